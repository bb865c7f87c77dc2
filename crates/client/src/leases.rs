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
use std::time::{Duration, Instant};

use freeflow_proto::meta::{Revocation, WaitRevocations};
use freeflow_types::InodeId;

use crate::client::Shared;
use crate::pool::Lease;

/// How long a poll waits at the server for revocations before it asks again (at most half
/// the call time-out, so that a waiting poll is never mistaken for a lost one).
const POLL_WAIT_MS: u64 = 20_000;
/// How long a handler may take before its revocations are acknowledged anyway.
pub const HANDLER_WAIT_MS: u64 = 100;
/// Most inodes remembered as revoked; older ones are forgotten first (a lease outlives
/// none of them: they are kept for longer than any lease).
const REVOKED_REMEMBERED_MAX: usize = 1 << 20;
/// How long a revocation is remembered: longer than any lease the server grants.
const REVOKED_REMEMBERED_FOR: Duration = Duration::from_secs(600);

/// What to call with revocations (inode 0: everything, the server restarted).
pub type RevocationHandler = Arc<dyn Fn(&[Revocation]) + Send + Sync>;

/// Revocations seen, by inode: the newest id and when.
#[derive(Default)]
pub(crate) struct Revoked {
    by_inode: HashMap<InodeId, (u64, Instant)>,
}

impl Revoked {
    pub fn note(&mut self, revocations: &[Revocation]) {
        let now = Instant::now();
        if self.by_inode.len() >= REVOKED_REMEMBERED_MAX {
            self.by_inode
                .retain(|_, (_, at)| now.duration_since(*at) < REVOKED_REMEMBERED_FOR);
        }
        for revocation in revocations {
            let entry = self.by_inode.entry(revocation.inode).or_insert((0, now));
            *entry = (entry.0.max(revocation.id), now);
        }
    }

    /// Whether a revocation of `inode` at or after `seq` was seen.
    pub fn since(&self, inode: InodeId, seq: u64) -> bool {
        self.by_inode.get(&inode).is_some_and(|(id, _)| *id >= seq)
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
    if lease.epoch != epoch || inodes.iter().any(|inode| revoked.since(*inode, lease.seq)) {
        return None;
    }
    until
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// The poll loop: runs until the client is gone.
pub(crate) async fn watch(shared: Weak<Shared>, handler: RevocationHandler) {
    let mut acknowledged = 0u64;
    loop {
        let Some(client) = shared.upgrade() else {
            return;
        };
        let request = WaitRevocations {
            acknowledged,
            wait_ms: POLL_WAIT_MS.min(client.pool.call_timeout_ms() / 2) as u32,
        };
        let revocations = client
            .pool
            .meta_call(&request, || "revocations".to_string())
            .await;
        let revocations = match revocations {
            Ok(revocations) => revocations,
            Err(error) => {
                tracing::debug!(%error, "polling for revocations failed; polling again");
                drop(client);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if revocations.is_empty() {
            continue;
        }
        client.revoked().note(&revocations);
        let last = revocations.iter().map(|revocation| revocation.id).max();
        let handler = handler.clone();
        let handled = tokio::task::spawn_blocking(move || handler(&revocations));
        // Acknowledged once handled, or after the wait whatever happens (see the module doc).
        let _ = tokio::time::timeout(Duration::from_millis(HANDLER_WAIT_MS), handled).await;
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
        let lease = Lease {
            until: Some(Instant::now() + Duration::from_secs(10)),
            seq: 50,
            epoch: 3,
        };
        assert!(remaining(&lease, 3, &revoked, &[7, 8]).is_some());
        assert!(
            remaining(&lease, 4, &revoked, &[7]).is_none(),
            "another epoch"
        );
        // A revocation older than the grant does not touch it; a newer one does.
        revoked.note(&[revocation(49, 7)]);
        assert!(remaining(&lease, 3, &revoked, &[7]).is_some());
        revoked.note(&[revocation(50, 8)]);
        assert!(remaining(&lease, 3, &revoked, &[7]).is_some());
        assert!(remaining(&lease, 3, &revoked, &[7, 8]).is_none());
        let expired = Lease {
            until: Some(Instant::now()),
            ..lease
        };
        assert!(remaining(&expired, 3, &revoked, &[7]).is_none());
        assert!(remaining(&Lease::default(), 0, &revoked, &[]).is_none());
    }
}
