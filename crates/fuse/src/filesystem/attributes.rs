//! The handlers of attributes: getattr, setattr (with the times of a file unlinked ahead,
//! `times_of_unlinked`), readlink, access and statfs.

use std::time::Duration;

use freeflow_client::{InodeId, Lease, SetAttr};
use fuser::{AccessFlags, FileHandle, INodeNo, TimeOrNow};

use super::FreeflowFs;
use crate::convert::{self, errno, STATFS_BLOCK_BYTES};
use crate::reply::{Caller, ReplyAttr, ReplyData, ReplyEmpty, ReplyStatfs};

/// How long the kernel may keep the attributes of a directory with creates or unlinks
/// answered ahead on their way (see `getattr`): long enough for the two permission checks
/// of one create or unlink (the search at the lookup, then the write), short enough that
/// the meta server's times are asked for soon after the changes landed.
const AHEAD_DIRECTORY_ATTR_TTL: Duration = Duration::from_millis(10);

/// Free inodes reported by statfs: Freeflow has no inode table to run out of.
pub const STATFS_FREE_INODES: u64 = 1 << 32;

impl FreeflowFs {
    /// The times a writeback mount's kernel sends for a file right after an unlink of it
    /// (inside the unlink: it writes the new change time at once), while that unlink,
    /// answered ahead, is on its way: answered from the attributes kept for the file (one
    /// link fewer, not cached), and sent once the unlink has landed, instead of holding
    /// the unlinking program until it has (the meta server sets the change time at the
    /// unlink itself). Returns the reply if it is not such a case.
    fn times_of_unlinked(
        &self,
        inode: InodeId,
        modify_time: Option<TimeOrNow>,
        change_time: Option<std::time::SystemTime>,
        reply: ReplyAttr,
    ) -> Option<ReplyAttr> {
        let client = &self.state.client;
        if !self.state.writeback || !client.ahead_unlinking(inode) {
            return Some(reply);
        }
        let Some(mut attr) = client.kept_attributes(inode) else {
            return Some(reply);
        };
        attr.link_count = attr.link_count.saturating_sub(1);
        let modify_time = modify_time.map(convert::time_or_now);
        if let Some(time) = modify_time {
            attr.modify_time = time;
        }
        if let Some(time) = change_time {
            attr.change_time = convert::time_spec(time);
        }
        self.state.reply_attr(reply, &attr, &Lease::default());
        // Only the modify time is the kernel's news: the change time is the unlink's.
        if let Some(modify_time) = modify_time {
            // A task like any request's (within `REQUESTS_IN_FLIGHT_MAX`).
            let client = client.clone();
            self.spawn(async move {
                client.settle_ahead(&[inode]).await;
                let changes = SetAttr {
                    modify_time: Some(modify_time),
                    ..SetAttr::default()
                };
                // Gone with its last name, or linked elsewhere: either way nothing waits.
                if let Err(error) = client.setattr_leased(inode, changes, None).await {
                    tracing::debug!(inode, %error, "times of a file unlinked here not set");
                }
            });
        }
        None
    }
}

/// The handlers of attributes, with the operations' arguments as the kernel gives them (hence
/// their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
    pub(crate) fn getattr(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        // The kernel holds the inode it asks about (`held.rs`).
        self.state.held.opened(inode.0);
        // A directory with creates answered ahead on their way (the kernel asks for it at
        // every create there, to check the creator's permissions: it drops the directory's
        // attributes after each change it makes there): answered from the attributes kept
        // under the lease, with the times of a change now, cached only for the checks of
        // one create or unlink, so that once they landed it is asked again. No other client
        // changes the directory meanwhile: it would recall the delegation first, and the
        // revocation drops the attributes from the kernel.
        let client = &self.state.client;
        if client.ahead_creating_in(inode.0) {
            if let Some(mut attr) = client.kept_attributes(inode.0) {
                let now = convert::time_spec(std::time::SystemTime::now());
                attr.modify_time = attr.modify_time.max(now);
                attr.change_time = attr.change_time.max(now);
                return reply.attr(&AHEAD_DIRECTORY_ATTR_TTL, &self.state.kernel_attr(&attr));
            }
        }
        self.settle(&[inode.0]);
        // Attributes kept from this mount's own changes: answered here, without a task
        // (a writeback mount's kernel asks again after every close of a file).
        if let Some((attr, lease)) = client.kept_attributes_leased(inode.0) {
            return self.state.reply_attr(reply, &attr, &lease);
        }
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.getattr_leased(inode.0).await {
                Ok((attr, lease)) => state.reply_attr(reply, &attr, &lease),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn setattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        mode: Option<u32>,
        user_id: Option<u32>,
        group_id: Option<u32>,
        size: Option<u64>,
        access_time: Option<TimeOrNow>,
        modify_time: Option<TimeOrNow>,
        change_time: Option<std::time::SystemTime>,
        handle: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        // A writeback mount's kernel keeps a file's times itself and sends them with the
        // change time: at a write-back of the file, or as the explicit times of a `touch`
        // (no "now" flag then). It checked the caller's right to either (default
        // permissions) before sending, so they are set as root: a writer who is not the
        // owner may set the times to now, which the meta server could not tell apart.
        self.state.held.opened(inode.0);
        let kernel_times = change_time.is_some()
            && mode.is_none()
            && user_id.is_none()
            && group_id.is_none()
            && size.is_none();
        let reply = if kernel_times {
            match self.times_of_unlinked(inode.0, modify_time, change_time, reply) {
                Some(reply) => reply,
                None => return,
            }
        } else {
            reply
        };
        self.settle(&[inode.0]);
        let changes = SetAttr {
            permissions: mode.map(|mode| mode & 0o7777),
            user_id,
            group_id,
            size_bytes: size,
            access_time: access_time.map(convert::time_or_now),
            // A writeback mount's kernel adds its own times to a size change; the meta
            // server sets them with the size anyway, and they would need the owner's right
            // where the descriptor's write access is enough (ftruncate).
            modify_time: modify_time
                .filter(|_| size.is_none() || change_time.is_none())
                .map(convert::time_or_now),
            change_time: None,
        };
        // A size change through a descriptor (ftruncate) is authorised by the descriptor,
        // which the kernel opened for writing, not by the mode bits (a file created with
        // mode 0 can be truncated through the descriptor that created it).
        let through = match (handle, size) {
            (Some(_), Some(_)) => self.state.files.get(inode.0),
            _ => None,
        };
        let client = if kernel_times {
            self.state.client.clone()
        } else {
            self.caller(request)
        };
        let state = self.state.clone();
        // The kernel holds this file's write-back until a truncation is answered.
        let truncating = size.map(|_| self.state.begin_truncation(inode.0));
        self.spawn(async move {
            let _truncating = truncating;
            if size.is_some() {
                state.files.wait_growth(inode.0).await;
            }
            let result = if changes == SetAttr::default() {
                client.getattr_leased(inode.0).await
            } else {
                let through = through.map(|open| open.handle_ref());
                client.setattr_leased(inode.0, changes, through).await
            };
            match result {
                Ok((attr, lease)) => {
                    if let Some(size) = size {
                        state.shadows.truncated(inode.0, size);
                        // The kernel takes the size of the reply.
                        state.held.size_is(inode.0, state.kernel_attr(&attr).size);
                    }
                    state.reply_attr(reply, &attr, &lease)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn readlink(&self, _request: &Caller, inode: INodeNo, reply: ReplyData) {
        self.state.cache.touched(inode.0);
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.readlink(inode.0).await {
                Ok(target) => reply.data(target.as_bytes()),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn statfs(&self, _request: &Caller, _inode: INodeNo, reply: ReplyStatfs) {
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.statfs().await {
                Ok(stats) => {
                    let block = u64::from(STATFS_BLOCK_BYTES);
                    reply.statfs(
                        stats.capacity_bytes / block,
                        stats.free_bytes / block,
                        stats.free_bytes / block,
                        stats.inode_count.saturating_add(STATFS_FREE_INODES),
                        STATFS_FREE_INODES,
                        STATFS_BLOCK_BYTES,
                        freeflow_types::limits::NAME_LENGTH_MAX as u32,
                        STATFS_BLOCK_BYTES,
                    )
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn access(
        &self,
        _request: &Caller,
        _inode: INodeNo,
        _mask: AccessFlags,
        reply: ReplyEmpty,
    ) {
        // default_permissions: the kernel checks access itself and never asks.
        reply.ok();
    }
}
