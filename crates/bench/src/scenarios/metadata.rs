//! `metadata`: mdtest-like create, stat, readdir and unlink of N files, all in one shared
//! directory and spread over many (each worker its own directories of a fixed number of
//! files), from 1 and P workers. Workers are threads, not processes: every operation is a
//! system call on its own path, so the kernel and the file system see what P processes
//! would make them see, without a worker binary to ship. Every run works in a directory
//! with a fresh name (ext4 here creates files ~20x slower for a minute after mass deletes
//! nearby). Each phase is timed from a barrier that releases all workers to the moment the
//! last one finishes; readdir counts entries returned. The stat phase goes over the
//! worker's files again until it has run [`STAT_PHASE_MIN`] (stat of a warm tree): one
//! pass over 10,000 cached names takes 15-30 ms, too short to time on a shared machine.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::{
    check_target, fresh_dir, parameter, parameter_list, span_seconds, Env, Scenario, Subject,
};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::{self, Value};
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;

const PHASES: [&str; 4] = ["create", "stat", "readdir", "unlink"];
/// The stat phase repeats its passes over a worker's files until this long has passed.
const STAT_PHASE_MIN: Duration = Duration::from_millis(300);
const LAYOUTS: [Layout; 2] = [Layout::OneDir, Layout::Spread];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    OneDir,
    Spread,
}

impl Layout {
    fn label(self) -> &'static str {
        match self {
            Layout::OneDir => "one_dir",
            Layout::Spread => "spread",
        }
    }
}

pub struct Metadata {
    files: u64,
    workers: Vec<u32>,
    files_per_dir: u64,
}

impl Metadata {
    pub fn new(sizes: &Sizes) -> Metadata {
        Metadata {
            files: sizes.metadata_files,
            workers: sizes.metadata_workers.clone(),
            files_per_dir: sizes.metadata_files_per_dir,
        }
    }
}

fn metric_name(phase: &str, layout: Layout, workers: u32) -> String {
    format!("{phase}_{}_p{workers}", layout.label())
}

impl Scenario for Metadata {
    fn name(&self) -> &'static str {
        "metadata"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter("files", self.files),
            parameter_list("workers", self.workers.iter().map(|&w| u64::from(w))),
            parameter("files_per_dir", self.files_per_dir),
            ("workers_are".into(), json::string("threads")),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut metrics = Vec::new();
        for layout in LAYOUTS {
            for &workers in &self.workers {
                for phase in PHASES {
                    metrics.push(MetricSpec::new(
                        metric_name(phase, layout, workers),
                        "ops/s",
                        Better::Higher,
                    ));
                }
            }
        }
        metrics
    }

    fn subjects(
        &mut self,
        targets: &[Target],
        _env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for target in targets {
            check_target(target)?;
            subjects.push(Box::new(MetadataSubject {
                target: target.clone(),
                files: self.files,
                workers: self.workers.clone(),
                files_per_dir: self.files_per_dir,
            }));
        }
        Ok(subjects)
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "workers are threads of one process; readdir counts entries per second; stat \
             passes over the files again until {} ms passed",
            STAT_PHASE_MIN.as_millis()
        )]
    }
}

struct MetadataSubject {
    target: Target,
    files: u64,
    workers: Vec<u32>,
    files_per_dir: u64,
}

/// One worker's share: its directories and the files in each.
struct Share {
    directories: Vec<PathBuf>,
    /// (directory index, file name)
    files: Vec<(usize, String)>,
    /// Whether this worker lists the directories (in one_dir, every worker lists the
    /// shared directory once; in spread, each its own).
    lists: bool,
}

impl Share {
    fn path(&self, file: &(usize, String)) -> PathBuf {
        self.directories[file.0].join(&file.1)
    }
}

/// Run one phase of one worker; returns the operations done.
fn run_phase(phase: &str, share: &Share) -> Result<u64, StepError> {
    match phase {
        "create" => {
            for file in &share.files {
                let path = share.path(file);
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .step(format!("create {}", path.display()))?;
            }
            Ok(share.files.len() as u64)
        }
        "stat" => {
            let started = Instant::now();
            let mut done = 0;
            loop {
                for file in &share.files {
                    let path = share.path(file);
                    std::fs::metadata(&path).step(format!("stat {}", path.display()))?;
                }
                done += share.files.len() as u64;
                if share.files.is_empty() || started.elapsed() >= STAT_PHASE_MIN {
                    return Ok(done);
                }
            }
        }
        "readdir" => {
            if !share.lists {
                return Ok(0);
            }
            let mut entries = 0;
            for directory in &share.directories {
                for entry in
                    std::fs::read_dir(directory).step(format!("readdir {}", directory.display()))?
                {
                    entry.step(format!("readdir {}", directory.display()))?;
                    entries += 1;
                }
            }
            Ok(entries)
        }
        _ => {
            for file in &share.files {
                let path = share.path(file);
                std::fs::remove_file(&path).step(format!("unlink {}", path.display()))?;
            }
            Ok(share.files.len() as u64)
        }
    }
}

impl MetadataSubject {
    /// The shares of `workers` workers under `base` (directories made here, untimed).
    fn shares(&self, base: &Path, layout: Layout, workers: u32) -> Result<Vec<Share>, StepError> {
        let workers = u64::from(workers);
        let mut shares = Vec::new();
        for worker in 0..workers {
            // Spread the remainder over the first workers.
            let count = self.files / workers + u64::from(worker < self.files % workers);
            let share = match layout {
                Layout::OneDir => Share {
                    directories: vec![base.to_path_buf()],
                    files: (0..count).map(|i| (0, format!("w{worker}.f{i}"))).collect(),
                    lists: true,
                },
                Layout::Spread => {
                    let directory_count = count.div_ceil(self.files_per_dir).max(1);
                    let mut directories = Vec::new();
                    for index in 0..directory_count {
                        let directory = base.join(format!("w{worker}.d{index}"));
                        std::fs::create_dir(&directory)
                            .step(format!("create directory {}", directory.display()))?;
                        directories.push(directory);
                    }
                    let files = (0..count)
                        .map(|i| ((i / self.files_per_dir) as usize, format!("f{i}")))
                        .collect();
                    Share {
                        directories,
                        files,
                        lists: true,
                    }
                }
            };
            shares.push(share);
        }
        Ok(shares)
    }

    /// Operations per second of each phase, for one layout and worker count.
    fn run_layout(&self, layout: Layout, workers: u32, env: &Env) -> Result<Vec<f64>, StepError> {
        let base = fresh_dir(&self.target.path, "md")?;
        let shares = self.shares(&base, layout, workers)?;
        let barrier = Barrier::new(workers as usize + 1);
        let outcome = std::thread::scope(|scope| {
            let handles: Vec<_> = shares
                .iter()
                .map(|share| {
                    let barrier = &barrier;
                    scope.spawn(move || {
                        // (operations, started, ended) per phase
                        let mut done = Vec::new();
                        let mut failure = None;
                        for phase in PHASES {
                            barrier.wait();
                            if failure.is_none() {
                                let started = Instant::now();
                                match run_phase(phase, share) {
                                    Ok(operations) => {
                                        done.push((operations, started, Instant::now()))
                                    }
                                    Err(error) => failure = Some(error),
                                }
                            }
                            barrier.wait();
                        }
                        match failure {
                            Some(error) => Err(error),
                            None => Ok(done),
                        }
                    })
                })
                .collect();
            for phase in PHASES {
                env.step(&format!("{} p{workers} {phase}", layout.label()));
                barrier.wait();
                barrier.wait();
            }
            let mut operations = vec![0u64; PHASES.len()];
            let mut intervals = vec![Vec::new(); PHASES.len()];
            for handle in handles {
                let done = handle.join().unwrap_or_else(|_| {
                    Err(StepError::new(
                        "metadata worker",
                        "a worker thread panicked",
                    ))
                })?;
                for (phase, (count, started, ended)) in done.into_iter().enumerate() {
                    operations[phase] += count;
                    intervals[phase].push((started, ended));
                }
            }
            Ok(operations
                .iter()
                .zip(&intervals)
                .map(|(&count, intervals)| count as f64 / span_seconds(intervals))
                .collect())
        });
        // Remove what is left (everything, on failure) so the target is not littered.
        if outcome.is_err() {
            let _ = std::fs::remove_dir_all(&base);
        } else {
            for share in &shares {
                for directory in &share.directories {
                    if directory != &base {
                        std::fs::remove_dir(directory)
                            .step(format!("remove directory {}", directory.display()))?;
                    }
                }
            }
            std::fs::remove_dir(&base).step(format!("remove directory {}", base.display()))?;
        }
        outcome
    }
}

impl Subject for MetadataSubject {
    fn name(&self) -> String {
        self.target.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        let mut measurements = Vec::new();
        for layout in LAYOUTS {
            for &workers in &self.workers {
                let rates = self.run_layout(layout, workers, env)?;
                for (phase, rate) in PHASES.iter().zip(rates) {
                    measurements.push(Measurement::new(metric_name(phase, layout, workers), rate));
                }
            }
        }
        Ok(measurements)
    }
}
