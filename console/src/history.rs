//! The backlog-age history behind the fleet page's chart: a sample of every
//! shard's backlog age every [`EVERY`], the last [`KEPT`] of them (ten
//! minutes), in this process's memory. A restart starts the chart empty; for
//! longer history, Prometheus scrapes the workers' `shardline_backlog_age_seconds`.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use askama::Template;
use askama::filters::HtmlSafe;
use serde::Serialize;
use shardline_contract::status::Thresholds;
use shardline_ops::topology::StatusReport;

/// How often the console samples the fleet.
pub(crate) const EVERY: Duration = Duration::from_secs(5);

/// Samples kept: ten minutes.
pub(crate) const KEPT: usize = 120;

/// Every shard's backlog age at one time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Sample {
    pub(crate) at_ms: u64,
    /// Seconds, by shard (index = shard number); `None`: unknown.
    pub(crate) ages: Vec<Option<f64>>,
}

impl Sample {
    pub(crate) fn of(report: &StatusReport) -> Self {
        Self {
            at_ms: report.read_at_ms,
            ages: report
                .shards
                .iter()
                .map(|s| s.backlog_age.map(|a| a.as_secs_f64()))
                .collect(),
        }
    }
}

/// The samples, oldest first.
#[derive(Debug, Default)]
pub(crate) struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    pub(crate) fn push(&self, sample: Sample) {
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        if samples
            .back()
            .is_some_and(|last| last.at_ms >= sample.at_ms)
        {
            return;
        }
        if samples.len() == KEPT {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    pub(crate) fn samples(&self) -> Vec<Sample> {
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        samples.iter().cloned().collect()
    }
}

/// Chart size, in SVG units.
const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 160.0;
const LEFT: f64 = 48.0;
const BOTTOM: f64 = 18.0;

/// The chart as inline SVG (`chart.html`; presentation attributes only: the
/// CSP allows no inline style): one line per shard, the WARN and PAGE levels
/// dashed, the y axis from 0 to the largest of the ages and the WARN level.
#[derive(Template)]
#[template(path = "chart.html")]
pub(crate) struct Chart {
    width: f64,
    height: f64,
    left: f64,
    now_x: f64,
    minutes: u64,
    /// `None` before the first sample.
    plot: Option<Plot>,
}

impl HtmlSafe for Chart {}

struct Plot {
    /// The top of the y axis, in seconds.
    top: f64,
    axis_y: f64,
    levels: Vec<LevelMark>,
    lines: Vec<Line>,
    span_seconds: f64,
}

/// A dashed WARN or PAGE level and its label.
struct LevelMark {
    y: f64,
    label_x: f64,
    label_y: f64,
    color: &'static str,
    name: &'static str,
}

/// A shard's backlog ages, as SVG `points`.
struct Line {
    shard: usize,
    color: String,
    points: String,
}

pub(crate) fn chart(samples: &[Sample], thresholds: &Thresholds) -> Chart {
    Chart {
        width: WIDTH,
        height: HEIGHT,
        left: LEFT,
        now_x: WIDTH - 24.0,
        minutes: KEPT as u64 * EVERY.as_secs() / 60,
        plot: plot(samples, thresholds),
    }
}

fn plot(samples: &[Sample], thresholds: &Thresholds) -> Option<Plot> {
    let warn = thresholds.warn.as_secs_f64();
    let page = thresholds.page.as_secs_f64();
    let (first, last) = (samples.first()?, samples.last()?);
    let top = samples
        .iter()
        .flat_map(|s| s.ages.iter().flatten())
        .fold(warn, |m, &a| m.max(a))
        * 1.1;
    let span = last.at_ms.saturating_sub(first.at_ms).max(1) as f64;
    let x = |at: u64| LEFT + (at.saturating_sub(first.at_ms) as f64 / span) * (WIDTH - LEFT - 4.0);
    let y = |age: f64| (HEIGHT - BOTTOM) - (age / top) * (HEIGHT - BOTTOM - 4.0);
    let levels = [(warn, "#b8860b", "WARN"), (page, "#b22222", "PAGE")]
        .into_iter()
        .filter(|&(level, _, _)| level <= top)
        .map(|(level, color, name)| LevelMark {
            y: y(level),
            label_x: WIDTH - 36.0,
            label_y: y(level) - 2.0,
            color,
            name,
        })
        .collect();
    let shards = samples.iter().map(|s| s.ages.len()).max().unwrap_or(0);
    let lines = (0..shards)
        .filter_map(|shard| {
            let points: Vec<String> = samples
                .iter()
                .filter_map(|s| {
                    let age = (*s.ages.get(shard)?)?;
                    Some(format!("{:.1},{:.1}", x(s.at_ms), y(age)))
                })
                .collect();
            (!points.is_empty()).then(|| Line {
                shard,
                color: color(shard),
                points: points.join(" "),
            })
        })
        .collect();
    Some(Plot {
        top,
        axis_y: HEIGHT - BOTTOM,
        levels,
        lines,
        span_seconds: (span / 1000.0).round(),
    })
}

/// A shard's line colour: spread around the hue circle.
fn color(shard: usize) -> String {
    let hue = (shard * 137) % 360;
    format!("hsl({hue},60%,40%)")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sample(at_ms: u64, ages: &[Option<f64>]) -> Sample {
        Sample {
            at_ms,
            ages: ages.to_vec(),
        }
    }

    #[test]
    fn the_history_keeps_the_latest_samples_in_time_order() {
        let history = History::default();
        for i in 0..KEPT as u64 + 10 {
            history.push(sample(1000 + i, &[Some(1.0)]));
        }
        history.push(sample(5, &[Some(1.0)]));
        let samples = history.samples();
        assert_eq!(samples.len(), KEPT);
        assert_eq!(samples[0].at_ms, 1010);
        assert!(samples.windows(2).all(|w| w[0].at_ms < w[1].at_ms));
    }

    #[test]
    fn the_chart_draws_a_line_per_shard_and_the_levels() {
        let thresholds = Thresholds::default();
        let svg = chart(
            &[
                sample(0, &[Some(0.0), None]),
                sample(5000, &[Some(200.0), Some(3.0)]),
            ],
            &thresholds,
        )
        .render()
        .unwrap();
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("data-shard=\"1\""));
        assert!(svg.contains(">WARN<") && svg.contains(">PAGE<"), "{svg}");
        assert!(!svg.contains("style="), "the CSP allows no inline style");
        assert!(
            chart(&[], &thresholds)
                .render()
                .unwrap()
                .contains("No samples yet")
        );
    }
}
