//! Requests read from `/dev/fuse` by fuser: each `fuser::Filesystem` method hands its
//! request to the handler of the same name in `filesystem/`, with fuser's reply wrapped
//! in the mount's own reply type. FUSE over io_uring reaches the same handlers from
//! `ring/dispatch.rs`.

use std::ffi::OsStr;
use std::path::Path;

use fuser::{
    AccessFlags, CopyFileRangeFlags, FileHandle, INodeNo, IoctlFlags, KernelConfig, LockOwner,
    OpenFlags, RenameFlags, Request, TimeOrNow, WriteFlags,
};

use crate::filesystem::FreeflowFs;
use crate::reply::{
    Caller, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
};

/// Each listed operation as fuser declares it, forwarded to the handler of the same name
/// with the caller's credentials and fuser's reply wrapped.
macro_rules! forward {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $reply:ident;)*) => {
        $(
            fn $name(&self, request: &Request, $($arg: $ty,)* reply: fuser::$reply) {
                FreeflowFs::$name(self, &Caller::from(request), $($arg,)* $reply::Dev(reply));
            }
        )*
    };
}

impl fuser::Filesystem for FreeflowFs {
    fn init(&mut self, _request: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        self.init_kernel(config)
    }

    fn forget(&self, _request: &Request, inode: INodeNo, count: u64) {
        self.forget_inode(inode, count);
    }

    fn setattr(
        &self,
        request: &Request,
        inode: INodeNo,
        mode: Option<u32>,
        user_id: Option<u32>,
        group_id: Option<u32>,
        size: Option<u64>,
        access_time: Option<TimeOrNow>,
        modify_time: Option<TimeOrNow>,
        change_time: Option<std::time::SystemTime>,
        handle: Option<FileHandle>,
        _birth_time: Option<std::time::SystemTime>,
        _change_time_macos: Option<std::time::SystemTime>,
        _backup_time: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: fuser::ReplyAttr,
    ) {
        FreeflowFs::setattr(
            self,
            &Caller::from(request),
            inode,
            mode,
            user_id,
            group_id,
            size,
            access_time,
            modify_time,
            change_time,
            handle,
            ReplyAttr::Dev(reply),
        );
    }

    forward! {
        fn lookup(parent: INodeNo, name: &OsStr) -> ReplyEntry;
        fn getattr(inode: INodeNo, handle: Option<FileHandle>) -> ReplyAttr;
        fn readlink(inode: INodeNo) -> ReplyData;
        fn mknod(parent: INodeNo, name: &OsStr, mode: u32, umask: u32, device: u32) -> ReplyEntry;
        fn mkdir(parent: INodeNo, name: &OsStr, mode: u32, umask: u32) -> ReplyEntry;
        fn unlink(parent: INodeNo, name: &OsStr) -> ReplyEmpty;
        fn rmdir(parent: INodeNo, name: &OsStr) -> ReplyEmpty;
        fn symlink(parent: INodeNo, link_name: &OsStr, target: &Path) -> ReplyEntry;
        fn rename(
            parent: INodeNo,
            name: &OsStr,
            new_parent: INodeNo,
            new_name: &OsStr,
            flags: RenameFlags,
        ) -> ReplyEmpty;
        fn link(inode: INodeNo, new_parent: INodeNo, new_name: &OsStr) -> ReplyEntry;
        fn open(inode: INodeNo, flags: OpenFlags) -> ReplyOpen;
        fn read(
            inode: INodeNo,
            handle: FileHandle,
            offset: u64,
            size: u32,
            flags: OpenFlags,
            lock_owner: Option<LockOwner>,
        ) -> ReplyData;
        fn write(
            inode: INodeNo,
            handle: FileHandle,
            offset: u64,
            data: &[u8],
            write_flags: WriteFlags,
            flags: OpenFlags,
            lock_owner: Option<LockOwner>,
        ) -> ReplyWrite;
        fn flush(inode: INodeNo, handle: FileHandle, lock_owner: LockOwner) -> ReplyEmpty;
        fn release(
            inode: INodeNo,
            handle: FileHandle,
            flags: OpenFlags,
            lock_owner: Option<LockOwner>,
            flush: bool,
        ) -> ReplyEmpty;
        fn getlk(
            inode: INodeNo,
            handle: FileHandle,
            lock_owner: LockOwner,
            start: u64,
            end: u64,
            kind: i32,
            pid: u32,
        ) -> ReplyLock;
        fn setlk(
            inode: INodeNo,
            handle: FileHandle,
            lock_owner: LockOwner,
            start: u64,
            end: u64,
            kind: i32,
            pid: u32,
            sleep: bool,
        ) -> ReplyEmpty;
        fn fsync(inode: INodeNo, handle: FileHandle, datasync: bool) -> ReplyEmpty;
        fn opendir(inode: INodeNo, flags: OpenFlags) -> ReplyOpen;
        fn readdir(inode: INodeNo, handle: FileHandle, offset: u64) -> ReplyDirectory;
        fn readdirplus(inode: INodeNo, handle: FileHandle, offset: u64) -> ReplyDirectoryPlus;
        fn releasedir(inode: INodeNo, handle: FileHandle, flags: OpenFlags) -> ReplyEmpty;
        fn fsyncdir(inode: INodeNo, handle: FileHandle, datasync: bool) -> ReplyEmpty;
        fn statfs(inode: INodeNo) -> ReplyStatfs;
        fn setxattr(
            inode: INodeNo,
            name: &OsStr,
            value: &[u8],
            flags: i32,
            position: u32,
        ) -> ReplyEmpty;
        fn getxattr(inode: INodeNo, name: &OsStr, size: u32) -> ReplyXattr;
        fn listxattr(inode: INodeNo, size: u32) -> ReplyXattr;
        fn removexattr(inode: INodeNo, name: &OsStr) -> ReplyEmpty;
        fn access(inode: INodeNo, mask: AccessFlags) -> ReplyEmpty;
        fn create(
            parent: INodeNo,
            name: &OsStr,
            mode: u32,
            umask: u32,
            flags: i32,
        ) -> ReplyCreate;
        fn ioctl(
            inode: INodeNo,
            handle: FileHandle,
            flags: IoctlFlags,
            command: u32,
            in_data: &[u8],
            out_size: u32,
        ) -> ReplyIoctl;
        fn fallocate(
            inode: INodeNo,
            handle: FileHandle,
            offset: u64,
            length: u64,
            mode: i32,
        ) -> ReplyEmpty;
        fn copy_file_range(
            source_inode: INodeNo,
            source_handle: FileHandle,
            source_offset: u64,
            target_inode: INodeNo,
            target_handle: FileHandle,
            target_offset: u64,
            length: u64,
            flags: CopyFileRangeFlags,
        ) -> ReplyWrite;
    }
}
