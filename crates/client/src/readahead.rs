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
//! fetched ahead while a write of the handle is gathered, parked or in flight. Other clients'
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
    Fetching(Fetch, OwnedSemaphorePermit),
    Fetched(Bytes, OwnedSemaphorePermit),
}

/// A fetch on its task, stopped when dropped (a cancelled read, a cleared read-ahead):
/// nothing keeps fetching once its room in the bound is given back.
pub(crate) struct Fetch(pub JoinHandle<Result<Bytes, ClientError>>);

impl Fetch {
    /// Its result; None if the task was stopped or failed (fetch the range again).
    pub async fn wait(mut self) -> Option<Bytes> {
        match (&mut self.0).await {
            Ok(Ok(bytes)) => Some(bytes),
            _ => None,
        }
    }
}

impl Drop for Fetch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The read-ahead state of one handle.
pub(crate) struct ReadAhead {
    /// Where the next read must start to be sequential.
    pub next: u64,
    /// Pieces fetched or on their way, by index.
    pub pieces: BTreeMap<u64, Piece>,
    /// Bumped at each `clear`: a piece a read took before it is not put back after.
    pub generation: u64,
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
            generation: 0,
            suspended: false,
            changing: 0,
        }
    }
}

impl ReadAhead {
    /// Forget every piece (stopping those on their way).
    pub fn clear(&mut self) {
        self.generation += 1;
        // Fetches on their way stop as they are dropped.
        self.pieces.clear();
    }
}
