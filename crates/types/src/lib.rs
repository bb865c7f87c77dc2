//! Freeflow's vocabulary: the ids, attributes, layouts and limits that every other crate
//! speaks. Nothing here does I/O or needs a runtime, so the wire contract (`proto`), the
//! servers and the client all agree on one definition of "where does byte N of a file live".

pub mod attr;
pub mod layout;
pub mod limits;
pub mod locks;

pub use attr::{Attr, FileKind, SetAttr, TimeSpec};
pub use layout::{Layout, LayoutError, ObjectId, StripeChunk};
pub use locks::{LockKind, LockRange, OwnerLocks};

/// An inode number. `ROOT_INODE` is the root directory; 0 is never a valid inode.
pub type InodeId = u64;

/// The root directory's inode number (as in most Unix file systems, not 0).
pub const ROOT_INODE: InodeId = 1;

/// The id of one I/O server in the cluster, fixed at `freeflow init`/`up` and stored in
/// the server's data directory so that a data directory can never be served under
/// another server's name.
pub type ServerId = u32;
