//! The report's chart: processed events/s above, backlog age below, each fault a
//! shaded band labelled with its name.

use std::error::Error;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use super::{ReportError, Summary};
use crate::history::{FaultRecord, History};
use crate::schedule::FaultKind;

/// The chart's font, read at run time (Debian `fonts-dejavu-core`): no font-kit,
/// freetype or fontconfig in the build.
const FONT_PATH: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// The family name the font is registered and used under.
const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (1200, 600);
/// The top panel's share of the height.
const TOP_PANEL: u32 = 330;

type Drawn = Result<(), Box<dyn Error>>;

/// Draws the chart of `history`'s samples and faults into `path`.
pub(super) fn draw(path: &Path, summary: &Summary, history: &History) -> Result<(), ReportError> {
    load_font()?;
    draw_panels(path, summary, history).map_err(|e| ReportError::Plot {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// Registers the font once per process; plotters keeps it for the process's life.
fn load_font() -> Result<(), ReportError> {
    static LOADED: OnceLock<()> = OnceLock::new();
    if LOADED.get().is_some() {
        return Ok(());
    }
    let missing = || ReportError::Font {
        path: PathBuf::from(FONT_PATH),
    };
    let bytes = std::fs::read(FONT_PATH).map_err(|_| missing())?;
    register_font(FONT, FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
        .map_err(|_| missing())?;
    let _ = LOADED.set(());
    Ok(())
}

fn draw_panels(path: &Path, summary: &Summary, history: &History) -> Drawn {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(TOP_PANEL);
    let run = summary.run.as_secs_f64().max(1.0);
    let processed: Vec<(f64, f64)> = history
        .samples
        .iter()
        .map(|s| (s.at.as_secs_f64(), s.processed_per_sec))
        .collect();
    let backlog: Vec<(f64, f64)> = history
        .samples
        .iter()
        .map(|s| (s.at.as_secs_f64(), s.backlog_age_secs))
        .collect();
    let warn = history.fleet.warn_backlog_age.as_secs_f64();
    let panel = Panel {
        run,
        faults: &history.faults,
    };
    let title = format!("{}: processed events/s", summary.title());
    panel.draw(&top, &title, "events/s", &processed, None, true)?;
    panel.draw(
        &bottom,
        "backlog age (s); dashed: WARN",
        "seconds",
        &backlog,
        Some(warn),
        false,
    )?;
    root.present()?;
    Ok(())
}

/// What both panels share: the time axis and the fault bands.
struct Panel<'h> {
    run: f64,
    faults: &'h [FaultRecord],
}

impl Panel<'_> {
    fn draw(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        caption: &str,
        unit: &str,
        points: &[(f64, f64)],
        threshold: Option<f64>,
        labelled: bool,
    ) -> Drawn {
        let top = points
            .iter()
            .map(|p| p.1)
            .chain(threshold)
            .fold(1.0, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(caption, (FONT, 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..self.run, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("seconds since start")
            .y_desc(unit)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(242, 242, 242))
            .label_style((FONT, 12))
            .draw()?;
        chart.draw_series(self.faults.iter().map(|r| {
            let span = [(secs(r.began), 0.0), (secs(r.ended), top)];
            Rectangle::new(span, color(&r.fault.kind).mix(0.18).filled())
        }))?;
        if labelled {
            chart.draw_series(self.faults.iter().enumerate().map(|(i, r)| {
                let y = top * (0.95 - 0.08 * (i % 5) as f64);
                Text::new(
                    r.fault.kind.name(),
                    (secs(r.began), y),
                    (FONT, 12).into_font().color(&color(&r.fault.kind)),
                )
            }))?;
        }
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            BLUE.stroke_width(2),
        ))?;
        if let Some(level) = threshold {
            chart.draw_series(DashedLineSeries::new(
                line(0.0..self.run, level),
                8,
                6,
                RED.into(),
            ))?;
        }
        Ok(())
    }
}

fn secs(at: std::time::Duration) -> f64 {
    at.as_secs_f64()
}

fn line(span: Range<f64>, level: f64) -> [(f64, f64); 2] {
    [(span.start, level), (span.end, level)]
}

/// One colour per part of the system a fault hits.
fn color(kind: &FaultKind) -> RGBColor {
    match kind {
        FaultKind::WorkerKill9 { .. } | FaultKind::WorkerTerm { .. } => RGBColor(230, 120, 0),
        FaultKind::NodeKill9 { .. }
        | FaultKind::Partition { .. }
        | FaultKind::MemoryAlarm { .. } => RGBColor(200, 30, 30),
        FaultKind::RedisFailover => RGBColor(130, 50, 180),
        FaultKind::DownstreamRefused | FaultKind::Downstream503 | FaultKind::SlowDownstream => {
            RGBColor(90, 90, 90)
        }
        FaultKind::Poison => RGBColor(20, 140, 60),
        FaultKind::Reshard { .. } => RGBColor(30, 110, 200),
    }
}
