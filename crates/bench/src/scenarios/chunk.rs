//! `chunk`: PxFS's chunk.py. One large file is written and the time of each system call
//! group is kept apart: open (create), the writes, fsync, close. Where a file system spends
//! its time (in write, or deferred to fsync or close) is the point, not the total alone.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::IntoRawFd;
use std::time::Instant;

use super::{check_target, parameter, Env, Scenario, Subject};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;
use crate::system::{fresh_name, megabytes_per_second, Xorshift};

pub struct Chunk {
    file_bytes: u64,
    write_bytes: u64,
}

impl Chunk {
    pub fn new(sizes: &Sizes) -> Chunk {
        Chunk {
            file_bytes: sizes.chunk_file_bytes,
            write_bytes: sizes.chunk_write_bytes,
        }
    }
}

impl Scenario for Chunk {
    fn name(&self) -> &'static str {
        "chunk"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter("file_bytes", self.file_bytes),
            parameter("write_bytes", self.write_bytes),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("open_ms", "ms", Better::Lower),
            MetricSpec::new("write_ms", "ms", Better::Lower),
            MetricSpec::new("fsync_ms", "ms", Better::Lower),
            MetricSpec::new("close_ms", "ms", Better::Lower),
            MetricSpec::new("total", "MB/s", Better::Higher),
        ]
    }

    fn subjects(
        &mut self,
        targets: &[Target],
        _env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let mut data = vec![0u8; self.write_bytes as usize];
        Xorshift::new(5).fill(&mut data);
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for target in targets {
            check_target(target)?;
            subjects.push(Box::new(ChunkSubject {
                target: target.clone(),
                file_bytes: self.file_bytes,
                data: data.clone(),
            }));
        }
        Ok(subjects)
    }
}

struct ChunkSubject {
    target: Target,
    file_bytes: u64,
    data: Vec<u8>,
}

fn elapsed_ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

impl Subject for ChunkSubject {
    fn name(&self) -> String {
        self.target.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        let path = self.target.path.join(fresh_name("chunk"));
        let shown = path.display().to_string();
        let started = Instant::now();
        env.step("open");
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .step(format!("create {shown}"))?;
        let open_ms = elapsed_ms(started);
        let measured = (|| {
            env.step("write");
            let writing = Instant::now();
            let mut written = 0u64;
            while written < self.file_bytes {
                let length = (self.file_bytes - written).min(self.data.len() as u64) as usize;
                file.write_all(&self.data[..length])
                    .step(format!("write {shown} at {written}"))?;
                written += length as u64;
            }
            let write_ms = elapsed_ms(writing);
            env.step("fsync");
            let syncing = Instant::now();
            file.sync_all().step(format!("fsync {shown}"))?;
            let fsync_ms = elapsed_ms(syncing);
            env.step("close");
            let closing = Instant::now();
            let descriptor = file.into_raw_fd();
            // SAFETY: the descriptor was just taken from the File, which no longer owns it.
            if unsafe { libc::close(descriptor) } != 0 {
                return Err(StepError::new(
                    format!("close {shown}"),
                    std::io::Error::last_os_error(),
                ));
            }
            let close_ms = elapsed_ms(closing);
            let total = megabytes_per_second(self.file_bytes, started.elapsed().as_secs_f64());
            Ok(vec![
                Measurement::new("open_ms", open_ms),
                Measurement::new("write_ms", write_ms),
                Measurement::new("fsync_ms", fsync_ms),
                Measurement::new("close_ms", close_ms),
                Measurement::new("total", total),
            ])
        })();
        let removed = std::fs::remove_file(&path).step(format!("remove {shown}"));
        let measured = measured?;
        removed?;
        Ok(measured)
    }
}
