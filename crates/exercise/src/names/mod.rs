//! `freeflow exercise-names`: a seeded random exerciser of the namespace, the twin of the data
//! exerciser in the crate root.
//!
//! The data exerciser checks the bytes of one file; this one checks names. Several workers
//! (threads), each with its own [`NamesTarget`] (different mounts of one cluster, the same
//! local directory several times, or the client library), run a random mix of every call that
//! changes a name or an inode's attributes: `open(O_CREAT|O_EXCL)`, `mkdir`, `rmdir`,
//! `unlink`, `link`, `symlink`, `mknod` of a FIFO, `renameat2` with no flag,
//! `RENAME_NOREPLACE`, `RENAME_EXCHANGE` and `RENAME_WHITEOUT`, `chmod`, `lchown`,
//! `utimensat`, `lsetxattr` and `lremovexattr` of `user.*` names, `truncate` and a small
//! `pwrite`. Names come from a small set (directories `d0`..`d7`, others `f0`..`f15`, nested
//! a few levels) so that collisions, moves into a directory's own subtree and renames onto
//! hard links of the same inode happen often: a name lost or invented somewhere in a layer that
//! remembers names (kept listings, creates answered ahead, leases, the kernel's dentries)
//! shows up within a few hundred operations.
//!
//! Each call's result is compared with [`model::Model`], which computes what Linux returns,
//! errno included, in the order the kernel checks ([`driver`] for the two modes: *serial*,
//! where every call is checked exactly even across mounts, and *concurrent*, where workers run
//! free and only the set of errnos a call can give is checked). At the end of each batch every
//! target walks the whole tree ([`walk`]) and the walks must agree with the model and with
//! each other. A failure names the seed, the worker and the operation, with the last
//! operations of every worker that touched the names involved; [`shrink`] cuts a serial
//! failure down to a short list of system calls.
//!
//! A target may not support every operation (the library has no whiteout): the driver then
//! never asks it for one ([`NamesTarget::supports`]), and the report lists what was skipped.

pub mod choose;
pub mod driver;
pub mod library;
pub mod model;
pub mod options;
pub mod posix;
pub mod shrink;
pub mod walk;

use std::fmt;

pub use driver::{run, NamesFailure, NamesReport};
pub use options::NamesOptions;
pub use shrink::{replay, shrink};

/// An error number as the system calls return it (`libc::ENOENT`, ...).
pub type Errno = i32;

/// The kind of an inode as `lstat` (`S_IFMT`) or a listing (`d_type`) tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    /// A character device: the whiteout `RENAME_WHITEOUT` leaves (device 0/0).
    CharDevice,
    /// Anything else (block device, socket): the exerciser never makes one.
    Other,
}

impl NodeKind {
    /// The kind of an `st_mode`.
    pub fn from_mode(mode: u32) -> NodeKind {
        match mode & libc::S_IFMT {
            libc::S_IFREG => NodeKind::Regular,
            libc::S_IFDIR => NodeKind::Directory,
            libc::S_IFLNK => NodeKind::Symlink,
            libc::S_IFIFO => NodeKind::Fifo,
            libc::S_IFCHR => NodeKind::CharDevice,
            _ => NodeKind::Other,
        }
    }

    /// The kind of a `d_type`; `None` for `DT_UNKNOWN`.
    pub fn from_directory_type(directory_type: u8) -> Option<NodeKind> {
        match directory_type {
            libc::DT_REG => Some(NodeKind::Regular),
            libc::DT_DIR => Some(NodeKind::Directory),
            libc::DT_LNK => Some(NodeKind::Symlink),
            libc::DT_FIFO => Some(NodeKind::Fifo),
            libc::DT_CHR => Some(NodeKind::CharDevice),
            libc::DT_UNKNOWN => None,
            _ => Some(NodeKind::Other),
        }
    }
}

/// What `lstat` tells of a name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    pub inode_number: u64,
    pub kind: NodeKind,
    /// Permission bits only (`0o7777`).
    pub permissions: u32,
    pub size_bytes: u64,
    pub link_count: u64,
    pub user_id: u32,
    pub group_id: u32,
}

/// One entry of a directory listing (`readdir`: `d_name`, `d_ino`, `d_type`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedEntry {
    pub name: String,
    pub inode_number: u64,
    /// `None` when the listing says `DT_UNKNOWN`.
    pub kind: Option<NodeKind>,
}

/// Who a target's new inodes belong to and which permission bits its creations lose (the
/// process's umask on a path; nothing through the library).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Creator {
    pub user_id: u32,
    pub group_id: u32,
    pub creation_mask: u32,
}

/// The flag of a `renameat2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RenameFlag {
    None,
    NoReplace,
    Exchange,
    Whiteout,
}

impl RenameFlag {
    /// The `renameat2` flag bits.
    pub fn bits(self) -> u32 {
        match self {
            RenameFlag::None => 0,
            RenameFlag::NoReplace => libc::RENAME_NOREPLACE,
            RenameFlag::Exchange => libc::RENAME_EXCHANGE,
            RenameFlag::Whiteout => libc::RENAME_WHITEOUT,
        }
    }
}

/// How a `setxattr` treats an existing attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XattrHow {
    /// Create or replace (flags 0).
    Any,
    /// `XATTR_CREATE`: `EEXIST` if it exists.
    CreateOnly,
    /// `XATTR_REPLACE`: `ENODATA` if it does not.
    ReplaceOnly,
}

/// One namespace call, as data: what a worker ran, what a failure lists and what
/// [`shrink`] cuts down. Paths are relative to a target's root, components joined by `/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Operation {
    /// `open(path, O_CREAT | O_EXCL | O_WRONLY, 0644)` and `close`.
    Create {
        path: String,
    },
    /// `mkdir(path, 0755)`.
    MakeDirectory {
        path: String,
    },
    RemoveDirectory {
        path: String,
    },
    Unlink {
        path: String,
    },
    /// `link(source, target)` (a final symlink is linked itself).
    Link {
        source: String,
        target: String,
    },
    /// `symlink(contents, path)`.
    Symlink {
        path: String,
        contents: String,
    },
    /// `mknod(path, S_IFIFO | 0644, 0)`.
    MakeFifo {
        path: String,
    },
    /// `renameat2(source, target, flag)`.
    Rename {
        source: String,
        target: String,
        flag: RenameFlag,
    },
    /// `chmod(path, permissions)` (follows a final symlink).
    ChangeMode {
        path: String,
        permissions: u32,
    },
    /// `lchown(path, user_id, group_id)`.
    ChangeOwner {
        path: String,
        user_id: u32,
        group_id: u32,
    },
    /// `utimensat(path, {seconds, seconds}, AT_SYMLINK_NOFOLLOW)`.
    SetTimes {
        path: String,
        seconds: i64,
    },
    /// `lsetxattr(path, name, value, how)`.
    SetXattr {
        path: String,
        name: String,
        value: Vec<u8>,
        how: XattrHow,
    },
    /// `lremovexattr(path, name)`.
    RemoveXattr {
        path: String,
        name: String,
    },
    /// `truncate(path, size_bytes)` (follows a final symlink).
    Truncate {
        path: String,
        size_bytes: u64,
    },
    /// `open(path, O_WRONLY | O_NONBLOCK)`, `pwrite(data, offset)`, `close` (a FIFO without
    /// a reader answers `ENXIO` instead of blocking).
    Write {
        path: String,
        offset: u64,
        data: Vec<u8>,
    },
}

/// The operations by name, for counts, weights and [`NamesTarget::supports`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OperationKind {
    Create,
    MakeDirectory,
    RemoveDirectory,
    Unlink,
    Link,
    Symlink,
    MakeFifo,
    Rename,
    RenameNoReplace,
    RenameExchange,
    RenameWhiteout,
    ChangeMode,
    ChangeOwner,
    SetTimes,
    SetXattr,
    RemoveXattr,
    Truncate,
    Write,
}

impl Operation {
    pub fn kind(&self) -> OperationKind {
        match self {
            Operation::Create { .. } => OperationKind::Create,
            Operation::MakeDirectory { .. } => OperationKind::MakeDirectory,
            Operation::RemoveDirectory { .. } => OperationKind::RemoveDirectory,
            Operation::Unlink { .. } => OperationKind::Unlink,
            Operation::Link { .. } => OperationKind::Link,
            Operation::Symlink { .. } => OperationKind::Symlink,
            Operation::MakeFifo { .. } => OperationKind::MakeFifo,
            Operation::Rename { flag, .. } => match flag {
                RenameFlag::None => OperationKind::Rename,
                RenameFlag::NoReplace => OperationKind::RenameNoReplace,
                RenameFlag::Exchange => OperationKind::RenameExchange,
                RenameFlag::Whiteout => OperationKind::RenameWhiteout,
            },
            Operation::ChangeMode { .. } => OperationKind::ChangeMode,
            Operation::ChangeOwner { .. } => OperationKind::ChangeOwner,
            Operation::SetTimes { .. } => OperationKind::SetTimes,
            Operation::SetXattr { .. } => OperationKind::SetXattr,
            Operation::RemoveXattr { .. } => OperationKind::RemoveXattr,
            Operation::Truncate { .. } => OperationKind::Truncate,
            Operation::Write { .. } => OperationKind::Write,
        }
    }

    /// The paths the call names (for the history of a failure).
    pub fn paths(&self) -> Vec<&str> {
        match self {
            Operation::Link { source, target } | Operation::Rename { source, target, .. } => {
                vec![source, target]
            }
            Operation::Create { path }
            | Operation::MakeDirectory { path }
            | Operation::RemoveDirectory { path }
            | Operation::Unlink { path }
            | Operation::Symlink { path, .. }
            | Operation::MakeFifo { path }
            | Operation::ChangeMode { path, .. }
            | Operation::ChangeOwner { path, .. }
            | Operation::SetTimes { path, .. }
            | Operation::SetXattr { path, .. }
            | Operation::RemoveXattr { path, .. }
            | Operation::Truncate { path, .. }
            | Operation::Write { path, .. } => vec![path],
        }
    }
}

impl fmt::Display for Operation {
    /// As the system call a C program would make, paths relative to the target's root.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operation::Create { path } => {
                write!(f, "close(open({path:?}, O_CREAT|O_EXCL|O_WRONLY, 0644))")
            }
            Operation::MakeDirectory { path } => write!(f, "mkdir({path:?}, 0755)"),
            Operation::RemoveDirectory { path } => write!(f, "rmdir({path:?})"),
            Operation::Unlink { path } => write!(f, "unlink({path:?})"),
            Operation::Link { source, target } => write!(f, "link({source:?}, {target:?})"),
            Operation::Symlink { path, contents } => write!(f, "symlink({contents:?}, {path:?})"),
            Operation::MakeFifo { path } => write!(f, "mknod({path:?}, S_IFIFO|0644, 0)"),
            Operation::Rename {
                source,
                target,
                flag,
            } => {
                let flag = match flag {
                    RenameFlag::None => "0",
                    RenameFlag::NoReplace => "RENAME_NOREPLACE",
                    RenameFlag::Exchange => "RENAME_EXCHANGE",
                    RenameFlag::Whiteout => "RENAME_WHITEOUT",
                };
                write!(
                    f,
                    "renameat2(AT_FDCWD, {source:?}, AT_FDCWD, {target:?}, {flag})"
                )
            }
            Operation::ChangeMode { path, permissions } => {
                write!(f, "chmod({path:?}, {permissions:04o})")
            }
            Operation::ChangeOwner {
                path,
                user_id,
                group_id,
            } => write!(f, "lchown({path:?}, {user_id}, {group_id})"),
            Operation::SetTimes { path, seconds } => write!(
                f,
                "utimensat(AT_FDCWD, {path:?}, {{{seconds}, {seconds}}}, AT_SYMLINK_NOFOLLOW)"
            ),
            Operation::SetXattr {
                path,
                name,
                value,
                how,
            } => {
                let how = match how {
                    XattrHow::Any => "0",
                    XattrHow::CreateOnly => "XATTR_CREATE",
                    XattrHow::ReplaceOnly => "XATTR_REPLACE",
                };
                write!(
                    f,
                    "lsetxattr({path:?}, {name:?}, {:?}, {}, {how})",
                    String::from_utf8_lossy(value),
                    value.len()
                )
            }
            Operation::RemoveXattr { path, name } => {
                write!(f, "lremovexattr({path:?}, {name:?})")
            }
            Operation::Truncate { path, size_bytes } => {
                write!(f, "truncate({path:?}, {size_bytes})")
            }
            Operation::Write { path, offset, data } => write!(
                f,
                "pwrite(open({path:?}, O_WRONLY|O_NONBLOCK), {:?}, {}, {offset})",
                String::from_utf8_lossy(data),
                data.len()
            ),
        }
    }
}

/// A place where the namespace can be exercised: a directory on a mount or a local file
/// system ([`posix::PosixTarget`]), or a directory of a cluster through the client library
/// ([`library::LibraryTarget`]). Paths are relative to the target's root directory (`""` is
/// the root itself). Every call returns the errno of its failure, as the system call would.
pub trait NamesTarget {
    /// Where the target is (for messages).
    fn describe(&self) -> String;
    /// Who owns what this target creates, and its umask.
    fn creator(&self) -> Creator;
    /// Whether the target can run operations of `kind`; the driver asks it for none it
    /// cannot. Every kind by default.
    fn supports(&self, kind: OperationKind) -> bool {
        let _ = kind;
        true
    }

    fn create(&mut self, path: &str) -> Result<(), Errno>;
    fn make_directory(&mut self, path: &str) -> Result<(), Errno>;
    fn remove_directory(&mut self, path: &str) -> Result<(), Errno>;
    fn unlink(&mut self, path: &str) -> Result<(), Errno>;
    fn link(&mut self, source: &str, target: &str) -> Result<(), Errno>;
    fn symlink(&mut self, path: &str, contents: &str) -> Result<(), Errno>;
    fn make_fifo(&mut self, path: &str) -> Result<(), Errno>;
    fn rename(&mut self, source: &str, target: &str, flag: RenameFlag) -> Result<(), Errno>;
    fn change_mode(&mut self, path: &str, permissions: u32) -> Result<(), Errno>;
    fn change_owner(&mut self, path: &str, user_id: u32, group_id: u32) -> Result<(), Errno>;
    fn set_times(&mut self, path: &str, seconds: i64) -> Result<(), Errno>;
    fn set_xattr(
        &mut self,
        path: &str,
        name: &str,
        value: &[u8],
        how: XattrHow,
    ) -> Result<(), Errno>;
    fn remove_xattr(&mut self, path: &str, name: &str) -> Result<(), Errno>;
    fn truncate(&mut self, path: &str, size_bytes: u64) -> Result<(), Errno>;
    fn write(&mut self, path: &str, offset: u64, data: &[u8]) -> Result<(), Errno>;

    /// The entries of a directory, without `.` and `..`, in any order.
    fn read_directory(&mut self, path: &str) -> Result<Vec<ListedEntry>, Errno>;
    /// `lstat`.
    fn status(&mut self, path: &str) -> Result<NodeStatus, Errno>;
    /// Open a regular file for reading and read all of it.
    fn read_file(&mut self, path: &str) -> Result<Vec<u8>, Errno>;
    /// `readlink`.
    fn read_link(&mut self, path: &str) -> Result<String, Errno>;
    /// The `user.*` extended attributes of a name (not following a symlink), with values,
    /// in any order.
    fn list_xattrs(&mut self, path: &str) -> Result<Vec<(String, Vec<u8>)>, Errno>;
}

/// Run `operation` on `target`.
pub fn perform(target: &mut dyn NamesTarget, operation: &Operation) -> Result<(), Errno> {
    match operation {
        Operation::Create { path } => target.create(path),
        Operation::MakeDirectory { path } => target.make_directory(path),
        Operation::RemoveDirectory { path } => target.remove_directory(path),
        Operation::Unlink { path } => target.unlink(path),
        Operation::Link { source, target: to } => target.link(source, to),
        Operation::Symlink { path, contents } => target.symlink(path, contents),
        Operation::MakeFifo { path } => target.make_fifo(path),
        Operation::Rename {
            source,
            target: to,
            flag,
        } => target.rename(source, to, *flag),
        Operation::ChangeMode { path, permissions } => target.change_mode(path, *permissions),
        Operation::ChangeOwner {
            path,
            user_id,
            group_id,
        } => target.change_owner(path, *user_id, *group_id),
        Operation::SetTimes { path, seconds } => target.set_times(path, *seconds),
        Operation::SetXattr {
            path,
            name,
            value,
            how,
        } => target.set_xattr(path, name, value, *how),
        Operation::RemoveXattr { path, name } => target.remove_xattr(path, name),
        Operation::Truncate { path, size_bytes } => target.truncate(path, *size_bytes),
        Operation::Write { path, offset, data } => target.write(path, *offset, data),
    }
}

/// The name of an errno for messages (`ENOENT`), or its number.
pub fn errno_name(errno: Errno) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::EMLINK => "EMLINK",
        libc::ENOSYS => "ENOSYS",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ELOOP => "ELOOP",
        libc::ENODATA => "ENODATA",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ESTALE => "ESTALE",
        libc::ETIMEDOUT => "ETIMEDOUT",
        _ => return format!("errno {errno}"),
    };
    name.to_string()
}

/// A result for messages: `ok` or the errno's name.
pub fn result_text(result: Result<(), Errno>) -> String {
    match result {
        Ok(()) => "ok".to_string(),
        Err(errno) => errno_name(errno),
    }
}
