//! The walk of a whole tree at the end of a batch, and the comparisons of walks with the
//! model and with each other.
//!
//! A walk lists every directory, `lstat`s every listed name, reads every regular file,
//! `readlink`s every symlink and lists the `user.*` attributes of files and directories. It
//! checks what must hold within one target on its own: every listed name `lstat`s (a name
//! that is listed but does not open is the failure the exerciser was built for), `d_ino`
//! equals `st_ino`, `d_type` matches the kind, the size matches the bytes read, no directory
//! is reached twice, a non-directory's link count equals the names found for its inode and a
//! directory's is `2 + subdirectories`. Walks are then compared by shape ([`canonical`]:
//! inodes numbered in the order of their first name), so the model, whose inodes are its own
//! labels, compares with any target, and targets of one cluster compare with each other.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use super::model::{Content, InodeLabel, Model, Node, ROOT};
use super::{errno_name, NamesTarget, NodeKind};

/// Names a walk visits at most: a bound on a tree that a broken target makes endless.
pub const WALK_NAMES_MAX: usize = 100_000;

/// What a walk found under one name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalkedName {
    pub kind: NodeKind,
    /// The target's inode number (the model's label in a walk of the model).
    pub inode_number: u64,
    pub permissions: u32,
    pub user_id: u32,
    pub group_id: u32,
    pub link_count: u64,
    /// Not compared for directories (file systems differ).
    pub size_bytes: Option<u64>,
    /// What a regular file holds.
    pub bytes: Option<Vec<u8>>,
    /// What a symlink says.
    pub link_text: Option<String>,
    /// `user.*` attributes of a regular file or a directory.
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

impl fmt::Display for WalkedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} inode {} mode {:04o} owner {}:{} links {}",
            self.kind,
            self.inode_number,
            self.permissions,
            self.user_id,
            self.group_id,
            self.link_count
        )?;
        if let Some(size) = self.size_bytes {
            write!(f, " size {size}")?;
        }
        if let Some(bytes) = &self.bytes {
            write!(f, " bytes {bytes:?}")?;
        }
        if let Some(text) = &self.link_text {
            write!(f, " -> {text:?}")?;
        }
        if !self.xattrs.is_empty() {
            let names: Vec<&str> = self.xattrs.keys().map(String::as_str).collect();
            write!(f, " xattrs {names:?}")?;
        }
        Ok(())
    }
}

/// A whole tree: every name (relative path) and the root's link count.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub names: BTreeMap<String, WalkedName>,
    pub root_link_count: u64,
}

fn join(directory: &str, name: &str) -> String {
    if directory.is_empty() {
        name.to_string()
    } else {
        format!("{directory}/{name}")
    }
}

/// Walk `target`'s tree, checking what one target must show on its own. `Err` says what
/// is wrong, naming the path.
pub fn walk_target(target: &mut dyn NamesTarget) -> Result<Snapshot, String> {
    let mut snapshot = Snapshot::default();
    let root = target
        .status("")
        .map_err(|errno| format!("lstat of the root: {}", errno_name(errno)))?;
    snapshot.root_link_count = root.link_count;
    let mut directories_seen = HashMap::from([(root.inode_number, String::new())]);
    let mut pending = vec![String::new()];
    while let Some(directory) = pending.pop() {
        let entries = target.read_directory(&directory).map_err(|errno| {
            format!(
                "readdir of {:?} failed with {}",
                directory,
                errno_name(errno)
            )
        })?;
        for entry in entries {
            let path = join(&directory, &entry.name);
            if snapshot.names.len() >= WALK_NAMES_MAX {
                return Err(format!("more than {WALK_NAMES_MAX} names (at {path:?})"));
            }
            if snapshot.names.contains_key(&path) {
                return Err(format!("{path:?} is listed twice"));
            }
            let status = target.status(&path).map_err(|errno| {
                format!("{path:?} is listed but lstat answers {}", errno_name(errno))
            })?;
            if entry.inode_number != status.inode_number {
                return Err(format!(
                    "{path:?} is listed with d_ino {} but lstat says inode {}",
                    entry.inode_number, status.inode_number
                ));
            }
            if entry.kind != Some(status.kind) {
                return Err(format!(
                    "{path:?} is listed with d_type {:?} but lstat says {:?}",
                    entry.kind, status.kind
                ));
            }
            let mut walked = WalkedName {
                kind: status.kind,
                inode_number: status.inode_number,
                permissions: status.permissions,
                user_id: status.user_id,
                group_id: status.group_id,
                link_count: status.link_count,
                size_bytes: (status.kind != NodeKind::Directory).then_some(status.size_bytes),
                bytes: None,
                link_text: None,
                xattrs: BTreeMap::new(),
            };
            match status.kind {
                NodeKind::Regular => {
                    let bytes = target.read_file(&path).map_err(|errno| {
                        format!(
                            "{path:?} is listed and lstats but its open or read answers {}",
                            errno_name(errno)
                        )
                    })?;
                    if bytes.len() as u64 != status.size_bytes {
                        return Err(format!(
                            "{path:?}: lstat says {} bytes, a read found {}",
                            status.size_bytes,
                            bytes.len()
                        ));
                    }
                    walked.bytes = Some(bytes);
                }
                NodeKind::Symlink => {
                    let text = target.read_link(&path).map_err(|errno| {
                        format!("readlink of {path:?} answers {}", errno_name(errno))
                    })?;
                    walked.link_text = Some(text);
                }
                NodeKind::Directory => {
                    if let Some(other) = directories_seen.insert(status.inode_number, path.clone())
                    {
                        return Err(format!(
                            "directory inode {} is reached as {other:?} and as {path:?}",
                            status.inode_number
                        ));
                    }
                    pending.push(path.clone());
                }
                _ => {}
            }
            if matches!(status.kind, NodeKind::Regular | NodeKind::Directory) {
                let attributes = target.list_xattrs(&path).map_err(|errno| {
                    format!(
                        "listing the xattrs of {path:?} answers {}",
                        errno_name(errno)
                    )
                })?;
                walked.xattrs = attributes.into_iter().collect();
            }
            snapshot.names.insert(path, walked);
        }
    }
    check_link_counts(&snapshot)?;
    Ok(snapshot)
}

/// Link counts as the names found require.
fn check_link_counts(snapshot: &Snapshot) -> Result<(), String> {
    let mut names_of_inode: HashMap<u64, u64> = HashMap::new();
    let mut subdirectories: HashMap<&str, u64> = HashMap::new();
    for (path, walked) in &snapshot.names {
        if walked.kind == NodeKind::Directory {
            let parent = path.rsplit_once('/').map_or("", |(parent, _)| parent);
            *subdirectories.entry(parent).or_default() += 1;
        } else {
            *names_of_inode.entry(walked.inode_number).or_default() += 1;
        }
    }
    let root_expected = 2 + subdirectories.get("").copied().unwrap_or(0);
    if snapshot.root_link_count != root_expected {
        return Err(format!(
            "the root has link count {} but {} subdirectories",
            snapshot.root_link_count,
            root_expected - 2
        ));
    }
    for (path, walked) in &snapshot.names {
        let expected = if walked.kind == NodeKind::Directory {
            2 + subdirectories.get(path.as_str()).copied().unwrap_or(0)
        } else {
            names_of_inode[&walked.inode_number]
        };
        if walked.link_count != expected {
            let what = if walked.kind == NodeKind::Directory {
                format!("{} subdirectories", expected - 2)
            } else {
                format!(
                    "{expected} names of inode {} in the tree",
                    walked.inode_number
                )
            };
            return Err(format!(
                "{path:?} has link count {} but {what}",
                walked.link_count
            ));
        }
    }
    Ok(())
}

/// The model as a walk would find it (inode numbers are the model's labels).
pub fn walk_model(model: &Model) -> Snapshot {
    let mut snapshot = Snapshot {
        names: BTreeMap::new(),
        root_link_count: model.link_count(ROOT),
    };
    for (path, label, _) in model.names() {
        let Some(node) = model.node(label) else {
            continue;
        };
        let kind = node.kind();
        let (bytes, link_text) = match &node.content {
            Content::Regular { bytes } => (Some(bytes.clone()), None),
            Content::Symlink { contents } => (None, Some(contents.clone())),
            _ => (None, None),
        };
        snapshot.names.insert(
            path,
            WalkedName {
                kind,
                inode_number: label,
                permissions: node.permissions,
                user_id: node.user_id,
                group_id: node.group_id,
                link_count: model.link_count(label),
                size_bytes: model.size_bytes(label),
                bytes,
                link_text,
                xattrs: node.xattrs.clone(),
            },
        );
    }
    snapshot
}

/// The snapshot with inode numbers replaced by the order of each inode's first name, so
/// that walks of different places compare by the shape of their links.
pub fn canonical(snapshot: &Snapshot) -> Snapshot {
    let mut numbering: HashMap<u64, u64> = HashMap::new();
    let mut names = BTreeMap::new();
    for (path, walked) in &snapshot.names {
        let next = numbering.len() as u64;
        let number = *numbering.entry(walked.inode_number).or_insert(next);
        let mut walked = walked.clone();
        walked.inode_number = number;
        names.insert(path.clone(), walked);
    }
    Snapshot {
        names,
        root_link_count: snapshot.root_link_count,
    }
}

/// The first difference between two walks (`expected_place` and `found_place` name them),
/// comparing shapes; with `same_inode_numbers`, the raw inode numbers must be equal too.
pub fn difference(
    expected: &Snapshot,
    found: &Snapshot,
    expected_place: &str,
    found_place: &str,
    same_inode_numbers: bool,
) -> Option<String> {
    let (expected_shape, found_shape) = (canonical(expected), canonical(found));
    if expected.root_link_count != found.root_link_count {
        return Some(format!(
            "the root has link count {} on {expected_place} but {} on {found_place}",
            expected.root_link_count, found.root_link_count
        ));
    }
    for (path, walked) in &expected_shape.names {
        match found_shape.names.get(path) {
            None => {
                return Some(format!(
                    "{path:?} is missing on {found_place}; on {expected_place}: {}",
                    expected.names[path]
                ))
            }
            Some(other) if other != walked => {
                return Some(format!(
                    "{path:?} differs:\n    {expected_place}: {}\n    {found_place}: {}",
                    expected.names[path], found.names[path]
                ))
            }
            Some(_) => {}
        }
        if same_inode_numbers && expected.names[path].inode_number != found.names[path].inode_number
        {
            return Some(format!(
                "{path:?} is inode {} on {expected_place} but {} on {found_place}",
                expected.names[path].inode_number, found.names[path].inode_number
            ));
        }
    }
    found_shape
        .names
        .keys()
        .find(|path| !expected_shape.names.contains_key(*path))
        .map(|path| {
            format!(
                "{path:?} is listed on {found_place} but not on {expected_place}: {}",
                found.names[path]
            )
        })
}

/// A model of the tree a walk found (concurrent mode rebuilds its model so), and each
/// label's inode number on the walked target.
pub fn model_from_walk(snapshot: &Snapshot) -> (Model, HashMap<InodeLabel, u64>) {
    let mut model = Model::new();
    let mut labels: HashMap<String, InodeLabel> = HashMap::from([(String::new(), ROOT)]);
    let mut label_of_number: HashMap<u64, InodeLabel> = HashMap::new();
    let mut numbers = HashMap::new();
    // Name order puts a directory before its entries (names have no byte below '/').
    for (path, walked) in &snapshot.names {
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path.as_str()));
        let Some(&directory) = labels.get(parent) else {
            continue;
        };
        if walked.kind != NodeKind::Directory {
            if let Some(&label) = label_of_number.get(&walked.inode_number) {
                model.insert_link(directory, name, label);
                continue;
            }
        }
        let content = match walked.kind {
            NodeKind::Directory => Content::Directory {
                entries: BTreeMap::new(),
                parent: directory,
            },
            NodeKind::Symlink => Content::Symlink {
                contents: walked.link_text.clone().unwrap_or_default(),
            },
            NodeKind::Fifo => Content::Fifo,
            NodeKind::Regular => Content::Regular {
                bytes: walked.bytes.clone().unwrap_or_default(),
            },
            NodeKind::CharDevice | NodeKind::Other => Content::Whiteout,
        };
        let mut node = Node::new(content, walked.permissions, walked.user_id, walked.group_id);
        node.xattrs = walked.xattrs.clone();
        let label = model.insert_node(directory, name, node);
        labels.insert(path.clone(), label);
        label_of_number.insert(walked.inode_number, label);
        numbers.insert(label, walked.inode_number);
    }
    (model, numbers)
}

/// Remove every name under `target`'s root (children first), as `rm -rf` would: a
/// directory whose listing is empty but whose removal answers `ENOTEMPTY` is reported.
pub fn remove_tree(target: &mut dyn NamesTarget) -> Result<(), String> {
    let snapshot = walk_target(target)?;
    for (path, walked) in snapshot.names.iter().rev() {
        let result = if walked.kind == NodeKind::Directory {
            target.remove_directory(path)
        } else {
            target.unlink(path)
        };
        if let Err(errno) = result {
            return Err(format!(
                "removing {path:?} ({:?}) after its entries answers {}",
                walked.kind,
                errno_name(errno)
            ));
        }
    }
    let left = target
        .read_directory("")
        .map_err(|errno| format!("readdir of the root answers {}", errno_name(errno)))?;
    if let Some(entry) = left.first() {
        return Err(format!(
            "{:?} is still listed after the whole tree was removed",
            entry.name
        ));
    }
    Ok(())
}
