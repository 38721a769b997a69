//! `shardline receive`: a stand-in for your service while trying shardline
//! out. Answers every POST with 200 and prints each event on a line.

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Args;
use shardline_bench::receive::{self, Received};
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

/// One line per event: who it is, then the body as published (control
/// characters escaped, so a body cannot forge lines).
fn print(r: Received) {
    let line = format!(
        "{} seq {} attempt {} shard {} key {} {} {}\n",
        dash(&r.order_id),
        dash(&r.seq),
        dash(&r.attempt),
        dash(&r.shard),
        dash(&r.idempotency_key),
        r.path,
        shown(&String::from_utf8_lossy(&r.body)),
    );
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`), the rest as is.
fn shown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
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
