//! Reference pages generated from the code (the command line's help, the
//! metric registry): a unit test next to the source renders the page and holds
//! the committed copy to it, so a change to a flag or a metric that leaves the
//! page behind fails the tests with the command that regenerates it.

use std::path::Path;

/// Set (to anything) to write the rendered page instead of comparing.
pub const REGENERATE: &str = "SHARDLINE_REGENERATE_DOCS";

/// Compares `rendered` with the committed `page`, or writes it when
/// [`REGENERATE`] is set. The error names the first line that differs and
/// `regenerate`, the command that brings the page up to date.
pub fn check(page: &Path, rendered: &str, regenerate: &str) -> Result<(), String> {
    if std::env::var_os(REGENERATE).is_some() {
        return std::fs::write(page, rendered)
            .map_err(|e| format!("cannot write {}: {e}", page.display()));
    }
    let committed = std::fs::read_to_string(page).unwrap_or_default();
    if committed == rendered {
        return Ok(());
    }
    let line = committed
        .lines()
        .zip(rendered.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| committed.lines().count().min(rendered.lines().count()))
        + 1;
    Err(format!(
        "{} is out of date (it differs from the code from line {line}): regenerate it with `{REGENERATE}=1 {regenerate}` and commit it",
        page.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_page_is_caught_with_the_command_that_mends_it() {
        let page =
            std::env::temp_dir().join(format!("shardline-docs-{}-stale.md", std::process::id()));
        std::fs::write(&page, "# Metrics\n\n| a |\n").unwrap();
        assert_eq!(check(&page, "# Metrics\n\n| a |\n", "cargo test x"), Ok(()));
        let error = check(&page, "# Metrics\n\n| b |\n", "cargo test x").unwrap_err();
        assert!(error.contains("from line 3"), "{error}");
        assert!(
            error.contains("SHARDLINE_REGENERATE_DOCS=1 cargo test x"),
            "{error}"
        );
        let _ = std::fs::remove_file(page);
    }
}
