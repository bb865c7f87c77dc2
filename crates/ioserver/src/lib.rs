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
//! - [`config`]: [`IoConfig`] and its validation; [`start`] composes everything.

pub mod buffer_pool;
pub mod config;
pub mod engine;
pub mod error;
pub mod fd_cache;
pub mod identity;
pub mod register;
pub mod service;
pub mod store;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use freeflow_rpc::{ClusterKey, ServerOptions};
use freeflow_types::limits;
use tokio::task::JoinHandle;

pub use config::{EngineKind, IoConfig};
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
                queue_depth_max: config.engine_queue_depth_max,
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
    serve: JoinHandle<std::io::Result<()>>,
    registration: JoinHandle<()>,
}

/// Starts an I/O server: checks the config and the data directory's identity, starts the disk
/// engine, listens, and begins registering with the meta server. Returns once it is serving;
/// it does not wait for the meta server, and never scans the objects before ready (the object
/// count is computed by a background task, see [`store`]).
pub async fn start(config: IoConfig, key: ClusterKey) -> Result<RunningIo, IoServerError> {
    let started = Instant::now();
    config.validate()?;
    identity::claim_data_dir(&config.data_dir, config.server_id)?;
    let engine = build_engine(&config)?;
    let engine_name = engine.name();
    let store = ObjectStore::open(
        config.server_id,
        &config.data_dir,
        engine,
        config.open_files_max,
    )
    .map_err(|source| IoServerError::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    let store = Arc::new(store);

    let listener = tokio::net::TcpListener::bind(&config.listen_address)
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

    let options = ServerOptions {
        window_bytes: config.window_bytes,
        payload_length_max: limits::IO_REQUEST_BYTES_MAX,
        requests_in_flight_max: config.requests_in_flight_max,
        ..ServerOptions::new(format!("io:{}", config.server_id))
    };
    let service = Arc::new(service::IoService::new(Arc::clone(&store)));
    let serve = tokio::spawn(freeflow_rpc::serve(listener, key.clone(), options, service));

    tracing::info!(
        server_id = config.server_id,
        address = %listen_address,
        data_dir = %config.data_dir.display(),
        engine = engine_name,
        "ready in {} ms",
        started.elapsed().as_millis()
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
        key,
        register::RegistrationOptions {
            meta_address: config.meta_address.clone(),
            advertise_address,
            connect_timeout_ms: config.meta_connect_timeout_ms,
            call_timeout_ms: config.meta_call_timeout_ms,
            retry_backoff_max_ms: config.register_backoff_max_ms,
        },
        Arc::clone(&registered),
    ));

    Ok(RunningIo {
        listen_address,
        engine_name,
        store,
        registered,
        serve,
        registration,
    })
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

    pub fn store(&self) -> &Arc<ObjectStore> {
        &self.store
    }

    pub fn engine_stats(&self) -> EngineStats {
        self.store.engine().stats()
    }

    /// Stops accepting connections and stops registering. Connections already open are
    /// served by their own tasks until their peers close them.
    pub async fn shutdown(self) {
        self.serve.abort();
        self.registration.abort();
        let _ = self.serve.await;
        let _ = self.registration.await;
    }

    /// Runs until the server fails.
    pub async fn wait(self) -> Result<(), IoServerError> {
        let outcome = self.serve.await;
        self.registration.abort();
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(IoServerError::Serve(error)),
            Err(error) => Err(IoServerError::Serve(std::io::Error::other(
                error.to_string(),
            ))),
        }
    }
}
