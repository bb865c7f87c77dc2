//! Byte-range locks (POSIX `fcntl` record locks, OFD locks and `flock`, issue 9): the range
//! arithmetic shared by the meta server, which holds the cluster's locks, and the client,
//! which keeps the locks it holds so that it can reclaim them after a meta server restart.
//!
//! A lock belongs to an *owner* (the kernel's lock owner: a process's file table for POSIX
//! locks, an open file description for OFD locks and `flock`). One owner's locks on one file
//! never overlap each other: a new lock replaces whatever part of the owner's locks it
//! covers (so a read lock inside a write lock splits it), and an unlock cuts the range out.
//! Ranges are inclusive; `u64::MAX` as the end means "to the end of the file, however far".

use serde::{Deserialize, Serialize};

/// Shared (read) or exclusive (write).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LockKind {
    Read,
    Write,
}

impl LockKind {
    /// Whether locks of these kinds held by two owners on overlapping ranges conflict.
    pub fn conflicts_with(self, other: LockKind) -> bool {
        self == LockKind::Write || other == LockKind::Write
    }
}

/// One held range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRange {
    pub kind: LockKind,
    pub start: u64,
    /// Inclusive; `u64::MAX`: to the end of the file.
    pub end: u64,
}

impl LockRange {
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }
}

/// The locks of one owner on one file: sorted, never overlapping, adjacent ranges of one
/// kind merged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerLocks {
    ranges: Vec<LockRange>,
}

impl OwnerLocks {
    pub fn ranges(&self) -> &[LockRange] {
        &self.ranges
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Lock `start..=end` with `kind` (None: unlock it). Returns how many ranges the owner
    /// holds afterwards minus before (for the callers' bounds).
    pub fn apply(&mut self, kind: Option<LockKind>, start: u64, end: u64) -> isize {
        let before = self.ranges.len() as isize;
        let mut kept = Vec::with_capacity(self.ranges.len() + 2);
        for range in self.ranges.drain(..) {
            if !range.overlaps(start, end) {
                kept.push(range);
                continue;
            }
            // Keep the parts outside the new range.
            if range.start < start {
                kept.push(LockRange {
                    end: start - 1,
                    ..range
                });
            }
            if range.end > end {
                kept.push(LockRange {
                    start: end + 1,
                    ..range
                });
            }
        }
        if let Some(kind) = kind {
            kept.push(LockRange { kind, start, end });
        }
        kept.sort_by_key(|range| range.start);
        // Merge neighbours of one kind that touch.
        let mut merged: Vec<LockRange> = Vec::with_capacity(kept.len());
        for range in kept {
            match merged.last_mut() {
                Some(last)
                    if last.kind == range.kind
                        && last.end != u64::MAX
                        && last.end + 1 >= range.start =>
                {
                    last.end = last.end.max(range.end);
                }
                _ => merged.push(range),
            }
        }
        self.ranges = merged;
        self.ranges.len() as isize - before
    }

    /// The first of these ranges that conflicts with `kind` on `start..=end`.
    pub fn conflict(&self, kind: LockKind, start: u64, end: u64) -> Option<LockRange> {
        self.ranges
            .iter()
            .find(|range| range.overlaps(start, end) && range.kind.conflicts_with(kind))
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LockKind::{Read, Write};

    fn range(kind: LockKind, start: u64, end: u64) -> LockRange {
        LockRange { kind, start, end }
    }

    #[test]
    fn locks_split_merge_and_unlock_like_posix_record_locks() {
        let mut locks = OwnerLocks::default();
        locks.apply(Some(Write), 0, 99);
        // A read lock inside a write lock splits it in three.
        locks.apply(Some(Read), 10, 19);
        assert_eq!(
            locks.ranges(),
            &[
                range(Write, 0, 9),
                range(Read, 10, 19),
                range(Write, 20, 99)
            ]
        );
        // Back to write: the three merge again.
        locks.apply(Some(Write), 10, 19);
        assert_eq!(locks.ranges(), &[range(Write, 0, 99)]);
        // Adjacent ranges of one kind merge.
        locks.apply(Some(Write), 100, u64::MAX);
        assert_eq!(locks.ranges(), &[range(Write, 0, u64::MAX)]);
        // Unlock a hole, then the rest.
        locks.apply(None, 50, 59);
        assert_eq!(
            locks.ranges(),
            &[range(Write, 0, 49), range(Write, 60, u64::MAX)]
        );
        assert_eq!(locks.conflict(Read, 55, 55), None);
        assert_eq!(locks.conflict(Read, 45, 55), Some(range(Write, 0, 49)));
        locks.apply(None, 0, u64::MAX);
        assert!(locks.is_empty());
    }

    #[test]
    fn read_locks_share_and_write_locks_exclude() {
        let mut locks = OwnerLocks::default();
        locks.apply(Some(Read), 0, 9);
        assert_eq!(locks.conflict(Read, 0, 9), None);
        assert_eq!(locks.conflict(Write, 9, 20), Some(range(Read, 0, 9)));
        assert_eq!(locks.conflict(Write, 10, 20), None);
    }
}
