//! Connecting to RabbitMQ. Every error names the URL with its password redacted.
//!
//! A connection goes to an [`AmqpTarget`]: one address or several (a cluster),
//! parsed once from the configured text and tried in turn, in a random order or
//! as listed ([`AddressOrder`]).

use std::fmt;
use std::io;
use std::str::FromStr;

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::LongString;
use lapin::{Connection, ConnectionProperties, ConnectionState, ErrorKind};
use rand::Rng;
use rand::seq::SliceRandom as _;

use crate::redact::{PERCENT_ENCODE, redact, scrub};

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to RabbitMQ at {url} (TCP connect, then AMQP handshake): {cause}")]
    Connect { url: String, cause: String },
    /// The configured address list is not one.
    #[error("RabbitMQ address `{given}`: {problem}")]
    Address { given: String, problem: String },
}

/// Where the broker is: one or more `amqp://` / `amqps://` URLs, each with its
/// own credentials, TLS host and vhost path.
///
/// Parsed from text that lists them separated by commas. A comma splits only
/// where the next address starts with `amqp://` or `amqps://`, since commas are
/// legal inside a URL's userinfo.
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpTarget {
    addresses: Vec<String>,
    order: AddressOrder,
}

/// In which order [`connect`] tries the addresses of a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AddressOrder {
    /// Shuffled on every connect, so that a fleet given one list spreads over
    /// a cluster's nodes.
    #[default]
    Random,
    /// As listed: the first address that answers, the others only when it
    /// does not (a preferred node with fallbacks).
    Given,
}

impl FromStr for AddressOrder {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(Self::Random),
            "given" => Ok(Self::Given),
            other => Err(format!("expected `random` or `given`, got `{other}`")),
        }
    }
}

impl fmt::Display for AddressOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Random => "random",
            Self::Given => "given",
        })
    }
}

impl AmqpTarget {
    /// The address list in `text`.
    pub fn parse(text: &str) -> Result<Self, BrokerError> {
        let problem = |problem: &str| BrokerError::Address {
            given: redact(text),
            problem: problem.to_owned(),
        };
        let mut addresses: Vec<String> = Vec::new();
        for piece in text.split(',') {
            let trimmed = piece.trim();
            let starts_address = trimmed.starts_with("amqp://") || trimmed.starts_with("amqps://");
            match addresses.last_mut() {
                Some(last) if !starts_address => {
                    last.push(',');
                    last.push_str(piece);
                }
                _ if starts_address => addresses.push(trimmed.to_owned()),
                _ => return Err(problem("each address must start with amqp:// or amqps://")),
            }
        }
        if addresses.is_empty() {
            return Err(problem("no address given"));
        }
        for address in &addresses {
            if let Err(e) = address.parse::<lapin::uri::AMQPUri>() {
                return Err(problem(&format!(
                    "{} does not parse ({}); {PERCENT_ENCODE}",
                    redact(address),
                    scrub(&e, address)
                )));
            }
        }
        Ok(Self {
            addresses,
            order: AddressOrder::default(),
        })
    }

    /// The same addresses, tried in `order`.
    #[must_use]
    pub fn with_order(mut self, order: AddressOrder) -> Self {
        self.order = order;
        self
    }

    /// The order [`connect`] tries the addresses in.
    pub fn order(&self) -> AddressOrder {
        self.order
    }

    /// The addresses in the order one connect tries them.
    fn attempt_order<R: Rng + ?Sized>(&self, rng: &mut R) -> Vec<&String> {
        let mut order: Vec<&String> = self.addresses.iter().collect();
        if self.order == AddressOrder::Random {
            order.shuffle(rng);
        }
        order
    }

    /// The addresses, in the order given.
    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    /// The first address (whose vhost and credentials tools report).
    pub fn primary(&self) -> &str {
        self.addresses.first().map_or("", String::as_str)
    }

    /// The vhost of the first address (its URL's path, decoded; `/` when
    /// there is none).
    pub fn vhost(&self) -> String {
        match self.primary().parse::<lapin::uri::AMQPUri>() {
            Ok(uri) => uri.vhost,
            Err(_) => "/".to_owned(),
        }
    }

    /// `text` with every address's password blanked out.
    pub fn scrub(&self, text: &str) -> String {
        self.addresses
            .iter()
            .fold(text.to_owned(), |text, url| scrub(&text, url))
    }
}

impl Default for AmqpTarget {
    fn default() -> Self {
        Self {
            addresses: vec!["amqp://guest:guest@127.0.0.1:5672/%2f".into()],
            order: AddressOrder::default(),
        }
    }
}

impl FromStr for AmqpTarget {
    type Err = BrokerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The addresses, comma-separated, passwords redacted.
impl fmt::Display for AmqpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<String> = self.addresses.iter().map(|a| redact(a)).collect();
        f.write_str(&shown.join(","))
    }
}

impl fmt::Debug for AmqpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AmqpTarget({self})")
    }
}

/// Opens a connection named `name` (shown as `connection_name` by `rabbitmqctl
/// list_connections` and the management UI, with the address it went to:
/// `name @ host:port`) to an address of `target` that answers: tried in a
/// random order, so that a fleet given one list spreads over its nodes, or in
/// the order listed ([`AddressOrder::Given`]). `amqps://` URLs use TLS.
pub async fn connect(target: &AmqpTarget, name: &str) -> Result<Connection, BrokerError> {
    let mut failures = Vec::new();
    let order = target.attempt_order(&mut rand::rng());
    for url in order {
        let named = match target.addresses.len() {
            1 => name.to_owned(),
            _ => format!("{name} @ {}", host_port(url)),
        };
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from(named.into_bytes()));
        let with_heartbeat = with_default_heartbeat(url);
        let connecting = Connection::connect(&with_heartbeat, props);
        match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => failures.push((redact(url), failure(&e, url))),
            Err(_) => failures.push((
                redact(url),
                format!(
                    "no AMQP handshake within {}s (a node that accepts TCP but does not answer: paused, overloaded?)",
                    CONNECT_TIMEOUT.as_secs()
                ),
            )),
        }
    }
    Err(match failures.as_slice() {
        [(url, cause)] => BrokerError::Connect {
            url: url.clone(),
            cause: cause.clone(),
        },
        _ => BrokerError::Connect {
            url: target.to_string(),
            cause: failures
                .iter()
                .map(|(url, cause)| format!("{url}: {cause}"))
                .collect::<Vec<_>>()
                .join("; "),
        },
    })
}

/// Why the broker hung up during the AMQP handshake, as far as a client can
/// tell: RabbitMQ closes the socket without a word when the first frames
/// break its rules. Before `connection.tune` a frame may be 4 KiB at most, so
/// a `connection.start-ok` whose client properties (the connection name among
/// them) are larger is cut off; a TLS client on a plain port, or a plain one
/// on a TLS port, never gets an AMQP frame; brokers and proxies that do not
/// honour `authentication_failure_close` drop a bad login, and some drop a
/// `connection.open` for a vhost that does not exist or that the user may not use.
pub const HANDSHAKE_CLOSED: &str = "the broker closed the connection during the AMQP handshake; \
     likely causes: client properties over 4 KiB (a long connection name), \
     amqps:// against a plain AMQP port or amqp:// against a TLS port, wrong credentials, \
     or a vhost that does not exist or that the user may not use";

/// Why a TLS client's handshake fails on data it cannot read: the rustls
/// error names a record type ("corrupt message of type InvalidContentType")
/// where the cause is the port or the certificate.
pub const TLS_FAILED: &str = "the TLS handshake failed; likely causes: amqps:// against a \
     plain AMQP port, or a broker certificate that does not verify (a private CA needs \
     SSL_CERT_FILE)";

/// A failed connect to `url` in words, its password scrubbed: a login the
/// broker refused says so and names the user (`ACCESS_REFUSED`), a port
/// nothing listens on says "connection refused"; the socket closed during
/// the handshake ([`HANDSHAKE_CLOSED`]) and a TLS handshake that read garbage
/// ([`TLS_FAILED`]) are explained, since the bare I/O error ("Connection
/// reset by peer") says nothing of why.
fn failure(error: &lapin::Error, url: &str) -> String {
    let text = scrub(&error.to_string(), url);
    if let Some(reply) = soft_error(error, AMQPSoftError::ACCESSREFUSED) {
        let reply = scrub(reply.trim_start_matches("ACCESS_REFUSED - "), url);
        format!(
            "ACCESS_REFUSED: the broker refused user {} ({reply})",
            user(url)
        )
    } else if is_io(error, io::ErrorKind::ConnectionRefused) {
        format!("connection refused: nothing listens at {}", host_port(url))
    } else if closed_during_handshake(error) {
        format!("{HANDSHAKE_CLOSED} ({text})")
    } else if url.starts_with("amqps://") && is_io(error, io::ErrorKind::InvalidData) {
        format!("{TLS_FAILED} ({text})")
    } else {
        text
    }
}

fn is_io(error: &lapin::Error, kind: io::ErrorKind) -> bool {
    matches!(error.kind(), ErrorKind::IOError(e) if e.kind() == kind)
}

/// Whether a connect's `error` is the broker closing an established socket
/// (reset, end of stream, or lapin's closed state) before the connection was
/// open. A refused TCP connect is not: nothing listened there.
fn closed_during_handshake(error: &lapin::Error) -> bool {
    match error.kind() {
        ErrorKind::IOError(e) => matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
                | io::ErrorKind::BrokenPipe
        ),
        ErrorKind::InvalidConnectionState(state) => {
            matches!(state, ConnectionState::Closed | ConnectionState::Error)
        }
        _ => false,
    }
}

/// One connection to each address of `target` that answers, in the order
/// given (a cluster's nodes, for declaring queues on each); an error only
/// when none answers (naming each failure), else a warning per address that
/// failed.
pub async fn connect_each(target: &AmqpTarget, name: &str) -> Result<Vec<Connection>, BrokerError> {
    let mut conns = Vec::with_capacity(target.addresses.len());
    let mut failed = Vec::new();
    for url in &target.addresses {
        let one = AmqpTarget {
            addresses: vec![url.clone()],
            order: AddressOrder::Given,
        };
        match connect(&one, &format!("{name} @ {}", host_port(url))).await {
            Ok(conn) => conns.push(conn),
            Err(e) => failed.push(e),
        }
    }
    if conns.is_empty() {
        // The caller reports them, in one line with no warning before it.
        return Err(match failed.len() {
            1 => failed.remove(0),
            _ => BrokerError::Connect {
                url: target.to_string(),
                cause: failed
                    .iter()
                    .map(|e| match e {
                        BrokerError::Connect { url, cause } => format!("{url}: {cause}"),
                        other => other.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
            },
        });
    }
    for e in failed {
        tracing::warn!(error = %e, "a broker address could not be connected to: nothing is declared through it");
    }
    Ok(conns)
}

/// Follows a connection's flow control: RabbitMQ blocks every publishing
/// connection while a memory or disk alarm is in effect (`connection.blocked`,
/// which lapin asks for). Logs the block and its end at once, and answers
/// whether the connection is blocked now (a publisher's confirm timeout stops
/// while it is: an alarm blocks every node, so another address would not help).
/// The watch ends with the value.
#[derive(Debug)]
pub struct BlockedWatch {
    reason: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl BlockedWatch {
    /// Watches `conn`; `who` names what waits in the log line (`load`'s
    /// publisher, the worker's dead letters).
    pub fn new(conn: &Connection, who: &str) -> Self {
        use futures_util::StreamExt as _;
        let reason = std::sync::Arc::new(std::sync::Mutex::new(None));
        let mut events = Box::pin(conn.events_listener());
        let (shared, who) = (reason.clone(), who.to_owned());
        let task = tokio::spawn(async move {
            while let Some(event) = events.next().await {
                let now = match event {
                    lapin::Event::ConnectionBlocked(reason) => {
                        tracing::warn!(reason = %reason, "broker blocked: {}; {who} waits until it clears", alarm(&reason));
                        Some(reason)
                    }
                    lapin::Event::ConnectionUnblocked => {
                        tracing::info!("broker unblocked: {who} goes on");
                        None
                    }
                    _ => continue,
                };
                if let Ok(mut blocked) = shared.lock() {
                    *blocked = now;
                }
            }
        });
        Self { reason, task }
    }

    /// The broker's reason while the connection is blocked.
    pub fn blocked(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

impl Drop for BlockedWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The alarm a `connection.blocked` reason names ("low on memory" → "memory alarm").
pub fn alarm(reason: &str) -> String {
    if reason.contains("memory") {
        "memory alarm".to_owned()
    } else if reason.contains("disk") {
        "disk alarm".to_owned()
    } else {
        format!("\"{reason}\"")
    }
}

/// How long one address may take to complete the TCP connect and the AMQP
/// handshake before the next is tried: a node that is paused (or hung)
/// accepts the TCP connection in the kernel and never answers.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The AMQP heartbeat asked for when the URL names none, in seconds: a peer
/// that vanishes without closing its TCP connection (a machine lost) is
/// noticed within about two of these, so that its exclusive consumers are
/// released in time for another member to take its shards (RabbitMQ would
/// otherwise negotiate 60 s).
pub const DEFAULT_HEARTBEAT_SECS: u16 = 5;

/// `url` with `heartbeat=` [`DEFAULT_HEARTBEAT_SECS`] unless it has one.
fn with_default_heartbeat(url: &str) -> String {
    if url.contains("heartbeat=") {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}heartbeat={DEFAULT_HEARTBEAT_SECS}")
}

/// The user an AMQP URL logs in as (`guest` when it names none, as lapin does).
fn user(url: &str) -> String {
    match url.parse::<lapin::uri::AMQPUri>() {
        Ok(uri) => uri.authority.userinfo.username,
        Err(_) => "guest".to_owned(),
    }
}

/// The `host:port` part of an AMQP URL (what a connection name shows).
pub(crate) fn host_port(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
}

/// The broker's reply text when `error` is a channel or connection error of `kind`.
pub fn soft_error(error: &lapin::Error, kind: AMQPSoftError) -> Option<String> {
    match error.kind() {
        ErrorKind::ProtocolError(e) if *e.kind() == AMQPErrorKind::Soft(kind) => {
            Some(e.get_message().to_string())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_is_asked_for_unless_the_url_names_one() {
        assert_eq!(
            with_default_heartbeat("amqp://h:5672/%2f"),
            "amqp://h:5672/%2f?heartbeat=5"
        );
        assert_eq!(
            with_default_heartbeat("amqps://h/v?frame_max=8192"),
            "amqps://h/v?frame_max=8192&heartbeat=5"
        );
        assert_eq!(
            with_default_heartbeat("amqp://h/?heartbeat=30"),
            "amqp://h/?heartbeat=30"
        );
    }

    #[test]
    fn address_lists_split_only_before_a_scheme() {
        let one = AmqpTarget::parse("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(one.addresses().len(), 1);
        assert_eq!(one.to_string(), "amqp://guest:***@127.0.0.1:5672/%2f");
        let two = AmqpTarget::parse("amqp://a:p,w@h1:5672/v, amqps://b:q@h2/v").unwrap();
        assert_eq!(
            two.addresses(),
            ["amqp://a:p,w@h1:5672/v", "amqps://b:q@h2/v"]
        );
        assert_eq!(two.primary(), "amqp://a:p,w@h1:5672/v");
        assert_eq!(two.to_string(), "amqp://a:***@h1:5672/v,amqps://b:***@h2/v");
        assert_eq!(two.scrub("x p,w q"), "x *** ***");
        assert!(AmqpTarget::parse("").is_err());
        let bad = AmqpTarget::parse("http://u:secret@h/")
            .unwrap_err()
            .to_string();
        assert!(bad.contains("amqp://") && !bad.contains("secret"), "{bad}");
        let raw = AmqpTarget::parse("amqp://guest:s3/cr#t?x@127.0.0.1:5672/%2f")
            .unwrap_err()
            .to_string();
        assert!(
            raw.contains("amqp://***@127.0.0.1:5672/%2f does not parse")
                && raw.contains("percent-encode")
                && !raw.contains("s3")
                && !raw.contains("cr#t"),
            "{raw}"
        );
    }

    #[test]
    fn addresses_are_tried_shuffled_by_default_and_as_listed_when_given() {
        use rand::SeedableRng as _;
        let three = AmqpTarget::parse("amqp://h1/v,amqp://h2/v,amqp://h3/v").unwrap();
        assert_eq!(three.order(), AddressOrder::Random);
        let listed: Vec<&String> = three.addresses().iter().collect();
        let mut firsts = std::collections::BTreeSet::new();
        for seed in 0..32 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut tried = three.attempt_order(&mut rng);
            firsts.insert(tried[0].clone());
            tried.sort();
            assert_eq!(tried, listed, "every address once (seed {seed})");
        }
        assert_eq!(firsts.len(), 3, "each address comes first for some seed");

        let given = three.clone().with_order(AddressOrder::Given);
        assert_eq!(given.addresses(), three.addresses());
        for seed in 0..32 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            assert_eq!(given.attempt_order(&mut rng), listed);
        }
        assert_eq!("given".parse(), Ok(AddressOrder::Given));
        assert_eq!("random".parse(), Ok(AddressOrder::Random));
        assert!("first".parse::<AddressOrder>().is_err());
        assert_eq!(AddressOrder::Given.to_string(), "given");
    }

    /// A local listener standing in for a broker: each accepted socket goes
    /// to `each`, in a task of its own. Returns a target at it (`scheme`,
    /// a password to keep out of errors) and its port.
    async fn stand_in<F, Fut>(
        scheme: &str,
        each: F,
    ) -> (AmqpTarget, u16, tokio::task::JoinHandle<()>)
    where
        F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(each(socket));
            }
        });
        let target =
            AmqpTarget::parse(&format!("{scheme}://u:secret@127.0.0.1:{port}/%2f")).unwrap();
        (target, port, task)
    }

    /// A node that accepts TCP and never speaks AMQP (paused, hung) costs one
    /// connect timeout, then the next address is tried.
    #[tokio::test]
    async fn a_silent_address_times_out_and_the_error_says_so() {
        let (target, _, held) = stand_in("amqp", |socket| async move {
            let _held = socket;
            std::future::pending::<()>().await;
        })
        .await;
        let started = std::time::Instant::now();
        let error = connect(&target, "test").await.unwrap_err().to_string();
        assert!(started.elapsed() >= CONNECT_TIMEOUT, "{error}");
        assert!(error.contains("no AMQP handshake within 10s"), "{error}");
        assert!(!error.contains("secret"), "{error}");
        held.abort();
    }

    /// A login the broker refuses (`connection.close` 403, as RabbitMQ
    /// sends with `authentication_failure_close`) is named as such, with
    /// the user and without the password.
    #[test]
    fn a_refused_login_says_access_refused_and_names_the_user() {
        use lapin::protocol::AMQPError;
        let url = "amqp://shop:secret@127.0.0.1:5672/%2f";
        let reply = "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN.";
        let kind = AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED);
        let error =
            lapin::Error::from(ErrorKind::ProtocolError(AMQPError::new(kind, reply.into())));
        assert_eq!(
            failure(&error, url),
            "ACCESS_REFUSED: the broker refused user shop (Login was refused using authentication mechanism PLAIN.)"
        );
        assert_eq!(user("amqp://127.0.0.1/%2f"), "guest");
    }

    /// A port nothing listens on: "connection refused", naming the address.
    #[tokio::test]
    async fn a_closed_port_says_connection_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let target = AmqpTarget::parse(&format!("amqp://u:secret@127.0.0.1:{port}/%2f")).unwrap();
        let error = connect_each(&target, "test").await.unwrap_err().to_string();
        assert_eq!(
            error,
            format!(
                "cannot connect to RabbitMQ at amqp://u:***@127.0.0.1:{port}/%2f (TCP connect, \
                 then AMQP handshake): connection refused: nothing listens at 127.0.0.1:{port}"
            )
        );
    }

    /// A listener that hangs up at once, as RabbitMQ does on a handshake it
    /// will not take: the error says where it broke and what usually breaks it.
    #[tokio::test]
    async fn a_hang_up_during_the_handshake_is_explained() {
        let (target, port, hanging_up) =
            stand_in("amqp", |socket| async move { drop(socket) }).await;
        let started = std::time::Instant::now();
        let error = connect(&target, "test").await.unwrap_err().to_string();
        assert!(started.elapsed() < CONNECT_TIMEOUT, "{error}");
        assert!(error.contains(HANDSHAKE_CLOSED), "{error}");
        assert!(
            error.starts_with(&format!(
                "cannot connect to RabbitMQ at amqp://u:***@127.0.0.1:{port}/%2f"
            )),
            "{error}"
        );
        assert!(!error.contains("secret"), "{error}");
        hanging_up.abort();
    }

    /// TLS to a plain AMQP port: the broker answers the ClientHello with its
    /// protocol header and hangs up, which rustls reads as a corrupt record.
    #[tokio::test]
    async fn tls_against_a_plain_port_is_explained() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (target, _, plain) = stand_in("amqps", |mut socket| async move {
            // Read the ClientHello first: unread data would make the close a
            // reset, which the client could see before the header.
            let _ = socket.read(&mut [0; 1024]).await;
            let _ = socket.write_all(b"AMQP\x00\x00\x09\x01").await;
            let _ = socket.shutdown().await;
            // Kept until the client lets go, so that it reads the header.
            let _ = socket.read(&mut [0; 1024]).await;
        })
        .await;
        let error = connect(&target, "test").await.unwrap_err().to_string();
        assert!(error.contains(TLS_FAILED), "{error}");
        assert!(!error.contains("secret"), "{error}");
        plain.abort();
    }

    #[test]
    fn only_a_socket_closed_once_open_is_a_broken_handshake() {
        let io = |kind| lapin::Error::from(io::Error::from(kind));
        assert!(closed_during_handshake(&io(io::ErrorKind::ConnectionReset)));
        assert!(closed_during_handshake(&io(
            io::ErrorKind::ConnectionAborted
        )));
        assert!(closed_during_handshake(&io(io::ErrorKind::UnexpectedEof)));
        assert!(!closed_during_handshake(&io(
            io::ErrorKind::ConnectionRefused
        )));
        assert!(!closed_during_handshake(&io(io::ErrorKind::TimedOut)));
        let closed: lapin::Error =
            ErrorKind::InvalidConnectionState(ConnectionState::Closed).into();
        assert!(closed_during_handshake(&closed));
        assert!(!closed_during_handshake(
            &ErrorKind::MissingHeartbeatError.into()
        ));
    }

    #[test]
    fn block_reasons_name_the_alarm() {
        assert_eq!(alarm("low on memory"), "memory alarm");
        assert_eq!(alarm("low on disk"), "disk alarm");
        assert_eq!(alarm("other"), "\"other\"");
    }

    #[test]
    fn connection_names_show_the_node_address() {
        assert_eq!(host_port("amqp://a:p,w@h1:5672/v"), "h1:5672");
        assert_eq!(host_port("amqps://h2/v?heartbeat=5"), "h2");
        assert_eq!(host_port("amqp://127.0.0.1:5673"), "127.0.0.1:5673");
    }

    #[test]
    fn the_vhost_is_the_first_addresss_path() {
        let vhost = |text: &str| AmqpTarget::parse(text).unwrap().vhost();
        assert_eq!(vhost("amqp://h:5672/%2f"), "/");
        assert_eq!(vhost("amqp://h/shop%2Feu,amqp://g/other"), "shop/eu");
        assert_eq!(vhost("amqp://h"), "/");
    }

    #[test]
    fn scrubs_an_echoed_password() {
        assert_eq!(
            scrub("auth failed for hunter2", "amqp://u:hunter2@h/"),
            "auth failed for ***"
        );
        assert_eq!(scrub("fine", "amqp://h/"), "fine");
    }
}
