//! Freeflow clusters the cluster scenarios (startup, incast, striping) start for themselves:
//! `freeflow meta` and `freeflow io` child processes of the bench's own binary, each with a
//! config file written in a scratch directory, as a deployment runs them. Children die with
//! the bench (PR_SET_PDEATHSIG) and are killed when the `Cluster` is dropped. I/O servers
//! may run inside a network namespace (`ip netns exec`) for the striping scenario.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use freeflow_client::{Client, ClientConfig, ClusterKey};
use freeflow_ioserver::{EngineKind, IoConfig};
use freeflow_meta::MetaConfig;
use serde::Serialize;

use crate::error::{StepContext, StepError};

/// How long a server gets to become ready (a debug build on 2 loaded cores is slow).
pub const READY_WAIT_MS: u64 = 60_000;
/// How long a stopped server gets to exit after SIGTERM before SIGKILL.
pub const STOP_WAIT_MS: u64 = 15_000;
/// Tries at a free port before giving up (a port found free can be taken before the bind).
const PORT_ATTEMPTS: u32 = 5;
/// Poll interval while waiting for a server.
const POLL_MS: u64 = 5;

#[derive(Serialize)]
struct MetaFile {
    key_file: PathBuf,
    meta: MetaConfig,
}

#[derive(Serialize)]
struct IoFile {
    key_file: PathBuf,
    io: IoConfig,
}

/// Where a cluster's servers listen.
#[derive(Clone, Debug)]
pub enum Placement {
    /// Every server on 127.0.0.1 with ports picked free.
    Loopback,
    /// The meta server on `meta_ip` (an address of this namespace), I/O server i inside
    /// network namespace `namespaces[i].0`, listening on `namespaces[i].1`.
    Namespaces {
        meta_ip: String,
        namespaces: Vec<(String, String)>,
    },
}

/// One server process.
pub struct Server {
    role: &'static str,
    config_path: PathBuf,
    log_path: PathBuf,
    /// `ip netns exec NAME` for servers inside a namespace.
    launcher: Vec<String>,
    child: Option<Child>,
}

impl Server {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The log from byte `offset` on.
    pub fn log_since(&self, offset: u64) -> String {
        let bytes = std::fs::read(&self.log_path).unwrap_or_default();
        let start = (offset as usize).min(bytes.len());
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    }

    pub fn log_length(&self) -> u64 {
        std::fs::metadata(&self.log_path).map_or(0, |m| m.len())
    }

    fn spawn(&mut self, freeflow_exe: &Path) -> Result<(), StepError> {
        let step = || {
            format!(
                "start {} server ({})",
                self.role,
                self.config_path.display()
            )
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .step(step())?;
        let log_copy = log.try_clone().step(step())?;
        let mut command = match self.launcher.split_first() {
            Some((program, arguments)) => {
                let mut command = Command::new(program);
                command.args(arguments).arg(freeflow_exe);
                command
            }
            None => Command::new(freeflow_exe),
        };
        command
            .arg(self.role)
            .arg("--config")
            .arg(&self.config_path)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_copy));
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self.child = Some(command.spawn().step(step())?);
        Ok(())
    }

    /// Some(status) if the process has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|child| child.try_wait().ok().flatten())
    }

    /// SIGTERM, wait for the exit (SIGKILL after [`STOP_WAIT_MS`]).
    pub fn stop(&mut self) -> Result<(), StepError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SAFETY: signalling our own child, which has not been reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_millis(STOP_WAIT_MS);
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(StepError::new(
                    format!("stop {} server", self.role),
                    format!("no exit within {STOP_WAIT_MS} ms of SIGTERM; killed"),
                ));
            }
            std::thread::sleep(Duration::from_millis(POLL_MS));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running cluster. Dropping it kills every server; the data goes with `dir`.
pub struct Cluster {
    dir: PathBuf,
    pub key: ClusterKey,
    /// Where clients reach the meta server.
    pub meta_address: String,
    pub meta: Server,
    pub io: Vec<Server>,
    freeflow_exe: PathBuf,
    runtime: tokio::runtime::Handle,
    /// The I/O servers' `memory_budget_bytes` (None: their default).
    io_memory_budget: Option<u64>,
}

/// A loopback port that was free a moment ago.
fn free_port() -> Result<u16, StepError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").step("find a free port")?;
    Ok(listener.local_addr().step("find a free port")?.port())
}

fn write_toml<T: Serialize>(path: &Path, value: &T) -> Result<(), StepError> {
    let step = || format!("write {}", path.display());
    let text = toml::to_string_pretty(value).step(step())?;
    std::fs::write(path, text).step(step())
}

/// The last lines of a log, for error messages.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

impl Cluster {
    /// Start a meta server and `io_count` I/O servers in `dir` (created), wait until every
    /// I/O server is registered and up.
    pub fn start(
        dir: PathBuf,
        io_count: u32,
        placement: Placement,
        freeflow_exe: &Path,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Cluster, StepError> {
        Cluster::start_with_budget(dir, io_count, placement, freeflow_exe, runtime, None)
    }

    /// [`Cluster::start`] with the I/O servers' memory budget set (`memory_budget_bytes`).
    pub fn start_with_budget(
        dir: PathBuf,
        io_count: u32,
        placement: Placement,
        freeflow_exe: &Path,
        runtime: &tokio::runtime::Handle,
        io_memory_budget: Option<u64>,
    ) -> Result<Cluster, StepError> {
        std::fs::create_dir_all(&dir).step(format!("create {}", dir.display()))?;
        let key = ClusterKey::generate().step("generate a cluster key")?;
        key.write_new(&dir.join("cluster.key"))
            .step("write the cluster key")?;
        let launcher_of = |index: usize| match &placement {
            Placement::Loopback => Vec::new(),
            Placement::Namespaces { namespaces, .. } => vec![
                "ip".to_string(),
                "netns".to_string(),
                "exec".to_string(),
                namespaces[index].0.clone(),
            ],
        };
        let mut cluster = Cluster {
            meta: Server {
                role: "meta",
                config_path: dir.join("meta.toml"),
                log_path: dir.join("meta.log"),
                launcher: Vec::new(),
                child: None,
            },
            io: (0..io_count as usize)
                .map(|index| Server {
                    role: "io",
                    config_path: dir.join(format!("io-{index}.toml")),
                    log_path: dir.join(format!("io-{index}.log")),
                    launcher: launcher_of(index),
                    child: None,
                })
                .collect(),
            dir,
            key,
            meta_address: String::new(),
            freeflow_exe: freeflow_exe.to_path_buf(),
            runtime: runtime.clone(),
            io_memory_budget,
        };
        let meta_ip = match &placement {
            Placement::Loopback => "127.0.0.1".to_string(),
            Placement::Namespaces { meta_ip, .. } => meta_ip.clone(),
        };
        for attempt in 1..=PORT_ATTEMPTS {
            cluster.meta_address = format!("{meta_ip}:{}", free_port()?);
            cluster.write_meta_config()?;
            let offset = cluster.meta.log_length();
            cluster.meta.spawn(freeflow_exe)?;
            match cluster.wait_meta_ready(offset)? {
                true => break,
                false if attempt < PORT_ATTEMPTS => continue,
                false => {
                    return Err(StepError::new("start meta server", "no free port found"));
                }
            }
        }
        for index in 0..cluster.io.len() {
            for attempt in 1..=PORT_ATTEMPTS {
                let listen = match &placement {
                    Placement::Loopback => format!("127.0.0.1:{}", free_port()?),
                    Placement::Namespaces { namespaces, .. } => {
                        format!("{}:7710", namespaces[index].1)
                    }
                };
                cluster.write_io_config(index, &listen)?;
                let offset = cluster.io[index].log_length();
                cluster.io[index].spawn(freeflow_exe)?;
                match cluster.wait_io_started(index, offset)? {
                    true => break,
                    false if attempt < PORT_ATTEMPTS => continue,
                    false => {
                        return Err(StepError::new(
                            format!("start I/O server {index}"),
                            "no free port found",
                        ))
                    }
                }
            }
        }
        cluster.wait_all_io_up()?;
        Ok(cluster)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write_meta_config(&self) -> Result<(), StepError> {
        let meta = MetaConfig {
            listen_address: self.meta_address.clone(),
            data_dir: PathBuf::from("meta"),
            server_down_after_ms: 5_000,
            heartbeat_interval_ms: 500,
            store_cache_bytes: 64 << 20,
            ..MetaConfig::default()
        };
        write_toml(
            &self.meta.config_path,
            &MetaFile {
                key_file: PathBuf::from("cluster.key"),
                meta,
            },
        )
    }

    fn write_io_config(&self, index: usize, listen: &str) -> Result<(), StepError> {
        let io = IoConfig {
            server_id: index as u32,
            listen_address: listen.to_string(),
            advertise_address: None,
            data_dir: PathBuf::from(format!("io-{index}")),
            meta_address: self.meta_address.clone(),
            engine: EngineKind::Uring,
            register_backoff_max_ms: 500,
            memory_budget_bytes: self
                .io_memory_budget
                .unwrap_or(IoConfig::default().memory_budget_bytes),
            ..IoConfig::default()
        };
        write_toml(
            &self.io[index].config_path,
            &IoFile {
                key_file: PathBuf::from("cluster.key"),
                io,
            },
        )
    }

    /// A client configuration for this cluster.
    pub fn client_config(&self, name: &str) -> ClientConfig {
        let mut config = ClientConfig::new(self.meta_address.clone(), self.key.clone());
        config.connect_timeout_ms = 2_000;
        config.call_timeout_ms = 120_000;
        config.client_name = format!("bench-{name}-{}", std::process::id());
        config
    }

    /// A connected client.
    pub fn client(&self, name: &str) -> Result<Client, StepError> {
        self.runtime
            .block_on(Client::connect(self.client_config(name)))
            .step(format!("connect a client to {}", self.meta_address))
    }

    fn failed_start(server: &mut Server, offset: u64) -> Option<(bool, String)> {
        let status = server.exited()?;
        let log = server.log_since(offset);
        server.child = None;
        Some((
            log.contains("in use"),
            format!("exited with {status}:\n{}", tail(&log)),
        ))
    }

    /// True when a client connects; false if the server lost its port to someone else.
    fn wait_meta_ready(&mut self, offset: u64) -> Result<bool, StepError> {
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        loop {
            if let Some((port_taken, message)) = Cluster::failed_start(&mut self.meta, offset) {
                if port_taken {
                    return Ok(false);
                }
                return Err(StepError::new("start meta server", message));
            }
            if self.try_connect() {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Err(StepError::new(
                    "start meta server",
                    format!(
                        "not ready within {READY_WAIT_MS} ms:\n{}",
                        tail(&self.meta.log_since(offset))
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(POLL_MS));
        }
    }

    /// End a client's session (its own runtime calls need this runtime).
    pub fn shutdown_client(&self, client: Client) {
        self.runtime.block_on(client.shutdown());
    }

    /// Whether a client can open a session now.
    pub fn try_connect(&self) -> bool {
        let mut config = self.client_config("probe");
        config.connect_timeout_ms = 1_000;
        config.call_timeout_ms = 5_000;
        match self.runtime.block_on(Client::connect(config)) {
            Ok(client) => {
                self.runtime.block_on(client.shutdown());
                true
            }
            Err(_) => false,
        }
    }

    /// True once the I/O server's log says ready; false if it lost its port.
    fn wait_io_started(&mut self, index: usize, offset: u64) -> Result<bool, StepError> {
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        let step = format!("start I/O server {index}");
        loop {
            let server = &mut self.io[index];
            if let Some((port_taken, message)) = Cluster::failed_start(server, offset) {
                if port_taken {
                    return Ok(false);
                }
                return Err(StepError::new(step, message));
            }
            if server.log_since(offset).contains("ready in") {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Err(StepError::new(
                    step,
                    format!(
                        "not ready within {READY_WAIT_MS} ms:\n{}",
                        tail(&server.log_since(offset))
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(POLL_MS * 4));
        }
    }

    /// Wait until the meta server lists every I/O server as up.
    pub fn wait_all_io_up(&mut self) -> Result<(), StepError> {
        let step = "wait for the I/O servers to register";
        let client = self.client("wait")?;
        let wanted: Vec<u32> = (0..self.io.len() as u32).collect();
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        let outcome = loop {
            for (index, server) in self.io.iter_mut().enumerate() {
                if let Some(status) = server.exited() {
                    break_with_log(server, index, status)?;
                }
            }
            if let Ok(servers) = self.runtime.block_on(client.servers()) {
                if wanted
                    .iter()
                    .all(|id| servers.iter().any(|s| s.server_id == *id && s.up))
                {
                    break Ok(());
                }
            }
            if Instant::now() >= deadline {
                break Err(StepError::new(
                    step,
                    format!("not all of {wanted:?} up within {READY_WAIT_MS} ms"),
                ));
            }
            std::thread::sleep(Duration::from_millis(POLL_MS * 10));
        };
        self.runtime.block_on(client.shutdown());
        outcome
    }

    /// Stop the meta server (SIGTERM) and start it again; returns the log offset before the
    /// new start and the instant of the spawn.
    pub fn restart_meta(&mut self) -> Result<(u64, Instant), StepError> {
        self.meta.stop()?;
        let offset = self.meta.log_length();
        let spawned = Instant::now();
        self.meta.spawn(&self.freeflow_exe)?;
        Ok((offset, spawned))
    }

    /// Fail if the meta server has exited (with its log).
    pub fn check_meta_alive(&mut self, offset: u64) -> Result<(), StepError> {
        match self.meta.exited() {
            Some(status) => Err(StepError::new(
                "meta server",
                format!(
                    "exited with {status}:\n{}",
                    tail(&self.meta.log_since(offset))
                ),
            )),
            None => Ok(()),
        }
    }
}

fn break_with_log(
    server: &mut Server,
    index: usize,
    status: std::process::ExitStatus,
) -> Result<(), StepError> {
    let log = server.log_since(0);
    server.child = None;
    Err(StepError::new(
        format!("I/O server {index}"),
        format!("exited with {status}:\n{}", tail(&log)),
    ))
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for server in &mut self.io {
            server.kill();
        }
        self.meta.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
