//! The drain measurements of one setting as rounds: the kinds run one after
//! another inside each round (so drift on a noisy machine hits them alike),
//! each round gives a worker/baseline ratio, and the report is the medians
//! with the spread of those ratios.

use std::fmt::Write as _;

/// A raw lapin consume-and-ack loop the worker is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// One Redis `SET key 1 NX EX` per event, then the ack.
    Set,
    /// The ack only, no Redis at all.
    Nodedup,
    /// An external program ([`BenchSettings::peer`](crate::BenchSettings::peer)):
    /// a consumer written with another library on the same load, as a check.
    Peer,
}

impl Baseline {
    /// How the progress lines name it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Set => "raw lapin loop + SET NX EX",
            Self::Nodedup => "raw lapin loop, no dedup",
            Self::Peer => "peer (--peer)",
        }
    }

    fn column(self) -> &'static str {
        match self {
            Self::Set => "raw set",
            Self::Nodedup => "raw nodedup",
            Self::Peer => "peer",
        }
    }
}

/// What one drain measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Raw(Baseline),
    Worker,
}

/// The kinds of one round, in the order they run: the first baseline, the
/// worker, then the other baselines, so the worker sits next to each of the
/// first two.
pub(crate) fn round_order(baselines: &[Baseline]) -> Vec<Kind> {
    let mut order: Vec<Kind> = baselines.iter().map(|&b| Kind::Raw(b)).collect();
    order.insert(order.len().min(1), Kind::Worker);
    order
}

/// The rates (events/s) one round measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Round {
    pub(crate) worker: f64,
    pub(crate) raw: Vec<(Baseline, f64)>,
}

impl Round {
    pub(crate) fn record(&mut self, kind: Kind, rate: f64) {
        match kind {
            Kind::Worker => self.worker = rate,
            Kind::Raw(b) => self.raw.push((b, rate)),
        }
    }

    /// worker / `baseline` in this round, when both were measured.
    pub(crate) fn ratio(&self, baseline: Baseline) -> Option<f64> {
        self.raw
            .iter()
            .find(|(b, _)| *b == baseline)
            .and_then(|&(_, raw)| (raw > 0.0).then(|| self.worker / raw))
    }
}

/// The median and the range of a set of per-round values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// `None` for no values.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            median: median_sorted(&sorted)?,
            min: *sorted.first()?,
            max: *sorted.last()?,
        })
    }
}

/// The median (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    median_sorted(&sorted)
}

fn median_sorted(sorted: &[f64]) -> Option<f64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// One setting's rounds, summarised.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub prefetch: u16,
    pub concurrency: u16,
    /// Median worker events/s.
    pub worker: f64,
    /// Per baseline: its median events/s and the spread of worker/it per round.
    pub baselines: Vec<(Baseline, f64, Option<Spread>)>,
    pub rounds: usize,
}

impl Summary {
    pub(crate) fn new(
        prefetch: u16,
        concurrency: u16,
        baselines: &[Baseline],
        rounds: &[Round],
    ) -> Self {
        let worker: Vec<f64> = rounds.iter().map(|r| r.worker).collect();
        let baselines = baselines
            .iter()
            .map(|&b| {
                let rates: Vec<f64> = rounds
                    .iter()
                    .flat_map(|r| r.raw.iter().filter(|(k, _)| *k == b).map(|&(_, v)| v))
                    .collect();
                let ratios: Vec<f64> = rounds.iter().filter_map(|r| r.ratio(b)).collect();
                (b, median(&rates).unwrap_or(0.0), Spread::of(&ratios))
            })
            .collect();
        Self {
            prefetch,
            concurrency,
            worker: median(&worker).unwrap_or(0.0),
            baselines,
            rounds: rounds.len(),
        }
    }
}

/// `0.76 (0.71–0.80)`; just `0.76` for one round.
fn spread_cell(spread: Option<Spread>, rounds: usize) -> String {
    match spread {
        None => "n/a".into(),
        Some(s) if rounds <= 1 => format!("{:.2}", s.median),
        Some(s) => format!("{:.2} ({:.2}–{:.2})", s.median, s.min, s.max),
    }
}

/// The one table: medians of each kind, then per baseline the median of the
/// per-round worker/baseline ratios with their range.
pub(crate) fn table(summaries: &[Summary]) -> String {
    let Some(first) = summaries.first() else {
        return String::new();
    };
    let mut out = String::new();
    let mut header = format!(
        "{:>8}  {:>11}  {:>15}",
        "prefetch", "concurrency", "worker events/s"
    );
    for &(b, _, _) in &first.baselines {
        let _ = write!(header, "  {:>14}", format!("{} ev/s", b.column()));
    }
    for &(b, _, _) in &first.baselines {
        let _ = write!(header, "  {:>24}", format!("worker/{}", b.column()));
    }
    out.push_str(header.trim_end());
    out.push('\n');
    for s in summaries {
        let mut line = format!(
            "{:>8}  {:>11}  {:>15.0}",
            s.prefetch, s.concurrency, s.worker
        );
        for &(_, rate, _) in &s.baselines {
            let _ = write!(line, "  {rate:>14.0}");
        }
        for &(_, _, spread) in &s.baselines {
            let _ = write!(line, "  {:>24}", spread_cell(spread, s.rounds));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    if first.rounds > 1 {
        let _ = writeln!(
            out,
            "rates: medians of {} rounds; ratios: median of the per-round ratios (min–max over the rounds)",
            first.rounds
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worker_runs_between_the_baselines() {
        use Baseline::*;
        assert_eq!(
            round_order(&[Set, Nodedup]),
            [Kind::Raw(Set), Kind::Worker, Kind::Raw(Nodedup)]
        );
        assert_eq!(round_order(&[Nodedup]), [Kind::Raw(Nodedup), Kind::Worker]);
        assert_eq!(round_order(&[]), [Kind::Worker]);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn spread_is_the_median_and_range_of_per_round_ratios() {
        let round = |worker, set, nodedup| Round {
            worker,
            raw: vec![(Baseline::Set, set), (Baseline::Nodedup, nodedup)],
        };
        // The rounds drift together: per-round ratios are steadier than the rates.
        let rounds = [
            round(800.0, 1000.0, 2000.0),
            round(400.0, 500.0, 1000.0),
            round(900.0, 1000.0, 1800.0),
        ];
        let s = Summary::new(32, 1, &[Baseline::Set, Baseline::Nodedup], &rounds);
        assert_eq!(s.worker, 800.0);
        let (b, rate, spread) = s.baselines[0];
        assert_eq!((b, rate), (Baseline::Set, 1000.0));
        assert_eq!(
            spread,
            Some(Spread {
                median: 0.8,
                min: 0.8,
                max: 0.9
            })
        );
        let (_, rate, spread) = s.baselines[1];
        assert_eq!(rate, 1800.0);
        assert_eq!(spread.map(|s| (s.min, s.max)), Some((0.4, 0.5)));
    }

    #[test]
    fn a_baseline_of_zero_gives_no_ratio() {
        let r = Round {
            worker: 10.0,
            raw: vec![(Baseline::Set, 0.0)],
        };
        assert_eq!(r.ratio(Baseline::Set), None);
        assert_eq!(r.ratio(Baseline::Nodedup), None);
        assert_eq!(Spread::of(&[]), None);
    }

    #[test]
    fn the_table_has_one_row_per_setting_and_ranges_only_for_rounds() {
        let rounds = [
            Round {
                worker: 750.0,
                raw: vec![(Baseline::Set, 1000.0)],
            },
            Round {
                worker: 900.0,
                raw: vec![(Baseline::Set, 1000.0)],
            },
        ];
        let two = Summary::new(1, 1, &[Baseline::Set], &rounds);
        let text = table(&[two]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].contains("worker/raw set"), "{text}");
        assert!(lines[1].ends_with("0.82 (0.75–0.90)"), "{text}");
        assert!(lines[2].contains("2 rounds"), "{text}");
        let one = Summary::new(1, 1, &[Baseline::Set], &rounds[..1]);
        assert!(
            table(&[one])
                .lines()
                .nth(1)
                .is_some_and(|l| l.ends_with("0.75"))
        );
    }
}
