//! What the contract depends on in the broker: the shard queues' type, and
//! the RabbitMQ versions whose defaults and bugs the probe's decision table
//! (`shardline_connect::probe`) and `topology apply` take into account.

use std::fmt;

/// Queue type of the shard queues (the dead-letter queue is quorum when they are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    #[default]
    Classic,
    /// Implies single-active-consumer: quorum queues ignore exclusive consumers.
    Quorum,
}

impl std::str::FromStr for QueueType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "classic" => Ok(Self::Classic),
            "quorum" => Ok(Self::Quorum),
            other => Err(format!("expected `classic` or `quorum`, got `{other}`")),
        }
    }
}

/// A RabbitMQ version, `major.minor.patch` (a pre-release or build suffix
/// is dropped: `4.0.0-rc.1` is 4.0.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Version {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// `text` as a version, when it starts like one.
    pub fn parse(text: &str) -> Option<Self> {
        let core = text.split(['-', '+', ' ']).next()?;
        let mut parts = core.split('.').map(str::parse::<u32>);
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = match parts.next() {
            Some(p) => p.ok()?,
            None => 0,
        };
        Some(Self::new(major, minor, patch))
    }

    /// Whether classic-queue single-active-consumer has the bug that can
    /// crash the queue when the active consumer changes, so that the standby
    /// never takes over (rabbitmq-server#5460; fixed in 3.10.13, 3.11.5 and
    /// 3.12.0).
    pub fn has_classic_sac_bug(self) -> bool {
        match (self.major, self.minor) {
            (3, 10) => self.patch < 13,
            (3, 11) => self.patch < 5,
            (3, m) => m < 10,
            (m, _) => m < 3,
        }
    }

    /// The largest message the broker takes by default (`max_message_size`):
    /// 128 MiB before 4.0, 16 MiB from 4.0.
    pub fn default_max_message(self) -> usize {
        if self.major >= 4 {
            16 * 1024 * 1024
        } else {
            128 * 1024 * 1024
        }
    }

    /// From 4.0 a quorum queue without `x-delivery-limit` has a limit of 20;
    /// `-1` asks for none. Before 4.0 an absent limit is none.
    pub fn quorum_limit_by_default(self) -> bool {
        self.major >= 4
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_with_and_without_suffixes() {
        assert_eq!(Version::parse("3.10.8"), Some(Version::new(3, 10, 8)));
        assert_eq!(Version::parse("4.0.0-rc.1"), Some(Version::new(4, 0, 0)));
        assert_eq!(
            Version::parse("3.13.7+1.g1234"),
            Some(Version::new(3, 13, 7))
        );
        assert_eq!(Version::parse("4.1"), Some(Version::new(4, 1, 0)));
        assert_eq!(Version::parse("master"), None);
        assert_eq!(Version::parse(""), None);
    }

    #[test]
    fn the_classic_sac_bug_is_in_every_version_before_its_fixes() {
        for (v, affected) in [
            ("3.8.30", true),
            ("3.9.29", true),
            ("3.10.8", true),
            ("3.10.12", true),
            ("3.10.13", false),
            ("3.11.4", true),
            ("3.11.5", false),
            ("3.12.0", false),
            ("3.13.7", false),
            ("4.0.5", false),
        ] {
            let version = Version::parse(v).unwrap();
            assert_eq!(version.has_classic_sac_bug(), affected, "{v}");
        }
    }
}
