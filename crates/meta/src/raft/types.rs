//! openraft's type configuration for the metadata state machine.

use openraft::StorageError;

use crate::raft::batch::Batch;
use crate::raft::snapshot_file::SnapshotFile;

openraft::declare_raft_types!(
    /// Entries carry a batch's changes; a response is the batch's transaction number
    /// (0 for entries that are not batches).
    pub TypeConfig:
        D = Batch,
        R = u64,
        NodeId = u64,
        Node = MetaNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = SnapshotFile,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, MetaNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, MetaNode>;
pub type Snapshot = openraft::Snapshot<TypeConfig>;
pub type SnapshotData = SnapshotFile;
pub type RaftError = StorageError<NodeId>;

/// One member of the metadata cluster as Raft's membership records it: where the other
/// members reach its Raft service, and where clients and I/O servers reach it. Kept in the
/// membership itself, so a member added later is known to everyone with its addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MetaNode {
    pub raft_address: String,
    pub address: String,
    /// Set by a leader once this member answered it (`members::mark_started`): a member
    /// that starts with an empty log while marked lost its disk, and with it the entries
    /// and votes it acknowledged; it must rejoin as a new member (`members::bootstrap`).
    pub started: bool,
}

impl MetaNode {
    pub fn new(raft_address: impl Into<String>, address: impl Into<String>) -> MetaNode {
        MetaNode {
            raft_address: raft_address.into(),
            address: address.into(),
            started: false,
        }
    }
}

impl std::fmt::Display for MetaNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (raft {})", self.address, self.raft_address)
    }
}
