//! `shardline console`: flags and the token sources to
//! [`shardline_console::Config`], the listener, and the login URL of a
//! generated token.

use crate::out::say;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use shardline_console::{Config, Token, Tokens};
use shardline_contract::status::Thresholds;
use shardline_ops::{Reconciler, Usage};
use tokio_util::sync::CancellationToken;

use crate::reconcile::OrdersArgs;
use crate::{Flags as _, GlobalArgs};

/// The environment variable holding token lines (newline or `;` between them).
const TOKENS_ENV: &str = "SHARDLINE_CONSOLE_TOKENS";

#[derive(Debug, Args)]
pub(crate) struct ConsoleArgs {
    /// Address to serve the console on (keep it on loopback unless behind a
    /// proxy that terminates TLS).
    #[arg(long, default_value = "127.0.0.1:8088")]
    pub listen: SocketAddr,
    /// File of tokens, one `name:role:token` a line (role `admin` or
    /// `read-only`; `#` comments). Also SHARDLINE_CONSOLE_TOKENS. Neither:
    /// an admin token is generated and a login URL printed.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Path the console is mounted under, for a reverse proxy.
    #[arg(long, default_value = "/")]
    pub base_path: String,
    /// Another Host header to answer to (a proxy's name), `host` or
    /// `host:port`; repeatable. Others are refused (DNS rebinding).
    #[arg(long = "allowed-host")]
    pub allowed_hosts: Vec<String>,
    /// A reverse proxy whose X-Forwarded-For is believed: a CIDR
    /// (10.0.0.0/8, fd00::/8) or an address; repeatable or comma-separated.
    /// A request from one is the right-most address of the header that is
    /// not itself a trusted proxy (for the login throttle and the logs); from
    /// any other peer the header is ignored.
    #[arg(long = "trusted-proxy", value_name = "CIDR", value_delimiter = ',')]
    pub trusted_proxies: Vec<String>,
    /// How long a client address waits after its fifth failed login (or
    /// wrong bearer token) before its next one is checked; doubles with each
    /// further failure, up to 5 minutes.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub login_backoff: Duration,
    /// Backlog age from which a shard shows WARN.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub backlog_warn: Duration,
    /// Backlog age from which a shard shows PAGE.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub backlog_page: Duration,
    /// PostgreSQL URL of the order database: the reconcile page then offers
    /// a dry run (read-only; it emits and writes nothing).
    #[arg(long)]
    pub orders_url: Option<shardline_connect::redact::Redacted>,
    #[command(flatten)]
    pub orders: OrdersArgs,
}

/// The tokens of `--token-file` and the environment, each refusal naming
/// where it came from; `None` when neither gives any.
fn tokens(args: &ConsoleArgs) -> anyhow::Result<Option<Tokens>> {
    let mut tokens = Tokens::default();
    if let Some(path) = &args.token_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--token-file {}", path.display()))?;
        tokens = Tokens::parse(&text, false)
            .map_err(|e| Usage(format!("--token-file {}: {e}", path.display())))?;
    }
    if let Some(text) = std::env::var_os(TOKENS_ENV) {
        let text = text
            .into_string()
            .map_err(|_| Usage(format!("{TOKENS_ENV}: not UTF-8")))?;
        let from_env =
            Tokens::parse(&text, true).map_err(|e| Usage(format!("{TOKENS_ENV}: {e}")))?;
        tokens = tokens
            .merge(from_env)
            .map_err(|e| Usage(format!("{TOKENS_ENV} and --token-file: {e}")))?;
    }
    Ok((!tokens.is_empty()).then_some(tokens))
}

fn flag(field: &str) -> String {
    match field {
        "tokens" => format!("--token-file or {TOKENS_ENV}"),
        "allowed_hosts" => "--allowed-host".into(),
        "trusted_proxies" => "--trusted-proxy".into(),
        field => crate::flag(field),
    }
}

pub(crate) async fn run(
    global: &GlobalArgs,
    args: ConsoleArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let (tokens, generated) = match tokens(&args)? {
        Some(tokens) => (tokens, None),
        None => {
            let token = Token::generate();
            let mut tokens = Tokens::default();
            tokens.add(token.clone())?;
            (tokens, Some(token))
        }
    };
    // A dry run's config is checked now: a bad URL fails the start, naming the flag.
    let reconcile = match args.orders_url {
        Some(url) => {
            let config = args.orders.config(url.into_inner(), true, usize::MAX);
            Reconciler::new(global.fleet(), config.clone()).flags()?;
            Some(config)
        }
        None => None,
    };
    let config = Config {
        reconcile,
        tokens,
        base_path: args.base_path,
        allowed_hosts: args.allowed_hosts,
        thresholds: Thresholds {
            warn: args.backlog_warn,
            page: args.backlog_page,
        },
        limits: shardline_connect::inbound::Inbound::default(),
        trusted_proxies: args.trusted_proxies,
        login_backoff: args.login_backoff,
        ..Config::default()
    };
    config
        .validate()
        .and_then(|()| config.validate_listen(args.listen))
        .map_err(|e| Usage(e.rename_field(flag)))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen {}", args.listen))?;
    let addr = listener.local_addr()?;
    if let Some(token) = generated {
        // Printed once, on stdout, never logged (like Jupyter's login URL).
        let host = if addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], addr.port()))
        } else {
            addr
        };
        let base = if config.base_path.is_empty() {
            "/".to_owned()
        } else {
            format!("{}/", config.base_path.trim_end_matches('/'))
        };
        say!(
            "shardline console: no token given, generated an admin token. Log in at:\n    http://{host}{base}login?token={}",
            token.secret()
        );
    }
    shardline_console::serve(config, global.fleet(), listener, shutdown)
        .await
        .map_err(|e| crate::usage_if(e.is_usage(), e.rename_field(flag)))?;
    Ok(ExitCode::SUCCESS)
}
