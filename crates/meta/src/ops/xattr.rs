//! Extended attributes: get, list (read transactions), set, remove (writer).
//!
//! Reading needs read permission, changing needs write permission; names in the
//! `trusted.` namespace are root's only (hidden from others, as Linux). Names longer than
//! `XATTR_NAME_LENGTH_MAX` or values longer than `XATTR_VALUE_LENGTH_MAX` are refused with
//! `OutOfRange` (Linux's ERANGE / E2BIG).

use std::ops::Bound;

use freeflow_proto::meta::{Caller, GetXattr, ListXattr, RemoveXattr, SetXattr, XattrSetMode};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{XATTR_NAME_LENGTH_MAX, XATTR_VALUE_LENGTH_MAX};
use freeflow_types::InodeId;

use super::{
    load_inode, refuse, require_access, save_inode, touch_change, OpContext, OpResult, ACCESS_READ,
    ACCESS_WRITE, XATTRS_PER_INODE_MAX,
};
use crate::records::{inode_key, name_of_key, named_key};
use crate::store::{StoreRead, StoreWrite, TableId};

const TRUSTED_PREFIX: &str = "trusted.";

fn check_xattr_name(name: &str) -> OpResult<()> {
    if name.is_empty() || name.contains('\0') {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            "empty xattr name or name with NUL",
        ));
    }
    if name.len() > XATTR_NAME_LENGTH_MAX {
        return Err(refuse(
            ErrorCode::OutOfRange,
            format!(
                "xattr name of {} bytes is longer than {XATTR_NAME_LENGTH_MAX}",
                name.len()
            ),
        ));
    }
    Ok(())
}

fn visible(name: &str, caller: &Caller) -> bool {
    caller.user_id == 0 || !name.starts_with(TRUSTED_PREFIX)
}

fn no_data(inode: InodeId, name: &str) -> super::OpError {
    refuse(
        ErrorCode::NoData,
        format!("inode {inode} has no xattr {name:?}"),
    )
}

fn list_names<R: StoreRead>(read: &R, inode: InodeId, limit: usize) -> OpResult<Vec<String>> {
    let start = inode_key(inode);
    let end = inode_key(inode + 1);
    let keys = read.range_keys(
        TableId::Xattrs,
        Bound::Included(&start),
        Bound::Excluded(&end),
        limit,
    )?;
    let mut names = Vec::with_capacity(keys.len());
    for key in keys {
        names.push(name_of_key(TableId::Xattrs, &key)?);
    }
    Ok(names)
}

pub fn get_xattr<R: StoreRead>(read: &R, request: &GetXattr) -> OpResult<Vec<u8>> {
    check_xattr_name(&request.name)?;
    let record = load_inode(read, request.inode)?;
    require_access(&record.attr, &request.caller, ACCESS_READ)?;
    if !visible(&request.name, &request.caller) {
        return Err(no_data(request.inode, &request.name));
    }
    read.get(
        TableId::Xattrs,
        &named_key(request.inode, request.name.as_bytes()),
    )?
    .ok_or_else(|| no_data(request.inode, &request.name))
}

pub fn list_xattr<R: StoreRead>(read: &R, request: &ListXattr) -> OpResult<Vec<String>> {
    let record = load_inode(read, request.inode)?;
    require_access(&record.attr, &request.caller, ACCESS_READ)?;
    let mut names = list_names(read, request.inode, XATTRS_PER_INODE_MAX)?;
    names.retain(|name| visible(name, &request.caller));
    Ok(names)
}

fn check_change(caller: &Caller, name: &str) -> OpResult<()> {
    if !visible(name, caller) {
        return Err(refuse(
            ErrorCode::NotPermitted,
            format!("only root may change {TRUSTED_PREFIX}* attributes"),
        ));
    }
    Ok(())
}

pub fn set_xattr<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &SetXattr,
) -> OpResult<()> {
    check_xattr_name(&request.name)?;
    if request.value.len() > XATTR_VALUE_LENGTH_MAX {
        return Err(refuse(
            ErrorCode::OutOfRange,
            format!(
                "xattr value of {} bytes is longer than {XATTR_VALUE_LENGTH_MAX}",
                request.value.len()
            ),
        ));
    }
    let mut record = load_inode(write, request.inode)?;
    require_access(&record.attr, &request.caller, ACCESS_WRITE)?;
    check_change(&request.caller, &request.name)?;
    let key = named_key(request.inode, request.name.as_bytes());
    let exists = write.get(TableId::Xattrs, &key)?.is_some();
    match (request.mode, exists) {
        (XattrSetMode::CreateOnly, true) => {
            return Err(refuse(
                ErrorCode::Exists,
                format!(
                    "inode {} already has xattr {:?}",
                    request.inode, request.name
                ),
            ))
        }
        (XattrSetMode::ReplaceOnly, false) => return Err(no_data(request.inode, &request.name)),
        _ => {}
    }
    if !exists
        && list_names(write, request.inode, XATTRS_PER_INODE_MAX)?.len() >= XATTRS_PER_INODE_MAX
    {
        return Err(refuse(
            ErrorCode::NoSpace,
            format!("inode {} has {XATTRS_PER_INODE_MAX} xattrs", request.inode),
        ));
    }
    // Validated: write.
    write.put(TableId::Xattrs, &key, &request.value)?;
    touch_change(&mut record, context.now);
    save_inode(write, &record)?;
    Ok(())
}

pub fn remove_xattr<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &RemoveXattr,
) -> OpResult<()> {
    check_xattr_name(&request.name)?;
    let mut record = load_inode(write, request.inode)?;
    require_access(&record.attr, &request.caller, ACCESS_WRITE)?;
    check_change(&request.caller, &request.name)?;
    let key = named_key(request.inode, request.name.as_bytes());
    if write.get(TableId::Xattrs, &key)?.is_none() {
        return Err(no_data(request.inode, &request.name));
    }
    // Validated: write.
    write.delete(TableId::Xattrs, &key)?;
    touch_change(&mut record, context.now);
    save_inode(write, &record)?;
    Ok(())
}
