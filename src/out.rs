//! What the command line prints as text: text from outside — letters'
//! bodies and headers, order ids, errors a downstream wrote — reaches the
//! terminal with its hidden characters (escape sequences, `\r`, bidi
//! overrides, zero-width characters) shown as escapes
//! (`shardline_contract::text::shown_lines`), never obeyed. `--json` output
//! is printed as serde writes it: exact JSON, for programs (JSON escapes
//! controls itself; bidi and zero-width characters pass as they are).

use shardline_contract::text::{shown, shown_lines};

/// `println!` for text: [`line()`] of the formatted text.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::out::line(&format!($($arg)*))
    };
}
pub(crate) use say;

/// Prints `text` and a line break; its own line breaks are kept.
pub(crate) fn line(text: &str) {
    println!("{}", shown_lines(text));
}

/// Prints `text` as it ends (a table, a report).
pub(crate) fn text(text: &str) {
    print!("{}", shown_lines(text));
}

/// An error as the one line `error: …` shows it.
pub(crate) fn error_line(error: &str) -> String {
    shown(&error.replace('\n', " ")).into_owned()
}
