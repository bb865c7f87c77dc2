//! Read-ahead for sequential readers of a handle (`ClientConfig::readahead_bytes`).
//!
//! A read that starts where the handle's last read ended is sequential: the handle then
//! fetches the next `readahead_bytes` of the file ahead of the reader, in pieces of one
//! stripe row (so every server of the layout reads at once), each on a task of its own. A
//! later read takes the pieces it covers (waiting for those still on their way) and keeps
//! the rest; any other read drops them all.
//!
//! What was fetched must never be read in place of what this handle wrote: every change
//! made through the handle (a write, a truncation, fallocate, a copy into it) and every
//! recall of the file by another client's truncation drops the pieces, and nothing is
//! fetched ahead while a write of the handle is gathered or in flight. Other clients'
//! writes are seen at the next open, as without read-ahead (close-to-open).
//!
//! Bounded per handle by `readahead_bytes` and over the client by
//! [`READAHEAD_CLIENT_BYTES_MAX`] (a piece that finds no room is not fetched ahead).

use std::collections::BTreeMap;

use bytes::Bytes;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;

use crate::error::ClientError;

/// Most bytes fetched ahead over all handles of a client.
pub const READAHEAD_CLIENT_BYTES_MAX: usize = 256 << 20;

/// A piece fetched ahead, by its index (file offset / piece size).
pub(crate) enum Piece {
    Fetching(JoinHandle<Result<Bytes, ClientError>>, OwnedSemaphorePermit),
    Fetched(Bytes, OwnedSemaphorePermit),
}

/// The read-ahead state of one handle.
pub(crate) struct ReadAhead {
    /// Where the next read must start to be sequential.
    pub next: u64,
    /// Pieces fetched or on their way, by index.
    pub pieces: BTreeMap<u64, Piece>,
    /// Bumped at each `clear`: a piece a read took before it is not put back after.
    pub generation: u64,
}

impl Default for ReadAhead {
    fn default() -> ReadAhead {
        ReadAhead {
            // No read yet: the first read is not sequential.
            next: u64::MAX,
            pieces: BTreeMap::new(),
            generation: 0,
        }
    }
}

impl ReadAhead {
    /// Forget every piece (stopping those on their way).
    pub fn clear(&mut self) {
        self.generation += 1;
        for (_, piece) in std::mem::take(&mut self.pieces) {
            if let Piece::Fetching(task, _) = piece {
                task.abort();
            }
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.clear();
    }
}
