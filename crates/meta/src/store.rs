//! The transactional key-value seam under the namespace.
//!
//! The namespace operations only need "get, put, delete and ordered range over byte keys,
//! inside a read or a write transaction", so that is all [`MetaStore`] offers: another
//! transactional KV (or a replicated state machine) can be plugged in behind the same seam
//! (DESIGN.md §2). [`RedbStore`] is the implementation over redb 4.
//!
//! Durability: every write transaction commits with `Durability::Immediate` (one fsync per
//! commit, group commit batches many operations into one) and quick repair is on, so an
//! unclean shutdown does not force a scan of the whole file on the next open.

use std::ops::Bound;
use std::path::Path;

use redb::{
    Database, Durability, ReadTransaction, ReadableDatabase, ReadableTable, TableDefinition,
    WriteTransaction,
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
}

impl TableId {
    pub const ALL: [TableId; 8] = [
        TableId::Inodes,
        TableId::Dirents,
        TableId::Symlinks,
        TableId::Xattrs,
        TableId::Orphans,
        TableId::Counters,
        TableId::Servers,
        TableId::Truncations,
    ];

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

/// Writes; nothing is visible to readers before `commit`.
pub trait StoreWrite: StoreRead {
    fn put(&mut self, table: TableId, key: &[u8], value: &[u8]) -> Result<(), StoreError>;
    /// True if the key existed.
    fn delete(&mut self, table: TableId, key: &[u8]) -> Result<bool, StoreError>;
    /// Durable when it returns Ok.
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
        Ok(RedbRead { transaction })
    }

    fn begin_write(&self) -> Result<RedbWrite, StoreError> {
        let mut transaction = self.database.begin_write().map_err(StoreError::backend)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(StoreError::backend)?;
        transaction.set_quick_repair(true);
        Ok(RedbWrite { transaction })
    }
}

pub struct RedbRead {
    transaction: ReadTransaction,
}

pub struct RedbWrite {
    transaction: WriteTransaction,
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
                let opened = self
                    .transaction
                    .open_table(table.definition())
                    .map_err(StoreError::backend)?;
                let value = opened.get(key).map_err(StoreError::backend)?;
                Ok(value.map(|guard| guard.value().to_vec()))
            }

            fn range(
                &self,
                table: TableId,
                start: Bound<&[u8]>,
                end: Bound<&[u8]>,
                limit: usize,
            ) -> Result<Vec<Pair>, StoreError> {
                let opened = self
                    .transaction
                    .open_table(table.definition())
                    .map_err(StoreError::backend)?;
                collect_range(&opened, start, end, limit, true)
            }

            fn range_keys(
                &self,
                table: TableId,
                start: Bound<&[u8]>,
                end: Bound<&[u8]>,
                limit: usize,
            ) -> Result<Vec<Vec<u8>>, StoreError> {
                let opened = self
                    .transaction
                    .open_table(table.definition())
                    .map_err(StoreError::backend)?;
                let pairs = collect_range(&opened, start, end, limit, false)?;
                Ok(pairs.into_iter().map(|(key, _)| key).collect())
            }
        }
    };
}

store_read_for!(RedbRead);
store_read_for!(RedbWrite);

impl StoreWrite for RedbWrite {
    fn put(&mut self, table: TableId, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        let mut opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        opened.insert(key, value).map_err(StoreError::backend)?;
        Ok(())
    }

    fn delete(&mut self, table: TableId, key: &[u8]) -> Result<bool, StoreError> {
        let mut opened = self
            .transaction
            .open_table(table.definition())
            .map_err(StoreError::backend)?;
        let removed = opened.remove(key).map_err(StoreError::backend)?;
        Ok(removed.is_some())
    }

    fn commit(self) -> Result<(), StoreError> {
        self.transaction.commit().map_err(StoreError::backend)
    }

    fn abort(self) -> Result<(), StoreError> {
        self.transaction.abort().map_err(StoreError::backend)
    }
}
