//! Snapshots of the replicated tables as files, built and installed as streams: whatever
//! the number of files, neither side holds the namespace in memory (issue 42).
//!
//! A snapshot is every pair of the replicated tables as of the last applied entry (the
//! leader's speculative batches left out by reading their undo records, see
//! [`for_each_applied_pair`]), written in key order, table by table, into a file of the
//! member's `raft-snapshots/` directory. openraft sends it from the file in chunks and the
//! receiver writes the chunks into a file of its own, then installs it by reading it
//! through once, in one write transaction it commits only when the file's count and
//! checksum match what its end says (a torn or corrupt file changes nothing).
//!
//! The file:
//! - `FFSNAP01`, then the header's length (u32, little-endian) and the header (postcard:
//!   the applied log id and the membership);
//! - per pair: the table's code (u8, never `0xFF`), the key's and the value's lengths
//!   (u32 each) and their bytes;
//! - `0xFF`, the number of pairs (u64) and a CRC-32C of everything before it (u32).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::raft::batch;
use crate::raft::types::{LogId, SnapshotMeta, StoredMembership};
use crate::store::{MetaStore, RedbStore, RedbWrite, StoreError, StoreRead, StoreWrite, TableId};

const MAGIC: &[u8; 8] = b"FFSNAP01";
const END: u8 = 0xFF;
/// Pairs read from the store, or inserted into it, at a time.
const PAGE_PAIRS: usize = 1024;
/// Largest header accepted (a membership of a few members is a few hundred bytes).
const HEADER_BYTES_MAX: u32 = 1 << 20;
/// Largest key or value accepted from a file (the store's own records are far smaller).
const FIELD_BYTES_MAX: u32 = 64 << 20;

/// What a snapshot file starts with.
#[derive(Serialize, Deserialize)]
pub struct Header {
    pub applied: Option<LogId>,
    pub membership: StoredMembership,
}

fn corrupt(reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        table: "snapshot",
        reason: reason.into(),
    }
}

fn io_error(what: &str, path: &Path, error: std::io::Error) -> StoreError {
    StoreError::backend(format!("{what} {}: {error}", path.display()))
}

/// Calls `visit` with every pair of the replicated tables as of the last applied entry,
/// table by table in key order: the store's, except that a key a batch not applied as
/// committed yet changed (one with an undo record, read in the same transaction) has the
/// value from before the oldest such batch. Reads the store a page at a time; what it
/// keeps is the undo records' keys (the batches in flight, a bounded few).
pub fn for_each_applied_pair<R: StoreRead>(
    read: &R,
    mut visit: impl FnMut(u8, &[u8], &[u8]) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut before: HashMap<(u8, Vec<u8>), Option<Vec<u8>>> = HashMap::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let bound = after.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
        let page = read.range(TableId::Undo, bound, Bound::Unbounded, PAGE_PAIRS)?;
        for (_, record) in &page {
            for (table, key, value) in batch::undo_record(record)?.before {
                before.entry((table, key)).or_insert(value);
            }
        }
        match page.last() {
            Some((key, _)) if page.len() == PAGE_PAIRS => after = Some(key.clone()),
            _ => break,
        }
    }
    for table in TableId::REPLICATED {
        let code = table.code();
        let mut overrides: BTreeMap<Vec<u8>, Option<Vec<u8>>> = before
            .iter()
            .filter(|((t, _), _)| *t == code)
            .map(|((_, key), value)| (key.clone(), value.clone()))
            .collect();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let bound = after.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
            let page = read.range(table, bound, Bound::Unbounded, PAGE_PAIRS)?;
            for (key, value) in &page {
                // Keys a batch not applied yet deleted, ordered before this one.
                while let Some(entry) = overrides.first_entry() {
                    if entry.key() >= key {
                        break;
                    }
                    let (deleted, value) = entry.remove_entry();
                    if let Some(value) = value {
                        visit(code, &deleted, &value)?;
                    }
                }
                match overrides.remove(key) {
                    Some(Some(old)) => visit(code, key, &old)?,
                    // Made by a batch not applied yet.
                    Some(None) => {}
                    None => visit(code, key, value)?,
                }
            }
            match page.last() {
                Some((key, _)) if page.len() == PAGE_PAIRS => after = Some(key.clone()),
                _ => break,
            }
        }
        for (key, value) in overrides {
            if let Some(value) = value {
                visit(code, &key, &value)?;
            }
        }
    }
    Ok(())
}

/// What a replica holds as of its last applied entry: that entry's log id, the number of
/// pairs of the replicated tables and a digest of them (key order). Equal digests at the
/// same applied entry: identical replicas. Reads the store as a stream.
pub fn replicated_digest(store: &RedbStore) -> Result<(Option<LogId>, u64, u64), StoreError> {
    use std::hash::{Hash, Hasher};
    let read = store.begin_read()?;
    let applied = crate::raft::applied::applied_state_in(&read)?.0;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let mut count = 0u64;
    for_each_applied_pair(&read, |code, key, value| {
        (code, key, value).hash(&mut hasher);
        count += 1;
        Ok(())
    })?;
    Ok((applied, count, hasher.finish()))
}

/// A writer that keeps the CRC-32C of what went through it.
struct Summed<W> {
    inner: W,
    crc: u32,
}

impl<W: Write> Summed<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
        self.inner.write_all(bytes)
    }
}

/// A reader that keeps the CRC-32C of what came through it.
struct Checked<R> {
    inner: R,
    crc: u32,
}

impl<R: Read> Checked<R> {
    fn take(&mut self, buffer: &mut [u8]) -> Result<(), StoreError> {
        self.inner
            .read_exact(buffer)
            .map_err(|error| corrupt(format!("cut short: {error}")))?;
        self.crc = crc32c::crc32c_append(self.crc, buffer);
        Ok(())
    }

    fn u32(&mut self) -> Result<u32, StoreError> {
        let mut bytes = [0; 4];
        self.take(&mut bytes)?;
        Ok(u32::from_le_bytes(bytes))
    }

    fn field(&mut self, length: u32) -> Result<Vec<u8>, StoreError> {
        if length > FIELD_BYTES_MAX {
            return Err(corrupt(format!("a field of {length} bytes")));
        }
        let mut bytes = vec![0; length as usize];
        self.take(&mut bytes)?;
        Ok(bytes)
    }
}

/// The snapshot files of one member: the last one built or installed, kept to be sent, and
/// those being received.
pub struct SnapshotFiles {
    dir: PathBuf,
    next: AtomicU64,
}

impl SnapshotFiles {
    /// Use `dir`, made if missing; files left there by an earlier run are removed (a
    /// restarted member builds a new snapshot when one is needed).
    pub fn open(dir: PathBuf) -> std::io::Result<SnapshotFiles> {
        std::fs::create_dir_all(&dir)?;
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::remove_file(&path)?;
            }
        }
        Ok(SnapshotFiles {
            dir,
            next: AtomicU64::new(1),
        })
    }

    /// A new file name in the directory.
    fn fresh(&self, kind: &str) -> PathBuf {
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{kind}-{number}"))
    }

    /// Build a snapshot of `store` as of its last applied entry into a new file; returns
    /// its description, its path and its length. The store is made durable first: the
    /// log may be purged up to the snapshot once it exists.
    pub fn build(&self, store: &RedbStore) -> Result<(SnapshotMeta, PathBuf, u64), StoreError> {
        let read = store.begin_read()?;
        let mut write = store.begin_write()?;
        write.set_durable(true)?;
        write.commit()?;
        let (applied, membership) = crate::raft::applied::applied_state_in(&read)?;
        let path = self.fresh("built");
        let file = File::create(&path).map_err(|error| io_error("creating", &path, error))?;
        let mut out = Summed {
            inner: BufWriter::with_capacity(1 << 20, file),
            crc: 0,
        };
        let written = (|| -> Result<u64, StoreError> {
            let header = postcard::to_allocvec(&Header {
                applied,
                membership: membership.clone(),
            })
            .map_err(StoreError::backend)?;
            let io = |error| io_error("writing", &path, error);
            out.put(MAGIC).map_err(io)?;
            out.put(&(header.len() as u32).to_le_bytes()).map_err(io)?;
            out.put(&header).map_err(io)?;
            let mut count = 0u64;
            for_each_applied_pair(&read, |code, key, value| {
                out.put(&[code]).map_err(io)?;
                out.put(&(key.len() as u32).to_le_bytes()).map_err(io)?;
                out.put(&(value.len() as u32).to_le_bytes()).map_err(io)?;
                out.put(key).map_err(io)?;
                out.put(value).map_err(io)?;
                count += 1;
                Ok(())
            })?;
            out.put(&[END]).map_err(io)?;
            out.put(&count.to_le_bytes()).map_err(io)?;
            let crc = out.crc;
            out.inner.write_all(&crc.to_le_bytes()).map_err(io)?;
            let file = out
                .inner
                .into_inner()
                .map_err(|error| io(error.into_error()))?;
            file.sync_all().map_err(io)?;
            Ok(file.metadata().map_err(io)?.len())
        })();
        let length = match written {
            Ok(length) => length,
            Err(error) => {
                let _ = std::fs::remove_file(&path);
                return Err(error);
            }
        };
        let snapshot_id = match applied {
            Some(log_id) => format!("{}-{}-{length}", log_id.leader_id.term, log_id.index),
            None => format!("empty-{length}"),
        };
        let meta = SnapshotMeta {
            last_log_id: applied,
            last_membership: membership,
            snapshot_id,
        };
        Ok((meta, path, length))
    }

    /// A new empty file for a snapshot being received.
    pub fn incoming(&self) -> std::io::Result<(PathBuf, File)> {
        let path = self.fresh("incoming");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok((path, file))
    }

    /// Forget a file (a snapshot replaced, or one received and not installed).
    pub fn remove(&self, path: &Path) {
        if let Err(error) = std::fs::remove_file(path) {
            if error.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), %error, "cannot remove a snapshot file");
            }
        }
    }
}

/// Replace the replicated tables of `store` with the snapshot in `path`, described by
/// `meta`: read through once, in one durable write transaction committed only if the
/// file ends with the count and checksum of what was read. Returns the pairs installed.
pub fn install(store: &RedbStore, meta: &SnapshotMeta, path: &Path) -> Result<u64, StoreError> {
    let file = File::open(path).map_err(|error| io_error("opening", path, error))?;
    let mut input = Checked {
        inner: BufReader::with_capacity(1 << 20, file),
        crc: 0,
    };
    let mut magic = [0; 8];
    input.take(&mut magic)?;
    if &magic != MAGIC {
        return Err(corrupt("not a Freeflow snapshot (bad magic)"));
    }
    let header_length = input.u32()?;
    if header_length > HEADER_BYTES_MAX {
        return Err(corrupt(format!("a header of {header_length} bytes")));
    }
    let header: Header = postcard::from_bytes(&input.field(header_length)?)
        .map_err(|error| corrupt(format!("header: {error}")))?;
    if header.applied != meta.last_log_id {
        return Err(corrupt(format!(
            "the file holds the state at {:?}, the leader described {:?}",
            header.applied, meta.last_log_id
        )));
    }
    let mut write = store.begin_write()?;
    write.set_durable(true)?;
    for table in TableId::REPLICATED {
        write.clear_table(table)?;
    }
    write.clear_table(TableId::Undo)?;
    let mut page: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(PAGE_PAIRS);
    let mut page_table: Option<TableId> = None;
    let mut count = 0u64;
    loop {
        let mut code = [0; 1];
        input.take(&mut code)?;
        if code[0] == END {
            break;
        }
        let table = TableId::from_code(code[0])
            .filter(|table| TableId::REPLICATED.contains(table))
            .ok_or_else(|| {
                corrupt(format!(
                    "a pair of table {}, which is not replicated",
                    code[0]
                ))
            })?;
        let key_length = input.u32()?;
        let value_length = input.u32()?;
        let key = input.field(key_length)?;
        let value = input.field(value_length)?;
        if page_table != Some(table) || page.len() == PAGE_PAIRS {
            if let Some(previous) = page_table {
                insert_page(&mut write, previous, &mut page)?;
            }
            page_table = Some(table);
        }
        page.push((key, value));
        count += 1;
    }
    if let Some(table) = page_table {
        insert_page(&mut write, table, &mut page)?;
    }
    let summed = input.crc;
    let mut end = [0; 12];
    input
        .inner
        .read_exact(&mut end)
        .map_err(|error| corrupt(format!("cut short at its end: {error}")))?;
    let stated_count = u64::from_le_bytes(end[..8].try_into().expect("8 bytes"));
    let stated_crc = u32::from_le_bytes(end[8..].try_into().expect("4 bytes"));
    // `summed` covers the end marker; the count follows it.
    let summed = crc32c::crc32c_append(summed, &end[..8]);
    if stated_count != count || stated_crc != summed {
        return Err(corrupt(format!(
            "{count} pairs read, checksum {summed:#010x}; the file states {stated_count} and \
             {stated_crc:#010x}"
        )));
    }
    crate::raft::applied::put_applied(&mut write, &meta.last_log_id, &meta.last_membership)?;
    write.commit()?;
    Ok(count)
}

fn insert_page(
    write: &mut RedbWrite,
    table: TableId,
    page: &mut Vec<(Vec<u8>, Vec<u8>)>,
) -> Result<(), StoreError> {
    write.insert_raw_many(table, page)?;
    page.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use openraft::CommittedLeaderId;

    use super::*;

    fn log_id(index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(3, 1), index)
    }

    /// A store with `files` inodes and names, applied through `log_id(7)`, and one batch
    /// run ahead of its commit (an undo record): it changed one inode, made one and
    /// deleted one, which the snapshot must show as they were before it.
    fn source(dir: &Path, files: u32) -> RedbStore {
        let store = RedbStore::open(&dir.join("source.redb")).unwrap();
        let mut write = store.begin_write().unwrap();
        for n in 0..files {
            let key = format!("inode-{n:08}");
            write
                .put(TableId::Inodes, key.as_bytes(), &[n as u8; 40])
                .unwrap();
            let name = format!("name-{n:08}");
            write
                .put(TableId::Dirents, name.as_bytes(), key.as_bytes())
                .unwrap();
        }
        crate::raft::applied::put_applied(
            &mut write,
            &Some(log_id(7)),
            &StoredMembership::default(),
        )
        .unwrap();
        write.commit().unwrap();
        let mut write = store.begin_write().unwrap();
        write.capture();
        write
            .put(TableId::Inodes, b"inode-00000001", b"speculative")
            .unwrap();
        write
            .put(TableId::Inodes, b"inode-99999999", b"made ahead")
            .unwrap();
        write.delete(TableId::Inodes, b"inode-00000002").unwrap();
        let changes = write.take_changes();
        batch::remember(&mut write, 7, 11, &changes).unwrap();
        write.commit().unwrap();
        store
    }

    fn meta(index: u64) -> SnapshotMeta {
        SnapshotMeta {
            last_log_id: Some(log_id(index)),
            last_membership: StoredMembership::default(),
            snapshot_id: "test".into(),
        }
    }

    #[test]
    fn a_snapshot_file_installs_the_applied_state_and_leaves_out_batches_not_committed() {
        let dir = tempfile::tempdir().unwrap();
        // More pairs than a page, so paging and the merge with the undo keys are crossed.
        let store = source(dir.path(), 2_500);
        let files = SnapshotFiles::open(dir.path().join("snapshots")).unwrap();
        let (built, path, length) = files.build(&store).unwrap();
        assert_eq!(built.last_log_id, Some(log_id(7)));
        assert!(length > 2_500 * 40);

        let target = RedbStore::open(&dir.path().join("target.redb")).unwrap();
        let mut write = target.begin_write().unwrap();
        write
            .put(TableId::Inodes, b"stale", b"from before")
            .unwrap();
        write.commit().unwrap();
        let pairs = install(&target, &built, &path).unwrap();
        assert_eq!(pairs, 5_000);

        let read = target.begin_read().unwrap();
        assert_eq!(read.get(TableId::Inodes, b"stale").unwrap(), None);
        assert_eq!(
            read.get(TableId::Inodes, b"inode-00000001").unwrap(),
            Some(vec![1; 40])
        );
        assert_eq!(
            read.get(TableId::Inodes, b"inode-00000002").unwrap(),
            Some(vec![2; 40])
        );
        assert_eq!(read.get(TableId::Inodes, b"inode-99999999").unwrap(), None);
        let (source_applied, source_count, source_digest) = replicated_digest(&store).unwrap();
        let (applied, count, digest) = replicated_digest(&target).unwrap();
        assert_eq!(
            (applied, count, digest),
            (source_applied, source_count, source_digest)
        );
    }

    #[test]
    fn a_damaged_or_cut_snapshot_file_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = source(dir.path(), 300);
        let files = SnapshotFiles::open(dir.path().join("snapshots")).unwrap();
        let (built, path, length) = files.build(&store).unwrap();
        let good = std::fs::read(&path).unwrap();
        let target = RedbStore::open(&dir.path().join("target.redb")).unwrap();
        let mut write = target.begin_write().unwrap();
        write.put(TableId::Inodes, b"kept", b"as it was").unwrap();
        write.commit().unwrap();

        let mut flipped = good.clone();
        flipped[length as usize / 2] ^= 0x10;
        std::fs::write(&path, &flipped).unwrap();
        assert!(install(&target, &built, &path).is_err(), "a flipped bit");
        std::fs::write(&path, &good[..good.len() - 5]).unwrap();
        assert!(install(&target, &built, &path).is_err(), "a cut file");
        std::fs::write(&path, &good).unwrap();
        assert!(
            install(&target, &meta(8), &path).is_err(),
            "another entry's state"
        );

        let read = target.begin_read().unwrap();
        assert_eq!(
            read.get(TableId::Inodes, b"kept").unwrap(),
            Some(b"as it was".to_vec())
        );
        assert_eq!(read.get(TableId::Inodes, b"inode-00000003").unwrap(), None);
        drop(read);
        assert_eq!(install(&target, &built, &path).unwrap(), 600);
    }
}
