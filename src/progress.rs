//! The progress bar of the long-running commands (`load`, `demo`, `dlq replay`).

use std::io::IsTerminal as _;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar on stderr counting `total` `things`; hidden when stderr is not a
/// terminal, so logs and CI output stay clean.
pub(crate) fn bar(total: u64, things: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let template =
        format!("{{bar:40.cyan/blue}} {{pos}}/{{len}} {things}  {{per_sec}}  eta {{eta}}  {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar
}
