//! Test harness: a real Freeflow cluster of `freeflow meta` and `freeflow io` child processes
//! in a temporary directory, so integration tests exercise the binary, the config files and
//! the network exactly as a deployment does, and can kill servers with SIGKILL.
//!
//! Every wait is a poll with a bound; a bound that runs out panics with the server logs, so a
//! failure on a loaded machine says what the servers were doing.

#![allow(dead_code)]

pub mod mount;
pub mod netswitch;
pub mod raw;
pub mod replicated;
pub mod workload;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use freeflow_client::{Client, ClientConfig, ClusterKey};
use freeflow_ioserver::{EngineKind, IoConfig};
use freeflow_meta::MetaConfig;
use freeflow_types::{InodeId, ObjectId};
use serde::Serialize;

/// The binary under test.
pub const FREEFLOW: &str = env!("CARGO_BIN_EXE_freeflow");

/// How long a server gets to become ready (generous: 2 loaded cores, debug build).
pub const READY_WAIT_MS: u64 = 30_000;

/// Lease of client sessions in test clusters: short, so orphans of a previous run of the
/// meta server are reaped soon after a restart.
pub const TEST_LEASE_MS: u32 = 4_000;

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

#[derive(Serialize)]
struct ClientFile {
    meta_address: String,
    key_file: PathBuf,
    call_timeout_ms: u64,
}

/// A loopback port that was free a moment ago (bind to port 0, read it, release it), and
/// never handed out before in this test process: the kernel may give one port to two
/// binds in a row once the first is released, and two servers of one cluster then collide.
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let port = listener.local_addr().expect("local address").port();
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// A base port `P` such that `P + offset` is free for every offset (checked by binding
/// them all at once, then released), for commands that derive ports from one base.
pub fn free_port_range(offsets: &[u16]) -> u16 {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| since.as_nanos() as u64)
        .unwrap_or(1)
        ^ u64::from(std::process::id());
    let mut random = Xorshift::new(seed);
    let span = offsets.iter().copied().max().unwrap_or(0);
    for _ in 0..200 {
        let base = 20_000 + random.below(u64::from(40_000 - span)) as u16;
        let held: Vec<_> = offsets
            .iter()
            .map_while(|offset| std::net::TcpListener::bind(("127.0.0.1", base + offset)).ok())
            .collect();
        if held.len() == offsets.len() {
            return base;
        }
    }
    panic!("no free port range found for offsets {offsets:?}");
}

/// Remove ANSI colour escapes (in case the log writer adds them).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for next in chars.by_ref() {
                    if next.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Read a log file (empty if it does not exist yet), without colour escapes.
pub fn read_log(path: &Path) -> String {
    strip_ansi(&String::from_utf8_lossy(
        &std::fs::read(path).unwrap_or_default(),
    ))
}

/// Poll `check` every 50 ms until it returns Some or `timeout_ms` passes.
pub async fn poll_until<T, F, Fut>(timeout_ms: u64, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deterministic pseudo-random bytes (xorshift64*), so a failure replays from its seed.
pub struct Xorshift(u64);

impl Xorshift {
    pub fn new(seed: u64) -> Xorshift {
        Xorshift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..bound`.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound
    }

    pub fn bytes(&mut self, length: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(length + 8);
        while out.len() < length {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(length);
        out
    }
}

/// First differing index of two byte strings, for assertion messages that stay short.
pub fn first_difference(left: &[u8], right: &[u8]) -> Option<usize> {
    if left.len() != right.len() {
        return Some(left.len().min(right.len()));
    }
    left.iter().zip(right).position(|(a, b)| a != b)
}

/// Assert two byte strings are equal without printing megabytes on failure.
#[track_caller]
pub fn assert_bytes_eq(actual: &[u8], expected: &[u8], what: &str) {
    if let Some(at) = first_difference(actual, expected) {
        panic!(
            "{what}: differs at byte {at} (lengths {} and {}; actual {:?}, expected {:?})",
            actual.len(),
            expected.len(),
            actual.get(at..(at + 16).min(actual.len())),
            expected.get(at..(at + 16).min(expected.len())),
        );
    }
}

/// Tries at finding a free port for one server before giving up.
const PORT_ATTEMPTS: u32 = 5;

/// Length of a file, 0 if it does not exist.
fn file_length(path: &Path) -> u64 {
    std::fs::metadata(path)
        .map(|metadata| metadata.len())
        .unwrap_or(0)
}

/// True if `child` has exited and its log past `log_offset` says its address was in use.
fn lost_port_race(child: &mut Child, log: &Path, log_offset: u64) -> bool {
    if !matches!(child.try_wait(), Ok(Some(_))) {
        return false;
    }
    let bytes = std::fs::read(log).unwrap_or_default();
    let start = (log_offset as usize).min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).contains("in use")
}

/// Options of a test cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub io_count: u32,
    pub engine: EngineKind,
    /// Stripe unit of new files (the meta server's default).
    pub stripe_unit_bytes: u32,
    /// Give every server a metrics endpoint on a free loopback port.
    pub metrics: bool,
    /// The meta server's `commit_interval_ms` (how long an early reply may stay not
    /// durable) and `recovery_window_ms`.
    pub meta_commit_interval_ms: u64,
    pub recovery_window_ms: u64,
    /// How long the meta server leases what clients cache (`cache_lease_ms`).
    pub cache_lease_ms: u32,
    /// Copies of each stripe of new files (the meta server's `replicas`).
    pub replicas: u32,
    /// The meta server's `server_dead_after_ms` (None: its default).
    pub server_dead_after_ms: Option<u64>,
    /// The meta server's `rebalance_min_bytes` (None: its default).
    pub rebalance_min_bytes: Option<u64>,
    /// Put each I/O server's data directory on a tmpfs of this many bytes (a small file
    /// system to fill; needs root: see [`small_file_systems_available`]).
    pub io_tmpfs_bytes: Option<u64>,
    /// Network namespaces: I/O server i runs in the switch's host i (for each host it
    /// has), the rest here on the switch's address, so a test can cut one off.
    pub switch: Option<std::sync::Arc<netswitch::NetSwitch>>,
    /// I/O servers listen on Unix sockets too and advertise them (as `freeflow up` does),
    /// so clients here read their objects locally (`local_reads`).
    pub unix_sockets: bool,
}

/// Whether this process may mount a tmpfs (root); says why not when it may not.
pub fn small_file_systems_available() -> bool {
    let probe = tempfile::tempdir().expect("a temporary directory");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "freeflow-probe"])
        .arg(probe.path())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if mounted {
        let _ = Command::new("umount").arg(probe.path()).status();
    } else {
        eprintln!("skipping: cannot mount a tmpfs here (not root?)");
    }
    mounted
}

impl ClusterOptions {
    pub fn new(io_count: u32) -> ClusterOptions {
        ClusterOptions {
            io_count,
            engine: EngineKind::Uring,
            stripe_unit_bytes: 64 << 10,
            metrics: false,
            meta_commit_interval_ms: 500,
            recovery_window_ms: 10_000,
            cache_lease_ms: 10_000,
            replicas: 1,
            server_dead_after_ms: None,
            rebalance_min_bytes: None,
            io_tmpfs_bytes: None,
            switch: None,
            unix_sockets: false,
        }
    }
}

struct IoServer {
    server_id: u32,
    address: String,
    config_path: PathBuf,
    log_path: PathBuf,
    data_dir: PathBuf,
    child: Option<Child>,
    metrics_address: Option<String>,
}

/// A running cluster of child processes. Dropping it kills them all.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub key: ClusterKey,
    pub meta_address: String,
    pub options: ClusterOptions,
    meta_config_path: PathBuf,
    meta_log_path: PathBuf,
    meta: Option<Child>,
    io: Vec<IoServer>,
    meta_metrics_address: Option<String>,
}

/// The switch host that I/O server `index` runs in, if any.
fn io_host(options: &ClusterOptions, index: usize) -> Option<usize> {
    let switch = options.switch.as_ref()?;
    (index < switch.hosts()).then_some(index)
}

/// Where I/O server `index` listens: its namespace's address, this namespace's switch
/// address, or loopback.
fn io_address(options: &ClusterOptions, index: usize) -> String {
    let ip = match (&options.switch, io_host(options, index)) {
        (Some(switch), Some(host)) => switch.ip(host),
        (Some(switch), None) => switch.here_ip(),
        (None, _) => "127.0.0.1".to_string(),
    };
    format!("{ip}:{}", free_port())
}

/// Where the meta server listens: this namespace's switch address, or loopback.
fn meta_address(options: &ClusterOptions) -> String {
    let ip = options
        .switch
        .as_ref()
        .map_or("127.0.0.1".to_string(), |switch| switch.here_ip());
    format!("{ip}:{}", free_port())
}

/// A fresh loopback metrics address when `enabled`.
fn metrics_address(enabled: bool) -> Option<String> {
    enabled.then(|| format!("127.0.0.1:{}", free_port()))
}

fn spawn_server(role: &str, config: &Path, log: &Path) -> Child {
    spawn_server_as(Command::new(FREEFLOW), role, config, log)
}

/// Start `freeflow ROLE --config CONFIG` through `command` (a namespace's `ip netns exec`, or
/// the binary itself), its output appended to `log`.
pub fn spawn_server_as(mut command: Command, role: &str, config: &Path, log: &Path) -> Child {
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("open the server log");
    let log_copy = log_file.try_clone().expect("clone the log handle");
    command
        .arg(role)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log_file))
        .stderr(Stdio::from(log_copy))
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {FREEFLOW} {role}: {error}"))
}

fn write_toml<T: Serialize>(path: &Path, value: &T) {
    let text = toml::to_string_pretty(value).expect("config encodes as TOML");
    std::fs::write(path, text).expect("write a config file");
}

/// I/O server `server_id` of a cluster in `dir`, not started; its data directory is a tmpfs
/// of its own with `io_tmpfs_bytes`.
fn new_io_server(options: &ClusterOptions, dir: &Path, server_id: u32) -> IoServer {
    let server = IoServer {
        server_id,
        address: io_address(options, server_id as usize),
        log_path: dir.join(format!("io-{server_id}.log")),
        data_dir: dir.join(format!("io-{server_id}")),
        config_path: dir.join(format!("io-{server_id}.toml")),
        child: None,
        metrics_address: metrics_address(options.metrics),
    };
    if let Some(bytes) = options.io_tmpfs_bytes {
        std::fs::create_dir_all(&server.data_dir).expect("make a data directory");
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={bytes}"),
                "freeflow-test",
            ])
            .arg(&server.data_dir)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mount a tmpfs on {}",
            server.data_dir.display()
        );
    }
    server
}

impl Cluster {
    /// A cluster of one meta server and `io_count` I/O servers (io_uring engine).
    pub async fn start(io_count: u32) -> Cluster {
        Cluster::start_with(ClusterOptions::new(io_count)).await
    }

    pub async fn start_with(options: ClusterOptions) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("freeflow-test-")
            .tempdir()
            .expect("make a temporary directory");
        let key = ClusterKey::generate().expect("generate a cluster key");
        key.write_new(&dir.path().join("cluster.key"))
            .expect("write the cluster key");
        let io = (0..options.io_count)
            .map(|server_id| new_io_server(&options, dir.path(), server_id))
            .collect::<Vec<IoServer>>();
        let mut cluster = Cluster {
            meta_log_path: dir.path().join("meta.log"),
            meta_config_path: dir.path().join("meta.toml"),
            dir,
            key,
            meta_address: meta_address(&options),
            meta_metrics_address: metrics_address(options.metrics),
            options,
            meta: None,
            io,
        };
        // A port picked free can be taken by another test before the server binds it:
        // then pick another and try again.
        for attempt in 0..PORT_ATTEMPTS {
            cluster.write_meta_config();
            let log_offset = file_length(&cluster.meta_log_path);
            cluster.spawn_meta();
            if cluster.wait_meta_ready(Some(log_offset)).await {
                break;
            }
            assert!(attempt + 1 < PORT_ATTEMPTS, "meta server: no free port");
            cluster.meta_address = meta_address(&cluster.options);
            cluster.meta_metrics_address = metrics_address(cluster.options.metrics);
        }
        for index in 0..cluster.io.len() {
            cluster.start_io_first_time(index).await;
        }
        cluster.wait_all_io_up().await;
        cluster
    }

    /// Start I/O server `index` for the first time, on another port if its own was
    /// taken meanwhile.
    async fn start_io_first_time(&mut self, index: usize) {
        for attempt in 0..PORT_ATTEMPTS {
            self.write_io_config(index);
            let log_offset = file_length(&self.io[index].log_path);
            self.spawn_io(index);
            if self.wait_io_serving(index, Some(log_offset)).await {
                return;
            }
            assert!(
                attempt + 1 < PORT_ATTEMPTS,
                "I/O server {index}: no free port"
            );
            self.io[index].address = io_address(&self.options, index);
            self.io[index].metrics_address = metrics_address(self.options.metrics);
        }
    }

    /// Add a new I/O server (the next id, its own tmpfs with `io_tmpfs_bytes`), started
    /// and registered; its index.
    pub async fn add_io(&mut self) -> usize {
        let index = self.io.len();
        let server = new_io_server(&self.options, self.dir.path(), index as u32);
        self.io.push(server);
        self.start_io_first_time(index).await;
        self.wait_all_io_up().await;
        index
    }

    fn write_meta_config(&self) {
        let meta = MetaConfig {
            listen_address: self.meta_address.clone(),
            // Relative: the binary must take it from the config file's directory.
            data_dir: PathBuf::from("meta"),
            lease_ms: TEST_LEASE_MS,
            stripe_unit_bytes: self.options.stripe_unit_bytes,
            server_down_after_ms: 3_000,
            heartbeat_interval_ms: 500,
            store_cache_bytes: 16 << 20,
            metrics_address: self.meta_metrics_address.clone(),
            commit_interval_ms: self.options.meta_commit_interval_ms,
            recovery_window_ms: self.options.recovery_window_ms,
            cache_lease_ms: self.options.cache_lease_ms,
            replicas: self.options.replicas,
            server_dead_after_ms: self
                .options
                .server_dead_after_ms
                .unwrap_or(MetaConfig::default().server_dead_after_ms),
            rebalance_min_bytes: self
                .options
                .rebalance_min_bytes
                .unwrap_or(MetaConfig::default().rebalance_min_bytes),
            ..MetaConfig::default()
        };
        let file = MetaFile {
            key_file: PathBuf::from("cluster.key"),
            meta,
        };
        write_toml(&self.meta_config_path, &file);
    }

    /// The Unix socket of an I/O server with `unix_sockets`.
    fn unix_socket(&self, server: &IoServer) -> Option<PathBuf> {
        self.options.unix_sockets.then(|| {
            self.dir
                .path()
                .join(format!("io-{}.sock", server.server_id))
        })
    }

    /// The address an I/O server gives the meta server for clients.
    fn advertised_address(&self, server: &IoServer) -> String {
        match self.unix_socket(server) {
            Some(path) => format!("unix:{}", path.display()),
            None => server.address.clone(),
        }
    }

    fn write_io_config(&self, index: usize) {
        let server = &self.io[index];
        let unix_socket = self.unix_socket(server);
        let io = IoConfig {
            server_id: server.server_id,
            listen_address: server.address.clone(),
            advertise_address: unix_socket
                .as_ref()
                .map(|path| format!("unix:{}", path.display())),
            unix_socket,
            data_dir: PathBuf::from(format!("io-{}", server.server_id)),
            meta_address: self.meta_address.clone(),
            engine: self.options.engine,
            buffer_count: 16,
            worker_threads: 4,
            register_backoff_max_ms: 500,
            metrics_address: server.metrics_address.clone(),
            ..IoConfig::default()
        };
        let file = IoFile {
            key_file: PathBuf::from("cluster.key"),
            io,
        };
        write_toml(&server.config_path, &file);
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn io_count(&self) -> usize {
        self.io.len()
    }

    pub fn io_address(&self, index: usize) -> &str {
        &self.io[index].address
    }

    /// The metrics endpoint of I/O server `index` (with `ClusterOptions::metrics`).
    pub fn io_metrics_address(&self, index: usize) -> Option<&str> {
        self.io[index].metrics_address.as_deref()
    }

    /// The meta server's metrics endpoint (with `ClusterOptions::metrics`).
    pub fn meta_metrics_address(&self) -> Option<&str> {
        self.meta_metrics_address.as_deref()
    }

    pub fn io_data_dir(&self, index: usize) -> &Path {
        &self.io[index].data_dir
    }

    pub fn meta_data_dir(&self) -> PathBuf {
        self.path().join("meta")
    }

    fn spawn_meta(&mut self) {
        assert!(self.meta.is_none(), "meta server already running");
        self.meta = Some(spawn_server(
            "meta",
            &self.meta_config_path,
            &self.meta_log_path,
        ));
    }

    fn spawn_io(&mut self, index: usize) {
        let command = match (&self.options.switch, io_host(&self.options, index)) {
            (Some(switch), Some(host)) => switch.command(host, FREEFLOW),
            _ => Command::new(FREEFLOW),
        };
        let server = &mut self.io[index];
        assert!(server.child.is_none(), "I/O server {index} already running");
        server.child = Some(spawn_server_as(
            command,
            "io",
            &server.config_path,
            &server.log_path,
        ));
    }

    /// Every log, for failure messages.
    pub fn all_logs(&self) -> String {
        let mut text = format!("---- meta log ----\n{}\n", self.meta_log());
        for index in 0..self.io.len() {
            text.push_str(&format!(
                "---- io-{index} log ----\n{}\n",
                self.io_log(index)
            ));
        }
        text
    }

    /// Panic with every log if a child has exited on its own.
    pub fn check_children_alive(&mut self) {
        let mut dead = Vec::new();
        if let Some(child) = &mut self.meta {
            if let Ok(Some(status)) = child.try_wait() {
                dead.push(format!("meta server exited with {status}"));
            }
        }
        for server in &mut self.io {
            if let Some(child) = &mut server.child {
                if let Ok(Some(status)) = child.try_wait() {
                    dead.push(format!(
                        "I/O server {} exited with {status}",
                        server.server_id
                    ));
                }
            }
        }
        if !dead.is_empty() {
            panic!("{}\n{}", dead.join("; "), self.all_logs());
        }
    }

    fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new(self.meta_address.clone(), self.key.clone());
        config.connect_timeout_ms = 2_000;
        config.call_timeout_ms = 20_000;
        config.client_name = format!("test-{}", std::process::id());
        config
    }

    /// Wait until a client connects. With `port_race_log_offset`, returns false instead if the
    /// server exited because its port was taken (its log past that offset says so).
    async fn wait_meta_ready(&mut self, port_race_log_offset: Option<u64>) -> bool {
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        loop {
            if let Some(offset) = port_race_log_offset {
                let child = self.meta.as_mut().expect("meta server spawned");
                if lost_port_race(child, &self.meta_log_path, offset) {
                    self.meta = None;
                    return false;
                }
            }
            self.check_children_alive();
            if let Ok(client) = Client::connect(self.client_config()).await {
                client.shutdown().await;
                return true;
            }
            if Instant::now() >= deadline {
                panic!(
                    "meta server not ready within {READY_WAIT_MS} ms\n{}",
                    self.all_logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the I/O server accepts an authenticated connection as itself.
    /// With `port_race_log_offset`, returns false instead if the server exited because its
    /// port was taken.
    async fn wait_io_serving(&mut self, index: usize, port_race_log_offset: Option<u64>) -> bool {
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        let options = freeflow_rpc::ConnectOptions {
            connect_timeout_ms: 1_000,
            ..freeflow_rpc::ConnectOptions::default()
        };
        let expected = format!("io:{}", self.io[index].server_id);
        loop {
            if let Some(offset) = port_race_log_offset {
                let server = &mut self.io[index];
                let child = server.child.as_mut().expect("I/O server spawned");
                if lost_port_race(child, &server.log_path, offset) {
                    server.child = None;
                    return false;
                }
            }
            self.check_children_alive();
            let address = self.io[index].address.clone();
            if let Ok(connection) =
                freeflow_rpc::Connection::connect(&address, &self.key, &options).await
            {
                assert_eq!(connection.identity(), expected, "who answers at {address}");
                return true;
            }
            if Instant::now() >= deadline {
                panic!(
                    "I/O server {index} not serving within {READY_WAIT_MS} ms\n{}",
                    self.all_logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the meta server lists every I/O server as up at its address.
    async fn wait_all_io_up(&mut self) {
        for index in 0..self.io.len() {
            if self.io[index].child.is_some() {
                self.wait_io_serving(index, None).await;
            }
        }
        let client = self.client().await;
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        loop {
            self.check_children_alive();
            if let Ok(servers) = client.servers().await {
                let all_up = self.io.iter().all(|io| {
                    servers.iter().any(|record| {
                        record.server_id == io.server_id
                            && record.up
                            && record.address == self.advertised_address(io)
                    })
                });
                if all_up {
                    break;
                }
            }
            if Instant::now() >= deadline {
                panic!(
                    "I/O servers not all registered within {READY_WAIT_MS} ms: {:?}\n{}",
                    client.servers().await,
                    self.all_logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        client.shutdown().await;
    }

    /// A new connected client (its own session and connections).
    pub async fn client(&self) -> Client {
        match Client::connect(self.client_config()).await {
            Ok(client) => client,
            Err(error) => panic!("client cannot connect: {error}\n{}", self.all_logs()),
        }
    }

    /// A client with a custom configuration change.
    pub async fn client_with(&self, change: impl FnOnce(&mut ClientConfig)) -> Client {
        let mut config = self.client_config();
        change(&mut config);
        match Client::connect(config).await {
            Ok(client) => client,
            Err(error) => panic!("client cannot connect: {error}\n{}", self.all_logs()),
        }
    }

    /// SIGKILL the I/O server and reap it.
    pub fn kill_io(&mut self, index: usize) {
        let mut child = self.io[index]
            .child
            .take()
            .unwrap_or_else(|| panic!("I/O server {index} is not running"));
        child.kill().expect("SIGKILL the I/O server");
        child.wait().expect("reap the I/O server");
    }

    /// Send `signal` to the I/O server (SIGSTOP to make it silent, SIGCONT to wake it).
    pub fn signal_io(&self, index: usize, signal: libc::c_int) {
        let child = self.io[index]
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("I/O server {index} is not running"));
        // SAFETY: sending a signal to our own child process.
        let sent = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "signal {signal} to I/O server {index}");
    }

    /// Send `signal` to the meta server (SIGSTOP to make it silent, SIGCONT to wake it).
    pub fn signal_meta(&self, signal: libc::c_int) {
        let child = self.meta.as_ref().expect("meta server is not running");
        // SAFETY: sending a signal to our own child process.
        let sent = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "signal {signal} to the meta server");
    }

    /// Start the I/O server again and wait only until it accepts connections, not for its
    /// registration (the meta server may be stopped).
    pub async fn respawn_io(&mut self, index: usize) {
        self.spawn_io(index);
        self.wait_io_serving(index, None).await;
    }

    /// SIGKILL the meta server and reap it.
    pub fn kill_meta(&mut self) {
        let mut child = self.meta.take().expect("meta server is not running");
        child.kill().expect("SIGKILL the meta server");
        child.wait().expect("reap the meta server");
    }

    /// Start the I/O server again with the same config and data; waits until it serves
    /// and the meta server lists it up.
    pub async fn restart_io(&mut self, index: usize) {
        self.spawn_io(index);
        self.wait_all_io_up().await;
    }

    /// Start the meta server again with the same config and data; waits until it serves
    /// and every running I/O server has registered with it again.
    pub async fn restart_meta(&mut self) {
        self.spawn_meta();
        self.wait_meta_ready(None).await;
        self.wait_running_io_registered().await;
    }

    /// Stop every process (SIGKILL) and start them all again on the same data.
    pub async fn restart_all(&mut self) {
        for index in 0..self.io.len() {
            if self.io[index].child.is_some() {
                self.kill_io(index);
            }
        }
        if self.meta.is_some() {
            self.kill_meta();
        }
        self.spawn_meta();
        self.wait_meta_ready(None).await;
        for index in 0..self.io.len() {
            self.spawn_io(index);
        }
        self.wait_all_io_up().await;
    }

    async fn wait_running_io_registered(&mut self) {
        let client = self.client().await;
        let running: Vec<u32> = self
            .io
            .iter()
            .filter(|io| io.child.is_some())
            .map(|io| io.server_id)
            .collect();
        let deadline = Instant::now() + Duration::from_millis(READY_WAIT_MS);
        loop {
            self.check_children_alive();
            if let Ok(servers) = client.servers().await {
                if running.iter().all(|id| {
                    servers
                        .iter()
                        .any(|record| record.server_id == *id && record.up)
                }) {
                    break;
                }
            }
            if Instant::now() >= deadline {
                panic!(
                    "I/O servers {running:?} did not register again within {READY_WAIT_MS} ms\n{}",
                    self.all_logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        client.shutdown().await;
    }

    pub fn meta_log(&self) -> String {
        read_log(&self.meta_log_path)
    }

    pub fn io_log(&self, index: usize) -> String {
        read_log(&self.io[index].log_path)
    }

    /// Where the object of (inode, stripe) lives in I/O server `index`'s data directory.
    pub fn object_path(&self, index: usize, inode: InodeId, stripe_index: u32) -> PathBuf {
        object_path_in(&self.io[index].data_dir, inode, stripe_index)
    }

    /// Every I/O server's data directory, by server index.
    pub fn io_data_dirs(&self) -> Vec<PathBuf> {
        self.io
            .iter()
            .map(|server| server.data_dir.clone())
            .collect()
    }

    /// Every object file of `inode` on any I/O server.
    pub fn object_files(&self, inode: InodeId) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for server in &self.io {
            let shard = server
                .data_dir
                .join("objects")
                .join(format!("{:02x}", inode % 256));
            let prefix = format!("{inode:016x}.");
            if let Ok(entries) = std::fs::read_dir(&shard) {
                for entry in entries.flatten() {
                    if entry.file_name().to_string_lossy().starts_with(&prefix) {
                        found.push(entry.path());
                    }
                }
            }
        }
        found
    }

    /// Write a client.toml for CLI runs and return its path.
    pub fn client_toml(&self) -> PathBuf {
        let path = self.path().join("client.toml");
        write_toml(
            &path,
            &ClientFile {
                meta_address: self.meta_address.clone(),
                key_file: self.path().join("cluster.key"),
                call_timeout_ms: 20_000,
            },
        );
        path
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut child) = self.meta.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for server in &mut self.io {
            if let Some(mut child) = server.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            if self.options.io_tmpfs_bytes.is_some() {
                let _ = Command::new("umount").arg(&server.data_dir).status();
            }
        }
    }
}

/// Where the object of (inode, stripe) lives in an I/O server's data directory.
pub fn object_path_in(data_dir: &Path, inode: InodeId, stripe_index: u32) -> PathBuf {
    let object = ObjectId {
        inode,
        stripe_index,
    };
    data_dir
        .join("objects")
        .join(format!("{:02x}", object.inode % 256))
        .join(format!("{:016x}.{}", object.inode, object.stripe_index))
}

/// Which of the (index, address) members of a replicated metadata cluster leads now: the
/// one whose hello carries an epoch (a member that does not lead says 0). None while none
/// does.
pub async fn leading_member(members: Vec<(usize, String)>, key: &ClusterKey) -> Option<usize> {
    let options = freeflow_rpc::ConnectOptions {
        connect_timeout_ms: 500,
        ..freeflow_rpc::ConnectOptions::default()
    };
    for (index, address) in members {
        if let Ok(connection) = freeflow_rpc::Connection::connect(&address, key, &options).await {
            if connection.epoch() != 0 {
                return Some(index);
            }
        }
    }
    None
}

/// A stopped metadata member's replicated tables: its last applied entry, the number of
/// pairs and their hash (`replicated_digest`), to compare members.
pub fn replica_digest(data_dir: &Path) -> (Option<String>, u64, u64) {
    let store =
        freeflow_meta::store::RedbStore::open(&data_dir.join("meta.redb")).expect("open a replica");
    let (applied, pairs, hash) =
        freeflow_meta::raft::snapshot::replicated_digest(&store).expect("digest");
    (applied.map(|log_id| log_id.to_string()), pairs, hash)
}

/// Poll `check` every 20 ms until it holds or `timeout_ms` passes (for synchronous tests).
pub fn poll_sync(timeout_ms: u64, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
