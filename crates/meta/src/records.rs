//! On-disk formats of the metadata tables, defined once.
//!
//! | table       | key                         | value                                       |
//! |-------------|-----------------------------|---------------------------------------------|
//! | inodes      | inode u64 BE                | version 2 byte + postcard(InodeRecord); version 1 (no space fields) is still read |
//! | dirents     | parent u64 BE ++ name bytes | child u64 BE ++ kind 1 byte                 |
//! | symlinks    | inode u64 BE                | target bytes (UTF-8)                        |
//! | xattrs      | inode u64 BE ++ name bytes  | value bytes                                 |
//! | orphans     | inode u64 BE                | version 1 byte + postcard(OrphanRecord)     |
//! | counters    | counter name (ASCII)        | u64 BE                                      |
//! | servers     | server u32 BE               | version 1 byte + postcard(ServerEntry)      |
//! | truncations | inode u64 BE                | version 1 byte + postcard(TruncationRecord) |
//! | replies     | client u64 BE ++ request u64 BE | version 1 byte + postcard(ReplyRecord)  |
//! | reply_expiry | txn u64 BE ++ client u64 BE ++ request u64 BE | empty                  |
//! | clients     | client u64 BE               | version 1 byte + postcard(ClientRecord)     |
//! | replacements | sequence u64 BE            | version 1 byte + postcard(proto `Replacement`) |
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
/// Transaction numbers below this may have been given out (reserved ahead, like inode ids).
pub const COUNTER_TXN_HIGH_WATER: &[u8] = b"txn_high_water";
/// The last transaction committed; as read at start, the last one that was durable.
pub const COUNTER_LAST_TXN: &[u8] = b"last_txn";

/// Version of the `inodes` records written now (2: with the space of each stripe).
pub const INODE_RECORD_VERSION: u8 = 2;

/// One inode: its attributes and, for a directory, its parent (to refuse moving a
/// directory into its own subtree without scanning).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeRecord {
    pub attr: Attr,
    /// The parent directory of a directory (the root is its own parent); 0 for other kinds.
    pub parent: InodeId,
    /// Per stripe of a regular file: (allocated bytes, stamp of that report), as the
    /// stripe's I/O server last reported it (`proto::io::ObjectSpace`). Empty until a
    /// stripe is reported; `attr.allocated_bytes` is the sum.
    pub stripe_space: Vec<(u64, u64)>,
}

impl InodeRecord {
    /// Take a report of the space of one stripe if it is newer than the one kept, and keep
    /// `attr.allocated_bytes` the sum. A stripe outside the layout is ignored.
    pub fn absorb_space(&mut self, stripe_index: u32, allocated_bytes: u64, stamp: u64) {
        let stripe_count = self
            .attr
            .layout
            .as_ref()
            .map_or(0, |layout| layout.stripe_count()) as usize;
        let index = stripe_index as usize;
        if index >= stripe_count {
            return;
        }
        if self.stripe_space.len() < stripe_count {
            self.stripe_space.resize(stripe_count, (0, 0));
        }
        let kept = &mut self.stripe_space[index];
        if stamp > kept.1 {
            *kept = (allocated_bytes, stamp);
            self.attr.allocated_bytes = self
                .stripe_space
                .iter()
                .fold(0u64, |sum, (bytes, _)| sum.saturating_add(*bytes));
        }
    }
}

/// `Attr` as records of version 1 stored it (before `allocated_bytes`).
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct AttrV1 {
    inode: InodeId,
    kind: FileKind,
    permissions: u32,
    link_count: u32,
    user_id: u32,
    group_id: u32,
    size_bytes: u64,
    access_time: freeflow_types::TimeSpec,
    modify_time: freeflow_types::TimeSpec,
    change_time: freeflow_types::TimeSpec,
    birth_time: freeflow_types::TimeSpec,
    device: u64,
    layout: Option<Layout>,
    generation: u64,
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct InodeRecordV1 {
    attr: AttrV1,
    parent: InodeId,
}

impl From<InodeRecordV1> for InodeRecord {
    /// Version 1 knew nothing of stored space: a regular file is taken as fully allocated
    /// up to its size (what `st_blocks` showed then) until its servers report.
    fn from(old: InodeRecordV1) -> InodeRecord {
        let a = old.attr;
        let allocated_bytes = if a.kind == FileKind::Regular {
            a.size_bytes
        } else {
            0
        };
        InodeRecord {
            attr: Attr {
                inode: a.inode,
                kind: a.kind,
                permissions: a.permissions,
                link_count: a.link_count,
                user_id: a.user_id,
                group_id: a.group_id,
                size_bytes: a.size_bytes,
                access_time: a.access_time,
                modify_time: a.modify_time,
                change_time: a.change_time,
                birth_time: a.birth_time,
                device: a.device,
                layout: a.layout,
                generation: a.generation,
                allocated_bytes,
            },
            parent: old.parent,
            stripe_space: Vec::new(),
        }
    }
}

pub fn encode_inode(record: &InodeRecord) -> Vec<u8> {
    let mut bytes = vec![INODE_RECORD_VERSION];
    bytes.extend(postcard::to_stdvec(record).expect("metadata records always encode"));
    bytes
}

/// Decode an `inodes` value of either version. Bytes from the disk: never panics.
pub fn decode_inode(bytes: &[u8]) -> Result<InodeRecord, StoreError> {
    let table = TableId::Inodes;
    match bytes.split_first() {
        Some((&INODE_RECORD_VERSION, rest)) => {
            postcard::from_bytes(rest).map_err(|e| corrupt(table, e))
        }
        Some((1, rest)) => postcard::from_bytes::<InodeRecordV1>(rest)
            .map(InodeRecord::from)
            .map_err(|e| corrupt(table, e)),
        Some((version, _)) => Err(corrupt(table, format!("unknown record version {version}"))),
        None => Err(corrupt(table, "empty record")),
    }
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

/// A client that may hold mutations not durable yet (see `writer/`): written durably
/// before its first early reply, removed when its last session ends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientRecord {
    /// The transaction that recorded it.
    pub first_txn: u64,
    /// Wall-clock seconds then (for operators).
    pub wall_seconds: i64,
}

/// The reply to an applied mutation, kept so that the same request sent again (a resend
/// after a lost connection, a replay after a restart) is answered and never applied twice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyRecord {
    pub txn: u64,
    /// The reply's header section (`Result<Reply, WireError>` encoded).
    pub reply: Vec<u8>,
}

/// Key of a reply record: client id then request id, big-endian.
pub fn reply_key(client_id: u64, request_id: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&client_id.to_be_bytes());
    key[8..].copy_from_slice(&request_id.to_be_bytes());
    key
}

/// Key of a reply record in expiry order: its transaction, then its reply key.
pub fn reply_expiry_key(txn: u64, client_id: u64, request_id: u64) -> [u8; 24] {
    let mut key = [0u8; 24];
    key[..8].copy_from_slice(&txn.to_be_bytes());
    key[8..].copy_from_slice(&reply_key(client_id, request_id));
    key
}

/// A registered I/O server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerEntry {
    pub address: String,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub object_count: u64,
    /// Its place in the chains of replicated stripes: an out server stays out across a
    /// restart of the meta server (its copies are stale until it resyncs).
    pub state: freeflow_proto::meta::MemberState,
    /// Out or syncing: since when (Unix ms, on the meta server's clock) it may lack
    /// writes; 0 in service. Kept across going out again while syncing.
    pub unsynced_since_ms: u64,
    /// Its data directory was lost: its resync copies everything.
    pub copy_everything: bool,
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
            state: freeflow_proto::meta::MemberState::Out,
            unsynced_since_ms: 7,
            copy_everything: true,
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

    fn sample_attr() -> Attr {
        let time = freeflow_types::TimeSpec::new(1_700_000_000, 5);
        Attr {
            inode: 77,
            kind: FileKind::Regular,
            permissions: 0o640,
            link_count: 1,
            user_id: 1000,
            group_id: 100,
            size_bytes: 3 << 20,
            access_time: time,
            modify_time: time,
            change_time: time,
            birth_time: time,
            device: 0,
            layout: Some(Layout::new(1 << 20, vec![1, 2, 3]).unwrap()),
            generation: 4,
            allocated_bytes: 0,
        }
    }

    #[test]
    fn inode_records_of_version_1_are_still_read() {
        let a = sample_attr();
        let old = InodeRecordV1 {
            attr: AttrV1 {
                inode: a.inode,
                kind: a.kind,
                permissions: a.permissions,
                link_count: a.link_count,
                user_id: a.user_id,
                group_id: a.group_id,
                size_bytes: a.size_bytes,
                access_time: a.access_time,
                modify_time: a.modify_time,
                change_time: a.change_time,
                birth_time: a.birth_time,
                device: a.device,
                layout: a.layout.clone(),
                generation: a.generation,
            },
            parent: 0,
        };
        let mut bytes = vec![1u8];
        bytes.extend(postcard::to_stdvec(&old).unwrap());
        let record = decode_inode(&bytes).unwrap();
        assert_eq!(record.attr.size_bytes, a.size_bytes);
        assert_eq!(record.attr.layout, a.layout);
        assert_eq!(record.attr.allocated_bytes, a.size_bytes);
        assert!(record.stripe_space.is_empty());
        // Written back, it is version 2 and reads the same.
        let again = decode_inode(&encode_inode(&record)).unwrap();
        assert_eq!(again, record);
        assert_eq!(encode_inode(&record)[0], INODE_RECORD_VERSION);
        assert!(decode_inode(&[]).is_err());
        assert!(decode_inode(&[3, 0, 0]).is_err());
        assert!(decode_inode(&bytes[..bytes.len() / 2]).is_err());
    }

    #[test]
    fn stripe_space_keeps_the_newest_report_per_stripe_and_sums_them() {
        let mut record = InodeRecord {
            attr: sample_attr(),
            parent: 0,
            stripe_space: Vec::new(),
        };
        record.absorb_space(0, 4096, 10);
        record.absorb_space(2, 8192, 11);
        assert_eq!(record.attr.allocated_bytes, 12288);
        // An older report of stripe 0 (a slow writer's) does not undo the newer one.
        record.absorb_space(0, 1 << 20, 9);
        assert_eq!(record.attr.allocated_bytes, 12288);
        record.absorb_space(0, 0, 12);
        assert_eq!(record.attr.allocated_bytes, 8192);
        // Outside the layout: ignored.
        record.absorb_space(3, 1 << 30, 99);
        assert_eq!(record.attr.allocated_bytes, 8192);
        assert_eq!(record.stripe_space.len(), 3);
    }

    /// Issue 8: no bytes read from the store panic a decoder. Arbitrary values and
    /// mutations of valid ones go through every decoder of a table value or key; a long
    /// run on demand: `PROPTEST_CASES=200000 cargo test -p freeflow-meta records::`.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn every_decoder(bytes: &[u8]) {
            let _ = decode_inode(bytes);
            let _ = decode_versioned::<OrphanRecord>(TableId::Orphans, bytes);
            let _ = decode_versioned::<TruncationRecord>(TableId::Truncations, bytes);
            let _ = decode_versioned::<ServerEntry>(TableId::Servers, bytes);
            let _ = decode_dirent(bytes);
            let _ = decode_counter(bytes);
            let _ = decode_inode_key(TableId::Inodes, bytes);
            let _ = decode_server_key(bytes);
            let _ = name_of_key(TableId::Dirents, bytes);
            if let Ok(record) = decode_inode(bytes) {
                assert_eq!(decode_inode(&encode_inode(&record)).unwrap(), record);
            }
        }

        fn samples() -> Vec<Vec<u8>> {
            let layout = Layout::new(1 << 20, vec![1, 2, 3]).unwrap();
            let mut record = InodeRecord {
                attr: sample_attr(),
                parent: 0,
                stripe_space: Vec::new(),
            };
            record.absorb_space(1, 4096, 5);
            vec![
                encode_inode(&record),
                encode_versioned(&TruncationRecord {
                    layout: layout.clone(),
                    generation: 3,
                    cuts: vec![(0, 10), (2, 20)],
                }),
                encode_versioned(&OrphanRecord {
                    layout,
                    boot_epoch: 4,
                }),
                encode_dirent(9, FileKind::Symlink).to_vec(),
                named_key(7, b"name"),
            ]
        }

        proptest! {
            #[test]
            fn arbitrary_values_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
                every_decoder(&bytes);
            }

            #[test]
            fn mutated_values_never_panic(
                which in any::<prop::sample::Index>(),
                writes in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
                keep in any::<prop::sample::Index>(),
            ) {
                let samples = samples();
                let mut bytes = samples[which.index(samples.len())].clone();
                for (at, value) in writes {
                    let at = at.index(bytes.len());
                    bytes[at] = value;
                }
                bytes.truncate(keep.index(bytes.len() + 1).max(1));
                every_decoder(&bytes);
            }
        }
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
