//! The gauges read from the metadata server's state at each scrape (docs/metrics.md lists
//! every name): inodes, orphans, sessions, open handles, servers, the writer's queue, the
//! start-up figures, each member's lag, and the I/O servers' replacement records.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use tokio::time::Instant;

use freeflow_metrics::Registry;

use crate::shared::Shared;

/// Registers the gauges read from the server's state at each scrape. Holds it weakly, so a
/// stopped server is freed.
pub fn register_state_gauges(
    registry: &Arc<Registry>,
    shared: &Arc<Shared>,
    inode_count_at_start: u64,
) {
    let inodes = registry.gauge("freeflow_meta_inodes", "Inodes in use.", &[]);
    let orphans = registry.gauge(
        "freeflow_meta_orphans",
        "Unlinked inodes whose data is still to be removed.",
        &[],
    );
    let sessions = registry.gauge("freeflow_meta_sessions", "Client sessions open.", &[]);
    let handles = registry.gauge(
        "freeflow_meta_open_handles",
        "File handles open, over all sessions.",
        &[],
    );
    let servers_up = registry.gauge(
        "freeflow_meta_io_servers_up",
        "I/O servers heard from within server_down_after_ms.",
        &[],
    );
    let servers_total = registry.gauge("freeflow_meta_io_servers", "I/O servers registered.", &[]);
    let replacements = registry.gauge(
        "freeflow_meta_io_replacements",
        "Records of I/O servers lost for good, drained or rebalanced (each moves stripes to stand-ins).",
        &[],
    );
    let stand_ins_filling = registry.gauge(
        "freeflow_meta_io_stand_ins_filling",
        "Stand-ins still copying the stripes they take (re-replication, drain, rebalance).",
        &[],
    );
    let writer_queue = registry.gauge(
        "freeflow_meta_writer_queue_depth",
        "Mutations queued for the group-commit writer.",
        &[],
    );
    let leases = registry.gauge(
        "freeflow_meta_leases_held",
        "Cache leases clients hold (one per client and inode, names or attributes).",
        &[],
    );
    let lease_clients = registry.gauge(
        "freeflow_meta_lease_clients",
        "Clients polling for revocations (their reads are leased).",
        &[],
    );
    let delegations = registry.gauge(
        "freeflow_meta_delegated_directories",
        "Directories delegated to one client, which answers creates and unlinks there before this server has them.",
        &[],
    );
    let lock_ranges = registry.gauge(
        "freeflow_meta_lock_ranges",
        "Byte-range and flock locks held over the cluster (ranges).",
        &[],
    );
    let ready = registry.gauge(
        "freeflow_meta_ready_milliseconds",
        "Time the server took from start to serving.",
        &[],
    );
    registry
        .gauge(
            "freeflow_meta_start_inodes",
            "Inodes in use when the server started (read from the counters, not counted).",
            &[],
        )
        .set(inode_count_at_start);
    // Replicated metadata: how far each other member's log is behind the leader's, by
    // member as the membership has them (members come and go: a gauge is registered for
    // each member id when it is first seen; one that left keeps its last value).
    let lags: std::sync::Mutex<Vec<(u64, freeflow_metrics::Gauge)>> = Default::default();
    let member_registry: Weak<Registry> = Arc::downgrade(registry);
    let voters = shared.raft.as_ref().map(|_| {
        registry.gauge(
            "freeflow_meta_raft_voters",
            "Members that vote (replicated metadata).",
            &[],
        )
    });
    let learners = shared.raft.as_ref().map(|_| {
        registry.gauge(
            "freeflow_meta_raft_learners",
            "Members catching up without a vote (replicated metadata).",
            &[],
        )
    });
    let term = shared.raft.as_ref().map(|_| {
        registry.gauge(
            "freeflow_meta_raft_term",
            "The Raft term this server leads in (replicated metadata).",
            &[],
        )
    });
    let shared: Weak<Shared> = Arc::downgrade(shared);
    registry.on_render(move || {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        inodes.set(shared.inode_count.load(Ordering::Relaxed));
        orphans.set(shared.orphan_count.load(Ordering::Relaxed));
        ready.set(shared.ready_ms.load(Ordering::Relaxed));
        leases.set(shared.leases.held() as u64);
        lease_clients.set(shared.leases.client_count() as u64);
        delegations.set(shared.leases.delegation_count() as u64);
        lock_ranges.set(shared.locks.range_count() as u64);
        {
            let sessions_now = shared.sessions();
            sessions.set(sessions_now.session_count() as u64);
            handles.set(sessions_now.handle_count() as u64);
        }
        let totals = shared.registry().totals(Instant::now());
        servers_up.set(u64::from(totals.servers_up));
        servers_total.set(u64::from(totals.servers_total));
        let (filling, _) = shared.registry().replacement_progress();
        replacements.set(shared.registry().service_map().replacements.len() as u64);
        stand_ins_filling.set(filling as u64);
        let queued = shared
            .config
            .commit_queue_max
            .saturating_sub(shared.writer.capacity());
        writer_queue.set(queued as u64);
        let members = shared.meta_members();
        let mut lags = lags.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for member in members.iter().filter(|member| !member.leader) {
            if !lags.iter().any(|(id, _)| *id == member.id) {
                let Some(registry) = member_registry.upgrade() else {
                    continue;
                };
                // Label values must be static: one small string per member id ever seen.
                let label: &'static str = Box::leak(member.id.to_string().into_boxed_str());
                let gauge = registry.gauge(
                    "freeflow_meta_raft_follower_lag_entries",
                    "Log entries a follower or learner of this leader is behind it (replicated metadata).",
                    &[("member", label)],
                );
                lags.push((member.id, gauge));
            }
            if let Some((_, gauge)) = lags.iter().find(|(id, _)| *id == member.id) {
                gauge.set(member.lag_entries.unwrap_or(u64::MAX));
            }
        }
        if let Some(term) = &term {
            if let Some(member) = members.first() {
                term.set(member.term);
            }
        }
        if let (Some(voters), Some(learners)) = (&voters, &learners) {
            let voting = members.iter().filter(|member| member.voter).count() as u64;
            voters.set(voting);
            learners.set(members.len() as u64 - voting);
        }
    });
}
