//! Freeflow's I/O server (DESIGN.md §3 and §6.5): stores stripe objects as sparse files in
//! one data directory and serves `proto::io` requests over the RPC layer, with disk I/O
//! through io_uring (or a thread pool) and a bounded cache of open descriptors.
//!
//! Crate map, from the disk up:
//! - [`buffer_pool`]: fixed, pre-allocated I/O buffers with a FIFO queue of waiters.
//! - [`engine`]: the [`engine::DiskEngine`] trait; `uring` and `threads` implementations.
//! - [`fd_cache`]: bounded CLOCK cache of `Arc<File>`.
//! - [`store`]: the object store (paths, lazy creation, truncate, sync, remove, counts).
//! - [`identity`]: the data directory's `server-id` file.
//! - [`service`]: the RPC service; [`register`]: heartbeats to the meta server.
//! - [`metrics`]: what the server counts, served over HTTP when `metrics_address` is set.
//! - [`config`]: [`IoConfig`] and its validation; [`start`] composes everything.

pub mod buffer_pool;
pub mod config;
pub mod copy;
pub mod engine;
pub mod error;
pub mod fd_cache;
pub mod fill;
pub mod gate;
pub mod identity;
pub mod local_reads;
pub mod metrics;
pub mod register;
pub mod replication;
pub mod resync;
pub mod service;
pub mod space;
pub mod store;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use freeflow_metrics::Registry;
use freeflow_rpc::{ClusterKey, ServerMetrics, ServerOptions};
use freeflow_types::limits;
use tokio::task::JoinHandle;

pub use config::{DirectIo, EngineKind, IoConfig};
pub use error::{IoServerError, StoreError};

use engine::threads::ThreadEngine;
use engine::uring::{UringEngine, UringOptions};
use engine::{DiskEngine, EngineStats};
use store::ObjectStore;

/// Builds the engine the config asks for; io_uring falls back to threads if it cannot start.
pub fn build_engine(config: &IoConfig) -> Result<Arc<dyn DiskEngine>, IoServerError> {
    let threads = || -> Result<Arc<dyn DiskEngine>, IoServerError> {
        let engine = ThreadEngine::new(config.worker_threads, config.engine_queue_depth_max)
            .map_err(IoServerError::Engine)?;
        Ok(Arc::new(engine))
    };
    match config.engine {
        EngineKind::Threads => threads(),
        EngineKind::Uring => {
            let options = UringOptions {
                ring_entries: config.ring_entries,
                buffer_count: config.buffer_count,
                buffer_bytes: config.buffer_bytes,
            };
            match UringEngine::new(options) {
                Ok(engine) => Ok(Arc::new(engine)),
                Err(error) => {
                    tracing::warn!(%error, "io_uring unavailable; falling back to the thread engine");
                    threads()
                }
            }
        }
    }
}

/// A started I/O server.
pub struct RunningIo {
    listen_address: SocketAddr,
    engine_name: &'static str,
    store: Arc<ObjectStore>,
    registered: Arc<AtomicBool>,
    gate: Arc<gate::DataGate>,
    serve: JoinHandle<std::io::Result<()>>,
    /// The local-reads socket's server, when there is one.
    local_reads: Option<JoinHandle<()>>,
    registration: JoinHandle<()>,
    /// Fetches the service map when a request names a newer one.
    fetcher: JoinHandle<()>,
    metrics: Arc<Registry>,
    metrics_address: Option<SocketAddr>,
    metrics_task: Option<JoinHandle<std::io::Result<()>>>,
}

/// Starts an I/O server: checks the config and the data directory's identity, starts the disk
/// engine, listens, and begins registering with the meta server. Returns once it is serving;
/// it does not wait for the meta server, and never scans the objects before ready (the object
/// count is computed by a background task, see [`store`]).
pub async fn start(config: IoConfig, key: ClusterKey) -> Result<RunningIo, IoServerError> {
    let started = Instant::now();
    config.validate()?;
    identity::claim_data_dir(&config.data_dir, config.server_id)?;
    let fresh = identity::is_fresh(&config.data_dir);
    let registry = Arc::new(Registry::new());
    let engine: Arc<dyn DiskEngine> = Arc::new(metrics::MeteredEngine::new(
        build_engine(&config)?,
        metrics::DiskMetrics::new(&registry),
    ));
    let engine_name = engine.name();
    // With O_DIRECT a quarter of the descriptor budget holds direct descriptors, so the
    // two caches together stay within `open_files_max`.
    let direct_share = match config.direct_io {
        DirectIo::Off => 0,
        _ if config.open_files_max < 2 => {
            tracing::warn!(
                "open_files_max below 2 leaves no descriptor for O_DIRECT: direct_io is off"
            );
            0
        }
        _ => (config.open_files_max / 4).max(1),
    };
    let mut store = ObjectStore::open(
        config.server_id,
        &config.data_dir,
        engine,
        config.open_files_max - direct_share,
    )
    .map_err(|source| IoServerError::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    store.set_cached_reads(config.cached_reads);
    if direct_share > 0 {
        store.use_direct_io(
            u64::from(config.direct_io_min_bytes),
            config.direct_io == DirectIo::All && engine_name == "io_uring",
            direct_share,
        );
    }
    let store = Arc::new(store);

    let listener = freeflow_rpc::net::bind(&config.listen_address)
        .await
        .map_err(|source| IoServerError::Bind {
            address: config.listen_address.clone(),
            source,
        })?;
    let listen_address = listener
        .local_addr()
        .map_err(|source| IoServerError::Bind {
            address: config.listen_address.clone(),
            source,
        })?;
    let unix_listener = match &config.unix_socket {
        Some(path) => Some(bind_unix(path)?),
        None => None,
    };
    let advertise_address = match &config.advertise_address {
        Some(address) => address.clone(),
        None => {
            if listen_address.ip().is_unspecified() {
                tracing::warn!(
                    %listen_address,
                    "listening on an unspecified address without advertise_address: clients on other hosts cannot use it"
                );
            }
            listen_address.to_string()
        }
    };

    // Bound before serving, so a taken metrics port fails the start, not a later scrape.
    let metrics_listener = match &config.metrics_address {
        Some(address) => Some(bind_metrics(address).await?),
        None => None,
    };
    let mut options = ServerOptions {
        metrics: Some(ServerMetrics::new(&registry, freeflow_proto::io::OPCODES)),
        window_bytes: config.window_bytes,
        payload_bytes_in_flight_max: config.payload_budget(),
        connections_max: config.connections_max,
        payload_length_max: limits::IO_REQUEST_BYTES_MAX,
        requests_in_flight_max: config.requests_in_flight_max,
        ..ServerOptions::new(format!("io:{}", config.server_id))
    };
    let gate = Arc::new(gate::DataGate::new(config.server_id));
    let replication = Arc::new(replication::Replication::new(
        config.server_id,
        key.clone(),
        config.meta_address.clone(),
        config.meta_call_timeout_ms,
        config.meta_connect_timeout_ms,
        Arc::clone(&gate),
    ));
    let service = Arc::new(service::IoService::new(
        Arc::clone(&store),
        Arc::clone(&gate),
        Arc::clone(&replication),
    ));
    let fetcher = tokio::spawn(Arc::clone(&replication).fetch_when_told());
    let resync = Arc::new(resync::Resync {
        store: Arc::clone(&store),
        replication: Arc::clone(&replication),
        key: key.clone(),
        options: freeflow_rpc::ConnectOptions {
            client_name: format!("io:{}:resync", config.server_id),
            call_timeout_ms: config.meta_call_timeout_ms,
            connect_timeout_ms: config.meta_connect_timeout_ms,
            ..freeflow_rpc::ConnectOptions::default()
        },
        progress: Arc::new(copy::CopyProgress::default()),
        fill_progress: Arc::new(copy::CopyProgress::default()),
        cleaned_version: std::sync::atomic::AtomicU64::new(0),
        cleaning: std::sync::atomic::AtomicBool::new(false),
    });
    metrics::register_copy_gauges(&registry, &resync.progress, metrics::CopyKind::Resync);
    metrics::register_copy_gauges(&registry, &resync.fill_progress, metrics::CopyKind::Fill);
    metrics::register_memory_gauges(&registry, &config);
    metrics::register_replication_gauges(&registry, &replication);
    let local_reads = match &config.unix_socket {
        Some(path) if config.local_reads => {
            let local_path = freeflow_rpc::local::local_reads_path(&path.to_string_lossy());
            match freeflow_rpc::local::SeqpacketListener::bind(std::path::Path::new(&local_path)) {
                Ok(listener) => {
                    // Clients on this host share regions for their write payloads there.
                    let regions = Arc::new(freeflow_rpc::shared::SharedRegions::default());
                    options.shared_regions = Some(Arc::clone(&regions));
                    Some(tokio::spawn(local_reads::serve(
                        listener,
                        Arc::clone(&store),
                        Arc::clone(&gate),
                        regions,
                    )))
                }
                Err(error) => {
                    // Clients read through the RPC path instead: slower, not wrong.
                    tracing::warn!(path = %local_path, %error, "no local reads: cannot listen on the local-reads socket");
                    None
                }
            }
        }
        _ => None,
    };
    let serve = tokio::spawn(freeflow_rpc::serve_with_unix(
        listener,
        unix_listener,
        key.clone(),
        options,
        service,
    ));

    let (metrics_address, metrics_task) = match metrics_listener {
        Some((listener, address)) => (
            Some(address),
            Some(tokio::spawn(freeflow_metrics::serve_http(
                listener,
                Arc::clone(&registry),
            ))),
        ),
        None => (None, None),
    };
    let ready_ms = started.elapsed().as_millis() as u64;
    metrics::register_store_gauges(&registry, &store, ready_ms);
    tracing::info!(
        server_id = config.server_id,
        address = %listen_address,
        data_dir = %config.data_dir.display(),
        engine = engine_name,
        metrics_address = metrics_address.map(|address| address.to_string()).unwrap_or_else(|| "off".to_owned()),
        "ready in {ready_ms} ms"
    );

    // The object count, after ready (see the `store` module doc).
    let counting_store = Arc::clone(&store);
    tokio::task::spawn_blocking(move || {
        if let Err(error) = counting_store.count_objects() {
            tracing::error!(%error, "cannot count objects; the reported count stays partial");
        }
    });

    let registered = Arc::new(AtomicBool::new(false));
    let registration = tokio::spawn(register::run_registration(
        Arc::clone(&store),
        register::RegistrationOptions {
            meta_address: config.meta_address.clone(),
            advertise_address,
            connect_timeout_ms: config.meta_connect_timeout_ms,
            call_timeout_ms: config.meta_call_timeout_ms,
            retry_backoff_max_ms: config.register_backoff_max_ms,
            metrics_address: metrics_address.map(|address| {
                advertised_metrics_address(address, config.advertise_address.as_deref())
            }),
            incarnation: incarnation(),
            fresh,
            data_dir: config.data_dir.clone(),
        },
        Arc::clone(&registered),
        Arc::clone(&gate),
        replication,
        resync,
    ));

    Ok(RunningIo {
        listen_address,
        engine_name,
        store,
        registered,
        gate,
        serve,
        local_reads,
        registration,
        fetcher,
        metrics: registry,
        metrics_address,
        metrics_task,
    })
}

/// A number that differs between starts of this server (see `Member::incarnation`).
fn incarnation() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    (nanos ^ (u64::from(std::process::id()) << 40)).max(1)
}

async fn bind_metrics(
    address: &str,
) -> Result<(tokio::net::TcpListener, SocketAddr), IoServerError> {
    let bind_error = |source| IoServerError::Bind {
        address: format!("{address} (metrics)"),
        source,
    };
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// The metrics address other hosts should scrape: the bound one, with the advertised
/// host instead when it is bound to all interfaces.
fn advertised_metrics_address(bound: SocketAddr, advertise_address: Option<&str>) -> String {
    let tcp = advertise_address.filter(|address| freeflow_rpc::unix_socket_path(address).is_none());
    match tcp.and_then(|address| address.rsplit_once(':')) {
        Some((host, _)) if bound.ip().is_unspecified() => format!("{host}:{}", bound.port()),
        _ => bound.to_string(),
    }
}

impl RunningIo {
    /// The bound address (the real port when the config said port 0).
    pub fn listen_address(&self) -> SocketAddr {
        self.listen_address
    }

    /// "io_uring" or "threads": the engine actually running (after any fallback).
    pub fn engine_name(&self) -> &'static str {
        self.engine_name
    }

    /// True when the last registration with the meta server succeeded.
    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Acquire)
    }

    /// True when the meta server said this server owes no truncation cut, so it serves
    /// data (see [`gate`]).
    pub fn serves_data(&self) -> bool {
        self.gate.is_open()
    }

    pub fn store(&self) -> &Arc<ObjectStore> {
        &self.store
    }

    pub fn engine_stats(&self) -> EngineStats {
        self.store.engine().stats()
    }

    /// This server's metrics (also served over HTTP when `metrics_address` is set).
    pub fn metrics(&self) -> &Arc<Registry> {
        &self.metrics
    }

    /// The bound metrics endpoint, if `metrics_address` was set.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics_address
    }

    /// Stops accepting connections and stops registering. Connections already open are
    /// served by their own tasks until their peers close them.
    pub async fn shutdown(self) {
        self.serve.abort();
        if let Some(task) = self.local_reads {
            // Awaited: its listener's socket file goes with it, before a new server of
            // this process may want the path.
            task.abort();
            let _ = task.await;
        }
        self.registration.abort();
        self.fetcher.abort();
        if let Some(task) = &self.metrics_task {
            task.abort();
        }
        let _ = self.serve.await;
        let _ = self.registration.await;
    }

    /// Runs until the server fails.
    pub async fn wait(self) -> Result<(), IoServerError> {
        let outcome = self.serve.await;
        if let Some(task) = &self.local_reads {
            task.abort();
        }
        self.registration.abort();
        self.fetcher.abort();
        if let Some(task) = &self.metrics_task {
            task.abort();
        }
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(IoServerError::Serve(error)),
            Err(error) => Err(IoServerError::Serve(std::io::Error::other(
                error.to_string(),
            ))),
        }
    }
}

/// Listen on a Unix socket at `path`, replacing a socket a stopped server left there (but
/// not one a running server answers on, nor anything that is not a socket: errors naming
/// the path).
fn bind_unix(path: &std::path::Path) -> Result<tokio::net::UnixListener, IoServerError> {
    use std::os::unix::fs::FileTypeExt;
    let bind_error = |source| IoServerError::Bind {
        address: format!("unix:{}", path.display()),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.file_type().is_socket() => {
            // A socket a running server answers on is not stale: leave it and say so.
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(bind_error(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "another server is listening on this socket",
                )));
            }
            std::fs::remove_file(path).map_err(bind_error)?;
        }
        Ok(_) => {
            return Err(bind_error(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "something other than a socket is there",
            )))
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(bind_error(error)),
    }
    tokio::net::UnixListener::bind(path).map_err(bind_error)
}
