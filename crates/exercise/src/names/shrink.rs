//! Replaying a recorded list of operations, and cutting a failing list down to a short
//! reproduction by delta debugging (Zeller's ddmin, with a bound on the replays).
//!
//! A serial run records every operation in the order it ran ([`super::NamesFailure::recorded`]).
//! Replayed by one worker on a fresh directory, the list runs the same calls with the same
//! model, so a failure that does not need two mounts or timing fails again; chunks of the
//! list are then removed while it still fails. The model computes what each call must
//! return from the calls left, so any sublist is a valid test.

use std::io;

use super::driver::{check_touched, judge, InodeNumbers, NamesFailure, WhiteoutBehaviour};
use super::model::Model;
use super::options::NamesOptions;
use super::walk::{difference, remove_tree, walk_model, walk_target};
use super::{perform, NamesTarget, Operation};

/// Run `operations` in order on `target` (emptied first), checking each call as serial mode
/// does and walking the tree every `options.batch_operations` calls and at the end.
/// Operations the target does not support are skipped.
pub fn replay(
    target: &mut dyn NamesTarget,
    operations: &[Operation],
    options: &NamesOptions,
) -> Result<(), Box<NamesFailure>> {
    let place = target.describe();
    let failure =
        |number: Option<u64>, operation: Option<&Operation>, expected: String, found: String| {
            Box::new(NamesFailure {
                seed: options.seed,
                worker: Some(0),
                target: place.clone(),
                operation_number: number,
                operation: operation.cloned(),
                expected,
                found,
                history: Vec::new(),
                recorded: operations.to_vec(),
            })
        };
    remove_tree(target).map_err(|text| failure(None, None, "an empty tree".into(), text))?;
    let mut model = Model::new();
    let mut numbers = InodeNumbers::default();
    let mut whiteout = WhiteoutBehaviour::NotSeen;
    let batch = options.batch_operations.max(1) as usize;
    for (index, operation) in operations.iter().enumerate() {
        let number = Some(index as u64 + 1);
        if target.supports(operation.kind()) {
            let expected = model.expect(operation);
            let onto_itself = model.renames_onto_itself(operation);
            let result = perform(target, operation);
            let apply = judge(operation, expected, result, &mut whiteout, onto_itself)
                .map_err(|(expected, found)| failure(number, Some(operation), expected, found))?;
            if apply {
                model.apply(operation, target.creator());
                check_touched(target, &model, &mut numbers, operation).map_err(
                    |(expected, found)| failure(number, Some(operation), expected, found),
                )?;
            }
        }
        if (index + 1) % batch == 0 || index + 1 == operations.len() {
            let found = walk_target(target)
                .map_err(|text| failure(number, None, "a consistent tree".into(), text))?;
            if let Some(text) = difference(&walk_model(&model), &found, "the model", &place, false)
            {
                return Err(failure(
                    number,
                    None,
                    "the tree the model holds".into(),
                    text,
                ));
            }
        }
    }
    Ok(())
}

/// Cut `operations`, which fail on a fresh target from `make_target`, down to a short list
/// that still fails, replaying at most `replays_max` times. Returns the shortest failing list
/// found, or `None` if the input does not fail when replayed (a failure that needs several
/// mounts or the timing of concurrent workers).
pub fn shrink(
    make_target: &mut dyn FnMut() -> io::Result<Box<dyn NamesTarget + Send>>,
    operations: &[Operation],
    options: &NamesOptions,
    replays_max: usize,
) -> Option<Vec<Operation>> {
    let mut replays = 0usize;
    let mut fails = |candidate: &[Operation], replays: &mut usize| -> bool {
        *replays += 1;
        match make_target() {
            Ok(mut target) => replay(target.as_mut(), candidate, options).is_err(),
            Err(_) => false,
        }
    };
    let mut current = operations.to_vec();
    if !fails(&current, &mut replays) {
        return None;
    }
    let mut chunks = 2usize;
    while current.len() >= 2 && replays < replays_max {
        let chunk_length = current.len().div_ceil(chunks);
        let mut reduced = false;
        let mut start = 0;
        while start < current.len() && replays < replays_max {
            let end = (start + chunk_length).min(current.len());
            let candidate: Vec<Operation> = current[..start]
                .iter()
                .chain(&current[end..])
                .cloned()
                .collect();
            if fails(&candidate, &mut replays) {
                current = candidate;
                chunks = (chunks - 1).max(2);
                reduced = true;
                break;
            }
            start = end;
        }
        if !reduced {
            if chunks >= current.len() {
                break;
            }
            chunks = (chunks * 2).min(current.len());
        }
    }
    Some(current)
}

/// A list of operations as numbered system calls, one a line.
pub fn reproduction(operations: &[Operation]) -> String {
    operations
        .iter()
        .enumerate()
        .map(|(index, operation)| format!("{:4}. {operation}", index + 1))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::names::model::{Content, Expected, InodeLabel, ROOT};
    use crate::names::{
        Creator, Errno, ListedEntry, NodeKind, NodeStatus, OperationKind, RenameFlag, XattrHow,
    };
    use std::sync::{Arc, Mutex};

    /// A target that keeps its tree in a [`Model`] (so it is right by construction), with a
    /// fault to inject: `RENAME_NOREPLACE` replaces an existing target instead of refusing.
    /// Several targets may share one tree, as mounts of one cluster do.
    pub(crate) struct MemoryTarget {
        pub tree: Arc<Mutex<Model>>,
        pub no_replace_replaces: bool,
    }

    impl MemoryTarget {
        pub(crate) fn new(tree: Arc<Mutex<Model>>) -> MemoryTarget {
            MemoryTarget {
                tree,
                no_replace_replaces: false,
            }
        }

        fn change(&mut self, mut operation: Operation) -> Result<(), Errno> {
            let mut tree = self.tree.lock().unwrap();
            if let Operation::Rename { flag, .. } = &mut operation {
                if self.no_replace_replaces && *flag == RenameFlag::NoReplace {
                    *flag = RenameFlag::None;
                }
            }
            match tree.expect(&operation) {
                Expected::Success => {
                    tree.apply(&operation, self.creator());
                    Ok(())
                }
                Expected::Failure(errno) => Err(errno),
            }
        }

        fn label(&self, path: &str) -> Result<InodeLabel, Errno> {
            if path.is_empty() {
                return Ok(ROOT);
            }
            self.tree.lock().unwrap().lookup(path)?.ok_or(libc::ENOENT)
        }
    }

    impl NamesTarget for MemoryTarget {
        fn describe(&self) -> String {
            "memory".into()
        }
        fn creator(&self) -> Creator {
            Creator {
                user_id: 0,
                group_id: 0,
                creation_mask: 0o022,
            }
        }
        fn supports(&self, kind: OperationKind) -> bool {
            kind != OperationKind::RenameWhiteout
        }
        fn create(&mut self, path: &str) -> Result<(), Errno> {
            self.change(Operation::Create { path: path.into() })
        }
        fn make_directory(&mut self, path: &str) -> Result<(), Errno> {
            self.change(Operation::MakeDirectory { path: path.into() })
        }
        fn remove_directory(&mut self, path: &str) -> Result<(), Errno> {
            self.change(Operation::RemoveDirectory { path: path.into() })
        }
        fn unlink(&mut self, path: &str) -> Result<(), Errno> {
            self.change(Operation::Unlink { path: path.into() })
        }
        fn link(&mut self, source: &str, target: &str) -> Result<(), Errno> {
            self.change(Operation::Link {
                source: source.into(),
                target: target.into(),
            })
        }
        fn symlink(&mut self, path: &str, contents: &str) -> Result<(), Errno> {
            self.change(Operation::Symlink {
                path: path.into(),
                contents: contents.into(),
            })
        }
        fn make_fifo(&mut self, path: &str) -> Result<(), Errno> {
            self.change(Operation::MakeFifo { path: path.into() })
        }
        fn rename(&mut self, source: &str, target: &str, flag: RenameFlag) -> Result<(), Errno> {
            self.change(Operation::Rename {
                source: source.into(),
                target: target.into(),
                flag,
            })
        }
        fn change_mode(&mut self, path: &str, permissions: u32) -> Result<(), Errno> {
            self.change(Operation::ChangeMode {
                path: path.into(),
                permissions,
            })
        }
        fn change_owner(&mut self, path: &str, user_id: u32, group_id: u32) -> Result<(), Errno> {
            self.change(Operation::ChangeOwner {
                path: path.into(),
                user_id,
                group_id,
            })
        }
        fn set_times(&mut self, path: &str, seconds: i64) -> Result<(), Errno> {
            self.change(Operation::SetTimes {
                path: path.into(),
                seconds,
            })
        }
        fn set_xattr(
            &mut self,
            path: &str,
            name: &str,
            value: &[u8],
            how: XattrHow,
        ) -> Result<(), Errno> {
            self.change(Operation::SetXattr {
                path: path.into(),
                name: name.into(),
                value: value.to_vec(),
                how,
            })
        }
        fn remove_xattr(&mut self, path: &str, name: &str) -> Result<(), Errno> {
            self.change(Operation::RemoveXattr {
                path: path.into(),
                name: name.into(),
            })
        }
        fn truncate(&mut self, path: &str, size_bytes: u64) -> Result<(), Errno> {
            self.change(Operation::Truncate {
                path: path.into(),
                size_bytes,
            })
        }
        fn write(&mut self, path: &str, offset: u64, data: &[u8]) -> Result<(), Errno> {
            self.change(Operation::Write {
                path: path.into(),
                offset,
                data: data.to_vec(),
            })
        }
        fn read_directory(&mut self, path: &str) -> Result<Vec<ListedEntry>, Errno> {
            let label = self.label(path)?;
            let tree = self.tree.lock().unwrap();
            let node = tree.node(label).ok_or(libc::ENOENT)?;
            let Content::Directory { entries, .. } = &node.content else {
                return Err(libc::ENOTDIR);
            };
            Ok(entries
                .iter()
                .map(|(name, child)| ListedEntry {
                    name: name.clone(),
                    inode_number: *child,
                    kind: tree.node(*child).map(|node| node.kind()),
                })
                .collect())
        }
        fn status(&mut self, path: &str) -> Result<NodeStatus, Errno> {
            let label = self.label(path)?;
            let tree = self.tree.lock().unwrap();
            let node = tree.node(label).ok_or(libc::ENOENT)?;
            Ok(NodeStatus {
                inode_number: label,
                kind: node.kind(),
                permissions: node.permissions,
                size_bytes: tree.size_bytes(label).unwrap_or(4096),
                link_count: tree.link_count(label),
                user_id: node.user_id,
                group_id: node.group_id,
            })
        }
        fn read_file(&mut self, path: &str) -> Result<Vec<u8>, Errno> {
            let label = self.label(path)?;
            let tree = self.tree.lock().unwrap();
            match &tree.node(label).ok_or(libc::ENOENT)?.content {
                Content::Regular { bytes } => Ok(bytes.clone()),
                Content::Directory { .. } => Err(libc::EISDIR),
                _ => Err(libc::EINVAL),
            }
        }
        fn read_link(&mut self, path: &str) -> Result<String, Errno> {
            let label = self.label(path)?;
            let tree = self.tree.lock().unwrap();
            match &tree.node(label).ok_or(libc::ENOENT)?.content {
                Content::Symlink { contents } => Ok(contents.clone()),
                _ => Err(libc::EINVAL),
            }
        }
        fn list_xattrs(&mut self, path: &str) -> Result<Vec<(String, Vec<u8>)>, Errno> {
            let label = self.label(path)?;
            let tree = self.tree.lock().unwrap();
            let node = tree.node(label).ok_or(libc::ENOENT)?;
            if !matches!(node.kind(), NodeKind::Regular | NodeKind::Directory) {
                return Err(libc::EPERM);
            }
            Ok(node
                .xattrs
                .iter()
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect())
        }
    }

    fn options(seed: u64) -> NamesOptions {
        NamesOptions {
            seed,
            operations: 3_000,
            batch_operations: 500,
            ..NamesOptions::default()
        }
    }

    #[test]
    fn a_correct_target_shared_by_three_workers_passes_in_both_modes() {
        for concurrent in [false, true] {
            for seed in 0..3 {
                let tree = Arc::new(Mutex::new(Model::new()));
                let targets: Vec<Box<dyn NamesTarget + Send>> = (0..3)
                    .map(|_| {
                        Box::new(MemoryTarget::new(tree.clone())) as Box<dyn NamesTarget + Send>
                    })
                    .collect();
                let options = NamesOptions {
                    concurrent,
                    ..options(seed)
                };
                let report = crate::names::run(targets, &options)
                    .unwrap_or_else(|failure| panic!("{failure}"));
                assert_eq!(report.operations, 3_000);
                assert_eq!(report.batches, 6);
                let (renamed, refused) = report.counts[&OperationKind::RenameExchange];
                assert!(renamed > 0 && refused > 0, "{report}");
                assert_eq!(
                    report.unsupported,
                    vec![("memory".to_string(), vec![OperationKind::RenameWhiteout]); 3]
                );
            }
        }
    }

    #[test]
    fn a_no_replace_that_replaces_is_caught_and_shrunk_to_a_few_calls() {
        let mut faulty = || -> io::Result<Box<dyn NamesTarget + Send>> {
            let mut target = MemoryTarget::new(Arc::new(Mutex::new(Model::new())));
            target.no_replace_replaces = true;
            Ok(Box::new(target))
        };
        let failure = crate::names::run(vec![faulty().unwrap()], &options(5)).unwrap_err();
        let text = failure.to_string();
        assert!(text.starts_with("seed 5, worker 0, operation #"), "{text}");
        assert!(text.contains("RENAME_NOREPLACE"), "{text}");
        assert!(!failure.history.is_empty(), "{text}");
        assert!(failure.recorded.len() as u64 >= failure.operation_number.unwrap());
        let short = shrink(&mut faulty, &failure.recorded, &options(5), 400).unwrap();
        // ddmin removes chunks and single calls; it does not rewrite the paths that make a
        // later call depend on an earlier one, so a few more calls than the three of the
        // hand-made case (two names, the rename) may stay.
        assert!(
            short.len() <= 12 && short.len() < failure.recorded.len(),
            "{}",
            reproduction(&short)
        );
        assert!(replay(faulty().unwrap().as_mut(), &short, &options(5)).is_err());
        let last = short.last().unwrap();
        assert!(
            matches!(
                last,
                Operation::Rename {
                    flag: RenameFlag::NoReplace,
                    ..
                }
            ),
            "{}",
            reproduction(&short)
        );
    }
}
