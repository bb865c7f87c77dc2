//! The client: its session at the meta server, the connections, the lease tables, and the
//! registry of open handles; it implements what the layers below ask of it (`HandleHost`
//! for open files, `LeaseHolder` for the revocation poll). Its calls are in the rooms
//! below: `namespace.rs` (the inode API the mount is built on, `open`/`create_open` giving
//! a [`crate::FileHandle`], a `setattr` that keeps this client's open handles right across
//! a size change) and `locks.rs` (file locks).
//!
//! The session is renewed in the background at a third of its lease; if the meta server has
//! forgotten it (restart, lease expired during a network cut), a new one is opened so that new
//! opens work again. An open that finds the session unknown reopens it at once (one reopen
//! for all callers that found the same session gone) and is tried once more, so opens do not
//! fail until the renewer notices. Handles of the old session are gone with it; closing one
//! succeeds once its data is flushed, also before the renewer noticed (a handle remembers
//! the meta server epoch it was opened under).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use freeflow_proto::meta::{
    Caller, CloseSession, HandleRef, OpenSession, ReclaimSession, ReclaimedHandle, RenewSession,
    Revocation, RECLAIM_HANDLES_MAX,
};
use freeflow_proto::ErrorCode;
use freeflow_rpc::{ConnectOptions, RpcError};
use freeflow_types::{Attr, InodeId, SetAttr};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

mod locks;
mod namespace;

use crate::file::{HandleHost, HandleShared};
use crate::lease::Lease;
use crate::leases::LeaseHolder;
use crate::metrics::ClientMetrics;
use crate::pool::Pool;
use crate::{ClientConfig, ClientError};

/// State shared by every clone of a [`Client`] and by its open handles.
/// How long after its last writing handle closed a client gives its space grants back.
const GRANT_GIVE_BACK_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

pub(crate) struct Shared {
    pub config: ClientConfig,
    /// Shared with the revocation poll, which must not keep the rest alive while it waits.
    pub pool: Arc<Pool>,
    session_id: AtomicU64,
    /// The meta server epoch the current session was granted under: a server of another
    /// epoch does not know it (sessions live in one run of one leader).
    pub(crate) session_epoch: AtomicU64,
    /// The session was closed (`Client::shutdown`): dropping the client need not close it.
    closed: AtomicBool,
    /// Write bytes in flight over the whole client (`dirty_bytes_max` permits).
    pub dirty: Arc<Semaphore>,
    /// Bytes fetched ahead over the whole client (see `readahead.rs`).
    pub readahead_room: Arc<Semaphore>,
    /// Descriptors of objects of I/O servers on this host (see `local.rs`).
    pub(crate) local: crate::local::LocalReads,
    /// Open handles by inode, so a truncate can wait for their writes and reset their
    /// sizes. Bounded by the number of open handles.
    handles: Mutex<HashMap<InodeId, Vec<Weak<HandleShared>>>>,
    renewer: Mutex<Option<JoinHandle<()>>>,
    /// Held while a new session is opened, so callers that found the session gone at the
    /// same time make one new session between them.
    reopening: tokio::sync::Mutex<()>,
    /// This client's metrics; see [`crate::metrics`].
    metrics: Arc<freeflow_metrics::Registry>,
    /// Revocations seen (see `leases.rs`).
    pub(crate) revoked: Mutex<crate::leases::Revoked>,
    /// The revocation poll (started at connect) and who is told of revocations.
    watcher: Mutex<Option<JoinHandle<()>>>,
    /// The newest revocation the poll handled, by server epoch (`leases::renew` waits
    /// for it).
    pub(crate) handled: tokio::sync::watch::Sender<(u64, u64)>,
    /// The run of lease renewals (see `leases.rs`) and its task.
    pub(crate) renewed: Mutex<crate::leases::Renewed>,
    lease_renewer: Mutex<Option<JoinHandle<()>>>,
    pub(crate) revocation_handler: Mutex<Option<crate::leases::RevocationHandler>>,
    /// Who writes back what it holds of a recalled file before the acknowledgement.
    pub(crate) recall_handler: Mutex<Option<crate::leases::RecallHandler>>,
    /// The file locks this client holds (see `locks.rs`).
    pub(crate) locks: Mutex<crate::locks::HeldLocks>,
    /// Turns of lock waits at the meta server (`locks::LOCK_WAITS_MAX`).
    pub(crate) lock_waits: tokio::sync::Semaphore,
    /// Closes nobody waits for (see `closer.rs`).
    pub(crate) closer: Arc<crate::closer::Closer>,
    /// Directories delegated to this client and the creates answered ahead in them (see
    /// `delegation.rs`).
    pub(crate) delegations: Arc<crate::delegation::Delegations>,
    /// Space this client holds on the I/O servers (see `space.rs`).
    pub(crate) space: crate::space::SpaceGrants,
    /// Handles open for writing (registered and not closed).
    writers_open: std::sync::atomic::AtomicUsize,
    /// Shared memory for write payloads to I/O servers on this host (`Client::payload`).
    payload_area: Option<Arc<freeflow_rpc::shared::PayloadArea>>,
}

impl Shared {
    pub(crate) fn open_handles(&self, inode: InodeId) -> Vec<Arc<HandleShared>> {
        let handles = self.handles.lock().expect("not poisoned");
        handles
            .get(&inode)
            .map(|list| list.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }
}

impl Drop for Shared {
    /// The last clone of the client is gone: its background tasks stop with it, and its
    /// session is closed in the background (best effort), so that the meta server does not
    /// wait for it as for a client that crashed (after a restart, for its replay).
    fn drop(&mut self) {
        for task in [&self.renewer, &self.watcher, &self.lease_renewer] {
            if let Some(task) = task.lock().map(|mut task| task.take()).unwrap_or(None) {
                task.abort();
            }
        }
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let session_id = self.session_id.load(Ordering::Acquire);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pool = self.pool.clone();
            runtime.spawn(async move { pool.close_session_quietly(session_id).await });
        }
    }
}

/// A connected client. Clones share the session and the connections.
#[derive(Clone)]
pub struct Client {
    pub(crate) shared: Arc<Shared>,
    pub(crate) caller: Caller,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("meta_address", &self.shared.config.meta_address)
            .field("session_id", &self.session_id())
            .field("caller", &self.caller)
            .finish_non_exhaustive()
    }
}

/// Times an open reopens a session the meta server does not know before it gives up.
const SESSION_REOPENS_MAX: u32 = 5;

/// Longest [`Client::shutdown`] waits for the meta server to take back the session's
/// space grants and close it (longer than a replicated meta server's failover).
pub const SHUTDOWN_WAIT_MS: u64 = 5_000;

fn is_session_unknown(error: &ClientError) -> bool {
    matches!(
        error,
        ClientError::Meta { source: RpcError::Remote(wire), .. }
            if matches!(wire.code, ErrorCode::NotFound | ErrorCode::Stale | ErrorCode::BadHandle)
    )
}

/// Whether an `Open` or `Create` with open was refused because the meta server does not know
/// the session (it answers `BadHandle` for that; `NotFound` there means the file).
fn is_open_session_unknown(error: &ClientError) -> bool {
    matches!(
        error,
        ClientError::Meta { source: RpcError::Remote(wire), .. } if wire.code == ErrorCode::BadHandle
    )
}

impl Shared {
    /// Use `session_id` from now on (a session opened during recovery).
    pub(crate) fn set_session_id(&self, session_id: u64) {
        self.session_id.store(session_id, Ordering::Release);
    }

    /// After a restart of the meta server or a change of leader, inside its recovery
    /// window: this client's session and every handle open in it taken again under their
    /// ids (`ReclaimSession`), so the new server counts their files open (an unlinked file
    /// keeps its data) and closes of them succeed. Returns the session, or None if it
    /// could not be taken again (the next call opens another; its handles are lost).
    pub(crate) async fn reclaim_session(
        &self,
        connection: &freeflow_rpc::Connection,
    ) -> Option<u64> {
        let session_id = self.session_id.load(Ordering::Acquire);
        let open: Vec<(Arc<HandleShared>, ReclaimedHandle)> = self
            .handles
            .lock()
            .expect("not poisoned")
            .values()
            .flatten()
            .filter_map(Weak::upgrade)
            .filter_map(|handle| {
                let (opened_in, reclaimed) = handle.reclaimed()?;
                (opened_in == session_id).then_some((handle, reclaimed))
            })
            .collect();
        let handles: Vec<ReclaimedHandle> = open.iter().map(|(_, handle)| *handle).collect();
        let mut lost = 0;
        let mut pieces: Vec<&[ReclaimedHandle]> = handles.chunks(RECLAIM_HANDLES_MAX).collect();
        if pieces.is_empty() {
            pieces.push(&[]);
        }
        for piece in pieces {
            let request = ReclaimSession {
                session_id,
                client_name: self.config.client_name.clone(),
                handles: piece.to_vec(),
            };
            let id = self.pool.next_meta_request_id();
            match connection
                .call_as(id, 0, &request, bytes::Bytes::new())
                .await
            {
                Ok((not_taken, _)) => {
                    lost += not_taken.len();
                    let not_taken: std::collections::HashSet<u64> = not_taken.into_iter().collect();
                    for (handle, reclaimed) in &open {
                        if not_taken.contains(&reclaimed.handle_id) {
                            handle.mark_lost();
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(
                        session_id,
                        %error,
                        "the session could not be taken again after the metadata server restarted: its handles are lost"
                    );
                    return None;
                }
            }
        }
        if lost > 0 {
            tracing::warn!(
                session_id,
                lost,
                "handles open before the metadata server restarted could not be taken again (their files are gone)"
            );
        }
        tracing::debug!(
            session_id,
            handles = handles.len(),
            lost,
            "session reclaimed"
        );
        self.session_epoch
            .store(self.pool.lease_epoch(), Ordering::Release);
        Some(session_id)
    }

    /// Open a new session because `gone_session_id` is unknown at the meta server, unless
    /// another caller already did; returns the session to use.
    pub(crate) async fn reopen_session(&self, gone_session_id: u64) -> Result<u64, ClientError> {
        let _reopening = self.reopening.lock().await;
        let current = self.session_id.load(Ordering::Acquire);
        if current != gone_session_id {
            return Ok(current);
        }
        let client_name = self.config.client_name.clone();
        let grant = self
            .pool
            .meta_call(&OpenSession { client_name }, || {
                format!("after session {gone_session_id} was lost")
            })
            .await?;
        tracing::warn!(
            old_session = gone_session_id,
            new_session = grant.session_id,
            "the meta server forgot this client's session; handles open in it are lost"
        );
        self.session_epoch
            .store(self.pool.lease_epoch(), Ordering::Release);
        self.session_id.store(grant.session_id, Ordering::Release);
        Ok(grant.session_id)
    }
}

/// The lease tables read once, as of `now` (see [`Client::lease_view`]).
struct LeaseView<'a> {
    epoch: u64,
    renewed: crate::leases::Renewed,
    revoked: std::sync::MutexGuard<'a, crate::leases::Revoked>,
    now: tokio::time::Instant,
}

impl LeaseView<'_> {
    /// How long `lease` can still be trusted for `inodes` (see `leases::remaining`).
    fn remaining(&self, lease: &Lease, inodes: &[InodeId]) -> Option<Duration> {
        crate::leases::remaining(
            lease,
            self.epoch,
            &self.revoked,
            &self.renewed,
            inodes,
            self.now,
        )
    }

    /// What renewals keep `lease` good for past its own end, if they do.
    fn spans(&self, lease: &Lease) -> Option<Duration> {
        self.renewed
            .spans(lease)
            .map(|until| until.saturating_duration_since(self.now))
    }
}

impl Client {
    /// Connect to the meta server and open a session, renewed in the background.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        config.validate()?;
        // Random per client: the meta server applies each mutation once per (client id,
        // request id), and waits for this client to replay after a restart.
        let client_id = freeflow_rpc::random_client_id().map_err(|error| {
            ClientError::Config(format!("no randomness for a client id: {error}"))
        })?;
        // One area of shared memory for the write payloads to every I/O server on this
        // host (its pages touched only when used); without one, each connection makes its
        // own and payloads are copied into it when sent.
        let payload_area = if config.shared_writes {
            freeflow_rpc::shared::PayloadArea::new(freeflow_rpc::shared::AREA_SLOTS)
                .inspect_err(|error| tracing::debug!(%error, "no payload area: each connection makes its own"))
                .ok()
        } else {
            None
        };
        let options = ConnectOptions {
            client_name: config.client_name.clone(),
            call_timeout_ms: config.call_timeout_ms,
            connect_timeout_ms: config.connect_timeout_ms,
            client_id,
            shared_payloads: config.shared_writes,
            payload_area: payload_area.clone(),
            ..ConnectOptions::default()
        };
        let metrics = Arc::new(freeflow_metrics::Registry::new());
        let client_metrics = ClientMetrics::new(&metrics);
        let pool = Pool::new(
            config.meta_address.clone(),
            config.key.clone(),
            options,
            client_metrics.clone(),
        );
        let client_name = config.client_name.clone();
        let grant = pool
            .meta_call(
                &OpenSession {
                    client_name: client_name.clone(),
                },
                || format!("for client {client_name:?}"),
            )
            .await?;
        // The semaphore's permit count is usize; validation bounds dirty_bytes_max to 1 TiB.
        let dirty = Arc::new(Semaphore::new(config.dirty_bytes_max as usize));
        let caller = config.caller.clone();
        let pool = Arc::new(pool);
        let session_epoch = pool.lease_epoch();
        let local = crate::local::LocalReads::new(config.local_reads);
        let shared = Arc::new(Shared {
            config,
            closer: Arc::new(crate::closer::Closer::new(pool.clone())),
            delegations: Arc::new(crate::delegation::Delegations::default()),
            space: crate::space::SpaceGrants::new(),
            writers_open: std::sync::atomic::AtomicUsize::new(0),
            payload_area,
            pool,
            session_id: AtomicU64::new(grant.session_id),
            session_epoch: AtomicU64::new(session_epoch),
            closed: AtomicBool::new(false),
            dirty,
            readahead_room: Arc::new(Semaphore::new(crate::readahead::READAHEAD_CLIENT_BYTES_MAX)),
            local,
            handles: Mutex::new(HashMap::new()),
            renewer: Mutex::new(None),
            reopening: tokio::sync::Mutex::new(()),
            metrics,
            revoked: crate::leases::new_revoked(),
            watcher: Mutex::new(None),
            handled: tokio::sync::watch::Sender::new((0, 0)),
            renewed: Mutex::new(crate::leases::Renewed::default()),
            lease_renewer: Mutex::new(None),
            revocation_handler: Mutex::new(None),
            recall_handler: Mutex::new(None),
            locks: crate::locks::new_held(),
            lock_waits: tokio::sync::Semaphore::new(crate::locks::LOCK_WAITS_MAX),
        });
        // After a meta server restart, the session, its open handles and the locks held
        // here are taken again before the server's recovery window ends.
        let reclaimer = Arc::downgrade(&shared);
        *shared.pool.on_recover.lock().expect("not poisoned") =
            Some(Arc::new(move |connection: freeflow_rpc::Connection| {
                let shared = reclaimer.clone();
                Box::pin(async move {
                    if let Some(shared) = shared.upgrade() {
                        let session = shared.reclaim_session(&connection).await;
                        crate::locks::reclaim(
                            &shared.locks,
                            &shared.pool,
                            &shared.config.client_name,
                            |session_id| shared.set_session_id(session_id),
                            &connection,
                            session,
                        )
                        .await;
                    }
                })
            }));
        let dirty_source = Arc::downgrade(&shared);
        shared.metrics.on_render(move || {
            if let Some(shared) = dirty_source.upgrade() {
                let free_bytes = shared.dirty.available_permits() as u64;
                client_metrics
                    .set_dirty_bytes(shared.config.dirty_bytes_max.saturating_sub(free_bytes));
                client_metrics.set_kept_mutations(shared.pool.kept_mutations() as u64);
                if let Some(area) = &shared.payload_area {
                    client_metrics
                        .set_payload_places(area.free_places() as u64, area.abandoned() as u64);
                }
            }
        });
        let renewer = tokio::spawn(renew_session(Arc::downgrade(&shared), grant.lease_ms));
        *shared.renewer.lock().expect("not poisoned") = Some(renewer);
        // Every client polls for revocations: a truncation by another client recalls the
        // writes this one has in flight on the file through them (`leases::watch`).
        let watcher = tokio::spawn(crate::leases::watch(
            Arc::downgrade(&shared),
            shared.pool.clone(),
        ));
        *shared.watcher.lock().expect("not poisoned") = Some(watcher);
        let lease_renewer = tokio::spawn(crate::leases::renew(
            Arc::downgrade(&shared),
            shared.pool.clone(),
            shared.handled.subscribe(),
        ));
        *shared.lease_renewer.lock().expect("not poisoned") = Some(lease_renewer);
        Ok(Client { shared, caller })
    }

    /// `data` as a write payload of this client's own: copied into its area of memory
    /// shared with the I/O servers on this host when one of them took it, there is a
    /// place free and `data` is long enough to share, so that the write's request refers
    /// to those bytes without another copy; otherwise copied onto the heap. For callers
    /// whose bytes are borrowed anyway (the mount's request buffer).
    pub fn payload(&self, data: &[u8]) -> bytes::Bytes {
        self.shared_payload_area()
            .and_then(|area| area.copy_in(data))
            .unwrap_or_else(|| bytes::Bytes::copy_from_slice(data))
    }

    /// This client's payload area, once a server of this host took it.
    pub(crate) fn shared_payload_area(&self) -> Option<&Arc<freeflow_rpc::shared::PayloadArea>> {
        self.shared
            .payload_area
            .as_ref()
            .filter(|area| area.is_shared())
    }

    /// The same client (session, connections) acting for another identity.
    pub fn with_caller(&self, caller: Caller) -> Client {
        Client {
            shared: self.shared.clone(),
            caller,
        }
    }

    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    pub fn config(&self) -> &ClientConfig {
        &self.shared.config
    }

    /// This client's metrics (the mount serves them with `--metrics-address`).
    pub fn metrics(&self) -> &Arc<freeflow_metrics::Registry> {
        &self.shared.metrics
    }

    pub fn session_id(&self) -> u64 {
        self.shared.session_id.load(Ordering::Acquire)
    }

    /// Make every metadata change this client was answered durable at the meta server
    /// (`fsync` of a directory, `syncfs`). Changes are answered before they are durable;
    /// without this they are within `commit_interval_ms` (docs/consistency.md).
    pub async fn sync(&self) -> Result<(), ClientError> {
        self.shared.pool.sync_meta().await
    }

    /// The transaction at the meta server that applied the last mutation this client was
    /// answered (0: none yet): with the server's durable transaction, it says whether a
    /// change could still be lost (tests and tools; concurrent calls make "last" loose).
    pub fn last_mutation_txn(&self) -> u64 {
        self.shared.pool.last_mutation_txn()
    }

    /// Mutations answered by the meta server and not known durable yet: what this client
    /// would replay if the meta server restarted now.
    pub fn kept_mutations(&self) -> usize {
        self.shared.pool.kept_mutations()
    }

    /// Hear when what the meta server leased to this client must go: `handler` is called
    /// with each batch of revocations (and, when the meta server restarted, with one
    /// revocation of inode 0: everything), and they are acknowledged once it returns (or
    /// after `HANDLER_WAIT_MS`). Every client polls from connect on, so its reads come with
    /// leases (`Lease`, `*_leased` methods) whether or not it sets a handler.
    pub fn watch_revocations(&self, handler: crate::leases::RevocationHandler) {
        let everything = handler.clone();
        *self.shared.pool.on_new_epoch.lock().expect("not poisoned") = Some(Arc::new(move || {
            everything(&[Revocation {
                id: 0,
                inode: 0,
                names: Vec::new(),
                attributes: true,
                whole_directory: true,
            }])
        }));
        *self.shared.revocation_handler.lock().expect("not poisoned") = Some(handler);
    }

    /// Hear when another client's change recalls this client's writes to files (a
    /// revocation of their attributes): `handler` is called with those inodes before the
    /// writes this client started on them are waited for, so that whatever it holds
    /// unsent (a mount's kernel with its writeback cache) is written through this client
    /// first. It is waited for up to the call time-out, then the recall goes on.
    pub fn watch_recalls(&self, handler: crate::leases::RecallHandler) {
        *self.shared.recall_handler.lock().expect("not poisoned") = Some(handler);
    }

    /// The lease tables as they are now, read once (the revocations' lock is held while
    /// the view lives): for answering many leases together.
    fn lease_view(&self) -> LeaseView<'_> {
        LeaseView {
            epoch: self.shared.pool.lease_epoch(),
            renewed: *self.shared.renewed(),
            revoked: self.shared.revoked(),
            now: tokio::time::Instant::now(),
        }
    }

    /// How long `lease` can still be trusted for what it covers (`inodes`), if at all.
    pub fn lease_remaining(&self, lease: &Lease, inodes: &[InodeId]) -> Option<Duration> {
        self.lease_view().remaining(lease, inodes)
    }

    /// How long a cache that is told of revocations and of lapses (the mount's kernel,
    /// through `watch_revocations`) may keep what `lease` covers (`inodes`): while this
    /// client's leases are being renewed, up to the lease's span; else what remains of it.
    /// Ask while holding off the handler (the mount's `Admission`), so that a lapse that
    /// comes after the answer takes the reply back.
    pub fn kernel_time_out(&self, lease: &Lease, inodes: &[InodeId]) -> Option<Duration> {
        let view = self.lease_view();
        let left = view.remaining(lease, inodes)?;
        Some(view.spans(lease).map_or(left, |spans| spans.max(left)))
    }

    /// [`Client::kernel_time_out`] of `lease` for each of `inodes` on its own, with the
    /// lease tables' locks taken once (a listing's page answers hundreds of entries under
    /// one lease).
    pub fn kernel_time_outs(&self, lease: &Lease, inodes: &[InodeId]) -> Vec<Option<Duration>> {
        let view = self.lease_view();
        let spans = view.spans(lease);
        inodes
            .iter()
            .map(|inode| {
                let left = view.remaining(lease, &[*inode])?;
                Some(spans.map_or(left, |spans| spans.max(left)))
            })
            .collect()
    }

    /// Close the session at the meta server (best effort, at most [`SHUTDOWN_WAIT_MS`])
    /// and stop renewing it.
    ///
    /// Call it before the program ends. A client that is only dropped closes its session
    /// on a background task, which does not run if the process exits first; the session
    /// and its cache leases then stay at the meta server until they run out, and every
    /// other client's change they cover (a create in a directory this one listed) waits
    /// that long, 10 s by default. The command-line tools and the Python package do it
    /// for their users.
    pub async fn shutdown(&self) {
        if let Some(renewer) = self.shared.renewer.lock().expect("not poisoned").take() {
            renewer.abort();
        }
        for task in [&self.shared.watcher, &self.shared.lease_renewer] {
            if let Some(task) = task.lock().expect("not poisoned").take() {
                task.abort();
            }
        }
        self.shared.closed.store(true, Ordering::Release);
        let session_id = self.session_id();
        let close = async {
            self.shared.space.give_back(&self.shared.pool).await;
            self.shared
                .pool
                .meta_call(&CloseSession { session_id }, || {
                    format!("session {session_id}")
                })
                .await
        };
        // Bounded: a program ending while its meta server is gone should not wait the
        // call time-out; the session, its grants and its leases then end when its lease
        // runs out at the server.
        match tokio::time::timeout(Duration::from_millis(SHUTDOWN_WAIT_MS), close).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(%error, "closing the session failed"),
            Err(_) => tracing::info!(
                session_id,
                "the meta server did not answer the session's close within {SHUTDOWN_WAIT_MS} ms; it ends when its lease runs out"
            ),
        }
    }

    pub(super) fn open_handles(&self, inode: InodeId) -> Vec<Arc<HandleShared>> {
        self.shared.open_handles(inode)
    }

    pub(super) async fn meta<R: freeflow_proto::Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
    ) -> Result<R::Reply, ClientError> {
        self.shared.pool.meta_call(request, target).await
    }
}

/// Renew the session at a third of its lease until the client is gone.
async fn renew_session(shared: Weak<Shared>, lease_ms: u32) {
    let interval = Duration::from_millis(u64::from(lease_ms / 3).max(100));
    loop {
        tokio::time::sleep(interval).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let session_id = shared.session_id.load(Ordering::Acquire);
        let renewed = shared
            .pool
            .meta_call(&RenewSession { session_id }, || {
                format!("session {session_id}")
            })
            .await;
        match renewed {
            Ok(()) => {}
            Err(error) if is_session_unknown(&error) => {
                if let Err(error) = shared.reopen_session(session_id).await {
                    tracing::warn!(%error, "reopening the session failed");
                }
            }
            Err(error) => tracing::warn!(%error, "renewing the session failed; retrying"),
        }
    }
}

/// What an open file needs of its client (`file/state.rs`).
impl HandleHost for Client {
    fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    fn config(&self) -> &ClientConfig {
        &self.shared.config
    }

    fn dirty(&self) -> &Arc<Semaphore> {
        &self.shared.dirty
    }

    fn readahead_room(&self) -> &Arc<Semaphore> {
        &self.shared.readahead_room
    }

    fn space(&self) -> &crate::space::SpaceGrants {
        &self.shared.space
    }

    fn local(&self) -> &crate::local::LocalReads {
        &self.shared.local
    }

    fn closer(&self) -> &Arc<crate::closer::Closer> {
        &self.shared.closer
    }

    fn session_id(&self) -> u64 {
        Client::session_id(self)
    }

    fn session_epoch(&self) -> u64 {
        self.shared.session_epoch.load(Ordering::Acquire)
    }

    fn shared_payload_area(&self) -> Option<&Arc<freeflow_rpc::shared::PayloadArea>> {
        Client::shared_payload_area(self)
    }

    fn register_handle(&self, handle: &Arc<HandleShared>) {
        let inode = handle.inode();
        let mut handles = self.shared.handles.lock().expect("not poisoned");
        let list = handles.entry(inode).or_default();
        list.retain(|weak| weak.strong_count() > 0);
        list.push(Arc::downgrade(handle));
        if handle.opened_for_writing() {
            self.shared.writers_open.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn unregister_handle(&self, inode: InodeId, handle: &Arc<HandleShared>) {
        {
            let mut handles = self.shared.handles.lock().expect("not poisoned");
            if let Some(list) = handles.get_mut(&inode) {
                list.retain(|weak| {
                    weak.strong_count() > 0 && !std::ptr::eq(weak.as_ptr(), Arc::as_ptr(handle))
                });
                if list.is_empty() {
                    handles.remove(&inode);
                }
            }
        }
        // The last handle open for writing closed: the space held for writes goes back.
        // (A close given up halfway leaves the count up: the space then lapses at the
        // servers.)
        if handle.opened_for_writing()
            && self.shared.writers_open.fetch_sub(1, Ordering::AcqRel) == 1
        {
            // A second later, if no writer opened meanwhile (a loop of opens, writes and
            // closes keeps its grants).
            let shared = self.shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(GRANT_GIVE_BACK_DELAY).await;
                if shared.writers_open.load(Ordering::Acquire) == 0 {
                    shared.space.give_back(&shared.pool).await;
                }
            });
        }
    }

    fn setattr_through(
        &self,
        inode: InodeId,
        changes: SetAttr,
        through: Option<HandleRef>,
    ) -> futures::future::BoxFuture<'_, Result<Attr, ClientError>> {
        Box::pin(Client::setattr_through(self, inode, changes, through))
    }
}

/// What the revocation poll and the renewer need of the client (`leases.rs`).
impl LeaseHolder for Shared {
    fn revoked(&self) -> std::sync::MutexGuard<'_, crate::leases::Revoked> {
        self.revoked.lock().expect("revoked not poisoned")
    }

    fn renewed(&self) -> std::sync::MutexGuard<'_, crate::leases::Renewed> {
        self.renewed.lock().expect("renewed not poisoned")
    }

    fn revocation_handler(&self) -> Option<crate::leases::RevocationHandler> {
        self.revocation_handler
            .lock()
            .expect("not poisoned")
            .clone()
    }

    fn recall_handler(&self) -> Option<crate::leases::RecallHandler> {
        self.recall_handler.lock().expect("not poisoned").clone()
    }

    fn handled(&self) -> &tokio::sync::watch::Sender<(u64, u64)> {
        &self.handled
    }

    fn delegations(&self) -> &crate::delegation::Delegations {
        &self.delegations
    }

    async fn recall_writes(&self, inode: InodeId) {
        for handle in self.open_handles(inode) {
            handle.note_changed_elsewhere();
            handle.wait_for_started_writes().await;
        }
    }
}
