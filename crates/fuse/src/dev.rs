//! Requests read from `/dev/fuse` by fuser: each `fuser::Filesystem` method hands its
//! request to the handler of the same name in `filesystem.rs`, with fuser's reply wrapped
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

impl fuser::Filesystem for FreeflowFs {
    fn init(&mut self, _request: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        self.init_kernel(config)
    }

    fn lookup(&self, request: &Request, parent: INodeNo, name: &OsStr, reply: fuser::ReplyEntry) {
        FreeflowFs::lookup(
            self,
            &Caller::from(request),
            parent,
            name,
            ReplyEntry::Dev(reply),
        );
    }

    fn forget(&self, _request: &Request, inode: INodeNo, count: u64) {
        self.forget_inode(inode, count);
    }

    fn getattr(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: Option<FileHandle>,
        reply: fuser::ReplyAttr,
    ) {
        FreeflowFs::getattr(
            self,
            &Caller::from(request),
            inode,
            handle,
            ReplyAttr::Dev(reply),
        );
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

    fn readlink(&self, request: &Request, inode: INodeNo, reply: fuser::ReplyData) {
        FreeflowFs::readlink(self, &Caller::from(request), inode, ReplyData::Dev(reply));
    }

    fn mknod(
        &self,
        request: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        device: u32,
        reply: fuser::ReplyEntry,
    ) {
        FreeflowFs::mknod(
            self,
            &Caller::from(request),
            parent,
            name,
            mode,
            umask,
            device,
            ReplyEntry::Dev(reply),
        );
    }

    fn mkdir(
        &self,
        request: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: fuser::ReplyEntry,
    ) {
        FreeflowFs::mkdir(
            self,
            &Caller::from(request),
            parent,
            name,
            mode,
            umask,
            ReplyEntry::Dev(reply),
        );
    }

    fn unlink(&self, request: &Request, parent: INodeNo, name: &OsStr, reply: fuser::ReplyEmpty) {
        FreeflowFs::unlink(
            self,
            &Caller::from(request),
            parent,
            name,
            ReplyEmpty::Dev(reply),
        );
    }

    fn rmdir(&self, request: &Request, parent: INodeNo, name: &OsStr, reply: fuser::ReplyEmpty) {
        FreeflowFs::rmdir(
            self,
            &Caller::from(request),
            parent,
            name,
            ReplyEmpty::Dev(reply),
        );
    }

    fn symlink(
        &self,
        request: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: fuser::ReplyEntry,
    ) {
        FreeflowFs::symlink(
            self,
            &Caller::from(request),
            parent,
            link_name,
            target,
            ReplyEntry::Dev(reply),
        );
    }

    fn rename(
        &self,
        request: &Request,
        parent: INodeNo,
        name: &OsStr,
        new_parent: INodeNo,
        new_name: &OsStr,
        flags: RenameFlags,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::rename(
            self,
            &Caller::from(request),
            parent,
            name,
            new_parent,
            new_name,
            flags,
            ReplyEmpty::Dev(reply),
        );
    }

    fn link(
        &self,
        request: &Request,
        inode: INodeNo,
        new_parent: INodeNo,
        new_name: &OsStr,
        reply: fuser::ReplyEntry,
    ) {
        FreeflowFs::link(
            self,
            &Caller::from(request),
            inode,
            new_parent,
            new_name,
            ReplyEntry::Dev(reply),
        );
    }

    fn open(&self, request: &Request, inode: INodeNo, flags: OpenFlags, reply: fuser::ReplyOpen) {
        FreeflowFs::open(
            self,
            &Caller::from(request),
            inode,
            flags,
            ReplyOpen::Dev(reply),
        );
    }

    fn read(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        reply: fuser::ReplyData,
    ) {
        FreeflowFs::read(
            self,
            &Caller::from(request),
            inode,
            handle,
            offset,
            size,
            flags,
            lock_owner,
            ReplyData::Dev(reply),
        );
    }

    fn write(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        FreeflowFs::write(
            self,
            &Caller::from(request),
            inode,
            handle,
            offset,
            data,
            write_flags,
            flags,
            lock_owner,
            ReplyWrite::Dev(reply),
        );
    }

    fn flush(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        lock_owner: LockOwner,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::flush(
            self,
            &Caller::from(request),
            inode,
            handle,
            lock_owner,
            ReplyEmpty::Dev(reply),
        );
    }

    fn release(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        flush: bool,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::release(
            self,
            &Caller::from(request),
            inode,
            handle,
            flags,
            lock_owner,
            flush,
            ReplyEmpty::Dev(reply),
        );
    }

    fn getlk(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        kind: i32,
        pid: u32,
        reply: fuser::ReplyLock,
    ) {
        FreeflowFs::getlk(
            self,
            &Caller::from(request),
            inode,
            handle,
            lock_owner,
            start,
            end,
            kind,
            pid,
            ReplyLock::Dev(reply),
        );
    }

    fn setlk(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        kind: i32,
        pid: u32,
        sleep: bool,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::setlk(
            self,
            &Caller::from(request),
            inode,
            handle,
            lock_owner,
            start,
            end,
            kind,
            pid,
            sleep,
            ReplyEmpty::Dev(reply),
        );
    }

    fn fsync(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        datasync: bool,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::fsync(
            self,
            &Caller::from(request),
            inode,
            handle,
            datasync,
            ReplyEmpty::Dev(reply),
        );
    }

    fn opendir(
        &self,
        request: &Request,
        inode: INodeNo,
        flags: OpenFlags,
        reply: fuser::ReplyOpen,
    ) {
        FreeflowFs::opendir(
            self,
            &Caller::from(request),
            inode,
            flags,
            ReplyOpen::Dev(reply),
        );
    }

    fn readdir(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        reply: fuser::ReplyDirectory,
    ) {
        FreeflowFs::readdir(
            self,
            &Caller::from(request),
            inode,
            handle,
            offset,
            ReplyDirectory::Dev(reply),
        );
    }

    fn readdirplus(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        reply: fuser::ReplyDirectoryPlus,
    ) {
        FreeflowFs::readdirplus(
            self,
            &Caller::from(request),
            inode,
            handle,
            offset,
            ReplyDirectoryPlus::Dev(reply),
        );
    }

    fn releasedir(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        flags: OpenFlags,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::releasedir(
            self,
            &Caller::from(request),
            inode,
            handle,
            flags,
            ReplyEmpty::Dev(reply),
        );
    }

    fn fsyncdir(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        datasync: bool,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::fsyncdir(
            self,
            &Caller::from(request),
            inode,
            handle,
            datasync,
            ReplyEmpty::Dev(reply),
        );
    }

    fn statfs(&self, request: &Request, inode: INodeNo, reply: fuser::ReplyStatfs) {
        FreeflowFs::statfs(self, &Caller::from(request), inode, ReplyStatfs::Dev(reply));
    }

    fn setxattr(
        &self,
        request: &Request,
        inode: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::setxattr(
            self,
            &Caller::from(request),
            inode,
            name,
            value,
            flags,
            position,
            ReplyEmpty::Dev(reply),
        );
    }

    fn getxattr(
        &self,
        request: &Request,
        inode: INodeNo,
        name: &OsStr,
        size: u32,
        reply: fuser::ReplyXattr,
    ) {
        FreeflowFs::getxattr(
            self,
            &Caller::from(request),
            inode,
            name,
            size,
            ReplyXattr::Dev(reply),
        );
    }

    fn listxattr(&self, request: &Request, inode: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        FreeflowFs::listxattr(
            self,
            &Caller::from(request),
            inode,
            size,
            ReplyXattr::Dev(reply),
        );
    }

    fn removexattr(
        &self,
        request: &Request,
        inode: INodeNo,
        name: &OsStr,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::removexattr(
            self,
            &Caller::from(request),
            inode,
            name,
            ReplyEmpty::Dev(reply),
        );
    }

    fn access(
        &self,
        request: &Request,
        inode: INodeNo,
        mask: AccessFlags,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::access(
            self,
            &Caller::from(request),
            inode,
            mask,
            ReplyEmpty::Dev(reply),
        );
    }

    fn create(
        &self,
        request: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        FreeflowFs::create(
            self,
            &Caller::from(request),
            parent,
            name,
            mode,
            umask,
            flags,
            ReplyCreate::Dev(reply),
        );
    }

    fn ioctl(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        flags: IoctlFlags,
        command: u32,
        in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        FreeflowFs::ioctl(
            self,
            &Caller::from(request),
            inode,
            handle,
            flags,
            command,
            in_data,
            out_size,
            ReplyIoctl::Dev(reply),
        );
    }

    fn fallocate(
        &self,
        request: &Request,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: fuser::ReplyEmpty,
    ) {
        FreeflowFs::fallocate(
            self,
            &Caller::from(request),
            inode,
            handle,
            offset,
            length,
            mode,
            ReplyEmpty::Dev(reply),
        );
    }

    fn copy_file_range(
        &self,
        request: &Request,
        source_inode: INodeNo,
        source_handle: FileHandle,
        source_offset: u64,
        target_inode: INodeNo,
        target_handle: FileHandle,
        target_offset: u64,
        length: u64,
        flags: CopyFileRangeFlags,
        reply: fuser::ReplyWrite,
    ) {
        FreeflowFs::copy_file_range(
            self,
            &Caller::from(request),
            source_inode,
            source_handle,
            source_offset,
            target_inode,
            target_handle,
            target_offset,
            length,
            flags,
            ReplyWrite::Dev(reply),
        );
    }
}
