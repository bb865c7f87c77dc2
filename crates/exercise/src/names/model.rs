//! The namespace as Linux keeps it, in memory: inodes (regular files with their bytes,
//! directories with their names, symlinks with their text, FIFOs, whiteouts), link counts,
//! permissions, owners and `user.*` extended attributes.
//!
//! [`Model::expect`] computes what a call returns, errno included, checking in the order the
//! kernel does (fs/namei.c: the parents of both paths, the source, the target, the ancestor
//! checks of `lock_rename`, then `vfs_rename`'s same-inode no-op and type checks, then the
//! file system's `ENOTEMPTY`); [`Model::apply`] makes the change of a call that succeeded.
//! The model is the reference the local disk is held to (tests run it there as root); where
//! it and the local disk disagree, the model is wrong.
//!
//! Every symlink is taken to dangle: the exerciser only makes symlinks whose text names
//! `nowhere/...`, and no `nowhere` is ever made, so following one (in the middle of a path,
//! or at the end for `chmod`, `truncate` and an open) gives `ENOENT`.

use std::collections::BTreeMap;

use super::{Creator, Errno, NodeKind, Operation, RenameFlag, XattrHow};

/// An inode of the model (not a target's inode number: [`super::driver`] maps them).
pub type InodeLabel = u64;

/// The root directory of the exercised tree.
pub const ROOT: InodeLabel = 1;

/// What an inode holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    Regular {
        bytes: Vec<u8>,
    },
    Directory {
        entries: BTreeMap<String, InodeLabel>,
        parent: InodeLabel,
    },
    Symlink {
        contents: String,
    },
    Fifo,
    /// What `RENAME_WHITEOUT` leaves at the source name: a character device 0/0.
    Whiteout,
}

/// One inode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub content: Content,
    /// Permission bits only.
    pub permissions: u32,
    pub user_id: u32,
    pub group_id: u32,
    /// Names of a non-directory (its link count); directories count theirs from entries.
    pub names: u32,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

impl Node {
    pub fn new(content: Content, permissions: u32, user_id: u32, group_id: u32) -> Node {
        Node {
            content,
            permissions,
            user_id,
            group_id,
            names: 1,
            xattrs: BTreeMap::new(),
        }
    }

    pub fn kind(&self) -> NodeKind {
        match self.content {
            Content::Regular { .. } => NodeKind::Regular,
            Content::Directory { .. } => NodeKind::Directory,
            Content::Symlink { .. } => NodeKind::Symlink,
            Content::Fifo => NodeKind::Fifo,
            Content::Whiteout => NodeKind::CharDevice,
        }
    }

    fn entries(&self) -> Option<&BTreeMap<String, InodeLabel>> {
        match &self.content {
            Content::Directory { entries, .. } => Some(entries),
            _ => None,
        }
    }
}

/// What a call must return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    Success,
    Failure(Errno),
}

impl Expected {
    fn from(result: Result<(), Errno>) -> Expected {
        match result {
            Ok(()) => Expected::Success,
            Err(errno) => Expected::Failure(errno),
        }
    }
}

/// The tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model {
    nodes: BTreeMap<InodeLabel, Node>,
    next_label: InodeLabel,
}

impl Default for Model {
    fn default() -> Model {
        Model::new()
    }
}

/// The components of a relative path (empty ones, as in `a//b`, are skipped).
fn components(path: &str) -> Vec<&str> {
    path.split('/').filter(|part| !part.is_empty()).collect()
}

impl Model {
    /// An empty root directory (its own attributes are not modelled).
    pub fn new() -> Model {
        let root = Node::new(
            Content::Directory {
                entries: BTreeMap::new(),
                parent: ROOT,
            },
            0o755,
            0,
            0,
        );
        Model {
            nodes: BTreeMap::from([(ROOT, root)]),
            next_label: ROOT + 1,
        }
    }

    pub fn node(&self, label: InodeLabel) -> Option<&Node> {
        self.nodes.get(&label)
    }

    pub fn is_live(&self, label: InodeLabel) -> bool {
        self.nodes.contains_key(&label)
    }

    /// The link count `lstat` must show: names of a non-directory, `2 + subdirectories` of a
    /// directory.
    pub fn link_count(&self, label: InodeLabel) -> u64 {
        let Some(node) = self.nodes.get(&label) else {
            return 0;
        };
        match node.entries() {
            Some(entries) => {
                2 + entries
                    .values()
                    .filter(|child| {
                        self.nodes
                            .get(child)
                            .is_some_and(|node| node.kind() == NodeKind::Directory)
                    })
                    .count() as u64
            }
            None => node.names as u64,
        }
    }

    /// The size `lstat` must show (`None` for a directory, whose size file systems differ
    /// on).
    pub fn size_bytes(&self, label: InodeLabel) -> Option<u64> {
        match &self.nodes.get(&label)?.content {
            Content::Regular { bytes } => Some(bytes.len() as u64),
            Content::Symlink { contents } => Some(contents.len() as u64),
            Content::Directory { .. } => None,
            Content::Fifo | Content::Whiteout => Some(0),
        }
    }

    /// Every name of the tree with its inode and depth (1 for the root's entries), parents
    /// before children, in name order.
    pub fn names(&self) -> Vec<(String, InodeLabel, usize)> {
        let mut found = Vec::new();
        let mut pending = vec![(String::new(), ROOT, 0usize)];
        while let Some((path, label, depth)) = pending.pop() {
            let Some(entries) = self.nodes.get(&label).and_then(Node::entries) else {
                continue;
            };
            let mut children = Vec::new();
            for (name, child) in entries {
                let child_path = if path.is_empty() {
                    name.clone()
                } else {
                    format!("{path}/{name}")
                };
                found.push((child_path.clone(), *child, depth + 1));
                children.push((child_path, *child, depth + 1));
            }
            pending.extend(children.into_iter().rev());
        }
        found
    }

    fn entry(&self, directory: InodeLabel, name: &str) -> Option<InodeLabel> {
        self.nodes
            .get(&directory)
            .and_then(Node::entries)
            .and_then(|entries| entries.get(name).copied())
    }

    fn kind_of(&self, label: InodeLabel) -> Option<NodeKind> {
        self.nodes.get(&label).map(Node::kind)
    }

    fn is_directory(&self, label: InodeLabel) -> bool {
        self.kind_of(label) == Some(NodeKind::Directory)
    }

    /// The directory holding the last component of `path`, and that component: `ENOENT` for
    /// a missing or dangling (symlink) component on the way, `ENOTDIR` for a component that
    /// is neither a directory nor a symlink.
    pub fn resolve_parent<'a>(&self, path: &'a str) -> Result<(InodeLabel, &'a str), Errno> {
        let parts = components(path);
        let Some((last, leading)) = parts.split_last() else {
            // The root itself is never operated on.
            return Err(libc::EBUSY);
        };
        let mut directory = ROOT;
        for part in leading {
            let child = self.entry(directory, part).ok_or(libc::ENOENT)?;
            match self.kind_of(child) {
                Some(NodeKind::Directory) => directory = child,
                Some(NodeKind::Symlink) => return Err(libc::ENOENT),
                _ => return Err(libc::ENOTDIR),
            }
        }
        Ok((directory, last))
    }

    /// What `path` names, not following a final symlink: `None` if nothing.
    pub fn lookup(&self, path: &str) -> Result<Option<InodeLabel>, Errno> {
        let (directory, name) = self.resolve_parent(path)?;
        Ok(self.entry(directory, name))
    }

    /// Whether `operation` renames a name onto another name of the same file (or onto
    /// itself): Linux then succeeds without asking the file system, whatever the flag.
    pub fn renames_onto_itself(&self, operation: &Operation) -> bool {
        let Operation::Rename { source, target, .. } = operation else {
            return false;
        };
        match (self.lookup(source), self.lookup(target)) {
            (Ok(Some(source)), Ok(Some(target))) => source == target,
            _ => false,
        }
    }

    /// What `path` names, following a final symlink (which dangles).
    fn follow(&self, path: &str) -> Result<InodeLabel, Errno> {
        let label = self.lookup(path)?.ok_or(libc::ENOENT)?;
        if self.kind_of(label) == Some(NodeKind::Symlink) {
            return Err(libc::ENOENT);
        }
        Ok(label)
    }

    fn existing(&self, path: &str) -> Result<InodeLabel, Errno> {
        self.lookup(path)?.ok_or(libc::ENOENT)
    }

    /// For `rename`: the child of one directory that `lock_rename(target_directory,
    /// source_directory)` returns when one is an ancestor of the other (`trap`).
    fn rename_trap(
        &self,
        target_directory: InodeLabel,
        source_directory: InodeLabel,
    ) -> Option<InodeLabel> {
        if target_directory == source_directory {
            return None;
        }
        let child_of_ancestor = |ancestor: InodeLabel, from: InodeLabel| {
            let mut at = from;
            while at != ROOT {
                let parent = match &self.nodes.get(&at)?.content {
                    Content::Directory { parent, .. } => *parent,
                    _ => return None,
                };
                if parent == ancestor {
                    return Some(at);
                }
                at = parent;
            }
            None
        };
        child_of_ancestor(source_directory, target_directory)
            .or_else(|| child_of_ancestor(target_directory, source_directory))
    }

    fn is_empty_directory(&self, label: InodeLabel) -> bool {
        self.nodes
            .get(&label)
            .and_then(Node::entries)
            .is_some_and(BTreeMap::is_empty)
    }

    fn expect_rename(&self, source: &str, target: &str, flag: RenameFlag) -> Result<(), Errno> {
        let (source_directory, source_name) = self.resolve_parent(source)?;
        let (target_directory, target_name) = self.resolve_parent(target)?;
        let moved = self
            .entry(source_directory, source_name)
            .ok_or(libc::ENOENT)?;
        let replaced = self.entry(target_directory, target_name);
        if flag == RenameFlag::NoReplace && replaced.is_some() {
            return Err(libc::EEXIST);
        }
        if flag == RenameFlag::Exchange && replaced.is_none() {
            return Err(libc::ENOENT);
        }
        let trap = self.rename_trap(target_directory, source_directory);
        if trap.is_some() && trap == Some(moved) {
            return Err(libc::EINVAL);
        }
        if trap.is_some() && trap == replaced {
            return Err(if flag == RenameFlag::Exchange {
                libc::EINVAL
            } else {
                libc::ENOTEMPTY
            });
        }
        let Some(replaced) = replaced else {
            return Ok(());
        };
        if replaced == moved {
            // vfs_rename: the same inode under both names (or the same name) does nothing.
            return Ok(());
        }
        if flag == RenameFlag::Exchange {
            return Ok(());
        }
        match (self.is_directory(moved), self.is_directory(replaced)) {
            (true, false) => Err(libc::ENOTDIR),
            (false, true) => Err(libc::EISDIR),
            (true, true) if !self.is_empty_directory(replaced) => Err(libc::ENOTEMPTY),
            _ => Ok(()),
        }
    }

    fn expect_result(&self, operation: &Operation) -> Result<(), Errno> {
        let must_be_new = |path: &str| match self.lookup(path)? {
            Some(_) => Err(libc::EEXIST),
            None => Ok(()),
        };
        let xattr_capable = |label: InodeLabel| match self.kind_of(label) {
            Some(NodeKind::Regular | NodeKind::Directory) => Ok(()),
            // fs/xattr.c xattr_permission: user.* only on regular files and directories.
            _ => Err(libc::EPERM),
        };
        match operation {
            Operation::Create { path }
            | Operation::MakeDirectory { path }
            | Operation::Symlink { path, .. }
            | Operation::MakeFifo { path } => must_be_new(path),
            Operation::RemoveDirectory { path } => {
                let label = self.existing(path)?;
                if !self.is_directory(label) {
                    Err(libc::ENOTDIR)
                } else if !self.is_empty_directory(label) {
                    Err(libc::ENOTEMPTY)
                } else {
                    Ok(())
                }
            }
            Operation::Unlink { path } => {
                let label = self.existing(path)?;
                if self.is_directory(label) {
                    Err(libc::EISDIR)
                } else {
                    Ok(())
                }
            }
            Operation::Link { source, target } => {
                let label = self.existing(source)?;
                must_be_new(target)?;
                if self.is_directory(label) {
                    Err(libc::EPERM)
                } else {
                    Ok(())
                }
            }
            Operation::Rename {
                source,
                target,
                flag,
            } => self.expect_rename(source, target, *flag),
            Operation::ChangeMode { path, .. } => self.follow(path).map(|_| ()),
            Operation::ChangeOwner { path, .. } | Operation::SetTimes { path, .. } => {
                self.existing(path).map(|_| ())
            }
            Operation::SetXattr {
                path, name, how, ..
            } => {
                let label = self.existing(path)?;
                xattr_capable(label)?;
                let present = self.nodes[&label].xattrs.contains_key(name);
                match how {
                    XattrHow::CreateOnly if present => Err(libc::EEXIST),
                    XattrHow::ReplaceOnly if !present => Err(libc::ENODATA),
                    _ => Ok(()),
                }
            }
            Operation::RemoveXattr { path, name } => {
                let label = self.existing(path)?;
                xattr_capable(label)?;
                if self.nodes[&label].xattrs.contains_key(name) {
                    Ok(())
                } else {
                    Err(libc::ENODATA)
                }
            }
            Operation::Truncate { path, .. } => {
                let label = self.follow(path)?;
                match self.kind_of(label) {
                    Some(NodeKind::Regular) => Ok(()),
                    Some(NodeKind::Directory) => Err(libc::EISDIR),
                    _ => Err(libc::EINVAL),
                }
            }
            Operation::Write { path, .. } => {
                let label = self.follow(path)?;
                match self.kind_of(label) {
                    Some(NodeKind::Regular) => Ok(()),
                    Some(NodeKind::Directory) => Err(libc::EISDIR),
                    // A FIFO without a reader under O_NONBLOCK; a character device 0/0 has
                    // no driver (a `nodev` mount answers EACCES instead: `equivalent`).
                    _ => Err(libc::ENXIO),
                }
            }
        }
    }

    /// What `operation` must return on this tree.
    pub fn expect(&self, operation: &Operation) -> Expected {
        Expected::from(self.expect_result(operation))
    }

    /// Whether `found` is as good as the `expected` errno for `operation`: opening a
    /// character device for writing is `ENXIO` on most file systems but `EACCES` or `EPERM`
    /// where devices are off (`nodev`, the default of FUSE mounts).
    pub fn equivalent(operation: &Operation, expected: Errno, found: Errno) -> bool {
        expected == found
            || (matches!(operation, Operation::Write { .. })
                && expected == libc::ENXIO
                && matches!(found, libc::EACCES | libc::EPERM))
    }

    fn allocate(&mut self, node: Node) -> InodeLabel {
        let label = self.next_label;
        self.next_label += 1;
        self.nodes.insert(label, node);
        label
    }

    fn entries_mut(&mut self, directory: InodeLabel) -> &mut BTreeMap<String, InodeLabel> {
        match &mut self
            .nodes
            .get_mut(&directory)
            .expect("a directory of the model exists")
            .content
        {
            Content::Directory { entries, .. } => entries,
            _ => panic!("inode {directory} of the model is not a directory"),
        }
    }

    fn set_parent(&mut self, label: InodeLabel, new_parent: InodeLabel) {
        if let Some(Node {
            content: Content::Directory { parent, .. },
            ..
        }) = self.nodes.get_mut(&label)
        {
            *parent = new_parent;
        }
    }

    /// Insert a new inode under `name` of `directory` (also what rebuilding the model from
    /// a walk uses).
    pub fn insert_node(&mut self, directory: InodeLabel, name: &str, mut node: Node) -> InodeLabel {
        if let Content::Directory { parent, .. } = &mut node.content {
            *parent = directory;
        }
        node.names = 1;
        let label = self.allocate(node);
        self.entries_mut(directory).insert(name.to_string(), label);
        label
    }

    /// Another name for a non-directory.
    pub fn insert_link(&mut self, directory: InodeLabel, name: &str, label: InodeLabel) {
        if let Some(node) = self.nodes.get_mut(&label) {
            node.names += 1;
        }
        self.entries_mut(directory).insert(name.to_string(), label);
    }

    /// A name of `label` went away: the inode goes with its last name.
    fn drop_name(&mut self, label: InodeLabel) {
        let Some(node) = self.nodes.get_mut(&label) else {
            return;
        };
        if node.kind() == NodeKind::Directory || node.names <= 1 {
            self.nodes.remove(&label);
        } else {
            node.names -= 1;
        }
    }

    fn node_mut(&mut self, label: InodeLabel) -> &mut Node {
        self.nodes
            .get_mut(&label)
            .expect("an inode the model just found exists")
    }

    /// Make the change of `operation`, which [`Model::expect`] said succeeds, as done by a
    /// target whose creations are `creator`'s.
    pub fn apply(&mut self, operation: &Operation, creator: Creator) {
        debug_assert_eq!(self.expect(operation), Expected::Success, "{operation}");
        let new_node = |content: Content, permissions: u32| {
            Node::new(content, permissions, creator.user_id, creator.group_id)
        };
        let masked = |permissions: u32| permissions & !creator.creation_mask;
        match operation {
            Operation::Create { path } => {
                let (directory, name) = self.parent_of_valid(path);
                let node = new_node(Content::Regular { bytes: Vec::new() }, masked(0o644));
                self.insert_node(directory, name, node);
            }
            Operation::MakeDirectory { path } => {
                let (directory, name) = self.parent_of_valid(path);
                let content = Content::Directory {
                    entries: BTreeMap::new(),
                    parent: directory,
                };
                self.insert_node(directory, name, new_node(content, masked(0o755)));
            }
            Operation::Symlink { path, contents } => {
                let (directory, name) = self.parent_of_valid(path);
                let content = Content::Symlink {
                    contents: contents.clone(),
                };
                self.insert_node(directory, name, new_node(content, 0o777));
            }
            Operation::MakeFifo { path } => {
                let (directory, name) = self.parent_of_valid(path);
                self.insert_node(directory, name, new_node(Content::Fifo, masked(0o644)));
            }
            Operation::RemoveDirectory { path } | Operation::Unlink { path } => {
                let (directory, name) = self.parent_of_valid(path);
                if let Some(label) = self.entries_mut(directory).remove(name) {
                    self.drop_name(label);
                }
            }
            Operation::Link { source, target } => {
                let label = self.lookup_valid(source);
                let (directory, name) = self.parent_of_valid(target);
                self.insert_link(directory, name, label);
            }
            Operation::Rename {
                source,
                target,
                flag,
            } => self.apply_rename(source, target, *flag, new_node(Content::Whiteout, 0)),
            Operation::ChangeMode { path, permissions } => {
                let label = self.lookup_valid(path);
                self.node_mut(label).permissions = permissions & 0o7777;
            }
            Operation::ChangeOwner {
                path,
                user_id,
                group_id,
            } => {
                let label = self.lookup_valid(path);
                let node = self.node_mut(label);
                node.user_id = *user_id;
                node.group_id = *group_id;
            }
            Operation::SetTimes { .. } => {}
            Operation::SetXattr {
                path, name, value, ..
            } => {
                let label = self.lookup_valid(path);
                self.node_mut(label)
                    .xattrs
                    .insert(name.clone(), value.clone());
            }
            Operation::RemoveXattr { path, name } => {
                let label = self.lookup_valid(path);
                self.node_mut(label).xattrs.remove(name);
            }
            Operation::Truncate { path, size_bytes } => {
                let label = self.lookup_valid(path);
                if let Content::Regular { bytes } = &mut self.node_mut(label).content {
                    bytes.resize(*size_bytes as usize, 0);
                }
            }
            Operation::Write { path, offset, data } => {
                let label = self.lookup_valid(path);
                if let Content::Regular { bytes } = &mut self.node_mut(label).content {
                    let start = *offset as usize;
                    let end = start + data.len();
                    if bytes.len() < end {
                        bytes.resize(end, 0);
                    }
                    bytes[start..end].copy_from_slice(data);
                }
            }
        }
    }

    fn parent_of_valid<'a>(&self, path: &'a str) -> (InodeLabel, &'a str) {
        self.resolve_parent(path)
            .expect("the parent of a path an operation succeeded on exists")
    }

    fn lookup_valid(&self, path: &str) -> InodeLabel {
        self.lookup(path)
            .ok()
            .flatten()
            .expect("the path an operation succeeded on exists")
    }

    fn apply_rename(&mut self, source: &str, target: &str, flag: RenameFlag, whiteout: Node) {
        let (source_directory, source_name) = self.parent_of_valid(source);
        let (target_directory, target_name) = self.parent_of_valid(target);
        let moved = self.lookup_valid(source);
        let replaced = self.entry(target_directory, target_name);
        if replaced == Some(moved) {
            return;
        }
        if flag == RenameFlag::Exchange {
            let replaced = replaced.expect("an exchange that succeeded had a target");
            self.entries_mut(source_directory)
                .insert(source_name.to_string(), replaced);
            self.entries_mut(target_directory)
                .insert(target_name.to_string(), moved);
            self.set_parent(replaced, source_directory);
            self.set_parent(moved, target_directory);
            return;
        }
        self.entries_mut(source_directory).remove(source_name);
        if let Some(replaced) = replaced {
            self.entries_mut(target_directory).remove(target_name);
            self.drop_name(replaced);
        }
        self.entries_mut(target_directory)
            .insert(target_name.to_string(), moved);
        self.set_parent(moved, target_directory);
        if flag == RenameFlag::Whiteout {
            self.insert_node(source_directory, source_name, whiteout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT_CREATOR: Creator = Creator {
        user_id: 0,
        group_id: 0,
        creation_mask: 0o022,
    };

    /// Run `operations`, each of which must give what is listed (checked against Linux by
    /// hand on ext4 and tmpfs), applying the ones that succeed.
    fn run(model: &mut Model, operations: &[(Operation, Expected)]) {
        for (operation, expected) in operations {
            assert_eq!(model.expect(operation), *expected, "{operation}");
            if *expected == Expected::Success {
                model.apply(operation, ROOT_CREATOR);
            }
        }
    }

    fn create(path: &str) -> Operation {
        Operation::Create { path: path.into() }
    }
    fn mkdir(path: &str) -> Operation {
        Operation::MakeDirectory { path: path.into() }
    }
    fn rename(source: &str, target: &str, flag: RenameFlag) -> Operation {
        Operation::Rename {
            source: source.into(),
            target: target.into(),
            flag,
        }
    }
    fn link(source: &str, target: &str) -> Operation {
        Operation::Link {
            source: source.into(),
            target: target.into(),
        }
    }

    fn kind_at(model: &Model, path: &str) -> Option<NodeKind> {
        model
            .lookup(path)
            .unwrap()
            .map(|label| model.node(label).unwrap().kind())
    }

    use Expected::{Failure, Success};

    #[test]
    fn exchanging_a_file_and_a_directory_swaps_them_and_their_parents_counts() {
        let mut model = Model::new();
        run(
            &mut model,
            &[
                (mkdir("d0"), Success),
                (mkdir("d1"), Success),
                (mkdir("d1/d2"), Success),
                (create("d0/f0"), Success),
                (rename("d0/f0", "d1/d2", RenameFlag::Exchange), Success),
            ],
        );
        assert_eq!(kind_at(&model, "d0/f0"), Some(NodeKind::Directory));
        assert_eq!(kind_at(&model, "d1/d2"), Some(NodeKind::Regular));
        let d0 = model.lookup("d0").unwrap().unwrap();
        let d1 = model.lookup("d1").unwrap().unwrap();
        assert_eq!(model.link_count(d0), 3);
        assert_eq!(model.link_count(d1), 2);
        // A plain rename of the file onto a directory is EISDIR, of the directory onto the
        // file ENOTDIR; an exchange with a missing name is ENOENT.
        run(
            &mut model,
            &[
                (
                    rename("d1/d2", "d0/f0", RenameFlag::None),
                    Failure(libc::EISDIR),
                ),
                (
                    rename("d0/f0", "d1/d2", RenameFlag::None),
                    Failure(libc::ENOTDIR),
                ),
                (
                    rename("d0/f0", "d1/f9", RenameFlag::Exchange),
                    Failure(libc::ENOENT),
                ),
                (
                    rename("d0/f9", "d1/d2", RenameFlag::Exchange),
                    Failure(libc::ENOENT),
                ),
            ],
        );
    }

    #[test]
    fn no_replace_onto_an_existing_name_is_eexist_even_onto_itself() {
        let mut model = Model::new();
        run(
            &mut model,
            &[
                (create("f0"), Success),
                (mkdir("d0"), Success),
                (
                    rename("f0", "d0", RenameFlag::NoReplace),
                    Failure(libc::EEXIST),
                ),
                (
                    rename("f0", "f0", RenameFlag::NoReplace),
                    Failure(libc::EEXIST),
                ),
                (
                    rename("f1", "d0", RenameFlag::NoReplace),
                    Failure(libc::ENOENT),
                ),
                (rename("f0", "d0/f1", RenameFlag::NoReplace), Success),
            ],
        );
        assert_eq!(kind_at(&model, "f0"), None);
        assert_eq!(kind_at(&model, "d0/f1"), Some(NodeKind::Regular));
    }

    #[test]
    fn renaming_onto_a_hard_link_of_the_same_inode_changes_nothing() {
        let mut model = Model::new();
        run(
            &mut model,
            &[
                (create("f0"), Success),
                (link("f0", "f1"), Success),
                (rename("f0", "f1", RenameFlag::None), Success),
                (rename("f0", "f1", RenameFlag::Exchange), Success),
                (rename("f0", "f1", RenameFlag::Whiteout), Success),
            ],
        );
        let label = model.lookup("f0").unwrap().unwrap();
        assert_eq!(model.lookup("f1").unwrap(), Some(label));
        assert_eq!(model.link_count(label), 2);
    }

    #[test]
    fn a_directory_cannot_move_into_its_own_subtree_nor_over_an_ancestor() {
        let mut model = Model::new();
        run(
            &mut model,
            &[
                (mkdir("d0"), Success),
                (mkdir("d0/d1"), Success),
                (create("d0/d1/f0"), Success),
                (
                    rename("d0", "d0/d1/d2", RenameFlag::None),
                    Failure(libc::EINVAL),
                ),
                (
                    rename("d0", "d0/d2", RenameFlag::None),
                    Failure(libc::EINVAL),
                ),
                (
                    rename("d0", "d0/d1", RenameFlag::Exchange),
                    Failure(libc::EINVAL),
                ),
                // The target is an ancestor of the source: ENOTEMPTY, EINVAL for an exchange.
                (
                    rename("d0/d1/f0", "d0", RenameFlag::None),
                    Failure(libc::ENOTEMPTY),
                ),
                (
                    rename("d0/d1", "d0", RenameFlag::Exchange),
                    Failure(libc::EINVAL),
                ),
                (
                    rename("d0/d1", "d0", RenameFlag::NoReplace),
                    Failure(libc::EEXIST),
                ),
                // Through a file on the way: ENOTDIR.
                (create("d0/d1/f0/f1"), Failure(libc::ENOTDIR)),
                (
                    Operation::RemoveDirectory { path: "d0".into() },
                    Failure(libc::ENOTEMPTY),
                ),
                (rename("d0/d1", "d2", RenameFlag::None), Success),
            ],
        );
        let d0 = model.lookup("d0").unwrap().unwrap();
        assert_eq!(model.link_count(d0), 2);
    }

    #[test]
    fn a_whiteout_leaves_a_character_device_and_links_and_xattrs_follow_linux() {
        let mut model = Model::new();
        let symlink = Operation::Symlink {
            path: "f2".into(),
            contents: "nowhere/f2".into(),
        };
        run(
            &mut model,
            &[
                (create("f0"), Success),
                (mkdir("d0"), Success),
                (rename("f0", "f1", RenameFlag::Whiteout), Success),
                (link("d0", "f3"), Failure(libc::EPERM)),
                (link("d0", "f1"), Failure(libc::EEXIST)),
                (symlink, Success),
                (
                    Operation::ChangeMode {
                        path: "f2".into(),
                        permissions: 0o700,
                    },
                    Failure(libc::ENOENT),
                ),
                (create("f2/f4"), Failure(libc::ENOENT)),
                (
                    Operation::SetXattr {
                        path: "f2".into(),
                        name: "user.a".into(),
                        value: b"x".to_vec(),
                        how: XattrHow::Any,
                    },
                    Failure(libc::EPERM),
                ),
                (
                    Operation::RemoveXattr {
                        path: "f1".into(),
                        name: "user.a".into(),
                    },
                    Failure(libc::ENODATA),
                ),
                (
                    Operation::Truncate {
                        path: "f0".into(),
                        size_bytes: 3,
                    },
                    Failure(libc::EINVAL),
                ),
                (
                    Operation::Truncate {
                        path: "d0".into(),
                        size_bytes: 3,
                    },
                    Failure(libc::EISDIR),
                ),
                (
                    Operation::Unlink { path: "d0".into() },
                    Failure(libc::EISDIR),
                ),
                (
                    Operation::RemoveDirectory { path: "f1".into() },
                    Failure(libc::ENOTDIR),
                ),
            ],
        );
        assert_eq!(kind_at(&model, "f0"), Some(NodeKind::CharDevice));
        let whiteout = model.lookup("f0").unwrap().unwrap();
        assert_eq!(model.node(whiteout).unwrap().permissions, 0);
    }
}
