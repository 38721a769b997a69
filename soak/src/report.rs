//! The soak's report: recovery per fault, the numbers, `report.md` and its chart.

mod plot;

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::check::Verdict;
use crate::history::{FaultRecord, History, Sample};
use crate::schedule::clock;

/// The report's Markdown file, in the report's directory.
const REPORT_FILE: &str = "report.md";
/// The chart, beside it.
const CHART_FILE: &str = "throughput.png";
/// The throughput before a fault that recovery is measured against.
const BASELINE: Duration = Duration::from_secs(60);
/// Recovered: processing at this share of the baseline, or more.
const RECOVERED_SHARE: f64 = 0.8;

/// Why the report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or the directory could not be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The chart's font is missing or unreadable.
    #[error("cannot load the chart's font {path}: install the Debian package fonts-dejavu-core")]
    Font {
        /// Where the font was looked for.
        path: PathBuf,
    },
    /// The chart could not be drawn.
    #[error("cannot draw {path}: {message}")]
    Plot {
        /// The chart's file.
        path: PathBuf,
        /// What the plotting library said.
        message: String,
    },
}

/// How long the fleet took to recover from one fault.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recovery {
    /// The fault, with its measured times.
    pub record: FaultRecord,
    /// From the fault's end to the first sample back to normal; `None` if none was.
    pub after: Option<Duration>,
}

/// Per fault, the time from its end to the first sample with the backlog younger
/// than `warn` and processing at 80 % or more of its mean over the 60 s before the
/// fault began (or over the samples there are, early in the run).
#[must_use]
pub fn recovery(faults: &[FaultRecord], samples: &[Sample], warn: Duration) -> Vec<Recovery> {
    faults
        .iter()
        .map(|record| {
            let wanted = RECOVERED_SHARE * baseline(samples, record.began);
            let after = samples
                .iter()
                .filter(|s| s.at >= record.ended)
                .find(|s| s.backlog_age_secs < warn.as_secs_f64() && s.processed_per_sec >= wanted)
                .map(|s| s.at - record.ended);
            Recovery {
                record: *record,
                after,
            }
        })
        .collect()
}

/// The mean processed events/s over the [`BASELINE`] before `began` (0 without samples).
fn baseline(samples: &[Sample], began: Duration) -> f64 {
    let from = began.saturating_sub(BASELINE);
    mean(
        samples
            .iter()
            .filter(|s| from <= s.at && s.at < began)
            .map(|s| s.processed_per_sec),
    )
}

/// The mean of `values`, 0 for none.
fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, count) = values.fold((0.0, 0_u32), |(sum, count), v| (sum + v, count + 1));
    if count == 0 {
        0.0
    } else {
        sum / f64::from(count)
    }
}

/// The largest of `values`, 0 for none.
fn max(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, f64::max)
}

/// What the report says about one soak.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The schedule's seed.
    pub seed: u64,
    /// The run's length.
    pub run: Duration,
    /// The check's outcome.
    pub verdict: Verdict,
    /// Each fault with its times and recovery.
    pub recoveries: Vec<Recovery>,
    /// Repeated 2xx calls over all shards.
    pub repeats_total: u64,
    /// The shard with the most repeats and their count, if any call was made.
    pub repeats_max: Option<(u16, u64)>,
    /// The oldest backlog seen, in seconds.
    pub longest_backlog_age_secs: f64,
    /// Processed events per second, over the samples.
    pub mean_events_per_sec: f64,
    /// The machine's CPU use over the samples, in percent.
    pub mean_cpu_percent: f64,
    /// The machine's highest CPU use in a sample, in percent.
    pub max_cpu_percent: f64,
}

impl Summary {
    /// The summary of `history`, checked into `verdict`, for the schedule of `seed`
    /// over `run`.
    #[must_use]
    pub fn new(history: &History, verdict: Verdict, seed: u64, run: Duration) -> Summary {
        let samples = &history.samples;
        let repeats = &verdict.repeats_by_shard;
        Summary {
            seed,
            run,
            recoveries: recovery(&history.faults, samples, history.fleet.warn_backlog_age),
            repeats_total: repeats.values().map(|r| r.repeats).sum(),
            repeats_max: repeats
                .iter()
                .max_by_key(|(shard, r)| (r.repeats, std::cmp::Reverse(**shard)))
                .map(|(shard, r)| (*shard, r.repeats)),
            longest_backlog_age_secs: max(samples.iter().map(|s| s.backlog_age_secs)),
            mean_events_per_sec: mean(samples.iter().map(|s| s.processed_per_sec)),
            mean_cpu_percent: mean(samples.iter().map(|s| s.cpu_percent)),
            max_cpu_percent: max(samples.iter().map(|s| s.cpu_percent)),
            verdict,
        }
    }

    fn title(&self) -> String {
        let outcome = if self.verdict.passed() {
            "passed".to_owned()
        } else {
            match self.verdict.violations.len() {
                1 => "FAILED (1 violation)".to_owned(),
                count => format!("FAILED ({count} violations)"),
            }
        };
        format!(
            "Soak: seed {}, run {}: {outcome}",
            self.seed,
            clock(self.run)
        )
    }
}

/// Writes `dir/report.md` and the chart `dir/throughput.png` it links, creating
/// `dir`; returns the Markdown file's path.
///
/// # Errors
/// [`ReportError::Font`] without the chart's font (Debian `fonts-dejavu-core`),
/// [`ReportError::Io`] or [`ReportError::Plot`] when a file cannot be written.
pub fn write(dir: &Path, summary: &Summary, history: &History) -> Result<PathBuf, ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Io {
        path: dir.to_owned(),
        source,
    })?;
    plot::draw(&dir.join(CHART_FILE), summary, history)?;
    let path = dir.join(REPORT_FILE);
    std::fs::write(&path, markdown(summary, history)).map_err(|source| ReportError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The whole Markdown report.
fn markdown(summary: &Summary, history: &History) -> String {
    let mut md = format!(
        "# {}\n\n![throughput and backlog age]({CHART_FILE})\n\n",
        summary.title()
    );
    md.push_str(&schedule_table(summary));
    md.push_str(&recovery_table(summary));
    md.push_str(&violations_section(summary));
    md.push_str(&allowed_letters_section(summary));
    md.push_str(&numbers_section(summary, history));
    md
}

fn schedule_table(summary: &Summary) -> String {
    let mut md = String::from(
        "## Schedule\n\n| fault | name | scheduled | length | began | ended |\n|---|---|---|---|---|---|\n",
    );
    for Recovery { record, .. } in &summary.recoveries {
        let fault = &record.fault;
        let _ = writeln!(
            md,
            "| {} | {} | +{} | {} | +{} | +{} |",
            fault.kind,
            fault.kind.name(),
            clock(fault.start),
            clock(fault.length),
            clock(record.began),
            clock(record.ended)
        );
    }
    md.push('\n');
    md
}

fn recovery_table(summary: &Summary) -> String {
    let mut md = String::from(
        "## Recovery\n\nFrom a fault's end to the first second with the backlog younger than WARN \
         and processing at 80 % of the minute before the fault.\n\n\
         | fault | ended | recovered after |\n|---|---|---|\n",
    );
    for recovery in &summary.recoveries {
        let after = recovery.after.map_or_else(
            || "not before the end".to_owned(),
            |d| format!("{} s", d.as_secs()),
        );
        let _ = writeln!(
            md,
            "| {} | +{} | {after} |",
            recovery.record.fault.kind,
            clock(recovery.record.ended)
        );
    }
    md.push('\n');
    md
}

fn violations_section(summary: &Summary) -> String {
    let violations = &summary.verdict.violations;
    if violations.is_empty() {
        return "## Violations\n\nnone\n\n".to_owned();
    }
    let mut md = format!("## Violations\n\n{} in all", violations.len());
    if violations.len() > LISTED {
        let _ = write!(md, "; the first {LISTED}");
    }
    md.push_str(":\n\n");
    for violation in violations.iter().take(LISTED) {
        let _ = writeln!(md, "- {violation}");
    }
    md.push('\n');
    md
}

/// Violations listed in the report: a fault that stops the fleet makes
/// thousands, and the first ones tell the story.
const LISTED: usize = 100;

fn allowed_letters_section(summary: &Summary) -> String {
    let letters = &summary.verdict.allowed_letters;
    if letters.is_empty() {
        return "## Allowed dead letters\n\nnone\n\n".to_owned();
    }
    let mut md =
        String::from("## Allowed dead letters\n\n| key | reason | allowed by |\n|---|---|---|\n");
    for letter in letters {
        let _ = writeln!(
            md,
            "| `{}` | {} | {} |",
            letter.key, letter.reason, letter.row
        );
    }
    md.push('\n');
    md
}

fn numbers_section(summary: &Summary, history: &History) -> String {
    let most = summary.repeats_max.map_or_else(
        || "no calls".to_owned(),
        |(shard, repeats)| format!("{repeats} on shard {shard}"),
    );
    format!(
        "## Numbers\n\n\
         - events confirmed: {}\n\
         - downstream calls: {}\n\
         - dead letters: {}\n\
         - repeated calls: {} in all, most {most}\n\
         - longest backlog age: {:.1} s\n\
         - mean processed: {:.1} events/s\n\
         - machine CPU: mean {:.1} %, max {:.1} %\n",
        history.published.len(),
        history.calls.len(),
        history.letters.len(),
        summary.repeats_total,
        summary.longest_backlog_age_secs,
        summary.mean_events_per_sec,
        summary.mean_cpu_percent,
        summary.max_cpu_percent
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check;
    use crate::history::{Call, FinalConsumers, Fleet, Published};
    use crate::schedule::{FaultKind, Schedule};

    const WARN: Duration = Duration::from_secs(30);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn record(kind: FaultKind, began: u64, ended: u64) -> FaultRecord {
        FaultRecord::at_secs(kind, began, ended)
    }

    /// One sample a second for `run` seconds: 100 events/s and a 1 s backlog, except
    /// `(from, to, processed, backlog)` spans.
    fn samples(run: u64, dips: &[(u64, u64, f64, f64)]) -> Vec<Sample> {
        (0..run)
            .map(|at| {
                let dip = dips.iter().find(|d| (d.0..d.1).contains(&at));
                let (processed, backlog) = dip.map_or((100.0, 1.0), |d| (d.2, d.3));
                Sample {
                    at: secs(at),
                    processed_per_sec: processed,
                    backlog_age_secs: backlog,
                    cpu_percent: 20.0 + (at % 10) as f64,
                }
            })
            .collect()
    }

    #[test]
    fn recovery_waits_for_a_young_backlog_and_the_throughput_back() {
        let fault = record(FaultKind::NodeKill9 { node: 1 }, 100, 120);
        // Backlog old until 130 s, throughput at 70 % until 140 s.
        let samples = samples(300, &[(100, 130, 0.0, 45.0), (130, 140, 70.0, 5.0)]);
        let recoveries = recovery(&[fault], &samples, WARN);
        assert_eq!(recoveries[0].after, Some(secs(20)));
    }

    #[test]
    fn recovery_is_none_when_the_fleet_never_comes_back() {
        let fault = record(FaultKind::RedisFailover, 100, 120);
        let samples = samples(200, &[(100, 200, 10.0, 60.0)]);
        assert_eq!(recovery(&[fault], &samples, WARN)[0].after, None);
    }

    #[test]
    fn recovery_early_in_the_run_uses_the_samples_there_are() {
        // 10 samples before the fault, at 100 events/s: back at 80 or more.
        let fault = record(FaultKind::WorkerKill9 { worker: 1 }, 10, 15);
        let samples = samples(60, &[(10, 18, 79.0, 2.0)]);
        assert_eq!(recovery(&[fault], &samples, WARN)[0].after, Some(secs(3)));
    }

    fn small_history(schedule: &Schedule) -> History {
        let published: Vec<Published> = (1..=20)
            .map(|seq| Published {
                key: format!("o1:e{seq}:{seq}"),
                order: "o1".into(),
                seq,
                shard: 0,
                confirmed_at: secs(seq * 5),
                poison: None,
            })
            .collect();
        let calls = published
            .iter()
            .map(|p| Call {
                key: p.key.clone(),
                order: p.order.clone(),
                seq: p.seq,
                shard: p.shard,
                started: p.confirmed_at,
                ended: p.confirmed_at + Duration::from_millis(30),
                status: 200,
            })
            .collect();
        let faults = schedule
            .faults()
            .iter()
            .map(|f| record(f.kind, f.start.as_secs(), f.end().as_secs()))
            .collect();
        // The schedule's reshard finished: the fleet ends on its count.
        let shards = schedule
            .faults()
            .iter()
            .find_map(|f| match f.kind {
                crate::FaultKind::Reshard { to } => Some(to),
                _ => None,
            })
            .unwrap_or(1);
        History {
            shards,
            retired: Vec::new(),
            published,
            calls,
            letters: Vec::new(),
            faults,
            samples: samples(180, &[(60, 75, 20.0, 40.0), (95, 105, 0.0, 35.0)]),
            final_consumers: FinalConsumers(
                (0..shards)
                    .map(|s| (s, vec![format!("worker-{}", s % 3)]))
                    .collect(),
            ),
            fleet: Fleet::soak(),
        }
    }

    #[test]
    fn write_puts_the_report_and_its_chart_in_the_directory() {
        let schedule = Schedule::from_seed(4242, secs(180));
        let history = small_history(&schedule);
        let summary = Summary::new(&history, check(&history), schedule.seed(), schedule.run());
        let dir =
            std::env::temp_dir().join(format!("shardline-soak-report-{}", std::process::id()));
        let written = write(&dir, &summary, &history);
        let markdown = written.as_ref().map(std::fs::read_to_string);
        let chart = std::fs::metadata(dir.join(CHART_FILE));
        std::fs::remove_dir_all(&dir).ok();

        let markdown = markdown.expect("report written").expect("report readable");
        assert!(chart.expect("chart written").len() > 10_000);
        assert!(
            markdown.starts_with("# Soak: seed 4242, run 3:00: passed"),
            "{markdown}"
        );
        assert!(markdown.contains("](throughput.png)"));
        for fault in schedule.faults() {
            assert!(
                markdown.contains(&fault.kind.to_string()),
                "{} missing",
                fault.kind
            );
        }
        assert!(markdown.contains("## Violations\n\nnone"));
    }

    #[test]
    fn a_missing_font_names_the_debian_package() {
        let error = ReportError::Font {
            path: PathBuf::from("/nowhere/DejaVuSans.ttf"),
        };
        let text = error.to_string();
        assert!(text.contains("/nowhere/DejaVuSans.ttf") && text.contains("fonts-dejavu-core"));
    }

    #[test]
    fn the_summary_counts_repeats_and_the_samples() {
        let schedule = Schedule::from_seed(1, secs(180));
        let mut history = small_history(&schedule);
        let again = history.calls[3].clone();
        history.calls.push(again);
        let summary = Summary::new(&history, check(&history), 1, secs(180));
        assert_eq!(summary.repeats_total, 1);
        assert_eq!(summary.repeats_max, Some((0, 1)));
        assert!((summary.longest_backlog_age_secs - 40.0).abs() < 1e-9);
        assert!((summary.max_cpu_percent - 29.0).abs() < 1e-9);
    }
}
