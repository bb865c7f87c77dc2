//! What a handle holds of written bytes not sent yet: small writes gathered into one
//! request, and pieces of large writes parked until the rest of their stripe unit comes
//! (plain data; `write.rs` decides when they go).

use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::time::Instant;

use bytes::{Bytes, BytesMut};

/// Writes shorter than this are gathered: a write that starts where the gathered ones end
/// joins them; the gathered bytes go out as one request when a write that cannot join
/// comes, when anything must see them (a read, flush, fsync, close, truncation, fallocate,
/// copy, or another client's recall), or `gather_wait_ms` (client config) after gathering
/// started.
pub const GATHER_WRITE_MAX: usize = 128 << 10;
/// Most bytes gathered before they are sent.
pub const GATHER_BYTES_MAX: usize = 1 << 20;
/// Room first made for gathering (it grows up to `GATHER_BYTES_MAX`).
pub(super) const GATHER_CAPACITY_START: usize = 64 << 10;

/// Most bytes of large writes parked at once, waiting for the rest of their stripe unit
/// (see [`Unsent::parked`]). Units longer than half of it are never parked.
pub const PARKED_BYTES_MAX: usize = 8 << 20;

/// A part of a stripe unit written and not sent yet (see [`Unsent::parked`]).
pub(super) struct ParkedPiece {
    pub(super) data: Bytes,
    /// Memory it holds, counted against `PARKED_BYTES_MAX`: the whole buffer of the write
    /// when it is a slice of it.
    pub(super) held: usize,
    pub(super) since: Instant,
}

/// Whether `start..end` makes whole a stripe unit of `unit` bytes with the `parked`
/// pieces of that unit (it lies inside the unit and overlaps none of them).
pub(super) fn completes_unit(
    parked: &BTreeMap<u64, ParkedPiece>,
    start: u64,
    end: u64,
    unit: u64,
) -> bool {
    let unit_start = start - start % unit;
    let unit_end = unit_start + unit;
    if end <= start || end > unit_end || parked.is_empty() {
        return false;
    }
    let mut covered = end - start;
    for (offset, piece) in parked.range(unit_start..unit_end) {
        let piece_end = *offset + piece.data.len() as u64;
        if *offset < end && piece_end > start {
            return false;
        }
        covered += piece.data.len() as u64;
    }
    covered == unit
}

/// Small adjacent writes gathered into one request.
pub(super) struct Gathered {
    pub(super) offset: u64,
    pub(super) data: GatherBuffer,
}

/// Where gathered bytes (or a stripe unit put together from parked pieces) are kept: in a
/// place of the client's payload area when it shares one with a server of this host (the
/// batch goes from there without another copy, and the place never grows by copying),
/// else on the heap.
pub(super) enum GatherBuffer {
    Heap(BytesMut),
    Shared(freeflow_rpc::shared::PlaceMut),
}

// A place holds a whole gathering.
const _: () = assert!(GATHER_BYTES_MAX <= freeflow_rpc::shared::REGION_SLOT_BYTES);

impl GatherBuffer {
    /// A buffer holding `data`, the first write of a gathering.
    pub(super) fn new(
        area: Option<&Arc<freeflow_rpc::shared::PayloadArea>>,
        data: &[u8],
    ) -> GatherBuffer {
        let mut buffer = GatherBuffer::empty(area, data.len().max(GATHER_CAPACITY_START));
        buffer.extend_from_slice(data);
        buffer
    }

    /// An empty buffer for up to `capacity` bytes: a place of `area` if it holds that
    /// many and one is free, else heap memory of that capacity (it may grow).
    pub(super) fn empty(
        area: Option<&Arc<freeflow_rpc::shared::PayloadArea>>,
        capacity: usize,
    ) -> GatherBuffer {
        let place = area
            .filter(|_| capacity <= freeflow_rpc::shared::REGION_SLOT_BYTES)
            .and_then(|area| area.take());
        match place {
            Some(place) => GatherBuffer::Shared(place),
            None => GatherBuffer::Heap(BytesMut::with_capacity(capacity)),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            GatherBuffer::Heap(bytes) => bytes.len(),
            GatherBuffer::Shared(place) => place.len(),
        }
    }

    /// Callers keep a gathering within `GATHER_BYTES_MAX`.
    pub(super) fn extend_from_slice(&mut self, data: &[u8]) {
        match self {
            GatherBuffer::Heap(bytes) => bytes.extend_from_slice(data),
            GatherBuffer::Shared(place) => place.extend_from_slice(data),
        }
    }

    pub(super) fn freeze(self) -> Bytes {
        match self {
            GatherBuffer::Heap(bytes) => bytes.freeze(),
            GatherBuffer::Shared(place) => place.freeze(),
        }
    }
}

/// Written bytes a handle acknowledged and has not sent yet.
#[derive(Default)]
pub(super) struct Unsent {
    /// Small writes gathered and not sent yet (see [`GATHER_WRITE_MAX`]);
    /// not counted in `writes.started` until they are sent.
    pub(super) gathered: Option<Gathered>,
    /// Bumped each time gathering starts, so a timer sends only what it was set for.
    pub(super) gather_generation: u64,
    /// Pieces of large writes that cover only part of a stripe unit, kept until the rest of
    /// their unit comes (a later write, or one that came first: the mount's session
    /// threads hand the kernel's write-back over out of order), so the unit goes out whole
    /// and aligned: file offset → piece. Pieces never overlap; at most [`PARKED_BYTES_MAX`]
    /// bytes in all; each is sent at most `gather_wait_ms` after it was parked, or as soon
    /// as anything must see it, as gathered bytes are. Never held together with `gathered`
    /// (a small write sends what is parked before it gathers; a large one sends what is
    /// gathered before it parks).
    pub(super) parked: BTreeMap<u64, ParkedPiece>,
    pub(super) parked_bytes: usize,
    /// Whether a timer task is watching the parked pieces' age.
    pub(super) park_timer: bool,
    /// Batches of gathered or parked pieces taken from the handle and not yet all started
    /// (`send_pieces_ordered`): between the two, the bytes are neither held here nor
    /// counted in `writes.started`, and a flush that looked only at those would find
    /// nothing to do and commit no size (a close answered before its write's size
    /// reached the meta server, so the next open saw the file shorter).
    pub(super) batches_in_transit: u32,
}

impl Unsent {
    /// Whether written bytes wait on this handle to be sent (gathered or parked).
    pub(super) fn holds_unsent(&self) -> bool {
        self.gathered.is_some() || !self.parked.is_empty() || self.batches_in_transit > 0
    }

    /// A batch of pieces was just taken (`taken`: not empty) to be sent by
    /// `send_pieces_ordered`, which counts it off.
    pub(super) fn in_transit(&mut self, taken: bool) {
        self.batches_in_transit += u32::from(taken);
    }

    /// If `piece` (at file offset `start`) and the parked pieces of its stripe unit make
    /// the whole unit, take those pieces and return them all in file order (`piece`
    /// among them); None otherwise.
    pub(super) fn take_unit(
        &mut self,
        start: u64,
        piece: &Bytes,
        unit: u64,
    ) -> Option<Vec<(u64, Bytes)>> {
        let unit_start = start - start % unit;
        let unit_end = unit_start + unit;
        let mut covered = piece.len() as u64;
        for (offset, parked) in self.parked.range(unit_start..unit_end) {
            debug_assert!(*offset + parked.data.len() as u64 <= unit_end);
            covered += parked.data.len() as u64;
        }
        // Parked pieces never overlap each other or this one (the overlapped ones were
        // sent first), and none crosses a unit boundary: the lengths tell.
        debug_assert!(covered <= unit, "parked pieces overlap");
        if covered != unit {
            return None;
        }
        let mut pieces = self.take_parked(|offset, _| (unit_start..unit_end).contains(&offset));
        pieces.push((start, piece.clone()));
        pieces.sort_by_key(|(offset, _)| *offset);
        Some(pieces)
    }

    /// Take the parked pieces that `select` keeps, in file order.
    pub(super) fn take_parked(
        &mut self,
        select: impl Fn(u64, &ParkedPiece) -> bool,
    ) -> Vec<(u64, Bytes)> {
        let offsets: Vec<u64> = self
            .parked
            .iter()
            .filter(|(offset, piece)| select(**offset, piece))
            .map(|(offset, _)| *offset)
            .collect();
        offsets
            .into_iter()
            .filter_map(|offset| {
                let piece = self.parked.remove(&offset)?;
                self.parked_bytes -= piece.held;
                Some((offset, piece.data))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(pieces: &[(u64, usize)]) -> BTreeMap<u64, ParkedPiece> {
        pieces
            .iter()
            .map(|&(offset, length)| {
                let piece = ParkedPiece {
                    data: Bytes::from(vec![0u8; length]),
                    held: length,
                    since: Instant::now(),
                };
                (offset, piece)
            })
            .collect()
    }

    /// The short write a direct write from an unaligned buffer ends each unit with makes
    /// the unit whole with its parked piece; a write that leaves a gap, crosses the unit's
    /// end, overlaps a piece or finds nothing parked does not.
    #[test]
    fn a_short_write_completes_the_unit_its_parked_piece_began() {
        let unit = 1 << 20;
        let head = parked(&[(3 * unit, unit as usize - 16)]);
        assert!(completes_unit(&head, 4 * unit - 16, 4 * unit, unit));
        assert!(
            !completes_unit(&head, 4 * unit - 8, 4 * unit, unit),
            "a gap"
        );
        assert!(
            !completes_unit(&head, 4 * unit - 16, 4 * unit + 8, unit),
            "past the unit"
        );
        assert!(
            !completes_unit(&head, 4 * unit - 20, 4 * unit - 4, unit),
            "overlaps"
        );
        assert!(!completes_unit(&BTreeMap::new(), 3 * unit, 4 * unit, unit));
        // Pieces on both sides of the hole.
        let both = parked(&[(0, 100), (200, unit as usize - 200)]);
        assert!(completes_unit(&both, 100, 200, unit));
        assert!(!completes_unit(&both, 100, 150, unit));
        // A piece of another unit does not count.
        let other = parked(&[(unit, unit as usize - 16)]);
        assert!(!completes_unit(&other, unit - 16, unit, unit));
    }
}
