//! Registration with the meta server: `RegisterServer` at start and then every heartbeat
//! interval (the meta server says how often in its reply), carrying this server's address,
//! space and object count. The meta server uses it to know which servers are up and how full
//! they are for placement.
//!
//! Data is served only once a registration was answered with no truncation cut owed here
//! (see `gate.rs`); after that, the I/O server goes on serving while the meta server is
//! unreachable (clients that already hold layouts keep working). Failed attempts are retried with exponential backoff bounded
//! by `retry_backoff_max_ms`, and logged once per change of state, never once per attempt,
//! so a meta server that is down for an hour does not fill the log.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use freeflow_proto::meta::RegisterServer;
use freeflow_rpc::{ConnectOptions, Connection, RpcError};

use crate::gate::DataGate;
use crate::replication::Replication;
use crate::resync::Resync;
use crate::service::IoService;
use crate::store::ObjectStore;

/// First retry delay after a failure; doubled per failure up to the configured bound.
const RETRY_BACKOFF_INITIAL_MS: u64 = 100;
/// Longest retry delay towards a replicated metadata cluster (several addresses): a new
/// leader is there within about a second of losing the old one, and this server's lease on
/// its copies (`server_down_after_ms / 2` from its last answered registration) runs out
/// soon after; a delay doubled past this would let it lapse and pause replicated writes
/// (seen as 2-3 s failover pauses instead of 1.2 s).
const REPLICATED_RETRY_BACKOFF_MAX_MS: u64 = 200;
/// Bounds on the heartbeat interval the meta server may ask for.
const HEARTBEAT_INTERVAL_MIN_MS: u64 = 50;
const HEARTBEAT_INTERVAL_MAX_MS: u64 = 60_000;

#[derive(Clone, Debug)]
pub struct RegistrationOptions {
    pub meta_address: String,
    /// The address clients should use to reach this server.
    pub advertise_address: String,
    pub connect_timeout_ms: u64,
    pub call_timeout_ms: u64,
    pub retry_backoff_max_ms: u64,
    /// The metrics endpoint to announce, for `freeflow top`; None when metrics are off.
    pub metrics_address: Option<String>,
    /// Random per start of this process.
    pub incarnation: u64,
    /// The data directory is new and the meta server was not told yet.
    pub fresh: bool,
    /// Where the `fresh` marker is (see `identity.rs`).
    pub data_dir: std::path::PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkState {
    Starting,
    Registered,
    /// Registered, but truncation cuts are still owed here: no data is served.
    OwesCuts,
    /// The meta server could not be reached (connect, timeout, lost connection).
    Unreachable,
    /// The meta server answered with an error.
    Refused,
    /// This server could not read its own statistics (statvfs failed).
    LocalFailure,
}

/// Registers forever; `registered` follows whether the last attempt succeeded, `gate`
/// what the last reply said of the truncation cuts owed here (a reply that says some are
/// owed is followed by the next attempt after the shortest retry delay, not a heartbeat).
pub async fn run_registration(
    store: Arc<ObjectStore>,
    mut options: RegistrationOptions,
    registered: Arc<AtomicBool>,
    gate: Arc<DataGate>,
    replication: Arc<Replication>,
    resync: Arc<Resync>,
) {
    let connect_options = ConnectOptions {
        client_name: format!("io:{}", store.server_id()),
        call_timeout_ms: options.call_timeout_ms,
        connect_timeout_ms: options.connect_timeout_ms,
        liveness_timeout_ms: crate::config::META_LIVENESS_TIMEOUT_MS,
        ..ConnectOptions::default()
    };
    let mut connection: Option<Connection> = None;
    let mut state = LinkState::Starting;
    let mut backoff_ms = RETRY_BACKOFF_INITIAL_MS;
    let backoff_max_ms = if options.meta_address.contains(',') {
        options
            .retry_backoff_max_ms
            .min(REPLICATED_RETRY_BACKOFF_MAX_MS)
    } else {
        options.retry_backoff_max_ms
    };
    loop {
        let sent = tokio::time::Instant::now();
        let attempt = register_once(
            &store,
            &options,
            &connect_options,
            &mut connection,
            &replication,
            resync
                .cleaned_version
                .load(std::sync::atomic::Ordering::Acquire),
        )
        .await;
        let (next_state, delay_ms) = match &attempt {
            Ok(reply) => {
                backoff_ms = RETRY_BACKOFF_INITIAL_MS;
                // The meta server knows now that the data directory is new.
                if options.fresh {
                    match crate::identity::fresh_told(&options.data_dir) {
                        Ok(()) => options.fresh = false,
                        Err(error) => tracing::warn!(%error, "cannot remove the fresh marker"),
                    }
                }
                if reply.map_version != replication.version() {
                    if let Err(error) = replication.fetch().await {
                        tracing::warn!(server_id = store.server_id(), %error, "cannot fetch the service map");
                    }
                }
                // Copies are served only under the map the meta server had then or newer.
                if replication.version() >= reply.map_version {
                    replication.renew_lease(sent, reply.lease_ms);
                }
                if let Some(order) = reply.resync {
                    resync.start(order);
                }
                if let Some(order) = reply.fill {
                    resync.start_fill(order);
                }
                resync.clean_after_drain(replication.version());
                gate.set_owed(reply.cuts_owed);
                if reply.cuts_owed > 0 {
                    (LinkState::OwesCuts, RETRY_BACKOFF_INITIAL_MS)
                } else {
                    (LinkState::Registered, reply.heartbeat_interval_ms)
                }
            }
            Err(error) => {
                let delay_ms = backoff_ms;
                backoff_ms = (backoff_ms * 2).min(backoff_max_ms);
                let next = match error {
                    RegisterError::Rpc(RpcError::Remote(_)) => LinkState::Refused,
                    RegisterError::Rpc(_) => LinkState::Unreachable,
                    RegisterError::Stats(_) => LinkState::LocalFailure,
                };
                (next, delay_ms)
            }
        };
        registered.store(
            matches!(next_state, LinkState::Registered | LinkState::OwesCuts),
            Ordering::Release,
        );
        if next_state != state {
            log_transition(&store, &options, next_state, &attempt);
            state = next_state;
        }
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    }
}

#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error("{0}")]
    Rpc(RpcError),
    #[error("cannot read the data directory's space: {0}")]
    Stats(crate::error::StoreError),
}

/// What a registration was answered.
#[derive(Debug)]
struct Registered {
    /// The heartbeat interval to wait before the next, within bounds.
    heartbeat_interval_ms: u64,
    cuts_owed: u32,
    map_version: u64,
    resync: Option<freeflow_proto::meta::ResyncOrder>,
    fill: Option<freeflow_proto::meta::FillOrder>,
    lease_ms: u64,
}

/// One registration.
async fn register_once(
    store: &ObjectStore,
    options: &RegistrationOptions,
    connect_options: &ConnectOptions,
    connection: &mut Option<Connection>,
    replication: &Replication,
    cleaned_version: u64,
) -> Result<Registered, RegisterError> {
    let map_version = replication.version();
    let stats = IoService::stats(store).map_err(RegisterError::Stats)?;
    if connection.as_ref().is_none_or(Connection::is_closed) {
        *connection = None;
        let connected = replication
            .connect_meta(connect_options)
            .await
            .map_err(RegisterError::Rpc)?;
        *connection = Some(connected);
    }
    let Some(link) = connection.as_ref() else {
        unreachable!("connected above")
    };
    let request = RegisterServer {
        server_id: stats.server_id,
        address: options.advertise_address.clone(),
        capacity_bytes: stats.capacity_bytes,
        free_bytes: stats.free_bytes,
        object_count: stats.object_count,
        metrics_address: options.metrics_address.clone(),
        incarnation: options.incarnation,
        map_version,
        fresh: options.fresh,
        cleaned_version,
    };
    let (reply, _) = link.call(&request, Bytes::new()).await.map_err(|error| {
        if error.is_connection_failure() {
            *connection = None;
        }
        RegisterError::Rpc(error)
    })?;
    Ok(Registered {
        heartbeat_interval_ms: u64::from(reply.heartbeat_interval_ms)
            .clamp(HEARTBEAT_INTERVAL_MIN_MS, HEARTBEAT_INTERVAL_MAX_MS),
        cuts_owed: reply.cuts_owed,
        map_version: reply.map_version,
        resync: reply.resync,
        fill: reply.fill,
        lease_ms: reply.lease_ms,
    })
}

fn log_transition(
    store: &ObjectStore,
    options: &RegistrationOptions,
    state: LinkState,
    attempt: &Result<Registered, RegisterError>,
) {
    let server_id = store.server_id();
    let meta = options.meta_address.as_str();
    match (state, attempt) {
        (LinkState::Registered, Ok(reply)) => tracing::info!(
            server_id,
            meta,
            address = options.advertise_address.as_str(),
            heartbeat_interval_ms = reply.heartbeat_interval_ms,
            "registered with the meta server; serving data"
        ),
        (LinkState::OwesCuts, Ok(reply)) => tracing::warn!(
            server_id,
            meta,
            cuts_owed = reply.cuts_owed,
            "registered, but truncation cuts are still owed here; serving no data until the meta server has made them"
        ),
        (LinkState::Refused, Err(error)) => tracing::error!(
            server_id,
            meta,
            %error,
            "meta server refused the registration; retrying with backoff (logged again only when this changes)"
        ),
        (LinkState::LocalFailure, Err(error)) => tracing::error!(
            server_id,
            %error,
            "cannot register with the meta server; retrying with backoff (logged again only when this changes)"
        ),
        (_, Err(error)) => tracing::warn!(
            server_id,
            meta,
            %error,
            "meta server unreachable; serving anyway and retrying with backoff (logged again only when this changes)"
        ),
        (_, Ok(_)) => {}
    }
}
