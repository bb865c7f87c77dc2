//! The handlers of file data: open, read, write (and the write-back of changed spans,
//! `write_spans`), flush, release, fsync, fallocate, copy_file_range and ioctl.

use std::sync::Arc;

use bytes::Bytes;
use freeflow_client::{Allocation, Client, InodeId, SetAttr};
use fuser::{Errno, FileHandle, INodeNo, IoctlFlags, LockOwner, OpenFlags, WriteFlags};

use super::{
    bad_handle, open_handle, open_reply_flags, reads_pages, writes, FreeflowFs, MountState,
    PAST_CACHE,
};
use crate::convert::errno;
use crate::reply::{Caller, ReplyData, ReplyEmpty, ReplyIoctl, ReplyOpen, ReplyWrite};

/// Marks a release answered when dropped: after its reply, or with its task if that never
/// runs (see `release`).
struct ReleaseAnswered {
    state: Arc<MountState>,
    inode: InodeId,
}

impl Drop for ReleaseAnswered {
    fn drop(&mut self) {
        self.state.files.release_answered(self.inode);
    }
}

/// What of a write-back goes (`Shadows::write_back`): the spans of it to send, and the size
/// the file grows to without a byte there.
struct Spans {
    spans: Vec<std::ops::Range<usize>>,
    grow: Option<u64>,
}

/// Clear setuid, and setgid when group-executable, as a write by an unprivileged caller
/// does on Linux.
async fn kill_set_id_bits(client: &Client, inode: u64) -> Result<(), freeflow_client::ClientError> {
    let attr = client.getattr(inode).await?;
    let mut permissions = attr.permissions & !0o4000;
    if permissions & 0o010 != 0 {
        permissions &= !0o2000;
    }
    if permissions != attr.permissions {
        let changes = freeflow_client::SetAttr {
            permissions: Some(permissions),
            ..Default::default()
        };
        client.setattr(inode, changes).await?;
    }
    Ok(())
}

/// The `fallocate(2)` modes the mount keeps, or `EOPNOTSUPP`.
fn allocation_of_mode(mode: i32) -> Result<Allocation, Errno> {
    const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE;
    const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE;
    match mode {
        0 => Ok(Allocation::Allocate { keep_size: false }),
        KEEP_SIZE => Ok(Allocation::Allocate { keep_size: true }),
        mode if mode == PUNCH_HOLE | KEEP_SIZE => Ok(Allocation::PunchHole),
        // Linux refuses a hole punched without KEEP_SIZE.
        PUNCH_HOLE => Err(Errno::EOPNOTSUPP),
        ZERO_RANGE => Ok(Allocation::ZeroRange { keep_size: false }),
        mode if mode == ZERO_RANGE | KEEP_SIZE => Ok(Allocation::ZeroRange { keep_size: true }),
        _ => Err(Errno::EOPNOTSUPP),
    }
}

impl FreeflowFs {
    /// A write-back of `data` at `offset` of which only `sent.spans` (offsets into `data`)
    /// changed here (`shadow.rs`): those go, the file grows to `sent.grow` once they are
    /// on their way (`FileHandle::extend_to` commits it after them), and the kernel is
    /// told all was written.
    fn write_spans(
        &self,
        handle: Arc<freeflow_client::FileHandle>,
        offset: u64,
        data: Bytes,
        sent: Spans,
        kill_privileges: bool,
        reply: ReplyWrite,
    ) {
        let Ok(length) = u32::try_from(data.len()) else {
            return reply.error(Errno::EINVAL);
        };
        let pieces: Vec<(u64, Bytes)> = sent
            .spans
            .iter()
            .map(|span| (offset + span.start as u64, data.slice(span.clone())))
            .collect();
        let privileged_client = kill_privileges.then(|| {
            self.state
                .client
                .with_caller(freeflow_client::Caller::root())
        });
        let state = self.state.clone();
        self.spawn(async move {
            if let Some(client) = privileged_client {
                if let Err(error) = kill_set_id_bits(&client, handle.inode()).await {
                    // The copies took bytes that were not sent.
                    state.shadows.failed(handle.inode());
                    return reply.error(errno(&error));
                }
            }
            // Disjoint pieces: sent at once, each seen through to its end.
            let writes = pieces
                .into_iter()
                .map(|(at, piece)| handle.write_at(at, piece));
            let results = futures::future::join_all(writes).await;
            let mut error = results.into_iter().find_map(Result::err);
            if let (None, Some(end)) = (&error, sent.grow) {
                error = handle.extend_to(end).err();
            }
            match error {
                None => reply.written(length),
                Some(error) => {
                    state.shadows.failed(handle.inode());
                    reply.error(errno(&error))
                }
            }
        });
    }
}

/// The handlers of file data, with the operations' arguments as the kernel gives them (hence
/// their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
    pub(crate) fn open(
        &self,
        request: &Caller,
        inode: INodeNo,
        flags: OpenFlags,
        reply: ReplyOpen,
    ) {
        self.settle(&[inode.0]);
        // The kernel holds the inode now, with the size the reply that made it gave.
        self.state.held.opened(inode.0);
        let truncate = flags.0 & libc::O_TRUNC != 0;
        if truncate {
            // The kernel drops the size and times it holds at a truncating open.
            self.state.cache.touched(inode.0);
        }
        let (client, state) = (self.caller(request), self.state.clone());
        let truncating = truncate.then(|| self.state.begin_truncation(inode.0));
        self.spawn(async move {
            let _truncating = truncating;
            let handle = match state.files.acquire(&state.client, inode.0).await {
                Ok(handle) => handle,
                Err(error) => return reply.error(errno(&error)),
            };
            if truncate {
                state.files.wait_growth(inode.0).await;
                // FUSE_ATOMIC_O_TRUNC: the truncate comes with the open, which the kernel
                // has checked for write access: authorised by the handle.
                let changes = SetAttr {
                    size_bytes: Some(0),
                    ..SetAttr::default()
                };
                let through = Some(handle.handle_ref());
                if let Err(error) = client.setattr_through(inode.0, changes, through).await {
                    let _ = state.files.release(inode.0, || {}).await;
                    return reply.error(errno(&error));
                }
                state.shadows.truncated(inode.0, 0);
                state.held.size_is(inode.0, 0);
            }
            if writes(flags.0) {
                // The size read under the count (after any growth under way ended).
                state
                    .files
                    .opened_for_writing(inode.0, || {
                        let from = state.held.writing_from(inode.0, handle.size());
                        state.shadows.begin(inode.0, from)
                    })
                    .await;
            }
            let answer = open_reply_flags(&state, flags.0);
            if reads_pages(open_handle(inode.0, answer), flags.0) {
                state.files.opened_for_reading(inode.0);
            }
            // No FOPEN_KEEP_CACHE: the kernel drops the file's pages at every open, which
            // the writeback mount's shadows count on (`shadow.rs`).
            reply.opened(open_handle(handle.inode(), answer), answer);
        });
    }

    pub(crate) fn read(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.settle(&[inode.0]);
        let Some((handle, reads)) = self.state.files.get_for_reading(inode.0) else {
            return reply.error(bad_handle());
        };
        let writeback = self.state.writeback;
        // A read into the kernel's pages (not a direct one) of a file open for writing
        // here is copied (`shadow.rs`), unless the file changed otherwise meanwhile.
        let copy = (writeback && flags.0 & libc::O_DIRECT == 0)
            .then(|| (self.state.clone(), self.state.shadows.reading(inode.0)));
        self.answer_read(size, async move {
            // A writeback mount's growth of a held-open file waits for the reads already
            // answering (their pages may end at the size the handle knew before it).
            let _reading = if writeback {
                Some(reads.read().await)
            } else {
                None
            };
            match handle.read_at(offset, u64::from(size)).await {
                Ok(data) => {
                    // Copied before the kernel has the page and can change it.
                    if let Some((state, start)) = &copy {
                        let size = u64::from(size);
                        state.shadows.read(inode.0, *start, offset, size, &data);
                    }
                    reply.data(&data)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn write(
        &self,
        _request: &Caller,
        inode: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.settle(&[inode.0]);
        let Some(handle) = self.state.files.get_for_writing(inode.0) else {
            return reply.error(bad_handle());
        };
        // The kernel asks us to drop setuid/setgid (a write by a caller without CAP_FSETID
        // to such a file): do it before the data lands, as a local file system would. The
        // kernel has made the decision, so it is carried out as root: a writer who is not
        // the owner could not chmod the file itself.
        let kill_privileges = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let direct = !write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        // A write through an open answered past the page cache (`open_reply_flags`): the
        // kernel dropped its pages of the range before sending it, but a read by another
        // descriptor here may have brought the old bytes back before the write reached
        // the handle. While the file is open for reading here they are dropped again once
        // it has (reads reaching the handle after that are ordered after the write).
        let past_cache = fh.0 & PAST_CACHE != 0;
        // The request buffer is reused for the next request: the data is copied out of it
        // once, here or below.
        let mut copied = None;
        if self.state.writeback {
            if direct {
                self.state
                    .shadows
                    .written_directly(inode.0, offset, data.len() as u64);
            } else {
                // A write-back never passes the size the kernel keeps.
                let end = offset + data.len() as u64;
                self.state.held.grown_to(inode.0, end);
                // Pages from the kernel's cache: only what changed here goes, and the
                // shadows keep views of the copy that is sent (`shadow.rs`).
                let bytes = Bytes::copy_from_slice(data);
                let (spans, grow) = self.state.shadows.write_back(inode.0, offset, &bytes);
                let whole = spans.len() == 1 && spans[0] == (0..data.len());
                if !whole {
                    let sent = Spans { spans, grow };
                    return self.write_spans(handle, offset, bytes, sent, kill_privileges, reply);
                }
                copied = Some(bytes);
            }
        }
        if !kill_privileges {
            // A small write that joins those gathered is answered here, on the session
            // thread, without a task or a request of its own.
            // In the runtime's context: the gathered bytes, once full, go on a task.
            let gathered = {
                let _runtime = self.state.runtime.enter();
                handle.write_gathered(offset, data)
            };
            match gathered {
                // Gathered writes are shorter than GATHER_WRITE_MAX: the length fits.
                Ok(true) => {
                    if direct {
                        let end = offset + data.len() as u64;
                        self.state.grown_here(inode.0, end);
                    }
                    if past_cache && self.state.files.is_read(inode.0) {
                        let (state, length) = (self.state.clone(), data.len() as u64);
                        self.spawn(async move {
                            state.drop_pages(inode.0, offset, length).await;
                            reply.written(length as u32)
                        });
                        return;
                    }
                    return reply.written(data.len() as u32);
                }
                Ok(false) => {}
                Err(error) => {
                    self.state.shadows.failed(inode.0);
                    return reply.error(errno(&error));
                }
            }
        }
        let privileged_client = kill_privileges.then(|| {
            self.state
                .client
                .with_caller(freeflow_client::Caller::root())
        });
        // Straight into the memory shared with the I/O servers on this host, where it
        // can be: the request then refers to it without another copy.
        let data = copied.unwrap_or_else(|| self.state.client.payload(data));
        let Ok(length) = u32::try_from(data.len()) else {
            return reply.error(Errno::EINVAL);
        };
        let state = self.state.clone();
        self.spawn(async move {
            if let Some(client) = privileged_client {
                if let Err(error) = kill_set_id_bits(&client, inode.0).await {
                    // The copies took bytes that were not sent.
                    state.shadows.failed(inode.0);
                    return reply.error(errno(&error));
                }
            }
            match handle.write_at(offset, data).await {
                Ok(()) => {
                    if direct {
                        let end = offset + u64::from(length);
                        state.grown_here(inode.0, end);
                    }
                    if past_cache && state.files.is_read(inode.0) {
                        state.drop_pages(inode.0, offset, u64::from(length)).await;
                    }
                    reply.written(length)
                }
                Err(error) => {
                    state.shadows.failed(inode.0);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn flush(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let handle = self.state.files.get(inode.0);
        let (state, sync) = (self.state.clone(), self.state.sync_on_close);
        // Nothing to release or flush (a file closed unwritten): answered here, without a
        // task.
        if !sync
            && !state.client.owner_holds_locks(inode.0, lock_owner.0)
            && handle.as_ref().is_none_or(|handle| handle.flush_is_empty())
        {
            return reply.ok();
        }
        self.spawn(async move {
            // A close releases the POSIX locks its process holds on the file (the kernel
            // leaves that to file systems with their own locks).
            if let Err(error) = state
                .client
                .release_owner_locks(inode.0, lock_owner.0)
                .await
            {
                tracing::warn!(inode = inode.0, %error, "releasing a record lock at close failed");
            }
            let Some(handle) = handle else {
                return reply.ok();
            };
            let result = if sync {
                handle.fsync().await
            } else {
                handle.flush().await
            };
            match result {
                Ok(()) => reply.ok(),
                Err(error) => {
                    // Gathered writes fail here: the copies may claim what never landed.
                    state.shadows.failed(inode.0);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn release(
        &self,
        _request: &Caller,
        inode: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Until the answer, the kernel holds the inode with the size it keeps of it on a
        // writeback mount: a lookup meanwhile would hand that inode out again, whatever
        // size another client has given the file since (see `lookup`). Noted first, before
        // anything slow here: a lookup read after this release may be answered on another
        // thread meanwhile.
        let answered = self.state.writeback.then(|| {
            self.state.files.release_began(inode.0);
            ReleaseAnswered {
                state: self.state.clone(),
                inode: inode.0,
            }
        });
        // Read or written while open: the kernel may have dropped some of its attributes.
        if self.state.files.take_accessed(inode.0) {
            self.state.cache.touched(inode.0);
        }
        if writes(flags.0) {
            let state = &self.state;
            let mut last = false;
            state.files.closed_for_writing(inode.0, || {
                state.shadows.end(inode.0);
                last = true;
            });
            if reads_pages(fh, flags.0) {
                state.files.closed_for_reading(inode.0);
            }
            if last {
                state.after_last_write_close(inode.0);
            }
        } else if reads_pages(fh, flags.0) {
            self.state.files.closed_for_reading(inode.0);
        }
        let state = self.state.clone();
        self.spawn(async move {
            // Dropped at the end, once the reply is written.
            let _answered = answered;
            // A file created ahead of the meta server is released once it is there.
            state.client.settle_ahead(&[inode.0]).await;
            // The last close of a file that held `flock` locks: they go with it.
            if let Some(owner) = lock_owner {
                if let Err(error) = state.client.release_owner_locks(inode.0, owner.0).await {
                    tracing::warn!(inode = inode.0, %error, "releasing a flock lock failed");
                }
            }
            // At the last close here, OFD locks (which the kernel does not announce at
            // close) belong to nothing open any more: their owners are taken at that
            // moment, so a file opened again meanwhile keeps its own locks.
            let mut owners = Vec::new();
            let released = state
                .files
                .release(inode.0, || {
                    owners = state.client.take_inode_lock_owners(inode.0)
                })
                .await;
            if let Err(error) = state.client.release_locks_of(inode.0, &owners).await {
                tracing::warn!(inode = inode.0, %error, "releasing locks at close failed");
            }
            match released {
                Ok(()) => reply.ok(),
                Err(error) => {
                    // close(2) has returned already; the error can only be logged.
                    tracing::warn!(inode = inode.0, %error, "closing a file failed");
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn fsync(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        let Some(handle) = self.state.files.get(inode.0) else {
            return reply.error(bad_handle());
        };
        let state = self.state.clone();
        self.spawn(async move {
            match handle.fsync().await {
                Ok(()) => reply.ok(),
                Err(error) => {
                    // Gathered writes fail here: the copies may claim what never landed.
                    state.shadows.failed(inode.0);
                    reply.error(errno(&error))
                }
            }
        });
    }

    /// No ioctl is supported: `ENOTTY`, as a local file system answers for a request it
    /// does not know (Python asks `TCGETS` at every `open()`, to see if it is a terminal).
    pub(crate) fn ioctl(
        &self,
        _request: &Caller,
        _inode: INodeNo,
        _handle: FileHandle,
        _flags: IoctlFlags,
        _command: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    pub(crate) fn fallocate(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        // The kernel drops the times (and, for an allocation, the size) it holds.
        self.state.cache.touched(inode.0);
        let how = match allocation_of_mode(mode) {
            Ok(how) => how,
            Err(error) => return reply.error(error),
        };
        let Some(handle) = self.state.files.get(inode.0) else {
            return reply.error(bad_handle());
        };
        // Its pages are the cluster's after it (the kernel drops them, `shadow.rs`).
        self.state.shadows.written_directly(inode.0, offset, length);
        let state = self.state.clone();
        self.spawn(async move {
            match handle.allocate(offset, length, how).await {
                Ok(()) => {
                    // The kernel raises its size to the end unless told to keep it (and
                    // the handle's size may hold other hosts' growth, which it has not).
                    if mode & libc::FALLOC_FL_KEEP_SIZE == 0 {
                        state.grown_here(inode.0, offset + length);
                    }
                    reply.ok()
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn copy_file_range(
        &self,
        _request: &Caller,
        source_inode: INodeNo,
        _source_handle: FileHandle,
        source_offset: u64,
        target_inode: INodeNo,
        _target_handle: FileHandle,
        target_offset: u64,
        length: u64,
        flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        // The kernel drops the target's size and times it holds, and the source's access time.
        self.state.cache.touched(source_inode.0);
        self.state.cache.touched(target_inode.0);
        self.settle(&[source_inode.0, target_inode.0]);
        if !flags.is_empty() {
            return reply.error(Errno::EINVAL);
        }
        let (Some(source), Some(target)) = (
            self.state.files.get(source_inode.0),
            self.state.files.get(target_inode.0),
        ) else {
            return reply.error(bad_handle());
        };
        // The reply counts bytes in 32 bits.
        let length = length.min(u64::from(!0xfff_u32));
        self.state
            .shadows
            .written_directly(target_inode.0, target_offset, length);
        let state = self.state.clone();
        self.spawn(async move {
            match target
                .copy_range_from(&source, source_offset, target_offset, length)
                .await
            {
                // At most `length`, which fits u32.
                Ok(copied) => {
                    // The kernel raises its size to the copy's end (the handle's size may
                    // hold other hosts' growth, which it has not).
                    let end = target_offset + copied;
                    state.grown_here(target_inode.0, end);
                    reply.written(copied as u32)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallocate_modes_map_to_allocations() {
        use libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
        assert_eq!(
            allocation_of_mode(0),
            Ok(Allocation::Allocate { keep_size: false })
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_KEEP_SIZE),
            Ok(Allocation::Allocate { keep_size: true })
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE),
            Ok(Allocation::PunchHole)
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_PUNCH_HOLE),
            Err(Errno::EOPNOTSUPP)
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_ZERO_RANGE),
            Ok(Allocation::ZeroRange { keep_size: false })
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE),
            Ok(Allocation::ZeroRange { keep_size: true })
        );
        // Collapse, insert and unshare are not kept.
        assert_eq!(allocation_of_mode(0x08), Err(Errno::EOPNOTSUPP));
        assert_eq!(allocation_of_mode(0x20), Err(Errno::EOPNOTSUPP));
    }
}
