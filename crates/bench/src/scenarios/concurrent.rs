//! `concurrent-writers`: N threads write disjoint ranges of one file with pwrite, each
//! through its own descriptor, then fsync; the aggregate throughput is set against one
//! writer writing the same file alone. A file system that serialises writers to one file
//! (a per-file lock, a single write-ordering queue) shows a speedup at or below 1.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Barrier;
use std::time::Instant;

use super::{check_target, parameter, span_seconds, Env, Scenario, Subject};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;
use crate::system::{fresh_name, megabytes_per_second, Xorshift};

pub struct ConcurrentWriters {
    file_bytes: u64,
    writers: u32,
    block_bytes: u64,
}

impl ConcurrentWriters {
    pub fn new(sizes: &Sizes) -> ConcurrentWriters {
        ConcurrentWriters {
            file_bytes: sizes.concurrent_file_bytes,
            writers: sizes.concurrent_writers,
            block_bytes: sizes.concurrent_block_bytes,
        }
    }

    fn many_name(&self) -> String {
        format!("writers_{}", self.writers)
    }
}

impl Scenario for ConcurrentWriters {
    fn name(&self) -> &'static str {
        "concurrent-writers"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter("file_bytes", self.file_bytes),
            parameter("writers", u64::from(self.writers)),
            parameter("block_bytes", self.block_bytes),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("writers_1", "MB/s", Better::Higher),
            MetricSpec::new(self.many_name(), "MB/s", Better::Higher),
            MetricSpec::new("speedup", "x", Better::Higher),
        ]
    }

    fn subjects(
        &mut self,
        targets: &[Target],
        _env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let mut data = vec![0u8; self.block_bytes as usize];
        Xorshift::new(6).fill(&mut data);
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for target in targets {
            check_target(target)?;
            subjects.push(Box::new(WritersSubject {
                target: target.clone(),
                file_bytes: self.file_bytes,
                writers: self.writers,
                many_name: self.many_name(),
                data: data.clone(),
            }));
        }
        Ok(subjects)
    }
}

struct WritersSubject {
    target: Target,
    file_bytes: u64,
    writers: u32,
    many_name: String,
    data: Vec<u8>,
}

/// Write `start..end` of the file at `path` in `data`-sized pwrites through a descriptor of
/// its own, then fsync it.
fn write_range(path: &Path, start: u64, end: u64, data: &[u8]) -> Result<(), StepError> {
    let shown = path.display();
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .step(format!("open {shown} to write"))?;
    let mut offset = start;
    while offset < end {
        let length = (end - offset).min(data.len() as u64) as usize;
        file.write_all_at(&data[..length], offset)
            .step(format!("pwrite {shown} at {offset}"))?;
        offset += length as u64;
    }
    file.sync_all().step(format!("fsync {shown}"))
}

impl WritersSubject {
    /// Aggregate MB/s of `writers` threads writing equal disjoint ranges of a new file.
    fn run_writers(&self, writers: u32) -> Result<f64, StepError> {
        let path = self.target.path.join(fresh_name("writers"));
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .step(format!("create {}", path.display()))?;
        let share = self.file_bytes / u64::from(writers);
        let barrier = Barrier::new(writers as usize + 1);
        let outcome = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..u64::from(writers))
                .map(|index| {
                    let (path, barrier, data) = (&path, &barrier, &self.data);
                    scope.spawn(move || {
                        barrier.wait();
                        let started = Instant::now();
                        write_range(path, index * share, (index + 1) * share, data)?;
                        Ok((started, Instant::now()))
                    })
                })
                .collect();
            barrier.wait();
            let intervals = handles
                .into_iter()
                .map(|handle| {
                    handle.join().unwrap_or_else(|_| {
                        Err(StepError::new(
                            "writer thread",
                            "the writer thread panicked",
                        ))
                    })
                })
                .collect::<Result<Vec<_>, StepError>>()?;
            Ok(megabytes_per_second(
                self.file_bytes,
                span_seconds(&intervals),
            ))
        });
        let removed = std::fs::remove_file(&path).step(format!("remove {}", path.display()));
        let throughput = outcome?;
        removed?;
        Ok(throughput)
    }
}

impl Subject for WritersSubject {
    fn name(&self) -> String {
        self.target.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        env.step("1 writer");
        let one = self.run_writers(1)?;
        env.step(&format!("{} writers", self.writers));
        let many = self.run_writers(self.writers)?;
        Ok(vec![
            Measurement::new("writers_1", one),
            Measurement::new(self.many_name.clone(), many),
            Measurement::new("speedup", many / one),
        ])
    }
}
