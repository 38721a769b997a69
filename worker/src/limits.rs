//! What the broker and the process allow a worker of so many shards, checked
//! at start: a worker over a limit refuses in one line, instead of failing
//! part-way — a channel refused at the 2,047th shard would make the supervisor
//! reconnect for ever, a file descriptor short would fail some shard's broker
//! or Redis connect at random, long after the start looked fine.
//!
//! - **Channels.** The worker opens, per shard it consumes, one channel on its
//!   consume connection (the shard's consumer and its acks, `shard.rs`) and
//!   one confirm channel on its dead-letter connection (`settle/dead_letter.rs`
//!   publishes through it); the depth poll has a connection of its own.
//!   RabbitMQ allows `channel_max` channels per connection, 2,047 by default,
//!   so one worker consumes at most [`MAX_SHARDS_PER_WORKER`] shards (2,047). A fixed assignment above it is refused by `Config::validate`; an
//!   elastic member (`--assign auto`) is warned; the broker's negotiated
//!   `channel_max` is checked once connected ([`check_channel_max`]).
//! - **File descriptors.** The soft `RLIMIT_NOFILE` is raised to the hard one
//!   ([`raise_nofile`]), then the need ([`FileNeed`]) is compared with it: a
//!   hard limit below the need refuses the start, a soft one that could not be
//!   raised enough is a warning.

use std::fmt;

use shardline_connect::inbound::Inbound;

/// RabbitMQ's default `channel_max` (3.x and 4.x): channels per connection.
pub(crate) const BROKER_CHANNEL_MAX: usize = 2047;

/// The most shards one worker consumes under RabbitMQ's default
/// `channel_max`: one channel each on the consume connection, and one each on
/// the dead-letter connection. (The start-up checks run on connections of
/// their own; the depth poll has its own.)
pub(crate) const MAX_SHARDS_PER_WORKER: usize = BROKER_CHANNEL_MAX;

/// The longest worker name: it tags each consumer (`{name}/shard-{i}`, `i`
/// up to 4,095), and a consumer tag is an AMQP short string, 255 bytes at
/// most — a longer one fails every consume.
pub(crate) const WORKER_NAME_MAX: usize = 255 - "/shard-4095".len();

/// Channels a worker of `shards` shards holds on its consume connection (as
/// many as on its dead-letter connection).
pub(crate) fn consume_channels(shards: usize) -> usize {
    shards
}

/// A limit the worker would cross: it does not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// The broker allows fewer channels per connection than the shards need.
    #[error(
        "the broker allows {channel_max} channels per connection (`channel_max`) but this worker \
         needs {need} on its consume connection: one per shard ({shards}); give the worker fewer shards or raise `channel_max` in rabbitmq.conf"
    )]
    Channels {
        channel_max: u16,
        shards: usize,
        need: usize,
    },
    /// The hard `RLIMIT_NOFILE` is below the file descriptors the worker may need.
    #[error(
        "RLIMIT_NOFILE: the hard limit {hard} is below the {need} file descriptors this worker \
         may need ({formula}); raise it (`ulimit -Hn`, systemd `LimitNOFILE=`, the container's \
         `nofile` ulimit) or give the worker fewer shards"
    )]
    Files {
        hard: u64,
        need: u64,
        formula: FileNeed,
    },
}

/// Refuses when the broker's negotiated `channel_max` is below what `shards`
/// shards need on the consume connection (a broker configured below 2,047).
pub(crate) fn check_channel_max(channel_max: u16, shards: usize) -> Result<(), LimitError> {
    let need = consume_channels(shards);
    if usize::from(channel_max) >= need {
        return Ok(());
    }
    Err(LimitError::Channels {
        channel_max,
        shards,
        need,
    })
}

/// Redis connections a worker of `shards` shards holds: its pool of
/// `min(shards, 16)`. Shared with the Redis pool: the pool is sized by this,
/// and a change to either is a change to both.
pub(crate) fn redis_connections(shards: usize) -> usize {
    shards.min(16)
}

/// Broker connections at most: consume, dead letters, the depth gauges'
/// (`supervisor::poll_depths`), and the probe's own at start
/// (`probe::read_all`; a reconnect closes the old pair first).
const BROKER_CONNECTIONS: usize = 4;

/// Descriptors beyond the connections: the runtime's epoll and event fds,
/// DNS lookups, TLS roots read from files, `/proc` reads, the management
/// API's client, standard streams.
const SPARE_FILES: usize = 32;

/// The file descriptors a worker may need, term by term, so that a refusal
/// can show its sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileNeed {
    broker: usize,
    redis: usize,
    handler: usize,
    metrics: usize,
    spare: usize,
}

impl FileNeed {
    /// The need of a worker of `shards` shards whose handler holds
    /// `handler` connections with every call in flight, serving metrics
    /// under `metrics` or not: the port's cap of connections, the one
    /// accepted while an evicted one closes, its listener
    /// ([`Inbound::descriptors`]). The cap bounds what inbound sockets take,
    /// so they cannot starve the broker and Redis connections.
    pub(crate) fn of(shards: usize, handler: usize, metrics: Option<&Inbound>) -> Self {
        Self {
            broker: BROKER_CONNECTIONS,
            redis: redis_connections(shards),
            handler,
            metrics: metrics.map_or(0, Inbound::descriptors),
            spare: SPARE_FILES,
        }
    }

    pub(crate) fn total(&self) -> u64 {
        let sum = self.broker + self.redis + self.handler + self.metrics + self.spare;
        u64::try_from(sum).unwrap_or(u64::MAX)
    }
}

/// The sum as the logs show it: `4 broker + 16 Redis + 0 handler + 66 metrics + 32 spare = 118`.
impl fmt::Display for FileNeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} broker + {} Redis + {} handler + {} metrics + {} spare = {}",
            self.broker,
            self.redis,
            self.handler,
            self.metrics,
            self.spare,
            self.total()
        )
    }
}

/// The process's `RLIMIT_NOFILE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoFile {
    pub(crate) soft: u64,
    pub(crate) hard: u64,
}

/// What the worker does about its file descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Files {
    Enough,
    /// The soft limit is below the need and could not be raised: a warning,
    /// since the hard one would allow it (someone may raise it, or the
    /// worker may never use them all).
    Low {
        soft: u64,
    },
    /// Even the hard limit is below the need: the start is refused.
    Short {
        hard: u64,
    },
}

/// Judges `limit` (after the attempt to raise it) against `need`.
pub(crate) fn judge(need: &FileNeed, limit: NoFile) -> Files {
    let need = need.total();
    if limit.hard < need {
        Files::Short { hard: limit.hard }
    } else if limit.soft < need {
        Files::Low { soft: limit.soft }
    } else {
        Files::Enough
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard one and checks the result
/// against `need`: an error when the hard limit is too low, a warning when
/// only the soft one is and it could not be raised.
pub(crate) fn check_files(need: &FileNeed) -> Result<(), LimitError> {
    let limit = match raise_nofile() {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, need = %need, "cannot read or raise RLIMIT_NOFILE; not checked");
            return Ok(());
        }
    };
    match judge(need, limit) {
        Files::Enough => {
            tracing::debug!(soft = limit.soft, hard = limit.hard, need = %need, "RLIMIT_NOFILE");
            Ok(())
        }
        Files::Low { soft } => {
            tracing::warn!(
                "RLIMIT_NOFILE: the soft limit {soft} is below the {} file descriptors this worker \
                 may need ({need}) and could not be raised to the hard limit {}",
                need.total(),
                limit.hard
            );
            Ok(())
        }
        Files::Short { hard } => Err(LimitError::Files {
            hard,
            need: need.total(),
            formula: *need,
        }),
    }
}

/// A soft limit raised no higher than this when the hard one is unlimited:
/// Linux refuses more than `fs.nr_open`, 1,048,576 by default.
const UNLIMITED_RAISE: u64 = 1 << 20;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the default soft limit,
/// often 1,024, is a relic of `select()`, which the runtime does not use) and
/// returns the limits then in force. The workspace's one unsafe function.
#[allow(unsafe_code)]
fn raise_nofile() -> std::io::Result<NoFile> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live,
    // properly aligned local; it reads nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let target = if limit.rlim_max == libc::RLIM_INFINITY {
        UNLIMITED_RAISE.max(limit.rlim_cur)
    } else {
        limit.rlim_max
    };
    if limit.rlim_cur < target {
        let raised = libc::rlimit {
            rlim_cur: target,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` from a live local and changes
        // only this process's descriptor limit; a refusal is its return value.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) } == 0 {
            limit.rlim_cur = target;
        } else {
            tracing::debug!(error = %std::io::Error::last_os_error(), "cannot raise RLIMIT_NOFILE");
        }
    }
    Ok(NoFile {
        soft: limit.rlim_cur,
        hard: limit.rlim_max,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_is_the_default_channel_max() {
        assert_eq!(MAX_SHARDS_PER_WORKER, 2047);
        assert_eq!(consume_channels(MAX_SHARDS_PER_WORKER), BROKER_CHANNEL_MAX);
        assert_eq!(check_channel_max(2047, 2047), Ok(()));
        assert_eq!(check_channel_max(0xffff, 4096), Ok(()));
        let refused = check_channel_max(128, 200).unwrap_err();
        assert_eq!(
            refused,
            LimitError::Channels {
                channel_max: 128,
                shards: 200,
                need: 200
            }
        );
        let line = refused.to_string();
        assert!(
            line.contains("channel_max") && line.contains("200"),
            "{line}"
        );
        assert!(!line.contains('\n'), "{line}");
    }

    #[test]
    fn redis_connections_are_capped_at_sixteen() {
        assert_eq!(redis_connections(1), 1);
        assert_eq!(redis_connections(16), 16);
        assert_eq!(redis_connections(1024), 16);
    }

    #[test]
    fn the_need_adds_its_terms_and_shows_them() {
        let noop = FileNeed::of(1024, 0, None);
        assert_eq!(noop.total(), 4 + 16 + 32);
        let http = FileNeed::of(1024, 1024, Some(&Inbound::default()));
        assert_eq!(http.total(), 4 + 16 + 1024 + 66 + 32);
        assert_eq!(
            http.to_string(),
            "4 broker + 16 Redis + 1024 handler + 66 metrics + 32 spare = 1142"
        );
    }

    #[test]
    fn a_hard_limit_below_the_need_refuses_a_soft_one_warns() {
        let need = FileNeed::of(1024, 1024, Some(&Inbound::default()));
        let limit = |soft, hard| NoFile { soft, hard };
        assert_eq!(judge(&need, limit(4096, 4096)), Files::Enough);
        assert_eq!(judge(&need, limit(1142, 1142)), Files::Enough);
        assert_eq!(judge(&need, limit(1024, 4096)), Files::Low { soft: 1024 });
        assert_eq!(judge(&need, limit(1024, 1024)), Files::Short { hard: 1024 });
        let refusal = LimitError::Files {
            hard: 1024,
            need: need.total(),
            formula: need,
        }
        .to_string();
        assert!(
            refusal.starts_with("RLIMIT_NOFILE: the hard limit 1024"),
            "{refusal}"
        );
        assert!(refusal.contains("= 1142"), "{refusal}");
        assert!(!refusal.contains('\n'), "{refusal}");
    }
}
