//! The lock calls of [`Client`] (`F_SETLK`, `F_SETLKW`, `F_GETLK`, `flock`, OFD locks): a
//! request that may wait is asked again each time the server's own wait runs out (see
//! `locks.rs`, which keeps what is held and takes it again after a restart).

use freeflow_proto::meta::{GetLock, LockConflict, SetLock};
use freeflow_proto::ErrorCode;
use freeflow_types::{InodeId, LockKind};

use super::{Client, Shared};
use crate::error::ClientError;
use crate::locks::{HeldLocks, LockSpec};

/// Most a lock request asks the server to wait before it asks again.
const LOCK_WAIT_MS: u64 = 5_000;
/// The same for a wait that may be interrupted ([`Client::set_lock_unless`]): how long an
/// interruption may go unnoticed.
pub(crate) const INTERRUPTIBLE_WAIT_MS: u64 = 1_000;

/// Says whether a waiting lock request should give up (its process has a signal to take).
pub(crate) type Interrupted<'a> = &'a (dyn Fn() -> bool + Send + Sync);

/// The error of a wait whose lock's owner unlocked meanwhile (it no longer wants it).
fn unlocked_while_waiting(inode: InodeId) -> ClientError {
    ClientError::Inode {
        inode,
        code: ErrorCode::WouldBlock,
        reason: "the lock's owner unlocked while it waited".into(),
    }
}

impl Shared {
    fn held_locks(&self) -> std::sync::MutexGuard<'_, HeldLocks> {
        self.locks.lock().expect("held locks not poisoned")
    }
}

fn would_block(error: &ClientError) -> bool {
    error.code() == ErrorCode::WouldBlock
}

impl Client {
    /// Set or release a lock on `inode` (`F_SETLK`, `F_SETLKW` with `wait`, `flock`).
    /// Another owner's conflicting lock gives `WouldBlock` at once, or with `wait` is waited
    /// for until it goes (or until the owner's file is closed: then `WouldBlock`).
    pub async fn set_lock(
        &self,
        inode: InodeId,
        spec: LockSpec,
        wait: bool,
    ) -> Result<(), ClientError> {
        let key = (inode, spec.owner);
        // An unlock of one range does not end the owner's requests for others (a thread of
        // a process waiting in F_SETLKW while another unlocks); only a close does.
        let unlocks = self.shared.held_locks().begin(key);
        let result = self
            .set_lock_counted(inode, spec, wait, None, unlocks)
            .await;
        self.shared.held_locks().end(key);
        result.map(drop)
    }

    /// [`Client::set_lock`] with `wait`, giving up once `interrupted` says so: it is asked
    /// each time a round of the wait at the server ends (rounds of at most
    /// [`INTERRUPTIBLE_WAIT_MS`]), and the lock is then not taken: `Ok(false)`. A lock
    /// granted in the round that saw the interruption is kept (`Ok(true)`), as a local
    /// lock granted as a signal comes is.
    pub async fn set_lock_unless(
        &self,
        inode: InodeId,
        spec: LockSpec,
        interrupted: Interrupted<'_>,
    ) -> Result<bool, ClientError> {
        let key = (inode, spec.owner);
        let unlocks = self.shared.held_locks().begin(key);
        let result = self
            .set_lock_counted(inode, spec, true, Some(interrupted), unlocks)
            .await;
        self.shared.held_locks().end(key);
        result
    }

    /// After a round of a wait for `spec`'s lock that did not get it: WouldBlock if its
    /// owner unlocked meanwhile (`unlocks` counted its unlocks before), not set if
    /// `interrupted` says so, None to wait on.
    fn wait_ended(
        &self,
        key: (InodeId, u64),
        unlocks: u64,
        interrupted: Option<Interrupted<'_>>,
    ) -> Option<Result<bool, ClientError>> {
        if self.shared.held_locks().unlocks(key) != unlocks {
            return Some(Err(unlocked_while_waiting(key.0)));
        }
        if interrupted.is_some_and(|interrupted| interrupted()) {
            return Some(Ok(false));
        }
        None
    }

    /// Whether the lock was set (false only when `interrupted` said so).
    async fn set_lock_counted(
        &self,
        inode: InodeId,
        spec: LockSpec,
        wait: bool,
        interrupted: Option<Interrupted<'_>>,
        unlocks: u64,
    ) -> Result<bool, ClientError> {
        let key = (inode, spec.owner);
        let round_ms = if interrupted.is_some() {
            INTERRUPTIBLE_WAIT_MS
        } else {
            LOCK_WAIT_MS
        };
        let wait_ms = if wait && spec.kind.is_some() {
            round_ms.min(self.shared.pool.call_timeout_ms() / 2) as u32
        } else {
            0
        };
        loop {
            // A turn at the server for a wait, kept in line across rounds (the semaphore
            // serves first come, first served); a round without one ends like a round that
            // ended WouldBlock.
            let _turn = if wait_ms == 0 {
                None
            } else {
                let round = std::time::Duration::from_millis(u64::from(wait_ms));
                let acquire = self.shared.lock_waits.acquire();
                tokio::pin!(acquire);
                loop {
                    match tokio::time::timeout(round, acquire.as_mut()).await {
                        Ok(turn) => break turn.ok(),
                        Err(_) => {
                            if let Some(ended) = self.wait_ended(key, unlocks, interrupted) {
                                return ended;
                            }
                        }
                    }
                }
            };
            let mut session_id = self.session_id();
            let request = |session_id| SetLock {
                session_id,
                inode,
                owner: spec.owner,
                pid: spec.pid,
                kind: spec.kind,
                start: spec.start,
                end: spec.end,
                wait_ms,
                reclaim: false,
            };
            let target = || format!("inode {inode} bytes {}..={}", spec.start, spec.end);
            let mut result = self
                .shared
                .pool
                .meta_call(&request(session_id), target)
                .await;
            if matches!(&result, Err(error) if error.code() == ErrorCode::BadHandle) {
                // The session is gone (and every lock of it): a new one for this request.
                session_id = self.shared.reopen_session(session_id).await?;
                result = self
                    .shared
                    .pool
                    .meta_call(&request(session_id), target)
                    .await;
            }
            match result {
                Ok(()) => {
                    let given_up = {
                        let mut held = self.shared.held_locks();
                        let given_up = spec.kind.is_some() && held.unlocks(key) != unlocks;
                        if !given_up {
                            held.applied(inode, &spec);
                        }
                        given_up
                    };
                    if given_up {
                        // The owner unlocked while this was on its way: give it back.
                        let release = LockSpec { kind: None, ..spec };
                        Box::pin(self.set_lock(inode, release, false)).await?;
                        return Err(unlocked_while_waiting(inode));
                    }
                    return Ok(true);
                }
                Err(error) if wait_ms > 0 && would_block(&error) => {
                    if let Some(ended) = self.wait_ended(key, unlocks, interrupted) {
                        return ended;
                    }
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// The first lock of another owner that would conflict with `kind` on the range
    /// (`F_GETLK`), if any.
    pub async fn get_lock(
        &self,
        inode: InodeId,
        owner: u64,
        kind: LockKind,
        start: u64,
        end: u64,
    ) -> Result<Option<LockConflict>, ClientError> {
        let request = GetLock {
            session_id: self.session_id(),
            inode,
            owner,
            kind,
            start,
            end,
        };
        self.shared
            .pool
            .meta_call(&request, || format!("inode {inode} bytes {start}..={end}"))
            .await
    }

    /// What [`Client::release_owner_locks`] does without a request: a lock request of
    /// `owner` on `inode` still in progress gives up. Returns whether the owner holds locks
    /// there (which only `release_owner_locks` gives back).
    pub fn owner_holds_locks(&self, inode: InodeId, owner: u64) -> bool {
        let mut held = self.shared.held_locks();
        let key = (inode, owner);
        held.unlocked(key);
        held.held.contains_key(&key)
    }

    /// Release every lock `owner` holds on `inode`, and end its requests still waiting (a
    /// close: POSIX locks of the closing process, or `flock` locks at the last close). Asks
    /// the meta server only if the owner holds something there.
    pub async fn release_owner_locks(&self, inode: InodeId, owner: u64) -> Result<(), ClientError> {
        if !self.owner_holds_locks(inode, owner) {
            return Ok(());
        }
        let spec = LockSpec {
            owner,
            pid: 0,
            kind: None,
            start: 0,
            end: u64::MAX,
        };
        self.set_lock(inode, spec, false).await
    }

    /// The owners holding locks on `inode` here, and an end to every request still in
    /// progress on it: to be taken when nothing of the file is open on this client any
    /// more (its last close), before anything else can open and lock it again. Release
    /// them with [`Client::release_locks_of`].
    pub fn take_inode_lock_owners(&self, inode: InodeId) -> Vec<u64> {
        let mut held = self.shared.held_locks();
        let asking: Vec<(InodeId, u64)> = held
            .asking
            .keys()
            .filter(|(file, _)| *file == inode)
            .copied()
            .collect();
        for key in asking {
            held.unlocked(key);
        }
        held.held
            .keys()
            .filter(|(file, _)| *file == inode)
            .map(|(_, owner)| *owner)
            .collect()
    }

    /// Release every lock of these owners on `inode` (see `take_inode_lock_owners`).
    pub async fn release_locks_of(
        &self,
        inode: InodeId,
        owners: &[u64],
    ) -> Result<(), ClientError> {
        for owner in owners {
            self.release_owner_locks(inode, *owner).await?;
        }
        Ok(())
    }

    /// Lock ranges this client holds (tests and metrics).
    pub fn held_lock_ranges(&self) -> usize {
        self.shared
            .held_locks()
            .held
            .values()
            .map(|(locks, _)| locks.ranges().len())
            .sum()
    }
}
