//! The one thread that owns write transactions: group commit, early replies, commit on
//! share (DESIGN.md §2, issue 10).
//!
//! Mutations arrive through a bounded channel. The writer takes what is queued (up to
//! `commit_batch_max`), applies the operations one after another in ONE write transaction
//! with one transaction number, persists the counters, commits once, then replies to every
//! caller. An operation that is refused wrote nothing (validate, then write), so it does not
//! disturb the others; a store failure aborts the whole batch, every caller gets `Io`, and
//! the writer's in-memory counters are restored to what the store holds.
//!
//! Durability is chosen per batch. A batch commits without an fsync (`Durability::None`:
//! visible at once, lost by a crash until a later durable commit) unless one of these makes
//! it durable before its replies:
//! - a caller asked (`CommitSize` ending an fsync, `Sync`, a client past its replay bound);
//! - commit on share: an operation reads or changes an inode that another client changed in
//!   a transaction not yet durable (earlier in this batch or before), so no client ever
//!   builds on a change that a crash could take away;
//! - an operation acts on the world outside the store right after (a truncation's cuts);
//! - a persisted high-water mark moved (ids and transaction numbers are never reused);
//! - the client has no durable client record yet (the recovery window after a restart
//!   waits for exactly the clients recorded);
//! - `commit_interval_ms` has passed since the oldest transaction not yet durable, or the
//!   table of non-durable inodes reached its bound.
//!
//! A batch of clients' mutations that need not be durable is answered before its commit
//! (after its changes are marked in `Shared::dirty` and `Shared::answered_txn` is
//! raised): the commit, most of a small mutation's time here, then runs while the replies
//! travel. A read waits until
//! every answered transaction is committed (`Shared::visible`), so a change is visible to
//! whoever learns of it. If such a commit fails, the server stops (exit status 74): its
//! callers were told, and only a restart makes them replay what it lost.
//!
//! A periodic `Flush` (from a ticker task) makes an idle server durable within the interval
//! with an empty durable commit; a `Sync` does the same at once.
//!
//! The writer runs on its own OS thread: commits block on fsync.

pub mod jobs;

use std::collections::{HashMap, VecDeque};
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{Attr, InodeId};
use tokio::sync::{mpsc, oneshot};

use crate::ops::{now, OpContext, WriterState};
use crate::records::{encode_versioned, ClientRecord};
use crate::shared::{Shared, CHANGED_ATTRIBUTES_MAX};
use crate::store::{
    Change, MetaStore, RedbWrite, StoreError, StoreRead, StoreWrite, TableId, TouchedInodes,
    Touches, TOUCHED_ALL,
};
pub use jobs::{job, BatchJob, Committed, WriterMessage};

/// Most inodes remembered as changed by a transaction not durable yet; reaching it makes
/// the next batch durable (which empties the table).
pub const DIRTY_INODES_MAX: usize = 262_144;

/// The answer of a leadership that is over (replicated metadata): the client sends the
/// request again to the next leader.
fn not_leader() -> WireError {
    WireError::new(
        ErrorCode::NotLeader,
        "this metadata server stopped leading; the request goes to the next leader",
    )
}

/// The exit status of a server whose store failed a commit it had answered for (EX_IOERR).
const EXIT_STORE_FAILED: i32 = 74;

/// Most reply records forgotten per durable commit (the rest wait for the next one).
const REPLY_PRUNE_PER_COMMIT: usize = 4096;

/// The messages taken for one round of the writer.
#[derive(Default)]
struct Queued {
    batch: Vec<Box<dyn BatchJob>>,
    syncs: Vec<oneshot::Sender<u64>>,
    flush: bool,
    stopping: bool,
}

impl Queued {
    fn take(&mut self, message: WriterMessage) {
        match message {
            WriterMessage::Job(job) => self.batch.push(job),
            WriterMessage::Sync(reply) => self.syncs.push(reply),
            WriterMessage::Flush => self.flush = true,
            WriterMessage::Shutdown => self.stopping = true,
        }
    }
}

/// What the writer thread keeps between batches.
struct Writer {
    shared: Arc<Shared>,
    state: WriterState,
    /// When the oldest transaction not yet durable committed (None: all durable).
    oldest_not_durable: Option<Instant>,
    /// (when, durable transaction) at each durable commit, oldest first: reply records of
    /// transactions durable for longer than the retention are forgotten.
    durable_history: VecDeque<(Instant, u64)>,
    interval: Duration,
    reply_retention: Duration,
}

/// The writer thread's loop. Returns when told to shut down or when every sender is gone.
pub fn run(shared: Arc<Shared>, mut receiver: mpsc::Receiver<WriterMessage>, state: WriterState) {
    let batch_max = shared.config.commit_batch_max.max(1);
    let mut writer = Writer {
        interval: Duration::from_millis(shared.config.commit_interval_ms),
        reply_retention: Duration::from_millis(u64::from(shared.config.lease_ms) * 2),
        shared,
        state,
        oldest_not_durable: None,
        durable_history: VecDeque::new(),
    };
    let mut stopping = false;
    while !stopping {
        let Some(first) = receiver.blocking_recv() else {
            break;
        };
        let mut queued = Queued::default();
        queued.take(first);
        while !queued.stopping && queued.batch.len() < batch_max {
            match receiver.try_recv() {
                Ok(message) => queued.take(message),
                Err(_) => break,
            }
        }
        let Queued {
            batch,
            syncs,
            flush,
            stopping: stop,
        } = queued;
        stopping = stop;
        let must_be_durable = !syncs.is_empty() || stopping;
        if !batch.is_empty() {
            writer.run_batch(batch, must_be_durable);
        }
        if must_be_durable || (flush && writer.interval_passed()) {
            writer.make_durable();
        }
        let durable = *writer.shared.durable.borrow();
        for reply in syncs {
            let _ = reply.send(durable);
        }
    }
    receiver.close();
    let refused = Err(WireError::new(
        ErrorCode::Unreachable,
        "metadata server is shutting down",
    ));
    while let Ok(message) = receiver.try_recv() {
        if let WriterMessage::Job(job) = message {
            job.finish(&refused);
        }
    }
}

impl Writer {
    fn interval_passed(&self) -> bool {
        self.oldest_not_durable
            .is_some_and(|since| since.elapsed() >= self.interval)
    }

    /// The transaction below which reply records may be forgotten: the last one durable for
    /// longer than the retention (a resend or replay comes within it).
    fn prune_limit(&self) -> Option<u64> {
        self.durable_history
            .iter()
            .rev()
            .find(|(at, _)| at.elapsed() >= self.reply_retention)
            .map(|(_, txn)| *txn)
    }

    fn run_batch(&mut self, mut batch: Vec<Box<dyn BatchJob>>, must_be_durable: bool) {
        let shared = self.shared.clone();
        let started = Instant::now();
        let saved = self.state.clone();
        let orphans_before = saved.orphan_count;
        let placement = shared.placement();
        // Inodes changed by each client's jobs in this batch (and which client).
        let mut batch_changes: HashMap<InodeId, u64> = HashMap::new();
        let mut new_clients: Vec<u64> = Vec::new();
        let mut durable =
            must_be_durable || self.interval_passed() || shared.dirty().len() >= DIRTY_INODES_MAX;
        let prune_limit = self.prune_limit();
        let operations = batch.len();
        // Applied, not committed yet: the transaction, its number, and whether it must be
        // durable before its callers are answered.
        let replicated = shared.raft.is_some();
        if let Some(link) = &shared.raft {
            // A leadership that is over runs nothing more: its callers go to the next.
            if link.is_deposed() {
                let refused = Err(not_leader());
                for job in batch {
                    job.finish(&refused);
                }
                return;
            }
            self.catch_up_commits();
        }
        let applied = (|| -> Result<(RedbWrite, u64, bool, Vec<Change>), StoreError> {
            let store = shared.store().map_err(|_| StoreError::Closed)?;
            let mut write = store.begin_write()?;
            if replicated {
                write.capture();
            }
            self.state.high_water_moved = false;
            let txn = self.state.begin_txn(&mut write)?;
            let mut context = OpContext::new(now(), &placement, &mut self.state, txn);
            for job in batch.iter_mut() {
                write.take_touched();
                job.apply(&mut write, &mut context)?;
                let touched = write.take_touched();
                durable |= job.wants_durable();
                let client = job.client();
                if client == 0 || !job.applied() {
                    job.set_touches(touched, None);
                    continue;
                }
                if !durable && shared_with_another(&shared, client, &touched.inodes, &batch_changes)
                {
                    durable = true;
                }
                for inode in &touched.inodes {
                    batch_changes.insert(*inode, client);
                }
                let changed = changed_attributes(&shared, client, &write, &touched);
                job.set_touches(touched, changed);
                if !shared.client_registered(client) && !new_clients.contains(&client) {
                    new_clients.push(client);
                }
            }
            for client in &new_clients {
                let record = ClientRecord {
                    first_txn: txn,
                    wall_seconds: now().seconds,
                };
                write.put(
                    TableId::Clients,
                    &client.to_be_bytes(),
                    &encode_versioned(&record),
                )?;
            }
            durable |= context.demand_durable || !new_clients.is_empty();
            durable |= context.state.high_water_moved;
            if durable {
                prune_replies(&mut write, prune_limit)?;
            }
            context.state.persist(&mut write)?;
            // Replicated: the batch's changes are its Raft entry; "durable" is the entry's
            // commit, and the store keeps the batch's undo record until then.
            let changes = if replicated {
                let changes = write.take_changes();
                let origin = shared.raft.as_ref().map_or(0, |link| link.origin);
                crate::raft::batch::remember(&mut write, origin, txn, &changes)?;
                write.set_durable(false)?;
                changes
            } else {
                write.set_durable(durable)?;
                Vec::new()
            };
            // Marked before the commit makes the changes visible: a reader that sees them
            // also sees that they are not durable yet. Replicated, a durable batch too is
            // visible here before Raft commits it (`became_durable` clears the marks).
            if !durable || replicated {
                let mut dirty = shared.dirty();
                for (inode, client) in &batch_changes {
                    dirty.insert(*inode, (*client, txn));
                }
            }
            Ok((write, txn, durable, changes))
        })();
        // A batch that need not be durable is answered before its commit, which then runs
        // while the replies travel (most of a small mutation's time at this server). Reads
        // wait for the commit meanwhile (`Shared::visible`), so nobody told of a
        // change reads from before it; the changes are not durable either way, and a
        // crash loses them only as it would a moment later (clients replay them).
        // The server's own changes (client 0: the reaper, the cutter, registrations) are
        // answered after their commit, so that its next read sees them.
        let clients_only = batch.iter().all(|job| job.client() != 0);
        let mut answered_early = false;
        let mut proposal = None;
        let outcome = applied.and_then(|(write, txn, durable, changes)| {
            if !durable && clients_only {
                shared.answered_txn.fetch_max(txn, Ordering::AcqRel);
                for job in batch.drain(..) {
                    job.finish(&Ok(txn));
                }
                answered_early = true;
            }
            let committed = write.commit();
            if answered_early {
                if let Err(error) = &committed {
                    // Callers were told these changes happened and the store refused
                    // them: stop, so that clients replay them to a restarted server
                    // rather than see them vanish from a running one.
                    tracing::error!(
                        %error,
                        txn,
                        "metadata commit failed after its callers were answered; stopping \
                         so that clients replay to a restarted server"
                    );
                    std::process::exit(EXIT_STORE_FAILED);
                }
            }
            committed?;
            proposal = Some(changes);
            Ok(txn)
        });
        // Replicated: hand the batch to Raft in transaction order; a batch that must be
        // durable is answered once a majority holds it.
        // A batch committed here but not known committed by Raft is neither undone nor
        // reported failed: its callers get `NotLeader` and send it again to the next
        // leader, which answers from its reply record if the entry was committed after
        // all. The writer runs nothing more (`is_deposed`); its counters stay past it.
        let mut lost_lead = None;
        let outcome = match (outcome, shared.raft.as_ref(), proposal) {
            (Ok(txn), Some(link), Some(changes)) => match link.propose(txn, &changes) {
                Ok(receiver) if durable => match link.wait_committed(receiver) {
                    Ok(()) => Ok(txn),
                    Err(reason) => {
                        link.depose(reason.clone());
                        lost_lead = Some(txn);
                        Err(StoreError::Backend(reason))
                    }
                },
                Ok(receiver) => {
                    let watcher = shared.clone();
                    link.runtime.spawn(async move {
                        let wait = crate::raft::link::COMMIT_WAIT;
                        let outcome = match tokio::time::timeout(wait, receiver).await {
                            Ok(outcome) => crate::raft::link::committed(outcome),
                            Err(_) => Err(format!("not committed within {wait:?}")),
                        };
                        match outcome {
                            Ok(()) => {
                                watcher.durable.send_if_modified(|durable| {
                                    let newer = txn > *durable;
                                    if newer {
                                        *durable = txn;
                                    }
                                    newer
                                });
                            }
                            Err(reason) => {
                                if let Some(link) = &watcher.raft {
                                    link.depose(reason);
                                }
                            }
                        }
                    });
                    Ok(txn)
                }
                Err(reason) => {
                    link.depose(reason.clone());
                    lost_lead = Some(txn);
                    Err(StoreError::Backend(reason))
                }
            },
            (outcome, _, _) => outcome,
        };
        let outcome = match (outcome, lost_lead) {
            (_, Some(txn)) => {
                shared.last_txn.store(txn, Ordering::Release);
                shared.visible_txn.send_replace(txn);
                Err(not_leader())
            }
            (Ok(txn), None) => {
                shared.commit_count.fetch_add(1, Ordering::Relaxed);
                shared.last_txn.store(txn, Ordering::Release);
                shared.visible_txn.send_replace(txn);
                shared
                    .inode_count
                    .store(self.state.inode_count, Ordering::Relaxed);
                shared
                    .orphan_count
                    .store(self.state.orphan_count, Ordering::Relaxed);
                if durable {
                    // Registered before durability is announced: a `CloseSession` waiting
                    // in `sync` for this commit must find the record to forget it, or a
                    // restart waits out its recovery window for a client long gone.
                    for client in new_clients {
                        shared.register_client(client);
                    }
                    self.became_durable(txn);
                } else if self.oldest_not_durable.is_none() {
                    self.oldest_not_durable = Some(Instant::now());
                }
                Ok(txn)
            }
            (Err(error), None) => {
                tracing::error!(%error, operations, "metadata batch failed; aborted");
                self.state = saved;
                // The changes never became visible: forget them.
                let failed_txn = self.state.next_txn;
                shared.dirty().retain(|_, (_, txn)| *txn != failed_txn);
                Err(WireError::new(
                    ErrorCode::Io,
                    format!("metadata store: {error}"),
                ))
            }
        };
        shared
            .metrics
            .batch_done(operations, started, outcome.is_ok());
        if durable && outcome.is_ok() {
            shared.metrics.durable_commit();
        }
        for job in batch {
            job.finish(&outcome);
        }
        // Handles of create-and-opens and pins of truncates in this batch were registered
        // before the commit, so the reaper cannot take the data of a file opened (or being
        // cut) and unlinked in the same batch.
        if outcome.is_ok() && self.state.orphan_count > orphans_before {
            shared.reaper_wake.notify_one();
        }
    }

    /// Everything up to `txn` is durable now.
    fn became_durable(&mut self, txn: u64) {
        self.oldest_not_durable = None;
        self.shared.dirty().clear();
        self.shared.durable.send_replace(txn);
        self.durable_history.push_back((Instant::now(), txn));
        // One entry per retention's worth of history is plenty.
        while self.durable_history.len() > 1
            && self.durable_history[1].0.elapsed() >= self.reply_retention
        {
            self.durable_history.pop_front();
        }
    }

    /// Replicated: take in the commits the watcher tasks saw (batches answered before
    /// their commit): what they changed is no longer shared ahead of durability.
    fn catch_up_commits(&mut self) {
        let committed = *self.shared.durable.borrow();
        if self
            .durable_history
            .back()
            .is_some_and(|(_, txn)| *txn >= committed)
        {
            return;
        }
        self.shared.dirty().retain(|_, (_, txn)| *txn > committed);
        if committed >= self.shared.last_txn.load(Ordering::Acquire) {
            self.oldest_not_durable = None;
        }
        self.durable_history.push_back((Instant::now(), committed));
    }

    /// Commit an empty durable transaction if anything committed is not durable yet
    /// (replicated: wait until Raft committed everything proposed).
    fn make_durable(&mut self) {
        let last = self.shared.last_txn.load(Ordering::Acquire);
        if last <= *self.shared.durable.borrow() {
            return;
        }
        let shared = self.shared.clone();
        if let Some(link) = &shared.raft {
            if link.deposed.borrow().is_some() {
                return;
            }
            let mut durable = shared.durable.subscribe();
            let mut deposed = link.deposed.subscribe();
            let timer = link.timer(crate::raft::link::COMMIT_WAIT);
            let waited = link.runtime.block_on(async {
                // The borrow `wait_for` returns is dropped here, before the watch is
                // written below. A leadership that ends meanwhile stops the wait.
                tokio::select! {
                    waited = durable.wait_for(|txn| *txn >= last) => match waited {
                        Ok(_) => Ok(()),
                        Err(_) => Err("the server is shutting down".to_string()),
                    },
                    elapsed = timer => match elapsed {
                        Ok(()) => Err(format!(
                            "transaction {last} not committed within {:?}",
                            crate::raft::link::COMMIT_WAIT
                        )),
                        Err(_) => Err("the server is shutting down".to_string()),
                    },
                    _ = deposed.wait_for(|reason| reason.is_some()) => {
                        Err("stopped leading".to_string())
                    }
                }
            });
            match waited {
                Ok(()) => self.became_durable(last),
                Err(reason) => link.depose(reason),
            }
            return;
        }
        let outcome = (|| -> Result<(), StoreError> {
            let store = shared.store().map_err(|_| StoreError::Closed)?;
            let mut write = store.begin_write()?;
            prune_replies(&mut write, self.prune_limit())?;
            write.set_durable(true)?;
            write.commit()
        })();
        match outcome {
            Ok(()) => {
                shared.commit_count.fetch_add(1, Ordering::Relaxed);
                shared.metrics.durable_commit();
                self.became_durable(last);
            }
            Err(error) => tracing::error!(%error, "making the metadata durable failed"),
        }
    }
}

/// The attributes of the inodes a mutation of `client` changed, read in its transaction,
/// for its reply: only for a client that caches (the others would not use them), and
/// only a few (`CHANGED_ATTRIBUTES_MAX`). What it reads is not counted as touched by the
/// next mutation (each job's touches are taken afresh).
fn changed_attributes(
    shared: &Shared,
    client: u64,
    write: &RedbWrite,
    touches: &Touches,
) -> Option<Vec<Attr>> {
    if !shared.leases.is_capable(client) {
        return None;
    }
    let mut inodes = touches.attributes_changed.clone();
    inodes.sort_unstable();
    inodes.dedup();
    if touches.overflowed || inodes.len() > CHANGED_ATTRIBUTES_MAX {
        return None;
    }
    let mut found = Vec::with_capacity(inodes.len());
    for inode in inodes {
        match crate::ops::lookup::attr_of(write, inode) {
            Ok(Some(attr)) => found.push(attr),
            // Removed by the mutation: nothing left to keep.
            Ok(None) => {}
            // The reply goes without them (the client asks when it needs them); the
            // batch is not failed for them.
            Err(_) => return None,
        }
    }
    Some(found)
}

/// Whether an inode touched by `client` was changed by another client in a transaction not
/// durable yet (`batch_changes`: earlier jobs of this batch, not committed yet).
fn shared_with_another(
    shared: &Shared,
    client: u64,
    touched: &[InodeId],
    batch_changes: &HashMap<InodeId, u64>,
) -> bool {
    let dirty = shared.dirty();
    touched.iter().any(|inode| {
        if *inode == TOUCHED_ALL {
            return !dirty.is_empty() || !batch_changes.is_empty();
        }
        let other = |owner: u64| owner != client && owner != 0;
        batch_changes.get(inode).is_some_and(|owner| other(*owner))
            || dirty.get(inode).is_some_and(|(owner, _)| other(*owner))
    })
}

/// Forget reply records of transactions up to `limit` (at most
/// [`REPLY_PRUNE_PER_COMMIT`] per call).
fn prune_replies(write: &mut RedbWrite, limit: Option<u64>) -> Result<(), StoreError> {
    let Some(limit) = limit else {
        return Ok(());
    };
    let end = limit.saturating_add(1).to_be_bytes();
    let keys = write.range_keys(
        TableId::ReplyExpiry,
        Bound::Unbounded,
        Bound::Excluded(&end[..]),
        REPLY_PRUNE_PER_COMMIT,
    )?;
    for key in keys {
        if let Some(reply_key) = key.get(8..24) {
            write.delete(TableId::Replies, reply_key)?;
        }
        write.delete(TableId::ReplyExpiry, &key)?;
    }
    Ok(())
}
