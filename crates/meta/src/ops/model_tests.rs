//! Property test: random sequences of namespace operations applied to the real operations
//! over redb and to a simple in-memory tree must agree on every result code and, at the
//! end, on the whole tree (names, kinds, link counts, sizes).

use std::collections::{BTreeMap, HashMap};

use freeflow_proto::meta::{
    Caller, Link, ReadDir, Rename, RenameMode, Rmdir, SetAttributes, Symlink, Unlink,
};
use freeflow_proto::ErrorCode;
use freeflow_types::{FileKind, InodeId, SetAttr, ROOT_INODE};
use proptest::prelude::*;

use super::testing::Harness;
use super::*;

const NAMES: [&str; 4] = ["d0", "d1", "f0", "f1"];
const PARENTS: [&[&str]; 6] = [
    &[],
    &["d0"],
    &["d1"],
    &["d0", "d0"],
    &["d0", "d1"],
    &["d1", "d0"],
];

#[derive(Clone, Debug)]
enum Step {
    Mkdir(usize, usize),
    Create(usize, usize),
    Symlink(usize, usize),
    Unlink(usize, usize),
    Rmdir(usize, usize),
    Rename(usize, usize, usize, usize, RenameMode),
    Link(usize, usize, usize, usize),
    SetSize(usize, usize, u64),
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let parent = 0..PARENTS.len();
    let name = 0..NAMES.len();
    let mode = prop_oneof![
        Just(RenameMode::Replace),
        Just(RenameMode::NoReplace),
        Just(RenameMode::Exchange)
    ];
    prop_oneof![
        3 => (parent.clone(), name.clone()).prop_map(|(p, n)| Step::Mkdir(p, n)),
        3 => (parent.clone(), name.clone()).prop_map(|(p, n)| Step::Create(p, n)),
        1 => (parent.clone(), name.clone()).prop_map(|(p, n)| Step::Symlink(p, n)),
        2 => (parent.clone(), name.clone()).prop_map(|(p, n)| Step::Unlink(p, n)),
        2 => (parent.clone(), name.clone()).prop_map(|(p, n)| Step::Rmdir(p, n)),
        3 => (parent.clone(), name.clone(), parent.clone(), name.clone(), mode)
            .prop_map(|(p, n, q, m, mode)| Step::Rename(p, n, q, m, mode)),
        2 => (parent.clone(), name.clone(), parent.clone(), name.clone())
            .prop_map(|(p, n, q, m)| Step::Link(p, n, q, m)),
        1 => (parent, name, 0u64..5000).prop_map(|(p, n, s)| Step::SetSize(p, n, s)),
    ]
}

// ---- the model ----

#[derive(Clone, Debug)]
enum Node {
    Directory(BTreeMap<String, usize>),
    File { size: u64 },
    Symlink,
}

#[derive(Default)]
struct Model {
    nodes: HashMap<usize, Node>,
    /// Links per node (names pointing at it).
    names: HashMap<usize, u32>,
    next: usize,
}

type Outcome = Result<(), ErrorCode>;

impl Model {
    fn new() -> Model {
        let mut model = Model::default();
        model.nodes.insert(0, Node::Directory(BTreeMap::new()));
        model.next = 1;
        model
    }

    fn entries(&self, directory: usize) -> &BTreeMap<String, usize> {
        match &self.nodes[&directory] {
            Node::Directory(entries) => entries,
            _ => unreachable!("not a directory"),
        }
    }

    fn entries_mut(&mut self, directory: usize) -> &mut BTreeMap<String, usize> {
        match self.nodes.get_mut(&directory) {
            Some(Node::Directory(entries)) => entries,
            _ => unreachable!("not a directory"),
        }
    }

    fn is_directory(&self, node: usize) -> bool {
        matches!(self.nodes[&node], Node::Directory(_))
    }

    fn resolve(&self, path: &[&str]) -> Result<usize, ErrorCode> {
        let mut current = 0;
        for component in path {
            let child = *self
                .entries(current)
                .get(*component)
                .ok_or(ErrorCode::NotFound)?;
            if !self.is_directory(child) {
                return Err(ErrorCode::NotDirectory);
            }
            current = child;
        }
        Ok(current)
    }

    fn add(&mut self, parent: usize, name: &str, node: Node) -> Outcome {
        if self.entries(parent).contains_key(name) {
            return Err(ErrorCode::Exists);
        }
        let id = self.next;
        self.next += 1;
        self.nodes.insert(id, node);
        self.names.insert(id, 1);
        self.entries_mut(parent).insert(name.to_string(), id);
        Ok(())
    }

    fn drop_name(&mut self, node: usize) {
        let count = self.names.get_mut(&node).expect("named");
        *count -= 1;
        if *count == 0 && self.is_directory(node) {
            self.nodes.remove(&node);
        }
    }

    /// True if `ancestor` is `node` or above it.
    fn contains(&self, ancestor: usize, node: usize) -> bool {
        if ancestor == node {
            return true;
        }
        match &self.nodes[&ancestor] {
            Node::Directory(entries) => entries
                .values()
                .any(|child| self.is_directory(*child) && self.contains(*child, node)),
            _ => false,
        }
    }

    fn apply(&mut self, step: &Step) -> Outcome {
        match step {
            Step::Mkdir(p, n) => {
                let parent = self.resolve(PARENTS[*p])?;
                self.add(parent, NAMES[*n], Node::Directory(BTreeMap::new()))
            }
            Step::Create(p, n) => {
                let parent = self.resolve(PARENTS[*p])?;
                self.add(parent, NAMES[*n], Node::File { size: 0 })
            }
            Step::Symlink(p, n) => {
                let parent = self.resolve(PARENTS[*p])?;
                self.add(parent, NAMES[*n], Node::Symlink)
            }
            Step::Unlink(p, n) => {
                let parent = self.resolve(PARENTS[*p])?;
                let child = *self
                    .entries(parent)
                    .get(NAMES[*n])
                    .ok_or(ErrorCode::NotFound)?;
                if self.is_directory(child) {
                    return Err(ErrorCode::IsDirectory);
                }
                self.entries_mut(parent).remove(NAMES[*n]);
                self.drop_name(child);
                Ok(())
            }
            Step::Rmdir(p, n) => {
                let parent = self.resolve(PARENTS[*p])?;
                let child = *self
                    .entries(parent)
                    .get(NAMES[*n])
                    .ok_or(ErrorCode::NotFound)?;
                if !self.is_directory(child) {
                    return Err(ErrorCode::NotDirectory);
                }
                if !self.entries(child).is_empty() {
                    return Err(ErrorCode::NotEmpty);
                }
                self.entries_mut(parent).remove(NAMES[*n]);
                self.drop_name(child);
                Ok(())
            }
            Step::Link(p, n, q, m) => {
                // The source is resolved as a path first (as a client would).
                let source_parent = self.resolve(PARENTS[*p])?;
                let source = *self
                    .entries(source_parent)
                    .get(NAMES[*n])
                    .ok_or(ErrorCode::NotFound)?;
                let target_parent = self.resolve(PARENTS[*q])?;
                if self.is_directory(source) {
                    return Err(ErrorCode::NotPermitted);
                }
                if self.entries(target_parent).contains_key(NAMES[*m]) {
                    return Err(ErrorCode::Exists);
                }
                self.entries_mut(target_parent)
                    .insert(NAMES[*m].to_string(), source);
                *self.names.get_mut(&source).expect("named") += 1;
                Ok(())
            }
            Step::SetSize(p, n, size) => {
                let parent = self.resolve(PARENTS[*p])?;
                let child = *self
                    .entries(parent)
                    .get(NAMES[*n])
                    .ok_or(ErrorCode::NotFound)?;
                match self.nodes.get_mut(&child) {
                    Some(Node::File { size: current }) => {
                        *current = *size;
                        Ok(())
                    }
                    Some(Node::Directory(_)) => Err(ErrorCode::IsDirectory),
                    _ => Err(ErrorCode::InvalidArgument),
                }
            }
            Step::Rename(p, n, q, m, mode) => self.rename(*p, *n, *q, *m, *mode),
        }
    }

    fn rename(&mut self, p: usize, n: usize, q: usize, m: usize, mode: RenameMode) -> Outcome {
        let (source_name, target_name) = (NAMES[n], NAMES[m]);
        let source_parent = self.resolve(PARENTS[p])?;
        let target_parent = self.resolve(PARENTS[q])?;
        let source = *self
            .entries(source_parent)
            .get(source_name)
            .ok_or(ErrorCode::NotFound)?;
        let target = self.entries(target_parent).get(target_name).copied();
        match (mode, target) {
            (RenameMode::NoReplace, Some(_)) => return Err(ErrorCode::Exists),
            (RenameMode::Exchange, None) => return Err(ErrorCode::NotFound),
            (_, Some(target)) if target == source => return Ok(()),
            _ => {}
        }
        let source_is_directory = self.is_directory(source);
        let target_is_directory = target.is_some_and(|target| self.is_directory(target));
        if mode != RenameMode::Exchange {
            if let Some(target) = target {
                if source_is_directory && !target_is_directory {
                    return Err(ErrorCode::NotDirectory);
                }
                if !source_is_directory && target_is_directory {
                    return Err(ErrorCode::IsDirectory);
                }
                if target_is_directory && !self.entries(target).is_empty() {
                    return Err(ErrorCode::NotEmpty);
                }
            }
        }
        let across = source_parent != target_parent;
        if source_is_directory && across && self.contains(source, target_parent) {
            return Err(ErrorCode::InvalidArgument);
        }
        if mode == RenameMode::Exchange && target_is_directory && across {
            if let Some(target) = target {
                if self.contains(target, source_parent) {
                    return Err(ErrorCode::InvalidArgument);
                }
            }
        }
        if mode == RenameMode::Exchange {
            let target = target.expect("exchange has a target");
            self.entries_mut(source_parent)
                .insert(source_name.to_string(), target);
            self.entries_mut(target_parent)
                .insert(target_name.to_string(), source);
        } else {
            self.entries_mut(source_parent).remove(source_name);
            self.entries_mut(target_parent)
                .insert(target_name.to_string(), source);
            if let Some(target) = target {
                self.drop_name(target);
            }
        }
        Ok(())
    }

    fn link_count(&self, node: usize) -> u32 {
        match &self.nodes[&node] {
            Node::Directory(entries) => {
                2 + entries
                    .values()
                    .filter(|child| self.is_directory(**child))
                    .count() as u32
            }
            _ => self.names[&node],
        }
    }

    /// (path, kind, link count, size of files) of every name, depth first.
    fn walk(&self, directory: usize, prefix: &str, out: &mut Vec<(String, FileKind, u32, u64)>) {
        for (name, child) in self.entries(directory) {
            let path = format!("{prefix}/{name}");
            let (kind, size) = match &self.nodes[child] {
                Node::Directory(_) => (FileKind::Directory, 0),
                Node::File { size } => (FileKind::Regular, *size),
                Node::Symlink => (FileKind::Symlink, 0),
            };
            out.push((path.clone(), kind, self.link_count(*child), size));
            if kind == FileKind::Directory {
                self.walk(*child, &path, out);
            }
        }
    }
}

// ---- the real operations ----

fn real_resolve(harness: &Harness, path: &[&str]) -> Result<InodeId, ErrorCode> {
    let mut current = ROOT_INODE;
    for component in path {
        let attr = harness
            .lookup(current, component)
            .map_err(|error| error.code())?;
        if attr.kind != FileKind::Directory {
            return Err(ErrorCode::NotDirectory);
        }
        current = attr.inode;
    }
    Ok(current)
}

fn real_apply(harness: &mut Harness, step: &Step) -> Outcome {
    let root = Caller::root();
    let code = |result: OpResult<()>| result.map_err(|error| error.code());
    match step {
        Step::Mkdir(p, n) => {
            let parent = real_resolve(harness, PARENTS[*p])?;
            code(harness.mkdir(parent, NAMES[*n]).map(drop))
        }
        Step::Create(p, n) => {
            let parent = real_resolve(harness, PARENTS[*p])?;
            code(harness.create(parent, NAMES[*n]).map(drop))
        }
        Step::Symlink(p, n) => {
            let parent = real_resolve(harness, PARENTS[*p])?;
            let request = Symlink {
                caller: root,
                parent,
                name: NAMES[*n].into(),
                target: "/x".into(),
            };
            code(
                harness
                    .write(|write, context| create::symlink(write, context, &request))
                    .map(drop),
            )
        }
        Step::Unlink(p, n) => {
            let parent = real_resolve(harness, PARENTS[*p])?;
            let request = Unlink {
                caller: root,
                parent,
                name: NAMES[*n].into(),
            };
            code(harness.write(|write, context| remove::unlink(write, context, &request)))
        }
        Step::Rmdir(p, n) => {
            let parent = real_resolve(harness, PARENTS[*p])?;
            let request = Rmdir {
                caller: root,
                parent,
                name: NAMES[*n].into(),
            };
            code(harness.write(|write, context| remove::rmdir(write, context, &request)))
        }
        Step::Link(p, n, q, m) => {
            let source_parent = real_resolve(harness, PARENTS[*p])?;
            let source = harness
                .lookup(source_parent, NAMES[*n])
                .map_err(|error| error.code())?;
            let target_parent = real_resolve(harness, PARENTS[*q])?;
            let request = Link {
                caller: root,
                inode: source.inode,
                target_parent,
                target_name: NAMES[*m].into(),
            };
            code(
                harness
                    .write(|write, context| link::link(write, context, &request))
                    .map(drop),
            )
        }
        Step::SetSize(p, n, size) => {
            let parent = real_resolve(harness, PARENTS[*p])?;
            let child = harness
                .lookup(parent, NAMES[*n])
                .map_err(|error| error.code())?;
            let request = SetAttributes {
                caller: root,
                inode: child.inode,
                changes: SetAttr {
                    size_bytes: Some(*size),
                    ..SetAttr::default()
                },
                through_handle: None,
            };
            let result = harness
                .write(|write, context| setattr::set_attributes(write, context, &request, false));
            code(result.map(drop))
        }
        Step::Rename(p, n, q, m, mode) => {
            let source_parent = real_resolve(harness, PARENTS[*p])?;
            let target_parent = real_resolve(harness, PARENTS[*q])?;
            let request = Rename {
                caller: root,
                source_parent,
                source_name: NAMES[*n].into(),
                target_parent,
                target_name: NAMES[*m].into(),
                mode: *mode,
            };
            code(harness.write(|write, context| rename::rename(write, context, &request)))
        }
    }
}

fn real_walk(
    harness: &Harness,
    directory: InodeId,
    prefix: &str,
    out: &mut Vec<(String, FileKind, u32, u64)>,
    inodes: &mut std::collections::HashSet<InodeId>,
) {
    let mut after = None;
    loop {
        let request = ReadDir {
            caller: Caller::root(),
            inode: directory,
            after: after.clone(),
            limit: 2,
            with_attributes: true,
        };
        let page = harness
            .read(|read| readdir::read_dir(read, &request))
            .expect("readdir");
        for entry in &page.entries {
            let attr = entry.attr.clone().expect("attributes");
            assert_eq!(attr, harness.attr(entry.inode).expect("getattr"));
            assert_eq!(attr.kind, entry.kind);
            inodes.insert(entry.inode);
            let path = format!("{prefix}/{}", entry.name);
            let size = if attr.kind == FileKind::Regular {
                attr.size_bytes
            } else {
                0
            };
            out.push((path.clone(), attr.kind, attr.link_count, size));
            if attr.kind == FileKind::Directory {
                real_walk(harness, entry.inode, &path, out, inodes);
            }
        }
        after = page.entries.last().map(|entry| entry.name.clone());
        if page.end {
            break;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn namespace_matches_the_model(steps in proptest::collection::vec(step_strategy(), 1..60)) {
        let mut harness = Harness::new();
        let mut model = Model::new();
        // A populated tree first, so that random steps mostly find their parents.
        let setup = [
            Step::Mkdir(0, 0), Step::Mkdir(0, 1), Step::Mkdir(1, 0), Step::Mkdir(1, 1),
            Step::Mkdir(2, 0), Step::Create(0, 2), Step::Create(1, 2), Step::Create(3, 3),
            Step::Create(5, 2),
        ];
        for (index, step) in setup.iter().chain(steps.iter()).enumerate() {
            let expected = model.apply(step);
            let actual = real_apply(&mut harness, step);
            prop_assert_eq!(actual, expected, "step {} {:?}", index, step);
        }
        let mut expected = Vec::new();
        model.walk(0, "", &mut expected);
        let mut actual = Vec::new();
        let mut inodes = std::collections::HashSet::new();
        real_walk(&harness, ROOT_INODE, "", &mut actual, &mut inodes);
        prop_assert_eq!(&actual, &expected);
        let root = harness.attr(ROOT_INODE).expect("root");
        prop_assert_eq!(root.link_count, model.link_count(0));
        // The persisted counters agree with what is reachable plus the orphans.
        prop_assert_eq!(
            harness.state.inode_count,
            1 + inodes.len() as u64 + harness.state.orphan_count
        );
        let orphans = harness.read(|read| orphan::list_orphans(read, None, 10_000)).expect("orphans");
        prop_assert_eq!(orphans.len() as u64, harness.state.orphan_count);
        harness.reopen();
        prop_assert_eq!(harness.state.orphan_count, orphans.len() as u64);
    }
}
