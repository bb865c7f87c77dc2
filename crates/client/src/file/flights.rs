//! An open handle's writes as they travel: their sequence numbers, the requests in flight
//! (so an overlapping one waits), those not finished yet, the stripes to sync, the space
//! they charged, and the first failure (kept for every later call). `write.rs` runs them.

use std::collections::{BTreeMap, BTreeSet};

use freeflow_types::limits::IO_REQUEST_BYTES_MAX;
use freeflow_types::InodeId;

use crate::error::ClientError;
use crate::plan::ObjectRequest;

#[derive(Default)]
pub(super) struct WriteFlights {
    /// Count of `write_at` calls (the last write's sequence number).
    pub(super) started: u64,
    pub(super) first_error: Option<ClientError>,
    /// Writes in flight: (stripe index, object offset) → object end. Overlapping entries never
    /// coexist, so the start is a unique key. Bounded by `dirty_bytes_max` / request size.
    pub(super) in_flight: BTreeMap<(u32, u64), u64>,
    /// Writes not finished: sequence number → its requests not finished yet. Bounded by the
    /// writes in flight (each holds dirty bytes) plus the `write_at` calls running.
    pub(super) outstanding: BTreeMap<u64, usize>,
    /// Stripes with a write acknowledged since the last successful sync.
    pub(super) unsynced_stripes: BTreeSet<u32>,
    /// Per stripe, the object end this handle's requests charged space up to (see
    /// `charge_request`; from the size at open, or at the last truncation). Bounded by the
    /// stripe count.
    pub(super) charged_through: BTreeMap<u32, u64>,
}

impl WriteFlights {
    pub(super) fn overlaps_in_flight(&self, request: &ObjectRequest) -> bool {
        // No request is longer than IO_REQUEST_BYTES_MAX, so any overlapping one starts
        // at most that far before this one.
        let lowest_start = request
            .object_offset
            .saturating_sub(u64::from(IO_REQUEST_BYTES_MAX));
        self.in_flight
            .range(
                (request.stripe_index, lowest_start)..(request.stripe_index, request.object_end()),
            )
            .any(|(_, &end)| end > request.object_offset)
    }

    /// Whether every write with a sequence number up to `sequence` has finished.
    pub(super) fn done_through(&self, sequence: u64) -> bool {
        self.outstanding.range(..=sequence).next().is_none()
    }

    pub(super) fn finish_requests(&mut self, sequence: u64, count: usize) {
        if let Some(remaining) = self.outstanding.get_mut(&sequence) {
            *remaining = remaining.saturating_sub(count);
            if *remaining == 0 {
                self.outstanding.remove(&sequence);
            }
        }
    }

    pub(super) fn earlier_write_error(&self, inode: InodeId) -> Option<ClientError> {
        self.first_error
            .as_ref()
            .map(|error| ClientError::EarlierWrite {
                inode,
                source: Box::new(error.clone()),
            })
    }
}
