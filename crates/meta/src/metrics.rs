//! What the metadata server counts as it works (docs/metrics.md lists every name): group
//! commits, their batch sizes and times. The gauges read from its state at each scrape are
//! in `gauges.rs`; requests per operation are counted by the RPC layer into the same registry.

use tokio::time::Instant;

use freeflow_metrics::{Counter, Histogram, Registry, COUNT_BUCKETS, LATENCY_BUCKETS_US};

/// Handles the writer thread updates.
pub struct MetaMetrics {
    commits: Counter,
    durable_commits: Counter,
    commit_failures: Counter,
    batch_operations: Histogram,
    commit_time: Histogram,
    revocations: Counter,
    revocation_expiries: Counter,
    revocation_wait: Histogram,
}

impl MetaMetrics {
    pub fn new(registry: &Registry) -> MetaMetrics {
        MetaMetrics {
            commits: registry.counter(
                "freeflow_meta_commits_total",
                "Write transactions committed by the group-commit writer (one per batch).",
                &[],
            ),
            durable_commits: registry.counter(
                "freeflow_meta_durable_commits_total",
                "Commits made durable (one fsync each): batches that had to be, and the empty \
                 commits that make earlier ones durable (interval, Sync, shutdown).",
                &[],
            ),
            commit_failures: registry.counter(
                "freeflow_meta_commit_failures_total",
                "Batches aborted because the store failed.",
                &[],
            ),
            batch_operations: registry.histogram(
                "freeflow_meta_commit_batch_operations",
                "Mutations applied per group commit.",
                &[],
                COUNT_BUCKETS,
            ),
            commit_time: registry.histogram(
                "freeflow_meta_commit_time_microseconds",
                "Time of one group commit: applying its mutations, then the commit and its fsync.",
                &[],
                LATENCY_BUCKETS_US,
            ),
            revocations: registry.counter(
                "freeflow_meta_revocations_total",
                "Cache revocations sent to clients (one per client and inode) before a \
                 mutation's reply.",
                &[],
            ),
            revocation_expiries: registry.counter(
                "freeflow_meta_revocation_expiries_total",
                "Revocations never acknowledged: the mutation waited for the lease to run out.",
                &[],
            ),
            revocation_wait: registry.histogram(
                "freeflow_meta_revocation_wait_microseconds",
                "Time a mutation waited for other clients to drop what it changed from their \
                 caches (mutations that revoked something).",
                &[],
                LATENCY_BUCKETS_US,
            ),
        }
    }

    /// A mutation sent `sent` revocations, waited since `started`, and `expired` of them
    /// ran out instead of being acknowledged.
    pub fn revoked(&self, sent: usize, expired: usize, started: Instant) {
        self.revocations.add(sent as u64);
        self.revocation_expiries.add(expired as u64);
        self.revocation_wait.observe_duration(started.elapsed());
    }

    /// A commit was made durable (one fsync).
    pub fn durable_commit(&self) {
        self.durable_commits.increment();
    }

    /// A batch of `operations` ended (committed or aborted) after starting at `started`.
    pub fn batch_done(&self, operations: usize, started: Instant, committed: bool) {
        if committed {
            self.commits.increment();
        } else {
            self.commit_failures.increment();
        }
        self.batch_operations.observe(operations as u64);
        self.commit_time.observe_duration(started.elapsed());
    }
}
