//! Size commits from writers and directory layout templates.
//!
//! Size only grows through `CommitSize` (monotonic max), so writes that land out of order
//! never shrink a file; only an explicit set-attributes truncate makes it smaller. A commit
//! also carries the space of the stripes the writer touched, as their servers reported it;
//! the newest report per stripe (by its server's stamp) is kept, so commits arriving out of
//! order never undo a newer figure.

use freeflow_proto::meta::{CommitSize, SetDirLayout, StripeSpace};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{FILE_SIZE_MAX, REPLICAS_MAX, STRIPE_COUNT_MAX};
use freeflow_types::{Attr, FileKind, Layout};

use super::{load_inode, refuse, save_inode, touch_change, OpContext, OpResult};
use crate::store::StoreWrite;

pub fn commit_size<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &CommitSize,
) -> OpResult<Attr> {
    let mut record = load_inode(write, request.inode)?;
    if record.attr.kind != FileKind::Regular {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            format!("inode {} is not a regular file", request.inode),
        ));
    }
    if request.size_bytes > FILE_SIZE_MAX {
        return Err(refuse(
            ErrorCode::FileTooBig,
            format!(
                "size {} is larger than the limit {FILE_SIZE_MAX}",
                request.size_bytes
            ),
        ));
    }
    // Validated: write.
    for space in &request.space {
        record.absorb_space(space.stripe_index, space.allocated_bytes, space.stamp);
    }
    record.attr.size_bytes = record.attr.size_bytes.max(request.size_bytes);
    record.attr.modify_time = record.attr.modify_time.max(request.modify_time);
    touch_change(&mut record, context.now);
    save_inode(write, &record)?;
    Ok(record.attr)
}

/// Take the space of some stripes of `inode` as their I/O servers reported it after a cut
/// (newest report per stripe wins, see `InodeRecord::absorb_space`). A missing inode is not
/// an error: it was removed since, and its space with it. Only store failures.
pub fn absorb_stripe_space<W: StoreWrite>(
    write: &mut W,
    inode: freeflow_types::InodeId,
    spaces: &[StripeSpace],
) -> Result<(), crate::store::StoreError> {
    if spaces.is_empty() {
        return Ok(());
    }
    let Some(mut record) = super::try_load_inode(write, inode)? else {
        return Ok(());
    };
    let before = record.attr.allocated_bytes;
    for space in spaces {
        record.absorb_space(space.stripe_index, space.allocated_bytes, space.stamp);
    }
    if record.attr.allocated_bytes != before {
        save_inode(write, &record)?;
    }
    Ok(())
}

/// Set (or, with neither field, clear) the layout template of a directory. The template is
/// stored as the directory's `Attr.layout`: its unit and its stripe count (the length of its
/// server list, filled with the first registered servers) are what new files inherit; the
/// servers of each new file are chosen at its create.
pub fn set_dir_layout<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &SetDirLayout,
) -> OpResult<Attr> {
    let mut record = load_inode(write, request.inode)?;
    if record.attr.kind != FileKind::Directory {
        return Err(refuse(
            ErrorCode::NotDirectory,
            format!("inode {} is not a directory", request.inode),
        ));
    }
    let caller = &request.caller;
    if caller.user_id != 0 && caller.user_id != record.attr.user_id {
        return Err(refuse(
            ErrorCode::NotPermitted,
            format!(
                "user {} may not change the layout of directory {}",
                caller.user_id, request.inode
            ),
        ));
    }
    let template = match (
        request.stripe_unit_bytes,
        request.stripe_count,
        request.replicas,
    ) {
        (None, None, None) => None,
        (unit, count, replicas) => {
            let (current_unit, current_count, current_replicas) =
                super::create::layout_template(context.placement, &record.attr);
            let unit = unit.unwrap_or(current_unit);
            let servers = &context.placement.servers;
            let count = match count.unwrap_or(current_count) {
                0 => servers.len() as u32,
                count => count,
            };
            if count == 0 || count > STRIPE_COUNT_MAX {
                return Err(refuse(
                    ErrorCode::InvalidArgument,
                    format!("stripe count {count} is outside 1..={STRIPE_COUNT_MAX}"),
                ));
            }
            if count as usize > servers.len() {
                return Err(refuse(
                    ErrorCode::InvalidArgument,
                    format!(
                        "stripe count {count} is more than the {} registered I/O servers",
                        servers.len()
                    ),
                ));
            }
            let replicas = replicas.unwrap_or(current_replicas);
            if replicas == 0 || replicas > REPLICAS_MAX || replicas as usize > servers.len() {
                return Err(refuse(
                    ErrorCode::InvalidArgument,
                    format!(
                        "{replicas} copies of each stripe is outside 1..={} (at most one per I/O server, {REPLICAS_MAX} at most)",
                        servers.len().min(REPLICAS_MAX as usize)
                    ),
                ));
            }
            let (heads, copies) =
                super::create::chains_over(servers, 0, count as usize, replicas as usize);
            let layout = Layout::replicated(unit, heads, copies)
                .map_err(|error| refuse(ErrorCode::InvalidArgument, format!("layout: {error}")))?;
            Some(layout)
        }
    };
    // Validated: write.
    record.attr.layout = template;
    touch_change(&mut record, context.now);
    save_inode(write, &record)?;
    Ok(record.attr)
}
