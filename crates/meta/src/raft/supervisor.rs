//! One metadata server of a replicated cluster: its Raft node, and the metadata service
//! it runs while it leads.
//!
//! A server that does not lead answers every client request with `NotLeader`, naming the
//! leader when it knows one, and its hello carries epoch 0. Once Raft makes it leader and
//! it has applied everything committed before its term, it starts the full service over
//! the replicated store: the writer (whose batches go through Raft), sessions, leases,
//! the reaper and the rest, exactly as a single server after a restart, with a new boot
//! epoch (itself a replicated batch), so clients replay what the old leader answered but
//! had not committed (the recovery window). When it stops leading (another node won a
//! term, or a batch was not committed in time) it stops that service, takes back the
//! batches it ran that were not committed (their undo records), restarts its Raft node
//! from its log and follows again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::{encode, ErrorCode, WireError};
use freeflow_rpc::{ClusterKey, Frame, PeerInfo, Reply, Service};
use openraft::ServerState;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{MetaConfig, MetaError, DATABASE_FILE_NAME};
use crate::ops;
use crate::raft::batch::{self, Batch};
use crate::raft::link::RaftLink;
use crate::raft::log_store::{LogStore, LOG_FILE_NAME};
use crate::raft::members::{self, Bootstrap};

/// The directory of the data directory where snapshots are built and received.
pub const SNAPSHOT_DIR_NAME: &str = "raft-snapshots";
use crate::raft::node::{RaftNode, Storage, Timing};
use crate::raft::snapshot::SnapshotFiles;
use crate::raft::types::{MetaNode, NodeId, Raft};
use crate::server::RunningMeta;
use crate::store::{MetaStore, RedbStore, StoreError, StoreWrite};

/// What this server is doing now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Starting,
    Following { leader: Option<NodeId> },
    Leading { term: u64 },
    Stopped,
}

/// A running member of a replicated metadata cluster.
pub struct ReplicatedMeta {
    stop: watch::Sender<bool>,
    role: watch::Receiver<Role>,
    task: JoinHandle<()>,
    store: Arc<RedbStore>,
}

impl ReplicatedMeta {
    pub fn role(&self) -> Role {
        self.role.borrow().clone()
    }

    /// The replicated state as applied here: the last applied log id, the number of
    /// pairs and a hash of them (`snapshot::replicated_digest`). Two members at the
    /// same applied id must agree.
    pub fn digest(&self) -> Result<(Option<crate::raft::types::LogId>, u64, u64), StoreError> {
        crate::raft::snapshot::replicated_digest(&self.store)
    }

    /// Stop serving and leave the Raft cluster's work to the others.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Start this server's Raft node and serve as its role says (see the module doc).
pub async fn start_replicated(
    config: MetaConfig,
    key: ClusterKey,
) -> Result<ReplicatedMeta, MetaError> {
    config.validate()?;
    std::fs::create_dir_all(&config.data_dir).map_err(|source| MetaError::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    let path = config.data_dir.join(DATABASE_FILE_NAME);
    let store = RedbStore::open_with_cache(&path, config.store_cache_bytes).map_err(|source| {
        MetaError::Store {
            path: path.clone(),
            source,
        }
    })?;
    let store = Arc::new(store);
    take_back(&store).map_err(|source| MetaError::Store { path, source })?;
    let log_path = config.data_dir.join(LOG_FILE_NAME);
    let log = LogStore::open(&log_path).map_err(|reason| {
        MetaError::Task(format!(
            "cannot open the raft log {}: {reason}",
            log_path.display()
        ))
    })?;
    let node = start_node(&config, &key, &log, &store).await?;
    let (stop, stop_receiver) = watch::channel(false);
    let (role_sender, role) = watch::channel(Role::Starting);
    let task = tokio::spawn(supervise(
        config,
        key,
        log,
        store.clone(),
        node,
        stop_receiver,
        role_sender,
    ));
    Ok(ReplicatedMeta {
        stop,
        role,
        task,
        store,
    })
}

/// Take back every batch run ahead of its commit (a leader's, before a crash or after it
/// stopped leading): Raft applies again whatever of them was committed.
fn take_back(store: &RedbStore) -> Result<(), StoreError> {
    let mut write = store.begin_write()?;
    let taken = batch::take_back_all(&mut write)?;
    write.commit()?;
    if !taken.is_empty() {
        tracing::info!(
            batches = taken.len(),
            "took back batches not known committed"
        );
    }
    Ok(())
}

fn members(config: &MetaConfig) -> BTreeMap<NodeId, MetaNode> {
    config
        .peers
        .iter()
        .map(|peer| {
            (
                peer.id,
                MetaNode::new(peer.raft_address.clone(), peer.address.clone()),
            )
        })
        .collect()
}

async fn bind_retrying(address: &str) -> Result<freeflow_rpc::net::Listener, MetaError> {
    let mut tries = 0;
    loop {
        match freeflow_rpc::net::bind(address).await {
            Ok(listener) => return Ok(listener),
            Err(source) if tries >= 50 => {
                return Err(MetaError::Bind {
                    address: address.to_string(),
                    source,
                })
            }
            Err(_) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn start_node(
    config: &MetaConfig,
    key: &ClusterKey,
    log: &LogStore,
    store: &Arc<RedbStore>,
) -> Result<RaftNode, MetaError> {
    let me = config
        .peers
        .iter()
        .find(|peer| peer.id == config.node_id)
        .ok_or_else(|| MetaError::Task("node_id is not among peers".into()))?;
    let listener = bind_retrying(&me.raft_address).await?;
    let timing = Timing {
        heartbeat_ms: config.raft_heartbeat_ms,
        election_min_ms: config.raft_election_ms,
        election_max_ms: config.raft_election_ms * 2,
        snapshot_entries: config.raft_snapshot_entries,
        log_kept_entries: config.raft_log_kept_entries,
        message_bytes_max: config.raft_message_bytes_max,
    };
    let snapshot_dir = config.data_dir.join(SNAPSHOT_DIR_NAME);
    let snapshots =
        SnapshotFiles::open(snapshot_dir.clone()).map_err(|source| MetaError::DataDir {
            path: snapshot_dir,
            source,
        })?;
    // An empty log: propose the configured membership, wait to be added, or refuse (a
    // member that lost its disk, `members.rs`).
    let propose = if log.is_empty().map_err(MetaError::Task)? {
        let others: Vec<(NodeId, String)> = config
            .peers
            .iter()
            .filter(|peer| peer.id != config.node_id)
            .map(|peer| (peer.id, peer.raft_address.clone()))
            .collect();
        let decided = members::bootstrap(config.node_id, config.join, &others, key)
            .await
            .map_err(MetaError::Task)?;
        if decided == Bootstrap::Wait {
            tracing::info!(
                node = config.node_id,
                "the raft log is empty and the cluster runs: waiting to be added (`freeflow meta add`)"
            );
        }
        decided == Bootstrap::Propose
    } else {
        false
    };
    RaftNode::start(
        config.node_id,
        members(config),
        propose,
        listener,
        Storage {
            log: log.clone(),
            store: store.clone(),
            snapshots,
        },
        key.clone(),
        timing,
    )
    .await
    .map_err(MetaError::Task)
}

/// Answers every request with `NotLeader`, naming the leader's client address if known.
/// A member taken out of the cluster says so.
struct NotLeaderService {
    raft: Raft,
    id: NodeId,
}

impl Service for NotLeaderService {
    async fn call(&self, _frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        let members = members::seen(&self.raft);
        let leader = members.leader.and_then(|id| members.nodes.get(&id));
        let message = if members.left_out(self.id) {
            format!(
                "metadata member {} was removed from the cluster: it serves nothing (stop it)",
                self.id
            )
        } else if let Some(address) = leader.map(|node| &node.address) {
            format!("not the metadata leader; leader: {address}")
        } else {
            "not the metadata leader; no leader known yet".to_string()
        };
        let error = WireError::new(ErrorCode::NotLeader, message);
        Ok(Reply {
            header: encode(&Err::<(), WireError>(error)).into(),
            payload: bytes::Bytes::new(),
        })
    }
}

async fn supervise(
    config: MetaConfig,
    key: ClusterKey,
    log: LogStore,
    store: Arc<RedbStore>,
    mut node: RaftNode,
    mut stop: watch::Receiver<bool>,
    role: watch::Sender<Role>,
) {
    loop {
        // Following: answer NotLeader until this node leads.
        let follower = match bind_retrying(&config.listen_address).await {
            Ok(listener) => {
                let mut options = freeflow_rpc::ServerOptions::new("meta");
                options.epoch = 0;
                options.members = Some(members::client_addresses(&node.raft));
                Some(tokio::spawn(freeflow_rpc::serve(
                    listener,
                    key.clone(),
                    options,
                    Arc::new(NotLeaderService {
                        raft: node.raft.clone(),
                        id: node.id,
                    }),
                )))
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for clients while following");
                None
            }
        };
        let term = {
            let mut metrics = node.raft.metrics();
            // The membership last looked at: whether it leaves this member out is asked
            // once per membership, not at every change of the metrics.
            let mut membership_seen = None;
            loop {
                let (state, term, leader, membership) = {
                    let now = metrics.borrow();
                    let membership = *now.membership_config.log_id();
                    (now.state, now.current_term, now.current_leader, membership)
                };
                if state == ServerState::Leader {
                    break Some(term);
                }
                if membership != membership_seen {
                    membership_seen = membership;
                    if members::seen(&node.raft).left_out(node.id) {
                        tracing::warn!(
                            node = node.id,
                            "this member was removed from the metadata cluster: it takes no part and serves nothing; stop this process"
                        );
                    }
                }
                role.send_if_modified(|current| {
                    let following = Role::Following { leader };
                    let changed = *current != following;
                    *current = following;
                    changed
                });
                tokio::select! {
                    changed = metrics.changed() => if changed.is_err() { break None },
                    _ = stop.changed() => break None,
                }
            }
        };
        let Some(term) = term else {
            if let Some(follower) = follower {
                follower.abort();
            }
            break;
        };
        // Everything in this leader's log must be committed and applied before it serves:
        // what earlier terms committed, and entries of its own term from before a restart
        // (openraft brings a node back as the leader of the term its vote is for; the
        // store took those entries back at the restart).
        let caught_up =
            tokio::time::timeout(Duration::from_millis(config.raft_election_ms * 4), async {
                node.raft
                    .ensure_linearizable()
                    .await
                    .map_err(|e| e.to_string())?;
                let last = node.raft.metrics().borrow().last_log_index;
                node.raft
                    .wait(None)
                    .applied_index_at_least(last, "leader applied its whole log")
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<(), String>(())
            })
            .await;
        if let Some(follower) = follower {
            follower.abort();
            let _ = follower.await;
        }
        let mut reason = match caught_up {
            Ok(Ok(())) => None,
            // Nothing was run ahead of a commit yet: follow again as we are.
            Ok(Err(error)) => {
                tracing::info!(%error, "lead lost before catching up");
                tokio::time::sleep(Duration::from_millis(config.raft_heartbeat_ms)).await;
                continue;
            }
            Err(_) => Some("not caught up as leader in time".to_string()),
        };
        if reason.is_none() {
            let deposed = Arc::new(watch::Sender::new(None));
            let mut deposed_receiver = deposed.subscribe();
            let link = RaftLink {
                raft: node.raft.clone(),
                id: node.id,
                origin: new_origin(node.id, term),
                runtime: tokio::runtime::Handle::current(),
                deposed: deposed.clone(),
                reports: node.reports.clone(),
                log: log.clone(),
            };
            // A leader that has not heard from a majority for longer than a follower waits
            // before it elects another may be cut off: it stops (openraft 0.9 does not).
            let quorum_lost_after = config.raft_election_ms * 2;
            let mut silent_ticks = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(config.raft_heartbeat_ms));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            match start_leader(config.clone(), key.clone(), store.clone(), link).await {
                Ok(running) => {
                    role.send_replace(Role::Leading { term });
                    tracing::info!(term, node = node.id, "leading the metadata cluster");
                    let marking = tokio::spawn(mark_members(node.raft.clone(), node.id));
                    let mut metrics = node.raft.metrics();
                    reason = loop {
                        {
                            let now = metrics.borrow();
                            if now.state != ServerState::Leader || now.current_term != term {
                                break Some(format!(
                                    "term {} state {:?}",
                                    now.current_term, now.state
                                ));
                            }
                        }
                        tokio::select! {
                            changed = metrics.changed() => if changed.is_err() {
                                break Some("raft stopped".into());
                            },
                            _ = deposed_receiver.changed() => {
                                break deposed_receiver.borrow().clone();
                            }
                            _ = tick.tick() => {
                                // Twice in a row: one reading can be stale after a stall
                                // of the Raft task (metrics go out before queued acks).
                                let silent = metrics.borrow().millis_since_quorum_ack;
                                if silent.is_some_and(|ms| ms > quorum_lost_after) {
                                    silent_ticks += 1;
                                } else {
                                    silent_ticks = 0;
                                }
                                if silent_ticks >= 2 {
                                    break Some(format!(
                                        "no majority heard from for {quorum_lost_after} ms"
                                    ));
                                }
                            }
                            _ = stop.changed() => break None,
                        }
                    };
                    // The writer refuses everything from now on, before the service stops.
                    if let Some(reason) = &reason {
                        crate::raft::link::depose(&deposed, reason.clone());
                    }
                    marking.abort();
                    running.shutdown().await;
                }
                Err(error) => reason = Some(format!("cannot start leading: {error}")),
            }
        }
        if *stop.borrow() {
            break;
        }
        // Follow again from what is committed: restart the node over the store without
        // the batches this term ran ahead of their commit.
        tracing::warn!(reason = reason.as_deref().unwrap_or(""), "stopped leading");
        role.send_replace(Role::Starting);
        node.stop().await;
        if let Err(error) = take_back(&store) {
            tracing::error!(%error, "cannot take back uncommitted batches; stopping");
            break;
        }
        node = match start_node(&config, &key, &log, &store).await {
            Ok(node) => node,
            Err(error) => {
                tracing::error!(%error, "cannot restart the raft node; stopping");
                role.send_replace(Role::Stopped);
                return;
            }
        };
    }
    node.stop().await;
    role.send_replace(Role::Stopped);
}

/// Leading: mark the members that answered as started (`members::mark_started`), now and
/// whenever one more answers.
async fn mark_members(raft: Raft, me: NodeId) {
    let mut tick = tokio::time::interval(MARK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(error) = members::mark_started(&raft, me).await {
            tracing::debug!(%error, "marking members as started failed; trying again");
        }
    }
}

/// How often a leader looks for members to mark as started.
const MARK_INTERVAL: Duration = Duration::from_millis(500);

/// A number for one leadership of this node in `term`, different from every other (random,
/// mixed with the node and the term).
fn new_origin(node: NodeId, term: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(node);
    hasher.write_u64(term);
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos())
            .unwrap_or(0),
    );
    hasher.finish().max(1)
}

/// Lead: a new boot epoch through Raft (so clients replay to this leader what the last
/// one had not committed), then the full service over the store.
async fn start_leader(
    config: MetaConfig,
    key: ClusterKey,
    store: Arc<RedbStore>,
    link: RaftLink,
) -> Result<RunningMeta, MetaError> {
    let started = Instant::now();
    let path = config.data_dir.join(DATABASE_FILE_NAME);
    let store_error = |source| MetaError::Store {
        path: path.clone(),
        source,
    };
    let (state, txn, changes) = {
        let mut write = store.begin_write().map_err(store_error)?;
        write.capture();
        let mut state = ops::initialise(&mut write, ops::now()).map_err(store_error)?;
        let txn = state.begin_txn(&mut write).map_err(store_error)?;
        state.recovered_txn = txn;
        let changes = write.take_changes();
        batch::remember(&mut write, link.origin, txn, &changes).map_err(store_error)?;
        write.set_durable(false).map_err(store_error)?;
        write.commit().map_err(store_error)?;
        (state, txn, changes)
    };
    let committed = tokio::time::timeout(
        crate::raft::link::COMMIT_WAIT,
        link.raft
            .client_write(Batch::new(link.origin, txn, &changes)),
    )
    .await;
    match committed {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => return Err(MetaError::Task(format!("new epoch not committed: {error}"))),
        Err(_) => return Err(MetaError::Task("new epoch not committed in time".into())),
    }
    crate::server::launch(config, key, store, state, started, Some(link)).await
}
