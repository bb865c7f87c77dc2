//! `startup`: how long a metadata server holding N files takes to be ready again after a
//! restart (PVFS2 scanned its whole database at start; Freeflow must not, so the time must
//! not grow with N). For each N a cluster of its own is populated once through the client
//! library (many creates in flight), then every run stops the meta server with SIGTERM,
//! starts it again and measures two things: the `ready in N ms` the server logs, and the
//! time from the spawn to the first client session (process start included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use freeflow_client::{Client, FileKind};

use super::{parameter_list, Env, Scenario, Subject};
use crate::cluster::{Cluster, Placement, READY_WAIT_MS};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;
use crate::system::fresh_name;

/// Creates in flight while populating.
const CREATES_IN_FLIGHT: usize = 64;
/// Files per directory while populating (directories are made first).
const FILES_PER_DIRECTORY: u64 = 10_000;

pub struct Startup {
    file_counts: Vec<u64>,
}

impl Startup {
    pub fn new(sizes: &Sizes) -> Startup {
        Startup {
            file_counts: sizes.startup_files.clone(),
        }
    }
}

impl Scenario for Startup {
    fn name(&self) -> &'static str {
        "startup"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![parameter_list("files", self.file_counts.iter().copied())]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("ready_ms", "ms", Better::Lower),
            MetricSpec::new("first_connect_ms", "ms", Better::Lower),
        ]
    }

    fn subjects(
        &mut self,
        _targets: &[Target],
        env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for &files in &self.file_counts {
            let name = format!("{files} files");
            env.step(&format!("start a cluster for {name}"));
            let failed = |error| SetupError::Failed {
                subject: name.clone(),
                error,
            };
            let cluster = Cluster::start(
                env.scratch().join(fresh_name("startup")),
                1,
                Placement::Loopback,
                &env.freeflow_exe,
                &env.runtime,
            )
            .map_err(failed)?;
            env.step(&format!("populate {name}"));
            populate(&cluster, files, env).map_err(failed)?;
            subjects.push(Box::new(StartupSubject { name, cluster }));
        }
        Ok(subjects)
    }
}

/// Create `files` empty files under a fresh top directory, many in flight.
fn populate(cluster: &Cluster, files: u64, env: &Env) -> Result<(), StepError> {
    let client = cluster.client("populate")?;
    let outcome = env.runtime.block_on(async {
        let top = client
            .mkdir_path("/populate", 0o755)
            .await
            .step("populate: mkdir /populate")?
            .inode;
        let mut directories = Vec::new();
        for index in 0..files.div_ceil(FILES_PER_DIRECTORY).max(1) {
            directories.push(
                client
                    .mkdir(top, &format!("d{index}"), 0o755)
                    .await
                    .step(format!("populate: mkdir /populate/d{index}"))?
                    .inode,
            );
        }
        let directories = Arc::new(directories);
        let semaphore = Arc::new(tokio::sync::Semaphore::new(CREATES_IN_FLIGHT));
        let mut tasks = tokio::task::JoinSet::new();
        for index in 0..files {
            let permit = semaphore
                .clone()
                .acquire_owned()
                .await
                .step("populate: wait for a create slot")?;
            let (client, directories): (Client, _) = (client.clone(), directories.clone());
            tasks.spawn(async move {
                let parent = directories[(index / FILES_PER_DIRECTORY) as usize];
                let result = client
                    .create(
                        parent,
                        &format!("f{index}"),
                        FileKind::Regular,
                        0o644,
                        0,
                        true,
                    )
                    .await;
                drop(permit);
                result.step(format!("populate: create file {index}"))
            });
            while let Some(done) = tasks.try_join_next() {
                done.step("populate: create task")??;
            }
        }
        while let Some(done) = tasks.join_next().await {
            done.step("populate: create task")??;
        }
        Ok::<(), StepError>(())
    });
    env.runtime.block_on(client.shutdown());
    outcome
}

/// The N of the first `ready in N ms` in `log`.
pub(crate) fn parse_ready_ms(log: &str) -> Option<u64> {
    let rest = &log[log.find("ready in ")? + "ready in ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    if !rest[digits.len()..].starts_with(" ms") {
        return None;
    }
    digits.parse().ok()
}

struct StartupSubject {
    name: String,
    cluster: Cluster,
}

impl Subject for StartupSubject {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        env.step("restart the meta server");
        let (offset, spawned) = self.cluster.restart_meta()?;
        let deadline = spawned + Duration::from_millis(READY_WAIT_MS);
        let first_connect_ms = loop {
            self.cluster.check_meta_alive(offset)?;
            if self.cluster.try_connect() {
                break spawned.elapsed().as_secs_f64() * 1000.0;
            }
            if Instant::now() >= deadline {
                return Err(StepError::new(
                    "wait for the restarted meta server",
                    format!("no session within {READY_WAIT_MS} ms"),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        // The line is logged right after the listener serves; allow it to reach the file.
        let log_deadline = Instant::now() + Duration::from_millis(5_000);
        let ready_ms = loop {
            if let Some(ready_ms) = parse_ready_ms(&self.cluster.meta.log_since(offset)) {
                break ready_ms;
            }
            if Instant::now() >= log_deadline {
                return Err(StepError::new(
                    "read the restarted meta server's log",
                    format!(
                        "no 'ready in N ms' line in {}",
                        self.cluster.meta.log_path().display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // A server that reports 0 ms is ready within the millisecond; count it as 0.5 so
        // ratios stay defined (the first_connect time is the one with the process start).
        let ready_ms = if ready_ms == 0 { 0.5 } else { ready_ms as f64 };
        Ok(vec![
            Measurement::new("ready_ms", ready_ms),
            Measurement::new("first_connect_ms", first_connect_ms),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ready_line_is_parsed_from_a_log() {
        let log = "2025-01-01T00:00:00Z  INFO starting\n\
                   2025-01-01T00:00:01Z  INFO ready in 137 ms inode_count=1002\n";
        assert_eq!(parse_ready_ms(log), Some(137));
        assert_eq!(parse_ready_ms("INFO ready in soon"), None);
        assert_eq!(parse_ready_ms("nothing here"), None);
    }
}
