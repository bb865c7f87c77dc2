//! The namespace exerciser's target through the client library, without the kernel: the
//! same tree as a mount, reached by the inode API of one [`Client`].
//!
//! On a mount the kernel's VFS makes some checks before the file system hears of a call: it
//! looks both names of a rename up (`ENOENT`, `EEXIST` for `RENAME_NOREPLACE`), refuses to
//! move a directory into its own subtree (`EINVAL`), answers a rename onto a hard link of the
//! same inode with success, and checks the kinds (`EISDIR`, `ENOTDIR`, `EPERM` for a link of a
//! directory or a `user.*` attribute of a symlink). This target makes the same checks, in the
//! same order, from lookups, so its errnos compare with the model's; everything else (the
//! change itself, `EEXIST` of a create, `ENOTEMPTY`, `ENODATA`) is the meta server's answer.
//!
//! Not supported: `RENAME_WHITEOUT` (the protocol's `RenameMode` has replace, no-replace and
//! exchange only); the driver never asks it of this target.

use std::io;

use bytes::Bytes;
use freeflow_client::{
    Attr, Client, ClientError, FileKind, InodeId, OpenAccess, RenameMode, SetAttr, TimeSpec,
    XattrSetMode,
};
use tokio::runtime::Handle;

use super::{
    Creator, Errno, ListedEntry, NamesTarget, NodeKind, NodeStatus, OperationKind, RenameFlag,
    XattrHow,
};

/// Bytes asked of one read while reading a whole file.
const READ_PIECE_BYTES: u64 = 1 << 20;

/// A directory of a cluster through one client.
pub struct LibraryTarget {
    client: Client,
    /// The tree's root inside the namespace (`/exercise`).
    root: String,
    runtime: Handle,
}

fn errno(error: ClientError) -> Errno {
    error.code().errno()
}

fn node_kind(kind: FileKind) -> NodeKind {
    match kind {
        FileKind::Regular => NodeKind::Regular,
        FileKind::Directory => NodeKind::Directory,
        FileKind::Symlink => NodeKind::Symlink,
        FileKind::Fifo => NodeKind::Fifo,
        FileKind::CharDevice => NodeKind::CharDevice,
        FileKind::Socket | FileKind::BlockDevice => NodeKind::Other,
    }
}

/// The directory part of a relative path (`""` for a name in the root) and the last name.
fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

/// For a rename: the child of one parent that holds the other parent, when one parent holds
/// the other (what the kernel's `lock_rename` returns), by path: the parents were resolved
/// through directories only (every symlink the exerciser makes dangles).
fn rename_trap(target_directory: &str, source_directory: &str) -> Option<String> {
    if target_directory == source_directory {
        return None;
    }
    let child_of = |ancestor: &str, descendant: &str| -> Option<String> {
        let rest = if ancestor.is_empty() {
            descendant
        } else {
            descendant.strip_prefix(ancestor)?.strip_prefix('/')?
        };
        let first = rest.split('/').next()?;
        Some(if ancestor.is_empty() {
            first.to_string()
        } else {
            format!("{ancestor}/{first}")
        })
    };
    child_of(source_directory, target_directory)
        .or_else(|| child_of(target_directory, source_directory))
}

impl LibraryTarget {
    /// The directory `root` (which must exist) of the cluster `client` reaches. Call from
    /// outside the runtime: the target blocks on it.
    pub fn new(client: Client, root: &str, runtime: Handle) -> io::Result<LibraryTarget> {
        let with_reason = |error: ClientError| {
            let code = error.code().errno();
            io::Error::new(
                io::Error::from_raw_os_error(code).kind(),
                format!("{error} (errno {code})"),
            )
        };
        let root = freeflow_client::normalize(root).map_err(with_reason)?;
        let target = LibraryTarget {
            client,
            root,
            runtime,
        };
        let attr = target
            .runtime
            .block_on(target.client.lstat(&target.root))
            .map_err(with_reason)?;
        if attr.kind != FileKind::Directory {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ff:{} is not a directory", target.root),
            ));
        }
        Ok(target)
    }

    fn full(&self, path: &str) -> String {
        if path.is_empty() {
            self.root.clone()
        } else {
            freeflow_client::join(&self.root, path)
        }
    }

    fn wait<T>(
        &self,
        future: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, Errno> {
        self.runtime.block_on(future).map_err(errno)
    }

    /// `lstat`.
    fn lstat(&self, path: &str) -> Result<Attr, Errno> {
        self.wait(self.client.lstat(&self.full(path)))
    }

    /// What `path` names, following a final symlink.
    fn resolve(&self, path: &str) -> Result<Attr, Errno> {
        self.wait(self.client.resolve(&self.full(path)))
    }

    /// The directory holding the last name of `path` (`ENOTDIR` if it is not one).
    fn parent<'a>(&self, path: &'a str) -> Result<(InodeId, &'a str), Errno> {
        let (directory, name) = split(path);
        let attr = self.resolve(directory)?;
        if attr.kind != FileKind::Directory {
            return Err(libc::ENOTDIR);
        }
        Ok((attr.inode, name))
    }

    /// The entry `name` of `parent`, if there is one.
    fn entry(&self, parent: InodeId, name: &str) -> Result<Option<Attr>, Errno> {
        match self.runtime.block_on(self.client.lookup(parent, name)) {
            Ok(attr) => Ok(Some(attr)),
            Err(error) if error.code().errno() == libc::ENOENT => Ok(None),
            Err(error) => Err(errno(error)),
        }
    }

    fn set(&self, inode: InodeId, changes: SetAttr) -> Result<(), Errno> {
        self.wait(self.client.setattr(inode, changes)).map(|_| ())
    }

    /// `lstat` of a name whose `user.*` attributes are asked: only files and directories
    /// have them (the VFS answers `EPERM` for others).
    fn xattr_capable(&self, path: &str) -> Result<Attr, Errno> {
        let attr = self.lstat(path)?;
        match attr.kind {
            FileKind::Regular | FileKind::Directory => Ok(attr),
            _ => Err(libc::EPERM),
        }
    }
}

impl NamesTarget for LibraryTarget {
    fn describe(&self) -> String {
        format!("ff:{}", self.root)
    }

    fn creator(&self) -> Creator {
        let caller = self.client.caller();
        Creator {
            user_id: caller.user_id,
            group_id: caller.group_id,
            creation_mask: 0,
        }
    }

    fn supports(&self, kind: OperationKind) -> bool {
        kind != OperationKind::RenameWhiteout
    }

    fn create(&mut self, path: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent(path)?;
        self.wait(
            self.client
                .create(parent, name, FileKind::Regular, 0o644, 0, true),
        )
        .map(|_| ())
    }

    fn make_directory(&mut self, path: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent(path)?;
        self.wait(self.client.mkdir(parent, name, 0o755))
            .map(|_| ())
    }

    fn remove_directory(&mut self, path: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent(path)?;
        let attr = self.entry(parent, name)?.ok_or(libc::ENOENT)?;
        if attr.kind != FileKind::Directory {
            return Err(libc::ENOTDIR);
        }
        self.wait(self.client.rmdir(parent, name))
    }

    fn unlink(&mut self, path: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent(path)?;
        let attr = self.entry(parent, name)?.ok_or(libc::ENOENT)?;
        if attr.kind == FileKind::Directory {
            return Err(libc::EISDIR);
        }
        self.wait(self.client.unlink(parent, name))
    }

    fn link(&mut self, source: &str, target: &str) -> Result<(), Errno> {
        let existing = self.lstat(source)?;
        let (parent, name) = self.parent(target)?;
        if self.entry(parent, name)?.is_some() {
            return Err(libc::EEXIST);
        }
        if existing.kind == FileKind::Directory {
            return Err(libc::EPERM);
        }
        self.wait(self.client.link(existing.inode, parent, name))
            .map(|_| ())
    }

    fn symlink(&mut self, path: &str, contents: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent(path)?;
        self.wait(self.client.symlink(parent, name, contents))
            .map(|_| ())
    }

    fn make_fifo(&mut self, path: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent(path)?;
        self.wait(
            self.client
                .create(parent, name, FileKind::Fifo, 0o644, 0, true),
        )
        .map(|_| ())
    }

    fn rename(&mut self, source: &str, target: &str, flag: RenameFlag) -> Result<(), Errno> {
        let mode = match flag {
            RenameFlag::None => RenameMode::Replace,
            RenameFlag::NoReplace => RenameMode::NoReplace,
            RenameFlag::Exchange => RenameMode::Exchange,
            RenameFlag::Whiteout => return Err(libc::EINVAL),
        };
        let (source_parent, source_name) = self.parent(source)?;
        let (target_parent, target_name) = self.parent(target)?;
        let moved = self
            .entry(source_parent, source_name)?
            .ok_or(libc::ENOENT)?;
        let replaced = self.entry(target_parent, target_name)?;
        if flag == RenameFlag::NoReplace && replaced.is_some() {
            return Err(libc::EEXIST);
        }
        if flag == RenameFlag::Exchange && replaced.is_none() {
            return Err(libc::ENOENT);
        }
        let trap = rename_trap(split(target).0, split(source).0);
        if trap.as_deref() == Some(source) {
            return Err(libc::EINVAL);
        }
        if replaced.is_some() && trap.as_deref() == Some(target) {
            return Err(if flag == RenameFlag::Exchange {
                libc::EINVAL
            } else {
                libc::ENOTEMPTY
            });
        }
        if let Some(replaced) = &replaced {
            if replaced.inode == moved.inode {
                return Ok(());
            }
            if flag != RenameFlag::Exchange {
                let moved_is_directory = moved.kind == FileKind::Directory;
                let replaced_is_directory = replaced.kind == FileKind::Directory;
                if moved_is_directory && !replaced_is_directory {
                    return Err(libc::ENOTDIR);
                }
                if !moved_is_directory && replaced_is_directory {
                    return Err(libc::EISDIR);
                }
            }
        }
        self.wait(
            self.client
                .rename(source_parent, source_name, target_parent, target_name, mode),
        )
    }

    fn change_mode(&mut self, path: &str, permissions: u32) -> Result<(), Errno> {
        let attr = self.resolve(path)?;
        self.set(
            attr.inode,
            SetAttr {
                permissions: Some(permissions),
                ..SetAttr::default()
            },
        )
    }

    fn change_owner(&mut self, path: &str, user_id: u32, group_id: u32) -> Result<(), Errno> {
        let attr = self.lstat(path)?;
        self.set(
            attr.inode,
            SetAttr {
                user_id: Some(user_id),
                group_id: Some(group_id),
                ..SetAttr::default()
            },
        )
    }

    fn set_times(&mut self, path: &str, seconds: i64) -> Result<(), Errno> {
        let attr = self.lstat(path)?;
        let time = TimeSpec::new(seconds, 0);
        self.set(
            attr.inode,
            SetAttr {
                access_time: Some(time),
                modify_time: Some(time),
                ..SetAttr::default()
            },
        )
    }

    fn set_xattr(
        &mut self,
        path: &str,
        name: &str,
        value: &[u8],
        how: XattrHow,
    ) -> Result<(), Errno> {
        let attr = self.xattr_capable(path)?;
        let mode = match how {
            XattrHow::Any => XattrSetMode::Any,
            XattrHow::CreateOnly => XattrSetMode::CreateOnly,
            XattrHow::ReplaceOnly => XattrSetMode::ReplaceOnly,
        };
        self.wait(self.client.set_xattr(attr.inode, name, value, mode))
    }

    fn remove_xattr(&mut self, path: &str, name: &str) -> Result<(), Errno> {
        let attr = self.xattr_capable(path)?;
        self.wait(self.client.remove_xattr(attr.inode, name))
    }

    fn truncate(&mut self, path: &str, size_bytes: u64) -> Result<(), Errno> {
        let attr = self.resolve(path)?;
        match attr.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(libc::EISDIR),
            _ => return Err(libc::EINVAL),
        }
        self.set(
            attr.inode,
            SetAttr {
                size_bytes: Some(size_bytes),
                ..SetAttr::default()
            },
        )
    }

    fn write(&mut self, path: &str, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let attr = self.resolve(path)?;
        match attr.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(libc::EISDIR),
            // A FIFO without a reader under O_NONBLOCK, a device without a driver.
            _ => return Err(libc::ENXIO),
        }
        let access = OpenAccess {
            read: false,
            write: true,
        };
        let handle = self.wait(self.client.open(attr.inode, access))?;
        let written = self.wait(handle.write_at(offset, Bytes::copy_from_slice(data)));
        let closed = self.wait(handle.close());
        written?;
        closed
    }

    fn read_directory(&mut self, path: &str) -> Result<Vec<ListedEntry>, Errno> {
        let entries = self.wait(self.client.read_dir_all(&self.full(path)))?;
        Ok(entries
            .into_iter()
            .map(|entry| ListedEntry {
                name: entry.name,
                inode_number: entry.inode,
                kind: Some(node_kind(entry.kind)),
            })
            .collect())
    }

    fn status(&mut self, path: &str) -> Result<NodeStatus, Errno> {
        let attr = self.lstat(path)?;
        Ok(NodeStatus {
            inode_number: attr.inode,
            kind: node_kind(attr.kind),
            permissions: attr.permissions & 0o7777,
            size_bytes: attr.size_bytes,
            link_count: attr.link_count as u64,
            user_id: attr.user_id,
            group_id: attr.group_id,
        })
    }

    fn read_file(&mut self, path: &str) -> Result<Vec<u8>, Errno> {
        let attr = self.resolve(path)?;
        let access = OpenAccess {
            read: true,
            write: false,
        };
        let handle = self.wait(self.client.open(attr.inode, access))?;
        let mut bytes = Vec::new();
        let read = loop {
            match self.wait(handle.read_at(bytes.len() as u64, READ_PIECE_BYTES)) {
                Ok(piece) if piece.is_empty() => break Ok(()),
                Ok(piece) => bytes.extend_from_slice(&piece),
                Err(errno) => break Err(errno),
            }
        };
        let closed = self.wait(handle.close());
        read?;
        closed?;
        Ok(bytes)
    }

    fn read_link(&mut self, path: &str) -> Result<String, Errno> {
        let attr = self.lstat(path)?;
        if attr.kind != FileKind::Symlink {
            return Err(libc::EINVAL);
        }
        self.wait(self.client.readlink(attr.inode))
    }

    fn list_xattrs(&mut self, path: &str) -> Result<Vec<(String, Vec<u8>)>, Errno> {
        let attr = self.lstat(path)?;
        let names = self.wait(self.client.list_xattr(attr.inode))?;
        let mut attributes = Vec::new();
        for name in names.into_iter().filter(|name| name.starts_with("user.")) {
            let value = self.wait(self.client.get_xattr(attr.inode, &name))?;
            attributes.push((name, value));
        }
        Ok(attributes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rename_trap_is_the_child_of_the_outer_parent_toward_the_inner() {
        assert_eq!(rename_trap("d0/d1", "d0/d1"), None);
        assert_eq!(rename_trap("d0/d1/d2", ""), Some("d0".into()));
        assert_eq!(rename_trap("d0/d1/d2", "d0"), Some("d0/d1".into()));
        assert_eq!(rename_trap("", "d0/d1"), Some("d0".into()));
        assert_eq!(rename_trap("d0", "d1"), None);
        assert_eq!(rename_trap("d0", "d01"), None);
    }
}
