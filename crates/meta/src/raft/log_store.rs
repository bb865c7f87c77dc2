//! The Raft log and vote, in their own redb file beside the namespace (`raft-log.redb`).
//!
//! Every append is one durable redb commit (one fsync for however many entries openraft
//! hands over at once: the leader's batches and a follower's replicated run of them), and
//! openraft is told the entries are on disk only after it. The vote is saved the same way
//! before it is returned, as Raft requires. Entries are encoded with postcard.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{AnyError, ErrorSubject, ErrorVerb, StorageError, StorageIOError};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

use crate::raft::types::{Entry, LogId, NodeId, TypeConfig, Vote};

/// Name of the log file inside the data directory.
pub const LOG_FILE_NAME: &str = "raft-log.redb";

const ENTRIES: TableDefinition<'static, u64, &'static [u8]> = TableDefinition::new("entries");
const STATE: TableDefinition<'static, &'static str, &'static [u8]> = TableDefinition::new("state");

const KEY_VOTE: &str = "vote";
const KEY_PURGED: &str = "last_purged";
const KEY_COMMITTED: &str = "committed";
/// The layout of what the log holds. 2: members carry their client address (`MetaNode`).
/// A log without it was written with members as Raft addresses alone (layout 1), which
/// this version cannot read.
const KEY_FORMAT: &str = "format";
const FORMAT: u32 = 2;

/// A storage error of openraft's kind about `subject`.
pub fn storage_error(
    subject: ErrorSubject<NodeId>,
    verb: ErrorVerb,
    error: impl std::fmt::Display,
) -> StorageError<NodeId> {
    StorageError::IO {
        source: StorageIOError::new(subject, verb, AnyError::error(error.to_string())),
    }
}

fn logs_error(verb: ErrorVerb, error: impl std::fmt::Display) -> StorageError<NodeId> {
    storage_error(ErrorSubject::Logs, verb, error)
}

fn vote_error(verb: ErrorVerb, error: impl std::fmt::Display) -> StorageError<NodeId> {
    storage_error(ErrorSubject::Vote, verb, error)
}

/// Memory redb may use to cache the log's pages. The log is written once and read back
/// in order by replication to a follower behind, so a small cache does; redb's default
/// (1 GiB) filled up as the log grew and was most of a member's resident memory.
const LOG_CACHE_BYTES: usize = 32 << 20;

/// The log store; clones share the file (the reader openraft's replication tasks use).
#[derive(Clone)]
pub struct LogStore {
    database: Arc<Database>,
    /// Most bytes of entries one replication read returns (the Raft message bound).
    read_bytes_max: Arc<std::sync::atomic::AtomicUsize>,
}

impl LogStore {
    pub fn open(path: &Path) -> Result<LogStore, String> {
        let database = Database::builder()
            .set_cache_size(LOG_CACHE_BYTES)
            .create(path)
            .map_err(|e| e.to_string())?;
        let write = database.begin_write().map_err(|e| e.to_string())?;
        {
            let entries = write.open_table(ENTRIES).map_err(|e| e.to_string())?;
            let mut state = write.open_table(STATE).map_err(|e| e.to_string())?;
            let format: Option<u32> = match state.get(KEY_FORMAT).map_err(|e| e.to_string())? {
                Some(value) => Some(
                    postcard::from_bytes(value.value())
                        .map_err(|e| format!("raft log state {KEY_FORMAT}: {e}"))?,
                ),
                None => None,
            };
            let used = entries.first().map_err(|e| e.to_string())?.is_some()
                || state.get(KEY_VOTE).map_err(|e| e.to_string())?.is_some();
            match format {
                Some(FORMAT) => {}
                None if !used => {
                    let bytes = postcard::to_allocvec(&FORMAT).map_err(|e| e.to_string())?;
                    state
                        .insert(KEY_FORMAT, bytes.as_slice())
                        .map_err(|e| e.to_string())?;
                }
                found => {
                    return Err(format!(
                        "it holds layout {} and this version reads layout {FORMAT} only \
                         (members with their client addresses); rebuild this member from \
                         empty under a new node_id (docs/operations.md)",
                        found.unwrap_or(1)
                    ))
                }
            }
        }
        write.commit().map_err(|e| e.to_string())?;
        Ok(LogStore {
            database: Arc::new(database),
            read_bytes_max: Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX)),
        })
    }

    fn read_state<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<Option<T>, String> {
        let read = self.database.begin_read().map_err(|e| e.to_string())?;
        let table = read.open_table(STATE).map_err(|e| e.to_string())?;
        let Some(value) = table.get(key).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        postcard::from_bytes(value.value())
            .map(Some)
            .map_err(|e| format!("raft log state {key}: {e}"))
    }

    /// Run one durable write transaction on a blocking thread.
    async fn write<F>(&self, work: F) -> Result<(), String>
    where
        F: FnOnce(&redb::WriteTransaction) -> Result<(), String> + Send + 'static,
    {
        self.write_with(Durability::Immediate, work).await
    }

    async fn write_with<F>(&self, durability: Durability, work: F) -> Result<(), String>
    where
        F: FnOnce(&redb::WriteTransaction) -> Result<(), String> + Send + 'static,
    {
        let database = self.database.clone();
        tokio::task::spawn_blocking(move || {
            let mut write = database.begin_write().map_err(|e| e.to_string())?;
            write
                .set_durability(durability)
                .map_err(|e| e.to_string())?;
            work(&write)?;
            write.commit().map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    fn put_state<T: serde::Serialize>(
        write: &redb::WriteTransaction,
        key: &str,
        value: &T,
    ) -> Result<(), String> {
        let encoded = postcard::to_allocvec(value).map_err(|e| e.to_string())?;
        let mut table = write.open_table(STATE).map_err(|e| e.to_string())?;
        table
            .insert(key, encoded.as_slice())
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Write entries durably (one fsync), each under its index.
    async fn put_entries(&self, entries: Vec<Entry>) -> Result<(), String> {
        let mut encoded = Vec::with_capacity(entries.len());
        for entry in &entries {
            let bytes = postcard::to_allocvec(entry).map_err(|e| e.to_string())?;
            encoded.push((entry.log_id.index, bytes));
        }
        self.write(move |write| {
            let mut table = write.open_table(ENTRIES).map_err(|e| e.to_string())?;
            for (index, bytes) in &encoded {
                table
                    .insert(*index, bytes.as_slice())
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })
        .await
    }

    fn entries_in(&self, start: Bound<u64>, end: Bound<u64>) -> Result<Vec<Entry>, String> {
        self.entries_bounded(start, end, usize::MAX)
    }

    /// The bytes of the stored entries after `after` through `through` (what a follower
    /// that matched `after` is behind); reads only their lengths.
    pub fn bytes_between(&self, after: u64, through: u64) -> Result<u64, String> {
        let read = self.database.begin_read().map_err(|e| e.to_string())?;
        let table = read.open_table(ENTRIES).map_err(|e| e.to_string())?;
        let mut bytes = 0u64;
        if after >= through {
            return Ok(0);
        }
        for item in table
            .range((Bound::Excluded(after), Bound::Included(through)))
            .map_err(|e| e.to_string())?
        {
            let (_, value) = item.map_err(|e| e.to_string())?;
            bytes += value.value().len() as u64;
        }
        Ok(bytes)
    }

    /// Bound what one replication read returns (`raft_message_bytes_max`): openraft sends
    /// what it reads in one append.
    pub fn set_read_bytes_max(&self, bytes: usize) {
        self.read_bytes_max
            .store(bytes.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The entries between `start` and `end`, in order, as many as fit
    /// in `bytes_max` stored bytes, and at least the first.
    fn entries_bounded(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
        bytes_max: usize,
    ) -> Result<Vec<Entry>, String> {
        let read = self.database.begin_read().map_err(|e| e.to_string())?;
        let table = read.open_table(ENTRIES).map_err(|e| e.to_string())?;
        let mut entries = Vec::new();
        let mut bytes = 0usize;
        for item in table.range((start, end)).map_err(|e| e.to_string())? {
            let (index, value) = item.map_err(|e| e.to_string())?;
            let stored = value.value();
            if !entries.is_empty() && bytes.saturating_add(stored.len()) > bytes_max {
                break;
            }
            bytes += stored.len();
            let entry: Entry = postcard::from_bytes(stored)
                .map_err(|e| format!("raft log entry {}: {e}", index.value()))?;
            entries.push(entry);
        }
        Ok(entries)
    }

    /// Nothing was ever appended (or installed): a new member, or one whose disk was lost.
    pub fn is_empty(&self) -> Result<bool, String> {
        let purged: Option<LogId> = self.read_state(KEY_PURGED)?;
        Ok(purged.is_none() && self.last_entry_id()?.is_none())
    }

    fn last_entry_id(&self) -> Result<Option<LogId>, String> {
        let read = self.database.begin_read().map_err(|e| e.to_string())?;
        let table = read.open_table(ENTRIES).map_err(|e| e.to_string())?;
        let Some(last) = table.last().map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let entry: Entry = postcard::from_bytes(last.1.value())
            .map_err(|e| format!("raft log entry {}: {e}", last.0.value()))?;
        Ok(Some(entry.log_id))
    }
}

fn owned<R: RangeBounds<u64>>(range: &R) -> (Bound<u64>, Bound<u64>) {
    (range.start_bound().cloned(), range.end_bound().cloned())
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError<NodeId>> {
        let (start, end) = owned(&range);
        self.entries_in(start, end)
            .map_err(|e| logs_error(ErrorVerb::Read, e))
    }

    /// What replication sends in one append: entries bounded by bytes as well as by
    /// `max_payload_entries` (a follower far behind is sent large batches; all of them at
    /// once passed the receiver's frame bound, 168 MB once, and the leader held them all
    /// decoded in memory).
    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry>, StorageError<NodeId>> {
        let bytes_max = self
            .read_bytes_max
            .load(std::sync::atomic::Ordering::Relaxed);
        self.entries_bounded(Bound::Included(start), Bound::Excluded(end), bytes_max)
            .map_err(|e| logs_error(ErrorVerb::Read, e))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let last_purged_log_id: Option<LogId> = self
            .read_state(KEY_PURGED)
            .map_err(|e| logs_error(ErrorVerb::Read, e))?;
        let last = self
            .last_entry_id()
            .map_err(|e| logs_error(ErrorVerb::Read, e))?;
        Ok(LogState {
            last_purged_log_id,
            last_log_id: last.or(last_purged_log_id),
        })
    }

    async fn get_log_reader(&mut self) -> LogStore {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError<NodeId>> {
        let vote = *vote;
        self.write(move |write| LogStore::put_state(write, KEY_VOTE, &vote))
            .await
            .map_err(|e| vote_error(ErrorVerb::Write, e))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError<NodeId>> {
        self.read_state(KEY_VOTE)
            .map_err(|e| vote_error(ErrorVerb::Read, e))
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId>,
    ) -> Result<(), StorageError<NodeId>> {
        // Not fsynced on its own (openraft saves it at every commit): the next append
        // makes it durable. A crash may bring back an older one, which only means that
        // fewer entries are applied again at start-up before the leader tells the rest.
        self.write_with(Durability::None, move |write| {
            LogStore::put_state(write, KEY_COMMITTED, &committed)
        })
        .await
        .map_err(|e| logs_error(ErrorVerb::Write, e))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError<NodeId>> {
        Ok(self
            .read_state::<Option<LogId>>(KEY_COMMITTED)
            .map_err(|e| logs_error(ErrorVerb::Read, e))?
            .flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let outcome = self.put_entries(entries.into_iter().collect()).await;
        match outcome {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(error) => {
                callback.log_io_completed(Err(std::io::Error::other(error.clone())));
                Err(logs_error(ErrorVerb::Write, error))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError<NodeId>> {
        self.write(move |write| {
            let mut table = write.open_table(ENTRIES).map_err(|e| e.to_string())?;
            table
                .retain_in(log_id.index.., |_, _| false)
                .map_err(|e| e.to_string())?;
            Ok(())
        })
        .await
        .map_err(|e| logs_error(ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError<NodeId>> {
        self.write(move |write| {
            LogStore::put_state(write, KEY_PURGED, &log_id)?;
            let mut table = write.open_table(ENTRIES).map_err(|e| e.to_string())?;
            table
                .retain_in(..=log_id.index, |_, _| false)
                .map_err(|e| e.to_string())?;
            Ok(())
        })
        .await
        .map_err(|e| logs_error(ErrorVerb::Delete, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};

    fn entry(term: u64, index: u64) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Blank,
        }
    }

    /// What the log reports after appends, a purge and a truncation, and after reopening.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purged_and_last_ids_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.redb");
        {
            let mut store = LogStore::open(&path).unwrap();
            let entries: Vec<Entry> = (1..=10).map(|index| entry(2, index)).collect();
            store.put_entries(entries).await.unwrap();
            store.purge(entry(2, 4).log_id).await.unwrap();
            store.truncate(entry(2, 9).log_id).await.unwrap();
            store
                .save_committed(Some(entry(2, 8).log_id))
                .await
                .unwrap();
            store.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
        }
        let mut store = LogStore::open(&path).unwrap();
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(entry(2, 4).log_id));
        assert_eq!(state.last_log_id, Some(entry(2, 8).log_id));
        assert_eq!(
            store.read_committed().await.unwrap(),
            Some(entry(2, 8).log_id)
        );
        assert_eq!(
            store.read_vote().await.unwrap(),
            Some(Vote::new_committed(2, 1))
        );
        let left = store.try_get_log_entries(0..100).await.unwrap();
        let indexes: Vec<u64> = left.iter().map(|e| e.log_id.index).collect();
        assert_eq!(indexes, vec![5, 6, 7, 8]);
    }

    /// A replication read returns a prefix of the range within the byte bound, never
    /// nothing: openraft sends what it reads in one append.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replication_reads_are_bounded_by_bytes_and_never_empty() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open(&dir.path().join("log.redb")).unwrap();
        let big = |index: u64| Entry {
            log_id: LogId::new(CommittedLeaderId::new(2, 1), index),
            payload: EntryPayload::Normal(crate::raft::batch::Batch {
                origin: 1,
                txn: index,
                changes: vec![(1, vec![index as u8; 8], Some(vec![7; 10_000]))],
            }),
        };
        store
            .put_entries((1..=50).map(big).collect())
            .await
            .unwrap();
        let whole = store.limited_get_log_entries(1, 51).await.unwrap();
        assert_eq!(whole.len(), 50, "unbounded until a bound is set");
        store.set_read_bytes_max(35_000);
        let first = store.limited_get_log_entries(1, 51).await.unwrap();
        let indexes: Vec<u64> = first.iter().map(|e| e.log_id.index).collect();
        assert_eq!(
            indexes,
            vec![1, 2, 3],
            "three entries of about 10 KB fit in 35,000 bytes"
        );
        store.set_read_bytes_max(1);
        let one = store.limited_get_log_entries(7, 51).await.unwrap();
        assert_eq!(one.len(), 1, "an entry larger than the bound goes alone");
        assert_eq!(one[0].log_id.index, 7);
    }

    /// Prints what a log holds: `FREEFLOW_RAFT_LOG=path cargo test -p freeflow-meta
    /// print_a_raft_log -- --ignored --nocapture` (for looking at a failed member).
    #[tokio::test]
    #[ignore]
    async fn print_a_raft_log() {
        let Ok(path) = std::env::var("FREEFLOW_RAFT_LOG") else {
            return;
        };
        let mut store = LogStore::open(Path::new(&path)).unwrap();
        println!("state: {:?}", store.get_log_state().await.unwrap());
        println!("vote: {:?}", store.read_vote().await.unwrap());
        println!("committed: {:?}", store.read_committed().await.unwrap());
        let entries = store
            .entries_in(Bound::Unbounded, Bound::Unbounded)
            .unwrap();
        println!(
            "{} entries, first {:?}, last {:?}",
            entries.len(),
            entries.first().map(|e| e.log_id),
            entries.last().map(|e| e.log_id)
        );
        let mut previous: Option<u64> = None;
        for entry in &entries {
            if let Some(previous) = previous {
                if entry.log_id.index != previous + 1 {
                    println!("hole after {previous}: next {}", entry.log_id.index);
                }
            }
            previous = Some(entry.log_id.index);
        }
    }
}
