//! One streaming pass over a JSON body (docs/semantics.md §2): whether it is
//! JSON, what it is at its top level, how deeply it is nested, and the
//! envelope fields of its top-level object (`order_id`, `event`, `seq` or
//! `version`), whether or not it is a valid envelope and however deep it is.
//!
//! No recursion and no tree: the pass keeps one byte per array or object
//! open around it and copies nothing but the values it extracts (and a
//! top-level key with escapes), so it is linear in the body and cannot run
//! out of stack. What it reads as JSON is what serde_json reads when it
//! skips a value (RFC 8259; a `\u` escape of a lone surrogate is not
//! checked), at any depth.

use std::borrow::Cow;

/// What a JSON text is at its top level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Object,
    Array,
    String,
    Number,
    Bool,
    Null,
}

impl Kind {
    /// The kind as a message names it: `an object`, `an array`, `a string`…
    pub fn described(self) -> &'static str {
        match self {
            Self::Object => "an object",
            Self::Array => "an array",
            Self::String => "a string",
            Self::Number => "a number",
            Self::Bool => "a boolean",
            Self::Null => "null",
        }
    }
}

/// A JSON body's outline ([`outline`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outline<'a> {
    pub kind: Kind,
    /// The deepest nesting of arrays and objects: 0 for a scalar, 1 for `{}`
    /// or `[1]`, 2 for `{"data":{}}`.
    pub depth: usize,
    /// The top-level object's `order_id`, when it is a string (of a key
    /// given twice, the last value counts).
    pub order_id: Option<Cow<'a, str>>,
    /// The top-level object's `event`, when it is a string.
    pub event: Option<Cow<'a, str>>,
    /// The top-level object's `seq`, or when it has none (or `null`) its
    /// `version`: when that is an integer from 0 to 2^64−1 (without fraction
    /// or exponent).
    pub seq: Option<u64>,
}

impl Outline<'_> {
    /// The outline of a body that is UTF-8 JSON; `None` for any other body.
    pub fn of(body: &[u8]) -> Option<Outline<'_>> {
        outline(std::str::from_utf8(body).ok()?).ok()
    }
}

/// Where a text stops being JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} at byte {at}")]
pub struct NotJson {
    /// What was wrong (`expected a value`, `end of input in a string`…).
    pub what: &'static str,
    /// Its offset in the text.
    pub at: usize,
}

/// Reads `text` once, start to end: its [`Outline`], or where it stops being
/// JSON.
pub fn outline(text: &str) -> Result<Outline<'_>, NotJson> {
    let mut scan = Scanner { text, at: 0 };
    // The arrays and objects open around the current position.
    let mut open: Vec<Open> = Vec::new();
    let mut found = Found::default();
    let mut depth = 0;
    let mut kind = None;
    // The top-level field whose value comes next.
    let mut field: Option<Field> = None;
    loop {
        // A value is due.
        scan.skip_whitespace();
        let Some(first) = scan.peek() else {
            return scan.fail("end of input where a value was due");
        };
        let capture = field.take();
        let met = match first {
            b'{' | b'[' => {
                scan.at += 1;
                let (this, close) = if first == b'{' {
                    (Open::Object, b'}')
                } else {
                    (Open::Array, b']')
                };
                kind.get_or_insert(if this == Open::Object {
                    Kind::Object
                } else {
                    Kind::Array
                });
                if let Some(capture) = capture {
                    found.set(capture, Met::Other);
                }
                open.push(this);
                depth = depth.max(open.len());
                scan.skip_whitespace();
                if scan.peek() == Some(close) {
                    scan.at += 1;
                    open.pop();
                } else {
                    if this == Open::Object {
                        field = scan.key(open.len() == 1)?;
                    }
                    continue;
                }
                None
            }
            b'"' => {
                kind.get_or_insert(Kind::String);
                Some(Met::Text(scan.string(capture.is_some())?))
            }
            b'-' | b'0'..=b'9' => {
                kind.get_or_insert(Kind::Number);
                Some(Met::Number(scan.number()?))
            }
            b't' | b'f' => {
                kind.get_or_insert(Kind::Bool);
                scan.word(if first == b't' { "true" } else { "false" })?;
                Some(Met::Other)
            }
            b'n' => {
                kind.get_or_insert(Kind::Null);
                scan.word("null")?;
                Some(Met::Null)
            }
            _ => return scan.fail("expected a value"),
        };
        if let (Some(capture), Some(met)) = (capture, met) {
            found.set(capture, met);
        }
        // After a value: close what ends here, then the next element.
        loop {
            scan.skip_whitespace();
            let Some(&inner) = open.last() else {
                if scan.peek().is_some() {
                    return scan.fail("characters after the value");
                }
                return Ok(Outline {
                    // Set by the first value, which was read.
                    kind: kind.unwrap_or(Kind::Null),
                    depth,
                    seq: found.seq(),
                    order_id: found.order_id,
                    event: found.event,
                });
            };
            match (scan.peek(), inner) {
                (Some(b','), Open::Object) => {
                    scan.at += 1;
                    scan.skip_whitespace();
                    field = scan.key(open.len() == 1)?;
                    break;
                }
                (Some(b','), Open::Array) => {
                    scan.at += 1;
                    break;
                }
                (Some(b'}'), Open::Object) | (Some(b']'), Open::Array) => {
                    scan.at += 1;
                    open.pop();
                }
                (None, _) => return scan.fail("end of input in an array or object"),
                (_, Open::Object) => return scan.fail("expected `,` or `}`"),
                (_, Open::Array) => return scan.fail("expected `,` or `]`"),
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Object,
    Array,
}

/// A top-level field the outline extracts.
#[derive(Debug, Clone, Copy)]
enum Field {
    OrderId,
    Event,
    Seq,
    Version,
}

impl Field {
    fn of(key: &str) -> Option<Self> {
        match key {
            "order_id" => Some(Self::OrderId),
            "event" => Some(Self::Event),
            "seq" => Some(Self::Seq),
            "version" => Some(Self::Version),
            _ => None,
        }
    }
}

/// A value met for a field: a string (`None`: one with a lone surrogate), a
/// number (the integer it is, when one), `null`, or anything else.
enum Met<'a> {
    Text(Option<Cow<'a, str>>),
    Number(Option<u64>),
    Null,
    Other,
}

/// A `seq` or `version` as met: absent, `null`, or a value (the integer it
/// is, when one).
#[derive(Debug, Clone, Copy, Default)]
enum Slot {
    #[default]
    Absent,
    Null,
    Value(Option<u64>),
}

#[derive(Default)]
struct Found<'a> {
    order_id: Option<Cow<'a, str>>,
    event: Option<Cow<'a, str>>,
    seq: Slot,
    version: Slot,
}

impl<'a> Found<'a> {
    fn set(&mut self, field: Field, met: Met<'a>) {
        let slot = match &met {
            Met::Null => Slot::Null,
            Met::Number(n) => Slot::Value(*n),
            Met::Text(_) | Met::Other => Slot::Value(None),
        };
        let text = match met {
            Met::Text(text) => text,
            _ => None,
        };
        match field {
            Field::OrderId => self.order_id = text,
            Field::Event => self.event = text,
            Field::Seq => self.seq = slot,
            Field::Version => self.version = slot,
        }
    }

    fn seq(&self) -> Option<u64> {
        match (self.seq, self.version) {
            (Slot::Value(seq), _) => seq,
            (_, Slot::Value(version)) => version,
            _ => None,
        }
    }
}

struct Scanner<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn fail<T>(&self, what: &'static str) -> Result<T, NotJson> {
        Err(NotJson { what, at: self.at })
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// An object's key and its colon; the field it names when `top` (the
    /// key of the top-level object).
    fn key(&mut self, top: bool) -> Result<Option<Field>, NotJson> {
        if self.peek() != Some(b'"') {
            return self.fail("expected a string key");
        }
        let key = self.string(top)?;
        self.skip_whitespace();
        if self.peek() != Some(b':') {
            return self.fail("expected `:`");
        }
        self.at += 1;
        Ok(key.as_deref().and_then(Field::of))
    }

    /// `word` (`true`, `false`, `null`), which the text has here.
    fn word(&mut self, word: &str) -> Result<(), NotJson> {
        let rest = self.text.as_bytes().get(self.at..).unwrap_or_default();
        if rest.starts_with(word.as_bytes()) {
            self.at += word.len();
            Ok(())
        } else {
            self.fail("expected a value")
        }
    }

    /// A number; the integer it is when it has no sign, fraction or
    /// exponent and fits 64 bits.
    fn number(&mut self) -> Result<Option<u64>, NotJson> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.at += 1;
        }
        let start = self.at;
        match self.peek() {
            Some(b'0') => {
                self.at += 1;
                if matches!(self.peek(), Some(b'0'..=b'9')) {
                    return self.fail("a number with a leading zero");
                }
            }
            Some(b'1'..=b'9') => self.digits(),
            _ => return self.fail("expected a digit"),
        }
        let end = self.at;
        let mut integer = !negative;
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.some_digits()?;
            integer = false;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.some_digits()?;
            integer = false;
        }
        Ok(integer
            .then(|| self.text.get(start..end)?.parse().ok())
            .flatten())
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
    }

    fn some_digits(&mut self) -> Result<(), NotJson> {
        if !matches!(self.peek(), Some(b'0'..=b'9')) {
            return self.fail("expected a digit");
        }
        self.digits();
        Ok(())
    }

    /// A string, at its opening quote. When `decode`, its value (`None` when
    /// it holds a lone surrogate); else it is only checked.
    fn string(&mut self, decode: bool) -> Result<Option<Cow<'a, str>>, NotJson> {
        self.at += 1;
        let mut text = Unescaped {
            decode,
            run: self.at,
            owned: None,
            high: None,
            valid: true,
        };
        loop {
            match self.peek() {
                None => return self.fail("end of input in a string"),
                Some(b'"') => {
                    let end = self.at;
                    text.end_run(self.text, end, false);
                    self.at += 1;
                    return Ok(text.value(self.text, end));
                }
                Some(b'\\') => {
                    text.end_run(self.text, self.at, true);
                    self.at += 1;
                    let unit = self.escape()?;
                    text.push(unit);
                    text.run = self.at;
                }
                Some(0..0x20) => return self.fail("a control character in a string"),
                Some(_) => self.at += 1,
            }
        }
    }

    /// An escape, after its backslash: the UTF-16 unit it stands for.
    fn escape(&mut self) -> Result<u16, NotJson> {
        let Some(letter) = self.peek() else {
            return self.fail("end of input in a string");
        };
        self.at += 1;
        Ok(match letter {
            b'"' | b'\\' | b'/' => u16::from(letter),
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => u16::from(b'\n'),
            b'r' => u16::from(b'\r'),
            b't' => u16::from(b'\t'),
            b'u' => {
                let hex = self
                    .text
                    .get(self.at..self.at + 4)
                    .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
                    .and_then(|h| u16::from_str_radix(h, 16).ok());
                let Some(unit) = hex else {
                    return self.fail("a `\\u` escape without four hex digits");
                };
                self.at += 4;
                unit
            }
            _ => {
                self.at -= 1;
                return self.fail("an invalid escape");
            }
        })
    }
}

/// A string's value as it is read, run of text by escape.
struct Unescaped {
    decode: bool,
    /// Where the current run of text without escapes starts.
    run: usize,
    /// The value so far, once an escape was met.
    owned: Option<String>,
    /// A high surrogate waiting for its low half.
    high: Option<u16>,
    /// False once a lone surrogate was met.
    valid: bool,
}

impl Unescaped {
    /// Ends the run of text at `end`: at an escape (`escape`) or the
    /// closing quote.
    fn end_run(&mut self, text: &str, end: usize, escape: bool) {
        if !self.decode {
            return;
        }
        if end > self.run && self.high.take().is_some() {
            self.valid = false;
        }
        if escape || self.owned.is_some() {
            // Runs start and end at ASCII bytes: character boundaries.
            let run = text.get(self.run..end).unwrap_or_default();
            self.owned.get_or_insert_with(String::new).push_str(run);
        }
    }

    fn push(&mut self, unit: u16) {
        if !self.decode {
            return;
        }
        let owned = self.owned.get_or_insert_with(String::new);
        let unit = u32::from(unit);
        let c = match (self.high.take(), unit) {
            (Some(high), 0xdc00..=0xdfff) => {
                char::from_u32(0x10000 + ((u32::from(high) - 0xd800) << 10) + (unit - 0xdc00))
            }
            (Some(_), _) | (None, 0xdc00..=0xdfff) => None,
            (None, 0xd800..=0xdbff) => {
                self.high = u16::try_from(unit).ok();
                return;
            }
            (None, _) => char::from_u32(unit),
        };
        match c {
            Some(c) => owned.push(c),
            None => self.valid = false,
        }
    }

    /// The value of the string that closes at `end`.
    fn value(self, text: &str, end: usize) -> Option<Cow<'_, str>> {
        if !self.decode || !self.valid || self.high.is_some() {
            return None;
        }
        match self.owned {
            Some(owned) => Some(Cow::Owned(owned)),
            // No escape: the text between the quotes as it is.
            None => text.get(self.run..end).map(Cow::Borrowed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(text: &str) -> (Option<String>, Option<String>, Option<u64>) {
        let o = outline(text).unwrap();
        (
            o.order_id.map(Cow::into_owned),
            o.event.map(Cow::into_owned),
            o.seq,
        )
    }

    #[test]
    fn the_envelope_fields_of_the_top_level_object() {
        assert_eq!(
            fields(r#"{"order_id":"A1","event":"e","seq":3,"data":{"order_id":"B"}}"#),
            (Some("A1".into()), Some("e".into()), Some(3))
        );
        // `version` when there is no `seq`, or a `null` one.
        assert_eq!(fields(r#"{"version":4}"#).2, Some(4));
        assert_eq!(fields(r#"{"seq":null,"version":4}"#).2, Some(4));
        assert_eq!(fields(r#"{"seq":"3","version":4}"#).2, None);
        // Of a key given twice, the last value counts.
        assert_eq!(
            fields(r#"{"order_id":"A","order_id":"B"}"#).0.as_deref(),
            Some("B")
        );
        assert_eq!(fields(r#"{"order_id":"A","order_id":7}"#).0, None);
        // Escapes are decoded, in keys too.
        assert_eq!(
            fields(r#"{"order\u005fid":"A\"1\u00e9\ud83d\ude00","event":"\n"}"#),
            (Some("A\"1é😀".into()), Some("\n".into()), None)
        );
        // A lone surrogate is JSON, but no string.
        assert_eq!(fields(r#"{"order_id":"A\ud800"}"#).0, None);
        assert_eq!(fields(r#"{"order_id":"A\udc00"}"#).0, None);
        assert_eq!(fields(r#"{"order_id":"\ud800A"}"#).0, None);
        // Only integers that fit 64 bits.
        for (seq, want) in [
            ("0", Some(0)),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("-1", None),
            ("-0", None),
            ("3.0", None),
            ("3e0", None),
            ("{}", None),
            ("true", None),
        ] {
            assert_eq!(fields(&format!(r#"{{"seq":{seq}}}"#)).2, want, "{seq}");
        }
        // Not the top-level object's: none.
        assert_eq!(
            fields(r#"[{"order_id":"A","event":"e","seq":1}]"#),
            (None, None, None)
        );
    }

    #[test]
    fn kind_and_depth() {
        for (text, kind, depth) in [
            ("{}", Kind::Object, 1),
            (" [1, [2, {\"a\": [ ]}]] ", Kind::Array, 4),
            ("\"x\"", Kind::String, 0),
            ("-1.5e3", Kind::Number, 0),
            ("false", Kind::Bool, 0),
            ("null", Kind::Null, 0),
        ] {
            let o = outline(text).unwrap();
            assert_eq!((o.kind, o.depth), (kind, depth), "{text}");
        }
    }

    #[test]
    fn any_depth_without_recursion() {
        let n = 100_000;
        let body = format!(
            r#"{{"order_id":"deep","event":"e","seq":2,"data":{}{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        );
        let o = outline(&body).unwrap();
        assert_eq!(o.depth, n + 1);
        assert_eq!(o.order_id.as_deref(), Some("deep"));
        assert_eq!(o.seq, Some(2));
        assert!(outline(&"[".repeat(n)).is_err());
    }

    #[test]
    fn what_is_not_json() {
        for text in [
            "",
            " ",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{,}",
            "{1:2}",
            "[1,]",
            "[1 2]",
            "[}",
            "{]",
            "01",
            "-",
            "1.",
            ".5",
            "1e",
            "1e+",
            "tru",
            "nul",
            "True",
            "\"a",
            "\"a\\\"",
            "\"\\x\"",
            "\"\\u12\"",
            "\"\\u12G4\"",
            "\"tab\there\"",
            "{} x",
            "{}{}",
            "NaN",
            "'a'",
            "\u{feff}{}",
        ] {
            assert!(outline(text).is_err(), "{text:?}");
        }
        let err = outline(r#"{"order_id":"A","#).unwrap_err();
        assert_eq!(err.to_string(), "expected a string key at byte 16");
    }
}
