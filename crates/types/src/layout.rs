//! Data layout of a file and the stripe arithmetic.
//!
//! A file is cut into stripe units of `stripe_unit_bytes`. Unit `k` is stored on stripe
//! `k % stripe_count`, i.e. on server `servers[k % stripe_count]`, in that stripe's object
//! at offset `(k / stripe_count) * stripe_unit_bytes`. In bytes: logical offset `o` lives
//! in stripe `(o / unit) % count` at object offset `(o / (unit * count)) * unit + o % unit`.
//! These functions are the single definition of that mapping; the client, the I/O servers
//! and the tools all call them.

use serde::{Deserialize, Serialize};

use crate::limits::{
    FILE_SIZE_MAX, REPLICAS_MAX, STRIPE_COUNT_MAX, STRIPE_UNIT_BYTES_MAX, STRIPE_UNIT_BYTES_MIN,
};
use crate::{InodeId, ServerId};

/// Where a regular file's data lives.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    pub stripe_unit_bytes: u32,
    /// The servers holding stripes 0, 1, 2, ... in order (each stripe's first copy, the
    /// head of its chain). Its length is the stripe count.
    pub servers: Vec<ServerId>,
    /// The further copies of each stripe when the file is replicated (DESIGN.md §7): stripe
    /// `s` is kept on the chain `servers[s]`, then `copies[s * (r - 1) .. (s + 1) * (r - 1)]`
    /// in order, `r` being [`Layout::replicas`]. Empty: one copy of each stripe.
    pub copies: Vec<ServerId>,
}

/// One stripe object: the part of a file kept by one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectId {
    pub inode: InodeId,
    pub stripe_index: u32,
}

/// One contiguous piece of a file range that falls inside a single stripe unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeChunk {
    pub stripe_index: u32,
    pub object_offset: u64,
    pub file_offset: u64,
    pub length: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    StripeUnitOutOfRange(u32),
    StripeUnitNotPowerOfTwo(u32),
    StripeCountOutOfRange(usize),
    DuplicateServer(ServerId),
    /// The copies do not give every stripe the same number of further servers, or more
    /// than [`REPLICAS_MAX`] in all.
    ReplicasOutOfRange(usize),
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutError::StripeUnitOutOfRange(unit) => write!(
                f,
                "stripe unit {unit} bytes is outside {STRIPE_UNIT_BYTES_MIN}..={STRIPE_UNIT_BYTES_MAX}"
            ),
            LayoutError::StripeUnitNotPowerOfTwo(unit) => {
                write!(f, "stripe unit {unit} bytes is not a power of two")
            }
            LayoutError::StripeCountOutOfRange(count) => {
                write!(f, "stripe count {count} is outside 1..={STRIPE_COUNT_MAX}")
            }
            LayoutError::DuplicateServer(server) => {
                write!(f, "server {server} appears twice in one layout or chain")
            }
            LayoutError::ReplicasOutOfRange(copies) => write!(
                f,
                "{copies} further copies do not give each stripe the same number of copies in 1..={REPLICAS_MAX}"
            ),
        }
    }
}

impl std::error::Error for LayoutError {}

impl Layout {
    /// A layout after checking it; every layout that reaches disk or wire passed this.
    pub fn new(stripe_unit_bytes: u32, servers: Vec<ServerId>) -> Result<Layout, LayoutError> {
        Layout::replicated(stripe_unit_bytes, servers, Vec::new())
    }

    /// A layout whose stripes are kept on chains of servers: `servers` are the heads,
    /// `copies` the further members, `replicas - 1` per stripe in stripe order.
    pub fn replicated(
        stripe_unit_bytes: u32,
        servers: Vec<ServerId>,
        copies: Vec<ServerId>,
    ) -> Result<Layout, LayoutError> {
        let layout = Layout {
            stripe_unit_bytes,
            servers,
            copies,
        };
        layout.validate()?;
        Ok(layout)
    }

    pub fn validate(&self) -> Result<(), LayoutError> {
        let unit = self.stripe_unit_bytes;
        if !(STRIPE_UNIT_BYTES_MIN..=STRIPE_UNIT_BYTES_MAX).contains(&unit) {
            return Err(LayoutError::StripeUnitOutOfRange(unit));
        }
        if !unit.is_power_of_two() {
            return Err(LayoutError::StripeUnitNotPowerOfTwo(unit));
        }
        let count = self.servers.len();
        if count == 0 || count > STRIPE_COUNT_MAX as usize {
            return Err(LayoutError::StripeCountOutOfRange(count));
        }
        for (index, server) in self.servers.iter().enumerate() {
            if self.servers[..index].contains(server) {
                return Err(LayoutError::DuplicateServer(*server));
            }
        }
        let further = self.copies.len();
        if !further.is_multiple_of(count) || further / count + 1 > REPLICAS_MAX as usize {
            return Err(LayoutError::ReplicasOutOfRange(further));
        }
        for stripe in 0..count as u32 {
            let chain = self.chain(stripe);
            for (index, server) in chain.iter().enumerate() {
                if chain[..index].contains(server) {
                    return Err(LayoutError::DuplicateServer(*server));
                }
            }
        }
        Ok(())
    }

    /// How many copies each stripe has (1: not replicated).
    pub fn replicas(&self) -> u32 {
        (self.copies.len() / self.servers.len().max(1)) as u32 + 1
    }

    /// The chain keeping stripe `stripe_index`: its head first, then its further copies in
    /// the order writes are forwarded. Empty for a stripe the layout does not have.
    pub fn chain(&self, stripe_index: u32) -> Vec<ServerId> {
        let Some(&head) = self.servers.get(stripe_index as usize) else {
            return Vec::new();
        };
        let further = self.replicas() as usize - 1;
        let start = stripe_index as usize * further;
        let mut chain = Vec::with_capacity(further + 1);
        chain.push(head);
        chain.extend(self.copies.get(start..start + further).unwrap_or(&[]));
        chain
    }

    /// Whether `server` keeps a copy of stripe `stripe_index`.
    pub fn keeps(&self, stripe_index: u32, server: ServerId) -> bool {
        self.chain(stripe_index).contains(&server)
    }

    /// Every (stripe, server) pair the layout stores an object on.
    pub fn placements(&self) -> Vec<(u32, ServerId)> {
        (0..self.stripe_count())
            .flat_map(|stripe| {
                self.chain(stripe)
                    .into_iter()
                    .map(move |server| (stripe, server))
            })
            .collect()
    }

    pub fn stripe_count(&self) -> u32 {
        self.servers.len() as u32
    }

    fn unit(&self) -> u64 {
        u64::from(self.stripe_unit_bytes)
    }

    /// The stripe and object offset holding logical byte `offset`.
    pub fn locate(&self, offset: u64) -> (u32, u64) {
        let unit = self.unit();
        let count = u64::from(self.stripe_count());
        let unit_index = offset / unit;
        let stripe_index = (unit_index % count) as u32;
        let object_offset = (unit_index / count) * unit + offset % unit;
        (stripe_index, object_offset)
    }

    /// The logical file offset of byte `object_offset` of stripe `stripe_index`
    /// (the inverse of [`Layout::locate`]).
    pub fn file_offset(&self, stripe_index: u32, object_offset: u64) -> u64 {
        let unit = self.unit();
        let count = u64::from(self.stripe_count());
        let row = object_offset / unit;
        (row * count + u64::from(stripe_index)) * unit + object_offset % unit
    }

    /// The pieces of the file range `[offset, offset + length)`, in file order, each inside
    /// one stripe unit.
    pub fn chunks(&self, offset: u64, length: u64) -> impl Iterator<Item = StripeChunk> + '_ {
        let end = offset.saturating_add(length).min(FILE_SIZE_MAX.max(offset));
        let unit = self.unit();
        let mut cursor = offset;
        std::iter::from_fn(move || {
            if cursor >= end {
                return None;
            }
            let unit_end = (cursor / unit + 1) * unit;
            let piece_end = unit_end.min(end);
            let (stripe_index, object_offset) = self.locate(cursor);
            let chunk = StripeChunk {
                stripe_index,
                object_offset,
                file_offset: cursor,
                length: piece_end - cursor,
            };
            cursor = piece_end;
            Some(chunk)
        })
    }

    /// How long stripe `stripe_index`'s object is when the file is `file_size` bytes and
    /// fully written: the length each object is cut to by a truncate to `file_size`.
    pub fn object_length(&self, file_size: u64, stripe_index: u32) -> u64 {
        let unit = self.unit();
        let count = u64::from(self.stripe_count());
        let full_rows = file_size / (unit * count);
        let remainder = file_size % (unit * count);
        let stripe_start = u64::from(stripe_index) * unit;
        let tail = remainder.saturating_sub(stripe_start).min(unit);
        full_rows * unit + tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout_strategy() -> impl Strategy<Value = Layout> {
        (12u32..=23, 1usize..=16).prop_map(|(shift, count)| {
            Layout::new(1 << shift, (0..count as u32).map(|s| s * 7 + 3).collect()).unwrap()
        })
    }

    #[test]
    fn mapping_matches_the_design_formula_on_known_points() {
        let layout = Layout::new(1 << 20, vec![10, 11, 12, 13]).unwrap();
        assert_eq!(layout.locate(0), (0, 0));
        assert_eq!(layout.locate((1 << 20) - 1), (0, (1 << 20) - 1));
        assert_eq!(layout.locate(1 << 20), (1, 0));
        assert_eq!(layout.locate(4 << 20), (0, 1 << 20));
        assert_eq!(layout.locate((5 << 20) + 17), (1, (1 << 20) + 17));
    }

    #[test]
    fn invalid_layouts_are_refused() {
        assert_eq!(
            Layout::new(1000, vec![1]),
            Err(LayoutError::StripeUnitOutOfRange(1000))
        );
        assert_eq!(
            Layout::new(12288, vec![1]),
            Err(LayoutError::StripeUnitNotPowerOfTwo(12288))
        );
        assert_eq!(
            Layout::new(4096, vec![]),
            Err(LayoutError::StripeCountOutOfRange(0))
        );
        assert_eq!(
            Layout::new(4096, vec![1, 2, 1]),
            Err(LayoutError::DuplicateServer(1))
        );
    }

    #[test]
    fn chains_of_a_replicated_layout() {
        let layout = Layout::replicated(4096, vec![1, 2, 3], vec![2, 3, 1]).unwrap();
        assert_eq!(layout.replicas(), 2);
        assert_eq!(layout.chain(0), vec![1, 2]);
        assert_eq!(layout.chain(2), vec![3, 1]);
        assert!(layout.chain(3).is_empty());
        assert!(layout.keeps(1, 3) && !layout.keeps(1, 1));
        assert_eq!(layout.placements().len(), 6);
        let single = Layout::new(4096, vec![4]).unwrap();
        assert_eq!((single.replicas(), single.chain(0)), (1, vec![4]));
        assert_eq!(
            Layout::replicated(4096, vec![1, 2], vec![2, 1, 3]),
            Err(LayoutError::ReplicasOutOfRange(3))
        );
        assert_eq!(
            Layout::replicated(4096, vec![1, 2], vec![1, 3]),
            Err(LayoutError::DuplicateServer(1))
        );
        assert_eq!(
            Layout::replicated(4096, vec![1], vec![2, 3, 4, 5]),
            Err(LayoutError::ReplicasOutOfRange(4))
        );
    }

    #[test]
    fn object_length_of_a_partial_last_row() {
        let layout = Layout::new(4096, vec![0, 1, 2]).unwrap();
        // 2 full rows (24 KiB) and 5000 more bytes: stripe 0 gets 4096, stripe 1 gets 904.
        let size = 2 * 3 * 4096 + 5000;
        assert_eq!(layout.object_length(size, 0), 2 * 4096 + 4096);
        assert_eq!(layout.object_length(size, 1), 2 * 4096 + 904);
        assert_eq!(layout.object_length(size, 2), 2 * 4096);
        assert_eq!(layout.object_length(0, 1), 0);
    }

    proptest! {
        #[test]
        fn locate_matches_formula_and_inverts(layout in layout_strategy(), offset in 0u64..(1 << 44)) {
            let unit = u64::from(layout.stripe_unit_bytes);
            let count = u64::from(layout.stripe_count());
            let (stripe, object_offset) = layout.locate(offset);
            prop_assert_eq!(u64::from(stripe), (offset / unit) % count);
            prop_assert_eq!(object_offset, (offset / (unit * count)) * unit + offset % unit);
            prop_assert_eq!(layout.file_offset(stripe, object_offset), offset);
        }

        #[test]
        fn chunks_tile_the_range_exactly(layout in layout_strategy(), offset in 0u64..(1 << 36), length in 0u64..(1 << 26)) {
            let unit = u64::from(layout.stripe_unit_bytes);
            let mut expected_offset = offset;
            for chunk in layout.chunks(offset, length) {
                prop_assert_eq!(chunk.file_offset, expected_offset);
                prop_assert!(chunk.length > 0 && chunk.length <= unit);
                // A chunk never crosses a stripe-unit boundary.
                prop_assert_eq!(chunk.file_offset / unit, (chunk.file_offset + chunk.length - 1) / unit);
                prop_assert_eq!(layout.locate(chunk.file_offset), (chunk.stripe_index, chunk.object_offset));
                expected_offset += chunk.length;
            }
            prop_assert_eq!(expected_offset, offset + length);
        }

        #[test]
        fn object_lengths_sum_to_the_file_size(layout in layout_strategy(), size in 0u64..(1 << 40)) {
            let total: u64 = (0..layout.stripe_count()).map(|s| layout.object_length(size, s)).sum();
            prop_assert_eq!(total, size);
            // The last byte of the file is inside its object's length.
            if size > 0 {
                let (stripe, object_offset) = layout.locate(size - 1);
                prop_assert_eq!(layout.object_length(size, stripe), object_offset + 1);
            }
        }
    }
}
