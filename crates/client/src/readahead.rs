//! Read-ahead for sequential readers of a handle (`ClientConfig::readahead_bytes`).
//!
//! A read that takes the handle's reads further (starting at most [`SEQUENTIAL_SLACK`] past
//! where they reached), or starts at most that far behind in a piece already fetched ahead
//! (the kernel sends a mount several reads of its read-ahead window at once, and they reach
//! the handle in any order), is sequential: the handle then fetches the
//! next `readahead_bytes` of the file ahead of the reader, in pieces of one stripe row (so
//! every server of the layout reads at once), each on a task of its own. A piece stays until
//! the reads have gone [`SEQUENTIAL_SLACK`] past it, and any number of reads share it (each
//! waits for it while it is on its way); any other read drops them all.
//!
//! What was fetched must never be read in place of what this handle wrote: every change
//! made through the handle (a write, a truncation, fallocate, a copy into it) and every
//! recall of the file by another client's change drops the pieces, and nothing is
//! fetched ahead while a write of the handle is gathered, parked or in flight. Other clients'
//! writes are seen at the next open, as without read-ahead (close-to-open).
//!
//! Bounded per handle by `readahead_bytes` and over the client by
//! [`READAHEAD_CLIENT_BYTES_MAX`] (a piece that finds no room is not fetched ahead).

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use futures::future::{BoxFuture, FutureExt, Shared};
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::{AbortHandle, JoinHandle};

use crate::error::ClientError;

/// Most bytes fetched ahead over all handles of a client.
pub const READAHEAD_CLIENT_BYTES_MAX: usize = 256 << 20;

/// How far from where a handle's reads have reached a read may start and still count as
/// sequential (see `ReadAhead::follows`): twice the kernel's read-ahead window on a mount
/// (the mount raises its bdi to `BDI_READAHEAD_KIB`, 4 MiB).
pub const SEQUENTIAL_SLACK: u64 = 8 << 20;

/// A piece's bytes once fetched (None: the fetch failed or was stopped; fetch the range
/// again), for any number of reads at once.
pub(crate) type Fetched = Shared<BoxFuture<'static, Option<Segments>>>;

/// A piece fetched ahead or on its way, by its index (file offset / piece size). Dropping
/// it stops its fetch and gives its room back; reads waiting for it then get None.
pub(crate) struct Piece {
    pub fetched: Fetched,
    task: AbortHandle,
    _room: OwnedSemaphorePermit,
}

impl Piece {
    /// A piece whose bytes `task` fetches, holding `room` in the client's bound.
    pub fn new(
        task: JoinHandle<Result<Segments, ClientError>>,
        room: OwnedSemaphorePermit,
    ) -> Piece {
        let abort = task.abort_handle();
        let fetched = async move { task.await.ok().and_then(Result::ok) }
            .boxed()
            .shared();
        Piece {
            fetched,
            task: abort,
            _room: room,
        }
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A file range as the servers' replies gave it: one part per request, in file order,
/// contiguous, never copied together. A read inside one part (a kernel read of 1 MiB at a
/// 1 MiB boundary of a layout with 1 MiB units) is a view of it; only a read across parts
/// copies, and only its own bytes (a piece used to be copied whole into one buffer, after
/// zeroing it: two passes over every byte read ahead).
#[derive(Clone, Debug, Default)]
pub(crate) struct Segments {
    /// (file offset, bytes), by offset; each part starts where the one before ends.
    parts: Vec<(u64, Bytes)>,
}

impl Segments {
    /// Append `bytes` at the end (`offset` must be where the parts end).
    pub fn push(&mut self, offset: u64, bytes: Bytes) {
        debug_assert_eq!(offset, self.end(offset), "parts are contiguous");
        if !bytes.is_empty() {
            self.parts.push((offset, bytes));
        }
    }

    /// Where the parts end (`or` when there are none).
    fn end(&self, or: u64) -> u64 {
        self.parts
            .last()
            .map_or(or, |(start, bytes)| start + bytes.len() as u64)
    }

    pub fn len(&self) -> usize {
        self.parts.iter().map(|(_, bytes)| bytes.len()).sum()
    }

    /// The bytes of `[from, to)`, which the parts hold: a view of one part when it holds
    /// them all, else one copy of them.
    pub fn range(&self, from: u64, to: u64) -> Bytes {
        let first = self
            .parts
            .iter()
            .find(|(start, bytes)| *start < to && start + bytes.len() as u64 > from);
        if let Some((start, bytes)) = first {
            if *start <= from && start + bytes.len() as u64 >= to {
                return bytes.slice((from - start) as usize..(to - start) as usize);
            }
        }
        let mut buffer = BytesMut::with_capacity(to.saturating_sub(from) as usize);
        self.copy_into(from, to, &mut buffer);
        buffer.freeze()
    }

    /// Append views of the bytes of `[from, to)` these parts hold to `into` (no copy).
    /// False, and nothing appended, where they would not continue `into`'s parts (a gap).
    pub fn views_into(&self, from: u64, to: u64, into: &mut Segments) -> bool {
        for (start, bytes) in &self.parts {
            let end = start + bytes.len() as u64;
            if *start < to && end > from {
                let at = from.max(*start);
                if !into.parts.is_empty() && into.end(at) != at {
                    return false;
                }
                into.push(
                    at,
                    bytes.slice((at - start) as usize..(to.min(end) - start) as usize),
                );
            }
        }
        true
    }

    /// The parts' bytes, in file order.
    pub fn into_parts(self) -> Vec<Bytes> {
        self.parts.into_iter().map(|(_, bytes)| bytes).collect()
    }

    /// Copy the bytes of `[from, to)` these parts hold onto `buffer`.
    pub fn copy_into(&self, from: u64, to: u64, buffer: &mut BytesMut) {
        for (start, bytes) in &self.parts {
            let end = start + bytes.len() as u64;
            if *start < to && end > from {
                let at = from.max(*start) - start;
                let until = to.min(end) - start;
                buffer.extend_from_slice(&bytes[at as usize..until as usize]);
            }
        }
    }
}

/// The read-ahead state of one handle.
pub(crate) struct ReadAhead {
    /// Where the handle's reads have reached (the furthest end of a sequential read, or
    /// the end of the last other one); `follows` judges a read by it.
    pub next: u64,
    /// Pieces fetched or on their way, by index.
    pub pieces: BTreeMap<u64, Piece>,
    /// Another client is changing the file (its truncation recalled this handle): nothing
    /// is fetched ahead until the handle learns the new size (`refresh`), or what is
    /// fetched between the recall and the change would be served after it.
    pub suspended: bool,
    /// Changes of the file's data under way through the handle other than writes
    /// (fallocate, a copy into it): nothing is fetched ahead meanwhile.
    pub changing: u32,
}

impl Default for ReadAhead {
    fn default() -> ReadAhead {
        ReadAhead {
            // No read yet: the first read is not sequential.
            next: u64::MAX,
            pieces: BTreeMap::new(),
            suspended: false,
            changing: 0,
        }
    }
}

impl ReadAhead {
    /// Whether a read of `[offset, end)`, whose first piece is `first`, is sequential,
    /// noting how far the reads reached: it takes the reads further (starting at most
    /// `SEQUENTIAL_SLACK` past where they reached), or it starts at most that far behind
    /// and its first piece is fetched ahead already (a read of the kernel's window that
    /// arrived after a later one). A reader going backwards, or jumping about behind
    /// where its reads reached, is not sequential.
    pub fn follows(&mut self, offset: u64, end: u64, first: u64) -> bool {
        let forward = self.next != u64::MAX
            && end > self.next
            && offset <= self.next.saturating_add(SEQUENTIAL_SLACK);
        let late = self.next != u64::MAX
            && offset <= self.next
            && self.next - offset <= SEQUENTIAL_SLACK
            && self.pieces.contains_key(&first);
        let sequential = forward || late;
        self.next = if sequential { self.next.max(end) } else { end };
        sequential
    }

    /// Drop the pieces that end `SEQUENTIAL_SLACK` or more before `offset`.
    pub fn drop_behind(&mut self, offset: u64, piece_bytes: u64) {
        let keep_from = offset.saturating_sub(SEQUENTIAL_SLACK) / piece_bytes;
        self.pieces = self.pieces.split_off(&keep_from);
    }

    /// Forget every piece (stopping those on their way).
    pub fn clear(&mut self) {
        // Fetches on their way stop as they are dropped.
        self.pieces.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_inside_one_part_is_a_view_and_one_across_parts_a_copy() {
        let mut segments = Segments::default();
        let first = Bytes::from((0u8..100).collect::<Vec<_>>());
        let second = Bytes::from((100u8..200).collect::<Vec<_>>());
        segments.push(1000, first.clone());
        segments.push(1100, Bytes::new());
        segments.push(1100, second.clone());
        assert_eq!(segments.len(), 200);
        let inside = segments.range(1110, 1150);
        assert_eq!(&inside[..], &second[10..50]);
        // A view: it points into the part's own memory.
        assert_eq!(inside.as_ptr(), second[10..].as_ptr());
        let across = segments.range(1090, 1120);
        let expected: Vec<u8> = (90u8..120).collect();
        assert_eq!(&across[..], &expected[..]);
        // Views of a range across parts: the parts' own memory, in order, nothing copied.
        let mut views = Segments::default();
        assert!(segments.views_into(1090, 1120, &mut views));
        let parts = views.clone().into_parts();
        assert_eq!(parts.len(), 2);
        assert_eq!(&parts[0][..], &first[90..]);
        assert_eq!(parts[0].as_ptr(), first[90..].as_ptr());
        assert_eq!(&parts[1][..], &second[..20]);
        assert_eq!(parts[1].as_ptr(), second.as_ptr());
        // Views continuing them from another piece are taken; a gap is refused.
        let mut next = Segments::default();
        next.push(1200, Bytes::from_static(b"abcdef"));
        assert!(next.views_into(1120, 1203, &mut Segments::default()));
        assert!(!next.views_into(1200, 1203, &mut views));
        assert_eq!(views.len(), 30);
        let mut buffer = BytesMut::new();
        segments.copy_into(1195, 1300, &mut buffer);
        segments.copy_into(900, 1003, &mut buffer);
        assert_eq!(&buffer[..], &[195, 196, 197, 198, 199, 0, 1, 2]);
    }
}
