//! Freeflow's metadata server: the namespace, inodes, layouts, orphans and the I/O server
//! registry, kept in redb behind the [`store::MetaStore`] seam (DESIGN.md §2).
//!
//! Reads run in read transactions on the request's task, concurrently with writes (MVCC).
//! Mutations go through one writer thread that group-commits them (`writer/`): one fsync
//! covers every operation that arrived together, and each is durable before its reply.
//! Start-up reads a handful of counters and never scans, so it is O(1) in the number of
//! files.

pub mod config;
pub mod cutter;
pub mod gauges;
pub mod io_peers;
pub mod leases;
pub mod locks;
pub mod metrics;
pub mod ops;
pub mod raft;
pub mod reaper;
pub mod records;
pub mod recovery;
pub mod registry;
pub mod replacements;
pub mod rereplication;
pub mod server;
pub mod service;
pub mod sessions;
pub mod shared;
pub mod store;
pub mod writer;

#[cfg(test)]
mod batch_tests;

pub use config::{
    MetaConfig, MetaError, MetaPeer, DATABASE_FILE_NAME, RECOVERY_WINDOW_REPLICATED_MIN_MS,
};
pub use server::{start, RunningMeta};
