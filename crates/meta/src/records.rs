//! On-disk formats of the metadata tables, defined once.
//!
//! | table       | key                         | value                                       |
//! |-------------|-----------------------------|---------------------------------------------|
//! | inodes      | inode u64 BE                | version 1 byte + postcard(InodeRecord)      |
//! | dirents     | parent u64 BE ++ name bytes | child u64 BE ++ kind 1 byte                 |
//! | symlinks    | inode u64 BE                | target bytes (UTF-8)                        |
//! | xattrs      | inode u64 BE ++ name bytes  | value bytes                                 |
//! | orphans     | inode u64 BE                | version 1 byte + postcard(OrphanRecord)     |
//! | counters    | counter name (ASCII)        | u64 BE                                      |
//! | servers     | server u32 BE               | version 1 byte + postcard(ServerEntry)      |
//! | truncations | inode u64 BE                | version 1 byte + postcard(TruncationRecord) |
//!
//! Integers in keys are big-endian so that byte order is numeric order and all entries of
//! one directory (or one inode's xattrs) are one contiguous range. Every record read back is
//! decoded without panicking: a bad byte is a `StoreError::Corrupt`.

use freeflow_types::{Attr, FileKind, InodeId, Layout, ServerId};
use serde::{Deserialize, Serialize};

use crate::store::{StoreError, TableId};

/// Record format version written in front of every versioned record.
pub const RECORD_VERSION: u8 = 1;

/// Counter names in the `counters` table.
pub const COUNTER_INODE_HIGH_WATER: &[u8] = b"inode_high_water";
pub const COUNTER_INODE_COUNT: &[u8] = b"inode_count";
pub const COUNTER_ORPHAN_COUNT: &[u8] = b"orphan_count";
/// Incremented at every start: orphans from an older epoch may still be read by clients
/// that do not know the server restarted, so they wait one lease before being reaped.
pub const COUNTER_BOOT_EPOCH: &[u8] = b"boot_epoch";

/// One inode: its attributes and, for a directory, its parent (to refuse moving a
/// directory into its own subtree without scanning).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeRecord {
    pub attr: Attr,
    /// The parent directory of a directory (the root is its own parent); 0 for other kinds.
    pub parent: InodeId,
}

/// An unlinked regular file whose data is still on the I/O servers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrphanRecord {
    pub layout: Layout,
    /// The boot epoch in which the inode became an orphan.
    pub boot_epoch: u64,
}

/// A shrink whose cuts on the I/O servers are not all done yet (see `ops/truncate.rs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TruncationRecord {
    pub layout: Layout,
    /// The inode's generation at the shrink that last changed this record. A cutter settles
    /// the stripes it cut only if the record still has the generation it cut for.
    pub generation: u64,
    /// (stripe index, file size to cut that stripe's object at), in stripe order: the
    /// smallest size still pending per stripe.
    pub cuts: Vec<(u32, u64)>,
}

/// A registered I/O server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerEntry {
    pub address: String,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub object_count: u64,
}

fn corrupt(table: TableId, reason: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        table: table.name(),
        reason: reason.to_string(),
    }
}

pub fn encode_versioned<T: Serialize>(record: &T) -> Vec<u8> {
    let mut bytes = vec![RECORD_VERSION];
    // Records are plain structs; postcard cannot fail on them (a programmer error if it did).
    bytes.extend(postcard::to_stdvec(record).expect("metadata records always encode"));
    bytes
}

pub fn decode_versioned<T: for<'de> Deserialize<'de>>(
    table: TableId,
    bytes: &[u8],
) -> Result<T, StoreError> {
    match bytes.split_first() {
        Some((&RECORD_VERSION, rest)) => postcard::from_bytes(rest).map_err(|e| corrupt(table, e)),
        Some((version, _)) => Err(corrupt(table, format!("unknown record version {version}"))),
        None => Err(corrupt(table, "empty record")),
    }
}

pub fn inode_key(inode: InodeId) -> [u8; 8] {
    inode.to_be_bytes()
}

pub fn server_key(server: ServerId) -> [u8; 4] {
    server.to_be_bytes()
}

pub fn decode_server_key(bytes: &[u8]) -> Result<ServerId, StoreError> {
    let array: [u8; 4] = bytes
        .try_into()
        .map_err(|_| corrupt(TableId::Servers, "bad key"))?;
    Ok(ServerId::from_be_bytes(array))
}

pub fn decode_inode_key(table: TableId, bytes: &[u8]) -> Result<InodeId, StoreError> {
    let array: [u8; 8] = bytes
        .get(..8)
        .and_then(|prefix| prefix.try_into().ok())
        .ok_or_else(|| corrupt(table, "key shorter than an inode id"))?;
    Ok(InodeId::from_be_bytes(array))
}

/// Key of a name under an inode (dirents, xattrs).
pub fn named_key(inode: InodeId, name: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(8 + name.len());
    key.extend_from_slice(&inode.to_be_bytes());
    key.extend_from_slice(name);
    key
}

/// The name part of a named key.
pub fn name_of_key(table: TableId, key: &[u8]) -> Result<String, StoreError> {
    let name = key
        .get(8..)
        .ok_or_else(|| corrupt(table, "key shorter than an inode id"))?;
    String::from_utf8(name.to_vec()).map_err(|e| corrupt(table, e))
}

fn kind_byte(kind: FileKind) -> u8 {
    match kind {
        FileKind::Regular => 1,
        FileKind::Directory => 2,
        FileKind::Symlink => 3,
        FileKind::Fifo => 4,
        FileKind::Socket => 5,
        FileKind::CharDevice => 6,
        FileKind::BlockDevice => 7,
    }
}

pub fn encode_dirent(child: InodeId, kind: FileKind) -> [u8; 9] {
    let mut value = [0u8; 9];
    value[..8].copy_from_slice(&child.to_be_bytes());
    value[8] = kind_byte(kind);
    value
}

pub fn decode_dirent(bytes: &[u8]) -> Result<(InodeId, FileKind), StoreError> {
    let table = TableId::Dirents;
    if bytes.len() != 9 {
        return Err(corrupt(
            table,
            format!("dirent value of {} bytes", bytes.len()),
        ));
    }
    let child = decode_inode_key(table, bytes)?;
    let kind = match bytes[8] {
        1 => FileKind::Regular,
        2 => FileKind::Directory,
        3 => FileKind::Symlink,
        4 => FileKind::Fifo,
        5 => FileKind::Socket,
        6 => FileKind::CharDevice,
        7 => FileKind::BlockDevice,
        other => return Err(corrupt(table, format!("unknown kind byte {other}"))),
    };
    Ok((child, kind))
}

pub fn decode_counter(bytes: &[u8]) -> Result<u64, StoreError> {
    let array: [u8; 8] = bytes
        .try_into()
        .map_err(|_| corrupt(TableId::Counters, "counter is not 8 bytes"))?;
    Ok(u64::from_be_bytes(array))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirent_round_trips_and_rejects_garbage() {
        let bytes = encode_dirent(42, FileKind::Symlink);
        assert_eq!(decode_dirent(&bytes).unwrap(), (42, FileKind::Symlink));
        assert!(decode_dirent(&bytes[..5]).is_err());
        let mut bad = bytes;
        bad[8] = 99;
        assert!(decode_dirent(&bad).is_err());
    }

    #[test]
    fn versioned_records_refuse_unknown_versions() {
        let record = ServerEntry {
            address: "a:1".into(),
            capacity_bytes: 1,
            free_bytes: 2,
            object_count: 3,
        };
        let mut bytes = encode_versioned(&record);
        assert_eq!(
            decode_versioned::<ServerEntry>(TableId::Servers, &bytes).unwrap(),
            record
        );
        bytes[0] = 9;
        assert!(decode_versioned::<ServerEntry>(TableId::Servers, &bytes).is_err());
        assert!(decode_versioned::<ServerEntry>(TableId::Servers, &[]).is_err());
    }

    #[test]
    fn named_keys_sort_by_inode_then_name() {
        assert!(named_key(1, b"zzz") < named_key(2, b""));
        assert!(named_key(1, b"a") < named_key(1, b"b"));
        assert_eq!(
            name_of_key(TableId::Dirents, &named_key(7, b"hello")).unwrap(),
            "hello"
        );
    }
}
