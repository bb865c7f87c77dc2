//! Orphans: unlinked regular files whose data is still on I/O servers. The reaper lists
//! them here and, once every server has removed the objects, deletes the record and the
//! inode in one transaction.

use std::ops::Bound;

use freeflow_types::InodeId;

use super::{delete_inode, try_load_inode, OpContext, OpResult};
use crate::records::{decode_inode_key, decode_versioned, inode_key, OrphanRecord};
use crate::store::{StoreRead, StoreWrite, TableId};

/// Up to `limit` orphans with ids after `after`, in id order.
pub fn list_orphans<R: StoreRead>(
    read: &R,
    after: Option<InodeId>,
    limit: usize,
) -> OpResult<Vec<(InodeId, OrphanRecord)>> {
    let after_key = after.map(inode_key);
    let start = match &after_key {
        Some(key) => Bound::Excluded(key.as_slice()),
        None => Bound::Unbounded,
    };
    let pairs = read.range(TableId::Orphans, start, Bound::Unbounded, limit)?;
    let mut orphans = Vec::with_capacity(pairs.len());
    for (key, value) in pairs {
        let inode = decode_inode_key(TableId::Orphans, &key)?;
        orphans.push((inode, decode_versioned(TableId::Orphans, &value)?));
    }
    Ok(orphans)
}

/// Forget an orphan whose data is gone. False if it was already forgotten.
pub fn forget_orphan<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    inode: InodeId,
) -> OpResult<bool> {
    if write.get(TableId::Orphans, &inode_key(inode))?.is_none() {
        return Ok(false);
    }
    let still_unlinked = try_load_inode(write, inode)?.map(|record| record.attr.link_count == 0);
    // Validated: write.
    write.delete(TableId::Orphans, &inode_key(inode))?;
    context.state.orphan_count = context.state.orphan_count.saturating_sub(1);
    if still_unlinked == Some(true) {
        delete_inode(write, context.state, inode)?;
    }
    Ok(true)
}
