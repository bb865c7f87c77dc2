//! `random`: 4 KiB reads and writes at random aligned offsets of one file, with one thread
//! and with many, each phase running for a fixed time and counting operations (IOPS), so a
//! slow target costs the same wall time as a fast one. O_DIRECT is used where the target
//! accepts it, so reads reach the file system rather than the page cache; where it does not,
//! buffered I/O is used and the report carries a note saying so.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::{
    check_target, fresh_dir, parameter, parameter_list, span_seconds, Env, Scenario, Subject,
};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;
use crate::system::{AlignedBuffer, Xorshift};

/// Bytes of each random read or write.
const IO_BYTES: u64 = 4096;
/// Bytes per write while filling the file before the runs.
const FILL_WRITE_BYTES: usize = 1 << 20;

pub struct Random {
    file_bytes: u64,
    duration_ms: u64,
    threads: Vec<u32>,
}

impl Random {
    pub fn new(sizes: &Sizes) -> Random {
        Random {
            file_bytes: sizes.random_file_bytes / IO_BYTES * IO_BYTES,
            duration_ms: sizes.random_duration_ms,
            threads: sizes.random_threads.clone(),
        }
    }
}

impl Scenario for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter("file_bytes", self.file_bytes),
            parameter("io_bytes", IO_BYTES),
            parameter("duration_ms", self.duration_ms),
            parameter_list("threads", self.threads.iter().map(|&t| u64::from(t))),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut metrics = Vec::new();
        for direction in ["read", "write"] {
            for threads in &self.threads {
                metrics.push(MetricSpec::new(
                    format!("{direction}_t{threads}"),
                    "IOPS",
                    Better::Higher,
                ));
            }
        }
        metrics
    }

    fn subjects(
        &mut self,
        targets: &[Target],
        env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for target in targets {
            check_target(target)?;
            env.step(&format!(
                "fill a {} MiB file on {}",
                self.file_bytes >> 20,
                target.name
            ));
            let subject =
                RandomSubject::create(target, self.file_bytes, self.duration_ms, &self.threads)
                    .map_err(|error| SetupError::Failed {
                        subject: target.name.clone(),
                        error,
                    })?;
            subjects.push(Box::new(subject));
        }
        Ok(subjects)
    }
}

struct RandomSubject {
    target: Target,
    directory: PathBuf,
    path: PathBuf,
    file_bytes: u64,
    duration: Duration,
    threads: Vec<u32>,
    direct: bool,
}

impl RandomSubject {
    fn create(
        target: &Target,
        file_bytes: u64,
        duration_ms: u64,
        threads: &[u32],
    ) -> Result<RandomSubject, StepError> {
        let directory = fresh_dir(&target.path, "random")?;
        let path = directory.join("data");
        let mut subject = RandomSubject {
            target: target.clone(),
            directory,
            path,
            file_bytes,
            duration: Duration::from_millis(duration_ms),
            threads: threads.to_vec(),
            direct: false,
        };
        let shown = subject.path.display().to_string();
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&subject.path)
            .step(format!("create {shown}"))?;
        let mut data = vec![0u8; FILL_WRITE_BYTES];
        let mut random = Xorshift::new(7);
        let mut offset = 0;
        while offset < file_bytes {
            random.fill(&mut data);
            let length = (file_bytes - offset).min(data.len() as u64) as usize;
            file.write_all_at(&data[..length], offset)
                .step(format!("fill {shown} at {offset}"))?;
            offset += length as u64;
        }
        file.sync_all().step(format!("fsync {shown}"))?;
        subject.direct = direct_io_works(&subject.path);
        Ok(subject)
    }

    fn open(&self) -> std::io::Result<File> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        if self.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        options.open(&self.path)
    }

    /// Operations per second of `threads` threads doing 4 KiB `write`s or reads for the
    /// phase's duration.
    fn phase(&self, threads: u32, write: bool) -> Result<f64, StepError> {
        let blocks = self.file_bytes / IO_BYTES;
        let barrier = Barrier::new(threads as usize + 1);
        let what = if write { "pwrite" } else { "pread" };
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|index| {
                    let barrier = &barrier;
                    scope.spawn(move || -> Result<(u64, Instant, Instant), StepError> {
                        let opened = self.open();
                        barrier.wait();
                        let file = opened.step(format!("open {}", self.path.display()))?;
                        let mut buffer = AlignedBuffer::new(IO_BYTES as usize);
                        let mut random = Xorshift::new(u64::from(index) + 1000);
                        if write {
                            random.fill(&mut buffer);
                        }
                        let started = Instant::now();
                        let deadline = started + self.duration;
                        let mut operations = 0u64;
                        while Instant::now() < deadline {
                            let offset = random.below(blocks) * IO_BYTES;
                            let done = if write {
                                file.write_at(&buffer, offset)
                            } else {
                                file.read_at(&mut buffer, offset)
                            };
                            match done {
                                Ok(length) if length as u64 == IO_BYTES => operations += 1,
                                Ok(length) => {
                                    return Err(StepError::new(
                                        format!("{what} {} at {offset}", self.path.display()),
                                        format!("short transfer of {length} bytes"),
                                    ))
                                }
                                Err(error) => {
                                    return Err(StepError::new(
                                        format!("{what} {} at {offset}", self.path.display()),
                                        error,
                                    ))
                                }
                            }
                        }
                        Ok((operations, started, Instant::now()))
                    })
                })
                .collect();
            barrier.wait();
            let mut total = 0;
            let mut intervals = Vec::new();
            let mut first_error = None;
            for handle in handles {
                match handle.join() {
                    Ok(Ok((operations, started, ended))) => {
                        total += operations;
                        intervals.push((started, ended));
                    }
                    Ok(Err(error)) => {
                        first_error.get_or_insert(error);
                    }
                    Err(_) => {
                        first_error.get_or_insert(StepError::new(what, "an I/O thread panicked"));
                    }
                }
            }
            match first_error {
                Some(error) => Err(error),
                None => Ok(total as f64 / span_seconds(&intervals)),
            }
        })
    }
}

/// Whether the file opens with O_DIRECT and an aligned 4 KiB read works through it.
fn direct_io_works(path: &Path) -> bool {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    else {
        return false;
    };
    let mut buffer = AlignedBuffer::new(IO_BYTES as usize);
    file.read_at(&mut buffer, 0).is_ok()
}

impl Subject for RandomSubject {
    fn name(&self) -> String {
        self.target.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        for &threads in &self.threads {
            env.drop_caches();
            env.step(&format!("read, {threads} threads"));
            reads.push(Measurement::new(
                format!("read_t{threads}"),
                self.phase(threads, false)?,
            ));
            env.step(&format!("write, {threads} threads"));
            writes.push(Measurement::new(
                format!("write_t{threads}"),
                self.phase(threads, true)?,
            ));
        }
        reads.extend(writes);
        Ok(reads)
    }

    fn notes(&self) -> Vec<String> {
        if self.direct {
            vec![format!("{}: O_DIRECT", self.target.name)]
        } else {
            vec![format!(
                "{}: O_DIRECT refused, so buffered I/O was used (reads may hit the page \
                 cache after the first pass; writes are not synced)",
                self.target.name
            )]
        }
    }
}

impl Drop for RandomSubject {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.directory);
    }
}
