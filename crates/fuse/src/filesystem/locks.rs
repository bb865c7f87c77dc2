//! The handlers of POSIX and flock locks (getlk, setlk), held at the meta server, and the
//! mapping of the kernel's lock kinds and ends.

use freeflow_client::{LockKind, LockSpec};
use fuser::{Errno, FileHandle, INodeNo, LockOwner};

use super::FreeflowFs;
use crate::convert::errno;
use crate::reply::{Caller, ReplyEmpty, ReplyLock};

/// The kernel's `OFFSET_MAX`: a lock to the end of the file, however far.
const KERNEL_OFFSET_MAX: u64 = i64::MAX as u64;

fn lock_kind(kind: i32) -> Result<Option<LockKind>, Errno> {
    match kind {
        libc::F_RDLCK => Ok(Some(LockKind::Read)),
        libc::F_WRLCK => Ok(Some(LockKind::Write)),
        libc::F_UNLCK => Ok(None),
        _ => Err(Errno::EINVAL),
    }
}

fn lock_end_from_kernel(end: u64) -> u64 {
    if end >= KERNEL_OFFSET_MAX {
        u64::MAX
    } else {
        end
    }
}

fn lock_end_to_kernel(end: u64) -> u64 {
    end.min(KERNEL_OFFSET_MAX)
}

/// The handlers of locks, with the operations' arguments as the kernel gives them (hence
/// their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
    pub(crate) fn getlk(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        kind: i32,
        _pid: u32,
        reply: ReplyLock,
    ) {
        self.settle(&[inode.0]);
        let kind = match lock_kind(kind) {
            Ok(Some(kind)) => kind,
            Ok(None) => return reply.error(Errno::EINVAL),
            Err(error) => return reply.error(error),
        };
        let state = self.state.clone();
        self.spawn(async move {
            let end = lock_end_from_kernel(end);
            match state
                .client
                .get_lock(inode.0, lock_owner.0, kind, start, end)
                .await
            {
                Ok(Some(found)) => {
                    let kind = match found.kind {
                        LockKind::Read => libc::F_RDLCK,
                        LockKind::Write => libc::F_WRLCK,
                    };
                    reply.locked(found.start, lock_end_to_kernel(found.end), kind, found.pid)
                }
                Ok(None) => reply.locked(start, lock_end_to_kernel(end), libc::F_UNLCK, 0),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn setlk(
        &self,
        request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        kind: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        let kind = match lock_kind(kind) {
            Ok(kind) => kind,
            Err(error) => return reply.error(error),
        };
        let spec = LockSpec {
            owner: lock_owner.0,
            pid,
            kind,
            start,
            end: lock_end_from_kernel(end),
        };
        let state = self.state.clone();
        let tid = request.pid;
        let task = async move {
            let set = if sleep {
                // A waiter whose thread has a signal to take gives up (the kernel's
                // INTERRUPT never reaches this mount: fuser answers it itself): EINTR,
                // which the kernel turns into a restart or an error as the program's
                // handler asks, as for a local lock.
                let interrupted = move || crate::caller::signal_waits(tid);
                state
                    .client
                    .set_lock_unless(inode.0, spec, &interrupted)
                    .await
            } else {
                state
                    .client
                    .set_lock(inode.0, spec, false)
                    .await
                    .map(|()| true)
            };
            match set {
                Ok(true) => reply.ok(),
                Ok(false) => reply.error(Errno::EINTR),
                Err(error) => reply.error(errno(&error)),
            }
        };
        if sleep {
            // A waiter waits for another process, not for this mount's work: outside the
            // bound of requests in flight, which 1,024 waiters would otherwise fill and
            // so hold up the holder's unlock. (The kernel's ring entries and the meta
            // server's long-poll slots bound waiters instead.)
            self.state.runtime.spawn(task);
        } else {
            self.spawn(task);
        }
    }
}
