//! Creates answered before the meta server has them, in directories delegated to this
//! client (issue 10; CephFS's asynchronous creates under an exclusive directory capability).
//!
//! A `Mkdir` of a client that polls for revocations delegates the new directory to it
//! (`ReplyStamp::delegated`): while its names lease holds, no other client reads or changes
//! the directory's names without the meta server first recalling the delegation with a
//! revocation of those names. So a caller that knows every name there (the mount's
//! complete listing) may answer a create of a missing name at once, with an inode number
//! reserved beforehand (`ReserveInodes`), and send the create after it.
//!
//! [`Delegations`] keeps what that takes:
//! - which directories are delegated, per server epoch, and which were recalled;
//! - the creates answered and not yet answered by the meta server, by directory and by
//!   inode, so that whoever must see them waits: the acknowledgement of a recall (the
//!   revocation poll), and this client's own requests naming the directory or the file;
//! - reserved inode numbers ([`InodePool`]).
//!
//! A create may start ([`Delegations::begin`]) only in a delegated directory not recalled,
//! checked under the same lock the poll takes to mark a recall, so none starts after the
//! poll began to wait for those in flight. Every table is bounded: directories by the
//! meta server's grants (one per mkdir), creates in flight by `CREATES_IN_FLIGHT_MAX`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use freeflow_types::InodeId;
use tokio::sync::Notify;

/// Most creates answered ahead of the meta server at once; past it, creates wait for an
/// answer like any other (flow control).
pub const CREATES_IN_FLIGHT_MAX: usize = 1024;
/// Numbers asked for per `ReserveInodes`, and how few left start the next reservation.
pub const INODES_PER_RESERVATION: u32 = 1024;
pub const INODES_LOW_WATER: u64 = 256;
/// Most directories remembered as delegated (each is one mkdir of this client); past it
/// they are all forgotten.
pub const DELEGATED_DIRECTORIES_MAX: usize = 65_536;

#[derive(Default)]
struct Inner {
    /// The meta server epoch the delegations and reserved numbers belong to.
    epoch: u64,
    delegated: HashSet<InodeId>,
    /// Creates answered ahead, by directory.
    in_directory: HashMap<InodeId, usize>,
    /// Inodes of creates and unlinks answered ahead.
    in_flight: HashSet<InodeId>,
    /// Names whose unlink answered ahead is on its way: a create of one waits for it.
    unlinking: HashSet<(InodeId, String)>,
    /// The files of `unlinking`.
    unlinking_files: HashSet<InodeId>,
    /// Reserved numbers not used yet: ranges (next, end).
    reserved: VecDeque<(InodeId, InodeId)>,
    reserving: bool,
}

impl Inner {
    fn reset_if_new_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            // A new server: delegations died with the old one. Reserved numbers stay good
            // (no run gives them out again), but are dropped with the rest. Ops on their
            // way are sent again by the pool: those the old server answered are replayed
            // within the recovery window, the others after it (see docs/consistency.md).
            self.epoch = epoch;
            self.delegated.clear();
            self.reserved.clear();
        }
    }

    fn reserved_left(&self) -> u64 {
        self.reserved.iter().map(|(next, end)| end - next).sum()
    }
}

/// A create or an unlink answered ahead of the meta server: finished (or dropped) when its
/// answer arrived.
pub struct AheadOp {
    delegations: Arc<Delegations>,
    directory: InodeId,
    inode: InodeId,
    /// Set for an unlink: the name it removes.
    unlinked: Option<String>,
    done: bool,
}

impl AheadOp {
    /// The new file's number (a create), or the unlinked file's (an unlink).
    pub fn inode(&self) -> InodeId {
        self.inode
    }

    /// The meta server answered (a refusal is the caller's to report).
    pub fn finish(mut self) {
        self.done = true;
        self.delegations
            .end(self.directory, self.inode, self.unlinked.take());
    }
}

impl Drop for AheadOp {
    fn drop(&mut self) {
        if !self.done {
            self.delegations
                .end(self.directory, self.inode, self.unlinked.take());
        }
    }
}

/// See the module doc.
#[derive(Default)]
pub struct Delegations {
    inner: Mutex<Inner>,
    /// `inner.in_flight.len()`, read without the lock: every FUSE request of the mount
    /// asks whether something is unsettled, and almost always nothing is.
    in_flight: AtomicUsize,
    /// Woken when a create answered ahead gets its answer.
    landed: Notify,
}

impl Delegations {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `directory` was delegated to this client by the server of `epoch`.
    pub fn delegate(&self, epoch: u64, directory: InodeId) {
        let mut inner = self.inner();
        inner.reset_if_new_epoch(epoch);
        if inner.delegated.len() >= DELEGATED_DIRECTORIES_MAX {
            // Most are directories long gone (removed by this client, which recalls
            // nothing): forget them all; those still here just go the long way.
            inner.delegated.clear();
        }
        inner.delegated.insert(directory);
    }

    /// A revocation of `directory`'s names arrived (inode 0: everything, the server
    /// restarted): no create starts there any more.
    pub fn recall(&self, directory: InodeId) {
        let mut inner = self.inner();
        if directory == 0 {
            inner.delegated.clear();
        } else {
            inner.delegated.remove(&directory);
        }
    }

    /// Start a create of `name` in `directory` answered ahead, with a reserved number: None
    /// when the directory is not delegated in `epoch`, an unlink of the name is on its way,
    /// no number is left, or too many are in flight. The second value says whether more
    /// numbers should be reserved now.
    pub fn begin(
        self: &Arc<Self>,
        epoch: u64,
        directory: InodeId,
        name: &str,
    ) -> (Option<AheadOp>, bool) {
        let mut inner = self.inner();
        inner.reset_if_new_epoch(epoch);
        let reserve = !inner.reserving && inner.reserved_left() < INODES_LOW_WATER;
        if reserve {
            inner.reserving = true;
        }
        if !inner.delegated.contains(&directory)
            || inner.in_flight.len() >= CREATES_IN_FLIGHT_MAX
            || inner.unlinking.contains(&(directory, name.to_string()))
        {
            return (None, reserve);
        }
        let Some((next, end)) = inner.reserved.front_mut() else {
            return (None, reserve);
        };
        let inode = *next;
        *next += 1;
        if *next >= *end {
            inner.reserved.pop_front();
        }
        *inner.in_directory.entry(directory).or_insert(0) += 1;
        inner.in_flight.insert(inode);
        self.in_flight
            .store(inner.in_flight.len(), Ordering::Release);
        let ahead = AheadOp {
            delegations: Arc::clone(self),
            directory,
            inode,
            unlinked: None,
            done: false,
        };
        (Some(ahead), reserve)
    }

    /// Start an unlink of `name` (file `inode`) in `directory` answered ahead: None when the
    /// directory is not delegated in `epoch`, the file's own create or another request
    /// about it is still on its way, or too many are in flight.
    pub fn begin_unlink(
        self: &Arc<Self>,
        epoch: u64,
        directory: InodeId,
        name: &str,
        inode: InodeId,
    ) -> Option<AheadOp> {
        let mut inner = self.inner();
        let key = (directory, name.to_string());
        if inner.epoch != epoch
            || !inner.delegated.contains(&directory)
            || inner.in_flight.len() >= CREATES_IN_FLIGHT_MAX
            || inner.in_flight.contains(&inode)
            || inner.unlinking.contains(&key)
        {
            return None;
        }
        *inner.in_directory.entry(directory).or_insert(0) += 1;
        inner.in_flight.insert(inode);
        self.in_flight
            .store(inner.in_flight.len(), Ordering::Release);
        inner.unlinking.insert(key);
        inner.unlinking_files.insert(inode);
        Some(AheadOp {
            delegations: Arc::clone(self),
            directory,
            inode,
            unlinked: Some(name.to_string()),
            done: false,
        })
    }

    /// A reservation finished: its numbers, if the server of `epoch` gave them.
    pub fn reserved(&self, epoch: u64, range: Option<(InodeId, u32)>) {
        let mut inner = self.inner();
        inner.reserving = false;
        inner.reset_if_new_epoch(epoch);
        if let Some((first, count)) = range {
            inner.reserved.push_back((first, first + u64::from(count)));
        }
    }

    fn end(&self, directory: InodeId, inode: InodeId, unlinked: Option<String>) {
        let mut inner = self.inner();
        if let Some(count) = inner.in_directory.get_mut(&directory) {
            *count -= 1;
            if *count == 0 {
                inner.in_directory.remove(&directory);
            }
        }
        inner.in_flight.remove(&inode);
        self.in_flight
            .store(inner.in_flight.len(), Ordering::Release);
        if let Some(name) = unlinked {
            inner.unlinking.remove(&(directory, name));
            inner.unlinking_files.remove(&inode);
        }
        drop(inner);
        self.landed.notify_waiters();
    }

    /// Whether anything answered ahead is still on its way in `inodes` (as directories)
    /// or of them (as files).
    pub fn unsettled(&self, inodes: &[InodeId]) -> bool {
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return false;
        }
        let inner = self.inner();
        if inner.in_flight.is_empty() {
            return false;
        }
        inodes.iter().any(|inode| {
            *inode == 0 || inner.in_directory.contains_key(inode) || inner.in_flight.contains(inode)
        })
    }

    /// Whether an unlink of (a name of) `inode` answered ahead is on its way.
    pub fn unlinking(&self, inode: InodeId) -> bool {
        self.in_flight.load(Ordering::Acquire) != 0 && self.inner().unlinking_files.contains(&inode)
    }

    /// Whether creates or unlinks answered ahead are on their way in `directory` (itself
    /// not one).
    pub fn creating_in(&self, directory: InodeId) -> bool {
        let inner = self.inner();
        inner.in_directory.contains_key(&directory) && !inner.in_flight.contains(&directory)
    }

    /// Wait until nothing answered ahead is on its way in or of `inodes` (0: anywhere).
    pub async fn settle(&self, inodes: &[InodeId]) {
        loop {
            let landed = self.landed.notified();
            if !self.unsettled(inodes) {
                return;
            }
            // Woken by each answer; the timeout only guards against a missed wake.
            let _ = tokio::time::timeout(Duration::from_millis(50), landed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_start_only_in_delegated_directories_with_numbers_left() {
        let delegations = Arc::new(Delegations::default());
        let (none, reserve) = delegations.begin(1, 10, "n");
        assert!(none.is_none());
        assert!(reserve, "no numbers: reserve");
        let (_, again) = delegations.begin(1, 10, "n");
        assert!(!again, "one reservation at a time");
        delegations.reserved(1, Some((500, 2)));
        assert!(delegations.begin(1, 10, "n").0.is_none(), "not delegated");
        delegations.delegate(1, 10);
        let first = delegations
            .begin(1, 10, "n")
            .0
            .expect("delegated, numbers left");
        assert_eq!(first.inode(), 500);
        assert!(delegations.unsettled(&[10]));
        assert!(delegations.unsettled(&[500]));
        assert!(!delegations.unsettled(&[11]));
        let second = delegations.begin(1, 10, "n").0.expect("one number left");
        assert_eq!(second.inode(), 501);
        assert!(delegations.begin(1, 10, "n").0.is_none(), "numbers used up");
        first.finish();
        assert!(
            delegations.unsettled(&[10]),
            "the second is still on its way"
        );
        drop(second);
        assert!(
            !delegations.unsettled(&[10]),
            "a dropped op counts as landed"
        );
    }

    #[test]
    fn an_unlink_ahead_waits_for_its_create_and_holds_back_a_create_of_its_name() {
        let delegations = Arc::new(Delegations::default());
        delegations.reserved(1, Some((100, 10)));
        delegations.delegate(1, 10);
        let create = delegations.begin(1, 10, "a").0.expect("create ahead");
        assert!(
            delegations.begin_unlink(1, 10, "a", 100).is_none(),
            "its create is on its way"
        );
        create.finish();
        let unlink = delegations
            .begin_unlink(1, 10, "a", 100)
            .expect("unlink ahead");
        assert!(delegations.unsettled(&[10]) && delegations.unsettled(&[100]));
        assert!(
            delegations.begin(1, 10, "a").0.is_none(),
            "the name is being unlinked"
        );
        assert!(
            delegations.begin(1, 10, "b").0.is_some(),
            "another name is not"
        );
        unlink.finish();
        assert!(delegations.begin(1, 10, "a").0.is_some());
    }

    #[test]
    fn a_recall_or_a_new_epoch_ends_the_delegation() {
        let delegations = Arc::new(Delegations::default());
        delegations.reserved(1, Some((100, 10)));
        delegations.delegate(1, 10);
        delegations.delegate(1, 11);
        delegations.recall(10);
        assert!(delegations.begin(1, 10, "n").0.is_none());
        assert!(delegations.begin(1, 11, "n").0.is_some());
        // A restarted server: neither the delegation nor the numbers are good.
        assert!(delegations.begin(2, 11, "n").0.is_none());
        delegations.delegate(2, 11);
        assert!(
            delegations.begin(2, 11, "n").0.is_none(),
            "numbers of epoch 1 are gone"
        );
    }
}
