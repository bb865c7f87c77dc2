//! Chain replication of stripe objects (DESIGN.md §7): what an I/O server does for a write
//! of a replicated stripe.
//!
//! A client sends a replicated write (`map_version` not 0) to the first member of the
//! stripe's chain with the rest of the chain in `forward`. Each member checks that it holds
//! the same service map version as the request, writes the bytes locally, then passes the
//! request on to the next member, and answers once that one answered, so the client's reply
//! means every member wrote it (and a member never holds a write its predecessor lacks). A member holding another map version refuses the request:
//! `Stale` when the request's map is older (the client fetches the map and sends again),
//! `Busy` when it is newer (this server fetches the map; the client sends again shortly).
//! A server left out of its chains therefore takes no write for them once its partners
//! hold the map that says so.
//!
//! Overlapping writes of one object are serialised on each member by range locks held
//! across the local write and the pass-on, so every member applies them in the same order
//! and the copies end identical. The local write and the version check are made under the
//! map's read lock, which a map change waits for: once this server reports a new version,
//! no write checked against the old one is still on its way to the disk.
//!
//! Reads of replicated stripes carry the map version too, and every replicated request is
//! served only within the lease the last registration gave (`RegisterReply::lease_ms`,
//! half the silence after which the meta server puts a server out): a server cut off from
//! the meta server stops serving its copies before its partners go on without it, so a
//! client holding an old map cannot read a copy that missed writes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use freeflow_proto::io::ObjectSpace;
use freeflow_proto::meta::{GetServiceMap, MemberState, ServiceMap};
use freeflow_proto::{ErrorCode, Request, WireError};
use freeflow_rpc::{ClusterKey, ConnectOptions, Connection, LeaderSearch, RpcError};
use freeflow_types::{ObjectId, ServerId};
use tokio::sync::{watch, RwLock, RwLockReadGuard};

/// The service map and the connections to chain partners.
pub struct Replication {
    server_id: ServerId,
    key: ClusterKey,
    /// For the meta server (map fetches).
    options: ConnectOptions,
    /// For chain partners: a longer call timeout, since a partner that hangs is given up
    /// as soon as the map puts it out (`pass_on`), and a loaded one must not be.
    peer_options: ConnectOptions,
    map: RwLock<ServiceMap>,
    /// The version in `map`, readable without waiting for its lock.
    version: std::sync::atomic::AtomicU64,
    peers: Mutex<HashMap<ServerId, Connection>>,
    meta: tokio::sync::Mutex<Option<Connection>>,
    /// Wakes the fetch task when a request named a newer map than ours.
    newer_seen: tokio::sync::Notify,
    /// Until when replicated stripes may be served without hearing from the meta server
    /// (see `RegisterReply::lease_ms`); None before the first registration.
    lease_until: Mutex<Option<tokio::time::Instant>>,
    /// The metadata members, the one that led last tried first (registration, map
    /// fetches, resync).
    meta_leader: LeaderSearch,
    pub ranges: RangeLocks,
    /// Requests passed on to the next member, their payload bytes, and those that failed.
    /// Told which objects leave this server when a map names a drain of it.
    gate: Arc<crate::gate::DataGate>,
    pub passed_on: std::sync::atomic::AtomicU64,
    pub passed_on_bytes: std::sync::atomic::AtomicU64,
    pub pass_on_failures: std::sync::atomic::AtomicU64,
}

impl Replication {
    pub fn new(
        server_id: ServerId,
        key: ClusterKey,
        meta_address: String,
        call_timeout_ms: u64,
        connect_timeout_ms: u64,
        gate: Arc<crate::gate::DataGate>,
    ) -> Replication {
        Replication {
            server_id,
            key,
            options: ConnectOptions {
                client_name: format!("io:{server_id}:chain"),
                call_timeout_ms,
                connect_timeout_ms,
                liveness_timeout_ms: crate::config::META_LIVENESS_TIMEOUT_MS,
                ..ConnectOptions::default()
            },
            peer_options: ConnectOptions {
                client_name: format!("io:{server_id}:chain"),
                call_timeout_ms: call_timeout_ms.max(PASS_ON_TIMEOUT_MS),
                connect_timeout_ms,
                ..ConnectOptions::default()
            },
            map: RwLock::new(ServiceMap::default()),
            version: std::sync::atomic::AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
            meta: tokio::sync::Mutex::new(None),
            newer_seen: tokio::sync::Notify::new(),
            lease_until: Mutex::new(None),
            meta_leader: LeaderSearch::new(meta_address),
            ranges: RangeLocks::default(),
            gate,
            passed_on: std::sync::atomic::AtomicU64::new(0),
            passed_on_bytes: std::sync::atomic::AtomicU64::new(0),
            pass_on_failures: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub fn server_id(&self) -> ServerId {
        self.server_id
    }

    /// The map version held (0: none fetched yet).
    pub fn version(&self) -> u64 {
        self.version.load(std::sync::atomic::Ordering::Acquire)
    }

    pub async fn map(&self) -> ServiceMap {
        self.map.read().await.clone()
    }

    /// Check a replicated request before it waits for any lock: the map version and the
    /// lease, and a chain that names no server twice, not this one, and no more members
    /// than a chain has.
    pub async fn check_chain(&self, version: u64, forward: &[ServerId]) -> Result<(), WireError> {
        self.check_forward(forward)?;
        drop(self.hold(version).await?);
        Ok(())
    }

    /// A chain that names no server twice, not this one, and no more members than a chain
    /// has.
    pub fn check_forward(&self, forward: &[ServerId]) -> Result<(), WireError> {
        let invalid = |reason: String| WireError::new(ErrorCode::InvalidArgument, reason);
        if forward.len() >= freeflow_types::limits::REPLICAS_MAX as usize {
            return Err(invalid(format!(
                "a chain of {} further members is longer than {} copies allow",
                forward.len(),
                freeflow_types::limits::REPLICAS_MAX
            )));
        }
        for (index, server) in forward.iter().enumerate() {
            if *server == self.server_id || forward[..index].contains(server) {
                return Err(invalid(format!(
                    "server {server} appears twice in the chain {forward:?} passed to server {}",
                    self.server_id
                )));
            }
        }
        Ok(())
    }

    /// A replicated change of `object`'s bytes `range` (a write or an allocation): the chain,
    /// map version and lease checked, the range held, `local` applied under the map, then
    /// `passed(rest of the chain)` sent on to the next member with `payload`. The local
    /// space comes back once the rest of the chain has the change too. Here first, then
    /// passed on: a member never holds a change its predecessor lacks, so a resync copying
    /// from a predecessor misses nothing its successor took (`resync.rs`).
    #[allow(clippy::too_many_arguments)]
    pub async fn apply_and_pass_on<R, F, Fut>(
        &self,
        object: ObjectId,
        range: (u64, u64),
        version: u64,
        forward: &[ServerId],
        local: F,
        passed: impl FnOnce(Vec<ServerId>) -> R,
        payload: Bytes,
    ) -> Result<ObjectSpace, WireError>
    where
        R: Request,
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<ObjectSpace, crate::error::StoreError>>,
    {
        self.check_chain(version, forward).await?;
        let _range = self.ranges.acquire(object, range.0, range.1).await;
        let space = {
            let _map = self.hold(version).await?;
            local().await?
        };
        if let Some((next, rest)) = forward.split_first() {
            self.pass_on(*next, &passed(rest.to_vec()), payload).await?;
        }
        Ok(space)
    }

    /// A registration sent at `sent` was answered with this lease.
    pub fn renew_lease(&self, sent: tokio::time::Instant, lease_ms: u64) {
        let until = sent + std::time::Duration::from_millis(lease_ms);
        let mut lease = self
            .lease_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *lease = Some(lease.map_or(until, |held| held.max(until)));
    }

    fn check_lease(&self) -> Result<(), WireError> {
        let lease = *self
            .lease_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if lease.is_some_and(|until| tokio::time::Instant::now() < until) {
            return Ok(());
        }
        Err(WireError::new(
            ErrorCode::Busy,
            format!(
                "I/O server {} has not heard from the meta server within its lease: it serves no replicated stripe until it does",
                self.server_id
            ),
        ))
    }

    /// Check that the map is held at `version` and the lease holds, and keep the map so
    /// while the guard lives (the local write of a replicated request is made under it).
    pub async fn hold(&self, version: u64) -> Result<RwLockReadGuard<'_, ServiceMap>, WireError> {
        self.check_lease()?;
        let map = self.map.read().await;
        if map.version == version {
            return Ok(map);
        }
        if version > map.version {
            drop(map);
            self.newer_seen.notify_one();
            return Err(WireError::new(
                ErrorCode::Busy,
                format!(
                    "I/O server {} does not hold service map {version} yet; fetching it",
                    self.server_id
                ),
            ));
        }
        Err(WireError::new(
            ErrorCode::Stale,
            format!(
                "service map {version} is stale: I/O server {} holds {}",
                self.server_id, map.version
            ),
        ))
    }

    /// Connect to the metadata server that leads among the meta addresses, trying first the
    /// one that led last time.
    pub async fn connect_meta(&self, options: &ConnectOptions) -> Result<Connection, RpcError> {
        self.meta_leader.connect(&self.key, options).await
    }

    /// Fetch the map from the meta server and hold it from now on.
    pub async fn fetch(&self) -> Result<u64, String> {
        let fetched = {
            let mut meta = self.meta.lock().await;
            // A connection to a member the registration no longer finds leading (it moved
            // on after a failover) is dropped: a call on it would wait for its liveness
            // check (a cut-off leader keeps its sockets open) and hold up the heartbeat
            // that fetches the map.
            if meta.as_ref().is_none_or(|connection| {
                connection.is_closed() || !self.meta_leader.is_preferred(connection.address())
            }) {
                *meta = Some(
                    self.connect_meta(&self.options)
                        .await
                        .map_err(|error| error.to_string())?,
                );
            }
            let Some(connection) = meta.as_ref() else {
                unreachable!("connected above")
            };
            match connection.call(&GetServiceMap {}, Bytes::new()).await {
                Ok((map, _)) => map,
                Err(error) => {
                    if error.is_connection_failure() {
                        *meta = None;
                    }
                    return Err(error.to_string());
                }
            }
        };
        let version = fetched.version;
        let mut map = self.map.write().await;
        if map.version != version {
            tracing::info!(
                server_id = self.server_id,
                version,
                out = ?fetched.members.iter().filter(|member| member.state == MemberState::Out).map(|member| member.server_id).collect::<Vec<_>>(),
                syncing = ?fetched.members.iter().filter(|member| member.state == MemberState::Syncing).map(|member| member.server_id).collect::<Vec<_>>(),
                "service map changed"
            );
            // A partner at a new address (or a new process) is reached anew.
            let mut peers = self.lock_peers();
            peers.retain(|server, connection| {
                fetched
                    .member(*server)
                    .is_some_and(|member| member.address == connection.address())
            });
        }
        // A drain of this server starts with this map: held only once no request that
        // skipped its chain is still being served here (`gate.rs`).
        self.gate.set_leaving(fetched.leaving(self.server_id)).await;
        *map = fetched;
        self.version
            .store(version, std::sync::atomic::Ordering::Release);
        Ok(version)
    }

    /// The map an order (a resync's, a fill's) was given under, fetched if need be; an
    /// error when the meta server has moved on since (the next order comes with the next
    /// heartbeat).
    pub async fn map_of_order(&self, version: u64) -> Result<ServiceMap, String> {
        if self.version() != version {
            self.fetch().await?;
        }
        let map = self.map().await;
        if map.version != version {
            return Err(format!(
                "the service map moved on (order under {version}, now {})",
                map.version
            ));
        }
        Ok(map)
    }

    /// Fetch the map whenever a request named a newer one, until the server stops.
    pub async fn fetch_when_told(self: Arc<Self>) {
        loop {
            self.newer_seen.notified().await;
            if let Err(error) = self.fetch().await {
                tracing::warn!(server_id = self.server_id, %error, "cannot fetch the service map");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }

    fn lock_peers(&self) -> MutexGuard<'_, HashMap<ServerId, Connection>> {
        self.peers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A connection to chain partner `server` at the address the map gives.
    pub async fn peer(&self, server: ServerId) -> Result<Connection, WireError> {
        if let Some(connection) = self.lock_peers().get(&server) {
            if !connection.is_closed() {
                return Ok(connection.clone());
            }
        }
        let known = |map: &ServiceMap| map.member(server).map(|member| member.address.clone());
        let mut address = known(&*self.map.read().await);
        if address.is_none() {
            // A server that registered after our last fetch: the meta server knows it.
            if let Err(error) = self.fetch().await {
                tracing::debug!(%error, "cannot fetch the service map");
            }
            address = known(&*self.map.read().await);
        }
        let address = address.ok_or_else(|| {
            WireError::new(
                ErrorCode::Stale,
                format!("I/O server {server} is not in the service map"),
            )
        })?;
        let connection = Connection::connect(&address, &self.key, &self.peer_options)
            .await
            .map_err(|error| unreachable_partner(server, error))?;
        self.lock_peers().insert(server, connection.clone());
        Ok(connection)
    }

    /// Pass a request on to the next member of its chain.
    pub async fn pass_on<R: Request>(
        &self,
        next: ServerId,
        request: &R,
        payload: Bytes,
    ) -> Result<R::Reply, WireError> {
        use std::sync::atomic::Ordering::Relaxed;
        self.passed_on.fetch_add(1, Relaxed);
        self.passed_on_bytes
            .fetch_add(payload.len() as u64, Relaxed);
        let connection = match self.peer(next).await {
            Ok(connection) => connection,
            Err(error) => {
                self.pass_on_failures.fetch_add(1, Relaxed);
                return Err(error);
            }
        };
        // Given up as soon as the map this server holds puts the partner out: a partner
        // that hangs costs the time the meta server takes to notice, not a call timeout.
        let call = connection.call(request, payload);
        tokio::pin!(call);
        let result = loop {
            tokio::select! {
                result = &mut call => break result,
                () = tokio::time::sleep(std::time::Duration::from_millis(PARTNER_CHECK_MS)) => {
                    if self.map.read().await.state(next) == MemberState::Out {
                        self.pass_on_failures.fetch_add(1, Relaxed);
                        return Err(WireError::new(
                            ErrorCode::Unreachable,
                            format!("chain partner I/O server {next} was put out of its chains while it held the request"),
                        ));
                    }
                }
            }
        };
        if result.is_err() {
            self.pass_on_failures.fetch_add(1, Relaxed);
        }
        match result {
            Ok((reply, _)) => Ok(reply),
            Err(RpcError::Remote(error)) => Err(error),
            Err(error) => {
                if error.is_connection_failure() {
                    self.lock_peers().remove(&next);
                }
                Err(unreachable_partner(next, error))
            }
        }
    }
}

/// Call timeout towards chain partners (at least the configured meta call timeout).
const PASS_ON_TIMEOUT_MS: u64 = 30_000;
/// How often a pass-on waiting for its partner checks whether the map put it out.
const PARTNER_CHECK_MS: u64 = 250;

fn unreachable_partner(server: ServerId, error: RpcError) -> WireError {
    WireError::new(
        ErrorCode::Unreachable,
        format!("chain partner I/O server {server}: {error}"),
    )
}

/// Byte ranges of objects being written, so overlapping writes of one object wait for each
/// other (and a resync's copy of a whole object waits for, and holds off, the writes).
#[derive(Default)]
pub struct RangeLocks {
    held: Mutex<HashMap<ObjectId, Vec<(u64, u64)>>>,
    released: watch::Sender<u64>,
}

/// A held range; released when dropped.
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    object: ObjectId,
    range: (u64, u64),
}

impl RangeLocks {
    fn lock(&self) -> MutexGuard<'_, HashMap<ObjectId, Vec<(u64, u64)>>> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wait until no held range of `object` overlaps `[start, end)`, then hold it.
    pub async fn acquire(&self, object: ObjectId, start: u64, end: u64) -> RangeGuard<'_> {
        // An empty range still orders against the byte at its start; at the very end of the
        // offsets it is taken from the last byte.
        let start = start.min(u64::MAX - 1);
        let end = end.max(start + 1);
        loop {
            let mut receiver = {
                let mut held = self.lock();
                let ranges = held.entry(object).or_default();
                if !ranges.iter().any(|(s, e)| *s < end && start < *e) {
                    ranges.push((start, end));
                    return RangeGuard {
                        locks: self,
                        object,
                        range: (start, end),
                    };
                }
                // Subscribed under the lock: a release after the check is seen.
                self.released.subscribe()
            };
            let _ = receiver.changed().await;
        }
    }

    /// Objects with a range held (for tests).
    pub fn held_objects(&self) -> usize {
        self.lock().len()
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        {
            let mut held = self.locks.lock();
            if let Some(ranges) = held.get_mut(&self.object) {
                if let Some(index) = ranges.iter().position(|range| *range == self.range) {
                    ranges.swap_remove(index);
                }
                if ranges.is_empty() {
                    held.remove(&self.object);
                }
            }
        }
        self.locks.released.send_modify(|count| *count += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn overlapping_ranges_wait_and_disjoint_ones_do_not() {
        let locks = Arc::new(RangeLocks::default());
        let object = ObjectId {
            inode: 5,
            stripe_index: 0,
        };
        let first = locks.acquire(object, 0, 100).await;
        // Disjoint: at once.
        let other = locks.acquire(object, 100, 200).await;
        let waiting = {
            let locks = Arc::clone(&locks);
            tokio::spawn(async move {
                let _guard = locks.acquire(object, 50, 150).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "an overlapping range waited");
        drop(first);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "still overlaps the second range");
        drop(other);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("released")
            .expect("task");
        assert_eq!(locks.held_objects(), 0);
    }
}
