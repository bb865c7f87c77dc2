//! Choosing the next operation: a worker's own seeded random stream, guided by a model of
//! the tree so that most paths exist and names collide often.
//!
//! Names come from a small set (`d0`.. mostly for directories, `f0`.. mostly for the rest):
//! a parent is mostly a directory the model has (no deeper than `depth_max`), sometimes the
//! root, sometimes a made-up path that may not exist or runs through a file; the name acted
//! on is mostly one that exists. Symlinks always say `nowhere/...`, which never exists (the
//! model takes every symlink to dangle).

use super::model::Model;
use super::options::NamesOptions;
use super::{Creator, NodeKind, Operation, OperationKind, RenameFlag, XattrHow};
use crate::random::SplitMix64;

/// How often each kind is picked (rename flags are kinds of their own).
pub const WEIGHTS: [(OperationKind, u64); 18] = [
    (OperationKind::Create, 12),
    (OperationKind::MakeDirectory, 9),
    (OperationKind::RemoveDirectory, 6),
    (OperationKind::Unlink, 8),
    (OperationKind::Link, 6),
    (OperationKind::Symlink, 3),
    (OperationKind::MakeFifo, 2),
    (OperationKind::Rename, 12),
    (OperationKind::RenameNoReplace, 5),
    (OperationKind::RenameExchange, 7),
    (OperationKind::RenameWhiteout, 2),
    (OperationKind::ChangeMode, 3),
    (OperationKind::ChangeOwner, 2),
    (OperationKind::SetTimes, 2),
    (OperationKind::SetXattr, 4),
    (OperationKind::RemoveXattr, 2),
    (OperationKind::Truncate, 3),
    (OperationKind::Write, 5),
];

/// Picks operations: a worker's random stream, guided by a model of the tree.
pub struct Chooser {
    random: SplitMix64,
    weights: Vec<(OperationKind, u64)>,
    worker: usize,
    creator: Creator,
    options: NamesOptions,
}

impl Chooser {
    /// The chooser of `worker`, asking only kinds `supports` allows.
    pub fn new(
        options: &NamesOptions,
        worker: usize,
        creator: Creator,
        supports: impl Fn(OperationKind) -> bool,
    ) -> Chooser {
        let stream = options
            .seed
            .wrapping_mul(0x2545_f491_4f6c_dd1d)
            .wrapping_add(worker as u64);
        Chooser {
            random: SplitMix64::new(stream),
            weights: WEIGHTS
                .iter()
                .copied()
                .filter(|(kind, _)| supports(*kind))
                .collect(),
            worker,
            creator,
            options: options.clone(),
        }
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.random.below(items.len() as u64) as usize])
    }

    fn leaf(&mut self, directory_like: bool) -> String {
        let directory_name = self.random.chance(4, 5) == directory_like;
        if directory_name {
            format!(
                "d{}",
                self.random
                    .below(self.options.directory_names.max(1) as u64)
            )
        } else {
            format!(
                "f{}",
                self.random.below(self.options.file_names.max(1) as u64)
            )
        }
    }

    /// A parent directory: mostly one the model has (not deeper than the bound), sometimes
    /// a made-up path that may not exist or run through a file.
    fn parent(&mut self, directories: &[String]) -> String {
        if self.random.chance(1, 12) {
            let depth = 1 + self.random.below(self.options.depth_max.max(1) as u64);
            let parts: Vec<String> = (0..depth)
                .map(|_| {
                    let directory_like = !self.random.chance(1, 4);
                    self.leaf(directory_like)
                })
                .collect();
            return parts.join("/");
        }
        if self.random.chance(1, 4) {
            return String::new();
        }
        self.pick(directories).cloned().unwrap_or_default()
    }

    fn fresh(&mut self, directories: &[String], directory_like: bool) -> String {
        let parent = self.parent(directories);
        let leaf = self.leaf(directory_like);
        if parent.is_empty() {
            leaf
        } else {
            format!("{parent}/{leaf}")
        }
    }

    /// Mostly a name that exists (of `preferred` when given and found), else a fresh one.
    fn existing(
        &mut self,
        names: &[(String, NodeKind)],
        directories: &[String],
        preferred: Option<NodeKind>,
    ) -> String {
        if self.random.chance(3, 4) {
            if let Some(kind) = preferred {
                if self.random.chance(2, 3) {
                    let of_kind: Vec<&String> = names
                        .iter()
                        .filter(|(_, found)| *found == kind)
                        .map(|(path, _)| path)
                        .collect();
                    if let Some(path) = self.pick(&of_kind) {
                        return (*path).clone();
                    }
                }
            }
            if let Some((path, _)) = self.pick(names) {
                return path.clone();
            }
        }
        self.fresh(directories, preferred == Some(NodeKind::Directory))
    }

    fn choose_kind(&mut self) -> OperationKind {
        let total: u64 = self.weights.iter().map(|(_, weight)| weight).sum();
        let mut pick = self.random.below(total.max(1));
        for (kind, weight) in &self.weights {
            if pick < *weight {
                return *kind;
            }
            pick -= weight;
        }
        OperationKind::Create
    }

    /// The next operation, `number` being the worker's count (it tells written bytes apart).
    pub fn choose(&mut self, model: &Model, number: u64) -> Operation {
        let all = model.names();
        let names: Vec<(String, NodeKind)> = all
            .iter()
            .filter_map(|(path, label, _)| Some((path.clone(), model.node(*label)?.kind())))
            .collect();
        let directories: Vec<String> = all
            .iter()
            .filter(|(_, label, depth)| {
                *depth < self.options.depth_max
                    && model
                        .node(*label)
                        .is_some_and(|node| node.kind() == NodeKind::Directory)
            })
            .map(|(path, _, _)| path.clone())
            .collect();
        let kind = self.choose_kind();
        let value = |number: u64, worker: usize| format!("w{worker}n{number}").into_bytes();
        match kind {
            OperationKind::Create => Operation::Create {
                path: self.fresh(&directories, false),
            },
            OperationKind::MakeDirectory => Operation::MakeDirectory {
                path: self.fresh(&directories, true),
            },
            OperationKind::MakeFifo => Operation::MakeFifo {
                path: self.fresh(&directories, false),
            },
            OperationKind::Symlink => {
                let path = self.fresh(&directories, false);
                let leaf = self.leaf(false);
                Operation::Symlink {
                    path,
                    contents: format!("nowhere/{leaf}"),
                }
            }
            OperationKind::RemoveDirectory => Operation::RemoveDirectory {
                path: self.existing(&names, &directories, Some(NodeKind::Directory)),
            },
            OperationKind::Unlink => Operation::Unlink {
                path: self.existing(&names, &directories, Some(NodeKind::Regular)),
            },
            OperationKind::Link => {
                let source = self.existing(&names, &directories, Some(NodeKind::Regular));
                let target = if self.random.chance(1, 5) {
                    self.existing(&names, &directories, None)
                } else {
                    self.fresh(&directories, false)
                };
                Operation::Link { source, target }
            }
            OperationKind::Rename
            | OperationKind::RenameNoReplace
            | OperationKind::RenameExchange
            | OperationKind::RenameWhiteout => {
                let flag = match kind {
                    OperationKind::RenameNoReplace => RenameFlag::NoReplace,
                    OperationKind::RenameExchange => RenameFlag::Exchange,
                    OperationKind::RenameWhiteout => RenameFlag::Whiteout,
                    _ => RenameFlag::None,
                };
                let preferred = self.random.chance(1, 2).then_some(NodeKind::Directory);
                let source = self.existing(&names, &directories, preferred);
                let target = if self.random.chance(1, 2) || flag == RenameFlag::Exchange {
                    self.existing(&names, &directories, preferred)
                } else {
                    self.fresh(&directories, preferred.is_some())
                };
                Operation::Rename {
                    source,
                    target,
                    flag,
                }
            }
            OperationKind::ChangeMode => Operation::ChangeMode {
                path: self.existing(&names, &directories, None),
                // Owners keep every right, so the tree stays usable for a user other than
                // root too.
                permissions: 0o700 | self.random.below(0o100) as u32,
            },
            OperationKind::ChangeOwner => {
                let path = self.existing(&names, &directories, None);
                let (user_id, group_id) = if self.creator.user_id == 0 {
                    let user_id = [0, 1000, 1001][self.random.below(3) as usize];
                    let group_id = [0, 1000, 1001][self.random.below(3) as usize];
                    (user_id, group_id)
                } else {
                    (self.creator.user_id, self.creator.group_id)
                };
                Operation::ChangeOwner {
                    path,
                    user_id,
                    group_id,
                }
            }
            OperationKind::SetTimes => Operation::SetTimes {
                path: self.existing(&names, &directories, None),
                seconds: 1_000_000_000 + self.random.below(1_000_000_000) as i64,
            },
            OperationKind::SetXattr => {
                let path = self.existing(&names, &directories, None);
                let name = format!("user.x{}", self.random.below(3));
                let how = [XattrHow::Any, XattrHow::CreateOnly, XattrHow::ReplaceOnly]
                    [self.random.below(3) as usize];
                Operation::SetXattr {
                    path,
                    name,
                    value: value(number, self.worker),
                    how,
                }
            }
            OperationKind::RemoveXattr => Operation::RemoveXattr {
                path: self.existing(&names, &directories, None),
                name: format!("user.x{}", self.random.below(3)),
            },
            OperationKind::Truncate => Operation::Truncate {
                path: self.existing(&names, &directories, Some(NodeKind::Regular)),
                size_bytes: self.random.below(48),
            },
            OperationKind::Write => {
                let path = self.existing(&names, &directories, Some(NodeKind::Regular));
                let offset = self.random.below(32);
                let mut data = value(number, self.worker);
                data.truncate(1 + self.random.below(8) as usize);
                Operation::Write { path, offset, data }
            }
        }
    }
}
