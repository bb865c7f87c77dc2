//! The disk engine: how positional reads, writes and data syncs of object files reach the
//! disk. One trait, two implementations, chosen by config (`engine = "uring" | "threads"`):
//!
//! - [`uring::UringEngine`]: one io_uring per data directory with a pool of registered
//!   buffers, fed by the requests' tasks and reaped on the tokio runtime; completions are
//!   handled in whatever order the kernel delivers them (DESIGN.md §6.5).
//! - [`threads::ThreadEngine`]: a bounded pool of threads doing `pread`/`pwrite`/
//!   `fdatasync`, for kernels or sandboxes without io_uring.
//!
//! Neither takes any per-object lock: concurrent writes to disjoint ranges of one object go
//! to the kernel independently (DESIGN.md §4). Files are passed as `Arc<File>` so an
//! eviction from the descriptor cache never closes a descriptor with I/O in flight.

pub mod threads;
pub mod uring;

use std::fs::File;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

/// A boxed engine future (the trait is used as `dyn`, so methods cannot be `async fn`).
pub type EngineFuture<'a, T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send + 'a>>;

/// Counters an engine keeps, for `freeflow top` and the benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Disk operations completed (one per submitted read, write or sync, counting the
    /// resubmissions after short transfers).
    pub completions: u64,
    /// Completions that arrived while an operation submitted earlier was still in flight:
    /// the kernel finished them out of submission order, and nothing waited for the older one.
    /// Tracked by the io_uring engine; the thread engine reports 0.
    pub out_of_order_completions: u64,
    /// Times a request found no free buffer and queued for one (io_uring engine; the thread
    /// engine has no pool and reports 0).
    pub buffer_waits: u64,
    /// Disk operations handed to the kernel (io_uring: entries pushed, resubmissions of
    /// short transfers included) or to a worker thread.
    pub submissions: u64,
    /// Total time requests spent waiting for a free buffer, in microseconds.
    pub buffer_wait_time_us: u64,
    /// Requests waiting for a buffer right now.
    pub buffer_waiters: u64,
}

/// Positional I/O on open object files.
pub trait DiskEngine: Send + Sync + 'static {
    /// "io_uring" or "threads", as reported in `ServerStats`.
    fn name(&self) -> &'static str;

    /// Writes all of `data` at `offset` (short writes are continued until done or failed).
    fn write_at(&self, file: Arc<File>, offset: u64, data: Bytes) -> EngineFuture<'_, ()>;

    /// Reads up to `length_bytes` at `offset`; fewer only when the file ends first.
    fn read_at(&self, file: Arc<File>, offset: u64, length_bytes: usize)
        -> EngineFuture<'_, Bytes>;

    /// `fdatasync` of the file.
    fn sync_data(&self, file: Arc<File>) -> EngineFuture<'_, ()>;

    fn stats(&self) -> EngineStats;

    /// A read of `length_bytes` was answered from the page cache without the engine (see
    /// `ObjectStore::read_cached`): counted with the engine's reads where reads are counted.
    fn note_cached_read(&self, _length_bytes: u64) {}
}
