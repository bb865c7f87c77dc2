//! Freeflow's FUSE mount (DESIGN.md §4-6): the kernel file system over the client library,
//! so that any program can use a Freeflow cluster through ordinary system calls.
//!
//! - [`mount`] mounts a connected [`freeflow_client::Client`] on a directory and returns a
//!   [`MountHandle`]; [`MountHandle::unmount`] (or dropping it) unmounts.
//! - Requests come over FUSE-over-io_uring rings, a queue per CPU served by a thread
//!   pinned to it (`ring/`), where the kernel offers them ([`Transport`]), else are read
//!   from several kernel channels (`clone_fd` threads, fuser); both reach the same
//!   handlers (`filesystem/`). A handler answers at once what it can (a gathered small
//!   write, attributes under a lease, a lone read) and hands the rest to a task on the
//!   caller's tokio runtime, so many are in flight at once; the number in flight has a
//!   bound ([`REQUESTS_IN_FLIGHT_MAX`]).
//! - Errors come from the client's one table ([`freeflow_client::ClientError::code`]):
//!   the codes are Linux errno numbers, returned as they are.
//!
//! Consistency (DESIGN.md §4, docs/consistency.md): the kernel caches names, missing names
//! and attributes only under the meta server's leases, for what is left of each lease
//! (`cache/`); before another client's change to them returns, the server revokes them and
//! this mount turns the revocation into the kernel's `inval_entry` / `inval_inode`. A reply
//! that carries no lease is not cached (entry and attribute time-outs 0 by default), and
//! every open fetches fresh attributes, so data written and closed elsewhere is seen by the
//! next open here (close-to-open). The kernel's writeback cache is off unless asked for
//! (`--writeback`): under it the kernel treats its own file size as the truth and ignores
//! sizes from the server, so this mount evicts the files it holds when their leases end,
//! and raises the size of those held open when they grow elsewhere (docs/consistency.md,
//! "Writeback mounts").

mod cache;
mod caller;
mod convert;
mod dev;
mod filesystem;
mod handles;
mod held;
mod limits;
mod options;
mod reply;
mod ring;
mod session;
mod shadow;

pub use limits::REQUESTS_IN_FLIGHT_MAX;
pub use options::{FuseError, MountOptions, Transport};
pub use session::{mount, MountHandle};
