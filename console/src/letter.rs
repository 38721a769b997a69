//! A dead letter as its detail shows it: the index entry and, for an
//! admin, what only the DLQ holds (routing key, headers, the body as text
//! or hex, capped); or why there is none.

use std::sync::Arc;

use shardline_contract::letters::{IndexEntry, hex};
use shardline_ops::Letter;

/// The most of a letter's body the detail view shows, in bytes.
pub(crate) const BODY_CAP: usize = 64 * 1024;

/// A letter's body as the detail view shows it: text when it is UTF-8,
/// else hex; at most [`BODY_CAP`] bytes of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Body {
    pub(crate) text: String,
    pub(crate) hex: bool,
    pub(crate) bytes: usize,
    pub(crate) capped: bool,
}

impl Body {
    pub(crate) fn of(body: &[u8]) -> Self {
        let capped = body.len() > BODY_CAP;
        let (text, hex) = match std::str::from_utf8(body) {
            Ok(text) => (text.chars().take(BODY_CAP).collect(), false),
            Err(_) => (hex(&body[..body.len().min(BODY_CAP)]), true),
        };
        Self {
            text,
            hex,
            bytes: body.len(),
            capped,
        }
    }
}

/// One dead letter as the detail view shows it: its index entry and, for
/// an admin, what was read from the DLQ (the index holds no body).
#[derive(Debug, Clone)]
pub(crate) struct Detail {
    pub(crate) entry: IndexEntry,
    /// `None` for a read-only token: bodies and headers may hold customer
    /// data; the index's metadata is what a read-only user needs.
    pub(crate) contents: Option<Contents>,
}

/// What only the DLQ holds of a letter.
#[derive(Debug, Clone)]
pub(crate) struct Contents {
    pub(crate) routing_key: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Body,
}

impl Detail {
    pub(crate) fn of(letter: &Letter) -> Self {
        Self {
            entry: letter.entry(),
            contents: Some(Contents {
                routing_key: letter.routing_key().to_owned(),
                headers: letter.headers(),
                body: Body::of(letter.body()),
            }),
        }
    }
}

/// A letter's detail, or why there is none.
#[derive(Debug, Clone)]
pub(crate) enum Shown {
    Letter(Arc<Detail>),
    /// Not in the DLQ (an admin's read) or the index (a read-only one's).
    NotFound,
    /// Not within the first this many letters of the DLQ.
    NotWithin(usize),
}
