//! The namespace in redb as openraft's state machine.
//!
//! A follower applies each committed batch by setting the keys it changed (`batch.rs`).
//! The leader ran its batches already, ahead of their commit: applying one of its own
//! entries only forgets the batch's undo record. The last applied log id and the
//! membership live in the `RaftState` table, changed in the same transaction as what they
//! describe, so the store never claims more or less than it holds.
//!
//! Applying commits without an fsync but once a second: the Raft log is the durable copy.
//! After a crash redb comes back at its last durable commit, with the applied log id of
//! that moment, and openraft applies the rest (at most a second's worth) from the log.
//! Building a snapshot makes the store durable first, so the log is never purged past
//! what the store durably holds.
//!
//! A snapshot is every replicated table's pairs as of the last applied entry, encoded with
//! postcard and held in memory (the leader's speculative batches are left out by reading
//! their undo records: see [`build`]).

use std::collections::{BTreeMap, HashMap};
use std::io::Cursor;
use std::ops::Bound;
use std::sync::{Arc, Mutex};

use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::{EntryPayload, ErrorSubject, ErrorVerb, StorageError};
use serde::{Deserialize, Serialize};

use crate::raft::batch;
use crate::raft::log_store::storage_error;
use crate::raft::types::{
    Entry, LogId, NodeId, Snapshot, SnapshotMeta, StoredMembership, TypeConfig,
};
use crate::store::{MetaStore, RedbStore, StoreError, StoreRead, StoreWrite, TableId};

const KEY_APPLIED: &[u8] = b"applied";
const KEY_MEMBERSHIP: &[u8] = b"membership";

fn sm_error(verb: ErrorVerb, error: impl std::fmt::Display) -> StorageError<NodeId> {
    storage_error(ErrorSubject::StateMachine, verb, error)
}

/// (table code, key, value).
type TablePair = (u8, Vec<u8>, Vec<u8>);

/// What a snapshot holds.
#[derive(Serialize, Deserialize)]
struct SnapshotBody {
    applied: Option<LogId>,
    membership: StoredMembership,
    /// Every pair of the replicated tables.
    pairs: Vec<TablePair>,
}

/// A snapshot's description and bytes.
type Built = (SnapshotMeta, Vec<u8>);

/// The state machine; clones share the store and the last snapshot.
#[derive(Clone)]
pub struct StateMachine {
    store: Arc<RedbStore>,
    current: Arc<Mutex<Option<Built>>>,
    /// When applying last made the store durable.
    last_durable: Arc<Mutex<std::time::Instant>>,
}

impl StateMachine {
    pub fn new(store: Arc<RedbStore>) -> StateMachine {
        StateMachine {
            store,
            current: Arc::default(),
            last_durable: Arc::new(Mutex::new(std::time::Instant::now())),
        }
    }

    /// Whether the next apply should be durable (once per `APPLIED_DURABLE_EVERY`).
    fn durable_due(&self) -> bool {
        let mut last = self.last_durable.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() < APPLIED_DURABLE_EVERY {
            return false;
        }
        *last = std::time::Instant::now();
        true
    }
}

fn read_record<T: serde::de::DeserializeOwned, R: StoreRead>(
    read: &R,
    key: &[u8],
) -> Result<Option<T>, StoreError> {
    let Some(bytes) = read.get(TableId::RaftState, key)? else {
        return Ok(None);
    };
    postcard::from_bytes(&bytes)
        .map(Some)
        .map_err(|error| StoreError::Corrupt {
            table: "raft_state",
            reason: error.to_string(),
        })
}

fn put_record<T: Serialize>(
    write: &mut crate::store::RedbWrite,
    key: &[u8],
    value: &T,
) -> Result<(), StoreError> {
    let bytes = postcard::to_allocvec(value).map_err(StoreError::backend)?;
    write.apply_raw(TableId::RaftState, key, Some(&bytes))
}

/// The last applied log id and membership the store holds.
pub fn applied_state(store: &RedbStore) -> Result<(Option<LogId>, StoredMembership), StoreError> {
    let read = store.begin_read()?;
    let applied = read_record::<Option<LogId>, _>(&read, KEY_APPLIED)?.flatten();
    let membership = read_record(&read, KEY_MEMBERSHIP)?.unwrap_or_default();
    Ok((applied, membership))
}

/// How often applying makes the store durable: what a member applies again from its log
/// after a crash is at most this much of the cluster's work.
const APPLIED_DURABLE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Apply committed entries in one transaction; one response per entry (the batch's
/// transaction number, 0 for other entries). `durable`: make this transaction durable.
fn apply_entries(
    store: &RedbStore,
    entries: Vec<Entry>,
    durable: bool,
) -> Result<Vec<u64>, StoreError> {
    let mut write = store.begin_write()?;
    write.set_durable(durable)?;
    let mut responses = Vec::with_capacity(entries.len());
    let mut last = None;
    for entry in entries {
        match &entry.payload {
            EntryPayload::Blank => responses.push(0),
            EntryPayload::Normal(batch) => {
                // A leader ran its own batches already: only their undo record goes.
                if !batch::forget(&mut write, batch)? {
                    // Another leadership's batch. Any batch this server still holds ahead
                    // of its commit can no longer commit (entries of its term that did
                    // were applied before this one, in log order): take them back first,
                    // so that this batch lands on the committed state.
                    if batch::has_undo(&write)? {
                        let taken = batch::take_back_all(&mut write)?;
                        tracing::warn!(
                            batches = taken.len(),
                            "a newer leader's entry arrived: took back batches not committed"
                        );
                    }
                    batch::apply(&mut write, batch)?;
                }
                responses.push(batch.txn);
            }
            EntryPayload::Membership(membership) => {
                let stored = StoredMembership::new(Some(entry.log_id), membership.clone());
                put_record(&mut write, KEY_MEMBERSHIP, &stored)?;
                responses.push(0);
            }
        }
        last = Some(entry.log_id);
    }
    if last.is_some() {
        put_record(&mut write, KEY_APPLIED, &last)?;
    }
    write.commit()?;
    Ok(responses)
}

/// Build a snapshot of the state as of the last applied entry. The leader's store also
/// holds batches not applied as committed yet: each key one of them changed is written
/// with the value it had before the oldest of them (their undo records, read in the same
/// transaction as the tables).
fn build(store: &RedbStore) -> Result<(SnapshotMeta, Vec<u8>), StoreError> {
    let read = store.begin_read()?;
    // Durable at least up to what is read: the log may be purged up to this snapshot
    // once it exists.
    let mut write = store.begin_write()?;
    write.set_durable(true)?;
    write.commit()?;
    let applied = read_record::<Option<LogId>, _>(&read, KEY_APPLIED)?.flatten();
    let membership: StoredMembership = read_record(&read, KEY_MEMBERSHIP)?.unwrap_or_default();
    let pairs = applied_pairs(&read)?;
    let body = SnapshotBody {
        applied,
        membership: membership.clone(),
        pairs,
    };
    let bytes = postcard::to_allocvec(&body).map_err(StoreError::backend)?;
    let snapshot_id = match applied {
        Some(log_id) => format!("{}-{}-{}", log_id.leader_id.term, log_id.index, bytes.len()),
        None => format!("empty-{}", bytes.len()),
    };
    let meta = SnapshotMeta {
        last_log_id: applied,
        last_membership: membership,
        snapshot_id,
    };
    Ok((meta, bytes))
}

/// Every pair of the replicated tables as of the last applied entry: the store's, except
/// that a key a batch not applied as committed yet changed (one with an undo record, read
/// in the same transaction) has the value from before the oldest such batch.
fn applied_pairs<R: StoreRead>(read: &R) -> Result<Vec<TablePair>, StoreError> {
    let mut before: HashMap<(u8, Vec<u8>), Option<Vec<u8>>> = HashMap::new();
    for (_, record) in read.range(
        TableId::Undo,
        Bound::Unbounded,
        Bound::Unbounded,
        usize::MAX,
    )? {
        for (table, key, value) in batch::undo_record(&record)?.before {
            before.entry((table, key)).or_insert(value);
        }
    }
    let mut pairs = Vec::new();
    for table in TableId::REPLICATED {
        let code = table.code();
        let mut overrides: BTreeMap<Vec<u8>, Option<Vec<u8>>> = before
            .iter()
            .filter(|((t, _), _)| *t == code)
            .map(|((_, key), value)| (key.clone(), value.clone()))
            .collect();
        for (key, value) in read.range(table, Bound::Unbounded, Bound::Unbounded, usize::MAX)? {
            match overrides.remove(&key) {
                Some(Some(old)) => pairs.push((code, key, old)),
                Some(None) => {}
                None => pairs.push((code, key, value)),
            }
        }
        // Keys a batch not applied yet deleted.
        for (key, value) in overrides {
            if let Some(value) = value {
                pairs.push((code, key, value));
            }
        }
    }
    Ok(pairs)
}

/// What a replica holds as of its last applied entry: that entry's log id, the number of
/// pairs of the replicated tables and a digest of them (key order). Equal digests at the
/// same applied entry: identical replicas.
pub fn replicated_digest(store: &RedbStore) -> Result<(Option<LogId>, u64, u64), StoreError> {
    use std::hash::{Hash, Hasher};
    let read = store.begin_read()?;
    let applied = read_record::<Option<LogId>, _>(&read, KEY_APPLIED)?.flatten();
    let mut pairs = applied_pairs(&read)?;
    pairs.sort();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    pairs.hash(&mut hasher);
    Ok((applied, pairs.len() as u64, hasher.finish()))
}

/// Replace the whole state with a snapshot's.
fn install(store: &RedbStore, meta: &SnapshotMeta, bytes: &[u8]) -> Result<(), StoreError> {
    let body: SnapshotBody = postcard::from_bytes(bytes).map_err(|error| StoreError::Corrupt {
        table: "snapshot",
        reason: error.to_string(),
    })?;
    let mut write = store.begin_write()?;
    write.set_durable(true)?;
    for table in TableId::REPLICATED {
        write.clear_table(table)?;
    }
    write.clear_table(TableId::Undo)?;
    for (code, key, value) in &body.pairs {
        let table = TableId::from_code(*code)
            .filter(|table| TableId::REPLICATED.contains(table))
            .ok_or_else(|| StoreError::Corrupt {
                table: "snapshot",
                reason: format!("pair of table {code}, which is not replicated"),
            })?;
        write.apply_raw(table, key, Some(value))?;
    }
    put_record(&mut write, KEY_APPLIED, &meta.last_log_id)?;
    put_record(&mut write, KEY_MEMBERSHIP, &meta.last_membership)?;
    write.commit()
}

async fn blocking<T: Send + 'static>(
    verb: ErrorVerb,
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StorageError<NodeId>> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| sm_error(verb, error))?
        .map_err(|error| sm_error(verb, error))
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError<NodeId>> {
        let store = self.store.clone();
        let (meta, bytes) = blocking(ErrorVerb::Read, move || build(&store)).await?;
        tracing::debug!(last_log_id = ?meta.last_log_id, bytes = bytes.len(), "built a snapshot");
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((meta.clone(), bytes.clone()));
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId>, StoredMembership), StorageError<NodeId>> {
        let store = self.store.clone();
        blocking(ErrorVerb::Read, move || applied_state(&store)).await
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<u64>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let store = self.store.clone();
        let durable = self.durable_due();
        blocking(ErrorVerb::Write, move || {
            apply_entries(&store, entries, durable)
        })
        .await
    }

    async fn get_snapshot_builder(&mut self) -> StateMachine {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = snapshot.into_inner();
        let store = self.store.clone();
        let installed_meta = meta.clone();
        let kept = bytes.clone();
        blocking(ErrorVerb::Write, move || {
            install(&store, &installed_meta, &kept)
        })
        .await?;
        tracing::info!(
            last_log_id = ?meta.last_log_id,
            bytes = bytes.len(),
            "installed a snapshot from the leader"
        );
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some((meta.clone(), bytes));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError<NodeId>> {
        let current = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(current.map(|(meta, bytes)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;
    use crate::raft::batch::Batch;
    use crate::store::{StoreWrite, TableId};

    fn entry(term: u64, index: u64, batch: Batch) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(batch),
        }
    }

    fn value(store: &RedbStore, key: &[u8]) -> Option<Vec<u8>> {
        store
            .begin_read()
            .unwrap()
            .get(TableId::Inodes, key)
            .unwrap()
    }

    /// A deposed leader ran a batch ahead of its commit; the new leader's committed entry
    /// changes the same key. Applying that entry takes the batch back first, so the entry
    /// lands on the committed state, and a later take-back finds nothing to undo.
    #[test]
    fn another_leaders_entry_takes_back_what_was_not_committed_first() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(&dir.path().join("s.redb")).unwrap();
        // Committed state: X = v0.
        apply_entries(
            &store,
            vec![entry(
                1,
                1,
                Batch {
                    origin: 5,
                    txn: 10,
                    changes: vec![(
                        TableId::Inodes.code(),
                        b"xxxxxxxxX".to_vec(),
                        Some(b"v0".to_vec()),
                    )],
                },
            )],
            false,
        )
        .unwrap();
        // This server, leading term 2 as origin 7, runs txn 11 ahead of its commit: X = v1,
        // Y = y1.
        let mut write = store.begin_write().unwrap();
        write.capture();
        write.put(TableId::Inodes, b"xxxxxxxxX", b"v1").unwrap();
        write.put(TableId::Inodes, b"xxxxxxxxY", b"y1").unwrap();
        let changes = write.take_changes();
        batch::remember(&mut write, 7, 11, &changes).unwrap();
        write.commit().unwrap();
        // The new leader (origin 9, term 3) commits its own txn 11: X = v2.
        apply_entries(
            &store,
            vec![entry(
                3,
                2,
                Batch {
                    origin: 9,
                    txn: 11,
                    changes: vec![(
                        TableId::Inodes.code(),
                        b"xxxxxxxxX".to_vec(),
                        Some(b"v2".to_vec()),
                    )],
                },
            )],
            false,
        )
        .unwrap();
        assert_eq!(value(&store, b"xxxxxxxxX"), Some(b"v2".to_vec()));
        assert_eq!(value(&store, b"xxxxxxxxY"), None);
        let mut write = store.begin_write().unwrap();
        assert!(batch::take_back_all(&mut write).unwrap().is_empty());
        write.commit().unwrap();
        assert_eq!(value(&store, b"xxxxxxxxX"), Some(b"v2".to_vec()));
        let (applied, _) = applied_state(&store).unwrap();
        assert_eq!(applied.map(|log_id| log_id.index), Some(2));
    }

    /// This server's own committed batch only loses its undo record.
    #[test]
    fn an_own_entry_is_not_applied_twice() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(&dir.path().join("s.redb")).unwrap();
        let mut write = store.begin_write().unwrap();
        write.capture();
        write.put(TableId::Inodes, b"xxxxxxxxX", b"v1").unwrap();
        let changes = write.take_changes();
        batch::remember(&mut write, 7, 11, &changes).unwrap();
        write.commit().unwrap();
        // Later in the same leadership (not replicated yet): X = v3.
        let mut write = store.begin_write().unwrap();
        write.capture();
        write.put(TableId::Inodes, b"xxxxxxxxX", b"v3").unwrap();
        let later = write.take_changes();
        batch::remember(&mut write, 7, 12, &later).unwrap();
        write.commit().unwrap();
        // Txn 11 commits: applying it again would set X back to v1.
        apply_entries(
            &store,
            vec![entry(2, 1, Batch::new(7, 11, &changes))],
            false,
        )
        .unwrap();
        assert_eq!(value(&store, b"xxxxxxxxX"), Some(b"v3".to_vec()));
    }
}
