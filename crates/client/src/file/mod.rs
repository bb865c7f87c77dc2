//! Open files: the data path (DESIGN.md §4-6); this module only declares its rooms and
//! re-exports what the crate uses of them.
//!
//! - `state.rs`: the handle, its shared state and the host trait the client implements;
//! - `pieces.rs`: gathered small writes and parked pieces of stripe units (plain data);
//! - `flights.rs`: the writes' own state (sequence numbers, requests in flight, failure);
//! - `sizes.rs`: the size's own state (known, written and acknowledged ends, commits);
//! - `write.rs`: the write path (gathering, parking, ordering, space, sending);
//! - `size.rs`: sizes, commits, flush, fsync, growth and truncation;
//! - `read.rs`: the read path (planning, read-ahead, local reads);
//! - `change.rs`: changes without a write (fallocate, copies);
//! - `handle.rs`: opening, the handle's accessors, close.
//!
//! The data path:
//!
//! A write is cut into object requests ([`crate::plan`]) that are all sent at once, each on a
//! spawned task, and `write_at` returns as soon as they are in flight (write-behind). Their
//! payloads are slices of the caller's buffer, never copies. Small writes are the exception:
//! one shorter than [`pieces::GATHER_WRITE_MAX`] is copied into the handle's gathering
//! buffer, which
//! adjacent small writes join (the mount's session threads append to it directly,
//! `write_gathered`), and which goes out as one write at most `gather_wait_ms` later, or as
//! soon as anything must see it (every path that waits for earlier writes sends it first).
//! A large write whose first or last piece covers only part of a stripe unit *parks* that
//! piece (acknowledged, not sent) until the rest of the unit comes, so the servers get
//! whole, aligned units (`write_in_units`); parked pieces follow the same rules as gathered
//! bytes, and a small write sends them all before it gathers. The bytes in flight over the
//! whole client are bounded by a semaphore of `dirty_bytes_max` bytes: a writer past it waits.
//! The first failure of a write is kept on the handle and returned by every later write,
//! flush, fsync and close (it is never lost, and the handle stays failed: the data is gone).
//!
//! Order: requests to one server are pipelined and may complete in any order, so a write that
//! overlaps one still in flight on the same handle waits for it first; otherwise a later write
//! could be overtaken by an earlier one. Reads wait for the handle's own writes in flight, so
//! a handle always reads what it wrote.
//!
//! Waiting: each `write_at` gets a sequence number. `flush`, `fsync` and a truncating
//! `setattr` wait only for the writes that started before they did, so a writer that keeps
//! the handle busy cannot hold them up forever; `close` waits for all (no write can start
//! after it).
//!
//! Size: the handle keeps the highest end acknowledged by the servers and commits it to the
//! meta server (`CommitSize`, a maximum there) on flush, fsync and close, and in the
//! background when `size_commit_interval_ms` has passed since the last commit. A commit
//! computed before a truncation must not land after it (it would grow the file back): a
//! truncation first stops new commits, bumps the handle's truncate epoch and waits for the
//! commits already sent; a reply to a commit of an older epoch is dropped.
//!
//! Durability: a stripe joins the handle's unsynced set when a write to it is acknowledged,
//! never earlier; `fsync` takes the set under the same lock that sees its writes done, so
//! every write acknowledged before its wait ended is in the set it syncs (`SyncObjects` on
//! each server, in parallel), and then commits the size: when it returns, the data and the
//! size survive a crash of any server.

mod change;
mod flights;
mod handle;
mod pieces;
mod read;
mod size;
mod sizes;
mod state;
mod write;

pub use change::{Allocation, COPY_LENGTH_MAX};
pub use read::READ_LENGTH_MAX;
pub(crate) use size::Truncation;
pub use state::FileHandle;
pub(crate) use state::{HandleHost, HandleShared};
