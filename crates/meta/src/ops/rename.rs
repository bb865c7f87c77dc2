//! Rename in its three modes (replace, no-replace, exchange), within and across
//! directories.
//!
//! Everything is checked before the first write: both names, both parents' permissions, the
//! sticky rule for both entries, kind compatibility of a replaced target, emptiness of a
//! replaced directory, and that no directory is moved into its own subtree (by walking the
//! parent pointers of directories up to the root, never by scanning). Parent link counts
//! follow moved directories.

use freeflow_proto::meta::{Rename, RenameMode};
use freeflow_proto::ErrorCode;
use freeflow_types::{FileKind, InodeId, ROOT_INODE};

use super::{
    check_name, check_sticky, delete_entry, delete_inode, directory_is_empty, drop_link,
    load_directory, load_inode, lookup_entry, put_entry, refuse, require_access, save_inode,
    touch_change, touch_directory, OpContext, OpResult, ACCESS_EXECUTE, ACCESS_WRITE,
    LINK_COUNT_MAX,
};
use crate::store::{StoreRead, StoreWrite};

/// Deepest directory tree walked when checking for a move into a subtree; deeper means a
/// corrupt parent chain (a cycle), reported rather than looped on.
pub const DIRECTORY_DEPTH_MAX: usize = 65536;

/// True if `ancestor` is `directory` or one of its ancestors.
fn is_ancestor_or_self<R: StoreRead>(
    read: &R,
    ancestor: InodeId,
    directory: InodeId,
) -> OpResult<bool> {
    let mut current = directory;
    for _ in 0..DIRECTORY_DEPTH_MAX {
        if current == ancestor {
            return Ok(true);
        }
        if current == ROOT_INODE {
            return Ok(false);
        }
        current = load_inode(read, current)?.parent;
    }
    Err(refuse(
        ErrorCode::Loop,
        format!("parent chain of directory {directory} does not end"),
    ))
}

pub fn rename<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Rename,
) -> OpResult<()> {
    let caller = &request.caller;
    check_name(&request.source_name)?;
    check_name(&request.target_name)?;
    let mut source_parent = load_directory(write, request.source_parent)?;
    let mut target_parent = load_directory(write, request.target_parent)?;
    require_access(&source_parent.attr, caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    require_access(&target_parent.attr, caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    let (source_id, source_kind) =
        lookup_entry(write, request.source_parent, &request.source_name)?.ok_or_else(|| {
            refuse(
                ErrorCode::NotFound,
                format!(
                    "no entry {:?} in directory {}",
                    request.source_name, request.source_parent
                ),
            )
        })?;
    let mut source = load_inode(write, source_id)?;
    check_sticky(&source_parent.attr, &source.attr, caller)?;
    let target_entry = lookup_entry(write, request.target_parent, &request.target_name)?;
    match (request.mode, target_entry) {
        (RenameMode::NoReplace, Some(_)) => {
            return Err(refuse(
                ErrorCode::Exists,
                format!(
                    "{:?} exists in directory {}",
                    request.target_name, request.target_parent
                ),
            ))
        }
        (RenameMode::Exchange, None) => {
            return Err(refuse(
                ErrorCode::NotFound,
                format!(
                    "no entry {:?} in directory {} to exchange with",
                    request.target_name, request.target_parent
                ),
            ))
        }
        // Two names of one inode (or one name twice): POSIX says do nothing.
        (_, Some((target_id, _))) if target_id == source_id => return Ok(()),
        _ => {}
    }
    let mut target = match target_entry {
        Some((target_id, _)) => Some(load_inode(write, target_id)?),
        None => None,
    };
    if let Some(target) = &target {
        check_sticky(&target_parent.attr, &target.attr, caller)?;
    }
    let source_is_directory = source_kind == FileKind::Directory;
    let target_is_directory = target_entry.is_some_and(|(_, kind)| kind == FileKind::Directory);
    let exchange = request.mode == RenameMode::Exchange;
    if !exchange {
        if let Some(target) = &target {
            if source_is_directory && !target_is_directory {
                return Err(refuse(
                    ErrorCode::NotDirectory,
                    format!(
                        "cannot replace non-directory {:?} with a directory",
                        request.target_name
                    ),
                ));
            }
            if !source_is_directory && target_is_directory {
                return Err(refuse(
                    ErrorCode::IsDirectory,
                    format!(
                        "cannot replace directory {:?} with a non-directory",
                        request.target_name
                    ),
                ));
            }
            if target_is_directory && !directory_is_empty(write, target.attr.inode)? {
                return Err(refuse(
                    ErrorCode::NotEmpty,
                    format!("directory {:?} is not empty", request.target_name),
                ));
            }
        }
    }
    let moves_across = request.source_parent != request.target_parent;
    if source_is_directory && moves_across {
        if is_ancestor_or_self(write, source_id, request.target_parent)? {
            return Err(refuse(
                ErrorCode::InvalidArgument,
                format!("cannot move directory {source_id} into its own subtree"),
            ));
        }
        // Its ".." changes: Linux wants write permission on the moved directory.
        require_access(&source.attr, caller, ACCESS_WRITE)?;
    }
    if exchange && target_is_directory && moves_across {
        let target_id = target_entry.map(|(id, _)| id).unwrap_or_default();
        if is_ancestor_or_self(write, target_id, request.source_parent)? {
            return Err(refuse(
                ErrorCode::InvalidArgument,
                format!("cannot move directory {target_id} into its own subtree"),
            ));
        }
        if let Some(target) = &target {
            require_access(&target.attr, caller, ACCESS_WRITE)?;
        }
    }
    // Link count changes of the parents ("..": one per subdirectory).
    let mut source_parent_delta: i64 = 0;
    let mut target_parent_delta: i64 = 0;
    if source_is_directory {
        source_parent_delta -= 1;
        target_parent_delta += 1;
    }
    if target_is_directory {
        target_parent_delta -= 1;
        if exchange {
            source_parent_delta += 1;
        }
    }
    if !moves_across {
        source_parent_delta += target_parent_delta;
        target_parent_delta = 0;
    }
    for (record, delta) in [
        (&source_parent, source_parent_delta),
        (&target_parent, target_parent_delta),
    ] {
        if delta > 0 && i64::from(record.attr.link_count) + delta > i64::from(LINK_COUNT_MAX) {
            return Err(refuse(
                ErrorCode::TooManyLinks,
                format!("directory {} has {LINK_COUNT_MAX} links", record.attr.inode),
            ));
        }
    }

    // Validated: write.
    let now = context.now;
    if exchange {
        let (target_id, target_kind) = target_entry.unwrap_or((0, FileKind::Regular));
        put_entry(
            write,
            request.source_parent,
            &request.source_name,
            target_id,
            target_kind,
        )?;
        put_entry(
            write,
            request.target_parent,
            &request.target_name,
            source_id,
            source_kind,
        )?;
        if let Some(target) = target.as_mut() {
            if target_is_directory {
                target.parent = request.source_parent;
            }
            touch_change(target, now);
            save_inode(write, target)?;
        }
    } else {
        delete_entry(write, request.source_parent, &request.source_name)?;
        put_entry(
            write,
            request.target_parent,
            &request.target_name,
            source_id,
            source_kind,
        )?;
        if let Some(target) = target.take() {
            if target_is_directory {
                delete_inode(write, context.state, target.attr.inode)?;
            } else {
                drop_link(write, context, target)?;
            }
        }
    }
    if source_is_directory {
        source.parent = request.target_parent;
    }
    touch_change(&mut source, now);
    save_inode(write, &source)?;
    let apply = |count: u32, delta: i64| (i64::from(count) + delta).max(0) as u32;
    source_parent.attr.link_count = apply(source_parent.attr.link_count, source_parent_delta);
    touch_directory(&mut source_parent, now);
    save_inode(write, &source_parent)?;
    if moves_across {
        target_parent.attr.link_count = apply(target_parent.attr.link_count, target_parent_delta);
        touch_directory(&mut target_parent, now);
        save_inode(write, &target_parent)?;
    }
    Ok(())
}
