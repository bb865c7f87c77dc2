//! The namespace operations, one module per family, each a function over a store
//! transaction.
//!
//! The rule every mutating operation keeps: **validate everything first, then write**. An
//! operation that is refused returns `OpError::Refused` before its first write, so it
//! leaves nothing behind in the shared group-commit transaction and the other operations of
//! the batch are unaffected. `OpError::Store` (the store itself failed) aborts the batch.
//!
//! Operations never read the clock or the server registry themselves: the caller passes
//! them in an [`OpContext`], so the same operation is deterministic in tests.

pub mod create;
pub mod link;
pub mod lookup;
pub mod orphan;
pub mod readdir;
pub mod remove;
pub mod rename;
pub mod servers;
pub mod setattr;
pub mod size;
pub mod truncate;
pub mod xattr;

use std::ops::Bound;

use freeflow_proto::meta::Caller;
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::limits::NAME_LENGTH_MAX;
use freeflow_types::{FileKind, InodeId, ServerId, TimeSpec};

use crate::records::{
    decode_counter, decode_dirent, decode_inode, encode_dirent, encode_inode, encode_versioned,
    inode_key, named_key, InodeRecord, OrphanRecord, COUNTER_BOOT_EPOCH, COUNTER_INODE_COUNT,
    COUNTER_INODE_HIGH_WATER, COUNTER_LAST_TXN, COUNTER_ORPHAN_COUNT, COUNTER_TXN_HIGH_WATER,
};
use crate::store::{StoreError, StoreRead, StoreWrite, TableId};

/// How many inode ids are reserved ahead with one persisted high-water mark.
pub const INODE_RESERVE_BATCH: u64 = 1024;

/// How many transaction numbers are reserved ahead with one persisted high-water mark.
pub const TXN_RESERVE_BATCH: u64 = 1 << 20;

/// Most links to one inode (and so most subdirectories of one directory, plus 2), as ext4.
pub const LINK_COUNT_MAX: u32 = 65000;

/// Most extended attributes on one inode.
pub const XATTRS_PER_INODE_MAX: usize = 1024;

/// Permission bits.
pub const MODE_SET_USER_ID: u32 = 0o4000;
pub const MODE_SET_GROUP_ID: u32 = 0o2000;
pub const MODE_STICKY: u32 = 0o1000;

/// Access masks for [`require_access`], as `access(2)`.
pub const ACCESS_READ: u32 = 4;
pub const ACCESS_WRITE: u32 = 2;
pub const ACCESS_EXECUTE: u32 = 1;

/// Why an operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// Refused before any write: reply with this error, the batch goes on.
    #[error(transparent)]
    Refused(WireError),
    /// The store failed: the whole batch is aborted.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl OpError {
    /// The error as sent to the client.
    pub fn to_wire(&self) -> WireError {
        match self {
            OpError::Refused(error) => error.clone(),
            OpError::Store(error) => WireError::new(ErrorCode::Io, error.to_string()),
        }
    }

    /// The error code (`Io` for store failures).
    pub fn code(&self) -> ErrorCode {
        match self {
            OpError::Refused(error) => error.code,
            OpError::Store(_) => ErrorCode::Io,
        }
    }
}

pub type OpResult<T> = Result<T, OpError>;

pub fn refuse(code: ErrorCode, message: impl Into<String>) -> OpError {
    OpError::Refused(WireError::new(code, message))
}

/// Where new files' data goes: the registered I/O servers and the cluster default layout.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// Registered I/O servers to place new files on, in id order.
    pub servers: Vec<ServerId>,
    /// Servers not out of their chains but silent of late (a crash or a cut not yet
    /// counted out): no stripe is headed by one, but when `servers` are fewer than the
    /// copies asked for, chains take their missing copies from these, so a file made
    /// while servers come and go still gets every copy (writes wait for a silent member
    /// until it is put out, as they do for files already on it).
    pub spares: Vec<ServerId>,
    pub default_stripe_unit_bytes: u32,
    /// 0: all servers.
    pub default_stripe_count: u32,
    /// Copies of each stripe (1: not replicated).
    pub default_replicas: u32,
}

/// State owned by the single writer: counters kept in memory and persisted once per batch.
/// Cloned before a batch and restored if the batch aborts, so memory never runs ahead of
/// the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterState {
    pub next_inode: InodeId,
    /// Ids below this are reserved by the persisted high-water mark.
    pub reserved_until: InodeId,
    pub inode_count: u64,
    pub orphan_count: u64,
    pub boot_epoch: u64,
    /// Rotates the first server of new files' layouts.
    pub placement_counter: u64,
    /// The next transaction number, and the persisted bound of those reserved. Numbers are
    /// never reused, even after a crash lost the transactions that had them.
    pub next_txn: u64,
    pub txn_reserved_until: u64,
    /// The last transaction that was durable when the store was opened: everything after
    /// it in the previous run was lost.
    pub recovered_txn: u64,
    /// Set when a persisted high-water mark moved in this batch: the batch must be durable
    /// (an id or number handed out after a crash must never repeat one handed out before).
    pub high_water_moved: bool,
}

/// The persisted inode high-water mark: no inode at or past it was ever given out or
/// reserved (0 if the store was never initialised).
pub fn inode_high_water<R: StoreRead>(read: &R) -> Result<InodeId, StoreError> {
    Ok(read_counter(read, COUNTER_INODE_HIGH_WATER)?.unwrap_or(0))
}

fn read_counter<R: StoreRead>(read: &R, name: &[u8]) -> Result<Option<u64>, StoreError> {
    read.get(TableId::Counters, name)?
        .map(|bytes| decode_counter(&bytes))
        .transpose()
}

impl WriterState {
    /// Read the counters: O(1), never a scan. `None` if the store was never initialised.
    pub fn load<R: StoreRead>(read: &R) -> Result<Option<WriterState>, StoreError> {
        let Some(high_water) = read_counter(read, COUNTER_INODE_HIGH_WATER)? else {
            return Ok(None);
        };
        Ok(Some(WriterState {
            next_inode: high_water,
            reserved_until: high_water,
            inode_count: read_counter(read, COUNTER_INODE_COUNT)?.unwrap_or(0),
            orphan_count: read_counter(read, COUNTER_ORPHAN_COUNT)?.unwrap_or(0),
            boot_epoch: read_counter(read, COUNTER_BOOT_EPOCH)?.unwrap_or(0),
            placement_counter: 0,
            next_txn: read_counter(read, COUNTER_TXN_HIGH_WATER)?.unwrap_or(1),
            txn_reserved_until: read_counter(read, COUNTER_TXN_HIGH_WATER)?.unwrap_or(1),
            recovered_txn: read_counter(read, COUNTER_LAST_TXN)?.unwrap_or(0),
            high_water_moved: false,
        }))
    }

    /// The number of the next transaction; persists a new high-water mark when the
    /// reserved ones run out.
    pub fn begin_txn<W: StoreWrite>(&mut self, write: &mut W) -> Result<u64, StoreError> {
        if self.next_txn >= self.txn_reserved_until {
            let high_water = self.next_txn + TXN_RESERVE_BATCH;
            write.put(
                TableId::Counters,
                COUNTER_TXN_HIGH_WATER,
                &high_water.to_be_bytes(),
            )?;
            self.txn_reserved_until = high_water;
            self.high_water_moved = true;
        }
        let txn = self.next_txn;
        self.next_txn += 1;
        write.put(TableId::Counters, COUNTER_LAST_TXN, &txn.to_be_bytes())?;
        Ok(txn)
    }

    /// Write the counters kept in memory (once per batch, before commit).
    pub fn persist<W: StoreWrite>(&self, write: &mut W) -> Result<(), StoreError> {
        write.put(
            TableId::Counters,
            COUNTER_INODE_COUNT,
            &self.inode_count.to_be_bytes(),
        )?;
        write.put(
            TableId::Counters,
            COUNTER_ORPHAN_COUNT,
            &self.orphan_count.to_be_bytes(),
        )?;
        Ok(())
    }

    /// `count` fresh ids for a client to choose from (`ReserveInodes`): the first is
    /// returned. They lie below the persisted high-water mark, so no crash gives them out
    /// again; they count as inodes only once created.
    pub fn reserve_inodes<W: StoreWrite>(
        &mut self,
        write: &mut W,
        count: u64,
    ) -> Result<InodeId, StoreError> {
        let first = self.next_inode;
        self.cover_inodes_until(write, first + count, first + count + INODE_RESERVE_BATCH)?;
        self.next_inode = first + count;
        Ok(first)
    }

    /// Persist `high_water` as the new high-water mark if ids up to `end` (excluded) are
    /// not covered yet.
    fn cover_inodes_until<W: StoreWrite>(
        &mut self,
        write: &mut W,
        end: InodeId,
        high_water: InodeId,
    ) -> Result<(), StoreError> {
        if end > self.reserved_until {
            write.put(
                TableId::Counters,
                COUNTER_INODE_HIGH_WATER,
                &high_water.to_be_bytes(),
            )?;
            self.reserved_until = high_water;
            self.high_water_moved = true;
        }
        Ok(())
    }

    /// A fresh id; persists a new high-water mark every `INODE_RESERVE_BATCH` ids.
    pub fn allocate_inode<W: StoreWrite>(&mut self, write: &mut W) -> Result<InodeId, StoreError> {
        self.cover_inodes_until(
            write,
            self.next_inode + 1,
            self.next_inode + INODE_RESERVE_BATCH,
        )?;
        let inode = self.next_inode;
        self.next_inode += 1;
        self.inode_count += 1;
        Ok(inode)
    }
}

/// Initialise a store on first start (root directory and counters) or load its counters,
/// and begin a new boot epoch. Returns the writer state to run with.
pub fn initialise<W: StoreWrite>(write: &mut W, now: TimeSpec) -> Result<WriterState, StoreError> {
    let mut state = match WriterState::load(write)? {
        Some(state) => state,
        None => {
            let root = InodeRecord {
                attr: freeflow_types::Attr::new_inode(
                    freeflow_types::ROOT_INODE,
                    FileKind::Directory,
                    0o755,
                    0,
                    0,
                    now,
                ),
                parent: freeflow_types::ROOT_INODE,
                stripe_space: Vec::new(),
            };
            save_inode(write, &root)?;
            let high_water = freeflow_types::ROOT_INODE + 1;
            write.put(
                TableId::Counters,
                COUNTER_INODE_HIGH_WATER,
                &high_water.to_be_bytes(),
            )?;
            WriterState {
                next_inode: high_water,
                reserved_until: high_water,
                inode_count: 1,
                orphan_count: 0,
                boot_epoch: 0,
                placement_counter: 0,
                next_txn: 1,
                txn_reserved_until: 1,
                recovered_txn: 0,
                high_water_moved: false,
            }
        }
    };
    state.boot_epoch += 1;
    write.put(
        TableId::Counters,
        COUNTER_BOOT_EPOCH,
        &state.boot_epoch.to_be_bytes(),
    )?;
    state.persist(write)?;
    Ok(state)
}

/// Everything an operation needs besides its transaction and request.
pub struct OpContext<'a> {
    pub now: TimeSpec,
    pub placement: &'a Placement,
    pub state: &'a mut WriterState,
    /// The transaction this operation is part of.
    pub txn: u64,
    /// Set by an operation whose effects must be durable before anything acts on them
    /// outside the store (a truncation's cuts on the I/O servers).
    pub demand_durable: bool,
    /// The id the next inode created must have (a replayed create keeps the id the client
    /// was first given).
    pub forced_inode: Option<InodeId>,
    /// The layout the next regular file created must have (a replayed create keeps the
    /// layout the client was first given: it may have written data by it already).
    pub forced_layout: Option<freeflow_types::Layout>,
}

impl<'a> OpContext<'a> {
    pub fn new(
        now: TimeSpec,
        placement: &'a Placement,
        state: &'a mut WriterState,
        txn: u64,
    ) -> OpContext<'a> {
        OpContext {
            now,
            placement,
            state,
            txn,
            demand_durable: false,
            forced_inode: None,
            forced_layout: None,
        }
    }

    /// The id of a new inode: the forced one of a replay, else a fresh one.
    pub fn allocate_inode<W: StoreWrite>(&mut self, write: &mut W) -> OpResult<InodeId> {
        match self.forced_inode.take() {
            Some(inode) => {
                // Ids of the run before the restart lie below the high-water mark this run
                // started from; one still in use would be an applied create, never replayed.
                if inode == 0 || inode >= self.state.next_inode {
                    return Err(refuse(
                        ErrorCode::InvalidArgument,
                        format!("a replayed create cannot take inode {inode}"),
                    ));
                }
                if try_load_inode(write, inode)?.is_some() {
                    return Err(refuse(
                        ErrorCode::Exists,
                        format!("inode {inode} of a replayed create exists already"),
                    ));
                }
                self.state.inode_count += 1;
                Ok(inode)
            }
            None => Ok(self.state.allocate_inode(write)?),
        }
    }
}

/// The current time from the system clock.
pub fn now() -> TimeSpec {
    let elapsed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    TimeSpec::new(elapsed.as_secs() as i64, elapsed.subsec_nanos())
}

/// A directory entry name: 1..=255 bytes, not "." or "..", no '/' or NUL.
pub fn check_name(name: &str) -> OpResult<()> {
    if name.is_empty() {
        return Err(refuse(ErrorCode::InvalidArgument, "empty name"));
    }
    if name.len() > NAME_LENGTH_MAX {
        return Err(refuse(
            ErrorCode::NameTooLong,
            format!(
                "name of {} bytes is longer than {NAME_LENGTH_MAX}",
                name.len()
            ),
        ));
    }
    if name == "." || name == ".." {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            format!("name {name:?} is reserved"),
        ));
    }
    if name.contains('/') || name.contains('\0') {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            "name contains '/' or NUL",
        ));
    }
    Ok(())
}

pub fn try_load_inode<R: StoreRead>(
    read: &R,
    inode: InodeId,
) -> Result<Option<InodeRecord>, StoreError> {
    match read.get(TableId::Inodes, &inode_key(inode))? {
        Some(bytes) => Ok(Some(decode_inode(&bytes)?)),
        None => Ok(None),
    }
}

pub fn load_inode<R: StoreRead>(read: &R, inode: InodeId) -> OpResult<InodeRecord> {
    try_load_inode(read, inode)?
        .ok_or_else(|| refuse(ErrorCode::NotFound, format!("inode {inode} does not exist")))
}

/// A directory, or NotDirectory.
pub fn load_directory<R: StoreRead>(read: &R, inode: InodeId) -> OpResult<InodeRecord> {
    let record = load_inode(read, inode)?;
    if record.attr.kind != FileKind::Directory {
        return Err(refuse(
            ErrorCode::NotDirectory,
            format!("inode {inode} is not a directory"),
        ));
    }
    Ok(record)
}

pub fn save_inode<W: StoreWrite>(write: &mut W, record: &InodeRecord) -> Result<(), StoreError> {
    write.put(
        TableId::Inodes,
        &inode_key(record.attr.inode),
        &encode_inode(record),
    )
}

pub fn lookup_entry<R: StoreRead>(
    read: &R,
    parent: InodeId,
    name: &str,
) -> Result<Option<(InodeId, FileKind)>, StoreError> {
    match read.get(TableId::Dirents, &named_key(parent, name.as_bytes()))? {
        Some(bytes) => Ok(Some(decode_dirent(&bytes)?)),
        None => Ok(None),
    }
}

pub fn put_entry<W: StoreWrite>(
    write: &mut W,
    parent: InodeId,
    name: &str,
    child: InodeId,
    kind: FileKind,
) -> Result<(), StoreError> {
    write.put(
        TableId::Dirents,
        &named_key(parent, name.as_bytes()),
        &encode_dirent(child, kind),
    )
}

pub fn delete_entry<W: StoreWrite>(
    write: &mut W,
    parent: InodeId,
    name: &str,
) -> Result<(), StoreError> {
    write.delete(TableId::Dirents, &named_key(parent, name.as_bytes()))?;
    Ok(())
}

/// True if the directory has no entries (one range read of at most one pair).
pub fn directory_is_empty<R: StoreRead>(read: &R, inode: InodeId) -> Result<bool, StoreError> {
    let start = inode_key(inode);
    let end = inode_key(inode + 1);
    let first = read.range_keys(
        TableId::Dirents,
        Bound::Included(&start),
        Bound::Excluded(&end),
        1,
    )?;
    Ok(first.is_empty())
}

pub fn caller_in_group(caller: &Caller, group_id: u32) -> bool {
    caller.group_id == group_id || caller.groups.contains(&group_id)
}

/// POSIX access check: owner, group or other bits; root passes every check.
pub fn has_access(attr: &freeflow_types::Attr, caller: &Caller, mask: u32) -> bool {
    if caller.user_id == 0 {
        return true;
    }
    let bits = if caller.user_id == attr.user_id {
        (attr.permissions >> 6) & 7
    } else if caller_in_group(caller, attr.group_id) {
        (attr.permissions >> 3) & 7
    } else {
        attr.permissions & 7
    };
    bits & mask == mask
}

pub fn require_access(attr: &freeflow_types::Attr, caller: &Caller, mask: u32) -> OpResult<()> {
    if has_access(attr, caller, mask) {
        return Ok(());
    }
    let wanted = [
        (ACCESS_READ, "read"),
        (ACCESS_WRITE, "write"),
        (ACCESS_EXECUTE, "search"),
    ]
    .iter()
    .filter(|(bit, _)| mask & bit != 0)
    .map(|(_, name)| *name)
    .collect::<Vec<_>>()
    .join("+");
    Err(refuse(
        ErrorCode::PermissionDenied,
        format!(
            "user {} lacks {wanted} permission on inode {}",
            caller.user_id, attr.inode
        ),
    ))
}

/// The sticky-directory rule: in a sticky directory only the owner of the entry, the owner
/// of the directory or root may remove or rename it (EPERM, as Linux).
pub fn check_sticky(
    directory: &freeflow_types::Attr,
    victim: &freeflow_types::Attr,
    caller: &Caller,
) -> OpResult<()> {
    if directory.permissions & MODE_STICKY == 0
        || caller.user_id == 0
        || caller.user_id == directory.user_id
        || caller.user_id == victim.user_id
    {
        return Ok(());
    }
    Err(refuse(
        ErrorCode::NotPermitted,
        format!(
            "inode {} in sticky directory {} belongs to another user",
            victim.inode, directory.inode
        ),
    ))
}

/// A directory whose entries changed: mtime and ctime now.
pub fn touch_directory(record: &mut InodeRecord, now: TimeSpec) {
    record.attr.modify_time = now;
    record.attr.change_time = now;
    record.attr.generation += 1;
}

/// An inode whose own metadata changed: ctime now.
pub fn touch_change(record: &mut InodeRecord, now: TimeSpec) {
    record.attr.change_time = now;
    record.attr.generation += 1;
}

/// Delete an inode and everything keyed by it (symlink target, xattrs).
pub fn delete_inode<W: StoreWrite>(
    write: &mut W,
    state: &mut WriterState,
    inode: InodeId,
) -> Result<(), StoreError> {
    write.delete(TableId::Inodes, &inode_key(inode))?;
    write.delete(TableId::Symlinks, &inode_key(inode))?;
    // The objects are gone with the inode: no cut is left to make.
    write.delete(TableId::Truncations, &inode_key(inode))?;
    let start = inode_key(inode);
    let end = inode_key(inode + 1);
    loop {
        let names = write.range_keys(
            TableId::Xattrs,
            Bound::Included(&start),
            Bound::Excluded(&end),
            XATTRS_PER_INODE_MAX,
        )?;
        if names.is_empty() {
            break;
        }
        for key in names {
            write.delete(TableId::Xattrs, &key)?;
        }
    }
    state.inode_count = state.inode_count.saturating_sub(1);
    Ok(())
}

/// Remove one link of a non-directory inode whose name is already gone. At link count 0 a
/// regular file with data becomes an orphan (its record stays for open handles and the
/// reaper); anything else is deleted at once. Returns true if it became an orphan.
pub fn drop_link<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    mut record: InodeRecord,
) -> Result<bool, StoreError> {
    assert!(
        record.attr.kind != FileKind::Directory,
        "drop_link is for non-directories"
    );
    record.attr.link_count = record.attr.link_count.saturating_sub(1);
    touch_change(&mut record, context.now);
    if record.attr.link_count > 0 {
        save_inode(write, &record)?;
        return Ok(false);
    }
    match (&record.attr.kind, &record.attr.layout) {
        (FileKind::Regular, Some(layout)) => {
            let orphan = OrphanRecord {
                layout: layout.clone(),
                boot_epoch: context.state.boot_epoch,
            };
            write.put(
                TableId::Orphans,
                &inode_key(record.attr.inode),
                &encode_versioned(&orphan),
            )?;
            save_inode(write, &record)?;
            context.state.orphan_count += 1;
            Ok(true)
        }
        _ => {
            delete_inode(write, context.state, record.attr.inode)?;
            Ok(false)
        }
    }
}

#[cfg(test)]
mod model_tests;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
