//! The mount's replies, one type per kind of answer, whichever way the request came: read
//! from `/dev/fuse` by fuser (its reply object, which writes the answer back there) or
//! taken from a ring entry of FUSE over io_uring (`ring.rs`, which encodes the answer into
//! the entry and commits it). The handlers in `filesystem/` answer through these and do
//! not know which transport carried the request.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{Errno, FileAttr, FileType, FopenFlags, Generation, INodeNo};
use zerocopy::IntoBytes;

use crate::ring::abi;
use crate::ring::RingReply;

/// Who made a request: the kernel's credentials of the calling process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl From<&fuser::Request> for Caller {
    fn from(request: &fuser::Request) -> Caller {
        Caller {
            uid: request.uid(),
            gid: request.gid(),
            pid: request.pid(),
        }
    }
}

/// A reply type over fuser's and the ring's, with `error` for both.
macro_rules! reply_type {
    ($name:ident, $fuser:ty) => {
        pub(crate) enum $name {
            Dev($fuser),
            Ring(RingReply),
        }

        impl $name {
            pub fn error(self, error: Errno) {
                match self {
                    $name::Dev(reply) => reply.error(error),
                    $name::Ring(reply) => reply.error(error),
                }
            }
        }
    };
}

reply_type!(ReplyEmpty, fuser::ReplyEmpty);
reply_type!(ReplyData, fuser::ReplyData);
reply_type!(ReplyEntry, fuser::ReplyEntry);
reply_type!(ReplyAttr, fuser::ReplyAttr);
reply_type!(ReplyOpen, fuser::ReplyOpen);
reply_type!(ReplyWrite, fuser::ReplyWrite);
reply_type!(ReplyStatfs, fuser::ReplyStatfs);
reply_type!(ReplyCreate, fuser::ReplyCreate);
reply_type!(ReplyLock, fuser::ReplyLock);
reply_type!(ReplyIoctl, fuser::ReplyIoctl);
reply_type!(ReplyXattr, fuser::ReplyXattr);

impl ReplyEmpty {
    pub fn ok(self) {
        match self {
            ReplyEmpty::Dev(reply) => reply.ok(),
            ReplyEmpty::Ring(reply) => reply.send(&[]),
        }
    }
}

impl ReplyData {
    pub fn data(self, data: &[u8]) {
        match self {
            ReplyData::Dev(reply) => reply.data(data),
            ReplyData::Ring(reply) => reply.send(&[data]),
        }
    }
}

impl ReplyEntry {
    pub fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation) {
        self.entry_with_ttls(ttl, ttl, attr, generation);
    }

    /// As fuser's: the attributes' time-out first, then the name's.
    pub fn entry_with_ttls(
        self,
        attr_ttl: &Duration,
        entry_ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
    ) {
        match self {
            ReplyEntry::Dev(reply) => reply.entry_with_ttls(attr_ttl, entry_ttl, attr, generation),
            ReplyEntry::Ring(reply) => {
                let out = entry_out(entry_ttl, attr, generation, attr_ttl);
                reply.send(&[out.as_bytes()]);
            }
        }
    }
}

impl ReplyAttr {
    pub fn attr(self, ttl: &Duration, attr: &FileAttr) {
        match self {
            ReplyAttr::Dev(reply) => reply.attr(ttl, attr),
            ReplyAttr::Ring(reply) => {
                let out = abi::AttrOut {
                    attr_valid: ttl.as_secs(),
                    attr_valid_nsec: ttl.subsec_nanos(),
                    dummy: 0,
                    attr: wire_attr(attr),
                };
                reply.send(&[out.as_bytes()]);
            }
        }
    }
}

impl ReplyOpen {
    pub fn opened(self, fh: fuser::FileHandle, flags: FopenFlags) {
        match self {
            ReplyOpen::Dev(reply) => reply.opened(fh, flags),
            ReplyOpen::Ring(reply) => {
                let out = open_out(fh, flags);
                reply.send(&[out.as_bytes()]);
            }
        }
    }
}

impl ReplyWrite {
    pub fn written(self, size: u32) {
        match self {
            ReplyWrite::Dev(reply) => reply.written(size),
            ReplyWrite::Ring(reply) => {
                let out = abi::WriteOut { size, padding: 0 };
                reply.send(&[out.as_bytes()]);
            }
        }
    }
}

impl ReplyStatfs {
    #[allow(clippy::too_many_arguments)]
    pub fn statfs(
        self,
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
    ) {
        match self {
            ReplyStatfs::Dev(reply) => {
                reply.statfs(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize)
            }
            ReplyStatfs::Ring(reply) => {
                let out = abi::StatfsOut {
                    blocks,
                    bfree,
                    bavail,
                    files,
                    ffree,
                    bsize,
                    namelen,
                    frsize,
                    ..abi::StatfsOut::default()
                };
                reply.send(&[out.as_bytes()]);
            }
        }
    }
}

impl ReplyCreate {
    pub fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: fuser::FileHandle,
        flags: FopenFlags,
    ) {
        match self {
            ReplyCreate::Dev(reply) => reply.created(ttl, attr, generation, fh, flags),
            ReplyCreate::Ring(reply) => {
                let entry = entry_out(ttl, attr, generation, ttl);
                let open = open_out(fh, flags);
                reply.send(&[entry.as_bytes(), open.as_bytes()]);
            }
        }
    }
}

impl ReplyLock {
    pub fn locked(self, start: u64, end: u64, kind: i32, pid: u32) {
        match self {
            ReplyLock::Dev(reply) => reply.locked(start, end, kind, pid),
            ReplyLock::Ring(reply) => {
                let out = abi::FileLock {
                    start,
                    end,
                    kind: kind as u32,
                    pid,
                };
                reply.send(&[out.as_bytes()]);
            }
        }
    }
}

impl ReplyXattr {
    pub fn size(self, size: u32) {
        match self {
            ReplyXattr::Dev(reply) => reply.size(size),
            ReplyXattr::Ring(reply) => {
                let out = abi::GetxattrOut { size, padding: 0 };
                reply.send(&[out.as_bytes()]);
            }
        }
    }

    pub fn data(self, data: &[u8]) {
        match self {
            ReplyXattr::Dev(reply) => reply.data(data),
            ReplyXattr::Ring(reply) => reply.send(&[data]),
        }
    }
}

/// Directory entries gathered for a ring reply, up to the size the kernel asked for,
/// written straight into the request's entry.
pub(crate) struct RingListing {
    reply: RingReply,
    len: usize,
    limit: usize,
}

impl RingListing {
    /// Only for `READDIR` and `READDIRPLUS`, whose handlers get no slice of the request's
    /// payload (the listing is written there).
    pub fn new(reply: RingReply, size: u32) -> RingListing {
        let limit = (size as usize).min(reply.payload_capacity());
        RingListing {
            reply,
            len: 0,
            limit,
        }
    }

    /// Appends `records` then the name padded to 8 bytes; false (nothing added) if it does
    /// not fit.
    fn push(&mut self, records: &[&[u8]], name: &[u8]) -> bool {
        let fixed: usize = records.iter().map(|record| record.len()).sum();
        let padded = (fixed + name.len()).next_multiple_of(8);
        if self.len + padded > self.limit {
            return false;
        }
        // SAFETY: a listing's request lends its handler nothing of its payload (`new`).
        let buffer = unsafe { self.reply.payload_mut() };
        let mut at = self.len;
        for part in records.iter().chain([&name]) {
            buffer[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        buffer[at..self.len + padded].fill(0);
        self.len += padded;
        true
    }

    fn send(self) {
        self.reply.send_in_place(self.len);
    }
}

pub(crate) enum ReplyDirectory {
    Dev(fuser::ReplyDirectory),
    Ring(RingListing),
}

impl ReplyDirectory {
    /// Adds an entry; true when the reply is full (the entry was not added).
    #[must_use]
    pub fn add<T: AsRef<OsStr>>(
        &mut self,
        ino: INodeNo,
        offset: u64,
        kind: FileType,
        name: T,
    ) -> bool {
        match self {
            ReplyDirectory::Dev(reply) => reply.add(ino, offset, kind, name),
            ReplyDirectory::Ring(listing) => {
                let name = name.as_ref().as_bytes();
                let dirent = dirent(ino, offset, kind, name);
                !listing.push(&[dirent.as_bytes()], name)
            }
        }
    }

    pub fn ok(self) {
        match self {
            ReplyDirectory::Dev(reply) => reply.ok(),
            ReplyDirectory::Ring(listing) => listing.send(),
        }
    }

    pub fn error(self, error: Errno) {
        match self {
            ReplyDirectory::Dev(reply) => reply.error(error),
            ReplyDirectory::Ring(listing) => listing.reply.error(error),
        }
    }
}

pub(crate) enum ReplyDirectoryPlus {
    Dev(fuser::ReplyDirectoryPlus),
    Ring(RingListing),
}

impl ReplyDirectoryPlus {
    /// Adds an entry with its attributes; true when the reply is full (it was not added).
    pub fn add<T: AsRef<OsStr>>(
        &mut self,
        ino: INodeNo,
        offset: u64,
        name: T,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
    ) -> bool {
        match self {
            ReplyDirectoryPlus::Dev(reply) => reply.add(ino, offset, name, ttl, attr, generation),
            ReplyDirectoryPlus::Ring(listing) => {
                let name = name.as_ref().as_bytes();
                let entry = entry_out(ttl, attr, generation, ttl);
                let dirent = dirent(ino, offset, attr.kind, name);
                !listing.push(&[entry.as_bytes(), dirent.as_bytes()], name)
            }
        }
    }

    /// Whether entries may go without attributes ([`ReplyDirectoryPlus::add_name`]):
    /// over a ring, where the mount writes the records itself.
    pub fn takes_names_alone(&self) -> bool {
        matches!(self, ReplyDirectoryPlus::Ring(_))
    }

    /// Adds an entry without attributes (node id 0: the kernel lists the name and leaves
    /// its own cache of it as it is); true when the reply is full (it was not added). Only
    /// where [`ReplyDirectoryPlus::takes_names_alone`].
    pub fn add_name<T: AsRef<OsStr>>(
        &mut self,
        ino: INodeNo,
        offset: u64,
        kind: FileType,
        name: T,
    ) -> bool {
        match self {
            ReplyDirectoryPlus::Dev(_) => {
                unreachable!("fuser gives every READDIRPLUS entry its attributes")
            }
            ReplyDirectoryPlus::Ring(listing) => {
                let name = name.as_ref().as_bytes();
                let entry = abi::EntryOut::default();
                let dirent = dirent(ino, offset, kind, name);
                !listing.push(&[entry.as_bytes(), dirent.as_bytes()], name)
            }
        }
    }

    pub fn ok(self) {
        match self {
            ReplyDirectoryPlus::Dev(reply) => reply.ok(),
            ReplyDirectoryPlus::Ring(listing) => listing.send(),
        }
    }

    pub fn error(self, error: Errno) {
        match self {
            ReplyDirectoryPlus::Dev(reply) => reply.error(error),
            ReplyDirectoryPlus::Ring(listing) => listing.reply.error(error),
        }
    }
}

/// A listing record's fixed part for `name`.
fn dirent(ino: INodeNo, offset: u64, kind: FileType, name: &[u8]) -> abi::Dirent {
    abi::Dirent {
        ino: ino.0,
        off: offset,
        namelen: name.len() as u32,
        kind: dirent_type(kind),
    }
}

fn entry_out(
    entry_ttl: &Duration,
    attr: &FileAttr,
    generation: Generation,
    attr_ttl: &Duration,
) -> abi::EntryOut {
    abi::EntryOut {
        nodeid: attr.ino.0,
        generation: generation.0,
        entry_valid: entry_ttl.as_secs(),
        attr_valid: attr_ttl.as_secs(),
        entry_valid_nsec: entry_ttl.subsec_nanos(),
        attr_valid_nsec: attr_ttl.subsec_nanos(),
        attr: wire_attr(attr),
    }
}

fn open_out(fh: fuser::FileHandle, flags: FopenFlags) -> abi::OpenOut {
    abi::OpenOut {
        fh: fh.0,
        open_flags: flags.bits(),
        backing_id: 0,
    }
}

/// Seconds and nanoseconds since the epoch as the kernel takes them (a time before the
/// epoch is negative seconds, in the field's two's complement, with positive nanoseconds).
fn wire_time(time: &SystemTime) -> (u64, u32) {
    match time.duration_since(UNIX_EPOCH) {
        Ok(since) => (since.as_secs().min(i64::MAX as u64), since.subsec_nanos()),
        Err(before) => {
            let before = before.duration();
            let (mut seconds, mut nanos) = (-(before.as_secs() as i64), before.subsec_nanos());
            if nanos > 0 {
                seconds -= 1;
                nanos = 1_000_000_000 - nanos;
            }
            (seconds as u64, nanos)
        }
    }
}

fn file_mode(kind: FileType, permissions: u16) -> u32 {
    let format = match kind {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    };
    format | u32::from(permissions)
}

/// `DT_*` of a directory entry: the file format bits shifted down.
fn dirent_type(kind: FileType) -> u32 {
    file_mode(kind, 0) >> 12
}

pub(crate) fn wire_attr(attr: &FileAttr) -> abi::Attr {
    let (atime, atimensec) = wire_time(&attr.atime);
    let (mtime, mtimensec) = wire_time(&attr.mtime);
    let (ctime, ctimensec) = wire_time(&attr.ctime);
    abi::Attr {
        ino: attr.ino.0,
        size: attr.size,
        blocks: attr.blocks,
        atime,
        mtime,
        ctime,
        atimensec,
        mtimensec,
        ctimensec,
        mode: file_mode(attr.kind, attr.perm),
        nlink: attr.nlink,
        uid: attr.uid,
        gid: attr.gid,
        rdev: attr.rdev,
        blksize: attr.blksize,
        flags: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_the_epoch_have_positive_nanoseconds() {
        assert_eq!(wire_time(&(UNIX_EPOCH + Duration::new(5, 7))), (5, 7));
        let before = UNIX_EPOCH - Duration::new(1, 250_000_000);
        assert_eq!(wire_time(&before), ((-2i64) as u64, 750_000_000));
        assert_eq!(
            wire_time(&(UNIX_EPOCH - Duration::new(3, 0))),
            ((-3i64) as u64, 0)
        );
    }

    #[test]
    fn modes_and_entry_types_follow_the_file_kind() {
        assert_eq!(file_mode(FileType::RegularFile, 0o644), 0o100644);
        assert_eq!(file_mode(FileType::Directory, 0o755), 0o040755);
        assert_eq!(dirent_type(FileType::Directory), libc::DT_DIR as u32);
        assert_eq!(dirent_type(FileType::Symlink), libc::DT_LNK as u32);
        assert_eq!(dirent_type(FileType::RegularFile), libc::DT_REG as u32);
    }
}
