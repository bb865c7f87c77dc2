//! `seq`: dd-like sequential write then read of one file at several block sizes (4K to 4M),
//! with fsync at the end of the write (counted in its time) and the page cache dropped
//! before the read, so both directions measure the file system rather than memory.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Instant;

use super::{check_target, parameter, parameter_list, size_label, Env, Scenario, Subject};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;
use crate::system::{fresh_name, megabytes_per_second, Xorshift};

pub struct Seq {
    file_bytes: u64,
    block_bytes: Vec<u64>,
}

impl Seq {
    pub fn new(sizes: &Sizes) -> Seq {
        Seq {
            file_bytes: sizes.seq_file_bytes,
            block_bytes: sizes.seq_block_bytes.clone(),
        }
    }
}

impl Scenario for Seq {
    fn name(&self) -> &'static str {
        "seq"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter("file_bytes", self.file_bytes),
            parameter_list("block_bytes", self.block_bytes.iter().copied()),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut metrics = Vec::new();
        for direction in ["write", "read"] {
            for &block in &self.block_bytes {
                metrics.push(MetricSpec::new(
                    format!("{direction}_{}", size_label(block)),
                    "MB/s",
                    Better::Higher,
                ));
            }
        }
        metrics
    }

    fn subjects(
        &mut self,
        targets: &[Target],
        _env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let largest = self.block_bytes.iter().copied().max().unwrap_or(1 << 20) as usize;
        let mut data = vec![0u8; largest];
        Xorshift::new(4).fill(&mut data);
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for target in targets {
            check_target(target)?;
            subjects.push(Box::new(SeqSubject {
                target: target.clone(),
                file_bytes: self.file_bytes,
                block_bytes: self.block_bytes.clone(),
                data: data.clone(),
            }));
        }
        Ok(subjects)
    }
}

struct SeqSubject {
    target: Target,
    file_bytes: u64,
    block_bytes: Vec<u64>,
    data: Vec<u8>,
}

impl SeqSubject {
    fn write(&self, path: &PathBuf, block: usize) -> Result<f64, StepError> {
        let label = size_label(block as u64);
        let started = Instant::now();
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .step(format!("create {}", path.display()))?;
        for _ in 0..self.file_bytes / block as u64 {
            file.write_all(&self.data[..block])
                .step(format!("write {label} blocks to {}", path.display()))?;
        }
        file.sync_all()
            .step(format!("fsync {} after writing", path.display()))?;
        drop(file);
        Ok(megabytes_per_second(
            self.file_bytes,
            started.elapsed().as_secs_f64(),
        ))
    }

    fn read(&self, path: &PathBuf, block: usize) -> Result<f64, StepError> {
        let label = size_label(block as u64);
        let mut buffer = vec![0u8; block];
        let started = Instant::now();
        let mut file = File::open(path).step(format!("open {} to read", path.display()))?;
        let mut total = 0u64;
        loop {
            let count = file
                .read(&mut buffer)
                .step(format!("read {label} blocks from {}", path.display()))?;
            if count == 0 {
                break;
            }
            total += count as u64;
        }
        let seconds = started.elapsed().as_secs_f64();
        if total != self.file_bytes {
            return Err(StepError::new(
                format!("read {}", path.display()),
                format!("read {total} bytes, wrote {}", self.file_bytes),
            ));
        }
        Ok(megabytes_per_second(total, seconds))
    }
}

impl Subject for SeqSubject {
    fn name(&self) -> String {
        self.target.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        let mut writes = Vec::new();
        let mut reads = Vec::new();
        for &block in &self.block_bytes {
            let label = size_label(block);
            let path = self.target.path.join(fresh_name("seq"));
            env.step(&format!("write {label}"));
            let written = self.write(&path, block as usize);
            let read = written.and_then(|written| {
                env.drop_caches();
                env.step(&format!("read {label}"));
                Ok((written, self.read(&path, block as usize)?))
            });
            let removed = std::fs::remove_file(&path).step(format!("remove {}", path.display()));
            let (written, read) = read?;
            removed?;
            writes.push(Measurement::new(format!("write_{label}"), written));
            reads.push(Measurement::new(format!("read_{label}"), read));
        }
        writes.extend(reads);
        Ok(writes)
    }
}
