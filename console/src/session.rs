//! Login sessions, in this process's memory: a random session id (the
//! cookie's value) maps to the token's name and role and a CSRF token of the
//! session's own. Sessions end after [`SESSION_TTL`], at logout, and when the
//! console restarts.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::token::{Role, Token, random_hex};

/// How long a login lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 60 * 60);

/// The session cookie's name.
pub const COOKIE: &str = "shardline_session";

/// Who a request is from: a session's (with its CSRF token) or a bearer
/// token's (no CSRF token: a browser never sends the header by itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Principal {
    /// The token's name.
    pub name: String,
    pub role: Role,
    /// The session's CSRF token; `None` for `Authorization: Bearer`.
    pub csrf: Option<String>,
}

#[derive(Debug)]
struct Session {
    principal: Principal,
    expires: Instant,
}

/// The live sessions.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    by_id: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// A new session for `token`: its id (the cookie's value) and principal.
    pub(crate) fn open(&self, token: &Token) -> (String, Principal) {
        let id = format!("{}{}", random_hex(), random_hex());
        let principal = Principal {
            name: token.name.clone(),
            role: token.role,
            csrf: Some(format!("{}{}", random_hex(), random_hex())),
        };
        let now = Instant::now();
        let mut sessions = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
        sessions.retain(|_, s| s.expires > now);
        sessions.insert(
            id.clone(),
            Session {
                principal: principal.clone(),
                expires: now + SESSION_TTL,
            },
        );
        (id, principal)
    }

    /// The principal of a live session.
    pub(crate) fn get(&self, id: &str) -> Option<Principal> {
        let sessions = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
        sessions
            .get(id)
            .filter(|s| s.expires > Instant::now())
            .map(|s| s.principal.clone())
    }

    pub(crate) fn close(&self, id: &str) {
        self.by_id
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_session_maps_its_id_to_the_token_and_ends_at_logout() {
        let sessions = Sessions::default();
        let token = Token::new("ops", Role::ReadOnly, "0123456789abcdef").unwrap();
        let (id, principal) = sessions.open(&token);
        assert_eq!(id.len(), 64);
        assert_eq!(sessions.get(&id), Some(principal.clone()));
        assert_eq!(principal.role, Role::ReadOnly);
        assert_eq!(principal.csrf.as_ref().map(String::len), Some(64));
        let (other, second) = sessions.open(&token);
        assert_ne!(other, id);
        assert_ne!(second.csrf, principal.csrf, "a CSRF token per session");
        sessions.close(&id);
        assert_eq!(sessions.get(&id), None);
        assert!(sessions.get(&other).is_some());
        assert_eq!(sessions.get("guess"), None);
    }
}
