//! What an open handle knows of its file's size: the size reads clamp to, the ends of its
//! writes started and acknowledged, a growth waiting for earlier writes, and its size
//! commits and truncations (`size.rs` runs them; this is their state).

use std::collections::BTreeMap;
use tokio::time::Instant;

use freeflow_proto::io::ObjectSpace;

pub(super) struct SizeState {
    /// The size reads clamp to and appends write at: the meta server's size or this
    /// handle's own extension, whichever is larger.
    pub(super) known_size: u64,
    /// Highest end of any write started through this handle.
    pub(super) written_end: u64,
    /// Highest end of any write acknowledged by its server.
    pub(super) acknowledged_end: u64,
    /// A growth without bytes (`FileHandle::extend_to`) waiting for the writes started
    /// before it: (the last of them, the end), joined to `acknowledged_end` once they are
    /// all acknowledged.
    pub(super) pending_extension: Option<(u64, u64)>,
    /// The writes' count (`WriteFlights::started`) when a commit last covered all
    /// of them.
    pub(super) writes_committed: u64,
    pub(super) last_commit: Instant,
    /// Size commits sent and not answered yet (background, flush, fsync, close).
    pub(super) commits_running: u32,
    /// Truncations by this client between their start and their reply: no commit starts
    /// while one is pending.
    pub(super) truncates_pending: u32,
    /// Bumped when a truncation starts; a commit reply of an older epoch is dropped.
    pub(super) truncate_epoch: u64,
    /// The newest space report of each stripe this handle changed (stripe → report), sent
    /// with every size commit so `st_blocks` follows what the servers store. Bounded by the
    /// stripe count.
    pub(super) stripe_space: BTreeMap<u32, ObjectSpace>,
}

impl SizeState {
    /// The state of a handle opened on a file of `size_bytes`.
    pub(super) fn new(size_bytes: u64) -> SizeState {
        SizeState {
            known_size: size_bytes,
            written_end: 0,
            acknowledged_end: 0,
            pending_extension: None,
            writes_committed: 0,
            last_commit: Instant::now(),
            commits_running: 0,
            truncates_pending: 0,
            truncate_epoch: 0,
            stripe_space: BTreeMap::new(),
        }
    }

    /// Keep `space` as stripe `stripe_index`'s report if it is newer than the one kept.
    pub(super) fn note_space(&mut self, stripe_index: u32, space: ObjectSpace) {
        let kept = self.stripe_space.entry(stripe_index).or_default();
        if space.stamp > kept.stamp {
            *kept = space;
        }
    }
}
