//! Why a command did not succeed, and its exit code.

use crate::exit;

/// Why a command did not succeed, and the exit code that says so.
#[derive(Debug)]
pub struct Failure {
    /// The exit code (see [`exit`](crate::exit)).
    pub code: u8,
    /// What to tell the operator (credentials redacted).
    pub message: String,
    /// Whether the command's own output (its JSON document) was printed already.
    pub reported: bool,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            reported: false,
        }
    }

    /// The same failure, after the command printed its own result.
    pub(crate) fn reported(mut self) -> Self {
        self.reported = true;
        self
    }
}

pub(crate) type Outcome = Result<(), Failure>;

pub(crate) fn failed(err: impl std::fmt::Display) -> Failure {
    Failure::new(exit::FAILURE, err.to_string())
}
