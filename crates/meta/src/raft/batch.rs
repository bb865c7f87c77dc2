//! A batch as the Raft log carries it, and how a server applies it or takes it back.
//!
//! The leader runs a batch of mutations in one write transaction as a single server does
//! (`writer/`), with the transaction recording every change and the value it replaced
//! ([`Change`]). The changes, in order, become the batch's log entry ([`Batch`]): a
//! follower applies the entry by setting the same keys to the same values, so no
//! operation needs to be deterministic and a follower never runs one. The replaced values
//! go to the `Undo` table in the same transaction, keyed by the batch's transaction number:
//! until the entry is committed the leader can take the batch back exactly (its entry may
//! be lost when it is deposed), and a crash leaves the undo record beside the changes it
//! undoes.

use std::ops::Bound;

use serde::{Deserialize, Serialize};

use crate::store::{Change, RedbWrite, StoreError, StoreRead, TableId};

/// One replicated batch: the leadership that ran it (a random number per leader and
/// term, `RaftLink::origin`), the transaction number it gave it and its changes in order
/// (table code, key, new value or None for a deletion).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub origin: u64,
    pub txn: u64,
    pub changes: Vec<(u8, Vec<u8>, Option<Vec<u8>>)>,
}

impl Batch {
    pub fn new(origin: u64, txn: u64, changes: &[Change]) -> Batch {
        Batch {
            origin,
            txn,
            changes: changes
                .iter()
                .map(|change| (change.table, change.key.clone(), change.value.clone()))
                .collect(),
        }
    }
}

fn table_of(code: u8) -> Result<TableId, StoreError> {
    TableId::from_code(code)
        .filter(|table| TableId::REPLICATED.contains(table))
        .ok_or_else(|| StoreError::Corrupt {
            table: "raft log",
            reason: format!("change names table {code}, which is not replicated"),
        })
}

/// Apply a batch another server ran: set every key it changed, in order.
pub fn apply(write: &mut RedbWrite, batch: &Batch) -> Result<(), StoreError> {
    for (code, key, value) in &batch.changes {
        write.apply_raw(table_of(*code)?, key, value.as_deref())?;
    }
    Ok(())
}

/// The undo record of a batch: the leadership that ran it, and the before-images of its
/// changes in their order (table code, key, value before or None).
#[derive(Serialize, Deserialize)]
pub struct UndoRecord {
    pub origin: u64,
    pub before: Vec<(u8, Vec<u8>, Option<Vec<u8>>)>,
}

/// Decode an undo record.
pub fn undo_record(encoded: &[u8]) -> Result<UndoRecord, StoreError> {
    postcard::from_bytes(encoded).map_err(|error| StoreError::Corrupt {
        table: "undo",
        reason: error.to_string(),
    })
}

/// Keep what `changes` replaced, so the batch `txn` run by leadership `origin` can be
/// taken back. A transaction number is never given twice by one leadership: an undo
/// record already there is a bug, refused rather than overwritten.
pub fn remember(
    write: &mut RedbWrite,
    origin: u64,
    txn: u64,
    changes: &[Change],
) -> Result<(), StoreError> {
    let key = txn.to_be_bytes();
    if write.get(TableId::Undo, &key)?.is_some() {
        return Err(StoreError::Corrupt {
            table: "undo",
            reason: format!("transaction {txn} has an undo record already"),
        });
    }
    let record = UndoRecord {
        origin,
        before: changes
            .iter()
            .map(|change| (change.table, change.key.clone(), change.before.clone()))
            .collect(),
    };
    let encoded = postcard::to_allocvec(&record).map_err(StoreError::backend)?;
    write.apply_raw(TableId::Undo, &key, Some(&encoded))
}

/// The committed `batch` is one this server ran ahead of its commit (an undo record of
/// the same transaction and leadership): forget the record and say so. False: the batch
/// is another leadership's, to be applied.
pub fn forget(write: &mut RedbWrite, batch: &Batch) -> Result<bool, StoreError> {
    let key = batch.txn.to_be_bytes();
    let Some(encoded) = write.get(TableId::Undo, &key)? else {
        return Ok(false);
    };
    if undo_record(&encoded)?.origin != batch.origin {
        return Ok(false);
    }
    write.apply_raw(TableId::Undo, &key, None)?;
    Ok(true)
}

/// Whether any batch run ahead of its commit is still to be committed or taken back.
pub fn has_undo(write: &RedbWrite) -> Result<bool, StoreError> {
    Ok(!write
        .range_keys(TableId::Undo, Bound::Unbounded, Bound::Unbounded, 1)?
        .is_empty())
}

/// Take back every batch with an undo record, newest first: what is left is the state of
/// the last batch applied as committed. Returns the transactions taken back.
pub fn take_back_all(write: &mut RedbWrite) -> Result<Vec<u64>, StoreError> {
    let records = write.range(
        TableId::Undo,
        Bound::Unbounded,
        Bound::Unbounded,
        usize::MAX,
    )?;
    let mut taken = Vec::with_capacity(records.len());
    for (key, encoded) in records.iter().rev() {
        let txn =
            u64::from_be_bytes(key.as_slice().try_into().map_err(|_| StoreError::Corrupt {
                table: "undo",
                reason: format!("key of {} bytes", key.len()),
            })?);
        let record = undo_record(encoded)?;
        for (code, key, before) in record.before.iter().rev() {
            write.apply_raw(table_of(*code)?, key, before.as_deref())?;
        }
        write.apply_raw(TableId::Undo, key, None)?;
        taken.push(txn);
    }
    Ok(taken)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::{MetaStore, RedbStore, StoreWrite};

    /// Every pair of the replicated tables, for comparing stores.
    pub(crate) fn dump(store: &RedbStore) -> Vec<(u8, Vec<u8>, Vec<u8>)> {
        let read = store.begin_read().unwrap();
        let mut all = Vec::new();
        for table in TableId::REPLICATED {
            for (key, value) in read
                .range(table, Bound::Unbounded, Bound::Unbounded, usize::MAX)
                .unwrap()
            {
                all.push((table.code(), key, value));
            }
        }
        all
    }

    fn seed(store: &RedbStore) {
        let mut write = store.begin_write().unwrap();
        write.put(TableId::Inodes, b"aaaaaaaa1", b"one").unwrap();
        write.put(TableId::Dirents, b"bbbbbbbbx", b"two").unwrap();
        write.commit().unwrap();
    }

    fn mutate(write: &mut RedbWrite) {
        write
            .put(TableId::Inodes, b"aaaaaaaa1", b"one-changed")
            .unwrap();
        write
            .put(TableId::Inodes, b"aaaaaaaa1", b"one-again")
            .unwrap();
        write.delete(TableId::Dirents, b"bbbbbbbbx").unwrap();
        write.put(TableId::Counters, b"next", b"7").unwrap();
        write.delete(TableId::Counters, b"missing").unwrap();
    }

    #[test]
    fn a_follower_applying_the_batch_ends_with_the_leaders_tables() {
        let dir = tempfile::tempdir().unwrap();
        let leader = RedbStore::open(&dir.path().join("leader.redb")).unwrap();
        let follower = RedbStore::open(&dir.path().join("follower.redb")).unwrap();
        seed(&leader);
        seed(&follower);
        let mut write = leader.begin_write().unwrap();
        write.capture();
        mutate(&mut write);
        let changes = write.take_changes();
        // Deleting a missing key changes nothing and is not recorded.
        assert_eq!(changes.len(), 4);
        write.commit().unwrap();
        let batch = Batch::new(1, 5, &changes);
        let encoded = postcard::to_allocvec(&batch).unwrap();
        let batch: Batch = postcard::from_bytes(&encoded).unwrap();
        let mut write = follower.begin_write().unwrap();
        apply(&mut write, &batch).unwrap();
        write.commit().unwrap();
        assert_eq!(dump(&leader), dump(&follower));
    }

    #[test]
    fn taking_back_restores_every_key_in_reverse() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(&dir.path().join("s.redb")).unwrap();
        seed(&store);
        let before = dump(&store);
        for txn in [3u64, 4] {
            let mut write = store.begin_write().unwrap();
            write.capture();
            mutate(&mut write);
            write
                .put(TableId::Xattrs, &txn.to_be_bytes(), b"x")
                .unwrap();
            let changes = write.take_changes();
            remember(&mut write, 7, txn, &changes).unwrap();
            write.commit().unwrap();
        }
        assert_ne!(dump(&store), before);
        let mut write = store.begin_write().unwrap();
        assert_eq!(take_back_all(&mut write).unwrap(), vec![4, 3]);
        write.commit().unwrap();
        assert_eq!(dump(&store), before);
        let read = store.begin_read().unwrap();
        let undo = read
            .range(TableId::Undo, Bound::Unbounded, Bound::Unbounded, 10)
            .unwrap();
        assert!(undo.is_empty());
    }

    #[test]
    fn a_committed_batch_is_not_taken_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(&dir.path().join("s.redb")).unwrap();
        seed(&store);
        let mut write = store.begin_write().unwrap();
        write.capture();
        mutate(&mut write);
        let changes = write.take_changes();
        remember(&mut write, 7, 9, &changes).unwrap();
        assert!(remember(&mut write, 7, 9, &changes).is_err());
        write.commit().unwrap();
        let after = dump(&store);
        let mut write = store.begin_write().unwrap();
        // Another leadership's batch of the same number is not this one.
        assert!(!forget(&mut write, &Batch::new(8, 9, &changes)).unwrap());
        assert!(forget(&mut write, &Batch::new(7, 9, &changes)).unwrap());
        assert!(take_back_all(&mut write).unwrap().is_empty());
        write.commit().unwrap();
        assert_eq!(dump(&store), after);
    }

    #[test]
    fn a_change_to_an_unreplicated_table_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(&dir.path().join("s.redb")).unwrap();
        let mut write = store.begin_write().unwrap();
        let batch = Batch {
            origin: 1,
            txn: 1,
            changes: vec![(TableId::Undo.code(), b"k".to_vec(), None)],
        };
        assert!(apply(&mut write, &batch).is_err());
        let batch = Batch {
            origin: 1,
            txn: 1,
            changes: vec![(200, b"k".to_vec(), None)],
        };
        assert!(apply(&mut write, &batch).is_err());
    }
}
