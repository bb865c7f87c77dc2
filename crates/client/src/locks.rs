//! Cluster-wide file locks from the client's side (issue 9): `fcntl` record locks, OFD
//! locks and `flock`, held at the meta server (`SetLock`, `GetLock`).
//!
//! A request that may wait is asked again each time the server's own wait runs out, until
//! the lock is granted or the same owner unlocks (its process gave up or died: the kernel
//! unlocks at close). The client keeps the locks it holds, by file and owner, so that after
//! a meta server restart it can take them again during the recovery window, before any
//! other client can be granted a new one.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use freeflow_proto::meta::{GetLock, LockConflict, OpenSession, SetLock};
use freeflow_proto::ErrorCode;
use freeflow_rpc::Connection;
use freeflow_types::{InodeId, LockKind, OwnerLocks};

use crate::client::{Client, Shared};
use crate::error::ClientError;

/// Most a lock request asks the server to wait before it asks again.
const LOCK_WAIT_MS: u64 = 5_000;
/// The same for a wait that may be interrupted ([`Client::set_lock_unless`]): how long an
/// interruption may go unnoticed.
pub const INTERRUPTIBLE_WAIT_MS: u64 = 1_000;

/// Lock requests of one client waiting at the meta server at once. Each is a long poll
/// there, with slots of their own (4,096 a connection, `long_polls_in_flight_max`) past
/// which the server stops reading the connection, lease renewals and all: more wait here
/// for a turn, a round at a time.
pub const LOCK_WAITS_MAX: usize = 1024;

/// Says whether a waiting lock request should give up (its process has a signal to take).
pub type Interrupted<'a> = &'a (dyn Fn() -> bool + Send + Sync);

/// The error of a wait whose lock's owner unlocked meanwhile (it no longer wants it).
fn unlocked_while_waiting(inode: InodeId) -> ClientError {
    ClientError::Inode {
        inode,
        code: ErrorCode::WouldBlock,
        reason: "the lock's owner unlocked while it waited".into(),
    }
}

/// A lock to set or release: the kernel's lock owner, the process (reported to others'
/// `F_GETLK`), the kind (None: unlock) and the inclusive range (`u64::MAX`: to the end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockSpec {
    pub owner: u64,
    pub pid: u32,
    pub kind: Option<LockKind>,
    pub start: u64,
    pub end: u64,
}

/// What this client holds, by (file, owner); for owners with requests in progress, how
/// many and a count of their unlocks. Bounded by the locks held and requests in flight.
#[derive(Default)]
pub(crate) struct HeldLocks {
    held: HashMap<(InodeId, u64), (OwnerLocks, u32)>,
    /// (requests in progress, unlocks seen) by owner with requests in progress.
    asking: HashMap<(InodeId, u64), (usize, u64)>,
}

impl HeldLocks {
    fn unlocks(&self, key: (InodeId, u64)) -> u64 {
        self.asking.get(&key).map_or(0, |(_, unlocks)| *unlocks)
    }

    fn begin(&mut self, key: (InodeId, u64)) -> u64 {
        let entry = self.asking.entry(key).or_insert((0, 0));
        entry.0 += 1;
        entry.1
    }

    fn end(&mut self, key: (InodeId, u64)) {
        if let Some(entry) = self.asking.get_mut(&key) {
            entry.0 -= 1;
            if entry.0 == 0 {
                self.asking.remove(&key);
            }
        }
    }

    /// The owner let go: its requests in progress must not take a lock after this.
    fn unlocked(&mut self, key: (InodeId, u64)) {
        if let Some(entry) = self.asking.get_mut(&key) {
            entry.1 += 1;
        }
    }

    fn applied(&mut self, inode: InodeId, spec: &LockSpec) {
        let key = (inode, spec.owner);
        let entry = self
            .held
            .entry(key)
            .or_insert_with(|| (OwnerLocks::default(), spec.pid));
        entry.0.apply(spec.kind, spec.start, spec.end);
        entry.1 = spec.pid;
        if entry.0.is_empty() {
            self.held.remove(&key);
        }
    }
}

pub(crate) fn new_held() -> Mutex<HeldLocks> {
    Mutex::new(HeldLocks::default())
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

/// After a meta server restart, inside its recovery window: every lock this client holds
/// taken again in its session (`session`: taken again with its handles, or a new one if
/// that failed). A lock that cannot be taken again is reported and
/// forgotten (its owner will find it gone only by its absence).
pub(crate) async fn reclaim(shared: &Shared, connection: &Connection, session: Option<u64>) {
    let held: Vec<((InodeId, u64), OwnerLocks, u32)> = shared
        .held_locks()
        .held
        .iter()
        .map(|(key, (locks, pid))| (*key, locks.clone(), *pid))
        .collect();
    if held.is_empty() {
        return;
    }
    // The session taken again with its handles, or a new one if it could not be.
    let session_id = match session {
        Some(session_id) => session_id,
        None => {
            let open = OpenSession {
                client_name: shared.config.client_name.clone(),
            };
            match connection
                .call_as(shared.pool.next_meta_request_id(), 0, &open, Bytes::new())
                .await
            {
                Ok((grant, _)) => grant.session_id,
                Err(error) => {
                    tracing::error!(%error, "no session to reclaim this client's locks in: they are lost");
                    shared.held_locks().held.clear();
                    return;
                }
            }
        }
    };
    shared.set_session_id(session_id);
    let mut lost = 0;
    for ((inode, owner), locks, pid) in held {
        for range in locks.ranges() {
            let request = SetLock {
                session_id,
                inode,
                owner,
                pid,
                kind: Some(range.kind),
                start: range.start,
                end: range.end,
                wait_ms: 0,
                reclaim: true,
            };
            let sent = connection
                .call_as(
                    shared.pool.next_meta_request_id(),
                    0,
                    &request,
                    Bytes::new(),
                )
                .await;
            if let Err(error) = sent {
                lost += 1;
                tracing::error!(inode, owner, %error, "a lock held before the meta server restarted was lost");
                shared.held_locks().applied(
                    inode,
                    &LockSpec {
                        owner,
                        pid,
                        kind: None,
                        start: range.start,
                        end: range.end,
                    },
                );
            }
        }
    }
    tracing::info!(
        session_id,
        lost,
        "locks reclaimed after the meta server restarted"
    );
}
