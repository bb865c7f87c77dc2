//! The run loop: each scenario sets up its subjects, then runs them interleaved (repeat 1 of
//! A, B, C, then repeat 2 of A, B, C, ...) so that slow drift of this noisy 2-core machine
//! (other builds, page cache reclaim) spreads over all subjects instead of biasing one.
//! A failed run is recorded and the loop goes on; the statistics are made at the end.

use std::path::PathBuf;
use std::time::Instant;

use crate::error::{BenchError, SetupError};
use crate::model::{
    summarise, CacheReport, HostInfo, MetricReport, Report, RunFailure, ScenarioReport, Target,
    TargetInfo,
};
use crate::scenarios::{self, Env};
use crate::sizes::Sizes;
use crate::system;

/// Most repeats a run may ask for (a typo like `--repeat 1000` should not run for days).
pub const REPEAT_MAX: u32 = 100;

/// Everything a run needs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Directories to compare; empty: one `local` target in a fresh directory under
    /// `scratch_parent`.
    pub targets: Vec<Target>,
    /// Scenario names; empty: all of [`scenarios::ALL`].
    pub scenarios: Vec<String>,
    pub repeat: u32,
    /// The preset's name, for the report.
    pub size_name: String,
    pub sizes: Sizes,
    /// The command line, for the report.
    pub command: String,
    /// The `freeflow` binary the cluster scenarios start servers from.
    pub freeflow_exe: PathBuf,
    /// Where the scratch directory (cluster data, the default local target) is made: a
    /// directory on the local disk (not tmpfs).
    pub scratch_parent: PathBuf,
    /// Draw the progress display on stderr.
    pub progress: bool,
}

impl RunOptions {
    fn validate(&self) -> Result<Vec<String>, BenchError> {
        if self.repeat == 0 || self.repeat > REPEAT_MAX {
            return Err(BenchError::Usage(format!(
                "--repeat must be 1 to {REPEAT_MAX}"
            )));
        }
        self.sizes.validate()?;
        let names: Vec<String> = if self.scenarios.is_empty() {
            scenarios::ALL.iter().map(|name| name.to_string()).collect()
        } else {
            self.scenarios.clone()
        };
        for name in &names {
            if !scenarios::ALL.contains(&name.as_str()) {
                return Err(BenchError::UnknownScenario(
                    name.clone(),
                    scenarios::ALL.join(", "),
                ));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for target in &self.targets {
            if !seen.insert(&target.name) {
                return Err(BenchError::Usage(format!(
                    "target name {:?} is given twice",
                    target.name
                )));
            }
            if !target.path.is_dir() {
                return Err(BenchError::Target {
                    name: target.name.clone(),
                    path: target.path.clone(),
                    message: "not a directory".into(),
                });
            }
        }
        Ok(names)
    }
}

fn progress_bar(enabled: bool) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(0);
    let style = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {pos}/{len} runs  {wide_msg}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner());
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// Run every scenario on every subject, `repeat` times interleaved. Must be called outside
/// an async context (it blocks on `runtime` for the cluster scenarios).
pub fn run(options: RunOptions, runtime: tokio::runtime::Handle) -> Result<Report, BenchError> {
    let names = options.validate()?;
    let started_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let scratch = tempfile::Builder::new()
        .prefix("freeflow-bench-")
        .tempdir_in(&options.scratch_parent)
        .map_err(|source| BenchError::Scratch {
            path: options.scratch_parent.clone(),
            source,
        })?;
    let mut targets = options.targets.clone();
    if targets.is_empty() {
        let path = scratch.path().join("local");
        std::fs::create_dir(&path).map_err(|source| BenchError::Scratch {
            path: path.clone(),
            source,
        })?;
        targets.push(Target {
            name: "local".into(),
            path,
        });
    }
    let progress = progress_bar(options.progress);
    let env = Env::new(
        runtime,
        options.freeflow_exe.clone(),
        scratch.path().to_path_buf(),
        progress,
    );
    let mut reports = Vec::new();
    for name in &names {
        let Some(scenario) = scenarios::by_name(name, &options.sizes) else {
            continue;
        };
        reports.push(run_scenario(scenario, &targets, options.repeat, &env));
    }
    env.progress().finish_and_clear();
    let (drops, failure) = env.cache_outcome();
    let caches = CacheReport {
        dropped: failure.is_none() && drops > 0,
        drops,
        reason: failure.or_else(|| (drops == 0).then(|| "no scenario asked for a drop".into())),
    };
    Ok(Report {
        started_unix_s,
        command: options.command.clone(),
        size: options.size_name.clone(),
        repeat: options.repeat,
        host: HostInfo {
            hostname: system::hostname(),
            kernel: system::kernel_release(),
            cpus: system::cpu_count(),
            memory_bytes: system::memory_bytes(),
        },
        caches,
        targets: targets
            .iter()
            .map(|target| TargetInfo {
                target: target.clone(),
                fs_type: system::fs_type(&target.path),
            })
            .collect(),
        scenarios: reports,
    })
}

fn run_scenario(
    mut scenario: Box<dyn scenarios::Scenario>,
    targets: &[Target],
    repeat: u32,
    env: &Env,
) -> ScenarioReport {
    let started = Instant::now();
    let name = scenario.name();
    let specs = scenario.metrics();
    let mut report = ScenarioReport {
        name: name.to_string(),
        parameters: scenario.parameters(),
        subjects: Vec::new(),
        skipped: None,
        notes: Vec::new(),
        metrics: Vec::new(),
        failures: Vec::new(),
        elapsed_ms: 0,
    };
    env.set_prefix(format!("{name}: setting up"));
    let mut subjects = match scenario.subjects(targets, env) {
        Ok(subjects) => subjects,
        Err(SetupError::Skip(reason)) => {
            env.progress().println(format!("{name}: skipped: {reason}"));
            report.skipped = Some(reason);
            report.elapsed_ms = started.elapsed().as_millis() as u64;
            return report;
        }
        Err(SetupError::Failed { subject, error }) => {
            env.progress()
                .println(format!("{name}: setting up {subject} failed: {error}"));
            report.failures.push(RunFailure {
                subject,
                repeat: 0,
                step: error.step,
                message: error.message,
            });
            report.elapsed_ms = started.elapsed().as_millis() as u64;
            return report;
        }
    };
    report.subjects = subjects.iter().map(|subject| subject.name()).collect();
    env.progress()
        .inc_length(u64::from(repeat) * subjects.len() as u64);
    // samples[metric][subject]
    let mut samples = vec![vec![Vec::new(); subjects.len()]; specs.len()];
    for round in 1..=repeat {
        for (index, subject) in subjects.iter_mut().enumerate() {
            let subject_name = subject.name();
            env.set_prefix(format!("{name} · {subject_name} · run {round}/{repeat}"));
            match subject.run_once(round, env) {
                Ok(measurements) => {
                    for (metric, spec) in specs.iter().enumerate() {
                        let value = measurements
                            .iter()
                            .find(|m| m.metric == spec.name)
                            .map(|m| m.value);
                        match value {
                            Some(value) if value.is_finite() => samples[metric][index].push(value),
                            other => report.failures.push(RunFailure {
                                subject: subject_name.clone(),
                                repeat: round,
                                step: format!("measure {}", spec.name),
                                message: match other {
                                    Some(value) => format!("the value {value} is not finite"),
                                    None => "the run returned no value for it".into(),
                                },
                            }),
                        }
                    }
                }
                Err(error) => {
                    env.progress()
                        .println(format!("{name} on {subject_name}, run {round}: {error}"));
                    report.failures.push(RunFailure {
                        subject: subject_name,
                        repeat: round,
                        step: error.step,
                        message: error.message,
                    });
                }
            }
            env.progress().inc(1);
        }
    }
    report.notes = scenario.notes();
    for subject in &subjects {
        report.notes.extend(subject.notes());
    }
    env.set_prefix(format!("{name}: tearing down"));
    drop(subjects);
    report.metrics = specs
        .into_iter()
        .zip(samples)
        .map(|(spec, samples)| MetricReport {
            results: summarise(&report.subjects, &samples),
            spec,
        })
        .collect();
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    report
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::error::StepError;
    use crate::json::Value;
    use crate::model::{Better, Measurement, MetricSpec};
    use crate::scenarios::{Scenario, Subject};

    /// Subjects that log their runs; `fail_on` makes one run of one subject fail, and
    /// `forget` makes a subject leave out the second metric.
    struct Fake {
        log: Arc<Mutex<Vec<String>>>,
        fail_on: Option<(&'static str, u32)>,
        forget: Option<&'static str>,
    }

    struct FakeSubject {
        name: &'static str,
        log: Arc<Mutex<Vec<String>>>,
        fail_on: Option<(&'static str, u32)>,
        forget: bool,
    }

    impl Scenario for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn parameters(&self) -> Vec<(String, Value)> {
            vec![]
        }
        fn metrics(&self) -> Vec<MetricSpec> {
            vec![
                MetricSpec::new("speed", "MB/s", Better::Higher),
                MetricSpec::new("time", "ms", Better::Lower),
            ]
        }
        fn subjects(
            &mut self,
            _targets: &[Target],
            _env: &Env,
        ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
            Ok(["a", "b"]
                .into_iter()
                .map(|name| {
                    Box::new(FakeSubject {
                        name,
                        log: Arc::clone(&self.log),
                        fail_on: self.fail_on,
                        forget: self.forget == Some(name),
                    }) as Box<dyn Subject>
                })
                .collect())
        }
    }

    impl Subject for FakeSubject {
        fn name(&self) -> String {
            self.name.to_string()
        }
        fn run_once(&mut self, repeat: u32, _env: &Env) -> Result<Vec<Measurement>, StepError> {
            self.log
                .lock()
                .expect("log")
                .push(format!("{}{repeat}", self.name));
            if self.fail_on == Some((self.name, repeat)) {
                return Err(StepError::new("fsync /x", "EIO"));
            }
            let base = if self.name == "a" { 10.0 } else { 30.0 };
            let mut measurements = vec![Measurement::new("speed", base + f64::from(repeat))];
            if !self.forget {
                measurements.push(Measurement::new("time", 5.0));
            }
            Ok(measurements)
        }
    }

    fn run_fake(fake: Fake, repeat: u32) -> ScenarioReport {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let env = Env::new(
            runtime.handle().clone(),
            PathBuf::from("/nonexistent/freeflow"),
            std::env::temp_dir(),
            indicatif::ProgressBar::hidden(),
        );
        run_scenario(Box::new(fake), &[], repeat, &env)
    }

    #[test]
    fn subjects_run_interleaved_and_ratios_are_to_the_first() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let report = run_fake(
            Fake {
                log: Arc::clone(&log),
                fail_on: None,
                forget: None,
            },
            3,
        );
        assert_eq!(
            *log.lock().expect("log"),
            ["a1", "b1", "a2", "b2", "a3", "b3"]
        );
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert_eq!(report.subjects, ["a", "b"]);
        let speed = &report.metrics[0];
        assert_eq!(speed.results[0].samples, [11.0, 12.0, 13.0]);
        assert_eq!(speed.results[1].median, 32.0);
        assert_eq!(speed.results[1].ratio_to_first, Some(32.0 / 12.0));
    }

    #[test]
    fn a_failed_run_or_a_missing_metric_is_recorded_and_the_rest_still_runs() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let report = run_fake(
            Fake {
                log: Arc::clone(&log),
                fail_on: Some(("a", 2)),
                forget: Some("b"),
            },
            3,
        );
        assert_eq!(log.lock().expect("log").len(), 6, "every run was tried");
        assert_eq!(report.metrics[0].results[0].samples, [11.0, 13.0]);
        let failed_runs: Vec<_> = report
            .failures
            .iter()
            .filter(|failure| failure.step != "measure time")
            .collect();
        assert_eq!(failed_runs.len(), 1, "{:?}", report.failures);
        let failed_run = failed_runs[0];
        assert_eq!(
            (failed_run.subject.as_str(), failed_run.repeat),
            ("a", 2),
            "{:?}",
            report.failures
        );
        assert_eq!(failed_run.step, "fsync /x");
        let missing: Vec<_> = report
            .failures
            .iter()
            .filter(|failure| failure.step == "measure time")
            .collect();
        assert_eq!(missing.len(), 3, "b forgot `time` in each of its runs");
        assert!(report.metrics[1].results[1].samples.is_empty());
        assert_eq!(report.metrics[1].results[1].ratio_to_first, None);
    }
}
