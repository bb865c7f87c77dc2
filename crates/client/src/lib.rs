//! Freeflow's client library (DESIGN.md §4-6): everything a program needs to use the file
//! system without a mount. The FUSE mount and the `freeflow` CLI are both built on it.
//!
//! - [`Client`] holds a session at the meta server and one pipelined connection per server.
//!   Its inode API (`lookup`, `getattr`, `create_open`, `readdir`, ...) maps one to one onto
//!   meta server requests, for the mount; its path API (`stat`, `mkdir_all`, `open_path`,
//!   `remove_all`, ...) resolves absolute paths inside the namespace on top of it, for tools.
//! - [`FileHandle`] is an open file and the data path: writes cut at stripe units and sent to
//!   all servers at once with bounded write-behind, parallel reads, size commits, `fsync`.
//! - [`ClientError::code`] is the one table from errors to errno.

mod check;
mod client;
mod closer;
pub mod cluster_file;
mod config;
mod delegation;
mod error;
mod file;
mod lease;
mod leases;
mod local;
mod locks;
mod metrics;
mod path;
mod paths;
mod plan;
mod pool;
mod readahead;
mod replay;
mod replicated;
mod space;

pub use client::Client;
pub use config::{
    ClientConfig, CALL_TIMEOUT_MS_DEFAULT, CONNECT_TIMEOUT_MS_DEFAULT, DIRTY_BYTES_MAX_DEFAULT,
    READAHEAD_BYTES_DEFAULT, SIZE_COMMIT_INTERVAL_MS_DEFAULT,
};
pub use delegation::AheadOp;
pub use error::ClientError;
pub use file::{Allocation, FileHandle, COPY_LENGTH_MAX, READ_LENGTH_MAX};
pub use lease::Lease;
pub use leases::{RecallHandler, RevocationHandler};
pub use local::reads_in_place;
pub use locks::LockSpec;
pub use path::{join, normalize};
pub use paths::{OpenOptions, StripePlacement};

// The request and reply types of the API, so users need not name the proto crate.
pub use freeflow_proto::io::{ListedObject, ObjectListing, LIST_OBJECTS_MAX};
pub use freeflow_proto::meta::{
    Caller, ClusterReport, DirEntry, DirPage, FsStats, HandleRef, InodeFacts, IoServerChange,
    LockConflict, MetaMember, MetaMemberChange, OpenAccess, RenameMode, Revocation, ServerRecord,
    XattrSetMode, INSPECT_INODES_MAX,
};
pub use freeflow_proto::ErrorCode;
pub use freeflow_rpc::ClusterKey;
pub use freeflow_types::{
    Attr, FileKind, InodeId, Layout, LockKind, ObjectId, ServerId, SetAttr, TimeSpec, ROOT_INODE,
};
