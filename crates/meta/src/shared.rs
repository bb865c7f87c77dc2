//! State shared by the request handlers, the writer thread, the reaper and the session
//! expiry task of one running metadata server.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use tokio::time::Instant;

use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{InodeId, ServerId};
use tokio::sync::{mpsc, oneshot, watch, Notify, OwnedMutexGuard};

use crate::io_peers::IoConnections;

use crate::config::MetaConfig;
use crate::ops::{OpContext, OpError, OpResult, Placement};
use crate::registry::Registry;
use crate::sessions::Sessions;
use crate::store::{
    MetaStore, RedbRead, RedbStore, RedbWrite, StoreWrite, TouchedInodes, TOUCHED_ALL,
};
use crate::writer::jobs::{job, Committed, WriterMessage};

/// Per (inode, truncation generation): the (stripe, member) cuts confirmed.
pub type CutsConfirmed = HashMap<(InodeId, u64), BTreeSet<(u32, ServerId)>>;

pub struct Shared {
    pub config: MetaConfig,
    /// None once shut down; handlers then answer `Unreachable`.
    pub store: RwLock<Option<Arc<RedbStore>>>,
    pub writer: mpsc::Sender<WriterMessage>,
    pub sessions: Mutex<Sessions>,
    pub registry: Mutex<Registry>,
    /// Cuts of replicated stripes each member confirmed, by (inode, truncation generation):
    /// a member that made its cut owes nothing while a partner's is still pending. In
    /// memory: after a restart a member cuts again (the same length, harmless: its
    /// stripe's writes wait at the partner that owes the cut).
    pub cuts_confirmed: Mutex<CutsConfirmed>,
    pub inode_count: AtomicU64,
    pub orphan_count: AtomicU64,
    /// Write transactions committed by the writer (one per batch).
    pub commit_count: AtomicU64,
    pub boot_epoch: u64,
    pub started: Instant,
    pub ready_ms: AtomicU64,
    pub reaper_wake: Notify,
    pub closing: AtomicBool,
    /// Connections to the I/O servers (reaper removals, truncation cuts).
    pub io: IoConnections,
    /// Inodes whose objects may be being cut, see [`CutPin`]. One entry per set-attributes
    /// with a size in flight, plus the reaper's one: bounded by the requests in flight.
    pub cut_gates: Mutex<HashMap<InodeId, CutGate>>,
    /// Counted by the writer; the rest of the metrics are read at each scrape.
    pub metrics: crate::metrics::MetaMetrics,
    /// The metrics endpoint, for `ClusterStatus` (None: off).
    pub metrics_address: Option<String>,
    /// The last transaction committed (visible to readers).
    pub last_txn: AtomicU64,
    /// The last transaction known durable; waiters watch it.
    pub durable: watch::Sender<u64>,
    /// The newest transaction whose callers were answered (some before its commit
    /// finished, `writer/`), and the newest committed (visible to new read
    /// transactions): a read waits for the one to reach the other ([`Shared::visible`]).
    pub answered_txn: AtomicU64,
    pub visible_txn: watch::Sender<u64>,
    /// Inodes changed in transactions not durable yet: inode → (client, transaction).
    /// Emptied at each durable commit; bounded by `writer::DIRTY_INODES_MAX`.
    pub dirty: Mutex<HashMap<InodeId, (u64, u64)>>,
    /// Clients whose record in the `clients` table is durable. Bounded by the sessions.
    pub registered_clients: Mutex<HashSet<u64>>,
    /// The recovery window after a restart (see `recovery.rs`).
    pub recovery: crate::recovery::Recovery,
    /// Mutations being applied now, by (client, request id): a copy of one sent again
    /// waits for the first instead of applying it twice. Bounded by the requests in flight.
    pub mutations_in_progress: Mutex<HashSet<(u64, u64)>>,
    pub mutation_finished: Notify,
    /// What clients cache, and its revocation (see `leases.rs`).
    pub leases: crate::leases::Leases,
    /// The cluster's file locks (see `locks.rs`).
    pub locks: crate::locks::LockTable,
    /// Replicated metadata: this server leads, and every batch goes through Raft
    /// (`raft/`); "durable" then means committed by a majority. None: a single server.
    pub raft: Option<crate::raft::link::RaftLink>,
}

/// How a request was answered: the transaction of a mutation (0 for a read) and the lease
/// granted on what it read or changed.
#[derive(Clone, Debug, Default)]
pub struct Answered {
    pub txn: u64,
    pub grant: crate::leases::Grant,
    /// A mutation's post-operation attributes of what it changed, and whether the list is
    /// complete (`ReplyStamp::changed`).
    pub changed: Vec<freeflow_types::Attr>,
    pub changed_complete: bool,
    /// Directories delegated to the client by this reply (`ReplyStamp::delegated`).
    pub delegated: Vec<InodeId>,
}

/// Most post-operation attributes a reply carries (a rename changes four inodes at most;
/// more: the client forgets what it kept instead).
pub const CHANGED_ATTRIBUTES_MAX: usize = 8;

/// Per inode: how many pins are held, and the lock that lets one pin-holder at a time send
/// cuts for it.
pub struct CutGate {
    pins: u32,
    /// Of those, the pins of set-attributes (which make their own cuts).
    size_changes: u32,
    lock: Arc<tokio::sync::Mutex<()>>,
}

/// Held from before a size change is queued until its cuts are over. While any pin is held
/// the reaper neither removes the inode's objects (a cut after the removal would re-create
/// an object nobody removes) nor retries its pending cuts (a late retry could cut data
/// written after the set-attributes replied). As for an open handle, it is taken before the
/// job is queued, so an unlink committed in the same batch cannot be reaped under it.
pub struct CutPin<'a> {
    shared: &'a Shared,
    inode: InodeId,
    lock: Arc<tokio::sync::Mutex<()>>,
    size_change: bool,
}

impl CutPin<'_> {
    /// Wait until no other pin-holder is sending cuts for this inode.
    pub async fn exclusive(&self) -> OwnedMutexGuard<()> {
        self.lock.clone().lock_owned().await
    }
}

impl Drop for CutPin<'_> {
    fn drop(&mut self) {
        let mut gates = self.shared.cut_gates();
        if let Some(gate) = gates.get_mut(&self.inode) {
            gate.pins = gate.pins.saturating_sub(1);
            if self.size_change {
                gate.size_changes = gate.size_changes.saturating_sub(1);
            }
            if gate.pins == 0 {
                gates.remove(&self.inode);
            }
        }
    }
}

fn shutting_down() -> WireError {
    WireError::new(ErrorCode::Unreachable, "metadata server is shutting down")
}

impl Shared {
    pub fn store(&self) -> Result<Arc<RedbStore>, WireError> {
        let guard = self
            .store
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard.clone().ok_or_else(shutting_down)
    }

    pub fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.sessions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn cuts_confirmed(&self) -> MutexGuard<'_, CutsConfirmed> {
        self.cuts_confirmed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn cut_gates(&self) -> MutexGuard<'_, HashMap<InodeId, CutGate>> {
        self.cut_gates
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Pin `inode` against the reaper (see [`CutPin`]).
    pub fn pin_cuts(&self, inode: InodeId) -> CutPin<'_> {
        let mut gates = self.cut_gates();
        let gate = gates.entry(inode).or_insert_with(|| CutGate {
            pins: 0,
            size_changes: 0,
            lock: Arc::new(tokio::sync::Mutex::new(())),
        });
        gate.pins += 1;
        gate.size_changes += 1;
        CutPin {
            shared: self,
            inode,
            lock: gate.lock.clone(),
            size_change: true,
        }
    }

    /// Pin `inode` only if nobody else holds a pin (the reaper's way: it leaves pinned
    /// inodes to their set-attributes).
    pub fn try_pin_cuts(&self, inode: InodeId) -> Option<CutPin<'_>> {
        let mut gates = self.cut_gates();
        if gates.contains_key(&inode) {
            return None;
        }
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        let gate = CutGate {
            pins: 1,
            size_changes: 0,
            lock: lock.clone(),
        };
        gates.insert(inode, gate);
        Some(CutPin {
            shared: self,
            inode,
            lock,
            size_change: false,
        })
    }

    /// Whether a set-attributes in flight has `inode` pinned (it makes its cuts itself).
    pub fn size_change_pinned(&self, inode: InodeId) -> bool {
        self.cut_gates()
            .get(&inode)
            .is_some_and(|gate| gate.size_changes > 0)
    }

    pub fn is_pinned(&self, inode: InodeId) -> bool {
        self.cut_gates().contains_key(&inode)
    }

    pub fn placement(&self) -> Placement {
        let (servers, spares) = self.registry().placement_servers(Instant::now());
        Placement {
            servers,
            spares,
            default_stripe_unit_bytes: self.config.stripe_unit_bytes,
            default_stripe_count: self.config.stripe_count,
            default_replicas: self.config.replicas,
        }
    }

    /// Run a read-only operation in its own read transaction (MVCC: concurrent with the
    /// writer).
    pub fn read<T>(
        &self,
        operation: impl FnOnce(&RedbRead) -> OpResult<T>,
    ) -> Result<T, WireError> {
        let store = self.store()?;
        let read = store
            .begin_read()
            .map_err(|error| OpError::Store(error).to_wire())?;
        operation(&read).map_err(|error| error.to_wire())
    }

    /// Queue a mutation of the server's own (the reaper, the cutter, registrations) and
    /// wait until it is committed (or refused) and clients' leases on what it changed are
    /// revoked.
    pub async fn write<T, F>(&self, operation: F) -> Result<T, WireError>
    where
        T: Send + 'static,
        F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
    {
        self.mutate(0, false, operation)
            .await
            .map(|(value, _)| value)
    }

    /// A mutation of `client` through the writer ([`Shared::write_as`]); then every other
    /// client's lease on what it changed is revoked (the reply waits for that, at most one
    /// lease), and the client is granted leases on what it changed, if it polls.
    pub async fn mutate<T, F>(
        &self,
        client: u64,
        durable: bool,
        operation: F,
    ) -> Result<(T, Answered), WireError>
    where
        T: Send + 'static,
        F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
    {
        let since = self.leases.seq();
        let (value, committed) = self.write_as(client, durable, operation).await?;
        let pending = self.leases.changed(client, &committed.touches);
        if !pending.is_empty() {
            let (started, sent) = (Instant::now(), pending.len());
            let expired = self.leases.wait(pending).await;
            self.metrics.revoked(sent, expired, started);
        }
        let grant = self.leases.grant(client, &committed.touches, since);
        // Read in the mutation's own transaction: no wait for its commit.
        let (changed, changed_complete) = match committed.changed {
            Some(changed) => (changed, true),
            None => (Vec::new(), false),
        };
        Ok((
            value,
            Answered {
                txn: committed.txn,
                grant,
                changed,
                changed_complete,
                delegated: Vec::new(),
            },
        ))
    }

    /// Queue a mutation of `client` and wait until it is committed (or refused); with
    /// `durable`, until it is durable. Returns the value and the transaction.
    pub async fn write_as<T, F>(
        &self,
        client: u64,
        durable: bool,
        operation: F,
    ) -> Result<(T, Committed), WireError>
    where
        T: Send + 'static,
        F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
    {
        if self.closing.load(Ordering::Acquire) {
            return Err(shutting_down());
        }
        let (job, receiver) = job(client, durable, operation);
        self.writer
            .send(WriterMessage::Job(job))
            .await
            .map_err(|_| shutting_down())?;
        receiver.await.map_err(|_| shutting_down())?
    }

    /// The last transaction known durable.
    pub fn durable_txn(&self) -> u64 {
        *self.durable.borrow()
    }

    /// Return once every transaction up to `through` is durable (asking the writer for a
    /// durable commit if it is not).
    pub async fn make_durable(&self, through: u64) -> Result<(), WireError> {
        if self.durable_txn() >= through {
            return Ok(());
        }
        let (reply, receiver) = oneshot::channel();
        self.writer
            .send(WriterMessage::Sync(reply))
            .await
            .map_err(|_| shutting_down())?;
        let durable = receiver.await.map_err(|_| shutting_down())?;
        // Replicated: a leadership that ended before the commit made nothing durable; the
        // caller asks the next leader.
        if self.raft.is_some() && durable < through {
            return Err(WireError::new(
                freeflow_proto::ErrorCode::NotLeader,
                format!(
                    "transaction {through} not known committed (this metadata server stopped leading)"
                ),
            ));
        }
        Ok(())
    }

    /// Return once every transaction up to `through` is durable, without asking for it:
    /// the periodic flush makes it so within `commit_interval_ms`.
    pub async fn wait_durable(&self, through: u64) {
        let mut durable = self.durable.subscribe();
        // Fails only if the sender is gone, and `self` owns it.
        let _ = durable.wait_for(|durable| *durable >= through).await;
    }

    /// Make everything committed so far durable.
    pub async fn sync(&self) -> Result<u64, WireError> {
        // Answered includes what is still committing (`writer/`): it is made durable too.
        let through = self
            .last_txn
            .load(Ordering::Acquire)
            .max(self.answered_txn.load(Ordering::Acquire));
        self.make_durable(through).await?;
        Ok(self.durable_txn())
    }

    /// Wait until every transaction answered before this call is committed, so that a
    /// read begun now sees whatever any caller was told: one non-durable commit at most
    /// (a durable one answers after its commit instead). `read` does not wait: a read
    /// for a client goes through `read_as`, which does.
    pub async fn visible(&self) {
        let answered = self.answered_txn.load(Ordering::Acquire);
        let mut visible = self.visible_txn.subscribe();
        // Fails only if the sender is gone, and `self` owns it.
        let _ = visible.wait_for(|committed| *committed >= answered).await;
    }

    pub fn dirty(&self) -> MutexGuard<'_, HashMap<InodeId, (u64, u64)>> {
        self.dirty
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn client_registered(&self, client: u64) -> bool {
        self.registered_clients
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(&client)
    }

    pub fn register_client(&self, client: u64) {
        self.registered_clients
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(client);
    }

    /// The last session of `client` ended: forget its client record (it holds nothing the
    /// recovery window would wait for once its mutations are durable, and the record's
    /// removal becomes durable no earlier than they do).
    pub async fn forget_client(&self, client: u64) {
        self.leases.forget_client(client);
        let registered = self
            .registered_clients
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&client);
        if registered {
            let removed = self
                .write(move |write, _| {
                    write.delete(crate::store::TableId::Clients, &client.to_be_bytes())?;
                    Ok(())
                })
                .await;
            if let Err(error) = removed {
                tracing::warn!(client, %error, "forgetting a client record failed");
            }
        }
    }

    /// A read for `client` (commit on share): if it read an inode another client changed
    /// in a transaction not durable yet, that transaction is made durable before the
    /// result is returned, so no client acts on a change a crash could take away. What it
    /// read is leased to the client if it polls for revocations.
    pub async fn read_as<T>(
        &self,
        client: u64,
        operation: impl Fn(&RedbRead) -> OpResult<T>,
    ) -> Result<(T, Answered), WireError> {
        loop {
            let since = self.leases.seq();
            self.visible().await;
            let (result, touched) = {
                let store = self.store()?;
                let read = store
                    .begin_read()
                    .map_err(|error| OpError::Store(error).to_wire())?;
                let result = operation(&read).map_err(|error| error.to_wire());
                (result, read.take_touched())
            };
            if self.leases.delegated_elsewhere(client, &touched.inodes) {
                // Another client may have answered creates there that are still on their
                // way: recall the delegation, wait until they are here, read again.
                let bound = std::time::Duration::from_millis(u64::from(self.config.lease_ms));
                let pending = self
                    .leases
                    .recall_delegations(client, &touched.inodes, bound);
                if !pending.is_empty() {
                    let (started, sent) = (Instant::now(), pending.len());
                    let expired = self.leases.wait(pending).await;
                    self.metrics.revoked(sent, expired, started);
                }
                continue;
            }
            if let Some(txn) = self.shared_change(client, &touched.inodes) {
                self.make_durable(txn).await?;
            }
            let value = result?;
            let grant = self.leases.grant(client, &touched, since);
            return Ok((
                value,
                Answered {
                    txn: 0,
                    grant,
                    ..Answered::default()
                },
            ));
        }
    }

    /// The newest transaction not durable yet in which another client than `client`
    /// changed one of `touched`, if any.
    pub fn shared_change(&self, client: u64, touched: &[InodeId]) -> Option<u64> {
        let dirty = self.dirty();
        if dirty.is_empty() {
            return None;
        }
        let durable = self.durable_txn();
        let other = |owner: u64, txn: u64| owner != client && owner != 0 && txn > durable;
        if touched.contains(&TOUCHED_ALL) {
            return dirty
                .values()
                .filter(|(owner, txn)| other(*owner, *txn))
                .map(|(_, txn)| *txn)
                .max();
        }
        touched
            .iter()
            .filter_map(|inode| dirty.get(inode))
            .filter(|(owner, txn)| other(*owner, *txn))
            .map(|(_, txn)| *txn)
            .max()
    }
}

impl Shared {
    /// The members of a replicated cluster as this leader sees them: how far each follower's
    /// log matches its own.
    pub(crate) fn meta_members(&self) -> Vec<freeflow_proto::meta::MetaMember> {
        let Some(link) = &self.raft else {
            return Vec::new();
        };
        let metrics = link.raft.metrics().borrow().clone();
        let last = metrics.last_log_index.unwrap_or(0);
        let purged = metrics.purged.map_or(0, |log_id| log_id.index);
        let reports = link
            .reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        // Raft's membership, not the configuration: members come and go (`members.rs`).
        let members = crate::raft::members::seen(&link.raft);
        members
            .nodes
            .iter()
            .map(|(id, node)| {
                let matched = if *id == link.id {
                    Some(last)
                } else {
                    metrics
                        .replication
                        .as_ref()
                        .and_then(|replication| replication.get(id).copied().flatten())
                        .map(|log_id| log_id.index)
                };
                let report = reports.get(id).cloned().unwrap_or_default();
                // Past what the log still holds, the follower is sent a snapshot.
                let lag_bytes = match matched {
                    Some(index) if index >= purged => link.log.bytes_between(index, last).ok(),
                    _ => None,
                };
                freeflow_proto::meta::MetaMember {
                    id: *id,
                    address: node.address.clone(),
                    leader: *id == link.id,
                    term: metrics.current_term,
                    lag_entries: matched.map(|index| last.saturating_sub(index)),
                    lag_bytes,
                    silent_ms: report.last_answer.map(|at| at.elapsed().as_millis() as u64),
                    last_error: report.last_error,
                    snapshot: report.snapshot,
                    voter: members.voters.contains(id),
                }
            })
            .collect()
    }

    /// An operator's change of the metadata cluster's members (`freeflow meta ...`),
    /// answered with the members once it is committed.
    pub(crate) async fn change_meta_members(
        &self,
        change: &freeflow_proto::meta::MetaMemberChange,
    ) -> Result<Vec<freeflow_proto::meta::MetaMember>, freeflow_proto::WireError> {
        let Some(link) = &self.raft else {
            return Err(freeflow_proto::WireError::new(
                freeflow_proto::ErrorCode::NotSupported,
                "a single metadata server has no members to change (a replicated cluster is \
                 made with `freeflow init --meta-servers 3`)",
            ));
        };
        crate::raft::members::change(&link.raft, change)
            .await
            .map_err(|reason| {
                freeflow_proto::WireError::new(freeflow_proto::ErrorCode::InvalidArgument, reason)
            })?;
        tracing::info!(?change, "metadata members changed");
        Ok(self.meta_members())
    }
}
