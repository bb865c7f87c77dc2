//! Removing names: unlink (non-directories) and rmdir (empty directories).
//!
//! The name goes at once. An unlinked regular file whose last link is gone becomes an
//! orphan: its inode stays for open handles and its data is removed later by the reaper.

use freeflow_proto::meta::{Caller, Rmdir, Unlink};
use freeflow_proto::ErrorCode;
use freeflow_types::{FileKind, InodeId};

use super::{
    check_name, check_sticky, delete_entry, delete_inode, directory_is_empty, drop_link,
    load_directory, load_inode, lookup_entry, refuse, require_access, save_inode, touch_directory,
    OpContext, OpResult, ACCESS_EXECUTE, ACCESS_WRITE,
};
use crate::records::InodeRecord;
use crate::store::StoreWrite;

/// The parent (checked for write+search) and the entry to remove (checked for the sticky
/// rule), without writing anything.
fn find_victim<W: StoreWrite>(
    write: &W,
    caller: &Caller,
    parent: InodeId,
    name: &str,
) -> OpResult<(InodeRecord, InodeRecord)> {
    check_name(name)?;
    let parent_record = load_directory(write, parent)?;
    require_access(&parent_record.attr, caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    let (child, _) = lookup_entry(write, parent, name)?.ok_or_else(|| {
        refuse(
            ErrorCode::NotFound,
            format!("no entry {name:?} in directory {parent}"),
        )
    })?;
    let child_record = load_inode(write, child)?;
    check_sticky(&parent_record.attr, &child_record.attr, caller)?;
    Ok((parent_record, child_record))
}

pub fn unlink<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Unlink,
) -> OpResult<()> {
    let (mut parent, child) = find_victim(write, &request.caller, request.parent, &request.name)?;
    if child.attr.kind == FileKind::Directory {
        return Err(refuse(
            ErrorCode::IsDirectory,
            format!("{:?} is a directory: use rmdir", request.name),
        ));
    }
    // Validated: write.
    delete_entry(write, request.parent, &request.name)?;
    touch_directory(&mut parent, context.now);
    save_inode(write, &parent)?;
    drop_link(write, context, child)?;
    Ok(())
}

pub fn rmdir<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Rmdir,
) -> OpResult<()> {
    let (mut parent, child) = find_victim(write, &request.caller, request.parent, &request.name)?;
    if child.attr.kind != FileKind::Directory {
        return Err(refuse(
            ErrorCode::NotDirectory,
            format!("{:?} is not a directory", request.name),
        ));
    }
    if !directory_is_empty(write, child.attr.inode)? {
        return Err(refuse(
            ErrorCode::NotEmpty,
            format!("{:?} is not empty", request.name),
        ));
    }
    // Validated: write.
    delete_entry(write, request.parent, &request.name)?;
    parent.attr.link_count = parent.attr.link_count.saturating_sub(1);
    touch_directory(&mut parent, context.now);
    save_inode(write, &parent)?;
    delete_inode(write, context.state, child.attr.inode)?;
    Ok(())
}
