//! Freeflow's metadata server: the namespace, inodes, layouts, orphans and the I/O server
//! registry, kept in redb behind the [`store::MetaStore`] seam (DESIGN.md §2).
//!
//! Reads run in read transactions on the request's task, concurrently with writes (MVCC).
//! Mutations go through one writer thread that group-commits them (`writer.rs`): one fsync
//! covers every operation that arrived together, and each is durable before its reply.
//! Start-up reads a handful of counters and never scans, so it is O(1) in the number of
//! files.

pub mod cutter;
pub mod io_peers;
pub mod leases;
pub mod locks;
pub mod metrics;
pub mod ops;
pub mod raft;
pub mod reaper;
pub mod records;
pub mod recovery;
pub mod registry;
pub mod service;
pub mod sessions;
pub mod shared;
pub mod store;
pub mod writer;

#[cfg(test)]
mod batch_tests;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use freeflow_metrics::Registry as MetricsRegistry;
use freeflow_rpc::{ClusterKey, ServerOptions};
use freeflow_types::limits::{REPLICAS_MAX, STRIPE_COUNT_MAX, STRIPE_UNIT_BYTES_DEFAULT};
use freeflow_types::Layout;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;

use crate::io_peers::IoConnections;
use crate::ops::WriterState;
use crate::registry::Registry;
use crate::service::MetaService;
use crate::sessions::{SessionLimits, Sessions};
use crate::shared::Shared;
use crate::store::{MetaStore, RedbStore, StoreError, StoreRead, StoreWrite, TableId};
use crate::writer::WriterMessage;

/// Name of the redb file inside the data directory.
pub const DATABASE_FILE_NAME: &str = "meta.redb";

/// Configuration of the metadata server, as read from TOML. Every field has a default.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetaConfig {
    /// Address to listen on; port 0 picks a free port (tests). Default "127.0.0.1:7700".
    pub listen_address: String,
    /// Directory holding `meta.redb`; created if missing.
    pub data_dir: PathBuf,
    /// Sessions not renewed within this time end, closing their handles. Default 30000.
    pub lease_ms: u32,
    /// Stripe unit of new files when their directory sets none. Default 1 MiB.
    pub stripe_unit_bytes: u32,
    /// Stripe count of new files when their directory sets none; 0: all servers. Default 0.
    pub stripe_count: u32,
    /// Copies of each stripe of new files when their directory sets none (chain
    /// replication, DESIGN.md §7); at most the number of I/O servers. Default 1.
    pub replicas: u32,
    /// An I/O server not heard from within this time is reported down. Default 5000.
    pub server_down_after_ms: u64,
    /// How often I/O servers are told to send their heartbeat. Default 1000.
    pub heartbeat_interval_ms: u32,
    /// Most mutations committed in one write transaction (one fsync). Default 256.
    pub commit_batch_max: usize,
    /// Mutations queued for the writer before callers wait. Default 4096.
    pub commit_queue_max: usize,
    /// Mutations are answered before they are durable; a durable commit (one fsync)
    /// follows within this time, sooner when a client asks (fsync, sync). Default 500.
    pub commit_interval_ms: u64,
    /// After a restart, how long new requests wait for clients to replay the mutations
    /// they were answered but that were not durable (and reclaim their locks). Default
    /// 10000; never shorter than `cache_lease_ms` in effect.
    pub recovery_window_ms: u64,
    /// How long a client that polls for revocations may cache what it read (names,
    /// attributes) without asking again; a mutation waits at most this long for a client
    /// that does not acknowledge a revocation. Default 10000.
    pub cache_lease_ms: u32,
    /// Payload bytes a client may have in flight per connection. Default 16 MiB.
    pub window_bytes: u32,
    /// Requests served at once per connection. Default 128.
    pub requests_in_flight_max: u32,
    /// Client sessions at once. Default 65536.
    pub sessions_max: usize,
    /// Open handles at once, over all sessions. Default 1048576.
    pub handles_max: usize,
    /// Orphans whose data is being removed at once. Default 32.
    pub reap_concurrency_max: usize,
    /// Memory redb may use to cache pages. Default 256 MiB.
    pub store_cache_bytes: usize,
    /// Where to serve Prometheus metrics over HTTP (`GET /metrics`), `host:port`; port 0
    /// picks a free port. Default: none (no endpoint; the counters still run).
    pub metrics_address: Option<String>,
    /// Replicated metadata (issue 11): this server's id among `peers`; 0 (the default):
    /// a single metadata server, no Raft.
    pub node_id: u64,
    /// Replicated metadata: every metadata server of the cluster, this one included (an
    /// odd number: 3 survive the loss of one). Empty for a single server.
    pub peers: Vec<MetaPeer>,
    /// Replicated metadata: the leader's heartbeat to its followers. Default 100.
    pub raft_heartbeat_ms: u64,
    /// Replicated metadata: the election timeout, between this and twice it at random. A
    /// follower that has not heard from its leader for twice this (the leader's lease)
    /// plus its timeout calls an election, so a failover takes about three to four times
    /// this. Default 300.
    pub raft_election_ms: u64,
    /// Replicated metadata: entries between two snapshots of the applied state (a
    /// follower further behind than the log keeps gets a snapshot). Default 20,000.
    pub raft_snapshot_entries: u64,
    /// Replicated metadata: entries the log keeps behind its last snapshot, for followers
    /// a little behind. Default 2,000.
    pub raft_log_kept_entries: u64,
}

/// One metadata server of a replicated cluster.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaPeer {
    /// Its Raft node id (at least 1, unique).
    pub id: u64,
    /// Where clients and I/O servers reach it (its `listen_address` as others see it).
    pub address: String,
    /// Where the other metadata servers reach its Raft service.
    pub raft_address: String,
}

impl Default for MetaConfig {
    fn default() -> MetaConfig {
        MetaConfig {
            listen_address: "127.0.0.1:7700".into(),
            data_dir: PathBuf::from("freeflow-meta"),
            lease_ms: 30_000,
            stripe_unit_bytes: STRIPE_UNIT_BYTES_DEFAULT,
            stripe_count: 0,
            replicas: 1,
            server_down_after_ms: 5000,
            heartbeat_interval_ms: 1000,
            commit_batch_max: 256,
            commit_queue_max: 4096,
            commit_interval_ms: 500,
            recovery_window_ms: 10_000,
            cache_lease_ms: 10_000,
            window_bytes: 16 << 20,
            requests_in_flight_max: 128,
            sessions_max: 65_536,
            handles_max: 1 << 20,
            reap_concurrency_max: 32,
            store_cache_bytes: 256 << 20,
            metrics_address: None,
            node_id: 0,
            peers: Vec::new(),
            raft_heartbeat_ms: 100,
            raft_election_ms: 300,
            raft_snapshot_entries: 20_000,
            raft_log_kept_entries: 2_000,
        }
    }
}

/// Why the metadata server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("invalid meta config: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("cannot create data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open metadata store {path}: {source}")]
    Store { path: PathBuf, source: StoreError },
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("metadata server task failed: {0}")]
    Task(String),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> MetaError {
    MetaError::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

impl MetaConfig {
    /// Check every field and the rules between fields.
    pub fn validate(&self) -> Result<(), MetaError> {
        let MetaConfig {
            listen_address,
            data_dir,
            lease_ms,
            stripe_unit_bytes,
            stripe_count,
            replicas,
            server_down_after_ms,
            heartbeat_interval_ms,
            commit_batch_max,
            commit_queue_max,
            commit_interval_ms,
            recovery_window_ms,
            cache_lease_ms,
            window_bytes,
            requests_in_flight_max,
            sessions_max,
            handles_max,
            reap_concurrency_max,
            store_cache_bytes,
            metrics_address,
            node_id,
            peers,
            raft_heartbeat_ms,
            raft_election_ms,
            raft_snapshot_entries,
            raft_log_kept_entries: _,
        } = self;
        if listen_address.is_empty() || !listen_address.contains(':') {
            return Err(invalid(
                "listen_address",
                format!("{listen_address:?} is not host:port"),
            ));
        }
        if data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if *lease_ms < 100 {
            return Err(invalid(
                "lease_ms",
                format!("{lease_ms} is below the minimum 100"),
            ));
        }
        if let Err(error) = Layout::new(*stripe_unit_bytes, vec![0]) {
            return Err(invalid("stripe_unit_bytes", error.to_string()));
        }
        if *stripe_count > STRIPE_COUNT_MAX {
            return Err(invalid(
                "stripe_count",
                format!("{stripe_count} is above the maximum {STRIPE_COUNT_MAX} (0: all servers)"),
            ));
        }
        if *replicas == 0 || *replicas > REPLICAS_MAX {
            return Err(invalid(
                "replicas",
                format!("{replicas} is outside 1..={REPLICAS_MAX}"),
            ));
        }
        if *heartbeat_interval_ms == 0 {
            return Err(invalid("heartbeat_interval_ms", "must be at least 1"));
        }
        if *server_down_after_ms <= u64::from(*heartbeat_interval_ms) {
            return Err(invalid(
                "server_down_after_ms",
                format!(
                    "{server_down_after_ms} must be longer than heartbeat_interval_ms {heartbeat_interval_ms}"
                ),
            ));
        }
        for (field, value) in [
            ("commit_batch_max", *commit_batch_max),
            ("commit_queue_max", *commit_queue_max),
            ("sessions_max", *sessions_max),
            ("handles_max", *handles_max),
            ("reap_concurrency_max", *reap_concurrency_max),
            ("requests_in_flight_max", *requests_in_flight_max as usize),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if *commit_interval_ms == 0 || *commit_interval_ms > 60_000 {
            return Err(invalid(
                "commit_interval_ms",
                format!("{commit_interval_ms} is not between 1 and 60000"),
            ));
        }
        if *cache_lease_ms < 100 || *cache_lease_ms > 600_000 {
            return Err(invalid(
                "cache_lease_ms",
                format!("{cache_lease_ms} is not between 100 and 600000"),
            ));
        }
        if *recovery_window_ms > 3_600_000 {
            return Err(invalid(
                "recovery_window_ms",
                format!("{recovery_window_ms} is above one hour"),
            ));
        }
        if *window_bytes < 64 << 10 {
            return Err(invalid(
                "window_bytes",
                format!("{window_bytes} is below 64 KiB"),
            ));
        }
        if let Some(metrics_address) = metrics_address {
            if metrics_address.is_empty() || !metrics_address.contains(':') {
                return Err(invalid(
                    "metrics_address",
                    format!("{metrics_address:?} is not host:port"),
                ));
            }
        }
        if *store_cache_bytes < 1 << 20 {
            return Err(invalid(
                "store_cache_bytes",
                format!("{store_cache_bytes} is below 1 MiB"),
            ));
        }
        if *node_id == 0 {
            if !peers.is_empty() {
                return Err(invalid(
                    "node_id",
                    "peers are set, so node_id must name this server among them",
                ));
            }
            return Ok(());
        }
        if !peers.iter().any(|peer| peer.id == *node_id) {
            return Err(invalid(
                "peers",
                format!("no peer has this server's node_id {node_id}"),
            ));
        }
        let mut ids = std::collections::BTreeSet::new();
        for peer in peers {
            if peer.id == 0 || !ids.insert(peer.id) {
                return Err(invalid(
                    "peers",
                    format!("peer id {} is 0 or given twice", peer.id),
                ));
            }
            for (what, address) in [
                ("address", &peer.address),
                ("raft_address", &peer.raft_address),
            ] {
                if !address.contains(':') {
                    return Err(invalid(
                        "peers",
                        format!("peer {}'s {what} {address:?} is not host:port", peer.id),
                    ));
                }
            }
        }
        if *raft_heartbeat_ms == 0 || *raft_election_ms < 3 * *raft_heartbeat_ms {
            return Err(invalid(
                "raft_election_ms",
                format!(
                    "{raft_election_ms} must be at least three heartbeats ({raft_heartbeat_ms} ms each, at least 1)"
                ),
            ));
        }
        if *recovery_window_ms < RECOVERY_WINDOW_REPLICATED_MIN_MS {
            return Err(invalid(
                "recovery_window_ms",
                format!(
                    "{recovery_window_ms} is below {RECOVERY_WINDOW_REPLICATED_MIN_MS}: with peers, \
                     a client finds a leader cut off only once it has been silent for the \
                     clients' liveness timeout ({} ms by default), and the changes it replays \
                     to the new leader after the window are lost",
                    freeflow_rpc::LIVENESS_TIMEOUT_MS_DEFAULT
                ),
            ));
        }
        if *raft_snapshot_entries == 0 {
            return Err(invalid(
                "raft_snapshot_entries",
                "must be at least 1 (entries between snapshots)",
            ));
        }
        Ok(())
    }
}

/// The shortest recovery window of a replicated metadata server. The window starts when
/// the new leader serves; a client whose calls wait on a leader cut off (not killed: its
/// sockets stay open) finds it gone only after the liveness timeout of its connection
/// (`freeflow_rpc::LIVENESS_TIMEOUT_MS_DEFAULT`, checked every quarter of it), then asks
/// every member at once. Twice the default liveness timeout leaves room for both.
pub const RECOVERY_WINDOW_REPLICATED_MIN_MS: u64 = 2 * freeflow_rpc::LIVENESS_TIMEOUT_MS_DEFAULT;

/// A running metadata server.
pub struct RunningMeta {
    shared: Arc<Shared>,
    metrics: Arc<MetricsRegistry>,
    listen_address: SocketAddr,
    serve_task: JoinHandle<std::io::Result<()>>,
    background_tasks: Vec<JoinHandle<()>>,
    writer_thread: Option<std::thread::JoinHandle<()>>,
}

/// How long shutdown waits for in-flight reads to release the store before closing it.
const STORE_RELEASE_WAIT_MS: u64 = 5000;

/// Open the store (creating it on first start), bind, and serve.
pub async fn start(config: MetaConfig, key: ClusterKey) -> Result<RunningMeta, MetaError> {
    config.validate()?;
    let started = Instant::now();
    std::fs::create_dir_all(&config.data_dir).map_err(|source| MetaError::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    let path = config.data_dir.join(DATABASE_FILE_NAME);
    let store_error = |source| MetaError::Store {
        path: path.clone(),
        source,
    };
    let store = RedbStore::open_with_cache(&path, config.store_cache_bytes).map_err(store_error)?;
    let state = {
        let mut write = store.begin_write().map_err(store_error)?;
        let state = ops::initialise(&mut write, ops::now()).map_err(store_error)?;
        write.commit().map_err(store_error)?;
        state
    };
    launch(config, key, Arc::new(store), state, started, None).await
}

/// Serve the namespace in `store` (initialised: `state` is its writer state) with this
/// process's writer, service and background tasks; `raft` when it leads a replicated
/// cluster.
pub(crate) async fn launch(
    config: MetaConfig,
    key: ClusterKey,
    store: Arc<RedbStore>,
    state: WriterState,
    started: Instant,
    raft: Option<raft::link::RaftLink>,
) -> Result<RunningMeta, MetaError> {
    let path = config.data_dir.join(DATABASE_FILE_NAME);
    let store_error = |source| MetaError::Store {
        path: path.clone(),
        source,
    };
    let (servers, clients) = {
        let read = store.begin_read().map_err(store_error)?;
        let servers = ops::servers::load_servers(&read).map_err(|error| match error {
            ops::OpError::Store(source) => store_error(source),
            ops::OpError::Refused(wire) => store_error(StoreError::Backend(wire.message)),
        })?;
        // Bounded like the sessions that made them (one record per client with a session).
        let clients: HashSet<u64> = read
            .range_keys(
                TableId::Clients,
                std::ops::Bound::Unbounded,
                std::ops::Bound::Unbounded,
                config.sessions_max,
            )
            .map_err(store_error)?
            .iter()
            .filter_map(|key| key.as_slice().try_into().ok().map(u64::from_be_bytes))
            .collect();
        (servers, clients)
    };
    let listener = freeflow_rpc::net::bind(&config.listen_address)
        .await
        .map_err(|source| MetaError::Bind {
            address: config.listen_address.clone(),
            source,
        })?;
    let listen_address = listener.local_addr().map_err(|source| MetaError::Bind {
        address: config.listen_address.clone(),
        source,
    })?;

    // Bound before serving, so a taken metrics port fails the start, not a later scrape.
    let metrics_listener = match &config.metrics_address {
        Some(address) => {
            let bind_error = |source| MetaError::Bind {
                address: format!("{address} (metrics)"),
                source,
            };
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(bind_error)?;
            let bound = listener.local_addr().map_err(bind_error)?;
            Some((listener, bound))
        }
        None => None,
    };
    let registry = Arc::new(MetricsRegistry::new());

    let state_inode_count = state.inode_count;
    let (writer_sender, writer_receiver) = mpsc::channel(config.commit_queue_max);
    let shared = Arc::new(Shared {
        sessions: Mutex::new(Sessions::new(SessionLimits {
            sessions_max: config.sessions_max,
            handles_max: config.handles_max,
            lease: Duration::from_millis(u64::from(config.lease_ms)),
        })),
        registry: Mutex::new(Registry::new(
            servers,
            Duration::from_millis(config.server_down_after_ms),
        )),
        cuts_confirmed: Mutex::new(HashMap::new()),
        store: RwLock::new(Some(store)),
        writer: writer_sender,
        inode_count: AtomicU64::new(state_inode_count),
        orphan_count: AtomicU64::new(state.orphan_count),
        commit_count: AtomicU64::new(0),
        boot_epoch: state.boot_epoch,
        started,
        ready_ms: AtomicU64::new(0),
        reaper_wake: Notify::new(),
        closing: AtomicBool::new(false),
        io: IoConnections::new(key.clone()),
        cut_gates: Mutex::new(HashMap::new()),
        metrics: metrics::MetaMetrics::new(&registry),
        metrics_address: metrics_listener
            .as_ref()
            .map(|(_, bound)| bound.to_string()),
        last_txn: AtomicU64::new(state.recovered_txn),
        durable: tokio::sync::watch::Sender::new(state.recovered_txn),
        dirty: Mutex::new(HashMap::new()),
        answered_txn: AtomicU64::new(0),
        visible_txn: tokio::sync::watch::Sender::new(0),
        registered_clients: Mutex::new(clients.clone()),
        // At least one cache lease: a client that does not come back may still trust
        // what the old server leased to it until then, so nothing may change before.
        recovery: recovery::Recovery::new(
            clients.clone(),
            Duration::from_millis(
                config
                    .recovery_window_ms
                    .max(u64::from(config.cache_lease_ms)),
            ),
        ),
        mutations_in_progress: Mutex::new(HashSet::new()),
        mutation_finished: Notify::new(),
        leases: leases::Leases::new(config.cache_lease_ms),
        locks: locks::LockTable::new(),
        raft,
        config,
    });
    if !clients.is_empty() {
        tracing::info!(
            clients = clients.len(),
            window_ms = shared.config.recovery_window_ms,
            recovered_txn = state.recovered_txn,
            "waiting for clients to replay what was not durable"
        );
    }
    let writer_thread = spawn_writer(shared.clone(), writer_receiver, state)?;

    let mut options = ServerOptions::new("meta");
    options.epoch = shared.boot_epoch;
    options.window_bytes = shared.config.window_bytes;
    options.requests_in_flight_max = shared.config.requests_in_flight_max;
    // Lock waits and revocation polls wait for other clients, not for this server: apart
    // from the slots of the requests that do work.
    options.long_poll_opcodes = vec![
        <freeflow_proto::meta::SetLock as freeflow_proto::Request>::OPCODE,
        <freeflow_proto::meta::WaitRevocations as freeflow_proto::Request>::OPCODE,
    ];
    options.metrics = Some(freeflow_rpc::ServerMetrics::new(
        &registry,
        freeflow_proto::meta::OPCODES,
    ));
    let service = Arc::new(MetaService {
        shared: shared.clone(),
    });
    let serve_task = tokio::spawn(freeflow_rpc::serve(listener, key.clone(), options, service));
    let mut background_tasks = vec![
        tokio::spawn(reaper::run(shared.clone())),
        tokio::spawn(expire_sessions(shared.clone())),
        tokio::spawn(flush_periodically(shared.clone())),
        tokio::spawn(end_recovery_in_time(shared.clone())),
        tokio::spawn(put_out_silent_servers(shared.clone())),
    ];
    metrics::register_state_gauges(&registry, &shared, state_inode_count);
    if let Some((listener, _)) = metrics_listener {
        let serving = freeflow_metrics::serve_http(listener, Arc::clone(&registry));
        background_tasks.push(tokio::spawn(async move {
            if let Err(error) = serving.await {
                tracing::error!(%error, "metrics endpoint stopped");
            }
        }));
    }

    let ready_ms = started.elapsed().as_millis() as u64;
    shared.ready_ms.store(ready_ms, Ordering::Relaxed);
    tracing::info!(
        inode_count = shared.inode_count.load(Ordering::Relaxed),
        listen_address = %listen_address,
        data_dir = %shared.config.data_dir.display(),
        metrics_address = shared.metrics_address.as_deref().unwrap_or("off"),
        "ready in {ready_ms} ms"
    );
    Ok(RunningMeta {
        shared,
        metrics: registry,
        listen_address,
        serve_task,
        background_tasks,
        writer_thread: Some(writer_thread),
    })
}

fn spawn_writer(
    shared: Arc<Shared>,
    receiver: mpsc::Receiver<WriterMessage>,
    state: WriterState,
) -> Result<std::thread::JoinHandle<()>, MetaError> {
    // In the runtime's context, so the writer's clock is the runtime's (the same as the
    // rest of the server's; only a paused clock under simulation can differ).
    let runtime = tokio::runtime::Handle::current();
    std::thread::Builder::new()
        .name("meta-writer".into())
        .spawn(move || {
            let _context = runtime.enter();
            writer::run(shared, receiver, state)
        })
        .map_err(|error| MetaError::Task(format!("cannot start the writer thread: {error}")))
}

/// Ends sessions whose lease ran out; wakes the reaper for files left without handles;
/// forgets the records of clients left without a session; releases the locks of sessions
/// that ended; drops cache leases that ran out.
async fn expire_sessions(shared: Arc<Shared>) {
    let period_ms = (u64::from(shared.config.lease_ms) / 4).max(50);
    let mut interval = tokio::time::interval(Duration::from_millis(period_ms));
    loop {
        interval.tick().await;
        shared.leases.sweep();
        let (closed, clients, ended) = shared.sessions().expire(Instant::now());
        for session in ended {
            shared.locks.release_session(session);
        }
        if !closed.is_empty() {
            shared.reaper_wake.notify_one();
        }
        for client in clients {
            shared.forget_client(client).await;
        }
    }
}

/// Puts out of their chains the I/O servers silent past `server_down_after_ms` (see
/// `registry.rs`), checked at every heartbeat interval.
async fn put_out_silent_servers(shared: Arc<Shared>) {
    let period = Duration::from_millis(u64::from(shared.config.heartbeat_interval_ms).max(10));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let silent = shared.registry().silent(Instant::now());
        if silent.is_empty() {
            continue;
        }
        // Persisted first: a map that names a server out must survive a restart of ours.
        let persisted = silent.clone();
        let written = shared
            .write(move |write, _context| {
                for (server, entry) in &persisted {
                    ops::servers::put_server(write, *server, entry)?;
                }
                Ok(())
            })
            .await;
        let durable = match written {
            Ok(()) => shared.sync().await.map(|_| ()),
            Err(error) => Err(error),
        };
        if let Err(error) = durable {
            tracing::error!(%error, "cannot persist the servers to put out of their chains; trying again");
            continue;
        }
        let mut registry = shared.registry();
        let now = Instant::now();
        for (server, entry) in &silent {
            tracing::warn!(
                server,
                "I/O server silent past server_down_after_ms: out of its chains"
            );
            registry.put_out(*server, entry, now);
        }
    }
}

/// Nudges the writer so that what was answered early is durable within
/// `commit_interval_ms` even when nothing else comes.
async fn flush_periodically(shared: Arc<Shared>) {
    let period = Duration::from_millis((shared.config.commit_interval_ms / 2).max(1));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        if shared.last_txn.load(Ordering::Acquire) > shared.durable_txn()
            && shared.writer.try_send(WriterMessage::Flush).is_err()
        {
            // A full queue: the writer is busy and will commit soon anyway.
        }
    }
}

/// Ends the recovery window at its deadline; clients that did not replay by then lose what
/// they held, and their records go.
async fn end_recovery_in_time(shared: Arc<Shared>) {
    if !shared.recovery.is_recovering() {
        return;
    }
    let deadline = shared.recovery.deadline();
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => {}
        () = shared.recovery.wait() => return,
    }
    let missing = shared.recovery.end();
    if !missing.is_empty() {
        tracing::warn!(
            clients = ?missing,
            "recovery window over: these clients did not replay; changes only they held are lost"
        );
    }
    for client in missing {
        if !shared.sessions().has_sessions_of(client) {
            shared.forget_client(client).await;
        }
    }
}

impl RunningMeta {
    pub fn listen_address(&self) -> SocketAddr {
        self.listen_address
    }

    /// Milliseconds from `start` being called to serving.
    pub fn ready_ms(&self) -> u64 {
        self.shared.ready_ms.load(Ordering::Relaxed)
    }

    pub fn inode_count(&self) -> u64 {
        self.shared.inode_count.load(Ordering::Relaxed)
    }

    pub fn orphan_count(&self) -> u64 {
        self.shared.orphan_count.load(Ordering::Relaxed)
    }

    /// This server's metrics (also served over HTTP when `metrics_address` is set).
    pub fn metrics(&self) -> &Arc<MetricsRegistry> {
        &self.metrics
    }

    /// The bound metrics endpoint, if `metrics_address` was set.
    pub fn metrics_address(&self) -> Option<&str> {
        self.shared.metrics_address.as_deref()
    }

    /// Write transactions committed since start (each one fsync, covering a batch).
    /// The last transaction committed, and the last one durable (issue 10: mutations are
    /// answered in between).
    pub fn last_txn(&self) -> u64 {
        self.shared.last_txn.load(Ordering::Acquire)
    }

    pub fn durable_txn(&self) -> u64 {
        self.shared.durable_txn()
    }

    pub fn commit_count(&self) -> u64 {
        self.shared.commit_count.load(Ordering::Relaxed)
    }

    /// Stop accepting, commit what is queued, close the store (its file lock is released
    /// when this returns, so the same data directory can be started again).
    pub async fn shutdown(mut self) {
        self.stop().await;
    }

    async fn stop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.serve_task.abort();
        for task in &self.background_tasks {
            task.abort();
        }
        if self
            .shared
            .writer
            .send(WriterMessage::Shutdown)
            .await
            .is_err()
        {
            tracing::warn!("metadata writer had already stopped");
        }
        if let Some(thread) = self.writer_thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                tracing::error!("metadata writer thread panicked");
            }
        }
        let store = {
            let mut guard = self
                .shared
                .store
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            guard.take()
        };
        // Replicated: the Raft node holds the store too and outlives this server.
        let store = store.filter(|_| self.shared.raft.is_none());
        if let Some(mut store) = store {
            let deadline = Instant::now() + Duration::from_millis(STORE_RELEASE_WAIT_MS);
            loop {
                match Arc::try_unwrap(store) {
                    Ok(store) => {
                        drop(store);
                        break;
                    }
                    Err(still_shared) if Instant::now() < deadline => {
                        store = still_shared;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(_) => {
                        tracing::warn!("metadata store still in use at shutdown; left open");
                        break;
                    }
                }
            }
        }
        tracing::info!("metadata server stopped");
    }

    /// Serve until the listener fails fatally.
    pub async fn wait(mut self) -> Result<(), MetaError> {
        let result = (&mut self.serve_task).await;
        self.stop().await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(MetaError::Task(format!("listener failed: {error}"))),
            Err(error) if error.is_cancelled() => Ok(()),
            Err(error) => Err(MetaError::Task(format!("listener task failed: {error}"))),
        }
    }
}

impl Drop for RunningMeta {
    /// Dropped without `shutdown`: stop serving and let the writer finish what is queued
    /// and exit (it would otherwise wait forever on its channel).
    fn drop(&mut self) {
        if self.writer_thread.is_some() {
            let _ = self.shared.writer.try_send(WriterMessage::Shutdown);
        }
        self.shared.closing.store(true, Ordering::Release);
        self.serve_task.abort();
        for task in &self.background_tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;

    fn replicated(recovery_window_ms: u64) -> MetaConfig {
        let peers = (1..=3)
            .map(|id| MetaPeer {
                id,
                address: format!("10.0.0.{id}:7700"),
                raft_address: format!("10.0.0.{id}:7774"),
            })
            .collect();
        MetaConfig {
            node_id: 1,
            peers,
            recovery_window_ms,
            ..MetaConfig::default()
        }
    }

    /// A replicated server's recovery window must outlast a client's discovery that its
    /// leader went silent; a single server's may be as short as its owner likes.
    #[test]
    fn a_replicated_recovery_window_shorter_than_a_clients_liveness_is_refused() {
        assert!(replicated(MetaConfig::default().recovery_window_ms)
            .validate()
            .is_ok());
        assert!(replicated(RECOVERY_WINDOW_REPLICATED_MIN_MS)
            .validate()
            .is_ok());
        let error = replicated(3_000).validate().unwrap_err().to_string();
        assert!(
            error.contains("recovery_window_ms") && error.contains("liveness"),
            "{error}"
        );
        let single = MetaConfig {
            recovery_window_ms: 1_000,
            ..MetaConfig::default()
        };
        assert!(single.validate().is_ok());
    }
}
