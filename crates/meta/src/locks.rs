//! The cluster's file locks (issue 9): POSIX record locks, OFD locks and `flock`, held here
//! so that processes on different clients exclude each other as they would on one host.
//!
//! A lock belongs to an owner within a session (the kernel's lock owner on that client), so
//! it ends with the session: at `CloseSession`, or when the session's lease runs out after
//! its client died. Locks live in memory; after a restart, clients reclaim the ones they
//! hold during the recovery window, before any new lock can be granted (`SetLock.reclaim`).
//!
//! A request that conflicts either fails at once (`WouldBlock`) or, when it may wait, waits
//! here for a release, up to the time its client allows, and then fails the same way (the
//! client asks again). An unlock by an owner also cancels its own requests still waiting,
//! so a lock asked for by a process that was killed meanwhile is never granted after it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use freeflow_proto::meta::LockConflict;
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{InodeId, LockKind, OwnerLocks};
use tokio::sync::Notify;

/// Most lock ranges held over the whole cluster.
pub const LOCK_RANGES_MAX: usize = 1 << 20;

/// Who holds a lock: a session and the kernel's lock owner within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockOwner {
    pub session: u64,
    pub owner: u64,
}

struct Held {
    locks: OwnerLocks,
    pid: u32,
}

#[derive(Default)]
struct Inner {
    files: HashMap<InodeId, HashMap<LockOwner, Held>>,
    ranges: usize,
    /// Bumped by each unlock of an owner: its waiting requests give up.
    cancels: HashMap<LockOwner, u64>,
}

/// What a lock request asks for.
#[derive(Clone, Copy, Debug)]
pub struct LockRequest {
    pub inode: InodeId,
    pub holder: LockOwner,
    pub pid: u32,
    /// None: unlock.
    pub kind: Option<LockKind>,
    pub start: u64,
    pub end: u64,
}

pub struct LockTable {
    inner: Mutex<Inner>,
    /// Woken whenever a lock is released or narrowed.
    released: Notify,
}

impl Default for LockTable {
    fn default() -> LockTable {
        LockTable::new()
    }
}

impl LockTable {
    pub fn new() -> LockTable {
        LockTable {
            inner: Mutex::new(Inner::default()),
            released: Notify::new(),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The first lock of another owner that conflicts with `kind` on the range.
    pub fn test(&self, request: &LockRequest) -> Option<LockConflict> {
        let kind = request.kind?;
        conflict(&self.inner(), request, kind)
    }

    /// Set (or release) a lock now, or say what conflicts.
    pub fn try_set(&self, request: &LockRequest) -> Result<(), WireError> {
        let mut inner = self.inner();
        if let Some(kind) = request.kind {
            if let Some(found) = conflict(&inner, request, kind) {
                return Err(WireError::new(
                    ErrorCode::WouldBlock,
                    format!(
                        "bytes {}..={} of inode {} are locked by another owner (pid {} on its client)",
                        found.start, found.end, request.inode, found.pid
                    ),
                ));
            }
            if inner.ranges >= LOCK_RANGES_MAX {
                return Err(WireError::new(
                    ErrorCode::NoSpace,
                    format!("the cluster holds {LOCK_RANGES_MAX} lock ranges already"),
                ));
            }
        } else {
            *inner.cancels.entry(request.holder).or_insert(0) += 1;
        }
        let file = inner.files.entry(request.inode).or_default();
        let held = file.entry(request.holder).or_insert_with(|| Held {
            locks: OwnerLocks::default(),
            pid: request.pid,
        });
        held.pid = request.pid;
        let before = held.locks.ranges().to_vec();
        let added = held.locks.apply(request.kind, request.start, request.end);
        // Anything given up (a write lock turned read, an unlock) may let a waiter in; an
        // unlock also ends the owner's own waiting requests.
        let released =
            request.kind.is_none()
                || before.iter().any(|old| {
                    !held.locks.ranges().iter().any(|new| {
                        new.start <= old.start && old.end <= new.end && new.kind == old.kind
                    })
                });
        if held.locks.is_empty() {
            file.remove(&request.holder);
        }
        if file.is_empty() {
            inner.files.remove(&request.inode);
        }
        inner.ranges = inner.ranges.saturating_add_signed(added);
        drop(inner);
        if released {
            self.released.notify_waiters();
        }
        Ok(())
    }

    /// Set a lock, waiting up to `wait` for the conflicting ones to go; `WouldBlock` if
    /// they did not, or if the owner unlocked meanwhile (its process gave up).
    pub async fn set_waiting(
        &self,
        request: &LockRequest,
        wait: Duration,
    ) -> Result<(), WireError> {
        let deadline = tokio::time::Instant::now() + wait;
        let cancel = self.inner().cancels.get(&request.holder).copied();
        loop {
            let released = self.released.notified();
            match self.try_set(request) {
                Err(error) if error.code == ErrorCode::WouldBlock => {
                    if self.inner().cancels.get(&request.holder).copied() != cancel {
                        return Err(WireError::new(
                            ErrorCode::WouldBlock,
                            "the owner unlocked while waiting",
                        ));
                    }
                    if tokio::time::timeout_at(deadline, released).await.is_err() {
                        return Err(error);
                    }
                }
                other => return other,
            }
        }
    }

    /// Release every lock of a session (it ended).
    pub fn release_session(&self, session: u64) {
        let mut inner = self.inner();
        let mut freed = 0;
        inner.files.retain(|_, owners| {
            owners.retain(|holder, held| {
                let keep = holder.session != session;
                if !keep {
                    freed += held.locks.ranges().len();
                }
                keep
            });
            !owners.is_empty()
        });
        inner.cancels.retain(|holder, _| holder.session != session);
        inner.ranges = inner.ranges.saturating_sub(freed);
        drop(inner);
        if freed > 0 {
            self.released.notify_waiters();
        }
    }

    /// Lock ranges held over the cluster (for metrics).
    pub fn range_count(&self) -> usize {
        self.inner().ranges
    }
}

fn conflict(inner: &Inner, request: &LockRequest, kind: LockKind) -> Option<LockConflict> {
    let owners = inner.files.get(&request.inode)?;
    owners
        .iter()
        .filter(|(holder, _)| **holder != request.holder)
        .find_map(|(_, held)| {
            held.locks
                .conflict(kind, request.start, request.end)
                .map(|range| LockConflict {
                    kind: range.kind,
                    start: range.start,
                    end: range.end,
                    pid: held.pid,
                })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn request(
        session: u64,
        owner: u64,
        kind: Option<LockKind>,
        start: u64,
        end: u64,
    ) -> LockRequest {
        LockRequest {
            inode: 5,
            holder: LockOwner { session, owner },
            pid: 100 + owner as u32,
            kind,
            start,
            end,
        }
    }

    #[test]
    fn owners_exclude_each_other_and_sessions_release_theirs() {
        let table = LockTable::new();
        table
            .try_set(&request(1, 1, Some(LockKind::Write), 0, 99))
            .unwrap();
        // Another owner of the same session conflicts too (two processes of one client).
        let error = table
            .try_set(&request(1, 2, Some(LockKind::Read), 50, 50))
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::WouldBlock);
        assert!(table
            .try_set(&request(2, 1, Some(LockKind::Write), 100, 200))
            .is_ok());
        let found = table
            .test(&request(2, 9, Some(LockKind::Read), 0, 0))
            .unwrap();
        assert_eq!(
            (found.kind, found.start, found.end, found.pid),
            (LockKind::Write, 0, 99, 101)
        );
        assert_eq!(table.range_count(), 2);
        table.release_session(1);
        assert!(table
            .test(&request(2, 9, Some(LockKind::Read), 0, 0))
            .is_none());
        assert_eq!(table.range_count(), 1);
    }

    #[tokio::test]
    async fn a_waiter_gets_the_lock_when_it_is_released_or_gives_up_when_its_owner_unlocks() {
        let table = Arc::new(LockTable::new());
        table
            .try_set(&request(1, 1, Some(LockKind::Write), 0, u64::MAX))
            .unwrap();
        let waiter = {
            let table = table.clone();
            tokio::spawn(async move {
                table
                    .set_waiting(
                        &request(2, 1, Some(LockKind::Write), 0, 0),
                        Duration::from_secs(30),
                    )
                    .await
            })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        table.try_set(&request(1, 1, None, 0, u64::MAX)).unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the release")
            .unwrap()
            .expect("granted");

        // Now session 2 holds byte 0; session 3's waiter is cancelled by its own unlock.
        let waiter = {
            let table = table.clone();
            tokio::spawn(async move {
                table
                    .set_waiting(
                        &request(3, 1, Some(LockKind::Read), 0, 0),
                        Duration::from_secs(30),
                    )
                    .await
            })
        };
        tokio::task::yield_now().await;
        table.try_set(&request(3, 1, None, 0, u64::MAX)).unwrap();
        let result = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter ends")
            .unwrap();
        assert_eq!(result.unwrap_err().code, ErrorCode::WouldBlock);
        // And a wait that runs out fails the same way.
        let started = tokio::time::Instant::now();
        let error = table
            .set_waiting(
                &request(4, 1, Some(LockKind::Write), 0, 0),
                Duration::from_millis(100),
            )
            .await
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::WouldBlock);
        assert!(started.elapsed() >= Duration::from_millis(100));
    }
}
