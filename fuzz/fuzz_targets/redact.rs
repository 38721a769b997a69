//! `cargo +nightly fuzz run redact`: the one redaction
//! (`shardline_connect::redact`).
//!
//! On any text, `redact`, `scrub`, `secrets` and `Redacted`'s `Display` and
//! `Debug` never panic. On a generated `scheme://user:PASSWORD@rest` (any
//! scheme and rest, any user without `:` — the first `:` is where the
//! password starts; a password of at least 8 characters, without `*` (the
//! mask's character) and not holding both `,` and `://`: such a one reads as
//! an address list by the redaction's rule, a comma before a `scheme://`
//! starts a new address), the password
//! as written and percent-decoded, each when it is 8 characters or more and
//! occurs nowhere else in the address, appears neither in `redact` of it, in
//! `Redacted`'s `Display` (its `Debug` is that text quoted), nor in `scrub`
//! of a text quoting the address and the password.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use shardline_connect::redact::{Redacted, redact, scrub, secrets};

#[derive(Debug, Arbitrary)]
struct Input {
    /// Any text, redacted as it is.
    text: String,
    scheme: String,
    user: String,
    password: String,
    rest: String,
}

/// A scheme as URLs have them: a letter, then letters, digits, `+`, `-`, `.`.
fn scheme(raw: &str) -> String {
    let kept: String = raw
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        .collect();
    format!("s{kept}")
}

fn never_panics(text: &str) {
    let _ = redact(text);
    let _ = scrub(text, text);
    let _ = secrets(text);
    let shown = Redacted::new(text);
    let _ = format!("{shown} {shown:?}");
}

fn decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

fuzz_target!(|input: Input| {
    never_panics(&input.text);

    let scheme = scheme(&input.scheme);
    let user = input.user.replace(':', "");
    let address = format!("{scheme}://{}:{}@{}", user, input.password, input.rest);
    never_panics(&address);
    let password = input.password.as_str();
    // A `*` could meet the mask `***` and its neighbours in the output.
    if password.chars().count() < 8
        || (password.contains(',') && password.contains("://"))
        || password.contains('*')
    {
        return;
    }
    let plain = decoded(password);
    let elsewhere = format!("{scheme}:{user}:{}", input.rest);
    let without = address.replacen(password, "", 1);
    // The password as written, and decoded, when long and found nowhere else.
    let hidden: Vec<&str> = [password, plain.as_str()]
        .into_iter()
        .filter(|p| p.chars().count() >= 8)
        .filter(|p| !elsewhere.contains(p) && !without.contains(p))
        .collect();
    let shown = Redacted::new(address.as_str());
    let quoted = format!("cannot connect to {address}: {password} / {plain} refused");
    // Debug quotes Display, so it shows what Display shows.
    assert_eq!(format!("{shown:?}"), format!("{:?}", shown.to_string()));
    for (what, output) in [
        ("redact", redact(&address)),
        ("Display", shown.to_string()),
        ("scrub", scrub(&quoted, &address)),
    ] {
        for secret in &hidden {
            assert!(
                !output.contains(secret),
                "{what} of {address:?} shows {secret:?}: {output:?}"
            );
        }
    }
});
