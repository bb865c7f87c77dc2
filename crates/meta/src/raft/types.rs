//! openraft's type configuration for the metadata state machine.

use openraft::{BasicNode, StorageError};

use crate::raft::batch::Batch;
use crate::raft::snapshot_file::SnapshotFile;

openraft::declare_raft_types!(
    /// Entries carry a batch's changes; a response is the batch's transaction number
    /// (0 for entries that are not batches).
    pub TypeConfig:
        D = Batch,
        R = u64,
        NodeId = u64,
        Node = BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = SnapshotFile,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, BasicNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, BasicNode>;
pub type Snapshot = openraft::Snapshot<TypeConfig>;
pub type SnapshotData = SnapshotFile;
pub type RaftError = StorageError<NodeId>;
