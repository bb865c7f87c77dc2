//! Starting one metadata server's Raft node: its log, its state machine over the
//! namespace store, its peers and the service they call.

use std::collections::BTreeMap;
use std::sync::Arc;

use freeflow_rpc::ClusterKey;
use openraft::{Config, SnapshotPolicy};
use tokio::task::JoinHandle;

use crate::raft::log_store::LogStore;
use crate::raft::network::{spawn_service, Network, PeerReports};
use crate::raft::snapshot::SnapshotFiles;
use crate::raft::state_machine::StateMachine;
use crate::raft::types::{MetaNode, NodeId, Raft};
use crate::store::RedbStore;

/// Timing of elections and heartbeats (milliseconds), and of snapshots (entries).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub heartbeat_ms: u64,
    pub election_min_ms: u64,
    pub election_max_ms: u64,
    /// Entries between snapshots.
    pub snapshot_entries: u64,
    /// Entries the log keeps behind a snapshot, for followers a little behind.
    pub log_kept_entries: u64,
    /// Most bytes of one message (`raft_message_bytes_max`).
    pub message_bytes_max: u32,
}
/// Time for one snapshot chunk to be sent and taken in.
const SNAPSHOT_CHUNK_TIMEOUT_MS: u64 = 10_000;
/// Entries in one append message (each a batch of up to `commit_batch_max` mutations);
/// fewer when they pass `message_bytes_max` (`network.rs`).
const ENTRIES_PER_MESSAGE: u64 = 64;
/// Largest snapshot chunk (smaller when `message_bytes_max` is).
const SNAPSHOT_CHUNK_BYTES_MAX: u64 = 4 << 20;

/// What a node keeps on disk: its log (kept open across restarts of the node: openraft's
/// tasks may hold it a moment after a stop), the namespace store its state machine
/// applies to, and its snapshot files.
pub struct Storage {
    pub log: LogStore,
    pub store: Arc<RedbStore>,
    pub snapshots: SnapshotFiles,
}

/// A running Raft node.
pub struct RaftNode {
    pub id: NodeId,
    pub raft: Raft,
    pub members: BTreeMap<NodeId, MetaNode>,
    /// What sending to each other member last came to (leading).
    pub reports: PeerReports,
    service: JoinHandle<std::io::Result<()>>,
}

impl RaftNode {
    /// Start the node on `listener` (its Raft address) with its `storage`. A node whose
    /// log is empty proposes the membership `members` if `propose` (at a cluster's first
    /// start every node may: all propose the same one, and a node that has joined already
    /// refuses); otherwise it waits for a leader to add it (`members.rs`).
    pub async fn start(
        id: NodeId,
        members: BTreeMap<NodeId, MetaNode>,
        propose: bool,
        listener: freeflow_rpc::net::Listener,
        storage: Storage,
        key: ClusterKey,
        timing: Timing,
    ) -> Result<RaftNode, String> {
        let Storage {
            log,
            store,
            snapshots,
        } = storage;
        // Entries of one append stay under the bound with room for the request's own fields.
        log.set_read_bytes_max((timing.message_bytes_max as usize).saturating_sub(16 << 10));
        let config = Config {
            cluster_name: "freeflow-meta".to_string(),
            heartbeat_interval: timing.heartbeat_ms,
            election_timeout_min: timing.election_min_ms,
            election_timeout_max: timing.election_max_ms,
            max_payload_entries: ENTRIES_PER_MESSAGE,
            snapshot_max_chunk_size: u64::from(timing.message_bytes_max)
                .min(SNAPSHOT_CHUNK_BYTES_MAX),
            snapshot_policy: SnapshotPolicy::LogsSinceLast(timing.snapshot_entries),
            max_in_snapshot_log_to_keep: timing.log_kept_entries,
            // The last chunk of a snapshot rewrites the follower's whole store.
            install_snapshot_timeout: SNAPSHOT_CHUNK_TIMEOUT_MS,
            ..Config::default()
        };
        let config = Arc::new(
            config
                .validate()
                .map_err(|error| format!("raft configuration: {error}"))?,
        );
        let state_machine = StateMachine::new(store, snapshots);
        let reports = PeerReports::default();
        let network = Network {
            key: key.clone(),
            reports: reports.clone(),
        };
        let raft = Raft::new(id, config, network, log, state_machine)
            .await
            .map_err(|error| format!("starting raft node {id}: {error}"))?;
        let service = spawn_service(listener, key, raft.clone(), id);
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|error| format!("raft node {id}: {error}"))?;
        if !initialized && propose {
            if let Err(error) = raft.initialize(members.clone()).await {
                tracing::info!(%error, id, "raft membership proposed by another node");
            }
        }
        Ok(RaftNode {
            id,
            raft,
            members,
            reports,
            service,
        })
    }

    pub async fn stop(&self) {
        if let Err(error) = self.raft.shutdown().await {
            tracing::warn!(%error, id = self.id, "raft node did not stop cleanly");
        }
        self.service.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::raft::batch::tests::dump;
    use crate::raft::batch::Batch;
    use crate::store::{MetaStore, StoreRead, TableId};

    async fn wait_for_leader(nodes: &[&RaftNode]) -> NodeId {
        for _ in 0..200 {
            let leaders: Vec<NodeId> = nodes
                .iter()
                .filter_map(|node| node.raft.metrics().borrow().current_leader)
                .collect();
            if leaders.len() == nodes.len() && leaders.iter().all(|l| *l == leaders[0]) {
                let leader = leaders[0];
                if nodes.iter().any(|node| node.id == leader) {
                    return leader;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no leader agreed on");
    }

    async fn wait_applied(nodes: &[&RaftNode], index: u64) {
        for node in nodes {
            node.raft
                .wait(Some(Duration::from_secs(10)))
                .applied_index_at_least(Some(index), "applied")
                .await
                .unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_nodes_replicate_batches_and_survive_the_leaders_loss() {
        let dir = tempfile::tempdir().unwrap();
        let key = ClusterKey::generate().unwrap();
        let mut listeners = Vec::new();
        let mut members = BTreeMap::new();
        for id in 1..=3u64 {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            members.insert(
                id,
                MetaNode::new(listener.local_addr().unwrap().to_string(), ""),
            );
            listeners.push(listener);
        }
        let timing = Timing {
            heartbeat_ms: 50,
            election_min_ms: 300,
            election_max_ms: 600,
            snapshot_entries: 20_000,
            log_kept_entries: 2_000,
            message_bytes_max: 4 << 20,
        };
        let mut nodes = Vec::new();
        let mut stores = Vec::new();
        for (listener, id) in listeners.into_iter().zip(1..=3u64) {
            let data = dir.path().join(format!("m{id}"));
            std::fs::create_dir_all(&data).unwrap();
            let store = Arc::new(RedbStore::open(&data.join("meta.redb")).unwrap());
            stores.push(store.clone());
            let log = LogStore::open(&data.join("raft-log.redb")).unwrap();
            nodes.push(
                RaftNode::start(
                    id,
                    members.clone(),
                    true,
                    Box::new(listener),
                    Storage {
                        log,
                        store,
                        snapshots: SnapshotFiles::open(data.join("raft-snapshots")).unwrap(),
                    },
                    key.clone(),
                    timing,
                )
                .await
                .unwrap(),
            );
        }
        let all: Vec<&RaftNode> = nodes.iter().collect();
        let leader = wait_for_leader(&all).await;
        let write = |txn: u64| Batch {
            origin: 1,
            txn,
            changes: vec![
                (
                    TableId::Inodes.code(),
                    txn.to_be_bytes().to_vec(),
                    Some(vec![txn as u8; 100]),
                ),
                (
                    TableId::Counters.code(),
                    b"last".to_vec(),
                    Some(txn.to_be_bytes().to_vec()),
                ),
                (
                    TableId::Inodes.code(),
                    (txn - 1).to_be_bytes().to_vec(),
                    if txn.is_multiple_of(2) {
                        None
                    } else {
                        Some(vec![1])
                    },
                ),
            ],
        };
        let leader_node = nodes.iter().find(|node| node.id == leader).unwrap();
        let mut last = 0;
        for txn in 1..=40u64 {
            let response = leader_node.raft.client_write(write(txn)).await.unwrap();
            assert_eq!(response.data, txn);
            last = response.log_id.index;
        }
        wait_applied(&all, last).await;
        let expected = dump(&stores[0]);
        assert!(!expected.is_empty());
        assert_eq!(dump(&stores[1]), expected);
        assert_eq!(dump(&stores[2]), expected);

        // The leader goes; the other two elect one and go on.
        let index = nodes.iter().position(|node| node.id == leader).unwrap();
        let gone = nodes.remove(index);
        stores.remove(index);
        gone.stop().await;
        let rest: Vec<&RaftNode> = nodes.iter().collect();
        let new_leader = wait_for_leader(&rest).await;
        assert_ne!(new_leader, leader);
        let leader_node = nodes.iter().find(|node| node.id == new_leader).unwrap();
        for txn in 41..=60u64 {
            last = leader_node
                .raft
                .client_write(write(txn))
                .await
                .unwrap()
                .log_id
                .index;
        }
        wait_applied(&rest, last).await;
        let expected = dump(&stores[0]);
        assert_eq!(dump(&stores[1]), expected);
        let read = stores[0].begin_read().unwrap();
        assert_eq!(
            read.get(TableId::Counters, b"last").unwrap(),
            Some(60u64.to_be_bytes().to_vec())
        );
        for node in nodes {
            node.stop().await;
        }
    }
}
