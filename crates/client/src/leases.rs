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
//!
//! Leases outlive their time while the client renews them (`RenewLeases`, every fifth of
//! a lease, see [`renew`]): a lease still good when an unbroken run of renewals began is
//! kept to the newest renewal's end, up to `LEASE_RENEWAL_SPAN_MS` after it was sent
//! ([`Renewed`]; the meta server keeps the same run, a little longer). A renewal counts
//! only once every revocation the server had queued to this client by then is handled.
//! While a run lives, the kernel may be given a lease's whole span (`Client::
//! kernel_time_out`); should renewals stop succeeding, the run *lapses* a quarter of a
//! lease before its end: everything handed out is taken back (the handler gets a
//! revocation of inode 0), before the server could let another client's change through.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::{LeasesRenewed, RenewLeases, Revocation, WaitRevocations};
use freeflow_types::InodeId;

use crate::delegation::Delegations;
use crate::lease::{Lease, HANDLER_WAIT_MS, LEASE_MARGIN_PERCENT};
use crate::pool::Pool;

/// How long a poll waits at the server for revocations before it asks again (at most half
/// the call time-out, so that a waiting poll is never mistaken for a lost one).
const POLL_WAIT_MS: u64 = 20_000;
/// How soon a renewal that failed or was not taken is tried again (at most: a fifth of
/// the lease otherwise).
const RENEWAL_RETRY: Duration = Duration::from_millis(200);
/// Most inodes remembered as revoked; past it they are forgotten, and every lease granted
/// before the newest of them is treated as revoked (`Revoked::floor`).
const REVOKED_REMEMBERED_MAX: usize = 1 << 20;

/// What to call with revocations (inode 0: everything, the server restarted).
pub type RevocationHandler = Arc<dyn Fn(&[Revocation]) + Send + Sync>;
/// Called with the files whose writes another client's change recalls (see
/// `Client::watch_recalls`).
pub type RecallHandler = Arc<dyn Fn(&[InodeId]) + Send + Sync>;

/// What the revocation poll and the renewer need of the client above them: its lease
/// state, the handlers it was given, and the open files and delegated directories a
/// revocation recalls. Defined here and implemented by the client, so that this file never
/// names the client.
pub(crate) trait LeaseHolder: Send + Sync + 'static {
    /// Revocations seen.
    fn revoked(&self) -> MutexGuard<'_, Revoked>;
    /// The run of lease renewals.
    fn renewed(&self) -> MutexGuard<'_, Renewed>;
    /// Who is told of revocations, if anyone.
    fn revocation_handler(&self) -> Option<RevocationHandler>;
    /// Who writes back what it holds of a recalled file, if anyone.
    fn recall_handler(&self) -> Option<RecallHandler>;
    /// The newest revocation the poll handled, by server epoch (`renew` waits for it).
    fn handled(&self) -> &tokio::sync::watch::Sender<(u64, u64)>;
    /// Directories delegated to this client (see `delegation.rs`).
    fn delegations(&self) -> &Delegations;
    /// A revocation of `inode`'s attributes arrived: each handle open on it learns it was
    /// changed elsewhere and waits for the writes it started (another client's truncation
    /// recalls them).
    fn recall_writes(&self, inode: InodeId) -> impl Future<Output = ()> + Send + '_;
}

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

/// How long `lease` can still be trusted for `inodes` at `now`, if at all.
pub(crate) fn remaining(
    lease: &Lease,
    epoch: u64,
    revoked: &Revoked,
    renewed: &Renewed,
    inodes: &[InodeId],
    now: Instant,
) -> Option<Duration> {
    let until = lease.until?;
    if lease.epoch != epoch
        || inodes
            .iter()
            .any(|inode| revoked.since(epoch, *inode, lease.seq))
    {
        return None;
    }
    renewed
        .extend(lease, until)
        .checked_duration_since(now)
        .filter(|left| !left.is_zero())
}

/// This client's run of lease renewals, as it counts on it (module doc).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Renewed {
    epoch: u64,
    /// When the run's first renewal was counted on (leases good then are kept by it), and
    /// the newest renewal's end; None: no run.
    run: Option<(Instant, Instant)>,
    /// How long before the run's end it lapses: a quarter of the lease.
    margin: Duration,
}

impl Renewed {
    /// The end of `lease` (its own: `until`) as the run keeps it.
    pub fn extend(&self, lease: &Lease, until: Instant) -> Instant {
        match self.run {
            Some((since, end)) if lease.epoch == self.epoch && until > since => {
                until.max(end.min(lease.span_until.unwrap_or(until)))
            }
            _ => until,
        }
    }

    /// Whether `lease` is kept by a run that is not about to lapse: then what it covers
    /// may be handed out until its span ends.
    pub fn spans(&self, lease: &Lease) -> Option<Instant> {
        let (since, end) = self.run?;
        let until = lease.until?;
        (lease.epoch == self.epoch && until > since && Instant::now() + self.margin < end)
            .then_some(lease.span_until)
            .flatten()
    }

    /// A renewal of `epoch` sent at `sent_at` for `lease_ms` was taken (and every
    /// revocation before it handled): the run goes on, or a new one begins now.
    pub fn note(&mut self, epoch: u64, sent_at: Instant, lease_ms: u32) {
        let now = Instant::now();
        let trusted_ms = u64::from(lease_ms) * (100 - LEASE_MARGIN_PERCENT) / 100;
        let end = sent_at + Duration::from_millis(trusted_ms);
        self.run = match self.run {
            Some((since, previous)) if self.epoch == epoch && now < previous => {
                Some((since, previous.max(end)))
            }
            _ => Some((now, end)),
        };
        self.epoch = epoch;
        self.margin = Duration::from_millis(u64::from(lease_ms) / 4);
    }

    /// When the run lapses if no renewal comes first.
    fn lapse_at(&self) -> Option<Instant> {
        self.run.map(|(_, end)| end - self.margin)
    }
}

/// Renew the leases at a fifth of a lease until the client is gone; lapse the run when
/// renewals stop succeeding (module doc). `handled` says which revocations the poll has
/// handled, by server epoch.
pub(crate) async fn renew<H: LeaseHolder>(
    shared: Weak<H>,
    pool: Arc<Pool>,
    mut handled: tokio::sync::watch::Receiver<(u64, u64)>,
) {
    // Until a server says how long its leases are.
    let mut lease = Duration::from_millis(10_000);
    // Soon after connect: the first renewal starts the run.
    let mut next = Instant::now() + RENEWAL_RETRY;
    loop {
        // No strong reference across the sleep: the client may go meanwhile.
        let Some(lapse_at) = shared.upgrade().map(|client| client.renewed().lapse_at()) else {
            return;
        };
        let wake = lapse_at.map_or(next, |at| at.min(next));
        tokio::time::sleep_until(wake).await;
        let now = Instant::now();
        if lapse_at.is_some_and(|at| now >= at) {
            let Some(client) = shared.upgrade() else {
                return;
            };
            lapse(client.as_ref());
            continue;
        }
        if now < next {
            continue;
        }
        next = now + lease / 5;
        // A slow answer still counts if it comes before the lapse (bounded so that the
        // lapse is never late).
        let bound = lapse_at.map_or(lease, |at| at - now);
        let sent_at = Instant::now();
        let renewal =
            tokio::time::timeout(bound, pool.meta_call(&RenewLeases {}, || "leases".into())).await;
        let reply: LeasesRenewed = match renewal {
            Ok(Ok(reply)) => reply,
            Ok(Err(error)) => {
                tracing::debug!(%error, "renewing the leases failed");
                next = next.min(Instant::now() + RENEWAL_RETRY);
                continue;
            }
            Err(_) => continue,
        };
        if reply.lease_ms == 0 || !reply.renewed || reply.epoch != pool.lease_epoch() {
            // Not polling yet (just connected), or refused for a while: ask again soon.
            next = next.min(Instant::now() + RENEWAL_RETRY);
            continue;
        }
        lease = Duration::from_millis(u64::from(reply.lease_ms));
        // The first reply may shorten the lease assumed so far.
        next = next.min(sent_at + lease / 5);
        let through = reply.revocations_through;
        let epoch = reply.epoch;
        let caught_up = through == 0
            || tokio::time::timeout(
                Duration::from_millis(HANDLER_WAIT_MS * 10),
                handled.wait_for(|(at, id)| *at == epoch && *id >= through),
            )
            .await
            .is_ok_and(|seen| seen.is_ok());
        if !caught_up {
            continue;
        }
        let Some(client) = shared.upgrade() else {
            return;
        };
        client.renewed().note(epoch, sent_at, reply.lease_ms);
    }
}

/// The run of renewals is about to end without a renewal: count on each lease's own time
/// only, and take back everything handed out under leases (as after a restart of the meta
/// server), on a blocking thread nobody waits for: the kernel may hold a directory's lock
/// for a request of this client that waits for this runtime.
fn lapse(client: &impl LeaseHolder) {
    client.renewed().run = None;
    tracing::warn!("the meta server has not renewed this client's leases: dropping its caches");
    if let Some(handler) = client.revocation_handler() {
        tokio::task::spawn_blocking(move || {
            handler(&[Revocation {
                id: 0,
                inode: 0,
                names: Vec::new(),
                attributes: true,
                whole_directory: true,
            }])
        });
    }
}

/// The poll loop: runs until the client is gone. Before a batch is acknowledged, the writes
/// this client has in flight on a file whose attributes are revoked are waited for: a
/// truncation by another client recalls them this way, so that bytes written here before
/// it cannot land after its cuts (the meta server waits for the acknowledgement first).
pub(crate) async fn watch<H: LeaseHolder>(shared: Weak<H>, pool: Arc<Pool>) {
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
        if let Some(handler) = client.recall_handler().filter(|_| !recalled.is_empty()) {
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
            client.recall_writes(*inode).await;
        }
        // A directory's names revoked: no create is answered ahead there any more, and
        // those answered are waited for (the recall of a delegation, see `delegation.rs`).
        let mut directories: Vec<InodeId> = Vec::new();
        for revocation in &revocations {
            if revocation.whole_directory || !revocation.names.is_empty() || revocation.inode == 0 {
                client.delegations().recall(revocation.inode);
                if revocation.inode != 0 {
                    directories.push(revocation.inode);
                }
            }
        }
        if !directories.is_empty() {
            client.delegations().settle(&directories).await;
        }
        let handler = client.revocation_handler();
        drop(client);
        if let Some(handler) = handler {
            let handled = tokio::task::spawn_blocking(move || handler(&revocations));
            // Acknowledged once handled, or after the wait whatever happens (module doc).
            let _ = tokio::time::timeout(Duration::from_millis(HANDLER_WAIT_MS), handled).await;
        }
        acknowledged = acknowledged.max(last.unwrap_or(0));
        if let Some(client) = shared.upgrade() {
            client.handled().send_replace((epoch, acknowledged));
        }
    }
}

/// Bounded memory of revocations for the client.
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
            span_until: None,
        };
        let none = Renewed::default();
        assert!(remaining(&lease, 3, &revoked, &none, &[7, 8], Instant::now()).is_some());
        assert!(
            remaining(&lease, 4, &revoked, &none, &[7], Instant::now()).is_none(),
            "another epoch"
        );
        // A revocation older than the grant does not touch it; a newer one does.
        revoked.note(3, &[revocation(49, 7)]);
        assert!(remaining(&lease, 3, &revoked, &none, &[7], Instant::now()).is_some());
        revoked.note(3, &[revocation(50, 8)]);
        assert!(remaining(&lease, 3, &revoked, &none, &[7], Instant::now()).is_some());
        assert!(remaining(&lease, 3, &revoked, &none, &[7, 8], Instant::now()).is_none());
        let expired = Lease {
            until: Some(Instant::now()),
            ..lease
        };
        assert!(remaining(&expired, 3, &revoked, &none, &[7], Instant::now()).is_none());
        // A new server numbers from 1 again: the old epoch's revocations do not apply.
        let renewed = Lease {
            seq: 10,
            epoch: 4,
            ..lease
        };
        assert!(remaining(&renewed, 4, &revoked, &none, &[8], Instant::now()).is_some());
        revoked.note(4, &[revocation(10, 8)]);
        assert!(remaining(&renewed, 4, &revoked, &none, &[8], Instant::now()).is_none());
        assert!(remaining(&renewed, 4, &revoked, &none, &[7], Instant::now()).is_some());
        assert!(remaining(&Lease::default(), 0, &revoked, &none, &[], Instant::now()).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_keep_leases_good_at_the_start_of_their_run_up_to_the_span() {
        let revoked = Revoked::default();
        let lease = |sent: Instant| Lease {
            until: Some(sent + Duration::from_millis(9_000)),
            seq: 1,
            epoch: 3,
            delegated: false,
            span_until: Some(sent + Duration::from_millis(60_000)),
        };
        let start = Instant::now();
        let old = Lease {
            until: Some(start + Duration::from_millis(100)),
            ..lease(start)
        };
        let held = lease(start);
        let mut renewed = Renewed::default();
        tokio::time::advance(Duration::from_millis(1_000)).await;
        renewed.note(3, Instant::now(), 10_000);
        // Held: kept to the renewal's end (sent now, 90% of 10 s), handed out to its span.
        let left = remaining(&held, 3, &revoked, &renewed, &[7], Instant::now()).unwrap();
        assert_eq!(left, Duration::from_millis(9_000));
        assert_eq!(renewed.spans(&held), held.span_until);
        // Run out before the run began: not kept.
        assert!(remaining(&old, 3, &revoked, &renewed, &[7], Instant::now()).is_none());
        assert_eq!(renewed.spans(&old), None);
        // Another epoch's renewal keeps nothing of this one.
        let other = Lease { epoch: 4, ..held };
        assert_eq!(renewed.spans(&other), None);
        // Renewals every 2 s keep it going, until its span.
        for _ in 0..40 {
            tokio::time::advance(Duration::from_millis(2_000)).await;
            renewed.note(3, Instant::now(), 10_000);
        }
        assert_eq!(Instant::now() - start, Duration::from_millis(81_000));
        assert!(remaining(&held, 3, &revoked, &renewed, &[7], Instant::now()).is_none());
        // A fresh lease is kept by the same run.
        let fresh = lease(Instant::now());
        assert_eq!(renewed.spans(&fresh), fresh.span_until);
        // Close to the run's end the span is not handed out any more; past it, a renewal
        // starts a new run that keeps only leases good at its start.
        tokio::time::advance(Duration::from_millis(7_000)).await;
        assert_eq!(renewed.spans(&fresh), None);
        assert!(remaining(&fresh, 3, &revoked, &renewed, &[7], Instant::now()).is_some());
        tokio::time::advance(Duration::from_millis(3_000)).await;
        assert!(remaining(&fresh, 3, &revoked, &renewed, &[7], Instant::now()).is_none());
        renewed.note(3, Instant::now(), 10_000);
        assert!(remaining(&fresh, 3, &revoked, &renewed, &[7], Instant::now()).is_none());
        // A revocation newer than the grant ends it whatever the run.
        let mut revoked = Revoked::default();
        let newest = lease(Instant::now());
        assert!(remaining(&newest, 3, &revoked, &renewed, &[7], Instant::now()).is_some());
        revoked.note(3, &[revocation(5, 7)]);
        assert!(remaining(&newest, 3, &revoked, &renewed, &[7], Instant::now()).is_none());
    }
}
