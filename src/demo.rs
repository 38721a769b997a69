//! `shardline demo`: flags to [`shardline_bench::demo`], its progress as a
//! bar, its report as text.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use shardline_bench::Scratch;
use shardline_bench::demo::{self, DemoReport, DemoSettings, POISON_ORDER, POISON_SEQ};
use shardline_ops::Usage;
use tokio_util::sync::CancellationToken;

use crate::{Flags as _, GlobalArgs};

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Orders in the generated stream.
    #[arg(long, default_value_t = 2000)]
    pub orders: u64,
    /// Events per order (seq 1..E).
    #[arg(long, default_value_t = 5)]
    pub events_per_order: u64,
    /// Give up waiting for the fleet after this long.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

pub(crate) async fn run(
    global: &GlobalArgs,
    args: DemoArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.orders >= POISON_ORDER,
        Usage(format!("--orders must be at least {POISON_ORDER}"))
    );
    anyhow::ensure!(
        args.events_per_order >= POISON_SEQ,
        Usage(format!("--events-per-order must be at least {POISON_SEQ}"))
    );
    let settings = DemoSettings {
        orders: args.orders,
        events_per_order: args.events_per_order,
        timeout: args.timeout,
    };
    let scratch = Scratch::create(&global.fleet(), "demo").await.flags()?;
    let bar = crate::progress::bar(0, "events settled");
    let progress = |settled, total| {
        bar.set_length(total);
        bar.set_position(settled);
    };
    let result = demo::run(&scratch, &settings, shutdown, progress).await;
    bar.finish_and_clear();
    let cleanup = scratch.remove().await.flags();
    let report = result?;
    cleanup?;
    print(&report);
    let problems = report.problems();
    if problems.is_empty() {
        println!("\nresult: OK — every event accounted for, no order violated");
        Ok(ExitCode::SUCCESS)
    } else {
        anyhow::bail!("demo found problems: {}", problems.join("; "))
    }
}

fn print(report: &DemoReport) {
    let p = report.published;
    let s = &report.counts;
    println!(
        "shardline demo: {} shards, {} events in {:.1} s",
        report.shards,
        p.total(),
        report.elapsed.as_secs_f64()
    );
    println!(
        "  published              {:>8}  ({} events, {} duplicates, {} malformed)",
        p.total(),
        p.events,
        p.duplicates,
        p.malformed
    );
    println!("  processed              {:>8}", s.processed);
    println!("  duplicates suppressed  {:>8}", s.duplicates);
    println!("  retries                {:>8}", s.retries);
    println!(
        "  dead-lettered          {:>8}  ({})",
        s.dead_lettered_total(),
        report.dead_letters_by_reason().join(", ")
    );
    println!("  dead-letter queue      {:>8}", report.dlq_depth);
    println!("  order violations       {:>8}", report.order_violations);
    println!(
        "  throughput             {:>8.0}  events/s",
        p.total() as f64 / report.elapsed.as_secs_f64()
    );
    println!(
        "  publish→processed      p50 {} ms, p99 {} ms",
        report.latency_ms(0.5),
        report.latency_ms(0.99)
    );
}
