//! Pending truncations: the cuts the I/O servers still owe after a shrink.
//!
//! DESIGN.md §3: "the meta server sets the size, then each I/O server cuts its object". A
//! shrinking set-attributes records its cuts in the same transaction that sets the size, so
//! a refused shrink cuts nothing and an accepted one is never forgotten, even across a
//! crash. The record is settled stripe by stripe as servers confirm their cut
//! (`cutter.rs`); what is left, the reaper retries.
//!
//! Per stripe the record keeps the SMALLEST size still to cut. After "truncate to 10" (cut
//! still pending) then "truncate to 100", the bytes between 10 and 100 must read as zeros,
//! so the object must still be cut at 10 although the size attribute is now 100. Cutting
//! at 10 also satisfies the later shrink (it removes more), so one size per stripe is
//! enough.

use std::ops::Bound;

use freeflow_types::{Attr, InodeId, Layout};

use super::OpResult;
use crate::records::{
    decode_inode_key, decode_versioned, encode_versioned, inode_key, TruncationRecord,
};
use crate::store::{StoreError, StoreRead, StoreWrite, TableId};

pub fn load_truncation<R: StoreRead>(
    read: &R,
    inode: InodeId,
) -> Result<Option<TruncationRecord>, StoreError> {
    read.get(TableId::Truncations, &inode_key(inode))?
        .map(|bytes| decode_versioned(TableId::Truncations, &bytes))
        .transpose()
}

/// Record that every stripe of `attr`'s file must be cut at `size_bytes` (or at a smaller
/// size still pending for it). `attr` is the inode as just changed: its generation marks
/// the record as this shrink's. Only store failures: call it after validating.
pub fn record_truncation<W: StoreWrite>(
    write: &mut W,
    attr: &Attr,
    layout: &Layout,
    size_bytes: u64,
) -> Result<TruncationRecord, StoreError> {
    let mut cuts: Vec<(u32, u64)> = (0..layout.stripe_count())
        .map(|stripe| (stripe, size_bytes))
        .collect();
    if let Some(pending) = load_truncation(write, attr.inode)? {
        for (stripe, pending_size_bytes) in pending.cuts {
            if let Some((_, cut_size_bytes)) = cuts.get_mut(stripe as usize) {
                *cut_size_bytes = (*cut_size_bytes).min(pending_size_bytes);
            }
        }
    }
    let record = TruncationRecord {
        layout: layout.clone(),
        generation: attr.generation,
        cuts,
    };
    write.put(
        TableId::Truncations,
        &inode_key(attr.inode),
        &encode_versioned(&record),
    )?;
    Ok(record)
}

/// Up to `limit` pending truncations with ids after `after`, in id order.
pub fn list_truncations<R: StoreRead>(
    read: &R,
    after: Option<InodeId>,
    limit: usize,
) -> OpResult<Vec<(InodeId, TruncationRecord)>> {
    let after_key = after.map(inode_key);
    let start = match &after_key {
        Some(key) => Bound::Excluded(key.as_slice()),
        None => Bound::Unbounded,
    };
    let pairs = read.range(TableId::Truncations, start, Bound::Unbounded, limit)?;
    let mut truncations = Vec::with_capacity(pairs.len());
    for (key, value) in pairs {
        let inode = decode_inode_key(TableId::Truncations, &key)?;
        truncations.push((inode, decode_versioned(TableId::Truncations, &value)?));
    }
    Ok(truncations)
}

/// Forget the cuts of `done_stripes`, confirmed by their servers, if the record is still
/// the one of `generation` (a newer shrink re-recorded every stripe: its own cutter settles
/// them). Deletes the record when nothing is left. Returns how many cuts remain pending.
pub fn settle_truncation<W: StoreWrite>(
    write: &mut W,
    inode: InodeId,
    generation: u64,
    done_stripes: &[u32],
) -> OpResult<usize> {
    let Some(mut record) = load_truncation(write, inode)? else {
        return Ok(0);
    };
    if record.generation != generation {
        return Ok(record.cuts.len());
    }
    // Validated: write.
    record
        .cuts
        .retain(|(stripe, _)| !done_stripes.contains(stripe));
    if record.cuts.is_empty() {
        write.delete(TableId::Truncations, &inode_key(inode))?;
    } else {
        write.put(
            TableId::Truncations,
            &inode_key(inode),
            &encode_versioned(&record),
        )?;
    }
    Ok(record.cuts.len())
}
