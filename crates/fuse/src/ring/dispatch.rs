//! One request from a ring entry, decoded and handed to its handler in `filesystem/`:
//! the opcode's record from the header's `op_in` area, names and data from the payload.
//! A request that does not parse gets EINVAL, an opcode the mount does not serve ENOSYS
//! (the kernel then stops asking for it where it can).
//!
//! It implements the rings' [`Dispatch`] for [`FreeflowFs`]: `ring/mod.rs` names no handler,
//! so the handlers (whose replies write into ring entries) stay below the rings.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, CopyFileRangeFlags, Errno, FileHandle, INodeNo, IoctlFlags, LockOwner, OpenFlags,
    RenameFlags, TimeOrNow, WriteFlags,
};
use zerocopy::FromBytes;

use super::abi::{self, InHeader};
use super::{Dispatch, RingReply};
use crate::filesystem::FreeflowFs;
use crate::reply::{
    Caller, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, RingListing,
};

/// The record at the start of `op_in`.
fn record<T: FromBytes>(op_in: &[u8]) -> Result<T, Errno> {
    T::read_from_prefix(op_in)
        .map(|(value, _)| value)
        .map_err(|_| Errno::EINVAL)
}

/// The NUL-terminated name at the start of `bytes`, and what follows it.
fn name(bytes: &[u8]) -> Result<(&OsStr, &[u8]), Errno> {
    let end = bytes
        .iter()
        .position(|&byte| byte == 0)
        .ok_or(Errno::EINVAL)?;
    Ok((OsStr::from_bytes(&bytes[..end]), &bytes[end + 1..]))
}

fn time(seconds: u64, nanos: u32) -> SystemTime {
    let seconds = seconds as i64;
    if seconds >= 0 {
        UNIX_EPOCH + Duration::new(seconds as u64, nanos)
    } else {
        UNIX_EPOCH - Duration::from_secs(seconds.unsigned_abs())
            + Duration::from_nanos(nanos.into())
    }
}

fn set_time(valid: u32, given: u32, now: u32, seconds: u64, nanos: u32) -> Option<TimeOrNow> {
    if valid & given == 0 {
        None
    } else if valid & now != 0 {
        Some(TimeOrNow::Now)
    } else {
        Some(TimeOrNow::SpecificTime(time(seconds, nanos)))
    }
}

/// An offset the kernel's `loff_t` can hold.
fn offset(value: u64) -> Result<u64, Errno> {
    if value > i64::MAX as u64 {
        Err(Errno::EINVAL)
    } else {
        Ok(value)
    }
}

impl Dispatch for FreeflowFs {
    fn dispatch(&self, request: &InHeader, op_in: &[u8], payload: &[u8], reply: RingReply) {
        dispatch(self, request, op_in, payload, reply);
    }
}

fn dispatch(fs: &FreeflowFs, request: &InHeader, op_in: &[u8], payload: &[u8], reply: RingReply) {
    if let Err((error, reply)) = serve(fs, request, op_in, payload, reply) {
        reply.error(error);
    }
}

/// Calls the handler; a request that cannot be decoded gives its reply back with the
/// error.
fn serve(
    fs: &FreeflowFs,
    request: &InHeader,
    op_in: &[u8],
    payload: &[u8],
    reply: RingReply,
) -> Result<(), (Errno, RingReply)> {
    let caller = Caller {
        uid: request.uid,
        gid: request.gid,
        pid: request.pid,
    };
    let caller = &caller;
    let inode = INodeNo(request.nodeid);
    macro_rules! decode {
        ($value:expr) => {
            match $value {
                Ok(value) => value,
                Err(error) => return Err((error, reply)),
            }
        };
    }
    match request.opcode {
        abi::LOOKUP => {
            let (child, _) = decode!(name(payload));
            fs.lookup(caller, inode, child, ReplyEntry::Ring(reply));
        }
        abi::GETATTR => {
            let arg: abi::GetattrIn = decode!(record(op_in));
            let handle = (arg.getattr_flags & abi::GETATTR_FH != 0).then_some(FileHandle(arg.fh));
            fs.getattr(caller, inode, handle, ReplyAttr::Ring(reply));
        }
        abi::SETATTR => {
            let arg: abi::SetattrIn = decode!(record(op_in));
            let valid = arg.valid;
            let given = |flag: u32| valid & flag != 0;
            fs.setattr(
                caller,
                inode,
                given(abi::FATTR_MODE).then_some(arg.mode),
                given(abi::FATTR_UID).then_some(arg.uid),
                given(abi::FATTR_GID).then_some(arg.gid),
                given(abi::FATTR_SIZE).then_some(arg.size),
                set_time(
                    valid,
                    abi::FATTR_ATIME,
                    abi::FATTR_ATIME_NOW,
                    arg.atime,
                    arg.atimensec,
                ),
                set_time(
                    valid,
                    abi::FATTR_MTIME,
                    abi::FATTR_MTIME_NOW,
                    arg.mtime,
                    arg.mtimensec,
                ),
                given(abi::FATTR_CTIME).then(|| time(arg.ctime, arg.ctimensec)),
                given(abi::FATTR_FH).then_some(FileHandle(arg.fh)),
                ReplyAttr::Ring(reply),
            );
        }
        abi::READLINK => fs.readlink(caller, inode, ReplyData::Ring(reply)),
        abi::SYMLINK => {
            let (link_name, rest) = decode!(name(payload));
            let (target, _) = decode!(name(rest));
            fs.symlink(
                caller,
                inode,
                link_name,
                Path::new(target),
                ReplyEntry::Ring(reply),
            );
        }
        abi::MKNOD => {
            let arg: abi::MknodIn = decode!(record(op_in));
            let (child, _) = decode!(name(payload));
            fs.mknod(
                caller,
                inode,
                child,
                arg.mode,
                arg.umask,
                arg.rdev,
                ReplyEntry::Ring(reply),
            );
        }
        abi::MKDIR => {
            let arg: abi::MkdirIn = decode!(record(op_in));
            let (child, _) = decode!(name(payload));
            fs.mkdir(
                caller,
                inode,
                child,
                arg.mode,
                arg.umask,
                ReplyEntry::Ring(reply),
            );
        }
        abi::UNLINK => {
            let (child, _) = decode!(name(payload));
            fs.unlink(caller, inode, child, ReplyEmpty::Ring(reply));
        }
        abi::RMDIR => {
            let (child, _) = decode!(name(payload));
            fs.rmdir(caller, inode, child, ReplyEmpty::Ring(reply));
        }
        abi::RENAME | abi::RENAME2 => {
            let (new_parent, flags) = if request.opcode == abi::RENAME {
                let arg: abi::RenameIn = decode!(record(op_in));
                (arg.newdir, 0)
            } else {
                let arg: abi::Rename2In = decode!(record(op_in));
                (arg.newdir, arg.flags)
            };
            let (old, rest) = decode!(name(payload));
            let (new, _) = decode!(name(rest));
            fs.rename(
                caller,
                inode,
                old,
                INodeNo(new_parent),
                new,
                RenameFlags::from_bits_retain(flags),
                ReplyEmpty::Ring(reply),
            );
        }
        abi::LINK => {
            let arg: abi::LinkIn = decode!(record(op_in));
            let (new_name, _) = decode!(name(payload));
            // The request's node is the new parent; the record names the linked inode.
            fs.link(
                caller,
                INodeNo(arg.oldnodeid),
                inode,
                new_name,
                ReplyEntry::Ring(reply),
            );
        }
        abi::OPEN => {
            let arg: abi::OpenIn = decode!(record(op_in));
            fs.open(
                caller,
                inode,
                OpenFlags(arg.flags as i32),
                ReplyOpen::Ring(reply),
            );
        }
        abi::READ => {
            let arg: abi::ReadIn = decode!(record(op_in));
            let at = decode!(offset(arg.offset));
            let owner =
                (arg.read_flags & abi::READ_LOCKOWNER != 0).then_some(LockOwner(arg.lock_owner));
            fs.read(
                caller,
                inode,
                FileHandle(arg.fh),
                at,
                arg.size,
                OpenFlags(arg.flags as i32),
                owner,
                ReplyData::Ring(reply),
            );
        }
        abi::WRITE => {
            let arg: abi::WriteIn = decode!(record(op_in));
            let at = decode!(offset(arg.offset));
            let data = decode!(payload.get(..arg.size as usize).ok_or(Errno::EINVAL));
            let owner =
                (arg.write_flags & abi::WRITE_LOCKOWNER != 0).then_some(LockOwner(arg.lock_owner));
            fs.write(
                caller,
                inode,
                FileHandle(arg.fh),
                at,
                data,
                WriteFlags::from_bits_retain(arg.write_flags),
                OpenFlags(arg.flags as i32),
                owner,
                ReplyWrite::Ring(reply),
            );
        }
        abi::STATFS => fs.statfs(caller, inode, ReplyStatfs::Ring(reply)),
        abi::RELEASE => {
            let arg: abi::ReleaseIn = decode!(record(op_in));
            let owner = (arg.release_flags & abi::RELEASE_FLOCK_UNLOCK != 0)
                .then_some(LockOwner(arg.lock_owner));
            fs.release(
                caller,
                inode,
                FileHandle(arg.fh),
                OpenFlags(arg.flags as i32),
                owner,
                arg.release_flags & abi::RELEASE_FLUSH != 0,
                ReplyEmpty::Ring(reply),
            );
        }
        abi::FSYNC | abi::FSYNCDIR => {
            let arg: abi::FsyncIn = decode!(record(op_in));
            let data_only = arg.fsync_flags & abi::FSYNC_FDATASYNC != 0;
            let reply = ReplyEmpty::Ring(reply);
            if request.opcode == abi::FSYNC {
                fs.fsync(caller, inode, FileHandle(arg.fh), data_only, reply);
            } else {
                fs.fsyncdir(caller, inode, FileHandle(arg.fh), data_only, reply);
            }
        }
        abi::SETXATTR => {
            let arg: abi::SetxattrIn = decode!(record(op_in));
            let (attribute, value) = decode!(name(payload));
            let value = decode!(value.get(..arg.size as usize).ok_or(Errno::EINVAL));
            fs.setxattr(
                caller,
                inode,
                attribute,
                value,
                arg.flags as i32,
                0,
                ReplyEmpty::Ring(reply),
            );
        }
        abi::GETXATTR => {
            let arg: abi::GetxattrIn = decode!(record(op_in));
            let (attribute, _) = decode!(name(payload));
            fs.getxattr(caller, inode, attribute, arg.size, ReplyXattr::Ring(reply));
        }
        abi::LISTXATTR => {
            let arg: abi::GetxattrIn = decode!(record(op_in));
            fs.listxattr(caller, inode, arg.size, ReplyXattr::Ring(reply));
        }
        abi::REMOVEXATTR => {
            let (attribute, _) = decode!(name(payload));
            fs.removexattr(caller, inode, attribute, ReplyEmpty::Ring(reply));
        }
        abi::FLUSH => {
            let arg: abi::FlushIn = decode!(record(op_in));
            fs.flush(
                caller,
                inode,
                FileHandle(arg.fh),
                LockOwner(arg.lock_owner),
                ReplyEmpty::Ring(reply),
            );
        }
        abi::OPENDIR => {
            let arg: abi::OpenIn = decode!(record(op_in));
            fs.opendir(
                caller,
                inode,
                OpenFlags(arg.flags as i32),
                ReplyOpen::Ring(reply),
            );
        }
        abi::READDIR => {
            let arg: abi::ReadIn = decode!(record(op_in));
            let listing = RingListing::new(reply, arg.size);
            fs.readdir(
                caller,
                inode,
                FileHandle(arg.fh),
                arg.offset,
                ReplyDirectory::Ring(listing),
            );
        }
        abi::READDIRPLUS => {
            let arg: abi::ReadIn = decode!(record(op_in));
            let listing = RingListing::new(reply, arg.size);
            fs.readdirplus(
                caller,
                inode,
                FileHandle(arg.fh),
                arg.offset,
                ReplyDirectoryPlus::Ring(listing),
            );
        }
        abi::RELEASEDIR => {
            let arg: abi::ReleaseIn = decode!(record(op_in));
            fs.releasedir(
                caller,
                inode,
                FileHandle(arg.fh),
                OpenFlags(arg.flags as i32),
                ReplyEmpty::Ring(reply),
            );
        }
        abi::GETLK => {
            let arg: abi::LkIn = decode!(record(op_in));
            fs.getlk(
                caller,
                inode,
                FileHandle(arg.fh),
                LockOwner(arg.owner),
                arg.lock.start,
                arg.lock.end,
                arg.lock.kind as i32,
                arg.lock.pid,
                ReplyLock::Ring(reply),
            );
        }
        abi::SETLK | abi::SETLKW => {
            let arg: abi::LkIn = decode!(record(op_in));
            fs.setlk(
                caller,
                inode,
                FileHandle(arg.fh),
                LockOwner(arg.owner),
                arg.lock.start,
                arg.lock.end,
                arg.lock.kind as i32,
                arg.lock.pid,
                request.opcode == abi::SETLKW,
                ReplyEmpty::Ring(reply),
            );
        }
        abi::ACCESS => {
            let arg: abi::AccessIn = decode!(record(op_in));
            fs.access(
                caller,
                inode,
                AccessFlags::from_bits_retain(arg.mask as i32),
                ReplyEmpty::Ring(reply),
            );
        }
        abi::CREATE => {
            let arg: abi::CreateIn = decode!(record(op_in));
            let (child, _) = decode!(name(payload));
            fs.create(
                caller,
                inode,
                child,
                arg.mode,
                arg.umask,
                arg.flags as i32,
                ReplyCreate::Ring(reply),
            );
        }
        abi::IOCTL => {
            let arg: abi::IoctlIn = decode!(record(op_in));
            let data = payload.get(..arg.in_size as usize).unwrap_or(payload);
            fs.ioctl(
                caller,
                inode,
                FileHandle(arg.fh),
                IoctlFlags::from_bits_retain(arg.flags),
                arg.cmd,
                data,
                arg.out_size,
                ReplyIoctl::Ring(reply),
            );
        }
        abi::FALLOCATE => {
            let arg: abi::FallocateIn = decode!(record(op_in));
            fs.fallocate(
                caller,
                inode,
                FileHandle(arg.fh),
                decode!(offset(arg.offset)),
                // Refused past the kernel's `loff_t`, as fuser refuses it.
                decode!(offset(arg.length)),
                arg.mode as i32,
                ReplyEmpty::Ring(reply),
            );
        }
        abi::COPY_FILE_RANGE => {
            let arg: abi::CopyFileRangeIn = decode!(record(op_in));
            fs.copy_file_range(
                caller,
                inode,
                FileHandle(arg.fh_in),
                decode!(offset(arg.off_in)),
                INodeNo(arg.nodeid_out),
                FileHandle(arg.fh_out),
                decode!(offset(arg.off_out)),
                arg.len,
                CopyFileRangeFlags::from_bits_retain(arg.flags),
                ReplyWrite::Ring(reply),
            );
        }
        _ => return Err((Errno::ENOSYS, reply)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_end_at_their_nul_and_a_missing_nul_is_refused() {
        let (first, rest) = name(b"old\0new\0").unwrap();
        assert_eq!(first, OsStr::new("old"));
        assert_eq!(name(rest).unwrap().0, OsStr::new("new"));
        assert_eq!(name(b"unterminated").unwrap_err(), Errno::EINVAL);
    }

    #[test]
    fn times_and_offsets_decode_as_the_kernel_means_them() {
        assert_eq!(time(10, 5), UNIX_EPOCH + Duration::new(10, 5));
        assert_eq!(
            time((-2i64) as u64, 500_000_000),
            UNIX_EPOCH - Duration::new(1, 500_000_000)
        );
        let valid = abi::FATTR_ATIME | abi::FATTR_ATIME_NOW;
        assert!(matches!(
            set_time(valid, abi::FATTR_ATIME, abi::FATTR_ATIME_NOW, 0, 0),
            Some(TimeOrNow::Now)
        ));
        assert!(set_time(0, abi::FATTR_MTIME, abi::FATTR_MTIME_NOW, 1, 0).is_none());
        assert_eq!(offset(u64::MAX).unwrap_err(), Errno::EINVAL);
        assert_eq!(offset(7).unwrap(), 7);
    }
}
