//! The client's side of cache leases (issue 9): which leases are still good, and the poll
//! that receives revocations and hands them to whoever caches (the mount's kernel).
//!
//! A lease comes with a reply (`Lease`); it is good until its time runs out on this
//! client's clock, the meta server restarts (a new epoch), or a revocation of one of its
//! inodes with an id at least its sequence arrives. Revocations are handed to the
//! handler one batch at a time and acknowledged in the next poll once the handler has
//! returned, so the server learns the caches are clean only when they are. A handler that
//! takes longer than [`HANDLER_WAIT_MS`] (the kernel holds a directory lock while it waits
//! for this client's own request in that directory, which may itself wait for another
//! client's acknowledgement) is acknowledged anyway, and finishes on its own: without that,
//! two mounts changing one directory at once could wait for each other until their leases
//! run out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::{Revocation, WaitRevocations};
use freeflow_types::InodeId;

use crate::client::Shared;
use crate::pool::{Lease, Pool};

/// How long a poll waits at the server for revocations before it asks again (at most half
/// the call time-out, so that a waiting poll is never mistaken for a lost one).
const POLL_WAIT_MS: u64 = 20_000;
/// How long a handler may take before its revocations are acknowledged anyway.
pub const HANDLER_WAIT_MS: u64 = 100;
/// Most inodes remembered as revoked; past it they are forgotten, and every lease granted
/// before the newest of them is treated as revoked (`Revoked::floor`).
const REVOKED_REMEMBERED_MAX: usize = 1 << 20;

/// What to call with revocations (inode 0: everything, the server restarted).
pub type RevocationHandler = Arc<dyn Fn(&[Revocation]) + Send + Sync>;
/// Called with the files whose writes another client's change recalls (see
/// `Client::watch_recalls`).
pub type RecallHandler = Arc<dyn Fn(&[InodeId]) + Send + Sync>;

/// Revocations seen in one server epoch: the newest id by inode.
#[derive(Default)]
pub(crate) struct Revoked {
    epoch: u64,
    by_inode: HashMap<InodeId, u64>,
    /// Every lease granted at or below this sequence counts as revoked (what the map
    /// forgot when it was full).
    floor: u64,
}

impl Revoked {
    /// Note revocations from the server of `epoch` (ids start over with each epoch).
    pub fn note(&mut self, epoch: u64, revocations: &[Revocation]) {
        if epoch != self.epoch {
            *self = Revoked {
                epoch,
                ..Revoked::default()
            };
        }
        if self.by_inode.len() >= REVOKED_REMEMBERED_MAX {
            let newest = self.by_inode.values().copied().max().unwrap_or(0);
            self.floor = self.floor.max(newest);
            self.by_inode.clear();
        }
        for revocation in revocations {
            let id = self.by_inode.entry(revocation.inode).or_insert(0);
            *id = (*id).max(revocation.id);
        }
    }

    /// Whether a revocation of `inode` at or after `seq` was seen in `epoch`.
    pub fn since(&self, epoch: u64, inode: InodeId, seq: u64) -> bool {
        epoch == self.epoch
            && (seq <= self.floor || self.by_inode.get(&inode).is_some_and(|id| *id >= seq))
    }
}

/// How long `lease` can still be trusted for `inodes`, if at all.
pub(crate) fn remaining(
    lease: &Lease,
    epoch: u64,
    revoked: &Revoked,
    inodes: &[InodeId],
) -> Option<Duration> {
    let until = lease.until?;
    if lease.epoch != epoch
        || inodes
            .iter()
            .any(|inode| revoked.since(epoch, *inode, lease.seq))
    {
        return None;
    }
    until
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// The poll loop: runs until the client is gone. Before a batch is acknowledged, the writes
/// this client has in flight on a file whose attributes are revoked are waited for: a
/// truncation by another client recalls them this way, so that bytes written here before
/// it cannot land after its cuts (the meta server waits for the acknowledgement first).
pub(crate) async fn watch(shared: Weak<Shared>, pool: Arc<Pool>) {
    let (mut acknowledged, mut epoch) = (0u64, 0u64);
    loop {
        if shared.strong_count() == 0 {
            return;
        }
        if pool.lease_epoch() != epoch {
            // A new server numbers its revocations from 1 again.
            (acknowledged, epoch) = (0, pool.lease_epoch());
        }
        let request = WaitRevocations {
            acknowledged,
            wait_ms: POLL_WAIT_MS.min(pool.call_timeout_ms() / 2) as u32,
        };
        let revocations = match pool.meta_call(&request, || "revocations".to_string()).await {
            Ok(revocations) => revocations,
            Err(error) => {
                tracing::debug!(%error, "polling for revocations failed; polling again");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if revocations.is_empty() {
            continue;
        }
        if pool.lease_epoch() != epoch {
            // Answered by a server that restarted since the poll was sent: ask again.
            continue;
        }
        let Some(client) = shared.upgrade() else {
            return;
        };
        client.revoked().note(epoch, &revocations);
        let last = revocations.iter().map(|revocation| revocation.id).max();
        let mut recalled: Vec<InodeId> = revocations
            .iter()
            .filter(|revocation| revocation.attributes && revocation.inode != 0)
            .map(|revocation| revocation.inode)
            .collect();
        recalled.sort_unstable();
        recalled.dedup();
        let recall_handler = client.recall_handler.lock().expect("not poisoned").clone();
        if let Some(handler) = recall_handler.filter(|_| !recalled.is_empty()) {
            let inodes = recalled.clone();
            let written = tokio::task::spawn_blocking(move || handler(&inodes));
            let bound = Duration::from_millis(pool.call_timeout_ms());
            if tokio::time::timeout(bound, written).await.is_err() {
                tracing::warn!(
                    files = recalled.len(),
                    "writing back recalled files took longer than the call time-out"
                );
            }
        }
        for inode in &recalled {
            for handle in client.open_handles(*inode) {
                handle.note_changed_elsewhere();
                handle.wait_for_started_writes().await;
            }
        }
        // A directory's names revoked: no create is answered ahead there any more, and
        // those answered are waited for (the recall of a delegation, see `delegation.rs`).
        let mut directories: Vec<InodeId> = Vec::new();
        for revocation in &revocations {
            if revocation.whole_directory || !revocation.names.is_empty() || revocation.inode == 0 {
                client.delegations.recall(revocation.inode);
                if revocation.inode != 0 {
                    directories.push(revocation.inode);
                }
            }
        }
        if !directories.is_empty() {
            client.delegations.settle(&directories).await;
        }
        let handler = client
            .revocation_handler
            .lock()
            .expect("not poisoned")
            .clone();
        drop(client);
        if let Some(handler) = handler {
            let handled = tokio::task::spawn_blocking(move || handler(&revocations));
            // Acknowledged once handled, or after the wait whatever happens (module doc).
            let _ = tokio::time::timeout(Duration::from_millis(HANDLER_WAIT_MS), handled).await;
        }
        acknowledged = acknowledged.max(last.unwrap_or(0));
    }
}

impl Shared {
    pub(crate) fn revoked(&self) -> std::sync::MutexGuard<'_, Revoked> {
        self.revoked.lock().expect("revoked not poisoned")
    }
}

/// Bounded memory of revocations for `Shared`.
pub(crate) fn new_revoked() -> Mutex<Revoked> {
    Mutex::new(Revoked::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revocation(id: u64, inode: InodeId) -> Revocation {
        Revocation {
            id,
            inode,
            names: vec![],
            attributes: true,
            whole_directory: false,
        }
    }

    #[test]
    fn a_lease_is_good_until_its_time_its_epoch_or_a_newer_revocation() {
        let mut revoked = Revoked::default();
        revoked.note(3, &[]);
        let lease = Lease {
            until: Some(Instant::now() + Duration::from_secs(10)),
            seq: 50,
            epoch: 3,
            delegated: false,
        };
        assert!(remaining(&lease, 3, &revoked, &[7, 8]).is_some());
        assert!(
            remaining(&lease, 4, &revoked, &[7]).is_none(),
            "another epoch"
        );
        // A revocation older than the grant does not touch it; a newer one does.
        revoked.note(3, &[revocation(49, 7)]);
        assert!(remaining(&lease, 3, &revoked, &[7]).is_some());
        revoked.note(3, &[revocation(50, 8)]);
        assert!(remaining(&lease, 3, &revoked, &[7]).is_some());
        assert!(remaining(&lease, 3, &revoked, &[7, 8]).is_none());
        let expired = Lease {
            until: Some(Instant::now()),
            ..lease
        };
        assert!(remaining(&expired, 3, &revoked, &[7]).is_none());
        // A new server numbers from 1 again: the old epoch's revocations do not apply.
        let renewed = Lease {
            seq: 10,
            epoch: 4,
            ..lease
        };
        assert!(remaining(&renewed, 4, &revoked, &[8]).is_some());
        revoked.note(4, &[revocation(10, 8)]);
        assert!(remaining(&renewed, 4, &revoked, &[8]).is_none());
        assert!(remaining(&renewed, 4, &revoked, &[7]).is_some());
        assert!(remaining(&Lease::default(), 0, &revoked, &[]).is_none());
    }
}
