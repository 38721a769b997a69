//! The one redaction of every address shardline takes: AMQP URLs and address
//! lists, Redis and Sentinel URLs, the HTTP handler's URL, the management
//! API's URL, PostgreSQL URLs and `key=value` connection strings. Whatever
//! prints an address (logs, errors, `--help`, metrics, status JSON,
//! dead-letter headers, the console, `{:?}`) prints [`redact`] of it, and a
//! library's text that may echo one goes through [`scrub`].
//!
//! - `scheme://user:password@host…` shows as `scheme://user:***@host…`.
//! - A URL whose userinfo holds reserved characters typed raw (`/`, `#`, `?`,
//!   `@`: `amqp://u:s3/cr#t?x@host`) does not parse the way it was meant; it
//!   shows as its scheme and everything after its **last** `@`
//!   (`amqp://***@host`), whatever the characters.
//! - Query parameters and `key=value` pairs whose name holds `pass`,
//!   `secret` or `token` (`password`, `sentinel_password`) show as `name=***`,
//!   quoted values (`password='x y'`, `password = "x"`) included.
//! - Comma-separated lists are redacted address by address (a comma starts a
//!   new address only when a `scheme://` follows it).

use std::fmt;

/// What a hidden secret shows as.
pub const HIDDEN: &str = "***";

/// The advice an error about an address that does not parse ends with.
pub const PERCENT_ENCODE: &str = "percent-encode reserved characters in the user and password (`/` as %2F, `#` as %23, `?` as %3F, `@` as %40, `:` as %3A, `%` as %25)";

/// An address as given (for clients only), shown redacted: its
/// [`fmt::Display`] and [`fmt::Debug`] print [`redact`] of it, so a config or
/// a command line holding one can derive `Debug`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Redacted(String);

impl Redacted {
    pub fn new(address: impl Into<String>) -> Self {
        Self(address.into())
    }

    /// The address as given, password included: for clients, never for output.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn into_inner(self) -> String {
        self.0
    }
}

impl std::str::FromStr for Redacted {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s))
    }
}

impl fmt::Display for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact(&self.0))
    }
}

/// `text`, an address, address list or connection string, with every
/// password hidden.
pub fn redact(text: &str) -> String {
    if !text.contains("://") {
        return redact_key_values(text);
    }
    addresses(text)
        .into_iter()
        .map(|(separator, address)| format!("{separator}{}", redact_url(address)))
        .collect()
}

/// `text` with every password of `address` (as written and percent-decoded)
/// replaced by [`HIDDEN`], for a library's words that may echo it.
pub fn scrub(text: &str, address: &str) -> String {
    secrets(address)
        .iter()
        .fold(text.to_owned(), |text, secret| text.replace(secret, HIDDEN))
}

/// The passwords in `address`, as written and percent-decoded, longest
/// first, even when the address does not parse.
pub fn secrets(address: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    if address.contains("://") {
        for (_, url) in addresses(address) {
            let Some((_, rest)) = url.split_once("://") else {
                continue;
            };
            let (userinfo, _) = split_userinfo(rest);
            if let Some(userinfo) = userinfo {
                found.extend(passwords(userinfo, authority_holds_at(rest)));
            }
            if let Some((_, query)) = rest.split_once('?') {
                let query = query.split('#').next().unwrap_or(query);
                for pair in query.split('&') {
                    if let Some((name, value)) = pair.split_once('=')
                        && is_secret_name(name)
                    {
                        found.push(value.to_owned());
                    }
                }
            }
        }
    } else if !address.contains('=') {
        // `user:password@host` without a scheme: hidden up to its last `@`.
        if let Some((userinfo, _)) = address.rsplit_once('@') {
            found.push(
                userinfo
                    .split_once(':')
                    .map_or(userinfo, |(_, p)| p)
                    .to_owned(),
            );
        }
    } else {
        for (range, _) in secret_values(address) {
            let value = &address[range];
            found.push(value.to_owned());
            found.push(unquote(value));
        }
    }
    // A parser that stopped at a reserved character typed raw may echo a
    // piece of the password: the pieces of four characters or more go too.
    let pieces: Vec<String> = found
        .iter()
        .flat_map(|secret| secret.split(['/', '#', '?', '@', ':', '&', ' ', '\'', '"']))
        .filter(|piece| piece.chars().count() >= 4)
        .map(str::to_owned)
        .collect();
    let mut all: Vec<String> = found
        .into_iter()
        .chain(pieces)
        .flat_map(|raw| {
            let decoded = percent_encoding::percent_decode_str(&raw)
                .decode_utf8_lossy()
                .into_owned();
            [raw, decoded]
        })
        .filter(|p| !p.is_empty())
        .collect();
    all.sort_by_key(|p| std::cmp::Reverse(p.len()));
    all.dedup();
    all
}

/// The passwords a userinfo may hold. Which `@` ends the password is
/// ambiguous when there are several (one typed raw in the password, or
/// before the host): the password up to each of them; and, when the address
/// does not parse (`well_formed` false), the whole userinfo if it has no `:`.
fn passwords(userinfo: &str, well_formed: bool) -> Vec<String> {
    let password = |userinfo: &str| userinfo.split_once(':').map(|(_, p)| p.to_owned());
    let mut found: Vec<String> = userinfo
        .match_indices('@')
        .filter_map(|(at, _)| password(&userinfo[..at]))
        .collect();
    match password(userinfo) {
        Some(whole) => found.push(whole),
        None if !well_formed => found.push(userinfo.to_owned()),
        None => {}
    }
    found
}

/// The addresses of a list, each with the separator before it (empty for
/// the first): a comma starts a new address only before a `scheme://`.
fn addresses(text: &str) -> Vec<(&str, &str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    let mut start = 0;
    let mut separator = "";
    for (at, _) in text.match_indices(',') {
        let after = &text[at + 1..];
        let trimmed = after.trim_start();
        if starts_with_scheme(trimmed) {
            out.push((separator, &text[start..at]));
            let begins = at + 1 + (after.len() - trimmed.len());
            separator = &text[at..begins];
            start = begins;
        }
    }
    out.push((separator, &text[start..]));
    out
}

fn starts_with_scheme(text: &str) -> bool {
    let Some((scheme, _)) = text.split_once("://") else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// Whether the `@` that ends the userinfo lies in the authority as a parser
/// reads it (before the first `/`, `?` or `#`), with no `@` after it.
fn authority_holds_at(rest: &str) -> bool {
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest.rfind('@') {
        Some(at) => at < end,
        None => true,
    }
}

/// The userinfo of a URL's part after `://` and what follows it. When an `@`
/// comes after the first `/`, `?` or `#`, the userinfo is taken to hold raw
/// reserved characters: it runs up to the last `@`.
fn split_userinfo(rest: &str) -> (Option<&str>, &str) {
    match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    }
}

fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_key_values(url);
    };
    let (userinfo, after) = split_userinfo(rest);
    let shown_after = redact_query(after);
    match userinfo {
        None => format!("{scheme}://{shown_after}"),
        Some(userinfo) if authority_holds_at(rest) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:{HIDDEN}@{shown_after}"),
            None => format!("{scheme}://{userinfo}@{shown_after}"),
        },
        Some(_) => format!("{scheme}://{HIDDEN}@{shown_after}"),
    }
}

/// `after` (host, path, query, fragment) with secret query parameters hidden.
fn redact_query(after: &str) -> String {
    let Some((head, query)) = after.split_once('?') else {
        return after.to_owned();
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_name(name) => format!("{name}={HIDDEN}"),
            _ => pair.to_owned(),
        })
        .collect();
    let mut out = format!("{head}?{}", pairs.join("&"));
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

fn is_secret_name(name: &str) -> bool {
    let name = name.trim().to_ascii_lowercase();
    ["pass", "secret", "token"].iter().any(|s| name.contains(s))
}

/// A `key=value` string (libpq's form: values bare or quoted, spaces around
/// `=` allowed) with secret values hidden. Text without `=` that holds an `@`
/// (`user:password@host`) is hidden up to its last `@`.
fn redact_key_values(text: &str) -> String {
    if !text.contains('=') {
        return match text.rsplit_once('@') {
            Some((_, host)) => format!("{HIDDEN}@{host}"),
            None => text.to_owned(),
        };
    }
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    for (range, _) in secret_values(text) {
        out.push_str(&text[copied..range.start]);
        out.push_str(HIDDEN);
        copied = range.end;
    }
    out.push_str(&text[copied..]);
    out
}

/// The byte ranges of the values of secret keys in a `key=value` string, with
/// their keys.
fn secret_values(text: &str) -> Vec<(std::ops::Range<usize>, String)> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let mut at = 0;
    let skip_space = |mut at: usize| {
        while at < bytes.len() && bytes[at].is_ascii_whitespace() {
            at += 1;
        }
        at
    };
    while at < bytes.len() {
        at = skip_space(at);
        let key_start = at;
        while at < bytes.len() && !bytes[at].is_ascii_whitespace() && bytes[at] != b'=' {
            at += 1;
        }
        let key = &text[key_start..at];
        at = skip_space(at);
        if at >= bytes.len() || bytes[at] != b'=' {
            continue;
        }
        at = skip_space(at + 1);
        let value_start = at;
        match bytes.get(at) {
            Some(&quote @ (b'\'' | b'"')) => {
                at += 1;
                while at < bytes.len() && bytes[at] != quote {
                    at += if bytes[at] == b'\\' { 2 } else { 1 };
                }
                at = (at + 1).min(bytes.len());
            }
            _ => {
                while at < bytes.len() && !bytes[at].is_ascii_whitespace() {
                    at += 1;
                }
            }
        }
        if is_secret_name(key) && at > value_start {
            found.push((value_start..at, key.to_owned()));
        }
    }
    found
}

/// A `key=value` value without its quotes and escapes.
fn unquote(value: &str) -> String {
    let inner = value
        .strip_prefix(['\'', '"'])
        .map(|v| v.strip_suffix(['\'', '"']).unwrap_or(v))
        .unwrap_or(value);
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CASES: &[(&str, &str)] = &[
        // URLs with userinfo: the user stays, the password goes.
        (
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://guest:***@127.0.0.1:5672/%2f",
        ),
        (
            "amqps://u:p%2Fw@h/v?heartbeat=5",
            "amqps://u:***@h/v?heartbeat=5",
        ),
        ("amqp://127.0.0.1:5672", "amqp://127.0.0.1:5672"),
        ("amqp://user@host/vh", "amqp://user@host/vh"),
        (
            "redis://:pw@127.0.0.1:6379/2",
            "redis://:***@127.0.0.1:6379/2",
        ),
        (
            "rediss://:pw@h:6380/0#insecure",
            "rediss://:***@h:6380/0#insecure",
        ),
        (
            "http://user:CANARY@127.0.0.1:8080/hook",
            "http://user:***@127.0.0.1:8080/hook",
        ),
        (
            "https://admin:pw@mq:15671/api/",
            "https://admin:***@mq:15671/api/",
        ),
        (
            "postgres://app:pw@db:5432/orders?sslmode=disable",
            "postgres://app:***@db:5432/orders?sslmode=disable",
        ),
        (
            "postgres://db/orders?user=app&password=pw&x=1",
            "postgres://db/orders?user=app&password=***&x=1",
        ),
        (
            "postgresql://app:pw@h1:5432,h2:5433/orders",
            "postgresql://app:***@h1:5432,h2:5433/orders",
        ),
        // Sentinels: the primary's password and the Sentinels' own.
        (
            "redis+sentinel://:pw@s1,s2:26380/mymaster/1?sentinel_username=u&sentinel_password=spw",
            "redis+sentinel://:***@s1,s2:26380/mymaster/1?sentinel_username=u&sentinel_password=***",
        ),
        // Reserved characters typed raw: the scheme and what follows the last `@`.
        (
            "amqp://guest:s3/cr#t?x@127.0.0.1:5672/%2f",
            "amqp://***@127.0.0.1:5672/%2f",
        ),
        (
            "redis://:pa/ss@127.0.0.1:6390",
            "redis://***@127.0.0.1:6390",
        ),
        ("redis://:s3cr@t@h:6380/0", "redis://:***@h:6380/0"),
        ("amqp://u:p@ss/x@host/v", "amqp://***@host/v"),
        ("http://u:a?b#c@h/p", "http://***@h/p"),
        ("postgres://u:a/b@db/orders", "postgres://***@db/orders"),
        // Address lists.
        (
            "amqp://a:p,w@h1:5672/v, amqps://b:q@h2/v",
            "amqp://a:***@h1:5672/v, amqps://b:***@h2/v",
        ),
        (
            "amqp://a:x/y@h1/v,amqp://b:q@h2/v",
            "amqp://***@h1/v,amqp://b:***@h2/v",
        ),
        // PostgreSQL key=value strings.
        (
            "host=db user=app password=pw dbname=orders",
            "host=db user=app password=*** dbname=orders",
        ),
        (
            "host=db password='x y' dbname=orders",
            "host=db password=*** dbname=orders",
        ),
        (
            "host=db password = \"x y\" dbname=orders",
            "host=db password = *** dbname=orders",
        ),
        (
            "host=db password='it\\'s' user=a",
            "host=db password=*** user=a",
        ),
        ("host=db password='unterminated", "host=db password=***"),
        ("PASSWORD=pw host=db", "PASSWORD=*** host=db"),
        // No scheme.
        ("guest:pw@host:5672", "***@host:5672"),
        ("not a url", "not a url"),
        ("", ""),
    ];

    #[test]
    fn every_form_of_address_is_shown_without_its_password() {
        for (given, shown) in CASES {
            assert_eq!(redact(given), *shown, "redact({given:?})");
        }
    }

    #[test]
    fn a_canary_never_survives_redaction() {
        const C: &str = "CANARY7x";
        for given in [
            format!("amqp://u:{C}@h/v"),
            format!("amqp://u:{C}/#?@h/v"),
            format!("amqp://u:@{C}@h/v"),
            format!("amqp://h1/v,amqp://u:{C}/x@h2/v"),
            format!("redis://:{C}@h"),
            format!("redis+sentinel://h/m?sentinel_password={C}"),
            format!("http://u:{C}?x@h/p"),
            format!("postgres://u:{C}@h/db"),
            format!("postgres://h/db?password={C}"),
            format!("host=h password={C}"),
            format!("host=h password = '{C} x'"),
            format!("host=h password=\"{C}\""),
            format!("u:{C}@h"),
        ] {
            let shown = redact(&given);
            assert!(!shown.contains(C), "{given} shows as {shown}");
            let scrubbed = scrub(&format!("failed: {given} ({C})"), &given);
            assert!(!scrubbed.contains(C), "{given}: {scrubbed}");
        }
    }

    #[test]
    fn a_redacted_address_shows_redacted_and_is_kept_whole() {
        let address: Redacted = "amqp://u:s3/cr#t@h/v".parse().unwrap();
        assert_eq!(address.to_string(), "amqp://***@h/v");
        assert_eq!(format!("{address:?}"), "\"amqp://***@h/v\"");
        assert_eq!(address.expose(), "amqp://u:s3/cr#t@h/v");
    }

    #[test]
    fn a_password_is_scrubbed_whichever_at_ends_it() {
        // Found by the `redact` fuzz target: the last `@` is the path's, so
        // the userinfo taken runs past the password.
        let address = "s://:\0/?[/?/?@/@\0\0";
        assert_eq!(redact(address), "s://***@\0\0");
        let scrubbed = scrub("refused: \0/?[/?/? and more", address);
        assert!(!scrubbed.contains("\0/?[/?/?"), "{scrubbed}");
        // Found next: two `@` before the host, the password ends at the first.
        let address = "s://:\u{1}\u{1}\"\n%\u{e}:J\0@@\x0007\u{1}";
        assert_eq!(redact(address), "s://:***@\x0007\u{1}");
        let password = "\u{1}\u{1}\"\n%\u{e}:J\0";
        assert!(!scrub(password, address).contains(password));
        let address = "amqp://u:pass/word@h/v@x";
        assert!(secrets(address).contains(&"pass/word".to_owned()));
        assert_eq!(scrub("pass/word", address), HIDDEN);
    }

    #[test]
    fn secrets_are_found_as_written_and_decoded() {
        assert_eq!(secrets("amqp://u:p%21w@h/"), ["p%21w", "p!w"]);
        assert_eq!(secrets("host=h password='a b'"), ["'a b'", "a b"]);
        assert_eq!(secrets("amqp://u:s/x@h/"), ["s/x"]);
        assert_eq!(
            secrets("amqp://u:long/piece@h/"),
            ["long/piece", "piece", "long"]
        );
        assert!(secrets("amqp://h/").is_empty());
    }
}
