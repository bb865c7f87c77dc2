//! The transactional key-value seam under the namespace.
//!
//! The namespace operations only need "get, put, delete and ordered range over byte keys,
//! inside a read or a write transaction", so that is all [`MetaStore`] offers: another
//! transactional KV (or a replicated state machine) can be plugged in behind the same seam
//! (DESIGN.md §2). [`RedbStore`] is the implementation over redb 4.
//!
//! Durability: a write transaction commits either durably (`Durability::Immediate`: one
//! fsync) or not (`Durability::None`: visible to readers at once, made durable by the next
//! durable commit, lost by a crash before it). The writer chooses per batch (`writer/`).
//! Quick repair is on, so an unclean shutdown does not force a scan of the whole file on
//! the next open.
//!
//! Both transaction kinds record the inodes they touch (through any table keyed by inode),
//! which is how the metadata server sees that a request reads or builds on another
//! client's change that is not durable yet (commit on share, `writer/`).

use std::cell::RefCell;
use std::ops::Bound;
use std::path::Path;

use freeflow_types::InodeId;

use redb::{
    Database, Durability, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable,
    TableDefinition, WriteTransaction,
};

/// The tables of the metadata store. Key and value formats are in `records.rs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableId {
    /// inode id (u64 BE) → versioned inode record (attributes, layout, parent).
    Inodes,
    /// (parent id u64 BE, name bytes) → child id + kind.
    Dirents,
    /// inode id → symlink target bytes.
    Symlinks,
    /// (inode id u64 BE, name bytes) → value.
    Xattrs,
    /// inode id → versioned orphan record (what the reaper needs to remove the data).
    Orphans,
    /// counter name → u64 BE.
    Counters,
    /// server id (u32 BE) → versioned server record.
    Servers,
    /// inode id → versioned truncation record (cuts still to be made on I/O servers).
    Truncations,
    /// (client id u64 BE, request id u64 BE) → versioned reply record: the reply to each
    /// applied mutation, so a mutation sent again is answered and never applied twice.
    Replies,
    /// (txn u64 BE, client id, request id) → empty: the reply records in the order they can
    /// be forgotten.
    ReplyExpiry,
    /// client id u64 BE → versioned client record: clients that may hold mutations not yet
    /// durable, waited for in the recovery window after a restart.
    Clients,
    /// Replicated metadata only (`raft/`): txn u64 BE → the before-images of a batch the
    /// leader applied ahead of its Raft commit, to take it back if the entry is lost.
    Undo,
    /// Replicated metadata only: name → the state machine's own records (last applied log
    /// id, membership), changed in the same transactions as what they describe.
    RaftState,
    /// sequence u64 BE → versioned replacement record: I/O servers lost for good and who
    /// takes their place in the chains (re-replication, `replacements.rs`).
    Replacements,
}

impl TableId {
    pub const ALL: [TableId; 14] = [
        TableId::Inodes,
        TableId::Dirents,
        TableId::Symlinks,
        TableId::Xattrs,
        TableId::Orphans,
        TableId::Counters,
        TableId::Servers,
        TableId::Truncations,
        TableId::Replies,
        TableId::ReplyExpiry,
        TableId::Clients,
        TableId::Undo,
        TableId::RaftState,
        TableId::Replacements,
    ];

    /// The tables a replicated batch changes and a snapshot carries: all but the state
    /// machine's own bookkeeping.
    pub const REPLICATED: [TableId; 12] = [
        TableId::Inodes,
        TableId::Dirents,
        TableId::Symlinks,
        TableId::Xattrs,
        TableId::Orphans,
        TableId::Counters,
        TableId::Servers,
        TableId::Truncations,
        TableId::Replies,
        TableId::ReplyExpiry,
        TableId::Clients,
        TableId::Replacements,
    ];

    /// The table's number in write-sets and snapshots (stable: it is on disk in Raft logs).
    pub fn code(self) -> u8 {
        match self {
            TableId::Inodes => 1,
            TableId::Dirents => 2,
            TableId::Symlinks => 3,
            TableId::Xattrs => 4,
            TableId::Orphans => 5,
            TableId::Counters => 6,
            TableId::Servers => 7,
            TableId::Truncations => 8,
            TableId::Replies => 9,
            TableId::ReplyExpiry => 10,
            TableId::Clients => 11,
            TableId::Undo => 12,
            TableId::RaftState => 13,
            TableId::Replacements => 14,
        }
    }

    pub fn from_code(code: u8) -> Option<TableId> {
        TableId::ALL.into_iter().find(|table| table.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            TableId::Inodes => "inodes",
            TableId::Dirents => "dirents",
            TableId::Symlinks => "symlinks",
            TableId::Xattrs => "xattrs",
            TableId::Orphans => "orphans",
            TableId::Counters => "counters",
            TableId::Servers => "servers",
            TableId::Truncations => "truncations",
            TableId::Replies => "replies",
            TableId::ReplyExpiry => "reply_expiry",
            TableId::Clients => "clients",
            TableId::Undo => "undo",
            TableId::RaftState => "raft_state",
            TableId::Replacements => "replacements",
        }
    }

    /// The inode a key of this table is about, for the tables keyed by inode (first 8
    /// bytes, big-endian).
    fn inode_of_key(self, key: &[u8]) -> Option<InodeId> {
        match self {
            TableId::Inodes
            | TableId::Dirents
            | TableId::Symlinks
            | TableId::Xattrs
            | TableId::Orphans
            | TableId::Truncations => {
                let prefix: [u8; 8] = key.get(..8)?.try_into().ok()?;
                Some(InodeId::from_be_bytes(prefix))
            }
            TableId::Counters
            | TableId::Servers
            | TableId::Replies
            | TableId::ReplyExpiry
            | TableId::Clients
            | TableId::Undo
            | TableId::RaftState
            | TableId::Replacements => None,
        }
    }

    fn definition(self) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
        TableDefinition::new(self.name())
    }
}

/// A failure of the storage layer itself (not a refused operation).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("metadata store I/O: {0}")]
    Backend(String),
    #[error("corrupt record in table {table}: {reason}")]
    Corrupt { table: &'static str, reason: String },
    #[error("metadata store is closed")]
    Closed,
}

impl StoreError {
    pub fn backend(error: impl std::fmt::Display) -> StoreError {
        StoreError::Backend(error.to_string())
    }
}

/// One key-value pair as returned by a range read.
pub type Pair = (Vec<u8>, Vec<u8>);

/// Reads, in a read or a write transaction.
pub trait StoreRead {
    fn get(&self, table: TableId, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// At most `limit` pairs with keys in `(start, end)`, in key order.
    fn range(
        &self,
        table: TableId,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Pair>, StoreError>;
    /// As `range`, keys only.
    fn range_keys(
        &self,
        table: TableId,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Vec<u8>>, StoreError>;
}

/// What a transaction read and changed, by inode (duplicates possible): for commit on
/// share (`inodes`) and for client cache leases (the rest; see `leases.rs`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Touches {
    /// Every inode read or changed through a table keyed by inode; `[TOUCHED_ALL]` when
    /// there were too many to keep.
    pub inodes: Vec<InodeId>,
    /// Directories whose entries were read.
    pub names_read: Vec<InodeId>,
    /// Inodes whose records were read.
    pub attributes_read: Vec<InodeId>,
    /// Entries changed: (directory, name).
    pub names_changed: Vec<(InodeId, String)>,
    /// Inodes whose records changed.
    pub attributes_changed: Vec<InodeId>,
    /// More was touched than kept: treat it as everything.
    pub overflowed: bool,
}

impl Touches {
    fn entries(&self) -> usize {
        self.inodes.len()
            + self.names_read.len()
            + self.attributes_read.len()
            + self.names_changed.len()
            + self.attributes_changed.len()
    }

    fn record(&mut self, table: TableId, key: &[u8], changed: bool) {
        let Some(inode) = table.inode_of_key(key) else {
            return;
        };
        if self.overflowed {
            return;
        }
        if self.entries() >= TOUCHED_INODES_MAX {
            *self = Touches {
                inodes: vec![TOUCHED_ALL],
                overflowed: true,
                ..Touches::default()
            };
            return;
        }
        self.inodes.push(inode);
        match (table, changed) {
            (TableId::Dirents, false) => self.names_read.push(inode),
            (TableId::Dirents, true) => {
                let name = String::from_utf8_lossy(key.get(8..).unwrap_or_default()).into_owned();
                self.names_changed.push((inode, name));
            }
            (TableId::Inodes, false) => self.attributes_read.push(inode),
            (TableId::Inodes, true) => self.attributes_changed.push(inode),
            _ => {}
        }
    }
}

/// The record of what a transaction touched so far.
pub trait TouchedInodes {
    fn take_touched(&self) -> Touches;
}

/// Writes; nothing is visible to readers before `commit`.
pub trait StoreWrite: StoreRead {
    fn put(&mut self, table: TableId, key: &[u8], value: &[u8]) -> Result<(), StoreError>;
    /// True if the key existed.
    fn delete(&mut self, table: TableId, key: &[u8]) -> Result<bool, StoreError>;
    /// Whether `commit` makes this transaction durable (default: yes).
    fn set_durable(&mut self, durable: bool) -> Result<(), StoreError>;
    /// Visible to readers when it returns Ok; durable too if so set.
    fn commit(self) -> Result<(), StoreError>;
    fn abort(self) -> Result<(), StoreError>;
}

/// A transactional ordered KV store with concurrent (MVCC) readers and one writer.
pub trait MetaStore: Send + Sync + 'static {
    type Read: StoreRead;
    type Write: StoreWrite;
    fn begin_read(&self) -> Result<Self::Read, StoreError>;
    fn begin_write(&self) -> Result<Self::Write, StoreError>;
}

/// [`MetaStore`] over one redb file.
pub struct RedbStore {
    database: Database,
}

impl RedbStore {
    /// Open (or create) the store at `path` and make sure every table exists. Never scans.
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        RedbStore::open_with_cache(path, 64 << 20)
    }

    /// As [`RedbStore::open`], with a page cache of `cache_bytes`.
    pub fn open_with_cache(path: &Path, cache_bytes: usize) -> Result<RedbStore, StoreError> {
        let database = Database::builder()
            .set_cache_size(cache_bytes)
            .create(path)
            .map_err(StoreError::backend)?;
        let store = RedbStore { database };
        let write = store.begin_write()?;
        for table in TableId::ALL {
            write
                .transaction
                .open_table(table.definition())
                .map_err(StoreError::backend)?;
        }
        write.commit()?;
        Ok(store)
    }
}

impl MetaStore for RedbStore {
    type Read = RedbRead;
    type Write = RedbWrite;

    fn begin_read(&self) -> Result<RedbRead, StoreError> {
        let transaction = self.database.begin_read().map_err(StoreError::backend)?;
        Ok(RedbRead {
            transaction,
            opened: RefCell::default(),
            touched: RefCell::default(),
        })
    }

    fn begin_write(&self) -> Result<RedbWrite, StoreError> {
        let mut transaction = self.database.begin_write().map_err(StoreError::backend)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(StoreError::backend)?;
        transaction.set_quick_repair(true);
        Ok(RedbWrite {
            transaction,
            touched: RefCell::default(),
            captured: None,
        })
    }
}

/// A table opened in a read transaction: owned, so it is opened once per transaction
/// (a listing reads one inode record per entry).
type OpenedTable = ReadOnlyTable<&'static [u8], &'static [u8]>;

pub struct RedbRead {
    transaction: ReadTransaction,
    /// The tables opened so far, by position in [`TableId::ALL`].
    opened: RefCell<[Option<OpenedTable>; TableId::ALL.len()]>,
    touched: RefCell<Touches>,
}

impl RedbRead {
    fn with_table<T>(
        &self,
        table: TableId,
        read: impl FnOnce(&OpenedTable) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let index = TableId::ALL
            .iter()
            .position(|known| *known == table)
            .expect("every table is in TableId::ALL");
        let mut opened = self.opened.borrow_mut();
        let slot = &mut opened[index];
        if slot.is_none() {
            let table = self
                .transaction
                .open_table(table.definition())
                .map_err(StoreError::backend)?;
            *slot = Some(table);
        }
        read(slot.as_ref().expect("opened above"))
    }
}

impl RedbWrite {
    fn with_table<T>(
        &self,
        table: TableId,
        read: impl FnOnce(&redb::Table<'_, &'static [u8], &'static [u8]>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        read(&opened)
    }
}

pub struct RedbWrite {
    transaction: WriteTransaction,
    touched: RefCell<Touches>,
    /// Every change in order, with what it replaced, when capturing (replicated metadata).
    captured: Option<Vec<Change>>,
}

/// One change of a write transaction: the key's new value (None: deleted) and the value it
/// replaced (None: there was none). A batch's changes, in order, are its Raft entry;
/// their before-images, in reverse, take it back.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Change {
    pub table: u8,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
    pub before: Option<Vec<u8>>,
}

impl RedbWrite {
    /// Record every change from now on (see [`Change`]).
    pub fn capture(&mut self) {
        self.captured.get_or_insert_with(Vec::new);
    }

    /// The changes recorded since [`RedbWrite::capture`], in order.
    pub fn take_changes(&mut self) -> Vec<Change> {
        self.captured
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Set (or delete) a key as a change says, without recording it: applying a batch of
    /// another server, or taking one back.
    pub fn apply_raw(
        &mut self,
        table: TableId,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        let mut opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        match value {
            Some(value) => {
                opened.insert(key, value).map_err(StoreError::backend)?;
            }
            None => {
                opened.remove(key).map_err(StoreError::backend)?;
            }
        }
        Ok(())
    }

    /// Set many keys of one table at once, without recording them (installing a snapshot).
    pub fn insert_raw_many(&mut self, table: TableId, pairs: &[Pair]) -> Result<(), StoreError> {
        let mut opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        for (key, value) in pairs {
            opened
                .insert(key.as_slice(), value.as_slice())
                .map_err(StoreError::backend)?;
        }
        Ok(())
    }

    /// Delete every key of a table (installing a snapshot).
    pub fn clear_table(&mut self, table: TableId) -> Result<(), StoreError> {
        self.transaction
            .delete_table(table.definition())
            .map_err(StoreError::backend)?;
        self.transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        Ok(())
    }
}

/// Bound on what one transaction records; past it the transaction counts as touching
/// everything (see [`TOUCHED_ALL`]).
const TOUCHED_INODES_MAX: usize = 65_536;

/// Recorded in place of a transaction's inodes when there were too many to keep: an
/// "inode" every check treats as shared with everyone.
pub const TOUCHED_ALL: InodeId = 0;

fn touch(touched: &RefCell<Touches>, table: TableId, key: &[u8]) {
    touched.borrow_mut().record(table, key, false);
}

fn change(touched: &RefCell<Touches>, table: TableId, key: &[u8]) {
    touched.borrow_mut().record(table, key, true);
}

fn start_key(bound: Bound<&[u8]>) -> &[u8] {
    match bound {
        Bound::Included(key) | Bound::Excluded(key) => key,
        Bound::Unbounded => &[],
    }
}

fn collect_range<T: ReadableTable<&'static [u8], &'static [u8]>>(
    table: &T,
    start: Bound<&[u8]>,
    end: Bound<&[u8]>,
    limit: usize,
    with_values: bool,
) -> Result<Vec<Pair>, StoreError> {
    let mut pairs = Vec::new();
    if limit == 0 {
        return Ok(pairs);
    }
    let range = table
        .range::<&[u8]>((start, end))
        .map_err(StoreError::backend)?;
    for item in range {
        let (key, value) = item.map_err(StoreError::backend)?;
        let value = if with_values {
            value.value().to_vec()
        } else {
            Vec::new()
        };
        pairs.push((key.value().to_vec(), value));
        if pairs.len() >= limit {
            break;
        }
    }
    Ok(pairs)
}

/// Reads are the same through a read transaction (MVCC snapshot) and a write transaction
/// (its own uncommitted changes): both open redb tables that implement `ReadableTable`.
macro_rules! store_read_for {
    ($transaction:ty) => {
        impl StoreRead for $transaction {
            fn get(&self, table: TableId, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
                touch(&self.touched, table, key);
                self.with_table(table, |opened| {
                    let value = opened.get(key).map_err(StoreError::backend)?;
                    Ok(value.map(|guard| guard.value().to_vec()))
                })
            }

            fn range(
                &self,
                table: TableId,
                start: Bound<&[u8]>,
                end: Bound<&[u8]>,
                limit: usize,
            ) -> Result<Vec<Pair>, StoreError> {
                // A range read of one inode's entries (a directory listing) reads that inode.
                touch(&self.touched, table, start_key(start));
                self.with_table(table, |opened| {
                    collect_range(opened, start, end, limit, true)
                })
            }

            fn range_keys(
                &self,
                table: TableId,
                start: Bound<&[u8]>,
                end: Bound<&[u8]>,
                limit: usize,
            ) -> Result<Vec<Vec<u8>>, StoreError> {
                touch(&self.touched, table, start_key(start));
                self.with_table(table, |opened| {
                    let pairs = collect_range(opened, start, end, limit, false)?;
                    Ok(pairs.into_iter().map(|(key, _)| key).collect())
                })
            }
        }
    };
}

store_read_for!(RedbRead);
store_read_for!(RedbWrite);

impl TouchedInodes for RedbRead {
    fn take_touched(&self) -> Touches {
        std::mem::take(&mut *self.touched.borrow_mut())
    }
}

impl TouchedInodes for RedbWrite {
    fn take_touched(&self) -> Touches {
        std::mem::take(&mut *self.touched.borrow_mut())
    }
}

impl StoreWrite for RedbWrite {
    fn put(&mut self, table: TableId, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        change(&self.touched, table, key);
        let mut opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        let before = opened.insert(key, value).map_err(StoreError::backend)?;
        if let Some(captured) = &mut self.captured {
            captured.push(Change {
                table: table.code(),
                key: key.to_vec(),
                value: Some(value.to_vec()),
                before: before.map(|old| old.value().to_vec()),
            });
        }
        Ok(())
    }

    fn delete(&mut self, table: TableId, key: &[u8]) -> Result<bool, StoreError> {
        change(&self.touched, table, key);
        let mut opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        let removed = opened.remove(key).map_err(StoreError::backend)?;
        let existed = removed.is_some();
        if let (Some(captured), Some(old)) = (&mut self.captured, removed) {
            captured.push(Change {
                table: table.code(),
                key: key.to_vec(),
                value: None,
                before: Some(old.value().to_vec()),
            });
        }
        Ok(existed)
    }

    fn set_durable(&mut self, durable: bool) -> Result<(), StoreError> {
        let durability = if durable {
            Durability::Immediate
        } else {
            Durability::None
        };
        self.transaction
            .set_durability(durability)
            .map_err(StoreError::backend)
    }

    fn commit(self) -> Result<(), StoreError> {
        self.transaction.commit().map_err(StoreError::backend)
    }

    fn abort(self) -> Result<(), StoreError> {
        self.transaction.abort().map_err(StoreError::backend)
    }
}
