//! The orphan reaper: removes the data of unlinked files from the I/O servers, then forgets
//! the orphan.
//!
//! An orphan is reaped when no handle is open on it, and, if it was orphaned before this
//! start of the server (an older boot epoch), once one lease has passed since the start:
//! clients that had it open cannot know the server restarted until their lease runs out.
//! For each orphan the reaper sends `RemoveObjects` to every server of its layout; only when
//! all succeeded does it delete the orphan record and the inode (through the writer, in one
//! transaction). A server that is down is retried later with a bounded backoff; orphans
//! survive crashes in the `orphans` table.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use freeflow_proto::io::RemoveObjects;
use freeflow_rpc::{ClusterKey, ConnectOptions, Connection};
use freeflow_types::{InodeId, ServerId};
use tokio::task::JoinSet;

use crate::ops::orphan::{forget_orphan, list_orphans};
use crate::records::OrphanRecord;
use crate::shared::Shared;

/// Orphans read from the store per page of a pass.
pub const REAP_PAGE_ORPHANS: usize = 256;
/// Shortest and longest wait before retrying after a failure.
pub const RETRY_DELAY_MIN_MS: u64 = 100;
pub const RETRY_DELAY_MAX_MS: u64 = 10_000;
/// Time between passes when nothing wakes the reaper (catches anything missed).
pub const IDLE_PASS_INTERVAL_MS: u64 = 30_000;

/// Connections to I/O servers, one per server, reconnected when closed.
struct Connections {
    key: ClusterKey,
    options: ConnectOptions,
    cache: Mutex<HashMap<ServerId, Connection>>,
}

impl Connections {
    async fn get(&self, server: ServerId, address: &str) -> Result<Connection, String> {
        {
            let cache = self
                .cache
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(connection) = cache.get(&server) {
                if !connection.is_closed() && connection.address() == address {
                    return Ok(connection.clone());
                }
            }
        }
        let connection = Connection::connect(address, &self.key, &self.options)
            .await
            .map_err(|error| error.to_string())?;
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        cache.insert(server, connection.clone());
        Ok(connection)
    }
}

/// The stripes each server of a layout holds.
pub fn stripes_by_server(orphan: &OrphanRecord) -> BTreeMap<ServerId, Vec<u32>> {
    let mut by_server: BTreeMap<ServerId, Vec<u32>> = BTreeMap::new();
    for (index, server) in orphan.layout.servers.iter().enumerate() {
        by_server.entry(*server).or_default().push(index as u32);
    }
    by_server
}

async fn remove_data(
    shared: &Shared,
    connections: &Connections,
    inode: InodeId,
    orphan: &OrphanRecord,
) -> Result<(), String> {
    for (server, stripes) in stripes_by_server(orphan) {
        let address = shared
            .registry()
            .address(server)
            .ok_or_else(|| format!("server {server} is not registered"))?;
        let connection = connections.get(server, &address).await?;
        connection
            .call(&RemoveObjects { inode, stripes }, bytes::Bytes::new())
            .await
            .map_err(|error| format!("server {server}: {error}"))?;
    }
    Ok(())
}

/// What one pass found.
#[derive(Default)]
struct PassOutcome {
    failed: bool,
    /// Orphans from an older epoch still waiting for the lease after start.
    waiting_for_lease: bool,
}

async fn pass(shared: &Arc<Shared>, connections: &Arc<Connections>) -> PassOutcome {
    let mut outcome = PassOutcome::default();
    let lease = Duration::from_millis(u64::from(shared.config.lease_ms));
    let old_epoch_ready = shared.started.elapsed() >= lease;
    let concurrency = shared.config.reap_concurrency_max.max(1);
    let mut after = None;
    loop {
        let page = match shared.read(|read| list_orphans(read, after, REAP_PAGE_ORPHANS)) {
            Ok(page) => page,
            Err(error) => {
                tracing::warn!(%error, "reaper cannot list orphans");
                outcome.failed = true;
                return outcome;
            }
        };
        let Some((last, _)) = page.last() else {
            return outcome;
        };
        after = Some(*last);
        let page_len = page.len();
        let mut tasks = JoinSet::new();
        for (inode, orphan) in page {
            if shared.sessions().is_open(inode) {
                continue;
            }
            if orphan.boot_epoch < shared.boot_epoch && !old_epoch_ready {
                outcome.waiting_for_lease = true;
                continue;
            }
            while tasks.len() >= concurrency {
                if let Some(Ok(false)) = tasks.join_next().await {
                    outcome.failed = true;
                }
            }
            let (shared, connections) = (shared.clone(), connections.clone());
            tasks.spawn(async move {
                if let Err(reason) = remove_data(&shared, &connections, inode, &orphan).await {
                    tracing::debug!(inode, %reason, "orphan data not removed yet; will retry");
                    return false;
                }
                match shared
                    .write(move |write, context| forget_orphan(write, context, inode))
                    .await
                {
                    Ok(_) => true,
                    Err(error) => {
                        tracing::warn!(inode, %error, "cannot forget reaped orphan");
                        false
                    }
                }
            });
        }
        while let Some(result) = tasks.join_next().await {
            if !matches!(result, Ok(true)) {
                outcome.failed = true;
            }
        }
        if page_len < REAP_PAGE_ORPHANS {
            return outcome;
        }
    }
}

/// The reaper task; runs until aborted.
pub async fn run(shared: Arc<Shared>, key: ClusterKey) {
    let connections = Arc::new(Connections {
        key,
        options: ConnectOptions {
            client_name: "meta-reaper".into(),
            call_timeout_ms: 10_000,
            connect_timeout_ms: 2_000,
            ..ConnectOptions::default()
        },
        cache: Mutex::new(HashMap::new()),
    });
    let lease = Duration::from_millis(u64::from(shared.config.lease_ms));
    let mut retry_delay_ms = RETRY_DELAY_MIN_MS;
    loop {
        if shared.closing.load(Ordering::Acquire) {
            return;
        }
        let outcome = if shared.orphan_count.load(Ordering::Relaxed) > 0 {
            pass(&shared, &connections).await
        } else {
            PassOutcome::default()
        };
        let wait = if outcome.failed {
            let wait = Duration::from_millis(retry_delay_ms);
            retry_delay_ms = (retry_delay_ms * 2).min(RETRY_DELAY_MAX_MS);
            wait
        } else {
            retry_delay_ms = RETRY_DELAY_MIN_MS;
            if outcome.waiting_for_lease {
                let elapsed = shared.started.elapsed();
                lease.saturating_sub(elapsed) + Duration::from_millis(RETRY_DELAY_MIN_MS)
            } else {
                Duration::from_millis(IDLE_PASS_INTERVAL_MS)
            }
        };
        let deadline = Instant::now() + wait;
        tokio::select! {
            _ = shared.reaper_wake.notified() => {}
            _ = tokio::time::sleep_until(deadline.into()) => {}
        }
    }
}
