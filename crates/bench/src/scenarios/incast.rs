//! `incast`: many clients writing to one I/O server at once, the many-to-one pattern that
//! fills a server's queues and memory. A cluster with a single I/O server is started; each
//! subject is a number of clients (1, then N), each client with its own `Client` (its own
//! session and connections) in this process. Each creates a file of its own, then all are
//! released together to write and fsync it: the clock starts after the creates (they queue
//! at the meta server; a writer whose create came back first would write alone). Reported: aggregate and per-client throughput, Jain's fairness index
//! of the per-client throughputs, and the I/O server's peak resident memory (VmHWM, reset
//! before each run where the kernel allows it), also as a share of its memory budget
//! (`memory_budget_bytes`, the whole process).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use freeflow_client::{Client, FileHandle, OpenAccess};

use super::{parameter, Env, Scenario, Subject};
use crate::cluster::{Cluster, Placement};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{jain_index, median, Better, Measurement, MetricSpec, Target};
use crate::sizes::Sizes;
use crate::system::{fresh_name, megabytes_per_second, peak_rss_kib, reset_peak_rss, Xorshift};

/// Bytes per write call of each client.
const WRITE_BYTES: usize = 1 << 20;

pub struct Incast {
    clients: u32,
    client_bytes: u64,
    budget_bytes: Option<u64>,
    peak_reset_refused: bool,
}

impl Incast {
    pub fn new(sizes: &Sizes) -> Incast {
        Incast {
            clients: sizes.incast_clients,
            client_bytes: sizes.incast_client_bytes,
            budget_bytes: sizes.incast_budget_bytes,
            peak_reset_refused: false,
        }
    }
}

impl Incast {
    fn memory_budget(&self) -> u64 {
        self.budget_bytes
            .unwrap_or(freeflow_ioserver::IoConfig::default().memory_budget_bytes)
    }
}

impl Scenario for Incast {
    fn name(&self) -> &'static str {
        "incast"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter("clients", u64::from(self.clients)),
            parameter("client_bytes", self.client_bytes),
            parameter("write_bytes", WRITE_BYTES as u64),
            parameter("io_servers", 1),
            parameter("io_memory_budget", self.memory_budget()),
            parameter(
                "io_payload_budget",
                freeflow_ioserver::IoConfig {
                    memory_budget_bytes: self.memory_budget(),
                    ..freeflow_ioserver::IoConfig::default()
                }
                .payload_budget(),
            ),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("aggregate", "MB/s", Better::Higher),
            MetricSpec::new("per_client_min", "MB/s", Better::Higher),
            MetricSpec::new("per_client_median", "MB/s", Better::Higher),
            MetricSpec::new("jain_index", "index", Better::Higher),
            MetricSpec::new("io_peak_rss", "MiB", Better::Lower),
            MetricSpec::new("io_peak_rss_of_budget", "%", Better::Lower),
        ]
    }

    fn subjects(
        &mut self,
        _targets: &[Target],
        env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        env.step("start a cluster with one I/O server");
        let cluster = Cluster::start_with_budget(
            env.scratch().join(fresh_name("incast")),
            1,
            Placement::Loopback,
            &env.freeflow_exe,
            &env.runtime,
            self.budget_bytes,
        )
        .map_err(|error| SetupError::Failed {
            subject: "cluster".into(),
            error,
        })?;
        let io_pid = cluster.io[0].pid().unwrap_or(0);
        if !reset_peak_rss(io_pid) {
            self.peak_reset_refused = true;
        }
        let cluster = Arc::new(cluster);
        let mut data = vec![0u8; WRITE_BYTES];
        Xorshift::new(8).fill(&mut data);
        let data = Bytes::from(data);
        let mut counts = vec![1, self.clients];
        counts.dedup();
        let mut subjects: Vec<Box<dyn Subject>> = Vec::new();
        for count in counts {
            let name = format!("{count} client{}", if count == 1 { "" } else { "s" });
            let clients = (0..count)
                .map(|index| cluster.client(&format!("incast-{index}")))
                .collect::<Result<Vec<Client>, StepError>>()
                .map_err(|error| SetupError::Failed {
                    subject: name.clone(),
                    error,
                })?;
            // The directory is made and removed by a client of its own: a writer that made
            // it would hold its lease and create its file without a round trip, starting
            // ahead of the others.
            let setup = cluster
                .client(&format!("incast-setup-{count}"))
                .map_err(|error| SetupError::Failed {
                    subject: name.clone(),
                    error,
                })?;
            subjects.push(Box::new(IncastSubject {
                setup,
                name,
                cluster: Arc::clone(&cluster),
                clients,
                client_bytes: self.client_bytes,
                data: data.clone(),
                io_pid,
                memory_budget: self.memory_budget(),
                warmed: false,
            }));
        }
        Ok(subjects)
    }

    fn notes(&self) -> Vec<String> {
        let mut notes = vec![
            "clients are separate Client instances (sessions, connections) in one process; \
             another one makes and removes the directories"
                .into(),
        ];
        if self.peak_reset_refused {
            notes.push(
                "the kernel refused to reset VmHWM (clear_refs), so io_peak_rss is the I/O \
                 server's peak since it started"
                    .into(),
            );
        }
        notes
    }
}

struct IncastSubject {
    /// Makes and removes each run's directory (not one of the writers).
    setup: Client,
    name: String,
    cluster: Arc<Cluster>,
    clients: Vec<Client>,
    client_bytes: u64,
    data: Bytes,
    io_pid: u32,
    /// The I/O server's `memory_budget_bytes`.
    memory_budget: u64,
    /// Whether each client has made its connections (see `run_once`).
    warmed: bool,
}

/// Create and open `path` for writing through `client`.
async fn create_one(client: Client, path: String) -> Result<FileHandle, StepError> {
    let (parent, name) = path.rsplit_once('/').unwrap_or(("", &path));
    let parent = client
        .resolve(if parent.is_empty() { "/" } else { parent })
        .await
        .step(format!("resolve the parent of {path}"))?;
    let access = OpenAccess {
        read: false,
        write: true,
    };
    let (handle, _) = client
        .create_open(parent.inode, name, 0o644, true, access)
        .await
        .step(format!("create {path}"))?;
    Ok(handle)
}

/// Write `bytes` through `handle` (of `path`), fsync, close; seconds since `started`.
async fn write_one(
    handle: FileHandle,
    path: String,
    bytes: u64,
    data: Bytes,
    started: Instant,
) -> Result<f64, StepError> {
    let mut offset = 0u64;
    while offset < bytes {
        let length = (bytes - offset).min(data.len() as u64) as usize;
        handle
            .write_at(offset, data.slice(..length))
            .await
            .step(format!("write {path} at {offset}"))?;
        offset += length as u64;
    }
    handle.fsync().await.step(format!("fsync {path}"))?;
    handle.close().await.step(format!("close {path}"))?;
    Ok(started.elapsed().as_secs_f64())
}

/// Each client creates its file in `directory` (named `prefix` and its index), then all
/// write `bytes` at once from one start; each one's seconds from that start to its close.
fn create_then_write(
    clients: &[Client],
    directory: &str,
    prefix: &str,
    bytes: u64,
    data: &Bytes,
    env: &Env,
) -> Result<Vec<f64>, StepError> {
    env.runtime.block_on(async {
        // Creates first, outside the clock: they queue at the meta server, and a client
        // whose create is answered first would write alone for tens of milliseconds (a
        // large part of a run here) and finish early. Incast is about the data path.
        let creates: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(index, client)| {
                let path = format!("{directory}/{prefix}{index}");
                (path.clone(), tokio::spawn(create_one(client.clone(), path)))
            })
            .collect();
        let mut handles = Vec::new();
        for (path, task) in creates {
            handles.push((path, task.await.step("incast create task")??));
        }
        let started = Instant::now();
        let writes: Vec<_> = handles
            .into_iter()
            .map(|(path, handle)| {
                tokio::spawn(write_one(handle, path, bytes, data.clone(), started))
            })
            .collect();
        let mut seconds = Vec::new();
        for task in writes {
            seconds.push(task.await.step("incast writer task")??);
        }
        Ok(seconds)
    })
}

impl Subject for IncastSubject {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        let directory = format!("/{}", fresh_name("incast"));
        let setup = &self.setup;
        env.runtime
            .block_on(setup.mkdir_path(&directory, 0o755))
            .step(format!("mkdir {directory}"))?;
        if !self.warmed {
            // A client's first write opens its connection to the I/O server: those that
            // connect first would write alone for a while. The connections are made
            // before the first measured run, by a small write of each client.
            env.step(&format!("{} connecting", self.name));
            let warm = Bytes::from_static(&[0u8; 4096]);
            create_then_write(&self.clients, &directory, "warm", 4096, &warm, env)?;
            self.warmed = true;
        }
        reset_peak_rss(self.io_pid);
        env.step(&format!("{} writing", self.name));
        let seconds = create_then_write(
            &self.clients,
            &directory,
            "c",
            self.client_bytes,
            &self.data,
            env,
        )?;
        let peak_kib = peak_rss_kib(self.io_pid).ok_or_else(|| {
            StepError::new(
                "read the I/O server's VmHWM",
                format!("/proc/{}/status unreadable", self.io_pid),
            )
        })?;
        env.step("remove the files");
        env.runtime
            .block_on(setup.remove_all(&directory))
            .step(format!("remove {directory}"))?;
        let per_client: Vec<f64> = seconds
            .iter()
            .map(|&s| megabytes_per_second(self.client_bytes, s))
            .collect();
        let slowest = seconds.iter().copied().fold(0.0, f64::max);
        let total = self.client_bytes * self.clients.len() as u64;
        Ok(vec![
            Measurement::new("aggregate", megabytes_per_second(total, slowest)),
            Measurement::new(
                "per_client_min",
                per_client.iter().copied().fold(f64::INFINITY, f64::min),
            ),
            Measurement::new("per_client_median", median(&per_client)),
            Measurement::new("jain_index", jain_index(&per_client)),
            Measurement::new("io_peak_rss", peak_kib as f64 / 1024.0),
            Measurement::new(
                "io_peak_rss_of_budget",
                (peak_kib * 1024) as f64 * 100.0 / self.memory_budget as f64,
            ),
        ])
    }
}

impl Drop for IncastSubject {
    fn drop(&mut self) {
        for client in self.clients.drain(..) {
            self.cluster.shutdown_client(client);
        }
        self.cluster.shutdown_client(self.setup.clone());
    }
}
