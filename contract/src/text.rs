//! Text from outside (order ids, event bodies, error texts, letter contents)
//! as a person reads it: the one definition of the characters that do not
//! show as themselves ([`hidden`]), and text with them escaped ([`shown`]).
//! Every place that prints such text uses them: `shardline receive`, the
//! worker's `--handler log` (as JSON escapes), the console's pages (as HTML).

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` does not show as itself: controls (C0, DEL, C1), bidi marks,
/// embeddings, overrides and isolates, zero-width and invisible formatting
/// characters, line and paragraph separators, tag characters. Printed as
/// they are, they forge lines, colours or the order of what follows them,
/// or hide.
pub fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00ad}'
                | '\u{061c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{2069}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// `text` with each [`hidden`] character escaped: `\n`, `\r`, `\t`, else
/// `\u{…}` in hex (`\u{1b}`, `\u{202e}`); the rest as is (borrowed when
/// nothing is hidden). The result is one line.
pub fn shown(text: &str) -> Cow<'_, str> {
    let Some(first) = text.find(hidden) else {
        return Cow::Borrowed(text);
    };
    let mut out = String::with_capacity(text.len() + 8);
    out.push_str(&text[..first]);
    for c in text[first..].chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hidden(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Text of several lines with each [`hidden`] character but the line feed
/// escaped as [`shown`] does: what a terminal may print of text from
/// outside (a `\r`, an escape sequence or a bidi override shows as its
/// escape, never obeyed).
pub fn shown_lines(text: &str) -> Cow<'_, str> {
    if !text.contains(|c: char| c != '\n' && hidden(c)) {
        return Cow::Borrowed(text);
    }
    let lines: Vec<Cow<'_, str>> = text.split('\n').map(shown).collect();
    Cow::Owned(lines.join("\n"))
}

/// JSON text as one line that shows what it holds: whitespace between
/// tokens dropped, and each [`hidden`] character written as a JSON `\u`
/// escape (a pair for one beyond U+FFFF). Valid JSON stays valid and means
/// the same (a hidden character of valid JSON is in a string, where the
/// escape stands for it); any other text still becomes one line.
pub fn json_line(json: &str) -> Cow<'_, str> {
    let plain = |c: char| !hidden(c) && !matches!(c, ' ' | '\t' | '\n' | '\r');
    if json.chars().all(plain) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in json.chars() {
        if !in_string && matches!(c, ' ' | '\t' | '\n' | '\r') {
            continue;
        }
        if hidden(c) {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{unit:04x}");
            }
            escaped = false;
            continue;
        }
        if in_string {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => escaped = false,
            }
        } else if c == '"' {
            in_string = true;
        }
        out.push(c);
    }
    Cow::Owned(out)
}

/// An error with its causes, `: `-separated, each cause once (some errors
/// repeat their source in their own message): the one line every crate
/// logs or returns for an error chain.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Failed(&'static str, Option<Box<Failed>>);

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Failed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|e| e as &(dyn std::error::Error + 'static))
        }
    }

    #[test]
    fn a_chain_names_each_cause_once() {
        let refused = Failed("connection refused", None);
        let io = Failed("io error: connection refused", Some(Box::new(refused)));
        let top = Failed("cannot connect", Some(Box::new(io)));
        assert_eq!(chain(&top), "cannot connect: io error: connection refused");
    }

    #[test]
    fn lines_stay_lines_and_nothing_else_is_obeyed() {
        assert_eq!(shown_lines("a\nb"), "a\nb");
        assert!(matches!(shown_lines("plain\ntext"), Cow::Borrowed(_)));
        assert_eq!(
            shown_lines("x\u{1b}]0;title\u{7}\r\ny\u{202e}z"),
            "x\\u{1b}]0;title\\u{7}\\r\ny\\u{202e}z"
        );
    }

    #[test]
    fn hidden_characters_are_shown_as_escapes() {
        for (input, want) in [
            ("order-77 naïve 注文 ✓", "order-77 naïve 注文 ✓"),
            ("line\nbreak\ttab\r", "line\\nbreak\\ttab\\r"),
            ("\u{1b}[31mred", "\\u{1b}[31mred"),
            ("nul\0", "nul\\u{0}"),
            ("\u{7f}\u{85}\u{9b}", "\\u{7f}\\u{85}\\u{9b}"),
            ("abc\u{202e}fdp.exe", "abc\\u{202e}fdp.exe"),
            ("\u{2066}a\u{2069}", "\\u{2066}a\\u{2069}"),
            ("a\u{2028}b\u{2029}c", "a\\u{2028}b\\u{2029}c"),
            ("a\u{200b}b\u{feff}c\u{ad}", "a\\u{200b}b\\u{feff}c\\u{ad}"),
            ("tag\u{e0041}", "tag\\u{e0041}"),
            // Backslashes are the text's own.
            ("C:\\dir \\u{1b}", "C:\\dir \\u{1b}"),
        ] {
            let out = shown(input);
            assert_eq!(out, want, "{input:?}");
            assert!(!out.chars().any(hidden), "{out:?}");
            assert!(!out.contains(['\n', '\r']));
        }
        assert!(matches!(shown("plain"), Cow::Borrowed("plain")));
    }

    /// Bodies a publisher could send to forge lines of `--handler log` or
    /// hide what they hold.
    const HOSTILE_JSON: &[(&str, &str)] = &[
        // Lines forged in the whitespace between tokens.
        (
            "{\"order_id\":\"A\",\n\"event\":\"e\"\r\n,\t\"seq\" : 1 }",
            r#"{"order_id":"A","event":"e","seq":1}"#,
        ),
        (
            "{\"a\":\"x\"}\n{\"forged\":true}",
            r#"{"a":"x"}{"forged":true}"#,
        ),
        // C1 controls and separators raw in strings.
        (
            "{\"a\":\"x\u{85}y\u{9b}31m\"}",
            r#"{"a":"x\u0085y\u009b31m"}"#,
        ),
        (
            "{\"a\":\"x\u{2028}y\u{2029}\"}",
            r#"{"a":"x\u2028y\u2029"}"#,
        ),
        (
            "{\"file\":\"abc\u{202e}fdp.exe\",\"k\u{200b}\":1}",
            r#"{"file":"abc\u202efdp.exe","k\u200b":1}"#,
        ),
        ("{\"t\":\"\u{e0041}\"}", r#"{"t":"\udb40\udc41"}"#),
        ("{\"d\":\"\u{7f}\"}", r#"{"d":"\u007f"}"#),
        // Escapes are JSON's own: kept, and the string ends where it ends.
        (
            r#"{"a":"\u001b[31m \" } \\", "b" : "\n"}"#,
            r#"{"a":"\u001b[31m \" } \\","b":"\n"}"#,
        ),
        // Spaces in strings are kept.
        ("{ \"a b\" : \" c  d \" }", r#"{"a b":" c  d "}"#),
    ];

    #[test]
    fn json_lines_are_one_line_and_mean_the_same() {
        for (input, want) in HOSTILE_JSON {
            let out = json_line(input);
            assert_eq!(out, *want, "{input:?}");
            assert!(!out.chars().any(hidden), "{out:?}");
            assert!(!out.contains(['\n', '\r']));
            // Valid JSON stays valid, with the same values.
            let values = |json: &str| {
                serde_json::Deserializer::from_str(json)
                    .into_iter::<serde_json::Value>()
                    .collect::<Result<Vec<_>, _>>()
                    .unwrap()
            };
            assert_eq!(values(input), values(&out), "{input:?}");
        }
        assert!(matches!(json_line(r#"{"a":1}"#), Cow::Borrowed(_)));
        // Not JSON: still one line.
        let out = json_line("\"open \n\u{85}\u{2028}");
        assert!(!out.contains('\n') && !out.chars().any(hidden), "{out:?}");
    }
}
