//! Replicated metadata: the namespace as a Raft state machine over openraft (issue 11,
//! DESIGN.md §7 and §10).
//!
//! The leader runs mutations as a single server does and replicates each batch's changes
//! (`batch.rs`); followers apply them. See docs/replication.md.

pub mod applied;
pub mod batch;
pub mod link;
pub mod log_store;
pub mod members;
pub mod network;
pub mod node;
pub mod snapshot;
pub mod snapshot_file;
pub mod state_machine;
pub mod supervisor;
pub mod types;
