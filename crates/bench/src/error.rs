//! Errors at the bench's two boundaries: a step of a run that failed (`StepError`, which the
//! runner records against the scenario and subject and continues), and a run that cannot
//! start or be saved at all (`BenchError`). Every message names the target and the step, so
//! a failure on a peer's mount says which mount and which system call.

use std::fmt::Display;
use std::path::PathBuf;

/// One step of one run failed: `step` says what was being done ("write 4K block size",
/// "start I/O server 1"), `message` why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{step}: {message}")]
pub struct StepError {
    pub step: String,
    pub message: String,
}

impl StepError {
    pub fn new(step: impl Into<String>, message: impl Display) -> StepError {
        StepError {
            step: step.into(),
            message: message.to_string(),
        }
    }
}

/// `.step("what")` on any result: the error becomes a `StepError` naming the step.
pub trait StepContext<T> {
    fn step(self, step: impl Into<String>) -> Result<T, StepError>;
}

impl<T, E: Display> StepContext<T> for Result<T, E> {
    fn step(self, step: impl Into<String>) -> Result<T, StepError> {
        self.map_err(|error| StepError::new(step, error))
    }
}

/// Why a scenario did not produce subjects: skipped on purpose, or failed to set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupError {
    /// The scenario cannot run here (not root, no `ip netns`); the reason goes in the report.
    Skip(String),
    /// Setting up a subject failed (a target directory missing, a cluster that did not start).
    Failed { subject: String, error: StepError },
}

impl From<(String, StepError)> for SetupError {
    fn from((subject, error): (String, StepError)) -> SetupError {
        SetupError::Failed { subject, error }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("unknown scenario {0:?} (known: {1})")]
    UnknownScenario(String, String),
    #[error("bad option: {0}")]
    Usage(String),
    #[error("target {name}: {path}: {message}")]
    Target {
        name: String,
        path: PathBuf,
        message: String,
    },
    #[error("cannot write {path}: {source}")]
    Output {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create a scratch directory under {path}: {source}")]
    Scratch {
        path: PathBuf,
        source: std::io::Error,
    },
}
