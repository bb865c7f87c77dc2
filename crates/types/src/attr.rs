//! Inode attributes as stored by the metadata server and returned to clients.

use serde::{Deserialize, Serialize};

use crate::{InodeId, Layout};

/// The kind of an inode, with the same meaning as the `S_IFMT` bits of `st_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileKind {
    /// The `S_IFMT` bits for this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::Regular => 0o100000,
            FileKind::Directory => 0o040000,
            FileKind::Symlink => 0o120000,
            FileKind::Fifo => 0o010000,
            FileKind::Socket => 0o140000,
            FileKind::CharDevice => 0o020000,
            FileKind::BlockDevice => 0o060000,
        }
    }

    /// The kind named by the `S_IFMT` bits of a mode, if any.
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        match mode & 0o170000 {
            0o100000 => Some(FileKind::Regular),
            0o040000 => Some(FileKind::Directory),
            0o120000 => Some(FileKind::Symlink),
            0o010000 => Some(FileKind::Fifo),
            0o140000 => Some(FileKind::Socket),
            0o020000 => Some(FileKind::CharDevice),
            0o060000 => Some(FileKind::BlockDevice),
            _ => None,
        }
    }
}

/// A point in time as seconds and nanoseconds since the Unix epoch.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct TimeSpec {
    pub seconds: i64,
    pub nanoseconds: u32,
}

impl TimeSpec {
    pub fn new(seconds: i64, nanoseconds: u32) -> TimeSpec {
        TimeSpec {
            seconds,
            nanoseconds,
        }
    }
}

/// Attributes of one inode.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub inode: InodeId,
    pub kind: FileKind,
    /// Permission bits only (`0o7777`); the kind is in `kind`.
    pub permissions: u32,
    pub link_count: u32,
    pub user_id: u32,
    pub group_id: u32,
    pub size_bytes: u64,
    pub access_time: TimeSpec,
    pub modify_time: TimeSpec,
    pub change_time: TimeSpec,
    pub birth_time: TimeSpec,
    /// Device number for character and block devices, 0 otherwise.
    pub device: u64,
    /// Data layout of a regular file; for a directory, the layout its new files inherit
    /// (None: the cluster default). None for other kinds.
    pub layout: Option<Layout>,
    /// Bumped on every change of this inode; lets clients tell a cached copy is stale.
    pub generation: u64,
    /// Bytes the I/O servers hold for this file: the sum of its objects' allocated blocks
    /// as last reported by their servers (holes and never-written ranges count nothing).
    /// What `st_blocks` shows, kept by the meta server from writers' commits and cuts.
    pub allocated_bytes: u64,
}

impl Attr {
    /// The attributes of a new, empty inode: every time `now`, two links for a directory
    /// and one otherwise, no layout yet, generation 1.
    pub fn new_inode(
        inode: InodeId,
        kind: FileKind,
        permissions: u32,
        user_id: u32,
        group_id: u32,
        now: TimeSpec,
    ) -> Attr {
        Attr {
            inode,
            kind,
            permissions,
            link_count: if kind == FileKind::Directory { 2 } else { 1 },
            user_id,
            group_id,
            size_bytes: 0,
            access_time: now,
            modify_time: now,
            change_time: now,
            birth_time: now,
            device: 0,
            layout: None,
            generation: 1,
            allocated_bytes: 0,
        }
    }

    /// The full `st_mode`: kind bits and permission bits.
    pub fn mode(&self) -> u32 {
        self.kind.mode_bits() | (self.permissions & 0o7777)
    }
}

/// A set-attributes request: each field that is `Some` is changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttr {
    pub permissions: Option<u32>,
    pub user_id: Option<u32>,
    pub group_id: Option<u32>,
    pub size_bytes: Option<u64>,
    pub access_time: Option<TimeSpec>,
    pub modify_time: Option<TimeSpec>,
    /// Explicit change time (used by replays); normally the server sets ctime itself.
    pub change_time: Option<TimeSpec>,
}
