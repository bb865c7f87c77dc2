//! The handlers of names: lookup and forget, and the operations that make, remove or move
//! a name (mknod, mkdir, unlink, rmdir, symlink, rename, link, create), with the creates and
//! unlinks answered ahead of the meta server (`create_ahead`, `unlink_ahead`) and `settle`,
//! which waits for those on their way.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use freeflow_client::{
    Attr, Client, ClientError, ErrorCode, FileKind, InodeId, Lease, RenameMode, SetAttr,
};
use fuser::{Errno, Generation, INodeNo, RenameFlags};

use super::{
    open_handle, open_reply_flags, reads_pages, regular_size, writes, FreeflowFs, MountState,
};
use crate::convert::{self, errno, file_attr};
use crate::reply::{Caller, ReplyCreate, ReplyEmpty, ReplyEntry};

/// Least lease on a directory's names left for a create there to be answered ahead of the
/// meta server: the create then has that long to reach it before the delegation could end.
const AHEAD_LEASE_LEFT_MIN: Duration = Duration::from_secs(1);

/// Longest a lookup on a writeback mount waits for a release of the same file to be
/// answered (a release takes milliseconds; bounded, as both hold a place among the
/// requests in flight).
const RELEASE_WAIT_MS: u64 = 2_000;

fn rename_mode(flags: RenameFlags) -> Result<RenameMode, Errno> {
    if flags.is_empty() {
        Ok(RenameMode::Replace)
    } else if flags == RenameFlags::RENAME_NOREPLACE {
        Ok(RenameMode::NoReplace)
    } else if flags == RenameFlags::RENAME_EXCHANGE {
        Ok(RenameMode::Exchange)
    } else {
        Err(Errno::EINVAL)
    }
}

fn kind_of_mode(mode: u32) -> Option<FileKind> {
    FileKind::from_mode(mode)
}

/// Create a file and open it for this mount. An existing file (when not `exclusive`) is
/// opened instead, truncated if asked: the kernel checks the caller's access to it after.
async fn create_and_open(
    state: &MountState,
    client: &Client,
    parent: InodeId,
    name: &str,
    mode: u32,
    exclusive: bool,
    truncate: bool,
) -> Result<(Attr, Lease), ClientError> {
    let access = freeflow_client::OpenAccess {
        read: true,
        write: true,
    };
    // Always exclusive at the server: an existing file is opened as root below, not with
    // the caller's read+write (the caller may have asked for less).
    match client
        .create_open_leased(parent, name, mode & 0o7777, true, access)
        .await
    {
        Ok((handle, _created, lease)) => {
            let handle = state.files.adopt(Arc::new(handle)).await?;
            Ok((handle.attr(), lease))
        }
        Err(error) if error.code() == ErrorCode::Exists && !exclusive => {
            let attr = client.lookup(parent, name).await?;
            if attr.kind == FileKind::Directory {
                return Err(ClientError::Inode {
                    inode: attr.inode,
                    code: ErrorCode::IsDirectory,
                    reason: format!("{name:?} is a directory"),
                });
            }
            let handle = state.files.acquire(&state.client, attr.inode).await?;
            if truncate {
                let _truncating = state.begin_truncation(attr.inode);
                state.files.wait_growth(attr.inode).await;
                let changes = SetAttr {
                    size_bytes: Some(0),
                    ..SetAttr::default()
                };
                let through = Some(handle.handle_ref());
                if let Err(error) = client.setattr_through(attr.inode, changes, through).await {
                    let _ = state.files.release(attr.inode, || {}).await;
                    return Err(error);
                }
                state.shadows.truncated(attr.inode, 0);
                state.held.size_is(attr.inode, 0);
            }
            Ok((handle.attr(), Lease::default()))
        }
        Err(error) => Err(error),
    }
}

impl FreeflowFs {
    /// Answer a create before the meta server has it (`delegation.rs` in the client):
    /// when this mount made `parent` and knows all its names under a lease with at least
    /// `AHEAD_LEASE_LEFT_MIN` left, `name` is not among them, the meta server delegated
    /// `parent` to this client and a reserved inode number is left. The create is sent
    /// after the answer; a refusal (no space, say) is logged, and the name and the file
    /// vanish from this mount. Gives the reply back when it cannot answer ahead.
    fn create_ahead(
        &self,
        request: &Caller,
        parent: InodeId,
        name: &str,
        mode: u32,
        flags: i32,
        reply: ReplyCreate,
    ) -> Option<ReplyCreate> {
        let state = &self.state;
        if state.sync_on_close {
            return Some(reply);
        }
        let client = &state.client;
        let mut admission = state.cache.admit();
        let Some((lease, group_of_new)) =
            admission.known_missing_for_create(parent, name, |lease| {
                client.lease_remaining(lease, &[parent])
            })
        else {
            return Some(reply);
        };
        if client
            .lease_remaining(&lease, &[parent])
            .is_none_or(|left| left < AHEAD_LEASE_LEFT_MIN)
        {
            return Some(reply);
        }
        let Some(ahead) = client.begin_ahead_create(parent, name, &state.runtime) else {
            return Some(reply);
        };
        let inode = ahead.inode();
        let now = convert::time_spec(std::time::SystemTime::now());
        let attr = Attr::new_inode(
            inode,
            FileKind::Regular,
            mode & 0o7777,
            request.uid,
            group_of_new.unwrap_or(request.gid),
            now,
        );
        admission.listing_added(
            parent,
            name,
            Some((inode, FileKind::Regular)),
            None,
            |lease| client.lease_remaining(lease, &[parent]),
        );
        state.directories.changed(&[parent]);
        state.remember(inode, Some(0));
        let (entry_ttl, attr_ttl) =
            state.entry_time_outs(&mut admission, &lease, parent, name, Some(inode));
        admission.held_as(inode, parent, name);
        if writes(flags) {
            state
                .files
                .created_for_writing(inode, || state.shadows.begin(inode, 0));
        }
        let answer = open_reply_flags(state, flags);
        if reads_pages(open_handle(inode, answer), flags) {
            state.files.opened_for_reading(inode);
        }
        reply.created(
            &attr_ttl.min(entry_ttl),
            &file_attr(&attr, 0),
            Generation(0),
            open_handle(inode, answer),
            answer,
        );
        drop(admission);
        let (creator, state, name) = (self.caller(request), self.state.clone(), name.to_owned());
        self.spawn(async move {
            let access = freeflow_client::OpenAccess {
                read: true,
                write: true,
            };
            let created = creator
                .create_open_reserved(parent, &name, mode & 0o7777, access, inode)
                .await;
            match created {
                Ok((handle, lease)) => {
                    if let Err(error) = state.files.adopt(Arc::new(handle)).await {
                        tracing::warn!(inode, %error, "a file created ahead cannot be kept open");
                    }
                    state.note_made(parent, &name, Some((inode, FileKind::Regular)), &lease, None);
                    ahead.finish();
                }
                Err(error) => {
                    tracing::error!(
                        parent,
                        name = %name,
                        inode,
                        %error,
                        "a create answered ahead of the meta server was refused; the file is gone from this mount"
                    );
                    state.note_unsure(&[parent]);
                    // Finished first: a request of this mount in the directory may be
                    // waiting for it while the kernel holds the directory's lock, which
                    // the invalidation needs.
                    ahead.finish();
                    state.forget_name(parent, name, true);
                }
            }
        });
        None
    }

    /// Answer an unlink before the meta server has it, under the same conditions as a
    /// create (`create_ahead`), when this mount knows which file the name stands for and
    /// nothing about that file is on its way. The kernel has checked already that it is
    /// not a directory and that the caller may remove it. Gives the reply back otherwise.
    fn unlink_ahead(
        &self,
        request: &Caller,
        parent: InodeId,
        name: &str,
        reply: ReplyEmpty,
    ) -> Option<ReplyEmpty> {
        let state = &self.state;
        if state.sync_on_close {
            return Some(reply);
        }
        let client = &state.client;
        let mut admission = state.cache.admit();
        let Some((lease, child)) = admission.known_child(parent, name, |lease| {
            client.lease_remaining(lease, &[parent])
        }) else {
            return Some(reply);
        };
        if client
            .lease_remaining(&lease, &[parent])
            .is_none_or(|left| left < AHEAD_LEASE_LEFT_MIN)
        {
            return Some(reply);
        }
        let Some(ahead) = client.begin_ahead_unlink(parent, name, child) else {
            return Some(reply);
        };
        admission.listing_removed(parent, name);
        state.directories.changed(&[parent]);
        reply.ok();
        drop(admission);
        let (remover, state, name) = (self.caller(request), self.state.clone(), name.to_owned());
        self.spawn(async move {
            match remover.unlink_ahead_sent(parent, &name).await {
                Ok(lease) => {
                    state.cache.admit().listing_renewed(parent, lease, |lease| {
                        state.client.lease_remaining(lease, &[parent])
                    });
                    ahead.finish();
                }
                Err(error) => {
                    tracing::error!(
                        parent,
                        name = %name,
                        inode = child,
                        %error,
                        "an unlink answered ahead of the meta server was refused; the name is asked for again"
                    );
                    state.note_unsure(&[parent]);
                    ahead.finish();
                    state.forget_name(parent, name, false);
                }
            }
        });
        None
    }

    /// Wait (on this kernel thread) until no create answered ahead of the meta server is
    /// on its way in or of `inodes` (0: anywhere), so that what this request does or asks
    /// sees it. Rare: only a request within moments of such a create waits.
    pub(super) fn settle(&self, inodes: &[InodeId]) {
        let client = &self.state.client;
        if client.ahead_unsettled(inodes) {
            self.state.runtime.block_on(client.settle_ahead(inodes));
        }
    }
}

/// The handlers of names, with the operations' arguments as the kernel gives them (hence
/// their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
    pub(crate) fn lookup(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEntry,
    ) {
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let Some(reply) = self.state.reply_if_known_missing(reply, parent.0, &name) else {
            return;
        };
        self.settle(&[parent.0]);
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.lookup_entry(parent.0, &name).await {
                Ok((Some(attr), lease)) => {
                    // A writeback mount's kernel still holds a regular file whose release
                    // is not answered, with its own size: the reply would hand that inode
                    // out again (it ignores the size in it), and a program opening the file
                    // after another client grew and closed it would read it short. Once
                    // the release is answered the kernel lets go of it (its names were
                    // dropped at the revocation) and takes this reply's size.
                    if state.writeback && attr.kind == FileKind::Regular {
                        let wait = Duration::from_millis(RELEASE_WAIT_MS);
                        let _ =
                            tokio::time::timeout(wait, state.files.wait_released(attr.inode)).await;
                    }
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Ok((None, lease)) => state.reply_missing(reply, parent.0, &name, &lease),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn forget_inode(&self, inode: INodeNo, count: u64) {
        self.state.forget(inode.0, count);
    }

    pub(crate) fn mknod(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        device: u32,
        reply: ReplyEntry,
    ) {
        self.settle(&[parent.0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        // The kernel applied the umask already (no FUSE_DONT_MASK).
        let Some(kind) = kind_of_mode(mode) else {
            return reply.error(Errno::EINVAL);
        };
        if kind == FileKind::Directory || kind == FileKind::Symlink {
            return reply.error(Errno::EINVAL);
        }
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            let created = client
                .create_leased(
                    parent.0,
                    &name,
                    kind,
                    mode & 0o7777,
                    u64::from(device),
                    true,
                )
                .await;
            match created {
                Ok((attr, lease)) => {
                    state.note_made(parent.0, &name, Some((attr.inode, attr.kind)), &lease, None);
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn mkdir(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        self.settle(&[parent.0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.mkdir_leased(parent.0, &name, mode & 0o7777).await {
                Ok((attr, lease)) => {
                    state.note_made(
                        parent.0,
                        &name,
                        Some((attr.inode, attr.kind)),
                        &lease,
                        Some(&attr),
                    );
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn unlink(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
    ) {
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let Some(reply) = self.unlink_ahead(request, parent.0, &name, reply) else {
            return;
        };
        self.settle(&[parent.0]);
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.unlink(parent.0, &name).await {
                Ok(()) => {
                    state.note_removed(parent.0, &name);
                    reply.ok()
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn rmdir(&self, request: &Caller, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.settle(&[0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.rmdir(parent.0, &name).await {
                Ok(()) => {
                    state.note_removed(parent.0, &name);
                    reply.ok()
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn symlink(
        &self,
        request: &Caller,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        self.settle(&[parent.0]);
        let (name, target) = match (convert::name(link_name), target.to_str()) {
            (Ok(name), Some(target)) => (name.to_owned(), target.to_owned()),
            _ => return reply.error(Errno::EINVAL),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.symlink_leased(parent.0, &name, &target).await {
                Ok((attr, lease)) => {
                    state.note_made(parent.0, &name, Some((attr.inode, attr.kind)), &lease, None);
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn rename(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        new_parent: INodeNo,
        new_name: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        self.settle(&[0]);
        let (source, target) = match (convert::name(name), convert::name(new_name)) {
            (Ok(source), Ok(target)) => (source.to_owned(), target.to_owned()),
            _ => return reply.error(Errno::EINVAL),
        };
        let mode = match rename_mode(flags) {
            Ok(mode) => mode,
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client
                .rename(parent.0, &source, new_parent.0, &target, mode)
                .await
            {
                Ok(()) => {
                    state.cache.admit().listing_renamed(
                        parent.0,
                        &source,
                        new_parent.0,
                        &target,
                        mode == RenameMode::Exchange,
                    );
                    state.directories.changed(&[parent.0, new_parent.0]);
                    reply.ok();
                    // The kernel moved its entry to the new name with the time-out it had
                    // under the old one, a lease on the old directory's names: another
                    // client's later change of the new directory might not revoke it here
                    // (a directory left linked at a name it was moved from makes the
                    // kernel refuse a lookup of its new place with ESTALE while a rename
                    // runs). So the moved names are dropped and looked up again, under a
                    // lease of their own; a writeback mount also knows its files by the
                    // names it handed out (`Index::held`).
                    state.evict_names(new_parent.0, vec![target.clone()]);
                    if mode == RenameMode::Exchange {
                        state.evict_names(parent.0, vec![source.clone()]);
                    }
                }
                Err(error) => {
                    state.note_unsure(&[parent.0, new_parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn link(
        &self,
        request: &Caller,
        inode: INodeNo,
        new_parent: INodeNo,
        new_name: &OsStr,
        reply: ReplyEntry,
    ) {
        self.settle(&[inode.0, new_parent.0]);
        // The kernel holds the inode it links: the reply does not make it.
        self.state.held.opened(inode.0);
        let name = match convert::name(new_name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.link_leased(inode.0, new_parent.0, &name).await {
                Ok((attr, lease)) => {
                    state.note_made(
                        new_parent.0,
                        &name,
                        Some((attr.inode, attr.kind)),
                        &lease,
                        None,
                    );
                    state.reply_entry(reply, new_parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[new_parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn create(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let Some(reply) = self.create_ahead(request, parent.0, &name, mode, flags, reply) else {
            return;
        };
        self.settle(&[parent.0]);
        let exclusive = flags & libc::O_EXCL != 0;
        let truncate = flags & libc::O_TRUNC != 0;
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match create_and_open(&state, &client, parent.0, &name, mode, exclusive, truncate).await
            {
                Ok((attr, lease)) => {
                    // Counted first: the shadows start from the size this reply gives if
                    // it makes the kernel's inode.
                    let kernel_attr = state.kernel_attr(&attr);
                    state.remember(attr.inode, regular_size(&kernel_attr));
                    if writes(flags) {
                        state
                            .files
                            .opened_for_writing(attr.inode, || {
                                let from = state.held.writing_from(attr.inode, attr.size_bytes);
                                state.shadows.begin(attr.inode, from)
                            })
                            .await;
                    }
                    let answer = open_reply_flags(&state, flags);
                    if reads_pages(open_handle(attr.inode, answer), flags) {
                        state.files.opened_for_reading(attr.inode);
                    }
                    state.note_made(parent.0, &name, Some((attr.inode, attr.kind)), &lease, None);
                    // One time-out covers both the entry and the attributes here: under a
                    // lease, what is left of it; without, the shorter of the two, so the
                    // new name is revalidated like any other (with the attribute
                    // time-out, another mount's later changes to this file would go
                    // unseen by an open through the cached name).
                    let mut admission = state.cache.admit();
                    let (entry_ttl, attr_ttl) = state.entry_time_outs(
                        &mut admission,
                        &lease,
                        parent.0,
                        &name,
                        Some(attr.inode),
                    );
                    admission.held_as(attr.inode, parent.0, &name);
                    reply.created(
                        &attr_ttl.min(entry_ttl),
                        &kernel_attr,
                        Generation(0),
                        open_handle(attr.inode, answer),
                        answer,
                    );
                    drop(admission);
                    let ttl = attr_ttl.min(entry_ttl);
                    state.evict_unleased(attr.kind, parent.0, &name, ttl);
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_flags_map_to_modes() {
        assert_eq!(rename_mode(RenameFlags::empty()), Ok(RenameMode::Replace));
        assert_eq!(
            rename_mode(RenameFlags::RENAME_NOREPLACE),
            Ok(RenameMode::NoReplace)
        );
        assert_eq!(
            rename_mode(RenameFlags::RENAME_EXCHANGE),
            Ok(RenameMode::Exchange)
        );
        assert_eq!(
            rename_mode(RenameFlags::RENAME_WHITEOUT),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            rename_mode(RenameFlags::RENAME_NOREPLACE | RenameFlags::RENAME_EXCHANGE),
            Err(Errno::EINVAL)
        );
    }
}
