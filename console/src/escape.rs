//! The one escaping function of the console: every untrusted value (queue
//! and worker names, order ids, error texts, letter contents) goes through
//! [`text`] (or [`bytes`]) before it reaches a page. The page templates
//! apply it as their `shown` filter; its output is complete HTML (the five
//! characters escaped here), marked safe there so that the template engine
//! does not escape it a second time.
//!
//! Beyond HTML's five characters, what would make a value lie about itself
//! is shown as a visible escape: bidi overrides and isolates (which reorder
//! what follows them), zero-width and other invisible characters, control
//! characters (NUL included): the contract's one definition,
//! [`shardline_contract::text::hidden`]. Bytes that are not UTF-8 are shown
//! as hex.
//! Long values are cut.

use std::fmt::Write as _;

use shardline_contract::text::hidden;

/// Longest value in a table cell, in characters; longer ones end with `…`.
pub const CELL_CHARS: usize = 200;

/// `value` as HTML text (fit for an element's content and a quoted
/// attribute), at most `max_chars` of its characters, then `…`.
pub fn text(value: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(value.len().min(max_chars.saturating_mul(2)));
    if push(&mut out, value, max_chars) {
        out.push('…');
    }
    out
}

/// [`text`] of bytes: valid UTF-8 as text, every other byte as `\x{ff}`
/// (one character of the cap each).
pub fn bytes(value: &[u8], max_chars: usize) -> String {
    let mut out = String::new();
    let mut left = max_chars;
    for chunk in value.utf8_chunks() {
        let valid = chunk.valid();
        if push(&mut out, valid, left) {
            out.push('…');
            return out;
        }
        left -= valid.chars().count();
        for b in chunk.invalid() {
            if left == 0 {
                out.push('…');
                return out;
            }
            let _ = write!(out, "\\x{{{b:02x}}}");
            left -= 1;
        }
    }
    out
}

/// Pushes at most `max_chars` characters of `value`, escaped; true when
/// some were left out.
fn push(out: &mut String, value: &str, max_chars: usize) -> bool {
    for (n, c) in value.chars().enumerate() {
        if n == max_chars {
            return true;
        }
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if hidden(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an attacker would put in an order id, a worker name or an error.
    const CORPUS: &[(&str, &str)] = &[
        (
            "<script>alert(1)</script>",
            "&lt;script&gt;alert(1)&lt;/script&gt;",
        ),
        (
            "\"><img src=x onerror=alert(1)>",
            "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;",
        ),
        ("it's & <b>", "it&#39;s &amp; &lt;b&gt;"),
        // HTML escaped once, the control character shown.
        ("a&b<c\u{0007}", "a&amp;b&lt;c\\u{7}"),
        ("abc\u{202e}fdp.exe", "abc\\u{202e}fdp.exe"),
        (
            "\u{2066}a\u{2067}b\u{2068}c\u{2069}",
            "\\u{2066}a\\u{2067}b\\u{2068}c\\u{2069}",
        ),
        (
            "\u{202a}\u{202b}\u{202c}\u{202d}",
            "\\u{202a}\\u{202b}\\u{202c}\\u{202d}",
        ),
        (
            "a\u{200b}b\u{feff}c\u{200d}",
            "a\\u{200b}b\\u{feff}c\\u{200d}",
        ),
        ("nul\0here", "nul\\u{0}here"),
        (
            "line\nbreak\ttab\r\u{1b}[31m",
            "line\\u{a}break\\u{9}tab\\u{d}\\u{1b}[31m",
        ),
        ("\u{7f}\u{85}\u{9b}", "\\u{7f}\\u{85}\\u{9b}"),
        ("tag\u{e0041}", "tag\\u{e0041}"),
        ("order-77 naïve 注文 ✓", "order-77 naïve 注文 ✓"),
    ];

    #[test]
    fn the_hostile_corpus_is_shown_as_harmless_text() {
        for (input, shown) in CORPUS {
            let out = text(input, CELL_CHARS);
            assert_eq!(out, *shown, "{input:?}");
            assert!(!out.contains(['<', '>', '"', '\'', '\0']), "{out}");
            assert!(!out.chars().any(hidden), "{out:?}");
            assert_eq!(bytes(input.as_bytes(), CELL_CHARS), out, "{input:?}");
        }
    }

    #[test]
    fn bytes_that_are_not_utf8_are_shown_as_hex() {
        assert_eq!(bytes(b"ok\xff\xfe<", 100), "ok\\x{ff}\\x{fe}&lt;");
        // A truncated multi-byte character.
        assert_eq!(bytes(b"caf\xc3", 100), "caf\\x{c3}");
        assert_eq!(bytes(b"\xc3\xa9", 100), "é");
    }

    #[test]
    fn long_values_are_cut() {
        let long = "x".repeat(500);
        let out = text(&long, CELL_CHARS);
        assert_eq!(out.chars().count(), CELL_CHARS + 1);
        assert!(out.ends_with('…'));
        assert_eq!(text("abc", 3), "abc");
        assert_eq!(text("abcd", 3), "abc…");
        assert_eq!(bytes(b"abcd", 3), "abc…");
        assert_eq!(bytes(b"abc", 3), "abc");
        assert_eq!(bytes(b"ab\xff\xff", 3), "ab\\x{ff}…");
        // Cut by characters, never inside one.
        assert_eq!(text("éééé", 2), "éé…");
    }
}
