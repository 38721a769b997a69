//! `shardline receive`: a stand-in for your service while trying shardline
//! out. Answers every POST with 200 and prints each event on a line.

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Args;
use shardline_bench::receive::{self, Received};
use shardline_contract::text::shown;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Args)]
pub(crate) struct ReceiveArgs {
    /// Address to listen on; point the worker at `http://ADDRESS/events`.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
}

pub(crate) async fn run(
    args: ReceiveArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let (addr, serve) = receive::bind(args.listen, shutdown, print).await?;
    eprintln!(
        "receiving on http://{addr}/events: every POST is answered 200 and printed; Ctrl-C stops"
    );
    serve.await;
    Ok(ExitCode::SUCCESS)
}

/// One line per event: who it is, then the body as published (in each, the
/// characters that do not show as themselves escaped, so a request cannot
/// forge lines, colours or the order of what it shows).
fn print(r: Received) {
    let line = format!(
        "{} seq {} attempt {} shard {} key {} {} {}\n",
        shown(dash(&r.order_id)),
        shown(dash(&r.seq)),
        shown(dash(&r.attempt)),
        shown(dash(&r.shard)),
        shown(dash(&r.idempotency_key)),
        shown(&r.path),
        shown(&String::from_utf8_lossy(&r.body)),
    );
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
}

fn dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_body_cannot_forge_a_line_or_a_colour() {
        assert_eq!(
            super::shown("{\"a\": \"x\ny\u{1b}[31m\"}"),
            "{\"a\": \"x\\ny\\u{1b}[31m\"}"
        );
    }
}
