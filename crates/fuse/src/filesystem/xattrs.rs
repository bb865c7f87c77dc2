//! The handlers of extended attributes: setxattr, getxattr, listxattr and removexattr.

use std::ffi::OsStr;

use freeflow_client::XattrSetMode;
use fuser::{Errno, INodeNo};

use super::FreeflowFs;
use crate::convert::{self, errno};
use crate::reply::{Caller, ReplyEmpty, ReplyXattr};

/// Reply to a getxattr or listxattr: the size for a size probe, ERANGE if the caller's
/// buffer is too small, else the bytes.
fn reply_xattr(reply: ReplyXattr, value: &[u8], size: u32) {
    let Ok(length) = u32::try_from(value.len()) else {
        return reply.error(Errno::E2BIG);
    };
    if size == 0 {
        reply.size(length)
    } else if length > size {
        reply.error(Errno::ERANGE)
    } else {
        reply.data(value)
    }
}

/// The handlers of extended attributes, with the operations' arguments as the kernel gives
/// them (hence their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
    pub(crate) fn setxattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        // The kernel drops the times (and, for an allocation, the size) it holds.
        self.state.cache.touched(inode.0);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let mode = match flags {
            0 => XattrSetMode::Any,
            libc::XATTR_CREATE => XattrSetMode::CreateOnly,
            libc::XATTR_REPLACE => XattrSetMode::ReplaceOnly,
            _ => return reply.error(Errno::EINVAL),
        };
        let value = value.to_vec();
        let client = self.caller(request);
        self.spawn(async move {
            match client.set_xattr(inode.0, &name, &value, mode).await {
                Ok(()) => reply.ok(),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn getxattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        name: &OsStr,
        size: u32,
        reply: ReplyXattr,
    ) {
        self.settle(&[inode.0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let client = self.caller(request);
        self.spawn(async move {
            match client.get_xattr(inode.0, &name).await {
                Ok(value) => reply_xattr(reply, &value, size),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn listxattr(&self, request: &Caller, inode: INodeNo, size: u32, reply: ReplyXattr) {
        self.settle(&[inode.0]);
        let client = self.caller(request);
        self.spawn(async move {
            match client.list_xattr(inode.0).await {
                Ok(names) => {
                    let mut list = Vec::new();
                    for name in names {
                        list.extend_from_slice(name.as_bytes());
                        list.push(0);
                    }
                    reply_xattr(reply, &list, size)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn removexattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        // The kernel drops the times (and, for an allocation, the size) it holds.
        self.state.cache.touched(inode.0);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let client = self.caller(request);
        self.spawn(async move {
            match client.remove_xattr(inode.0, &name).await {
                Ok(()) => reply.ok(),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }
}
