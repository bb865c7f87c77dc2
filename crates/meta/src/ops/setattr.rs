//! Set attributes: permissions, owner, group, size and times, with the POSIX rules.
//!
//! - chmod: only the owner or root (EPERM); a caller that is not root and not in the file's
//!   group loses the setgid bit.
//! - chown: only root changes the user; the owner may change the group to one of its own.
//!   A change of owner or group clears setuid (and setgid if group-executable) on files.
//! - size: regular files only, needs write permission (or a handle open for writing named
//!   by the request: `ftruncate`); a change sets mtime. A shrink, and any size change of
//!   an open file, also records the cuts the I/O servers must make, in the same
//!   transaction (`truncate.rs`).
//!   A caller that is not root loses the file's setuid bit (and setgid if group-executable),
//!   as Linux does on truncate, unless the same request sets the permissions.
//! - atime/mtime: the owner, root, or a caller with write permission.
//! - ctime is set to now on every change (or to the explicit value, owner or root only).

use freeflow_proto::meta::SetAttributes;
use freeflow_proto::ErrorCode;
use freeflow_types::limits::FILE_SIZE_MAX;
use freeflow_types::{Attr, FileKind};

use super::truncate::record_truncation;
use super::{
    caller_in_group, has_access, load_inode, refuse, require_access, save_inode, OpContext,
    OpResult, ACCESS_WRITE, MODE_SET_GROUP_ID, MODE_SET_USER_ID,
};
use crate::records::TruncationRecord;
use crate::store::StoreWrite;

/// What a set-attributes changed, and the cuts a shrink left for the I/O servers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetAttrOutcome {
    pub attr: Attr,
    /// Some after a shrink of a regular file with data: the pending truncation as recorded
    /// (already durable when the batch commits); send its cuts, then settle it.
    pub truncation: Option<TruncationRecord>,
}

/// [`set_attributes`], and for a size change of a regular file the record of its cuts, in
/// the same transaction (`truncate.rs`).
///
/// Which size changes cut: every shrink, and while the file is open anywhere, every size
/// change at all. The meta server knows only the sizes writers have committed; a writer's
/// bytes acknowledged by the I/O servers but not committed yet lie beyond the size it
/// knows. A "grow" from the committed size may so really be a shrink, and without the cut
/// those bytes would reappear inside the new size. With no handle open, every writer has
/// closed, and closing commits the size, so the size is exact and a grow needs no cut.
///
/// `is_open` says whether the file has open handles. An unlinked file without any is left
/// to the reaper: it removes the objects whole, and a cut racing that removal could
/// re-create an object nobody would ever remove. `through_handle_writable` says the size
/// change comes through an open handle with write access (see [`set_attributes`]).
pub fn set_attributes_recording_cuts<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &SetAttributes,
    is_open: impl FnOnce(freeflow_types::InodeId) -> bool,
    through_handle_writable: bool,
) -> OpResult<SetAttrOutcome> {
    let size_before_bytes = load_inode(write, request.inode)?.attr.size_bytes;
    let attr = set_attributes(write, context, request, through_handle_writable)?;
    let truncation = match (&attr.layout, request.changes.size_bytes) {
        (Some(layout), Some(size_bytes)) if attr.kind == FileKind::Regular => {
            let open = is_open(attr.inode);
            let may_hide_bytes = size_bytes < size_before_bytes || open;
            if may_hide_bytes && (attr.link_count > 0 || open) {
                // The cuts act on the I/O servers: the size they cut to must not be lost.
                context.demand_durable = true;
                Some(record_truncation(write, &attr, layout, size_bytes)?)
            } else {
                None
            }
        }
        _ => None,
    };
    Ok(SetAttrOutcome { attr, truncation })
}

/// Apply the changes after the POSIX checks. A size change needs write permission on the
/// file, unless `through_handle_writable`: the caller changes the size through a descriptor
/// it opened for writing (`ftruncate`), which POSIX authorises by the descriptor, whatever
/// the mode bits say now.
pub fn set_attributes<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &SetAttributes,
    through_handle_writable: bool,
) -> OpResult<Attr> {
    let caller = &request.caller;
    let changes = &request.changes;
    let mut record = load_inode(write, request.inode)?;
    let attr = &record.attr;
    let is_root = caller.user_id == 0;
    let is_owner = is_root || caller.user_id == attr.user_id;
    let not_permitted = |what: &str| {
        refuse(
            ErrorCode::NotPermitted,
            format!(
                "user {} may not {what} inode {}",
                caller.user_id, request.inode
            ),
        )
    };
    if changes.permissions.is_some() && !is_owner {
        return Err(not_permitted("change the permissions of"));
    }
    let user_changes = changes.user_id.is_some_and(|user| user != attr.user_id);
    let group_changes = changes.group_id.is_some_and(|group| group != attr.group_id);
    if user_changes && !is_root {
        return Err(not_permitted("change the owner of"));
    }
    if let Some(group) = changes.group_id {
        if group_changes && !is_root && !(is_owner && caller_in_group(caller, group)) {
            return Err(not_permitted("change the group of"));
        }
    }
    if let Some(size) = changes.size_bytes {
        match attr.kind {
            FileKind::Regular => {}
            FileKind::Directory => {
                return Err(refuse(
                    ErrorCode::IsDirectory,
                    format!(
                        "inode {} is a directory: it has no size to set",
                        request.inode
                    ),
                ))
            }
            _ => {
                return Err(refuse(
                    ErrorCode::InvalidArgument,
                    format!(
                        "inode {} is not a regular file: it has no size to set",
                        request.inode
                    ),
                ))
            }
        }
        if size > FILE_SIZE_MAX {
            return Err(refuse(
                ErrorCode::FileTooBig,
                format!("size {size} is larger than the limit {FILE_SIZE_MAX}"),
            ));
        }
        if !through_handle_writable {
            require_access(attr, caller, ACCESS_WRITE)?;
        }
    }
    if (changes.access_time.is_some() || changes.modify_time.is_some())
        && !is_owner
        && !has_access(attr, caller, ACCESS_WRITE)
    {
        return Err(refuse(
            ErrorCode::PermissionDenied,
            format!(
                "user {} may not set the times of inode {}",
                caller.user_id, request.inode
            ),
        ));
    }
    if changes.change_time.is_some() && !is_owner {
        return Err(not_permitted("set the change time of"));
    }

    // Validated: write.
    let now = context.now;
    let attr = &mut record.attr;
    if let Some(user) = changes.user_id {
        attr.user_id = user;
    }
    if let Some(group) = changes.group_id {
        attr.group_id = group;
    }
    if (user_changes || group_changes) && attr.kind != FileKind::Directory {
        attr.permissions &= !MODE_SET_USER_ID;
        if attr.permissions & 0o010 != 0 {
            attr.permissions &= !MODE_SET_GROUP_ID;
        }
    }
    if let Some(permissions) = changes.permissions {
        attr.permissions = permissions & 0o7777;
        if !is_root && !caller_in_group(caller, attr.group_id) {
            attr.permissions &= !MODE_SET_GROUP_ID;
        }
    }
    if let Some(size) = changes.size_bytes {
        if size != attr.size_bytes {
            attr.size_bytes = size;
            attr.modify_time = now;
        }
        if !is_root && changes.permissions.is_none() {
            attr.permissions &= !MODE_SET_USER_ID;
            if attr.permissions & 0o010 != 0 {
                attr.permissions &= !MODE_SET_GROUP_ID;
            }
        }
    }
    if let Some(time) = changes.access_time {
        attr.access_time = time;
    }
    if let Some(time) = changes.modify_time {
        attr.modify_time = time;
    }
    attr.change_time = changes.change_time.unwrap_or(now);
    attr.generation += 1;
    save_inode(write, &record)?;
    Ok(record.attr)
}
