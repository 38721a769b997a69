//! What the broker can do, read at start by every command, and what follows
//! from it: a safe behaviour, or a one-line refusal naming the problem and
//! the fix.
//!
//! AMQP 0-9-1 shows a client the server properties (product, version,
//! cluster name, capabilities) in `connection.start`, and nothing of the
//! node's settings or of the policies on a queue. lapin keeps the server
//! properties to itself, so [`server_info`] reads `connection.start` on a
//! connection of its own (TCP, TLS for `amqps://`, the protocol header; then
//! it hangs up before logging in). A queue's arguments are checked the only
//! way AMQP allows: a non-passive redeclare with the expected arguments
//! ([`crate::declare::check_queue_arguments`]); a passive declare ignores
//! every field but the name.
//!
//! [`assess`] is the decision table: the facts read ([`Facts`]) against what
//! the command is about to do ([`Plan`]), each finding with its source.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read as _, Write as _};
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};

use crate::broker::host_port;
use crate::management::{ManagementError, ManagementFacts, ManagementTarget, QueueFacts};
use shardline_contract::Names;
use shardline_contract::ShardCount;
use shardline_contract::rabbitmq::{QueueType, Version};

/// How long reading one node's server properties may take (TCP, TLS and the
/// first frame).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One node's `connection.start`: the server properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// Where it was read: `host:port`.
    pub address: String,
    /// `product` (`RabbitMQ`).
    pub product: String,
    /// `version` as the server gave it.
    pub version_text: String,
    pub version: Option<Version>,
    pub cluster_name: Option<String>,
    /// `capabilities`: the features the server announces, and whether on.
    pub capabilities: BTreeMap<String, bool>,
}

impl ServerInfo {
    /// The server properties of `connection.start`, as the server sent them.
    pub fn from_properties(address: &str, props: &FieldTable) -> Self {
        let text = |key: &str| match props.inner().get(key) {
            Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into()),
            Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_owned()),
            _ => None,
        };
        let capabilities = match props.inner().get("capabilities") {
            Some(AMQPValue::FieldTable(caps)) => caps
                .inner()
                .iter()
                .filter_map(|(k, v)| match v {
                    AMQPValue::Boolean(on) => Some((k.as_str().to_owned(), *on)),
                    _ => None,
                })
                .collect(),
            _ => BTreeMap::new(),
        };
        let version_text = text("version").unwrap_or_default();
        Self {
            address: address.to_owned(),
            product: text("product").unwrap_or_default(),
            version: Version::parse(&version_text),
            version_text,
            cluster_name: text("cluster_name"),
            capabilities,
        }
    }
}

/// Why a node's server properties could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("server properties of {address}: {cause}")]
pub struct ProbeError {
    pub address: String,
    pub cause: String,
}

/// Reads the server properties of the node at `url` (`amqp://` or
/// `amqps://`; TLS as lapin does it, trusting the same roots): connects,
/// sends the protocol header, reads `connection.start` and hangs up without
/// logging in (the broker logs a connection closed during the handshake).
pub async fn server_info(url: &str) -> Result<ServerInfo, ProbeError> {
    let address = host_port(url).to_owned();
    let owned = url.to_owned();
    let fail = |cause: String| ProbeError {
        address: address.clone(),
        cause: crate::scrub(&cause, url),
    };
    match tokio::task::spawn_blocking(move || read_start(&owned, PROBE_TIMEOUT)).await {
        Ok(Ok(props)) => Ok(ServerInfo::from_properties(&address, &props)),
        Ok(Err(cause)) => Err(fail(cause)),
        Err(e) => Err(fail(e.to_string())),
    }
}

/// The server properties of every address of `urls`, read at once (a node
/// that does not answer costs [`PROBE_TIMEOUT`], not a command's start).
pub async fn server_infos(urls: &[String]) -> Vec<Result<ServerInfo, ProbeError>> {
    futures_util::future::join_all(urls.iter().map(|url| server_info(url))).await
}

/// `connection.start`'s server properties, read over a blocking socket.
fn read_start(url: &str, timeout: Duration) -> Result<FieldTable, String> {
    use lapin::tcp::{TLSConfig, TcpStream};
    use lapin::uri::{AMQPScheme, AMQPUri};

    let uri: AMQPUri = url.parse().map_err(|e: String| e)?;
    let host = uri.authority.host.as_str();
    let io = |what: &str| {
        let what = what.to_owned();
        move |e: std::io::Error| format!("{what}: {e}")
    };
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, uri.authority.port))
        .map_err(io("resolving the host"))?
        .next()
        .ok_or_else(|| format!("`{host}` resolves to no address"))?;
    let stream = TcpStream::connect_timeout(addr, timeout).map_err(io("TCP connect"))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(io("socket"))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(io("socket"))?;
    let mut stream = match uri.scheme {
        AMQPScheme::AMQP => stream,
        AMQPScheme::AMQPS => stream
            .into_tls(host, TLSConfig::default())
            .map_err(|e| format!("TLS handshake: {e:?}"))?,
    };
    stream
        .write_all(b"AMQP\x00\x00\x09\x01")
        .map_err(io("sending the protocol header"))?;
    let mut header = [0u8; 7];
    stream
        .read_exact(&mut header)
        .map_err(io("reading connection.start"))?;
    parse_start(&header, |len| {
        let mut rest = vec![0u8; len];
        stream
            .read_exact(&mut rest)
            .map_err(io("reading connection.start"))?;
        Ok(rest)
    })
}

/// The largest `connection.start` frame read (RabbitMQ's is under 1 KiB).
const MAX_START_FRAME: usize = 128 * 1024;

/// Parses `connection.start` from its 7-byte frame header and, through
/// `rest(len)`, the `len` bytes that follow it (payload and frame end).
fn parse_start(
    header: &[u8; 7],
    rest: impl FnOnce(usize) -> Result<Vec<u8>, String>,
) -> Result<FieldTable, String> {
    if header.starts_with(b"AMQP") {
        return Err(format!(
            "the server does not speak AMQP 0-9-1 (it answered with protocol header {:?})",
            &header[4..]
        ));
    }
    let [kind, _, _, s0, s1, s2, s3] = *header;
    if kind != 1 {
        return Err(format!("expected a method frame, got frame type {kind}"));
    }
    let size = u32::from_be_bytes([s0, s1, s2, s3]) as usize;
    if size > MAX_START_FRAME {
        return Err(format!("connection.start of {size} bytes is too large"));
    }
    let frame = rest(size + 1)?;
    let (payload, end) = frame.split_at(size);
    if end != [0xCE] {
        return Err("the frame does not end with 0xCE".into());
    }
    let Some((method, args)) = payload.split_first_chunk::<6>() else {
        return Err("connection.start is too short".into());
    };
    if method[..4] != [0, 10, 0, 10] {
        return Err(format!(
            "expected connection.start (10, 10), got method {:?}",
            &method[..4]
        ));
    }
    match lapin::types::parsing::parse_field_table(args) {
        Ok((_, table)) => Ok(table),
        Err(e) => Err(format!("server properties: {e}")),
    }
}

/// Where a finding comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The server properties of these nodes (`connection.start`).
    ServerProperties(Vec<String>),
    /// A broker default for the version read: the node's own setting is not
    /// visible over AMQP.
    VersionDefault(Version),
    /// A redeclare of the shard queues with the arguments this command expects.
    Redeclare,
    /// The management API at this URL (password redacted).
    Management(String),
    /// This command's own settings.
    Flags,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ServerProperties(nodes) if nodes.is_empty() => {
                f.write_str("server properties (no node read)")
            }
            Self::ServerProperties(nodes) => {
                write!(f, "server properties of {}", nodes.join(", "))
            }
            Self::VersionDefault(v) => write!(
                f,
                "RabbitMQ {v}'s default; the node's own setting is not visible over AMQP"
            ),
            Self::Redeclare => f.write_str("redeclare of the shard queues"),
            Self::Management(url) => write!(f, "management API {url}"),
            Self::Flags => f.write_str("this command's flags"),
        }
    }
}

/// How a finding bears on the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    /// As it should be.
    Ok,
    /// Worth knowing; the command goes on.
    Warn,
    /// The command refuses to start.
    Refuse,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Refuse => "refuse",
        }
    }
}

/// One line of what the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// What it is about: `version`, `single-active-consumer`, …
    pub topic: &'static str,
    pub verdict: Verdict,
    /// What was found and, for a refusal, the fix.
    pub text: String,
    pub source: Source,
}

/// What the broker told us.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// The nodes read; a cluster in a rolling upgrade may run two versions.
    pub servers: Vec<ServerInfo>,
    /// Nodes whose server properties could not be read.
    pub unread: Vec<ProbeError>,
    /// What `--management-url` showed, when given and it answered.
    pub management: Option<ManagementFacts>,
    /// Why `--management-url` could not be read.
    pub management_error: Option<ManagementError>,
}

impl Facts {
    /// The lowest version among the nodes read (the one a rule must hold
    /// for); the management API's when no node's server properties were read.
    pub fn lowest_version(&self) -> Option<Version> {
        let servers = self.servers.iter().filter_map(|s| s.version).min();
        servers.or_else(|| self.management.as_ref().and_then(|m| m.version))
    }

    fn source(&self) -> Source {
        Source::ServerProperties(self.servers.iter().map(|s| s.address.clone()).collect())
    }
}

/// What the command is about to do, as far as the broker matters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub queue_type: QueueType,
    /// Consumers rely on `x-single-active-consumer` on classic shard queues.
    pub classic_single_active_consumer: bool,
    /// `--accept-classic-sac-risk`: single-active-consumer on classic queues
    /// although the broker has the bug that can stop the failover.
    pub accept_classic_sac_risk: bool,
    /// The largest body this command handles (the worker's
    /// `--max-body-bytes`: a dead letter carries its body).
    pub largest_body: Option<usize>,
    /// How long the worker may hold one event unacked (attempts, handler
    /// timeouts and backoff), against `consumer_timeout`.
    pub longest_hold: Option<Duration>,
    /// Quorum consumers: the `--delivery-limit` they count against (a
    /// policy's lower limit would dead-letter before them).
    pub delivery_limit: Option<u32>,
}

/// RabbitMQ's default `consumer_timeout` (from 3.8.15): a delivery unacked
/// longer than this closes its channel.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Room a dead letter needs above its event's body for the headers it gains.
const DEAD_LETTER_HEADROOM: usize = 64 * 1024;

/// The decision table: each rule's finding for `plan` on the broker of `facts`.
pub fn assess(facts: &Facts, plan: &Plan) -> Vec<Finding> {
    let version = facts.lowest_version();
    let mut findings = vec![version_finding(facts)];
    if plan.classic_single_active_consumer {
        findings.push(classic_sac(facts, version, plan.accept_classic_sac_risk));
    }
    findings.push(Finding {
        topic: "prefetch",
        verdict: Verdict::Ok,
        text: "per consumer (basic.qos global=false): unaffected by 4.3 denying global QoS".into(),
        source: Source::Flags,
    });
    if plan.queue_type == QueueType::Quorum
        && let Some(v) = version
    {
        findings.push(Finding {
            topic: "delivery-limit",
            verdict: Verdict::Ok,
            text: if v.quorum_limit_by_default() {
                "shard queues carry an explicit x-delivery-limit; the DLQ is declared with -1 (none): from 4.0 an absent limit means 20".into()
            } else {
                "shard queues carry an explicit x-delivery-limit; the DLQ has none (before 4.0 an absent limit is none)".into()
            },
            source: facts.source(),
        });
    }
    if let (Some(body), Some(v)) = (plan.largest_body, version) {
        findings.push(largest_message(body, v));
    }
    if let Some(hold) = plan.longest_hold {
        findings.push(consumer_timeout(hold, version));
    }
    findings.extend(policies(facts, plan));
    findings
}

/// The policies in effect on the shard queues and the DLQ, as the
/// management API shows them: a TTL or a length limit that drops would lose
/// events; a lower delivery limit would dead-letter before the worker does.
fn policies(facts: &Facts, plan: &Plan) -> Vec<Finding> {
    let Some(m) = &facts.management else {
        let text = match &facts.management_error {
            Some(e) => format!("not checked: {e}"),
            None => "not checked: policies are visible only through --management-url".into(),
        };
        return vec![Finding {
            topic: "policies",
            verdict: if facts.management_error.is_some() {
                Verdict::Warn
            } else {
                Verdict::Ok
            },
            text,
            source: Source::Flags,
        }];
    };
    let source = || Source::Management(m.address.clone());
    let mut found: Vec<Finding> = m
        .queues
        .iter()
        .filter_map(|q| queue_policy(q, plan).map(|(verdict, text)| (q, verdict, text)))
        .map(|(q, verdict, text)| Finding {
            topic: "policies",
            verdict,
            text: format!(
                "queue `{}` (policy `{}`): {text}",
                q.name,
                q.policy.as_deref().unwrap_or("-")
            ),
            source: source(),
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.verdict));
    if found.is_empty() {
        let with_policy = m.queues.iter().filter(|q| q.policy.is_some()).count();
        found.push(Finding {
            topic: "policies",
            verdict: Verdict::Ok,
            text: format!(
                "{} queues read, {with_policy} with a policy; none sets a TTL, a dropping length limit or a lower delivery limit",
                m.queues.len()
            ),
            source: source(),
        });
    }
    found
}

/// What one queue's policy means for us, when anything.
fn queue_policy(q: &QueueFacts, plan: &Plan) -> Option<(Verdict, String)> {
    let fix = "exclude the queue from the policy (its pattern) or remove those keys";
    for key in ["message-ttl", "expires"] {
        if let Some(ms) = q.policy_number(key) {
            return Some((
                Verdict::Refuse,
                format!(
                    "{key} {ms} ms: events would expire or the queue be deleted, unseen by the worker; {fix}"
                ),
            ));
        }
    }
    let limit = ["max-length", "max-length-bytes"]
        .into_iter()
        .find_map(|key| q.policy_number(key).map(|n| (key, n)));
    if let Some((key, n)) = limit {
        return Some(match q.overflow() {
            "drop-head" => (
                Verdict::Refuse,
                format!(
                    "{key} {n} with overflow drop-head: the broker would drop the oldest messages; {fix}, or set overflow reject-publish"
                ),
            ),
            overflow => (
                Verdict::Warn,
                format!(
                    "{key} {n} with overflow {overflow}: publishes past it are refused (publishers retry)"
                ),
            ),
        });
    }
    let policy_limit = q.policy_number("delivery-limit")?;
    let argument = q
        .arguments
        .get("x-delivery-limit")
        .and_then(serde_json::Value::as_i64);
    let effective = argument.map_or(policy_limit, |a| a.min(policy_limit));
    match plan.delivery_limit {
        Some(ours) if q.kind == "quorum" && effective < i64::from(ours) => Some((
            Verdict::Refuse,
            format!(
                "delivery-limit {effective} is below --delivery-limit {ours}: the broker would dead-letter events before the worker counts them; start the workers with --delivery-limit {effective} or raise the policy's"
            ),
        )),
        _ => Some((
            Verdict::Warn,
            format!(
                "delivery-limit {effective} set by the policy (the lower of policy and argument applies)"
            ),
        )),
    }
}

/// The broker's version, or why it is not known.
fn version_finding(facts: &Facts) -> Finding {
    let mut versions: Vec<String> = facts
        .servers
        .iter()
        .map(|s| format!("{} {}", s.product, s.version_text))
        .collect();
    versions.dedup();
    let cluster = facts
        .servers
        .iter()
        .find_map(|s| s.cluster_name.as_deref())
        .map(|c| format!(", cluster `{c}`"))
        .unwrap_or_default();
    let unread = match facts.unread.as_slice() {
        [] => String::new(),
        unread => format!(
            "; not read: {}",
            unread
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    let (verdict, text) = match (versions.as_slice(), facts.lowest_version()) {
        ([], Some(v)) => (
            Verdict::Ok,
            format!("RabbitMQ {v} (management API){cluster}{unread}"),
        ),
        ([], None) => (Verdict::Warn, format!("unknown{unread}")),
        ([one], Some(_)) => (Verdict::Ok, format!("{one}{cluster}{unread}")),
        (_, Some(low)) => (
            Verdict::Warn,
            format!(
                "mixed: {} (rules hold for the lowest, {low}){cluster}{unread}",
                versions.join(", ")
            ),
        ),
        (_, None) => (
            Verdict::Warn,
            format!("not a version: {}{unread}", versions.join(", ")),
        ),
    };
    Finding {
        topic: "version",
        verdict,
        text,
        source: facts.source(),
    }
}

/// Single-active-consumer on classic queues below 3.10.13 (3.11.5).
fn classic_sac(facts: &Facts, version: Option<Version>, accepted: bool) -> Finding {
    let risk = "classic-queue single-active-consumer can crash the queue when the active consumer changes, so that the standby never takes over (rabbitmq-server#5460, fixed in 3.10.13 and 3.11.5)";
    let (verdict, text) = match version {
        Some(v) if !v.has_classic_sac_bug() => (
            Verdict::Ok,
            format!("classic-queue single-active-consumer is safe on {v}"),
        ),
        Some(v) if accepted => (
            Verdict::Warn,
            format!("RabbitMQ {v}: {risk}; accepted with --accept-classic-sac-risk"),
        ),
        Some(v) => (
            Verdict::Refuse,
            format!(
                "RabbitMQ {v}: {risk}; upgrade the broker, use exclusive consumers (leave out --single-active-consumer) or quorum queues, or accept the risk with --accept-classic-sac-risk"
            ),
        ),
        None if accepted => (
            Verdict::Warn,
            format!(
                "broker version unknown, so {risk} cannot be ruled out; accepted with --accept-classic-sac-risk"
            ),
        ),
        None => (
            Verdict::Refuse,
            format!(
                "broker version unknown, so {risk} cannot be ruled out; leave out --single-active-consumer or accept the risk with --accept-classic-sac-risk"
            ),
        ),
    };
    Finding {
        topic: "single-active-consumer",
        verdict,
        text,
        source: facts.source(),
    }
}

/// A dead letter carries its event's body and some headers: it must fit
/// the broker's largest message.
fn largest_message(body: usize, version: Version) -> Finding {
    let max = version.default_max_message();
    let (verdict, text) = if body + DEAD_LETTER_HEADROOM > max {
        (
            Verdict::Refuse,
            format!(
                "--max-body-bytes {body} leaves no room for a dead letter's headers under the broker's largest message ({max} bytes): lower --max-body-bytes below {}",
                max - DEAD_LETTER_HEADROOM
            ),
        )
    } else {
        (
            Verdict::Ok,
            format!("bodies up to {body} bytes fit the largest message, {max} bytes"),
        )
    };
    Finding {
        topic: "largest-message",
        verdict,
        text,
        source: Source::VersionDefault(version),
    }
}

/// An event held unacked past `consumer_timeout` closes the channel: it is
/// redelivered (nothing lost), after the broker's timeout rather than ours.
fn consumer_timeout(hold: Duration, version: Option<Version>) -> Finding {
    let limit = DEFAULT_CONSUMER_TIMEOUT;
    let hold_text = humantime::format_duration(hold);
    let (verdict, text) = if hold > limit {
        (
            Verdict::Warn,
            format!(
                "an event may be held unacked for {hold_text} (attempts, timeouts and backoff), over the default consumer_timeout of 30m: past it the broker closes the channel and redelivers (nothing lost); raise consumer_timeout or lower --max-attempts/--retry-cap"
            ),
        )
    } else {
        (
            Verdict::Ok,
            format!(
                "an event is held unacked for at most {hold_text} in retries, under the default consumer_timeout of 30m (an open breaker holds it longer)"
            ),
        )
    };
    Finding {
        topic: "consumer-timeout",
        verdict,
        text,
        source: version.map_or(Source::Flags, Source::VersionDefault),
    }
}

/// The first refusal among `findings`, as one line.
pub fn refusal(findings: &[Finding]) -> Option<String> {
    findings
        .iter()
        .find(|f| f.verdict == Verdict::Refuse)
        .map(|f| format!("{}: {}", f.topic, f.text))
}

/// Reads the server properties of every address of `target` into [`Facts`].
pub async fn read_facts(target: &crate::AmqpTarget) -> Facts {
    let mut facts = Facts::default();
    for read in server_infos(target.addresses()).await {
        match read {
            Ok(info) => facts.servers.push(info),
            Err(e) => facts.unread.push(e),
        }
    }
    facts
}

/// [`read_facts`], and with a management API also the policies on the
/// shard queues and the DLQ of `names` (the vhost is `target`'s).
pub async fn read_all(
    target: &crate::AmqpTarget,
    management: Option<&ManagementTarget>,
    names: &Names,
    shards: ShardCount,
) -> Facts {
    let mut facts = read_facts(target).await;
    if let Some(api) = management {
        let mut queues: Vec<String> = shards.ids().map(|s| names.shard_queue(s)).collect();
        queues.push(names.dead_letter_queue.clone());
        match api.read(&target.vhost(), &queues).await {
            Ok(m) => facts.management = Some(m),
            Err(e) => facts.management_error = Some(e),
        }
    }
    facts
}

/// `findings` as log lines: refusals are the caller's to report.
pub fn log(findings: &[Finding]) {
    for f in findings {
        match f.verdict {
            Verdict::Ok => {
                tracing::debug!(topic = f.topic, source = %f.source, "broker probe: {}", f.text);
            }
            Verdict::Warn => {
                tracing::warn!(topic = f.topic, source = %f.source, "broker probe: {}", f.text);
            }
            Verdict::Refuse => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(version: &str) -> ServerInfo {
        ServerInfo {
            address: "127.0.0.1:5672".into(),
            product: "RabbitMQ".into(),
            version_text: version.into(),
            version: Version::parse(version),
            cluster_name: Some("rabbit@localhost".into()),
            capabilities: BTreeMap::new(),
        }
    }

    fn facts(versions: &[&str]) -> Facts {
        Facts {
            servers: versions.iter().map(|v| server(v)).collect(),
            ..Facts::default()
        }
    }

    fn sac(accept: bool) -> Plan {
        Plan {
            classic_single_active_consumer: true,
            accept_classic_sac_risk: accept,
            ..Plan::default()
        }
    }

    fn verdict_of(findings: &[Finding], topic: &str) -> Option<Verdict> {
        findings
            .iter()
            .find(|f| f.topic == topic)
            .map(|f| f.verdict)
    }

    #[test]
    fn classic_sac_is_refused_on_an_affected_broker_unless_accepted() {
        let refused = assess(&facts(&["3.10.8"]), &sac(false));
        assert_eq!(
            verdict_of(&refused, "single-active-consumer"),
            Some(Verdict::Refuse)
        );
        let line = refusal(&refused).unwrap();
        assert!(line.contains("3.10.8") && line.contains("#5460"), "{line}");
        assert!(line.contains("--accept-classic-sac-risk"), "{line}");
        assert!(!line.contains('\n'));

        let accepted = assess(&facts(&["3.10.8"]), &sac(true));
        assert_eq!(
            verdict_of(&accepted, "single-active-consumer"),
            Some(Verdict::Warn)
        );
        assert_eq!(refusal(&accepted), None);

        let fixed = assess(&facts(&["3.10.13"]), &sac(false));
        assert_eq!(
            verdict_of(&fixed, "single-active-consumer"),
            Some(Verdict::Ok)
        );
    }

    #[test]
    fn an_unknown_version_cannot_rule_the_bug_out() {
        let none = Facts {
            unread: vec![ProbeError {
                address: "h:5671".into(),
                cause: "TLS handshake".into(),
            }],
            ..Facts::default()
        };
        let findings = assess(&none, &sac(false));
        assert_eq!(verdict_of(&findings, "version"), Some(Verdict::Warn));
        let version = findings.iter().find(|f| f.topic == "version").unwrap();
        assert_eq!(
            version.source.to_string(),
            "server properties (no node read)"
        );
        assert!(refusal(&findings).unwrap().contains("version unknown"));
        assert_eq!(refusal(&assess(&none, &sac(true))), None);
    }

    #[test]
    fn a_mixed_cluster_is_held_to_its_lowest_version() {
        let mixed = facts(&["3.11.4", "3.12.1", "3.12.1"]);
        assert_eq!(mixed.lowest_version(), Some(Version::new(3, 11, 4)));
        let findings = assess(&mixed, &sac(false));
        assert_eq!(verdict_of(&findings, "version"), Some(Verdict::Warn));
        assert!(refusal(&findings).unwrap().contains("3.11.4"));
    }

    #[test]
    fn exclusive_consumers_and_quorum_queues_need_no_sac_rule() {
        let plain = assess(&facts(&["3.10.8"]), &Plan::default());
        assert_eq!(verdict_of(&plain, "single-active-consumer"), None);
        let quorum = Plan {
            queue_type: QueueType::Quorum,
            ..Plan::default()
        };
        let findings = assess(&facts(&["3.10.8"]), &quorum);
        assert_eq!(refusal(&findings), None);
        assert_eq!(verdict_of(&findings, "delivery-limit"), Some(Verdict::Ok));
    }

    #[test]
    fn the_largest_body_must_leave_room_for_a_dead_letter() {
        let plan = |body| Plan {
            largest_body: Some(body),
            ..Plan::default()
        };
        let mib = 1024 * 1024;
        assert_eq!(refusal(&assess(&facts(&["3.10.8"]), &plan(64 * mib))), None);
        let line = refusal(&assess(&facts(&["4.0.2"]), &plan(16 * mib))).unwrap();
        assert!(line.contains("--max-body-bytes"), "{line}");
        assert_eq!(refusal(&assess(&facts(&["4.0.2"]), &plan(mib))), None);
        let source = assess(&facts(&["4.0.2"]), &plan(mib))
            .into_iter()
            .find(|f| f.topic == "largest-message")
            .unwrap()
            .source;
        assert_eq!(source, Source::VersionDefault(Version::new(4, 0, 2)));
    }

    #[test]
    fn a_hold_past_the_consumer_timeout_is_a_warning() {
        let plan = |mins: u64| Plan {
            longest_hold: Some(Duration::from_secs(mins * 60)),
            ..Plan::default()
        };
        let long = assess(&facts(&["3.10.8"]), &plan(45));
        assert_eq!(verdict_of(&long, "consumer-timeout"), Some(Verdict::Warn));
        assert_eq!(refusal(&long), None);
        let short = assess(&facts(&["3.10.8"]), &plan(2));
        assert_eq!(verdict_of(&short, "consumer-timeout"), Some(Verdict::Ok));
    }

    fn with_policy(
        kind: &str,
        effective: serde_json::Value,
        arguments: serde_json::Value,
    ) -> Facts {
        Facts {
            management: Some(ManagementFacts {
                address: "http://guest:***@h:15672/".into(),
                version_text: "3.10.8".into(),
                version: Some(Version::new(3, 10, 8)),
                cluster_name: None,
                queues: vec![QueueFacts {
                    name: "order.events.shard.0".into(),
                    kind: kind.into(),
                    arguments: arguments.as_object().cloned().unwrap(),
                    policy: Some("shop-wide".into()),
                    effective: effective.as_object().cloned().unwrap(),
                }],
            }),
            ..Facts::default()
        }
    }

    #[test]
    fn policies_that_would_lose_events_are_refused() {
        use serde_json::json;
        let quorum = Plan {
            queue_type: QueueType::Quorum,
            delivery_limit: Some(20),
            ..Plan::default()
        };
        let refused = |facts: Facts| refusal(&assess(&facts, &quorum));
        let ttl = refused(with_policy(
            "quorum",
            json!({"message-ttl": 60000}),
            json!({}),
        ))
        .unwrap();
        assert!(
            ttl.contains("message-ttl 60000") && ttl.contains("`shop-wide`"),
            "{ttl}"
        );
        let drop = refused(with_policy(
            "classic",
            json!({"max-length": 100}),
            json!({}),
        ))
        .unwrap();
        assert!(drop.contains("drop-head"), "{drop}");
        // The topology's quorum queues carry x-overflow reject-publish: a
        // length limit then refuses publishes instead of dropping.
        let rejecting = with_policy(
            "quorum",
            json!({"max-length": 100}),
            json!({"x-overflow": "reject-publish"}),
        );
        let findings = assess(&rejecting, &quorum);
        assert_eq!(refusal(&findings), None);
        assert_eq!(verdict_of(&findings, "policies"), Some(Verdict::Warn));
        let low = refused(with_policy(
            "quorum",
            json!({"delivery-limit": 5}),
            json!({"x-delivery-limit": 20}),
        ))
        .unwrap();
        assert!(
            low.contains("delivery-limit 5 is below --delivery-limit 20"),
            "{low}"
        );
        let higher = with_policy(
            "quorum",
            json!({"delivery-limit": 50}),
            json!({"x-delivery-limit": 20}),
        );
        assert_eq!(refusal(&assess(&higher, &quorum)), None);
        let harmless = with_policy("quorum", json!({"ha-mode": "all"}), json!({}));
        let findings = assess(&harmless, &quorum);
        assert_eq!(verdict_of(&findings, "policies"), Some(Verdict::Ok));
        assert!(matches!(
            findings
                .iter()
                .find(|f| f.topic == "policies")
                .unwrap()
                .source,
            Source::Management(_)
        ));
    }

    #[test]
    fn without_the_management_api_policies_are_not_checked_and_it_says_so() {
        let findings = assess(&facts(&["3.10.8"]), &Plan::default());
        let f = findings.iter().find(|f| f.topic == "policies").unwrap();
        assert_eq!(f.verdict, Verdict::Ok);
        assert!(f.text.contains("--management-url"), "{}", f.text);
        let only_api = with_policy("quorum", serde_json::json!({}), serde_json::json!({}));
        assert_eq!(only_api.lowest_version(), Some(Version::new(3, 10, 8)));
        assert_eq!(
            verdict_of(&assess(&only_api, &Plan::default()), "version"),
            Some(Verdict::Ok)
        );
    }

    fn frame(payload: &[u8]) -> ([u8; 7], Vec<u8>) {
        let size = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let header = [1, 0, 0, size[0], size[1], size[2], size[3]];
        let mut rest = payload.to_vec();
        rest.push(0xCE);
        (header, rest)
    }

    /// A field table encoded by hand (the wire format of AMQP 0-9-1 §4.2.5.5):
    /// long strings (`S`), booleans (`t`) and nested tables (`F`).
    fn table(entries: &[(&str, Value)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (key, value) in entries {
            body.push(u8::try_from(key.len()).unwrap());
            body.extend(key.as_bytes());
            match value {
                Value::Text(s) => {
                    body.push(b'S');
                    body.extend(u32::try_from(s.len()).unwrap().to_be_bytes());
                    body.extend(s.as_bytes());
                }
                Value::Bool(b) => body.extend([b't', u8::from(*b)]),
                Value::Table(t) => {
                    body.push(b'F');
                    body.extend(t);
                }
            }
        }
        let mut out = u32::try_from(body.len()).unwrap().to_be_bytes().to_vec();
        out.extend(body);
        out
    }

    enum Value {
        Text(&'static str),
        Bool(bool),
        Table(Vec<u8>),
    }

    #[test]
    fn connection_start_yields_the_server_properties() {
        let caps = table(&[("per_consumer_qos", Value::Bool(true))]);
        let props = table(&[
            ("product", Value::Text("RabbitMQ")),
            ("version", Value::Text("3.10.8")),
            ("capabilities", Value::Table(caps)),
        ]);
        let mut payload = vec![0, 10, 0, 10, 0, 9];
        payload.extend(props);
        payload.extend(table(&[]));
        let (header, rest) = frame(&payload);
        let table = parse_start(&header, |len| {
            assert_eq!(len, rest.len());
            Ok(rest.clone())
        })
        .unwrap();
        let info = ServerInfo::from_properties("h:1", &table);
        assert_eq!(info.version, Some(Version::new(3, 10, 8)));
        assert_eq!(info.product, "RabbitMQ");
        assert_eq!(info.capabilities.get("per_consumer_qos"), Some(&true));
        assert_eq!(info.cluster_name, None);
    }

    #[test]
    fn a_bad_first_frame_is_named() {
        let header = *b"AMQP\x00\x00\x09\x01".first_chunk::<7>().unwrap();
        let err = parse_start(&header, |_| Ok(Vec::new())).unwrap_err();
        assert!(err.contains("AMQP 0-9-1"), "{err}");
        let (header, mut rest) = frame(&[0, 10, 0, 11, 0, 9, 0, 0, 0, 0]);
        let err = parse_start(&header, |_| Ok(rest.clone())).unwrap_err();
        assert!(err.contains("connection.start"), "{err}");
        rest.pop();
        rest.push(0);
        let err = parse_start(&header, |_| Ok(rest.clone())).unwrap_err();
        assert!(err.contains("0xCE"), "{err}");
    }
}
