//! The orphan reaper: removes the data of unlinked files from the I/O servers, then forgets
//! the orphan.
//!
//! No orphan is reaped during the recovery window after a start (clients reclaim their
//! open handles then, `ReclaimSession`). An orphan is reaped when no handle is open on it,
//! and, if it was orphaned before this
//! start of the server (an older boot epoch), once one lease has passed since the start:
//! clients that had it open cannot know the server restarted until their lease runs out.
//! For each orphan the reaper sends `RemoveObjects` to every server of its layout; only when
//! all succeeded does it delete the orphan record and the inode (through the writer, in one
//! transaction). A server that is down is retried later with a bounded backoff; orphans
//! survive crashes in the `orphans` table.
//!
//! Each pass first retries pending truncations (cuts a set-attributes could not make
//! because a server was unreachable; they survive crashes in the `truncations` table), only
//! on servers that are up. A returning server's registration makes the cuts it owes
//! before it is answered (`cuts_owed_by`), and the server serves no data until then (see
//! `cutter.rs`). Inodes pinned by
//! a set-attributes in flight are left alone, both their cuts and their orphan data.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::io::RemoveObjects;
use freeflow_proto::meta::ServiceMap;
use freeflow_types::{InodeId, ObjectId, ServerId};
use tokio::task::JoinSet;

use crate::cutter::{carry_out, Reach};
use crate::ops::orphan::{forget_orphan, list_orphans};
use crate::ops::truncate::{list_truncations, load_truncation, settle_truncation};
use crate::ops::try_load_inode;
use crate::records::{OrphanRecord, TruncationRecord};
use crate::shared::Shared;

/// Orphans read from the store per page of a pass.
pub const REAP_PAGE_ORPHANS: usize = 256;
/// Pending truncations read from the store per page of a pass.
pub const CUT_PAGE_TRUNCATIONS: usize = 256;
/// Shortest and longest wait before retrying after a failure.
pub const RETRY_DELAY_MIN_MS: u64 = 100;
pub const RETRY_DELAY_MAX_MS: u64 = 10_000;
/// Time between passes when nothing wakes the reaper (catches anything missed).
pub const IDLE_PASS_INTERVAL_MS: u64 = 30_000;

/// The stripes each server of a layout holds, as the service map makes the chains (a lost
/// server's stand-in in its place; the lost server empties itself if it comes back).
pub fn stripes_by_server(
    map: &ServiceMap,
    inode: InodeId,
    orphan: &OrphanRecord,
) -> BTreeMap<ServerId, Vec<u32>> {
    let mut by_server: BTreeMap<ServerId, Vec<u32>> = BTreeMap::new();
    for (stripe, server) in map.placements(inode, &orphan.layout) {
        by_server.entry(server).or_default().push(stripe);
    }
    by_server
}

async fn remove_data(shared: &Shared, inode: InodeId, orphan: &OrphanRecord) -> Result<(), String> {
    let map = shared.registry().service_map();
    for (server, stripes) in stripes_by_server(&map, inode, orphan) {
        let address = shared
            .registry()
            .address(server)
            .ok_or_else(|| format!("server {server} is not registered"))?;
        let connection = shared.io.get(server, &address).await?;
        connection
            .call(&RemoveObjects { inode, stripes }, bytes::Bytes::new())
            .await
            .map_err(|error| format!("server {server}: {error}"))?;
    }
    Ok(())
}

/// What one pass found.
#[derive(Default)]
struct PassOutcome {
    failed: bool,
    /// Orphans from an older epoch still waiting for the lease after start.
    waiting_for_lease: bool,
}

/// What to do with one pending truncation.
enum CutStep {
    /// Send the cuts.
    Cut,
    /// Unlinked and not open: the orphan pass removes the objects whole.
    LeaveToOrphanPass,
    /// The inode is gone, and its objects with it.
    Forget,
}

/// Retry the pending truncations; true if some are still pending.
async fn cut_pass(shared: &Arc<Shared>) -> bool {
    let mut pending = false;
    let mut after = None;
    loop {
        let page = match shared.read(|read| list_truncations(read, after, CUT_PAGE_TRUNCATIONS)) {
            Ok(page) => page,
            Err(error) => {
                tracing::warn!(%error, "reaper cannot list pending truncations");
                return true;
            }
        };
        let Some((last, _)) = page.last() else {
            return pending;
        };
        after = Some(*last);
        let page_len = page.len();
        for (inode, record) in page {
            if !retry_cuts(shared, inode, &record).await {
                pending = true;
            }
        }
        if page_len < CUT_PAGE_TRUNCATIONS {
            return pending;
        }
    }
}

/// Make the pending cuts that `server` owes (files shrunk while it could not be reached)
/// and return how many truncations still owe it a cut. Truncations a set-attributes is
/// carrying out right now are not owed: it makes their cuts itself. The registration of `server` calls
/// this before answering, and the server serves no data until the answer is 0: a client
/// write accepted before such a cut would be destroyed by it.
pub async fn cuts_owed_by(shared: &Arc<Shared>, server: ServerId) -> u32 {
    // A member of a replicated stripe that confirmed its cut owes nothing while a
    // partner's cut is still pending.
    let map = shared.registry().service_map();
    let owes = |inode: InodeId, record: &TruncationRecord| {
        let confirmed = shared.cuts_confirmed();
        let done = confirmed.get(&(inode, record.generation));
        record.cuts.iter().any(|(stripe, _)| {
            let object = ObjectId {
                inode,
                stripe_index: *stripe,
            };
            map.keeps(object, &record.layout, server)
                && !done.is_some_and(|done| done.contains(&(*stripe, server)))
        })
    };
    let mut owed = 0u32;
    let mut after = None;
    loop {
        let page = match shared.read(|read| list_truncations(read, after, CUT_PAGE_TRUNCATIONS)) {
            Ok(page) => page,
            Err(error) => {
                tracing::warn!(%error, server, "cannot list the cuts a registering server owes");
                return owed.max(1);
            }
        };
        let Some((last, _)) = page.last() else {
            return owed;
        };
        after = Some(*last);
        let page_len = page.len();
        for (inode, record) in page
            .into_iter()
            .filter(|(inode, record)| owes(*inode, record))
        {
            // A set-attributes in flight makes these cuts itself, ordered after the writes
            // it recalls. Counting them would close this server's gate under those very
            // writes, which would then land after the cut.
            if shared.size_change_pinned(inode) {
                continue;
            }
            if retry_cuts(shared, inode, &record).await {
                continue;
            }
            // Not all done: some other server may be the one still missing.
            match shared.read(|read| Ok(load_truncation(read, inode)?)) {
                Ok(Some(record)) if !owes(inode, &record) => {}
                Ok(None) => {}
                _ => owed = owed.saturating_add(1),
            }
        }
        if page_len < CUT_PAGE_TRUNCATIONS {
            return owed;
        }
    }
}

/// Retry the cuts of one truncation; true if none is pending any more (or they are not
/// the reaper's to make). `listed` is the record as the pass listed it, before the pin:
/// the record is read again under the pin, because a set-attributes that held the pin
/// meanwhile may have made and settled these cuts, answered, and let its client write past
/// them (cutting again from the listed record would destroy those bytes).
async fn retry_cuts(shared: &Arc<Shared>, inode: InodeId, listed: &TruncationRecord) -> bool {
    // A set-attributes in flight on this inode makes (or will make) these cuts itself.
    let Some(pin) = shared.try_pin_cuts(inode) else {
        return false;
    };
    let _exclusive = pin.exclusive().await;
    let step = shared.read(|read| {
        let Some(record) = load_truncation(read, inode)? else {
            return Ok(None);
        };
        let step = match try_load_inode(read, inode)? {
            None => CutStep::Forget,
            Some(found) if found.attr.link_count == 0 && !shared.sessions().is_open(inode) => {
                CutStep::LeaveToOrphanPass
            }
            Some(_) => CutStep::Cut,
        };
        Ok(Some((step, record)))
    });
    let (step, record) = match step {
        Ok(None) => {
            tracing::debug!(
                inode,
                generation = listed.generation,
                "pending cuts were made and settled by their truncation meanwhile"
            );
            return true;
        }
        Ok(Some((step, record))) => (Ok(step), record),
        Err(error) => (Err(error), listed.clone()),
    };
    let record = &record;
    match step {
        Err(error) => {
            tracing::warn!(inode, %error, "reaper cannot read an inode with pending cuts");
            false
        }
        Ok(CutStep::LeaveToOrphanPass) => true,
        Ok(CutStep::Forget) => {
            let (generation, stripes): (u64, Vec<u32>) = (
                record.generation,
                record.cuts.iter().map(|(stripe, _)| *stripe).collect(),
            );
            shared
                .write(move |write, _| settle_truncation(write, inode, generation, &stripes))
                .await
                .is_ok()
        }
        Ok(CutStep::Cut) => match carry_out(shared, inode, record, Reach::UpOnly).await {
            Ok(()) => {
                tracing::info!(inode, "pending cuts made");
                true
            }
            Err(error) => {
                tracing::debug!(inode, %error, "cuts still pending; will retry");
                false
            }
        },
    }
}

async fn pass(shared: &Arc<Shared>) -> PassOutcome {
    let mut outcome = PassOutcome::default();
    let lease = Duration::from_millis(u64::from(shared.config.lease_ms));
    let old_epoch_ready = shared.started.elapsed() >= lease;
    let concurrency = shared.config.reap_concurrency_max.max(1);
    let mut after = None;
    loop {
        let page = match shared.read(|read| list_orphans(read, after, REAP_PAGE_ORPHANS)) {
            Ok(page) => page,
            Err(error) => {
                tracing::warn!(%error, "reaper cannot list orphans");
                outcome.failed = true;
                return outcome;
            }
        };
        let Some((last, _)) = page.last() else {
            return outcome;
        };
        after = Some(*last);
        let page_len = page.len();
        // An unlink is answered before it is durable: its data goes only once it is (a
        // crash before would bring the name back without its data). Waited for, not
        // forced: the periodic flush makes it durable within the commit interval, and
        // removing data is never urgent enough for an fsync of its own.
        shared
            .wait_durable(shared.last_txn.load(std::sync::atomic::Ordering::Acquire))
            .await;
        let mut tasks = JoinSet::new();
        for (inode, orphan) in page {
            if shared.sessions().is_open(inode) || shared.is_pinned(inode) {
                continue;
            }
            if orphan.boot_epoch < shared.boot_epoch && !old_epoch_ready {
                outcome.waiting_for_lease = true;
                continue;
            }
            while tasks.len() >= concurrency {
                if let Some(Ok(false)) = tasks.join_next().await {
                    outcome.failed = true;
                }
            }
            let shared = shared.clone();
            tasks.spawn(async move {
                if let Err(reason) = remove_data(&shared, inode, &orphan).await {
                    tracing::debug!(inode, %reason, "orphan data not removed yet; will retry");
                    return false;
                }
                match shared
                    .write(move |write, context| forget_orphan(write, context, inode))
                    .await
                {
                    Ok(_) => true,
                    Err(error) => {
                        tracing::warn!(inode, %error, "cannot forget reaped orphan");
                        false
                    }
                }
            });
        }
        while let Some(result) = tasks.join_next().await {
            if !matches!(result, Ok(true)) {
                outcome.failed = true;
            }
        }
        if page_len < REAP_PAGE_ORPHANS {
            return outcome;
        }
    }
}

/// The reaper task; runs until aborted.
pub async fn run(shared: Arc<Shared>) {
    let lease = Duration::from_millis(u64::from(shared.config.lease_ms));
    let mut retry_delay_ms = RETRY_DELAY_MIN_MS;
    loop {
        if shared.closing.load(Ordering::Acquire) {
            return;
        }
        let cuts_pending = cut_pass(&shared).await;
        let mut outcome = if shared.orphan_count.load(Ordering::Relaxed) > 0 {
            // Inside the recovery window clients take back the handles they hold, while
            // replayed unlinks make orphans of this run: none is reaped before it ends.
            shared.recovery.wait().await;
            pass(&shared).await
        } else {
            PassOutcome::default()
        };
        outcome.failed |= cuts_pending;
        let wait = if outcome.failed {
            let wait = Duration::from_millis(retry_delay_ms);
            retry_delay_ms = (retry_delay_ms * 2).min(RETRY_DELAY_MAX_MS);
            wait
        } else {
            retry_delay_ms = RETRY_DELAY_MIN_MS;
            if outcome.waiting_for_lease {
                let elapsed = shared.started.elapsed();
                lease.saturating_sub(elapsed) + Duration::from_millis(RETRY_DELAY_MIN_MS)
            } else {
                Duration::from_millis(IDLE_PASS_INTERVAL_MS)
            }
        };
        let deadline = Instant::now() + wait;
        tokio::select! {
            _ = shared.reaper_wake.notified() => {}
            _ = tokio::time::sleep_until(deadline) => {}
        }
    }
}
