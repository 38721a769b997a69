//! The console's settings: who may log in, where it is mounted, which Host
//! names it answers to, the backlog thresholds of its fleet page.

use std::net::SocketAddr;

use shardline_connect::inbound::Inbound;
use shardline_contract::status::Thresholds;
use shardline_ops::ReconcileConfig;

use crate::Error;
use crate::token::Tokens;

/// What [`crate::serve`] needs besides the fleet and a listener.
#[derive(Debug, Clone)]
pub struct Config {
    /// The tokens that may log in; at least one (the command line generates
    /// one when none is given).
    pub tokens: Tokens,
    /// Where the console is mounted, for a reverse proxy: starts with `/`
    /// (default `/`). Every route, and the session cookie's `Path`, is under it.
    pub base_path: String,
    /// Host names (`host` or `host:port`) the console answers to besides its
    /// listen address, `localhost:{port}` and `127.0.0.1:{port}`: any other
    /// Host header is refused (DNS rebinding). Default none.
    pub allowed_hosts: Vec<String>,
    /// Backlog age levels on the fleet page (default WARN from 30 s, PAGE
    /// from 2 min).
    pub thresholds: Thresholds,
    /// The order database: with it the reconcile page offers a dry run
    /// (its `dry_run` is set for each run). Default none.
    pub reconcile: Option<ReconcileConfig>,
    /// The limits of its port: header-read and idle timeouts, the
    /// connection cap, the request body limit and read timeout. Default
    /// [`Inbound::default`]: 10 s, 5 s, 64, 1 MiB, 10 s.
    pub limits: Inbound,
    /// Proxies whose `X-Forwarded-For` is believed: CIDRs (`10.0.0.0/8`,
    /// `fd00::/8`) or addresses. A request from one of them is the
    /// right-most address of the header that is not itself a trusted proxy
    /// (for the login throttle and the logs); from any other peer, the peer.
    /// Default none: the header is ignored.
    pub trusted_proxies: Vec<String>,
    /// How many letters a letter's detail reads from the head of the DLQ
    /// looking for it (default [`LETTERS_READ`], 10,000): a letter further
    /// back is reported as such, for `shardline dlq show`. More reads
    /// longer and holds more letters unacked while it does.
    pub letters_read: usize,
    /// How long a client address waits after its fifth failed token check
    /// before its next one is checked; doubles with each further failure,
    /// up to 5 min. Default 1 s; above zero.
    pub login_backoff: std::time::Duration,
}

/// The default [`Config::letters_read`].
pub const LETTERS_READ: usize = 10_000;

impl Default for Config {
    fn default() -> Self {
        Self {
            tokens: Tokens::default(),
            base_path: String::new(),
            allowed_hosts: Vec::new(),
            thresholds: Thresholds::default(),
            reconcile: None,
            limits: Inbound::default(),
            trusted_proxies: Vec::new(),
            letters_read: LETTERS_READ,
            login_backoff: std::time::Duration::from_secs(1),
        }
    }
}

impl Config {
    /// Checks the fields; the error names the field.
    pub fn validate(&self) -> Result<(), Error> {
        if self.tokens.is_empty() {
            return Err(Error::Config {
                field: "tokens",
                message: "tokens: at least one token is required".into(),
            });
        }
        base_path(&self.base_path)?;
        if let Some(bad) = self
            .allowed_hosts
            .iter()
            .find(|h| h.is_empty() || h.contains(['/', ' ', '@', '?', '#']))
        {
            return Err(Error::Config {
                field: "allowed_hosts",
                message: format!("allowed_hosts: {bad:?} is not a host name or host:port"),
            });
        }
        if self.thresholds.page < self.thresholds.warn {
            return Err(Error::Config {
                field: "thresholds.page",
                message: "thresholds.page must not be below thresholds.warn".into(),
            });
        }
        if let Err(message) = crate::client::trusted(&self.trusted_proxies) {
            return Err(Error::Config {
                field: "trusted_proxies",
                message: format!("trusted_proxies: {message}"),
            });
        }
        if self.login_backoff.is_zero() {
            return Err(Error::Config {
                field: "login_backoff",
                message: "login_backoff: above zero".into(),
            });
        }
        if self.letters_read == 0 {
            return Err(Error::Config {
                field: "letters_read",
                message: "letters_read: at least 1 letter".into(),
            });
        }
        if let Err(e) = self.limits.validate() {
            return Err(Error::Config {
                field: "limits",
                message: format!("limits.{e}"),
            });
        }
        Ok(())
    }
}

impl Config {
    /// A console listening beyond loopback (`0.0.0.0`, a LAN address) must
    /// name the host names people reach it by: a console opened to the
    /// network is opened on purpose, and without them the Host check would
    /// refuse every request not made by IP address.
    pub fn validate_listen(&self, listen: SocketAddr) -> Result<(), Error> {
        if listen.ip().is_loopback() || !self.allowed_hosts.is_empty() {
            return Ok(());
        }
        Err(Error::Config {
            field: "allowed_hosts",
            message: format!(
                "allowed_hosts: required to listen on {listen}, beyond this machine: name the host names people reach the console by (put it behind a TLS proxy, docs/security.md), or listen on 127.0.0.1"
            ),
        })
    }
}

/// The base path with one trailing `/` (`""` is `/`).
pub(crate) fn base_path(path: &str) -> Result<String, Error> {
    let path = if path.is_empty() { "/" } else { path };
    let fits = path.starts_with('/')
        && !path.contains("//")
        && path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '-' | '_' | '.' | '~'));
    if !fits {
        return Err(Error::Config {
            field: "base_path",
            message: format!(
                "base_path: {path:?} must start with `/` and hold only letters, digits and `/-_.~`"
            ),
        });
    }
    Ok(if path.ends_with('/') {
        path.to_owned()
    } else {
        format!("{path}/")
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_base_path_gets_one_trailing_slash() {
        assert_eq!(base_path("/").unwrap(), "/");
        assert_eq!(base_path("").unwrap(), "/");
        assert_eq!(base_path("/console").unwrap(), "/console/");
        assert_eq!(base_path("/ops/console/").unwrap(), "/ops/console/");
        assert!(base_path("console").is_err());
        assert!(base_path("//evil.example").is_err());
        assert!(base_path("/a?b").is_err());
    }

    #[test]
    fn a_malformed_trusted_proxy_is_refused_naming_the_field() {
        let config = Config {
            tokens: crate::Tokens::parse("a:admin:0123456789abcdef", false).unwrap(),
            trusted_proxies: vec!["10.0.0.0/8".into(), "10.0.0.0/40".into()],
            ..Config::default()
        };
        let err = config.validate().unwrap_err();
        assert!(err.is_usage());
        assert_eq!(
            err.rename_field(|_| "--trusted-proxy".into()),
            "--trusted-proxy: \"10.0.0.0/40\" is not a CIDR (such as 10.0.0.0/8 or fd00::/8) or an IP address"
        );
    }

    #[test]
    fn beyond_loopback_the_host_names_are_required() {
        let mut config = Config::default();
        for local in ["127.0.0.1:8080", "[::1]:8080"] {
            assert!(config.validate_listen(local.parse().unwrap()).is_ok());
        }
        for open in ["0.0.0.0:8080", "[::]:8080", "10.1.2.3:8080"] {
            let err = config.validate_listen(open.parse().unwrap()).unwrap_err();
            assert!(
                err.rename_field(|_| "--allowed-host".into())
                    .starts_with("--allowed-host: required to listen on"),
                "{err}"
            );
        }
        config.allowed_hosts = vec!["console.example".into()];
        assert!(
            config
                .validate_listen("0.0.0.0:8080".parse().unwrap())
                .is_ok()
        );
    }
}
