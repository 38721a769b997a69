//! Connecting to Redis: the one place a Redis address is parsed, a connection
//! or a pool is opened, and a Redis error is made fit to print (passwords
//! redacted, one line). An address names the data node itself (`redis://`,
//! `rediss://`) or the Sentinels that name the current primary
//! (`redis+sentinel://`, `rediss+sentinel://`); either way the rest of the
//! code gets one connection type and one pool type.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use deadpool_redis::sentinel::{SentinelNodeConnectionInfo, SentinelServerType, TlsMode};
use futures_util::StreamExt;
use percent_encoding::percent_decode_str;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{Cmd, ErrorKind, IntoConnectionInfo, Pipeline, RedisFuture, ServerErrorKind, Value};

use crate::redact::{PERCENT_ENCODE, redact, scrub};

/// How long a command-line tool waits for Redis to answer before giving up
/// (for each Sentinel in turn, with a Sentinel address).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest wait for a free pooled connection, and (Sentinels) for a new one.
const POOL_WAIT: Duration = Duration::from_secs(5);

/// The port of a Sentinel address that names none.
pub const SENTINEL_PORT: u16 = 26379;

#[derive(Debug, Clone, thiserror::Error)]
pub enum RedisError {
    /// The address is not a Redis URL, or Redis refused or failed.
    #[error("Redis {url}: {cause}")]
    Failed { url: String, cause: String },
    /// Redis did not answer within [`CONNECT_TIMEOUT`].
    #[error("Redis {url}: no answer within 5 s")]
    Timeout { url: String },
}

/// Where Redis is.
///
/// - `redis://[[user]:password@]host[:port][/db]`, or `rediss://…` for TLS
///   (`#insecure` skips verification): the data node itself.
/// - `redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service_name[/db]`
///   `[?sentinel_username=…&sentinel_password=…]`: the Sentinels (port
///   [`SENTINEL_PORT`] unless given; IPv6 as `[addr]:port`) that name the
///   primary of `service_name`. The userinfo and `db` are the primary's; the
///   Sentinels' own credentials are the query parameters, because Sentinels
///   and data nodes usually have different passwords (a Sentinel's is its
///   `requirepass`, not the data nodes'). Components are percent-decoded.
/// - `rediss+sentinel://…`: TLS to the Sentinels and to the primary, both
///   verified like `rediss://` (the primary against the address the Sentinels
///   announce, an IP unless they announce hostnames); `#insecure` skips both
///   verifications.
///
/// Passwords never appear in [`fmt::Display`], [`fmt::Debug`] or any error.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTarget {
    url: String,
    sentinels: Option<Sentinels>,
}

/// A parsed `redis+sentinel://` address.
#[derive(Clone, PartialEq, Eq)]
struct Sentinels {
    tls: Tls,
    nodes: Vec<Node>,
    service: String,
    db: i64,
    username: Option<String>,
    password: Option<String>,
    sentinel_username: Option<String>,
    sentinel_password: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tls {
    Off,
    Verified,
    Insecure,
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct Node {
    host: String,
    port: u16,
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

const SENTINEL_SCHEME: &str = "redis+sentinel://";
const SENTINEL_TLS_SCHEME: &str = "rediss+sentinel://";
const PARAMETERS: &str = "sentinel_username, sentinel_password";

impl Sentinels {
    /// Parses a `redis+sentinel://` or `rediss+sentinel://` URL; the error
    /// names the problem in one line and never quotes a password.
    fn parse(url: &str) -> Result<Self, String> {
        let (tls, rest) = if let Some(rest) = url.strip_prefix(SENTINEL_SCHEME) {
            (Tls::Off, rest)
        } else if let Some(rest) = url.strip_prefix(SENTINEL_TLS_SCHEME) {
            (Tls::Verified, rest)
        } else {
            return Err("not a redis+sentinel:// or rediss+sentinel:// URL".into());
        };
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (tail, fragment) = match tail.split_once('#') {
            Some((tail, fragment)) => (tail, Some(fragment)),
            None => (tail, None),
        };
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(userinfo) => match userinfo.split_once(':') {
                Some((user, password)) => (decoded(user)?, decoded(password)?),
                None => (decoded(userinfo)?, None),
            },
        };
        if username.is_some() && password.is_none() {
            return Err("the primary's username has no password (user:password@)".into());
        }
        let nodes = parse_nodes(hosts)?;
        let (service, db) = parse_path(path)?;
        let (sentinel_username, sentinel_password) = parse_query(query)?;
        let tls = match (tls, fragment) {
            (tls, None) => tls,
            (Tls::Verified, Some("insecure")) => Tls::Insecure,
            (_, Some("insecure")) => {
                return Err("`#insecure` is for rediss+sentinel:// (TLS) only".into());
            }
            (_, Some(other)) => {
                return Err(format!(
                    "unknown fragment `#{other}` (only `#insecure`, with rediss+sentinel://)"
                ));
            }
        };
        Ok(Self {
            tls,
            nodes,
            service,
            db,
            username,
            password,
            sentinel_username,
            sentinel_password,
        })
    }

    /// How to reach each Sentinel: its address, TLS and the Sentinels' credentials.
    fn sentinel_infos(&self) -> redis::RedisResult<Vec<redis::ConnectionInfo>> {
        let (scheme, fragment) = match self.tls {
            Tls::Off => ("redis", ""),
            Tls::Verified => ("rediss", ""),
            Tls::Insecure => ("rediss", "#insecure"),
        };
        self.nodes
            .iter()
            .map(|node| {
                let info = format!("{scheme}://{node}/{fragment}").into_connection_info()?;
                let mut auth = redis::RedisConnectionInfo::default();
                if let Some(user) = &self.sentinel_username {
                    auth = auth.set_username(user);
                }
                if let Some(password) = &self.sentinel_password {
                    auth = auth.set_password(password);
                }
                Ok(info.set_redis_settings(auth))
            })
            .collect()
    }

    /// How to reach the primary the Sentinels name: TLS, its credentials and database.
    fn primary_info(&self) -> SentinelNodeConnectionInfo {
        SentinelNodeConnectionInfo {
            tls_mode: match self.tls {
                Tls::Off => None,
                Tls::Verified => Some(TlsMode::Secure),
                Tls::Insecure => Some(TlsMode::Insecure),
            },
            redis_connection_info: Some(deadpool_redis::RedisConnectionInfo {
                db: self.db,
                username: self.username.clone(),
                password: self.password.clone(),
                protocol: deadpool_redis::ProtocolVersion::default(),
            }),
        }
    }

    /// A client that asks only `sentinel` for the primary.
    fn client(&self, sentinel: redis::ConnectionInfo) -> redis::RedisResult<SentinelClient> {
        SentinelClient::build(
            vec![sentinel],
            &self.service,
            Some(self.primary_info().into()),
            redis::sentinel::SentinelServerType::Master,
        )
    }
}

fn decoded(text: &str) -> Result<Option<String>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    percent_decode_str(text)
        .decode_utf8()
        .map(|s| Some(s.into_owned()))
        .map_err(|_| "a percent-encoded part of the URL is not UTF-8".to_owned())
}

fn parse_nodes(hosts: &str) -> Result<Vec<Node>, String> {
    if hosts.is_empty() {
        return Err("no Sentinel address (host[:port][,host[:port]…])".into());
    }
    hosts.split(',').map(parse_node).collect()
}

fn parse_node(address: &str) -> Result<Node, String> {
    let (host, port) = if let Some(bracketed) = address.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| format!("Sentinel address `{address}` has no closing `]`"))?;
        match after {
            "" => (host, None),
            _ => match after.strip_prefix(':') {
                Some(port) => (host, Some(port)),
                None => return Err(format!("Sentinel address `{address}`: junk after `]`")),
            },
        }
    } else {
        match address.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (address, None),
        }
    };
    if host.is_empty() {
        return Err(if address.is_empty() {
            "an empty Sentinel address in the list (two commas, or a trailing one)".into()
        } else {
            format!("Sentinel address `{address}` has no host")
        });
    }
    if host.contains(|c: char| c.is_whitespace() || c == '@') {
        return Err(format!("Sentinel host `{host}` is not a host name"));
    }
    let port = match port {
        None => SENTINEL_PORT,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("Sentinel port `{port}` is not a port number (1-65535)"))?,
    };
    Ok(Node {
        host: host.to_owned(),
        port,
    })
}

fn parse_path(path: &str) -> Result<(String, i64), String> {
    let mut segments = path.strip_prefix('/').unwrap_or(path).split('/');
    let service = segments.next().and_then(|s| decoded(s).transpose());
    let Some(service) = service.transpose()? else {
        return Err("no service name: the path names the primary (`/mymaster`)".into());
    };
    let db = match segments.next() {
        None => 0,
        Some(db) => db
            .parse::<i64>()
            .ok()
            .filter(|&db| db >= 0)
            .ok_or_else(|| format!("database `{db}` is not a database number"))?,
    };
    if segments.next().is_some() {
        return Err("too many path segments (expected /service_name[/db])".into());
    }
    Ok((service, db))
}

type Credentials = (Option<String>, Option<String>);

fn parse_query(query: Option<&str>) -> Result<Credentials, String> {
    let (mut username, mut password) = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let Some((name, value)) = pair.split_once('=') else {
            return Err("a query parameter has no value (name=value)".into());
        };
        let slot = match name {
            "sentinel_username" => &mut username,
            "sentinel_password" => &mut password,
            other => {
                return Err(format!(
                    "unknown query parameter `{other}` (known: {PARAMETERS})"
                ));
            }
        };
        if slot.is_some() {
            return Err(format!("query parameter `{name}` given twice"));
        }
        *slot = Some(decoded(value)?.ok_or_else(|| format!("`{name}` is empty"))?);
    }
    if username.is_some() && password.is_none() {
        return Err("sentinel_username has no sentinel_password".into());
    }
    Ok((username, password))
}

fn is_sentinel_url(url: &str) -> bool {
    url.starts_with(SENTINEL_SCHEME) || url.starts_with(SENTINEL_TLS_SCHEME)
}

impl RedisTarget {
    /// Checks that `url` is a Redis URL the client understands, or a
    /// Sentinel URL (see [`RedisTarget`]) that parses.
    pub fn parse(url: &str) -> Result<Self, RedisError> {
        let mut target = Self {
            url: url.to_owned(),
            sentinels: None,
        };
        if is_sentinel_url(url) {
            // The problem never quotes a password (and scrubbing a short one
            // would blank its letters all over the sentence).
            let sentinels = Sentinels::parse(url).map_err(|problem| RedisError::Failed {
                url: target.to_string(),
                cause: problem,
            })?;
            target.sentinels = Some(sentinels);
        } else if let Err(e) = redis::Client::open(url) {
            return Err(match e.kind() {
                ErrorKind::InvalidClientConfig => RedisError::Failed {
                    url: target.to_string(),
                    cause: url_problem(url, &target.scrub(&e.to_string())),
                },
                _ => target.error(&e),
            });
        }
        Ok(target)
    }

    /// The URL as given (with its passwords: for clients only, never for
    /// output). A Sentinel URL is understood by [`Self::connect`] and
    /// [`Self::pool`] only, not by `redis::Client::open`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether the primary is found through Sentinels.
    pub fn is_sentinel(&self) -> bool {
        self.sentinels.is_some()
    }

    /// `text` with every password of the address blanked out.
    pub fn scrub(&self, text: &str) -> String {
        scrub(text, &self.url)
    }

    /// A Redis error as [`RedisError::Failed`]: this address, redacted, and the
    /// error's text with the passwords blanked out.
    pub fn error(&self, e: &redis::RedisError) -> RedisError {
        self.failed(&e.to_string())
    }

    fn failed(&self, cause: &str) -> RedisError {
        RedisError::Failed {
            url: self.to_string(),
            cause: one_line(&self.scrub(cause)),
        }
    }

    /// One multiplexed connection to the primary, within [`CONNECT_TIMEOUT`]
    /// (with Sentinels: asking each in turn, within [`CONNECT_TIMEOUT`] each).
    pub async fn connect(&self) -> Result<MultiplexedConnection, RedisError> {
        if let Some(sentinels) = &self.sentinels {
            return self.connect_through(sentinels).await;
        }
        let connect = async {
            redis::Client::open(self.url.as_str())
                .map_err(|e| self.error(&e))?
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| self.error(&e))
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::Timeout {
                url: self.to_string(),
            }),
        }
    }

    async fn connect_through(
        &self,
        sentinels: &Sentinels,
    ) -> Result<MultiplexedConnection, RedisError> {
        let infos = sentinels.sentinel_infos().map_err(|e| self.error(&e))?;
        let mut tried = Vec::with_capacity(infos.len());
        for (node, info) in sentinels.nodes.iter().zip(infos) {
            let attempt = async { sentinels.client(info)?.get_async_connection().await };
            match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(e)) => tried.push(format!("{node} ({e})")),
                Err(_) => tried.push(format!("{node} (no answer within 5 s)")),
            }
        }
        Err(self.failed(&format!(
            "no Sentinel named a reachable primary of `{}`; tried {}",
            sentinels.service,
            tried.join(", ")
        )))
    }

    /// A pool of at most `size` connections to the primary (opened when first
    /// asked for; with Sentinels, each new connection asks them where the
    /// primary is).
    pub fn pool(&self, size: usize) -> Result<RedisPool, RedisError> {
        let mut pool = deadpool_redis::PoolConfig::new(size.max(1));
        // A checkout that cannot be served in time fails like an outage (and
        // is retried) instead of waiting forever.
        pool.timeouts.wait = Some(POOL_WAIT);
        let Some(sentinels) = &self.sentinels else {
            let mut config = deadpool_redis::Config::from_url(self.url.as_str());
            config.pool = Some(pool);
            return config
                .create_pool(Some(deadpool_redis::Runtime::Tokio1))
                .map(|pool| RedisPool(Pools::Direct(pool)))
                .map_err(|e| self.failed(&e.to_string()));
        };
        // A lookup asks the Sentinels one after another: bounded like a wait.
        pool.timeouts.create = Some(POOL_WAIT);
        let manager = deadpool_redis::sentinel::Manager::new(
            sentinels.sentinel_infos().map_err(|e| self.error(&e))?,
            sentinels.service.clone(),
            Some(sentinels.primary_info()),
            SentinelServerType::Master,
        )
        .map_err(|e| self.error(&e))?;
        let pool = deadpool_redis::sentinel::Pool::builder(manager)
            .config(pool)
            .runtime(deadpool_redis::Runtime::Tokio1)
            .build()
            .map_err(|e| self.failed(&e.to_string()))?;
        let failovers = Arc::new(Failovers::default());
        let watchers = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => sentinels
                .sentinel_infos()
                .map_err(|e| self.error(&e))?
                .into_iter()
                .map(|sentinel| {
                    let watch = watch_failovers(
                        sentinel,
                        sentinels.service.clone(),
                        failovers.clone(),
                        pool.clone(),
                    );
                    AbortOnDrop(runtime.spawn(watch))
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        Ok(RedisPool(Pools::Sentinel {
            pool,
            failovers,
            _watchers: Arc::new(watchers),
        }))
    }
}

/// Longest pause of new connections while the Sentinels promote a replica,
/// in case their announcement of the end is missed.
const PROMOTION_FENCE: Duration = Duration::from_secs(30);

/// What the Sentinels announced about the primary's failovers.
#[derive(Default)]
struct Failovers {
    /// Bumped when a promotion starts and when the primary switched: a
    /// connection made before is stale ([`PooledConnection::is_stale`]).
    switches: AtomicU64,
    /// While a replica is being promoted (from the leader's
    /// `+failover-state-send-slaveof-noone` to `+switch-master` or an abort):
    /// no new connection. The old primary still takes writes then (after a
    /// manual failover until the Sentinels convert it, seconds later), and
    /// every write it takes is lost; the new one is not named yet.
    fenced_until: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// The last event acted upon: every Sentinel announces the switch.
    last_event: std::sync::Mutex<String>,
}

impl Failovers {
    /// Whether this event is news (not the same one from another Sentinel).
    fn is_new(&self, channel: &str, payload: &str) -> bool {
        let event = format!("{channel} {payload}");
        match self.last_event.lock() {
            Ok(last) if *last == event => false,
            Ok(mut last) => {
                *last = event;
                true
            }
            Err(_) => true,
        }
    }

    fn fence(&self, until: Option<tokio::time::Instant>) {
        self.switches.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut fenced) = self.fenced_until.lock() {
            *fenced = until;
        }
    }

    fn is_fenced(&self) -> bool {
        self.fenced_until
            .lock()
            .ok()
            .and_then(|fenced| *fenced)
            .is_some_and(|until| tokio::time::Instant::now() < until)
    }
}

/// The Sentinel events a failover of the service is followed by.
const FAILOVER_EVENTS: [&str; 5] = [
    "+failover-state-send-slaveof-noone",
    "+switch-master",
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
];

/// Follows one Sentinel's announcements of `service`'s failovers (only the
/// leader of a failover announces its steps, so every Sentinel is
/// followed): a promotion starting fences new connections and makes the
/// current ones stale, the switch (or an abort) lifts the fence and makes
/// connections stale again, and empties the pool's idle ones.
async fn watch_failovers(
    sentinel: redis::ConnectionInfo,
    service: String,
    failovers: Arc<Failovers>,
    pool: deadpool_redis::sentinel::Pool,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let subscribed = async {
            let mut pubsub = redis::Client::open(sentinel.clone())?
                .get_async_pubsub()
                .await?;
            pubsub.subscribe(&FAILOVER_EVENTS[..]).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        if let Ok(Ok(mut pubsub)) = tokio::time::timeout(CONNECT_TIMEOUT, subscribed).await {
            backoff = Duration::from_millis(100);
            let mut messages = pubsub.on_message();
            while let Some(message) = messages.next().await {
                let Ok(payload) = message.get_payload::<String>() else {
                    continue;
                };
                let channel = message.get_channel_name();
                if event_service(&payload) != Some(service.as_str())
                    || !failovers.is_new(channel, &payload)
                {
                    continue;
                }
                match channel {
                    "+failover-state-send-slaveof-noone" => {
                        failovers.fence(Some(tokio::time::Instant::now() + PROMOTION_FENCE));
                        pool.retain(|_, _| false);
                        tracing::warn!(service = %service, event = %payload, "Redis Sentinels are promoting a replica: no Redis writes until they name it");
                    }
                    "+switch-master" => {
                        failovers.fence(None);
                        pool.retain(|_, _| false);
                        tracing::warn!(service = %service, event = %payload, "Redis Sentinels switched the primary: connections to the old one are dropped");
                    }
                    abort => {
                        failovers.fence(None);
                        tracing::warn!(service = %service, event = %abort, "Redis Sentinels aborted a failover");
                    }
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// The service a Sentinel event is about: `<service> <old ip> <old port> …`
/// (`+switch-master`), `<type> <name> <ip> <port> @ <service> <ip> <port>`
/// (a replica's event), or `master <service> <ip> <port>`.
fn event_service(payload: &str) -> Option<&str> {
    let words: Vec<&str> = payload.split(' ').collect();
    match words.iter().position(|w| *w == "@") {
        Some(at) => words.get(at + 1).copied(),
        None if words.first() == Some(&"master") => words.get(1).copied(),
        None => words.first().copied(),
    }
}

/// Ends the watcher with the last clone of its pool.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A pool of connections to the primary: the data node of a `redis://`
/// address, or the one the Sentinels name. Cloning shares the pool.
#[derive(Clone)]
pub struct RedisPool(Pools);

#[derive(Clone)]
enum Pools {
    Direct(deadpool_redis::Pool),
    Sentinel {
        pool: deadpool_redis::sentinel::Pool,
        failovers: Arc<Failovers>,
        /// One per Sentinel, ended with the last clone of the pool.
        _watchers: Arc<Vec<AbortOnDrop>>,
    },
}

impl RedisPool {
    /// A connection from the pool (a new one if none is idle), within the
    /// pool's wait.
    pub async fn get(&self) -> Result<PooledConnection, redis::RedisError> {
        let (object, switches) = match &self.0 {
            Pools::Direct(pool) => (Object::Direct(pool.get().await.map_err(pool_error)?), None),
            Pools::Sentinel {
                pool, failovers, ..
            } => {
                if failovers.is_fenced() {
                    return Err(redis::RedisError::from(std::io::Error::other(
                        "the Sentinels are promoting a replica to primary",
                    )));
                }
                let seen = failovers.switches.load(Ordering::Relaxed);
                let object = Object::Sentinel(pool.get().await.map_err(pool_error)?);
                (object, Some((failovers.clone(), seen)))
            }
        };
        let conn = match &object {
            Object::Direct(c) => MultiplexedConnection::clone(c),
            Object::Sentinel(c) => MultiplexedConnection::clone(c),
        };
        Ok(PooledConnection {
            conn,
            object: Some(object),
            discard: AtomicBool::new(false),
            switches,
        })
    }

    /// The connections the pool holds now, checked out or idle (detached
    /// ones no longer count): what a caller that shares connections checks
    /// its bound against.
    pub fn connections(&self) -> usize {
        match &self.0 {
            Pools::Direct(pool) => pool.status().size,
            Pools::Sentinel { pool, .. } => pool.status().size,
        }
    }
}

impl fmt::Debug for RedisPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, status) = match &self.0 {
            Pools::Direct(pool) => ("direct", pool.status()),
            Pools::Sentinel { pool, .. } => ("sentinel", pool.status()),
        };
        write!(f, "RedisPool({kind}, {status:?})")
    }
}

/// A connection checked out of a [`RedisPool`]; it goes back to the pool when
/// dropped, unless it failed in a way that says it is no good for the next
/// user: an I/O error, or a node that is no longer the primary
/// ([`is_not_primary`]). Such a connection is detached and closed instead,
/// so that the next checkout opens a new one (with Sentinels: to the primary
/// they name now). A recycled connection would only be PINGed, which a
/// demoted primary still answers.
pub struct PooledConnection {
    /// Shares the pooled connection (clones of a multiplexed connection do).
    conn: MultiplexedConnection,
    object: Option<Object>,
    discard: AtomicBool,
    /// With Sentinels: the pool's failovers, and their count of switches
    /// when this connection was checked out.
    switches: Option<(Arc<Failovers>, u64)>,
}

enum Object {
    Direct(deadpool_redis::Connection),
    Sentinel(deadpool_redis::sentinel::Connection),
}

impl PooledConnection {
    /// The connection itself, for callers that share it (each clone is the
    /// same connection). Errors on a clone are not seen here: report them
    /// with [`Self::discard`].
    pub fn shared(&self) -> MultiplexedConnection {
        self.conn.clone()
    }

    /// Never return this connection to the pool: it is closed when dropped.
    pub fn discard(&self) {
        self.discard.store(true, Ordering::Relaxed);
    }

    /// Whether the Sentinels started promoting a replica or switched the
    /// primary since this connection was checked out: it may lead to the old
    /// primary, and must not be used again (nor returned to the pool).
    pub fn is_stale(&self) -> bool {
        self.switches
            .as_ref()
            .is_some_and(|(failovers, seen)| failovers.switches.load(Ordering::Relaxed) != *seen)
    }

    /// An error for a request not sent because the connection is stale.
    fn refuse_stale(&self) -> Option<redis::RedisError> {
        self.is_stale().then(|| {
            self.discard();
            redis::RedisError::from(std::io::Error::other(
                "the Sentinels failed the primary over since this connection was made",
            ))
        })
    }

    /// Discards the connection if `result` says it is no good. A server's
    /// error reply arrives as a value (a caller's `query_async` turns it into
    /// an error afterwards), in a pipeline's or transaction's answer too.
    fn note(&self, result: Result<&[Value], &redis::RedisError>) {
        let failed = match result {
            Ok(values) => values.iter().any(refused),
            Err(e) => e.is_io_error() || e.is_unrecoverable_error() || is_not_primary(e),
        };
        if failed {
            self.discard();
        }
    }
}

/// Whether a reply is (or holds) a refusal as not the primary.
fn refused(value: &Value) -> bool {
    match value {
        Value::ServerError(e) => is_not_primary(&redis::RedisError::from(e.clone())),
        Value::Array(values) => values.iter().any(refused),
        _ => false,
    }
}

impl ConnectionLike for PooledConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            if let Some(stale) = self.refuse_stale() {
                return Err(stale);
            }
            let result = self.conn.req_packed_command(cmd).await;
            self.note(result.as_ref().map(std::slice::from_ref));
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            if let Some(stale) = self.refuse_stale() {
                return Err(stale);
            }
            let result = self.conn.req_packed_commands(cmd, offset, count).await;
            self.note(result.as_ref().map(Vec::as_slice));
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

impl Drop for PooledConnection {
    fn drop(&mut self) {
        if !self.discard.load(Ordering::Relaxed) && !self.is_stale() {
            return;
        }
        match self.object.take() {
            Some(Object::Direct(c)) => drop(deadpool_redis::Connection::take(c)),
            Some(Object::Sentinel(c)) => drop(deadpool_redis::sentinel::Connection::take(c)),
            None => {}
        }
    }
}

/// Whether `e` says that the node is not (or no longer) the primary: a
/// replica refusing a write (`READONLY`, also inside a script's error), one
/// that lost its primary (`MASTERDOWN`), or a primary cut off from its
/// replicas under `min-replicas-to-write` (`NOREPLICAS`, as an old primary
/// is after a failover). Such a connection must not be used again.
pub fn is_not_primary(e: &redis::RedisError) -> bool {
    if matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    ) {
        return true;
    }
    // Scripts wrap the refusal of their write in an error of their own, and
    // NOREPLICAS has no kind of its own in the client.
    let text = e.to_string();
    text.contains("READONLY") || text.contains("NOREPLICAS")
}

fn pool_error(e: deadpool_redis::PoolError) -> redis::RedisError {
    match e {
        deadpool_redis::PoolError::Backend(e) => e,
        other => redis::RedisError::from(std::io::Error::other(other.to_string())),
    }
}

impl Default for RedisTarget {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            sentinels: None,
        }
    }
}

impl FromStr for RedisTarget {
    type Err = RedisError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The URL with its passwords redacted.
impl fmt::Display for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.url))
    }
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisTarget({self})")
    }
}

/// What is wrong with a Redis URL the client refused, in words (the
/// client's own, `Redis URL did not parse`, says nothing of what).
fn url_problem(url: &str, client_says: &str) -> String {
    const SCHEMES: &str = "redis://, rediss://, redis+sentinel:// or rediss+sentinel://";
    let parsed = match reqwest::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(e) => return format!("not a URL ({e}); {PERCENT_ENCODE}"),
    };
    let scheme = parsed.scheme();
    if !matches!(
        scheme,
        "redis" | "rediss" | "valkey" | "valkeys" | "unix" | "redis+unix"
    ) {
        return format!("the scheme must be {SCHEMES}, not `{scheme}://`");
    }
    if parsed.host_str().is_none_or(str::is_empty) && !scheme.contains("unix") {
        return "no host (redis://[[user]:password@]host[:port][/db])".into();
    }
    let db = parsed.path().trim_matches('/');
    if !db.is_empty() && db.parse::<i64>().is_err() {
        return "the path must be a database number, `/N`".into();
    }
    let client_says = client_says.trim_start_matches("Redis URL did not parse");
    let client_says = client_says.trim_start_matches([' ', '-', ':']);
    match client_says {
        "" | "InvalidClientConfig" => format!("not a Redis URL; {PERCENT_ENCODE}"),
        words => format!("{words}; {PERCENT_ENCODE}"),
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_never_shown_with_their_password() {
        let target = RedisTarget::parse("redis://:s3cret@127.0.0.1:6379/2").unwrap();
        assert_eq!(target.to_string(), "redis://:***@127.0.0.1:6379/2");
        assert!(!format!("{target:?}").contains("s3cret"));
        assert_eq!(target.scrub("auth s3cret failed"), "auth *** failed");
        assert!(!target.is_sentinel());
        let bad = RedisTarget::parse("http://u:s3cret@h/")
            .unwrap_err()
            .to_string();
        assert!(bad.starts_with("Redis http://u:***@h/: "), "{bad}");
        assert!(!bad.contains("s3cret"), "{bad}");
        assert!(bad.contains("the scheme must be redis://"), "{bad}");
    }

    #[test]
    fn a_url_that_does_not_parse_says_why_and_never_shows_its_password() {
        for (url, shown, why) in [
            (
                "redis://:pa/ss@127.0.0.1:6390",
                "redis://***@127.0.0.1:6390",
                "percent-encode reserved characters",
            ),
            (
                "redis://:pa#ss@127.0.0.1:6390",
                "redis://***@127.0.0.1:6390",
                "percent-encode reserved characters",
            ),
            (
                "redis://127.0.0.1:6379/zero",
                "redis://127.0.0.1:6379/zero",
                "/N",
            ),
        ] {
            let e = RedisTarget::parse(url).map(|_| ()).unwrap_err().to_string();
            assert!(e.starts_with(&format!("Redis {shown}: ")), "{url}: {e}");
            assert!(e.contains(why), "{url}: {e}");
            assert!(!e.contains("pa/ss") && !e.contains("pa#ss"), "{e}");
            assert!(!e.contains("InvalidClientConfig"), "{e}");
        }
    }

    fn sentinels(url: &str) -> Sentinels {
        let target = RedisTarget::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(target.is_sentinel());
        target.sentinels.unwrap()
    }

    fn node(host: &str, port: u16) -> Node {
        Node {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn sentinel_urls_name_the_sentinels_the_service_and_the_primarys_database() {
        let s = sentinels("redis+sentinel://h1,h2:26380,[::1]:26381/mymaster");
        assert_eq!(
            s.nodes,
            [node("h1", 26379), node("h2", 26380), node("::1", 26381)]
        );
        assert_eq!((s.service.as_str(), s.db, s.tls), ("mymaster", 0, Tls::Off));
        assert_eq!(s.nodes[2].to_string(), "[::1]:26381");
        assert_eq!((s.username, s.password), (None, None));

        let s = sentinels("redis+sentinel://10.0.0.1:26379/cache/3");
        assert_eq!((s.service.as_str(), s.db), ("cache", 3));
        assert_eq!(
            sentinels("redis+sentinel://[::1]/m").nodes,
            [node("::1", 26379)]
        );
    }

    #[test]
    fn the_userinfo_is_the_primarys_and_the_query_the_sentinels_credentials() {
        let s = sentinels(
            "redis+sentinel://app:p%40ss@h/m/1?sentinel_username=sen&sentinel_password=s%26pw",
        );
        assert_eq!(s.username.as_deref(), Some("app"));
        assert_eq!(s.password.as_deref(), Some("p@ss"));
        assert_eq!(s.sentinel_username.as_deref(), Some("sen"));
        assert_eq!(s.sentinel_password.as_deref(), Some("s&pw"));
        let primary = s.primary_info().redis_connection_info.unwrap();
        assert_eq!(primary.password.as_deref(), Some("p@ss"));
        assert_eq!(primary.db, 1);
        let infos = s.sentinel_infos().unwrap();
        assert_eq!(infos[0].redis_settings().password(), Some("s&pw"));
        assert_eq!(infos[0].redis_settings().username(), Some("sen"));
        assert_eq!(
            infos[0].redis_settings().db(),
            0,
            "Sentinels have no databases"
        );

        let s = sentinels("redis+sentinel://:only@h/m?sentinel_password=x");
        assert_eq!((s.username, s.password.as_deref()), (None, Some("only")));
        assert_eq!(
            (s.sentinel_username, s.sentinel_password.as_deref()),
            (None, Some("x"))
        );
    }

    #[test]
    fn rediss_sentinel_means_tls_to_the_sentinels_and_the_primary() {
        let s = sentinels("rediss+sentinel://h/m");
        assert_eq!(s.tls, Tls::Verified);
        assert!(matches!(s.primary_info().tls_mode, Some(TlsMode::Secure)));
        let infos = s.sentinel_infos().unwrap();
        assert!(
            matches!(
                infos[0].addr(),
                redis::ConnectionAddr::TcpTls {
                    insecure: false,
                    ..
                }
            ),
            "{:?}",
            infos[0].addr()
        );
        let s = sentinels("rediss+sentinel://h/m#insecure");
        assert_eq!(s.tls, Tls::Insecure);
        assert!(matches!(s.primary_info().tls_mode, Some(TlsMode::Insecure)));
        let infos = s.sentinel_infos().unwrap();
        assert!(matches!(
            infos[0].addr(),
            redis::ConnectionAddr::TcpTls { insecure: true, .. }
        ));
        let plain = sentinels("redis+sentinel://h/m").sentinel_infos().unwrap();
        assert!(matches!(
            plain[0].addr(),
            redis::ConnectionAddr::Tcp(_, 26379)
        ));
    }

    #[test]
    fn malformed_sentinel_urls_fail_naming_the_problem_on_one_line() {
        let cases = [
            ("redis+sentinel:///m", "no Sentinel address"),
            ("redis+sentinel://h1,,h2/m", "an empty Sentinel address"),
            ("redis+sentinel://h1,/m", "an empty Sentinel address"),
            (
                "redis+sentinel://h:port/m",
                "Sentinel port `port` is not a port number",
            ),
            ("redis+sentinel://h:0/m", "Sentinel port `0`"),
            ("redis+sentinel://h:70000/m", "Sentinel port `70000`"),
            ("redis+sentinel://:1/m", "has no host"),
            ("redis+sentinel://[::1/m", "no closing `]`"),
            ("redis+sentinel://[::1]x/m", "junk after `]`"),
            ("redis+sentinel://h", "no service name"),
            ("redis+sentinel://h/", "no service name"),
            (
                "redis+sentinel://h/m/x",
                "database `x` is not a database number",
            ),
            ("redis+sentinel://h/m/-1", "database `-1`"),
            ("redis+sentinel://h/m/1/2", "too many path segments"),
            ("redis+sentinel://h/m?db=1", "unknown query parameter `db`"),
            ("redis+sentinel://h/m?sentinel_password", "has no value"),
            (
                "redis+sentinel://h/m?sentinel_password=",
                "`sentinel_password` is empty",
            ),
            (
                "redis+sentinel://h/m?sentinel_password=a&sentinel_password=b",
                "given twice",
            ),
            (
                "redis+sentinel://h/m?sentinel_username=u",
                "sentinel_username has no sentinel_password",
            ),
            ("redis+sentinel://app@h/m", "username has no password"),
            (
                "redis+sentinel://h/m#insecure",
                "`#insecure` is for rediss+sentinel://",
            ),
            ("rediss+sentinel://h/m#nope", "unknown fragment `#nope`"),
            ("redis+sentinel://u:%ff@h/m", "not UTF-8"),
        ];
        for (url, problem) in cases {
            let e = RedisTarget::parse(url)
                .map(|_| ())
                .expect_err(url)
                .to_string();
            assert!(e.contains(problem), "{url}: {e}");
            assert!(e.starts_with("Redis redis"), "{url}: {e}");
            assert!(!e.contains('\n'), "{url}: {e}");
        }
    }

    #[test]
    fn both_passwords_are_redacted_everywhere() {
        let url = "redis+sentinel://app:PrimaryPw@h1,h2/m/2?sentinel_username=s&sentinel_password=SentinelPw";
        let target = RedisTarget::parse(url).unwrap();
        let shown = target.to_string();
        assert_eq!(
            shown,
            "redis+sentinel://app:***@h1,h2/m/2?sentinel_username=s&sentinel_password=***"
        );
        let debug = format!("{target:?}");
        for secret in ["PrimaryPw", "SentinelPw"] {
            assert!(!debug.contains(secret), "{debug}");
        }
        assert_eq!(
            target.scrub("AUTH PrimaryPw then SentinelPw"),
            "AUTH *** then ***"
        );

        // Malformed, with both passwords (one percent-encoded): still redacted.
        let bad = "rediss+sentinel://u:Pw%21x@h:bad/m?sentinel_password=Sen%21tinel#insecure";
        let e = RedisTarget::parse(bad).map(|_| ()).unwrap_err().to_string();
        for secret in ["Pw%21x", "Pw!x", "Sen%21tinel", "Sen!tinel"] {
            assert!(!e.contains(secret), "{e}");
        }
        assert!(e.contains("sentinel_password=***#insecure"), "{e}");
        let short = RedisTarget::parse("redis+sentinel://:S@h,/m?sentinel_password=e")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            short
                .ends_with("an empty Sentinel address in the list (two commas, or a trailing one)"),
            "{short}"
        );
        assert_eq!(
            scrub("decoded Pw!x and Sen!tinel", bad),
            "decoded *** and ***"
        );
    }

    fn reply_error(reply: &str) -> redis::RedisError {
        redis::parse_redis_value(format!("{reply}\r\n").as_bytes())
            .and_then(Value::extract_error)
            .map(|v| panic!("{reply} parsed as {v:?}"))
            .unwrap_or_else(|e| e)
    }

    #[test]
    fn refusals_as_not_the_primary_are_recognised() {
        for reply in [
            "-READONLY You can't write against a read only replica.",
            "-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "-NOREPLICAS Not enough good replicas to write.",
            "-ERR Error running script (call to f_1): @user_script:1: -READONLY You can't write against a read only replica.",
        ] {
            assert!(is_not_primary(&reply_error(reply)), "{reply}");
        }
        for reply in [
            "-ERR unknown command",
            "-NOSCRIPT No matching script",
            "-WRONGTYPE x",
        ] {
            assert!(!is_not_primary(&reply_error(reply)), "{reply}");
        }
        let values = [
            Value::Okay,
            Value::ServerError(match redis::parse_redis_value(b"-READONLY no\r\n") {
                Ok(Value::ServerError(e)) => e,
                other => panic!("{other:?}"),
            }),
        ];
        assert!(values.iter().any(refused));
        assert!(!refused(&Value::Array(vec![Value::Okay, Value::Int(1)])));
        assert!(refused(&Value::Array(vec![Value::Okay, values[1].clone()])));
    }

    #[test]
    fn sentinel_events_name_their_service() {
        for (payload, service) in [
            ("mymaster 127.0.0.1 1 127.0.0.1 2", "mymaster"),
            ("slave 127.0.0.1:2 127.0.0.1 2 @ cache 127.0.0.1 1", "cache"),
            ("master orders 127.0.0.1 1", "orders"),
        ] {
            assert_eq!(event_service(payload), Some(service), "{payload}");
        }
    }

    #[tokio::test]
    async fn an_unreachable_set_of_sentinels_is_named_address_by_address() {
        let url = "redis+sentinel://:PrimaryPw@127.0.0.1:1,127.0.0.1:2/m?sentinel_password=SenPw";
        let target = RedisTarget::parse(url).unwrap();
        let e = target.connect().await.map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains("no Sentinel named a reachable primary of `m`; tried 127.0.0.1:1 (")
                && e.contains(", 127.0.0.1:2 ("),
            "{e}"
        );
        assert!(!e.contains("PrimaryPw") && !e.contains("SenPw"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        // The pool opens nothing until asked.
        target.pool(2).unwrap();
    }
}
