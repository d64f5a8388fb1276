//! A string that must never reach a log line: database URLs (they may carry a password) and
//! broker credentials. A leaf module: configuration, credentials, the broker adapter and the
//! database layer all hold secrets without depending on each other for the type.

use std::fmt;

/// A string whose `Debug` prints `Secret(<redacted>)` and which has no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself; call only where it is handed to the library that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}
