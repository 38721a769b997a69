//! What can stop the console: a setting it refuses (naming the field, never
//! a flag), or the listener failing.

/// Why the console did not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config field is unusable; the message starts with the field.
    #[error("{message}")]
    Config {
        field: &'static str,
        message: String,
    },
    /// The listener failed.
    #[error("serving the console: {0}")]
    Serve(#[from] std::io::Error),
}

impl Error {
    /// Whether a config field was refused as given: a front end reports a
    /// usage error (the command line exits 2); a listener that fails is not.
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Config { .. })
    }

    /// The message with the config field renamed (the command line names
    /// its flag).
    pub fn rename_field(&self, rename: impl Fn(&str) -> String) -> String {
        match self {
            Self::Config { field, message } => match message.strip_prefix(field) {
                Some(rest) => format!("{}{rest}", rename(field)),
                None => message.replace(field, &rename(field)),
            },
            other => other.to_string(),
        }
    }
}
