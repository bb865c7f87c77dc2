//! A running metadata server: opening the store, launching the writer, the service and
//! the background tasks, and shutting them down.

use crate::config::{MetaConfig, MetaError, DATABASE_FILE_NAME};
use crate::io_peers::IoConnections;
use crate::ops;
use crate::ops::WriterState;
use crate::raft;
use crate::registry::Registry;
use crate::service::MetaService;
use crate::sessions::{SessionLimits, Sessions};
use crate::shared::Shared;
use crate::store::{MetaStore, RedbStore, StoreError, StoreRead, StoreWrite, TableId};
use crate::writer;
use crate::writer::WriterMessage;
use crate::{gauges, leases, locks, metrics, reaper, recovery};
use freeflow_metrics::Registry as MetricsRegistry;
use freeflow_rpc::{ClusterKey, ServerOptions};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A running metadata server.
pub struct RunningMeta {
    pub(crate) shared: Arc<Shared>,
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
    let (servers, replacements, clients) = {
        let read = store.begin_read().map_err(store_error)?;
        let op_error = |error| match error {
            ops::OpError::Store(source) => store_error(source),
            ops::OpError::Refused(wire) => store_error(StoreError::Backend(wire.message)),
        };
        let servers = ops::servers::load_servers(&read).map_err(op_error)?;
        let replacements = ops::servers::load_replacements(&read).map_err(op_error)?;
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
        (servers, replacements, clients)
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
            replacements,
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
    options.members = shared
        .raft
        .as_ref()
        .map(|link| crate::raft::members::client_addresses(&link.raft));
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
        tokio::spawn(crate::rereplication::replace_lost_servers(shared.clone())),
    ];
    gauges::register_state_gauges(&registry, &shared, state_inode_count);
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
