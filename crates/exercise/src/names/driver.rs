//! The run: workers, batches, the check of every call, and the report or the failure.
//!
//! **Serial mode** (the default). The model sits behind one lock. A worker takes the lock,
//! picks an operation with its own seeded random stream (guided by the model, so most paths
//! exist and collisions are frequent), runs it on its target, compares the result (success or
//! the errno) with what the model computes, `lstat`s the names it touched, updates the model
//! and lets go. Every call is thus checked exactly, also when the workers' targets are
//! different mounts of one cluster: a mount that still shows a name another mount just removed
//! fails at its next call on that name.
//!
//! **Concurrent mode.** Workers run free; a call is only checked to give success or one of the
//! errnos its kind can give, and each worker's model is a guide for choosing paths. At the
//! end of a batch the walks of all targets must agree with each other, and the model is
//! rebuilt from the first.
//!
//! In both modes a batch ends with every worker at a gate; then every target walks the whole
//! tree ([`super::walk`]), and the walks must match the model (serial) and each other.
//! `RENAME_WHITEOUT` may be refused (`EINVAL`, `EPERM`, `EOPNOTSUPP`): the first time the
//! model expects success, what the target does is recorded, and it must do the same after.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::choose::{Chooser, WEIGHTS};
use super::model::{Expected, InodeLabel, Model};
use super::options::NamesOptions;
use super::walk::{difference, model_from_walk, remove_tree, walk_model, walk_target, Snapshot};
use super::{errno_name, perform, result_text, Errno, NamesTarget, Operation, OperationKind};

/// One operation as run, for a failure's history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    /// Order among all workers' operations (serial mode: the order they ran in).
    pub sequence: u64,
    pub worker: usize,
    /// The worker's own operation number, from 1.
    pub number: u64,
    pub operation: Operation,
    pub result: Result<(), Errno>,
}

impl fmt::Display for HistoryEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] worker {} #{}: {} = {}",
            self.sequence,
            self.worker,
            self.number,
            self.operation,
            result_text(self.result)
        )
    }
}

/// How a run went.
#[derive(Clone, Debug, Default)]
pub struct NamesReport {
    pub operations: u64,
    pub batches: u64,
    pub elapsed: Duration,
    /// Per kind: calls that succeeded and calls that failed (as the model said).
    pub counts: BTreeMap<OperationKind, (u64, u64)>,
    /// Per target: what it does with `RENAME_WHITEOUT` (if it was asked).
    pub whiteouts: Vec<(String, String)>,
    /// Per target: kinds it does not support, never asked of it.
    pub unsupported: Vec<(String, Vec<OperationKind>)>,
    /// Names in the tree at the last walk.
    pub final_names: usize,
    /// Calls refused with ESTALE in concurrent mode: across mounts, a directory another
    /// mount moved while one of this mount's renames ran (docs/consistency.md).
    pub stale_lookups: u64,
}

impl fmt::Display for NamesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rate = self.operations as f64 / self.elapsed.as_secs_f64().max(1e-9);
        writeln!(
            f,
            "{} operations in {:.1} s ({rate:.0}/s), {} batches, every call and walk matched; {} names at the last walk",
            self.operations,
            self.elapsed.as_secs_f64(),
            self.batches,
            self.final_names
        )?;
        let counts: Vec<String> = self
            .counts
            .iter()
            .map(|(kind, (succeeded, failed))| format!("{kind:?} {succeeded}/{failed}"))
            .collect();
        write!(f, "  succeeded/failed: {}", counts.join(", "))?;
        for (target, behaviour) in &self.whiteouts {
            write!(f, "\n  RENAME_WHITEOUT on {target}: {behaviour}")?;
        }
        for (target, kinds) in &self.unsupported {
            write!(f, "\n  not supported on {target}, skipped: {kinds:?}")?;
        }
        if self.stale_lookups > 0 {
            write!(
                f,
                "\n  refused with ESTALE (a directory moved by another mount during a rename): {}",
                self.stale_lookups
            )?;
        }
        Ok(())
    }
}

/// Why a run stopped.
#[derive(Clone, Debug)]
pub struct NamesFailure {
    pub seed: u64,
    /// The worker whose call or walk failed (`None`: a comparison of walks).
    pub worker: Option<usize>,
    pub target: String,
    /// The worker's operation number, for a failed call.
    pub operation_number: Option<u64>,
    pub operation: Option<Operation>,
    pub expected: String,
    pub found: String,
    /// The last operations of every worker touching the names involved, in sequence order.
    pub history: Vec<HistoryEntry>,
    /// Serial mode: every operation run, in the order run (what [`super::shrink`] cuts down).
    pub recorded: Vec<Operation>,
}

impl fmt::Display for NamesFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {}", self.seed)?;
        if let Some(worker) = self.worker {
            write!(f, ", worker {worker}")?;
        }
        if let Some(number) = self.operation_number {
            write!(f, ", operation #{number}")?;
        }
        if let Some(operation) = &self.operation {
            write!(f, ": {operation}")?;
        }
        write!(
            f,
            " (on {})\n  expected: {}\n  found:    {}",
            self.target, self.expected, self.found
        )?;
        if !self.history.is_empty() {
            write!(f, "\nlast operations touching these names:")?;
            for entry in &self.history {
                write!(f, "\n  {entry}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for NamesFailure {}

/// Errnos that refuse `RENAME_WHITEOUT` as a whole (FUSE without rename2, no `CAP_MKNOD`,
/// a file system without whiteouts).
const WHITEOUT_REFUSALS: [Errno; 4] = [libc::EINVAL, libc::EPERM, libc::EOPNOTSUPP, libc::ENOSYS];

/// What a target does with `RENAME_WHITEOUT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WhiteoutBehaviour {
    NotSeen,
    Accepted,
    Refused(Errno),
}

impl fmt::Display for WhiteoutBehaviour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WhiteoutBehaviour::NotSeen => write!(f, "never expected to succeed"),
            WhiteoutBehaviour::Accepted => write!(f, "accepted (leaves a whiteout)"),
            WhiteoutBehaviour::Refused(errno) => write!(f, "refused with {}", errno_name(*errno)),
        }
    }
}

/// Whether `result` is what the model `expected` of `operation`: `Ok(true)` when the model is
/// to be changed, `Err((expected, found))` as text when it is not what the model said.
/// `RENAME_WHITEOUT` may be refused, consistently (`whiteout` records how), but not onto
/// another name of the same file (`onto_itself`): the kernel answers that one itself.
pub(super) fn judge(
    operation: &Operation,
    expected: Expected,
    result: Result<(), Errno>,
    whiteout: &mut WhiteoutBehaviour,
    onto_itself: bool,
) -> Result<bool, (String, String)> {
    let mismatch = |expected: String| Err((expected, result_text(result)));
    if operation.kind() != OperationKind::RenameWhiteout || onto_itself {
        return match (expected, result) {
            (Expected::Success, Ok(())) => Ok(true),
            (Expected::Failure(wanted), Err(errno))
                if Model::equivalent(operation, wanted, errno) =>
            {
                Ok(false)
            }
            (Expected::Success, _) => mismatch("ok".into()),
            (Expected::Failure(wanted), _) => mismatch(errno_name(wanted)),
        };
    }
    let behaviour = *whiteout;
    match (expected, result) {
        (Expected::Success, Ok(())) => {
            if let WhiteoutBehaviour::Refused(errno) = behaviour {
                return mismatch(format!("{} (as before)", errno_name(errno)));
            }
            *whiteout = WhiteoutBehaviour::Accepted;
            Ok(true)
        }
        (Expected::Success, Err(errno)) if WHITEOUT_REFUSALS.contains(&errno) => match behaviour {
            WhiteoutBehaviour::Accepted => mismatch("ok (as before)".into()),
            WhiteoutBehaviour::Refused(before) if before != errno => {
                mismatch(format!("{} (as before)", errno_name(before)))
            }
            _ => {
                *whiteout = WhiteoutBehaviour::Refused(errno);
                Ok(false)
            }
        },
        (Expected::Failure(wanted), Err(errno))
            if errno == wanted
                || (WHITEOUT_REFUSALS.contains(&errno)
                    && behaviour != WhiteoutBehaviour::Accepted) =>
        {
            Ok(false)
        }
        (Expected::Success, _) => mismatch("ok or a refusal".into()),
        (Expected::Failure(wanted), _) => mismatch(errno_name(wanted)),
    }
}

/// The errnos a call of `kind` can give when other workers change the tree meanwhile.
fn possible_errnos(kind: OperationKind) -> &'static [Errno] {
    use libc::*;
    match kind {
        OperationKind::Create
        | OperationKind::MakeDirectory
        | OperationKind::Symlink
        | OperationKind::MakeFifo => &[ENOENT, ENOTDIR, EEXIST],
        OperationKind::RemoveDirectory => &[ENOENT, ENOTDIR, ENOTEMPTY],
        OperationKind::Unlink => &[ENOENT, ENOTDIR, EISDIR],
        OperationKind::Link => &[ENOENT, ENOTDIR, EEXIST, EPERM],
        OperationKind::Rename | OperationKind::RenameNoReplace | OperationKind::RenameExchange => {
            &[ENOENT, ENOTDIR, EEXIST, EISDIR, ENOTEMPTY, EINVAL]
        }
        OperationKind::RenameWhiteout => &[
            ENOENT, ENOTDIR, EEXIST, EISDIR, ENOTEMPTY, EINVAL, EPERM, EOPNOTSUPP, ENOSYS,
        ],
        OperationKind::ChangeMode | OperationKind::ChangeOwner | OperationKind::SetTimes => {
            &[ENOENT, ENOTDIR]
        }
        OperationKind::SetXattr => &[ENOENT, ENOTDIR, EPERM, EEXIST, ENODATA],
        OperationKind::RemoveXattr => &[ENOENT, ENOTDIR, EPERM, ENODATA],
        OperationKind::Truncate => &[ENOENT, ENOTDIR, EISDIR, EINVAL],
        OperationKind::Write => &[ENOENT, ENOTDIR, EISDIR, ENXIO, EACCES, EPERM],
    }
}

/// A target's inode numbers for the model's labels, checked as names are seen: a name keeps
/// its inode number, and two live inodes never share one.
#[derive(Default)]
pub struct InodeNumbers {
    by_label: HashMap<InodeLabel, u64>,
    by_number: HashMap<u64, InodeLabel>,
}

impl InodeNumbers {
    pub fn check(
        &mut self,
        model: &Model,
        label: InodeLabel,
        number: u64,
        path: &str,
    ) -> Result<(), String> {
        if let Some(&known) = self.by_label.get(&label) {
            if known != number {
                return Err(format!(
                    "{path:?} was inode {known} and is now inode {number} (no call replaced it)"
                ));
            }
        }
        if let Some(&other) = self.by_number.get(&number) {
            if other != label && model.is_live(other) {
                self.by_label.remove(&other);
            }
        }
        self.by_label.insert(label, number);
        self.by_number.insert(number, label);
        Ok(())
    }

    pub fn reset(&mut self, numbers: HashMap<InodeLabel, u64>) {
        self.by_number = numbers
            .iter()
            .map(|(label, number)| (*number, *label))
            .collect();
        self.by_label = numbers;
    }
}

/// `lstat` every name `operation` names on `target` and compare with the model.
pub fn check_touched(
    target: &mut dyn NamesTarget,
    model: &Model,
    numbers: &mut InodeNumbers,
    operation: &Operation,
) -> Result<(), (String, String)> {
    for path in operation.paths() {
        let Ok(found_label) = model.lookup(path) else {
            continue;
        };
        let status = target.status(path);
        let Some(label) = found_label else {
            if let Ok(status) = status {
                return Err((
                    format!("lstat of {path:?}: ENOENT"),
                    format!("{:?} inode {}", status.kind, status.inode_number),
                ));
            }
            continue;
        };
        let node = model.node(label).ok_or_else(|| {
            (
                format!("{path:?} in the model"),
                "a name without an inode".to_string(),
            )
        })?;
        let status = status.map_err(|errno| {
            (
                format!("lstat of {path:?}: a {:?}", node.kind()),
                errno_name(errno),
            )
        })?;
        let expected = (
            node.kind(),
            node.permissions,
            model.link_count(label),
            node.user_id,
            node.group_id,
        );
        let found = (
            status.kind,
            status.permissions,
            status.link_count,
            status.user_id,
            status.group_id,
        );
        let size_differs = model
            .size_bytes(label)
            .is_some_and(|size| size != status.size_bytes);
        if expected != found || size_differs {
            return Err((
                format!(
                    "lstat of {path:?}: {:?} mode {:04o} links {} owner {}:{} size {:?}",
                    expected.0,
                    expected.1,
                    expected.2,
                    expected.3,
                    expected.4,
                    model.size_bytes(label)
                ),
                format!(
                    "{:?} mode {:04o} links {} owner {}:{} size {}",
                    found.0, found.1, found.2, found.3, found.4, status.size_bytes
                ),
            ));
        }
        numbers
            .check(model, label, status.inode_number, path)
            .map_err(|text| (format!("{path:?} keeps its inode number"), text))?;
    }
    Ok(())
}

/// What the model lock guards in serial mode.
struct State {
    model: Model,
    sequence: u64,
    recorded: Vec<Operation>,
}

/// A gate every worker waits at; one that stops (a panic) opens it for good, so the others
/// stop too instead of waiting forever.
struct Gate {
    state: Mutex<(usize, u64, bool)>,
    condition: Condvar,
    parties: usize,
}

impl Gate {
    fn new(parties: usize) -> Gate {
        Gate {
            state: Mutex::new((0, 0, false)),
            condition: Condvar::new(),
            parties,
        }
    }

    /// Wait for every worker; false if the gate was broken.
    fn wait(&self) -> bool {
        let mut state = lock(&self.state);
        if state.2 {
            return false;
        }
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            state.0 = 0;
            state.1 += 1;
            self.condition.notify_all();
            return true;
        }
        while state.1 == generation && !state.2 {
            state = self
                .condition
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        !state.2
    }

    fn break_open(&self) {
        lock(&self.state).2 = true;
        self.condition.notify_all();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Everything the workers share.
struct Shared<'a> {
    options: &'a NamesOptions,
    state: Mutex<State>,
    histories: Vec<Mutex<VecDeque<HistoryEntry>>>,
    sequence: AtomicU64,
    stop: AtomicBool,
    failure: Mutex<Option<NamesFailure>>,
    walks: Mutex<Vec<Option<Snapshot>>>,
    descriptions: Vec<String>,
    gate: Gate,
    counts: Mutex<BTreeMap<OperationKind, (u64, u64)>>,
    final_names: AtomicU64,
    /// Calls of concurrent mode refused with ESTALE (see `concurrent_step`).
    stale_lookups: AtomicU64,
}

/// A failure before it gets its history.
struct Found {
    worker: Option<usize>,
    target: String,
    operation_number: Option<u64>,
    operation: Option<Operation>,
    expected: String,
    found: String,
    /// Paths whose history is shown.
    paths: Vec<String>,
}

/// Whether two relative paths are one, or one holds the other.
fn related(first: &str, second: &str) -> bool {
    let within = |inner: &str, outer: &str| {
        inner == outer || outer.is_empty() || inner.starts_with(&format!("{outer}/"))
    };
    within(first, second) || within(second, first)
}

impl Shared<'_> {
    fn fail(&self, found: Box<Found>) {
        let found = *found;
        let mut history: Vec<HistoryEntry> = Vec::new();
        for worker_history in &self.histories {
            let worker_history = lock(worker_history);
            let mut touching: Vec<HistoryEntry> =
                worker_history
                    .iter()
                    .rev()
                    .filter(|entry| {
                        found.paths.is_empty()
                            || entry.operation.paths().iter().any(|path| {
                                found.paths.iter().any(|involved| related(path, involved))
                            })
                    })
                    .take(self.options.history_per_worker)
                    .cloned()
                    .collect();
            touching.reverse();
            history.extend(touching);
        }
        history.sort_by_key(|entry| entry.sequence);
        let recorded = if self.options.concurrent {
            Vec::new()
        } else {
            lock(&self.state).recorded.clone()
        };
        let failure = NamesFailure {
            seed: self.options.seed,
            worker: found.worker,
            target: found.target,
            operation_number: found.operation_number,
            operation: found.operation,
            expected: found.expected,
            found: found.found,
            history,
            recorded,
        };
        let mut slot = lock(&self.failure);
        if slot.is_none() {
            *slot = Some(failure);
        }
        self.stop.store(true, Ordering::SeqCst);
    }

    fn remember(&self, entry: HistoryEntry) {
        if self.options.trace {
            eprintln!("{entry}");
        }
        let mut history = lock(&self.histories[entry.worker]);
        if history.len() >= self.options.history_per_worker.max(1) * 4 {
            history.pop_front();
        }
        history.push_back(entry);
    }

    fn count(&self, kind: OperationKind, result: Result<(), Errno>) {
        let mut counts = lock(&self.counts);
        let (succeeded, failed) = counts.entry(kind).or_default();
        if result.is_ok() {
            *succeeded += 1;
        } else {
            *failed += 1;
        }
    }
}

/// One worker: its target, its random stream, what it learned of its target.
struct Worker {
    index: usize,
    target: Box<dyn NamesTarget + Send>,
    chooser: Chooser,
    numbers: InodeNumbers,
    whiteout: WhiteoutBehaviour,
    /// Concurrent mode: the tree as this worker last knew it, to choose paths.
    guide: Model,
    done: u64,
}

impl Worker {
    fn found(&self, operation: &Operation, expected: String, found: String) -> Box<Found> {
        Box::new(Found {
            worker: Some(self.index),
            target: self.target.describe(),
            operation_number: Some(self.done),
            operation: Some(operation.clone()),
            expected,
            found,
            paths: operation
                .paths()
                .iter()
                .map(|path| path.to_string())
                .collect(),
        })
    }

    /// One operation in serial mode, under the model's lock.
    fn serial_step(&mut self, shared: &Shared) -> Result<(), Box<Found>> {
        let mut state = lock(&shared.state);
        self.done += 1;
        let operation = self.chooser.choose(&state.model, self.done);
        let expected = state.model.expect(&operation);
        let result = perform(self.target.as_mut(), &operation);
        let sequence = state.sequence;
        state.sequence += 1;
        state.recorded.push(operation.clone());
        shared.remember(HistoryEntry {
            sequence,
            worker: self.index,
            number: self.done,
            operation: operation.clone(),
            result,
        });
        shared.count(operation.kind(), result);
        let onto_itself = state.model.renames_onto_itself(&operation);
        let apply = judge(
            &operation,
            expected,
            result,
            &mut self.whiteout,
            onto_itself,
        )
        .map_err(|(expected, found)| self.found(&operation, expected, found))?;
        if apply {
            state.model.apply(&operation, self.target.creator());
            check_touched(
                self.target.as_mut(),
                &state.model,
                &mut self.numbers,
                &operation,
            )
            .map_err(|(expected, found)| self.found(&operation, expected, found))?;
        }
        Ok(())
    }

    /// One operation in concurrent mode: only the kinds of errno are checked.
    fn concurrent_step(&mut self, shared: &Shared) -> Result<(), Box<Found>> {
        self.done += 1;
        let operation = self.chooser.choose(&self.guide, self.done);
        let result = perform(self.target.as_mut(), &operation);
        shared.remember(HistoryEntry {
            sequence: shared.sequence.fetch_add(1, Ordering::SeqCst),
            worker: self.index,
            number: self.done,
            operation: operation.clone(),
            result,
        });
        shared.count(operation.kind(), result);
        let possible = possible_errnos(operation.kind());
        if let Err(errno) = result {
            if errno == libc::ESTALE {
                // A directory another mount moved meanwhile, which this mount's kernel still
                // holds at its old place while one of its own renames runs: the kernel
                // cannot move it to the new place then and refuses the lookup (see
                // `stale_lookups` in the report, and docs/consistency.md). The call did
                // nothing.
                shared.stale_lookups.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            if !possible.contains(&errno) {
                let names: Vec<String> = possible.iter().map(|errno| errno_name(*errno)).collect();
                return Err(self.found(
                    &operation,
                    format!("ok or one of {}", names.join(", ")),
                    errno_name(errno),
                ));
            }
        }
        if result.is_ok() && self.guide.expect(&operation) == Expected::Success {
            self.guide.apply(&operation, self.target.creator());
        }
        Ok(())
    }

    /// Walk this target at the end of a batch; in serial mode compare with the model.
    fn walk(&mut self, shared: &Shared) -> Result<Snapshot, Box<Found>> {
        let describe = self.target.describe();
        let walk_failure = |text: String| Found {
            worker: Some(self.index),
            target: describe.clone(),
            operation_number: None,
            operation: None,
            expected: "a consistent tree".into(),
            found: text,
            paths: Vec::new(),
        };
        let snapshot =
            walk_target(self.target.as_mut()).map_err(|text| Box::new(walk_failure(text)))?;
        if !shared.options.concurrent {
            let state = lock(&shared.state);
            let expected = walk_model(&state.model);
            if let Some(text) = difference(&expected, &snapshot, "the model", &describe, false) {
                let paths = text
                    .split('"')
                    .nth(1)
                    .map(|path| vec![path.to_string()])
                    .unwrap_or_default();
                return Err(Box::new(Found {
                    paths,
                    expected: "the tree the model holds".into(),
                    ..walk_failure(text)
                }));
            }
            for (path, walked) in &snapshot.names {
                let Ok(Some(label)) = state.model.lookup(path) else {
                    continue;
                };
                self.numbers
                    .check(&state.model, label, walked.inode_number, path)
                    .map_err(|text| Box::new(walk_failure(text)))?;
            }
        }
        Ok(snapshot)
    }
}

/// Run one worker's share of every batch.
fn work(worker: &mut Worker, shared: &Shared, shares: &[u64]) {
    for (batch, share) in shares.iter().enumerate() {
        for _ in 0..*share {
            if shared.stop.load(Ordering::SeqCst) {
                break;
            }
            let step = if shared.options.concurrent {
                worker.concurrent_step(shared)
            } else {
                worker.serial_step(shared)
            };
            if let Err(found) = step {
                shared.fail(found);
            }
        }
        if !shared.gate.wait() {
            return;
        }
        if !shared.stop.load(Ordering::SeqCst) {
            match worker.walk(shared) {
                Ok(snapshot) => lock(&shared.walks)[worker.index] = Some(snapshot),
                Err(found) => shared.fail(found),
            }
        }
        if !shared.gate.wait() {
            return;
        }
        if worker.index == 0 && !shared.stop.load(Ordering::SeqCst) {
            compare_walks(shared, batch + 1 == shares.len());
        }
        if !shared.gate.wait() {
            return;
        }
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        if shared.options.concurrent {
            let state = lock(&shared.state);
            worker.guide = state.model.clone();
        }
    }
}

/// The leader's part of a batch's end: every walk must equal the first; concurrent mode
/// then takes the first walk as its model.
fn compare_walks(shared: &Shared, last: bool) {
    let walks = lock(&shared.walks).clone();
    let Some(Some(first)) = walks.first() else {
        return;
    };
    for (index, walk) in walks.iter().enumerate().skip(1) {
        let Some(walk) = walk else { continue };
        if let Some(text) = difference(
            first,
            walk,
            &shared.descriptions[0],
            &shared.descriptions[index],
            shared.options.same_inode_numbers,
        ) {
            shared.fail(Box::new(Found {
                worker: Some(index),
                target: shared.descriptions[index].clone(),
                operation_number: None,
                operation: None,
                expected: format!("the tree {} shows", shared.descriptions[0]),
                paths: text
                    .split('"')
                    .nth(1)
                    .map(|path| vec![path.to_string()])
                    .unwrap_or_default(),
                found: text,
            }));
            return;
        }
    }
    shared
        .final_names
        .store(first.names.len() as u64, Ordering::SeqCst);
    if shared.options.concurrent && !last {
        let (model, _) = model_from_walk(first);
        lock(&shared.state).model = model;
    }
}

/// Each batch's share of one worker.
fn shares_of(options: &NamesOptions, workers: usize, worker: usize) -> Vec<u64> {
    let batch = options.batch_operations.max(1);
    let mut shares = Vec::new();
    let mut left = options.operations;
    while left > 0 {
        let this_batch = left.min(batch);
        let base = this_batch / workers as u64;
        let extra = u64::from((worker as u64) < this_batch % workers as u64);
        shares.push(base + extra);
        left -= this_batch;
    }
    if shares.is_empty() {
        shares.push(0);
    }
    shares
}

/// Clear the tree through the first target, then check every target lists the root empty.
fn clear(
    targets: &mut [Box<dyn NamesTarget + Send>],
    options: &NamesOptions,
) -> Result<(), Box<NamesFailure>> {
    let failure = |target: String, text: String| {
        Box::new(NamesFailure {
            seed: options.seed,
            worker: None,
            target,
            operation_number: None,
            operation: None,
            expected: "an empty tree after removing everything".into(),
            found: text,
            history: Vec::new(),
            recorded: Vec::new(),
        })
    };
    let first = &mut targets[0];
    remove_tree(first.as_mut()).map_err(|text| failure(first.describe(), text))?;
    for target in targets.iter_mut() {
        let listed = target.read_directory("").map_err(|errno| {
            failure(
                target.describe(),
                format!("readdir of the root: {}", errno_name(errno)),
            )
        })?;
        if let Some(entry) = listed.first() {
            return Err(failure(
                target.describe(),
                format!("{:?} is still listed", entry.name),
            ));
        }
    }
    Ok(())
}

/// Run the exerciser: one worker per target, all showing one tree (mounts of one cluster, or
/// the same directory). The tree is emptied first, through the first target.
pub fn run(
    targets: Vec<Box<dyn NamesTarget + Send>>,
    options: &NamesOptions,
) -> Result<NamesReport, Box<NamesFailure>> {
    let mut targets = targets;
    assert!(!targets.is_empty(), "the exerciser needs a target");
    let started = Instant::now();
    clear(&mut targets, options)?;
    let descriptions: Vec<String> = targets.iter().map(|target| target.describe()).collect();
    let unsupported: Vec<(String, Vec<OperationKind>)> = targets
        .iter()
        .filter_map(|target| {
            let kinds: Vec<OperationKind> = WEIGHTS
                .iter()
                .map(|(kind, _)| *kind)
                .filter(|kind| !target.supports(*kind))
                .collect();
            (!kinds.is_empty()).then(|| (target.describe(), kinds))
        })
        .collect();
    let workers_count = targets.len();
    let mut workers: Vec<Worker> = targets
        .into_iter()
        .enumerate()
        .map(|(index, target)| {
            let chooser = Chooser::new(options, index, target.creator(), |kind| {
                target.supports(kind)
            });
            Worker {
                index,
                target,
                chooser,
                numbers: InodeNumbers::default(),
                whiteout: WhiteoutBehaviour::NotSeen,
                guide: Model::new(),
                done: 0,
            }
        })
        .collect();
    let shared = Shared {
        options,
        state: Mutex::new(State {
            model: Model::new(),
            sequence: 0,
            recorded: Vec::new(),
        }),
        histories: (0..workers_count)
            .map(|_| Mutex::new(VecDeque::new()))
            .collect(),
        sequence: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        failure: Mutex::new(None),
        walks: Mutex::new(vec![None; workers_count]),
        descriptions: descriptions.clone(),
        gate: Gate::new(workers_count),
        counts: Mutex::new(BTreeMap::new()),
        final_names: AtomicU64::new(0),
        stale_lookups: AtomicU64::new(0),
    };
    std::thread::scope(|scope| {
        for worker in workers.iter_mut() {
            let shared = &shared;
            let shares = shares_of(options, workers_count, worker.index);
            scope.spawn(move || {
                let outcome =
                    std::panic::catch_unwind(AssertUnwindSafe(|| work(worker, shared, &shares)));
                if let Err(panic) = outcome {
                    let text = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                        .unwrap_or_default();
                    shared.fail(Box::new(Found {
                        worker: Some(worker.index),
                        target: worker.target.describe(),
                        operation_number: Some(worker.done),
                        operation: None,
                        expected: "no panic".into(),
                        found: format!("the worker panicked: {text}"),
                        paths: Vec::new(),
                    }));
                    shared.gate.break_open();
                }
            });
        }
    });
    if let Some(failure) = lock(&shared.failure).take() {
        return Err(Box::new(failure));
    }
    let whiteouts = workers
        .iter()
        .filter(|worker| worker.whiteout != WhiteoutBehaviour::NotSeen)
        .map(|worker| (worker.target.describe(), worker.whiteout.to_string()))
        .collect();
    let mut targets: Vec<Box<dyn NamesTarget + Send>> =
        workers.into_iter().map(|worker| worker.target).collect();
    if options.remove_at_end {
        clear(&mut targets, options)?;
    }
    let counts = lock(&shared.counts).clone();
    Ok(NamesReport {
        operations: counts
            .values()
            .map(|(succeeded, failed)| succeeded + failed)
            .sum(),
        batches: shares_of(options, workers_count, 0).len() as u64,
        elapsed: started.elapsed(),
        counts,
        whiteouts,
        unsupported,
        final_names: shared.final_names.load(Ordering::SeqCst) as usize,
        stale_lookups: shared.stale_lookups.load(Ordering::SeqCst),
    })
}
