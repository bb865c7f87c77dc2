//! Read-only name and attribute queries: lookup, getattr, readlink. They run in read
//! transactions, concurrently with the writer (MVCC), and never write.

use freeflow_proto::meta::{GetAttr, Lookup, ReadLink};
use freeflow_proto::ErrorCode;
use freeflow_types::{Attr, FileKind};

use super::{
    check_name, load_directory, load_inode, lookup_entry, refuse, require_access, OpResult,
    ACCESS_EXECUTE,
};
use crate::records::inode_key;
use crate::store::{StoreRead, TableId};

/// The attributes of `name` in `parent`; needs search permission on `parent`.
pub fn lookup<R: StoreRead>(read: &R, request: &Lookup) -> OpResult<Attr> {
    check_name(&request.name)?;
    let parent = load_directory(read, request.parent)?;
    require_access(&parent.attr, &request.caller, ACCESS_EXECUTE)?;
    let (child, _) = lookup_entry(read, request.parent, &request.name)?.ok_or_else(|| {
        refuse(
            ErrorCode::NotFound,
            format!(
                "no entry {:?} in directory {}",
                request.name, request.parent
            ),
        )
    })?;
    Ok(load_inode(read, child)?.attr)
}

/// The attributes of `inode`, if it still exists.
pub fn attr_of<R: StoreRead>(read: &R, inode: freeflow_types::InodeId) -> OpResult<Option<Attr>> {
    Ok(super::try_load_inode(read, inode)?.map(|record| record.attr))
}

pub fn get_attr<R: StoreRead>(read: &R, request: &GetAttr) -> OpResult<Attr> {
    Ok(load_inode(read, request.inode)?.attr)
}

pub fn read_link<R: StoreRead>(read: &R, request: &ReadLink) -> OpResult<String> {
    let record = load_inode(read, request.inode)?;
    if record.attr.kind != FileKind::Symlink {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            format!("inode {} is not a symbolic link", request.inode),
        ));
    }
    let bytes = read
        .get(TableId::Symlinks, &inode_key(request.inode))?
        .ok_or_else(|| {
            refuse(
                ErrorCode::Io,
                format!("symlink {} has no target record", request.inode),
            )
        })?;
    String::from_utf8(bytes).map_err(|_| {
        refuse(
            ErrorCode::Io,
            format!("symlink {} target is not UTF-8", request.inode),
        )
    })
}
