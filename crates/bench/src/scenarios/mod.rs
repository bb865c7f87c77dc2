//! The scenarios, one module each, behind two small traits. A [`Scenario`] declares its
//! metrics and sets up its subjects: one per user target for the workloads on directories,
//! or its own variants (file counts, server counts) for those that start Freeflow clusters.
//! A [`Subject`] runs the workload once and returns one measurement per declared metric;
//! the runner interleaves subjects (A B A B ...) and drops each subject to tear it down.

mod chunk;
mod concurrent;
mod incast;
mod metadata;
mod random;
mod seq;
mod startup;
mod striping;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{SetupError, StepError};
use crate::json::{self, Value};
use crate::model::{Measurement, MetricSpec, Target};
use crate::sizes::Sizes;

/// Every scenario name, in the order a full run takes them.
pub const ALL: [&str; 8] = [
    "seq",
    "chunk",
    "concurrent-writers",
    "random",
    "metadata",
    "startup",
    "incast",
    "striping",
];

/// The scenario called `name`, sized by `sizes`; None for an unknown name.
pub fn by_name(name: &str, sizes: &Sizes) -> Option<Box<dyn Scenario>> {
    let scenario: Box<dyn Scenario> = match name {
        "seq" => Box::new(seq::Seq::new(sizes)),
        "chunk" => Box::new(chunk::Chunk::new(sizes)),
        "concurrent-writers" => Box::new(concurrent::ConcurrentWriters::new(sizes)),
        "random" => Box::new(random::Random::new(sizes)),
        "metadata" => Box::new(metadata::Metadata::new(sizes)),
        "startup" => Box::new(startup::Startup::new(sizes)),
        "incast" => Box::new(incast::Incast::new(sizes)),
        "striping" => Box::new(striping::Striping::new(sizes)),
        _ => return None,
    };
    Some(scenario)
}

pub trait Scenario {
    fn name(&self) -> &'static str;
    /// The sizes it runs with, for the report.
    fn parameters(&self) -> Vec<(String, Value)>;
    /// Every metric each run of each subject returns.
    fn metrics(&self) -> Vec<MetricSpec>;
    /// What is compared: a subject per target, or the scenario's own variants.
    fn subjects(
        &mut self,
        targets: &[Target],
        env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError>;
    /// Conditions a reader of the results must know, gathered after the runs.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

pub trait Subject {
    fn name(&self) -> String;
    /// One run; `repeat` is 1-based.
    fn run_once(&mut self, repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError>;
    /// Notes about this subject (e.g. "buffered I/O: O_DIRECT refused"), read after the runs.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

/// What every run may use: a runtime for the client library, the `freeflow` binary for
/// cluster scenarios, a scratch directory on disk, the progress line and cache dropping.
pub struct Env {
    pub runtime: tokio::runtime::Handle,
    pub freeflow_exe: PathBuf,
    pub scratch_dir: PathBuf,
    progress: indicatif::ProgressBar,
    prefix: Mutex<String>,
    caches: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    drops: u64,
    failure: Option<String>,
}

impl Env {
    pub fn new(
        runtime: tokio::runtime::Handle,
        freeflow_exe: PathBuf,
        scratch_dir: PathBuf,
        progress: indicatif::ProgressBar,
    ) -> Env {
        Env {
            runtime,
            freeflow_exe,
            scratch_dir,
            progress,
            prefix: Mutex::new(String::new()),
            caches: Mutex::new(CacheState::default()),
        }
    }

    pub fn scratch(&self) -> &Path {
        &self.scratch_dir
    }

    pub(crate) fn progress(&self) -> &indicatif::ProgressBar {
        &self.progress
    }

    /// Set what the progress line says is running (the runner sets the prefix).
    pub(crate) fn set_prefix(&self, prefix: String) {
        self.progress.set_message(prefix.clone());
        *self.prefix.lock().unwrap_or_else(|e| e.into_inner()) = prefix;
    }

    /// Show the step a run is in ("write 4K").
    pub fn step(&self, what: &str) {
        let prefix = self.prefix.lock().unwrap_or_else(|e| e.into_inner());
        self.progress.set_message(format!("{prefix} · {what}"));
    }

    /// Drop the page cache between a write and a read phase; the report records whether
    /// every drop could be made. Returns whether this one was.
    pub fn drop_caches(&self) -> bool {
        let result = crate::system::drop_caches();
        let mut state = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(()) => {
                state.drops += 1;
                true
            }
            Err(reason) => {
                state.failure.get_or_insert(reason);
                false
            }
        }
    }

    /// (drops made, first reason a drop could not be made).
    pub(crate) fn cache_outcome(&self) -> (u64, Option<String>) {
        let state = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        (state.drops, state.failure.clone())
    }
}

/// Make a fresh directory for one run under a target (never a reused name).
pub(crate) fn fresh_dir(base: &Path, prefix: &str) -> Result<PathBuf, StepError> {
    let path = base.join(crate::system::fresh_name(prefix));
    std::fs::create_dir(&path)
        .map_err(|error| StepError::new(format!("create directory {}", path.display()), error))?;
    Ok(path)
}

/// Check a target is a writable directory before a scenario relies on it.
pub(crate) fn check_target(target: &Target) -> Result<(), SetupError> {
    let failed = |message: String| SetupError::Failed {
        subject: target.name.clone(),
        error: StepError::new("check the target directory", message),
    };
    let metadata = std::fs::metadata(&target.path)
        .map_err(|error| failed(format!("{}: {error}", target.path.display())))?;
    if !metadata.is_dir() {
        return Err(failed(format!(
            "{} is not a directory",
            target.path.display()
        )));
    }
    Ok(())
}

/// Seconds from the earliest start to the latest end of workers' (start, end) intervals:
/// the phase's wall time as mdtest takes it, measured by the workers themselves so the
/// scheduling of the thread that waits for them does not count.
pub(crate) fn span_seconds(intervals: &[(std::time::Instant, std::time::Instant)]) -> f64 {
    let start = intervals.iter().map(|(start, _)| *start).min();
    let end = intervals.iter().map(|(_, end)| *end).max();
    match (start, end) {
        (Some(start), Some(end)) => end.duration_since(start).as_secs_f64(),
        _ => f64::NAN,
    }
}

/// A number for the parameters list.
pub(crate) fn parameter(name: &str, value: u64) -> (String, Value) {
    (name.to_string(), json::number(value as f64))
}

/// A list of numbers for the parameters list.
pub(crate) fn parameter_list(name: &str, values: impl IntoIterator<Item = u64>) -> (String, Value) {
    (
        name.to_string(),
        Value::Array(values.into_iter().map(|v| json::number(v as f64)).collect()),
    )
}

/// `4K`, `64K`, `1M`, `4M`: block sizes in metric names.
pub(crate) fn size_label(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{}M", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{}K", bytes >> 10)
    } else {
        format!("{bytes}B")
    }
}
