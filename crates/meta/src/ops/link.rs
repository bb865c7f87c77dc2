//! Hard links: a new name for an existing non-directory inode.

use freeflow_proto::meta::Link;
use freeflow_proto::ErrorCode;
use freeflow_types::{Attr, FileKind};

use super::{
    check_name, load_directory, load_inode, lookup_entry, put_entry, refuse, require_access,
    save_inode, touch_change, touch_directory, OpContext, OpResult, ACCESS_EXECUTE, ACCESS_WRITE,
    LINK_COUNT_MAX,
};
use crate::store::StoreWrite;

pub fn link<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Link,
) -> OpResult<Attr> {
    check_name(&request.target_name)?;
    let mut parent = load_directory(write, request.target_parent)?;
    require_access(&parent.attr, &request.caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    let mut record = load_inode(write, request.inode)?;
    if record.attr.kind == FileKind::Directory {
        return Err(refuse(
            ErrorCode::NotPermitted,
            format!(
                "inode {} is a directory: hard links to directories are not allowed",
                request.inode
            ),
        ));
    }
    if record.attr.link_count == 0 {
        return Err(refuse(
            ErrorCode::NotFound,
            format!("inode {} has been unlinked", request.inode),
        ));
    }
    if record.attr.link_count >= LINK_COUNT_MAX {
        return Err(refuse(
            ErrorCode::TooManyLinks,
            format!("inode {} has {LINK_COUNT_MAX} links", request.inode),
        ));
    }
    if lookup_entry(write, request.target_parent, &request.target_name)?.is_some() {
        return Err(refuse(
            ErrorCode::Exists,
            format!(
                "{:?} already exists in directory {}",
                request.target_name, request.target_parent
            ),
        ));
    }
    // Validated: write.
    put_entry(
        write,
        request.target_parent,
        &request.target_name,
        request.inode,
        record.attr.kind,
    )?;
    record.attr.link_count += 1;
    touch_change(&mut record, context.now);
    save_inode(write, &record)?;
    touch_directory(&mut parent, context.now);
    save_inode(write, &parent)?;
    Ok(record.attr)
}
