//! Cluster-wide file locks from the client's side (issue 9): `fcntl` record locks, OFD
//! locks and `flock`, held at the meta server (`SetLock`, `GetLock`).
//!
//! A request that may wait is asked again each time the server's own wait runs out, until
//! the lock is granted or the same owner unlocks (its process gave up or died: the kernel
//! unlocks at close). The client keeps the locks it holds, by file and owner, so that after
//! a meta server restart it can take them again during the recovery window, before any
//! other client can be granted a new one.
//!
//! This file keeps what is held ([`HeldLocks`]) and takes it again after a restart
//! ([`reclaim`]); the lock calls of `Client` are in `client/locks.rs`.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use freeflow_proto::meta::{OpenSession, SetLock};
use freeflow_rpc::Connection;
use freeflow_types::{InodeId, LockKind, OwnerLocks};

use crate::pool::Pool;

/// Lock requests of one client waiting at the meta server at once. Each is a long poll
/// there, with slots of their own (4,096 a connection, `long_polls_in_flight_max`) past
/// which the server stops reading the connection, lease renewals and all: more wait here
/// for a turn, a round at a time.
pub(crate) const LOCK_WAITS_MAX: usize = 1024;

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
    pub(crate) held: HashMap<(InodeId, u64), (OwnerLocks, u32)>,
    /// (requests in progress, unlocks seen) by owner with requests in progress.
    pub(crate) asking: HashMap<(InodeId, u64), (usize, u64)>,
}

impl HeldLocks {
    pub(crate) fn unlocks(&self, key: (InodeId, u64)) -> u64 {
        self.asking.get(&key).map_or(0, |(_, unlocks)| *unlocks)
    }

    pub(crate) fn begin(&mut self, key: (InodeId, u64)) -> u64 {
        let entry = self.asking.entry(key).or_insert((0, 0));
        entry.0 += 1;
        entry.1
    }

    pub(crate) fn end(&mut self, key: (InodeId, u64)) {
        if let Some(entry) = self.asking.get_mut(&key) {
            entry.0 -= 1;
            if entry.0 == 0 {
                self.asking.remove(&key);
            }
        }
    }

    /// The owner let go: its requests in progress must not take a lock after this.
    pub(crate) fn unlocked(&mut self, key: (InodeId, u64)) {
        if let Some(entry) = self.asking.get_mut(&key) {
            entry.1 += 1;
        }
    }

    pub(crate) fn applied(&mut self, inode: InodeId, spec: &LockSpec) {
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

/// After a meta server restart, inside its recovery window: every lock this client holds
/// taken again in its session (`session`: taken again with its handles, or a new one if
/// that failed). A lock that cannot be taken again is reported and
/// forgotten (its owner will find it gone only by its absence).
pub(crate) async fn reclaim(
    held_locks: &Mutex<HeldLocks>,
    pool: &Pool,
    client_name: &str,
    set_session_id: impl FnOnce(u64),
    connection: &Connection,
    session: Option<u64>,
) {
    let held_locks = || held_locks.lock().expect("held locks not poisoned");
    let held: Vec<((InodeId, u64), OwnerLocks, u32)> = held_locks()
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
                client_name: client_name.to_string(),
            };
            match connection
                .call_as(pool.next_meta_request_id(), 0, &open, Bytes::new())
                .await
            {
                Ok((grant, _)) => grant.session_id,
                Err(error) => {
                    tracing::error!(%error, "no session to reclaim this client's locks in: they are lost");
                    held_locks().held.clear();
                    return;
                }
            }
        }
    };
    set_session_id(session_id);
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
                .call_as(pool.next_meta_request_id(), 0, &request, Bytes::new())
                .await;
            if let Err(error) = sent {
                lost += 1;
                tracing::error!(inode, owner, %error, "a lock held before the meta server restarted was lost");
                held_locks().applied(
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
