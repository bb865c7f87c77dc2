//! The namespace in redb as openraft's state machine.
//!
//! A follower applies each committed batch by setting the keys it changed (`batch.rs`).
//! The leader ran its batches already, ahead of their commit: applying one of its own
//! entries only forgets the batch's undo record. The last applied log id and the
//! membership live in the `RaftState` table (`applied.rs`), changed in the same
//! transaction as what they describe, so the store never claims more or less than it holds.
//!
//! Applying commits without an fsync but once a second: the Raft log is the durable copy.
//! After a crash redb comes back at its last durable commit, with the applied log id of
//! that moment, and openraft applies the rest (at most a second's worth) from the log.
//! Building a snapshot makes the store durable first, so the log is never purged past
//! what the store durably holds.
//!
//! Snapshots are files, built and installed as streams (`snapshot.rs`); the state machine
//! keeps the path of the last one, never its bytes.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::{EntryPayload, ErrorSubject, ErrorVerb, StorageError};

use crate::raft::applied::{applied_state, put_membership, put_record, KEY_APPLIED};
use crate::raft::batch;
use crate::raft::log_store::storage_error;
use crate::raft::snapshot::{self, SnapshotFiles};
use crate::raft::types::{
    Entry, LogId, NodeId, Snapshot, SnapshotData, SnapshotMeta, StoredMembership, TypeConfig,
};
use crate::store::{MetaStore, RedbStore, StoreError, StoreWrite};

fn sm_error(verb: ErrorVerb, error: impl std::fmt::Display) -> StorageError<NodeId> {
    storage_error(ErrorSubject::StateMachine, verb, error)
}

/// The last snapshot: its description and its file.
type Kept = (SnapshotMeta, PathBuf);

/// The state machine; clones share the store, the snapshot files and the last snapshot.
#[derive(Clone)]
pub struct StateMachine {
    store: Arc<RedbStore>,
    files: Arc<SnapshotFiles>,
    current: Arc<Mutex<Option<Kept>>>,
    /// When applying last made the store durable.
    last_durable: Arc<Mutex<std::time::Instant>>,
}

impl StateMachine {
    pub fn new(store: Arc<RedbStore>, files: SnapshotFiles) -> StateMachine {
        StateMachine {
            store,
            files: Arc::new(files),
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

    /// Keep `path` as the last snapshot; the one it replaces is removed (a sender that
    /// opened it reads on: the file lives until it is closed).
    fn keep(&self, meta: SnapshotMeta, path: PathBuf) {
        let replaced = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace((meta, path));
        if let Some((_, old)) = replaced {
            self.files.remove(&old);
        }
    }
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
                put_membership(&mut write, &stored)?;
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

async fn blocking<T: Send + 'static>(
    verb: ErrorVerb,
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StorageError<NodeId>> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| sm_error(verb, error))?
        .map_err(|error| sm_error(verb, error))
}

/// Open a snapshot file for openraft to read (sending it) or write (receiving it).
async fn open_data(path: &std::path::Path) -> Result<Box<SnapshotData>, StorageError<NodeId>> {
    let file = tokio::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .await
        .map_err(|error| sm_error(ErrorVerb::Read, format!("{}: {error}", path.display())))?;
    Ok(Box::new(SnapshotData::new(file, path.to_path_buf())))
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError<NodeId>> {
        let store = self.store.clone();
        let files = self.files.clone();
        let (meta, path, length) = blocking(ErrorVerb::Read, move || files.build(&store)).await?;
        tracing::debug!(last_log_id = ?meta.last_log_id, bytes = length, "built a snapshot");
        let snapshot = open_data(&path).await?;
        self.keep(meta.clone(), path);
        Ok(Snapshot { meta, snapshot })
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
    ) -> Result<Box<SnapshotData>, StorageError<NodeId>> {
        let (path, file) = self
            .files
            .incoming()
            .map_err(|error| sm_error(ErrorVerb::Write, format!("a snapshot file: {error}")))?;
        Ok(Box::new(SnapshotData::new(
            tokio::fs::File::from_std(file),
            path,
        )))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<SnapshotData>,
    ) -> Result<(), StorageError<NodeId>> {
        let path = snapshot.path().to_path_buf();
        // Every chunk written reaches the file before it is read through.
        snapshot
            .sync()
            .await
            .map_err(|error| sm_error(ErrorVerb::Write, format!("{}: {error}", path.display())))?;
        drop(snapshot);
        let store = self.store.clone();
        let installed_meta = meta.clone();
        let reading = path.clone();
        let installed = blocking(ErrorVerb::Write, move || {
            snapshot::install(&store, &installed_meta, &reading)
        })
        .await;
        let pairs = match installed {
            Ok(pairs) => pairs,
            Err(error) => {
                self.files.remove(&path);
                return Err(error);
            }
        };
        tracing::info!(
            last_log_id = ?meta.last_log_id,
            pairs,
            "installed a snapshot from the leader"
        );
        self.keep(meta.clone(), path);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError<NodeId>> {
        let current = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match current {
            Some((meta, path)) => Ok(Some(Snapshot {
                meta,
                snapshot: open_data(&path).await?,
            })),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;
    use crate::raft::batch::Batch;
    use crate::store::{StoreRead, TableId};

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
