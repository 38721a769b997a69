//! Who may use the console: named tokens, each `admin` or `read-only`.
//!
//! The syntax, one token per line: `name:role:token`, role `admin` or
//! `read-only`; blank lines and lines starting with `#` are skipped. A token
//! has at least [`MIN_TOKEN_CHARS`] characters and no whitespace; names and
//! tokens are unique. A presented token is compared with every known token
//! in constant time.

use std::fmt;

use subtle::ConstantTimeEq as _;

/// Shortest token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Look and act (release a quarantined order; later replay and purge).
    Admin,
    /// Look only: every POST to an action is refused (403).
    ReadOnly,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::ReadOnly => "read-only",
        }
    }
}

/// A named token.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    pub name: String,
    pub role: Role,
    secret: String,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("name", &self.name)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl Token {
    /// A token named `name`; refused when the secret is too short or blank.
    pub fn new(name: &str, role: Role, secret: &str) -> Result<Self, TokenError> {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'))
        {
            return Err(TokenError::Name {
                name: format!("{name:?}"),
            });
        }
        if secret.chars().any(char::is_whitespace) {
            return Err(TokenError::Whitespace {
                name: name.to_owned(),
            });
        }
        let chars = secret.chars().count();
        if chars < MIN_TOKEN_CHARS {
            return Err(TokenError::TooShort {
                name: name.to_owned(),
                chars,
            });
        }
        Ok(Self {
            name: name.to_owned(),
            role,
            secret: secret.to_owned(),
        })
    }

    /// A random admin token named `generated` (128 bits, hex).
    pub fn generate() -> Self {
        Self {
            name: "generated".to_owned(),
            role: Role::Admin,
            secret: random_hex(),
        }
    }

    /// The secret itself, for the one login URL printed at start.
    pub fn secret(&self) -> &str {
        &self.secret
    }
}

/// 32 random hex digits from the thread's CSPRNG.
pub(crate) fn random_hex() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Why a token line was refused (it never shows the token).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("line {line}: expected `name:role:token`")]
    Syntax { line: usize },
    /// The role is never quoted: in a line with its fields swapped, it is
    /// the token.
    #[error(
        "line {line}: the role of {name} must be `admin` or `read-only` (a line is `name:role:token`)"
    )]
    Role { line: usize, name: String },
    #[error("token name {name}: use letters, digits, `-`, `_`, `.` or `@`")]
    Name { name: String },
    #[error("token {name} contains whitespace")]
    Whitespace { name: String },
    #[error("token {name} is {chars} characters long; at least {min} are required", min = MIN_TOKEN_CHARS)]
    TooShort { name: String, chars: usize },
    #[error("token name {name} is given twice")]
    DuplicateName { name: String },
    #[error("token {name} has the same secret as another token")]
    DuplicateSecret { name: String },
    #[error("line {line}: {source}")]
    Line {
        line: usize,
        #[source]
        source: Box<TokenError>,
    },
}

impl TokenError {
    /// The error naming its token as [`shown_name`] shows `name`.
    fn with_name(self, name: &str) -> Self {
        if name.chars().count() < MIN_TOKEN_CHARS {
            return self;
        }
        let shown = shown_name(name);
        match self {
            Self::Name { .. } => Self::Name { name: shown },
            Self::Whitespace { .. } => Self::Whitespace { name: shown },
            Self::TooShort { chars, .. } => Self::TooShort { name: shown, chars },
            Self::DuplicateName { .. } => Self::DuplicateName { name: shown },
            Self::DuplicateSecret { .. } => Self::DuplicateSecret { name: shown },
            Self::Role { line, .. } => Self::Role { line, name: shown },
            other => other,
        }
    }
}

/// A line's name as errors show it: not at all when it is as long as a
/// token, since in a line with its fields swapped it is the token.
fn shown_name(name: &str) -> String {
    match name.chars().count() < MIN_TOKEN_CHARS {
        true => name.to_owned(),
        false => "the line's first field (not shown: as long as a token; are the fields swapped?)"
            .to_owned(),
    }
}

/// The tokens the console accepts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens(Vec<Token>);

impl Tokens {
    /// Tokens in the syntax of this module; `;` separates lines as a newline
    /// does when `semicolons` (an environment variable holds one line).
    pub fn parse(text: &str, semicolons: bool) -> Result<Self, TokenError> {
        let mut tokens = Self::default();
        let lines: Vec<&str> = if semicolons {
            text.split(['\n', ';']).collect()
        } else {
            text.lines().collect()
        };
        for (n, line) in lines.into_iter().enumerate() {
            let line_no = n + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.splitn(3, ':');
            let (Some(name), Some(role), Some(secret)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(TokenError::Syntax { line: line_no });
            };
            let role = match role {
                "admin" => Role::Admin,
                "read-only" => Role::ReadOnly,
                _ => {
                    return Err(TokenError::Role {
                        line: line_no,
                        name: shown_name(name),
                    });
                }
            };
            let token = Token::new(name, role, secret).map_err(|e| TokenError::Line {
                line: line_no,
                source: Box::new(e.with_name(name)),
            })?;
            tokens.add(token).map_err(|e| e.with_name(name))?;
        }
        Ok(tokens)
    }

    /// Adds a token; names and secrets must be unique.
    pub fn add(&mut self, token: Token) -> Result<(), TokenError> {
        if self.0.iter().any(|t| t.name == token.name) {
            return Err(TokenError::DuplicateName { name: token.name });
        }
        if self.find(&token.secret).is_some() {
            return Err(TokenError::DuplicateSecret { name: token.name });
        }
        self.0.push(token);
        Ok(())
    }

    /// Both sets, refused where a name or a secret is in both.
    pub fn merge(mut self, other: Self) -> Result<Self, TokenError> {
        for token in other.0 {
            self.add(token)?;
        }
        Ok(self)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The token whose secret is `presented`. Every token is compared, each
    /// in constant time, so the time taken does not tell how much matched.
    pub fn find(&self, presented: &str) -> Option<&Token> {
        let mut found = None;
        for token in &self.0 {
            if bool::from(token.secret.as_bytes().ct_eq(presented.as_bytes())) {
                found = Some(token);
            }
        }
        found
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn lines_with_comments_and_both_roles() {
        let tokens = Tokens::parse(
            "# the on-call team\nops:admin:0123456789abcdef\n\n  viewer:read-only:abcdefghijklmnop:with:colons  \n",
            false,
        )
        .unwrap();
        assert_eq!(tokens.len(), 2);
        let ops = tokens.find("0123456789abcdef").unwrap();
        assert_eq!((ops.name.as_str(), ops.role), ("ops", Role::Admin));
        let viewer = tokens.find("abcdefghijklmnop:with:colons").unwrap();
        assert_eq!(viewer.role, Role::ReadOnly);
        assert!(tokens.find("0123456789abcde").is_none());
        assert!(tokens.find("").is_none());
    }

    #[test]
    fn semicolons_separate_lines_in_the_environment() {
        let tokens = Tokens::parse(
            "a:admin:aaaaaaaaaaaaaaaa;b:read-only:bbbbbbbbbbbbbbbb",
            true,
        )
        .unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(tokens.find("bbbbbbbbbbbbbbbb").unwrap().name, "b");
    }

    #[test]
    fn bad_lines_are_refused_without_showing_the_token() {
        let short = Tokens::parse("# c\nops:admin:short-secret", false).unwrap_err();
        assert_eq!(
            short.to_string(),
            "line 2: token ops is 12 characters long; at least 16 are required"
        );
        assert!(!short.to_string().contains("short-secret"));
        assert_eq!(
            Tokens::parse("ops-admin-0123456789abcdef", false).unwrap_err(),
            TokenError::Syntax { line: 1 }
        );
        assert!(matches!(
            Tokens::parse("ops:root:0123456789abcdef", false).unwrap_err(),
            TokenError::Role { .. }
        ));
        assert!(matches!(
            Tokens::parse("a:admin:0123456789abcdef\na:admin:fedcba9876543210", false).unwrap_err(),
            TokenError::DuplicateName { .. }
        ));
        assert!(matches!(
            Tokens::parse("a:admin:0123456789abcdef\nb:admin:0123456789abcdef", false).unwrap_err(),
            TokenError::DuplicateSecret { .. }
        ));
        assert!(Tokens::parse(":admin:0123456789abcdef", false).is_err());
        // Fields swapped: the token is in the role's or the name's place.
        const CANARY: &str = "CANARY0123456789abcdef";
        for line in [
            format!("ops:{CANARY}:admin"),
            format!("{CANARY}:admin:ops"),
            format!("{CANARY}:ops:admin"),
            format!("admin:{CANARY}:ops"),
            format!("read-only:ops:{CANARY}"),
            format!("{CANARY}:admin:{CANARY}x\n{CANARY}:admin:{CANARY}y"),
        ] {
            let e = Tokens::parse(&line, false).unwrap_err().to_string();
            assert!(!e.contains("CANARY"), "{line}: {e}");
        }
        assert!(Tokens::parse("a b:admin:0123456789abcdef", false).is_err());
    }

    #[test]
    fn a_generated_token_is_a_long_random_admin_token() {
        let (a, b) = (Token::generate(), Token::generate());
        assert_eq!((a.name.as_str(), a.role), ("generated", Role::Admin));
        assert_eq!(a.secret().len(), 32);
        assert_ne!(a.secret(), b.secret());
        assert!(!format!("{a:?}").contains(a.secret()));
    }
}
