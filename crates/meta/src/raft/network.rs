//! Raft between metadata servers over Freeflow's RPC layer (opcodes in
//! `freeflow_proto::raft`): the client side openraft calls, and the service each meta
//! server runs on its `raft_address`.

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::Arc;

use bytes::Bytes;
use freeflow_proto::raft::{RaftAppend, RaftMembers, RaftSnapshot, RaftVote};
use freeflow_proto::{Request, WireError};
use freeflow_rpc::{
    handle, ClusterKey, ConnectOptions, Connection, Frame, PeerInfo, Reply, Service,
};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::raft::types::{MetaNode, NodeId, Raft, TypeConfig};

/// What this member, leading, last learnt of sending to one other member: shown by
/// `freeflow status`, where openraft's own figure (the last index it matched) stays as it
/// was while every message fails.
#[derive(Clone, Debug, Default)]
pub struct PeerReport {
    /// When it last answered a message.
    pub last_answer: Option<std::time::Instant>,
    /// Why the last message failed, if it did.
    pub last_error: Option<String>,
    /// A snapshot on its way: (bytes sent, bytes in all).
    pub snapshot: Option<(u64, u64)>,
}

/// The reports of every other member, shared by the peers' tasks and the status answer.
pub type PeerReports = Arc<std::sync::Mutex<BTreeMap<NodeId, PeerReport>>>;

/// Makes one [`Peer`] per other meta server.
#[derive(Clone)]
pub struct Network {
    pub key: ClusterKey,
    pub reports: PeerReports,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &MetaNode) -> Peer {
        Peer {
            target,
            node: node.clone(),
            key: self.key.clone(),
            reports: self.reports.clone(),
            connection: None,
        }
    }
}

/// The connection to one other meta server's Raft service, made when first needed and
/// again after it broke.
pub struct Peer {
    target: NodeId,
    node: MetaNode,
    key: ClusterKey,
    reports: PeerReports,
    connection: Option<Connection>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Failure(String);

impl Peer {
    fn report(&self, update: impl FnOnce(&mut PeerReport)) {
        let mut reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        update(reports.entry(self.target).or_default());
    }

    /// Note how a message ended.
    fn note<T, E: std::fmt::Display>(&self, result: &Result<T, E>) {
        match result {
            Ok(_) => self.report(|report| {
                report.last_answer = Some(std::time::Instant::now());
                report.last_error = None;
            }),
            Err(error) => {
                let text = error.to_string();
                self.report(|report| report.last_error = Some(text));
            }
        }
    }

    fn noted<T, E: std::fmt::Display>(&self, result: Result<T, E>) -> Result<T, E> {
        self.note(&result);
        result
    }

    /// The connection to the peer, made again when it broke.
    async fn connection<E: Error>(
        &mut self,
        option: &RPCOption,
    ) -> Result<Connection, RPCError<NodeId, MetaNode, E>> {
        Ok(match &self.connection {
            Some(connection) if !connection.is_closed() => connection.clone(),
            _ => {
                let options = ConnectOptions {
                    client_name: "meta-raft".to_string(),
                    call_timeout_ms: option.hard_ttl().as_millis() as u64,
                    connect_timeout_ms: option.hard_ttl().as_millis().clamp(50, 2000) as u64,
                    ..ConnectOptions::default()
                };
                let connection = Connection::connect(&self.node.raft_address, &self.key, &options)
                    .await
                    .map_err(|error| {
                        RPCError::Unreachable(Unreachable::new(&Failure(format!(
                            "meta server {} at {}: {error}",
                            self.target, self.node.raft_address
                        ))))
                    })?;
                self.connection = Some(connection.clone());
                connection
            }
        })
    }

    async fn send<R, Q, S, E>(
        &mut self,
        header: R,
        request: &Q,
        option: &RPCOption,
    ) -> Result<S, RPCError<NodeId, MetaNode, E>>
    where
        R: Request<Reply = ()>,
        Q: Serialize,
        S: DeserializeOwned,
        E: DeserializeOwned + Error,
    {
        let connection = self.connection(option).await;
        let connection = self.noted(connection)?;
        let payload = postcard::to_allocvec(request)
            .map_err(|error| RPCError::Network(NetworkError::new(&error)))?;
        self.call(&connection, header, payload, option).await
    }

    /// Send one message on `connection` and read its answer; how it ended is noted.
    async fn call<R, S, E>(
        &mut self,
        connection: &Connection,
        header: R,
        payload: Vec<u8>,
        option: &RPCOption,
    ) -> Result<S, RPCError<NodeId, MetaNode, E>>
    where
        R: Request<Reply = ()>,
        S: DeserializeOwned,
        E: DeserializeOwned + Error,
    {
        let call = connection.call(&header, Bytes::from(payload));
        let reply = match tokio::time::timeout(option.hard_ttl(), call).await {
            Ok(Ok((_, reply))) => Ok(reply),
            Ok(Err(error)) => {
                self.connection = None;
                Err(RPCError::Unreachable(Unreachable::new(&Failure(format!(
                    "meta server {} at {}: {error}",
                    self.target, self.node.raft_address
                )))))
            }
            Err(_) => {
                // A connection that did not answer in time may be half open: a new one next.
                self.connection = None;
                Err(RPCError::Network(NetworkError::new(&Failure(format!(
                    "meta server {} at {} did not answer {} within {:?}",
                    self.target,
                    self.node.raft_address,
                    R::NAME,
                    option.hard_ttl()
                )))))
            }
        };
        let result = match reply {
            Err(error) => Err(error),
            Ok(reply) => match postcard::from_bytes::<Result<S, E>>(&reply) {
                Err(error) => Err(RPCError::Network(NetworkError::new(&error))),
                Ok(answer) => answer.map_err(|error| {
                    RPCError::RemoteError(RemoteError::new_with_node(
                        self.target,
                        self.node.clone(),
                        error,
                    ))
                }),
            },
        };
        self.noted(result)
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, MetaNode, RaftError<NodeId>>> {
        // Entries must follow `prev_log_id` at once. A read of a range the leader's log
        // purged behind a new snapshot meanwhile starts at the first entry left: sent, it
        // would leave a hole in the follower's log (seen at 1,000,000 files: a wiped member
        // sent entries 178,100.. after entry 0 crashed applying them). Not sent: answered
        // as a conflict at `prev_log_id` instead, which makes openraft look below it, where
        // the log is purged, and send the snapshot (a failure would only be retried with
        // the same range). Installing a snapshot is right for a follower whatever it holds.
        if let Some(first) = rpc.entries.first() {
            let expected = rpc.prev_log_id.map_or(0, |prev| prev.index + 1);
            if first.log_id.index != expected {
                let why = format!(
                    "entries from {} do not follow {expected}: the log was purged under \
                     the replication; a snapshot goes instead",
                    first.log_id.index
                );
                if rpc.prev_log_id.is_some() {
                    self.report(|report| report.last_error = Some(why));
                    return Ok(AppendEntriesResponse::Conflict);
                }
                let failure = RPCError::Network(NetworkError::new(&Failure(why)));
                return self.noted(Err(failure));
            }
        }
        let connection = self.connection(&option).await;
        let connection = self.noted(connection)?;
        let payload = postcard::to_allocvec(&rpc)
            .map_err(|error| RPCError::Network(NetworkError::new(&error)))?;
        let target = self.target;
        self.call(&connection, RaftAppend { target }, payload, &option)
            .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, MetaNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        let sent = rpc.offset + rpc.data.len() as u64;
        let total = snapshot_length(&rpc.meta.snapshot_id)
            .unwrap_or(0)
            .max(sent);
        let done = rpc.done;
        let target = self.target;
        let result = self.send(RaftSnapshot { target }, &rpc, &option).await;
        if result.is_ok() {
            self.report(|report| report.snapshot = (!done).then_some((sent, total)));
        }
        result
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, MetaNode, RaftError<NodeId>>> {
        let target = self.target;
        self.send(RaftVote { target }, &rpc, &option).await
    }
}

/// The Raft service a meta server runs for its peers.
pub struct RaftService {
    pub raft: Raft,
    /// This member's node id: a message meant for another is refused.
    pub id: NodeId,
}

/// A message meant for node `target` reached node `id`: a member that took the address of
/// another (replaced on the same host and ports) must not answer for it, or the leader
/// would count its answers as the other's.
fn check_target(id: NodeId, target: u64) -> Result<(), WireError> {
    if target == id {
        return Ok(());
    }
    Err(WireError::new(
        freeflow_proto::ErrorCode::InvalidArgument,
        format!("this is metadata member {id}, not member {target}"),
    ))
}

fn malformed(error: postcard::Error) -> WireError {
    WireError::new(
        freeflow_proto::ErrorCode::Protocol,
        format!("malformed raft message: {error}"),
    )
}

fn encoded<T: Serialize>(value: &T) -> Result<((), Bytes), WireError> {
    postcard::to_allocvec(value)
        .map(|bytes| ((), Bytes::from(bytes)))
        .map_err(malformed)
}

impl Service for RaftService {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        let (raft, id) = (self.raft.clone(), self.id);
        match frame.opcode {
            RaftAppend::OPCODE => {
                handle::<RaftAppend, _, _>(frame, |header, payload| async move {
                    check_target(id, header.target)?;
                    let request: AppendEntriesRequest<TypeConfig> =
                        postcard::from_bytes(&payload).map_err(malformed)?;
                    encoded(&raft.append_entries(request).await)
                })
                .await
            }
            RaftVote::OPCODE => {
                handle::<RaftVote, _, _>(frame, |header, payload| async move {
                    check_target(id, header.target)?;
                    let request: VoteRequest<NodeId> =
                        postcard::from_bytes(&payload).map_err(malformed)?;
                    encoded(&raft.vote(request).await)
                })
                .await
            }
            RaftSnapshot::OPCODE => {
                handle::<RaftSnapshot, _, _>(frame, |header, payload| async move {
                    check_target(id, header.target)?;
                    let request: InstallSnapshotRequest<TypeConfig> =
                        postcard::from_bytes(&payload).map_err(malformed)?;
                    encoded(&raft.install_snapshot(request).await)
                })
                .await
            }
            RaftMembers::OPCODE => {
                handle::<RaftMembers, _, _>(frame, |_, _| async move {
                    encoded(&crate::raft::members::seen(&raft))
                })
                .await
            }
            other => Err(format!("opcode {other} is not a raft request")),
        }
    }
}

/// Serve the Raft service on `listener` until the task is aborted. It takes messages of up
/// to the largest `raft_message_bytes_max` (and the request's own fields), whatever this
/// member's is: a sender's bound is soft for one entry larger than it (a batch of large
/// extended attributes), which goes alone.
pub fn spawn_service(
    listener: freeflow_rpc::net::Listener,
    key: ClusterKey,
    raft: Raft,
    id: NodeId,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    let mut options = freeflow_rpc::ServerOptions::new("meta-raft");
    options.payload_length_max =
        crate::config::RAFT_MESSAGE_BYTES_MAX.saturating_add(MESSAGE_OVERHEAD_BYTES);
    tokio::spawn(freeflow_rpc::serve(
        listener,
        key,
        options,
        Arc::new(RaftService { raft, id }),
    ))
}

/// The length of a snapshot from its id (`{term}-{index}-{length}` or `empty-{length}`,
/// `snapshot.rs`).
fn snapshot_length(id: &str) -> Option<u64> {
    id.rsplit('-').next()?.parse().ok()
}

/// What a message holds besides its entries or its snapshot chunk (vote, log ids,
/// membership), on top of the largest `raft_message_bytes_max` in the frame bound.
pub const MESSAGE_OVERHEAD_BYTES: u32 = 64 << 10;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use openraft::{CommittedLeaderId, EntryPayload, LogId, Vote};

    use super::*;
    use crate::raft::types::Entry;

    fn entry(index: u64) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 3), index),
            payload: EntryPayload::Blank,
        }
    }

    fn append(prev: Option<u64>, first: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(1, 3),
            prev_log_id: prev.map(|index| entry(index).log_id),
            leader_commit: None,
            entries: vec![entry(first), entry(first + 1)],
        }
    }

    /// A follower is never sent entries that leave a hole after `prev_log_id` (the log
    /// purged under the replication): the append is answered as a conflict before it is
    /// sent (openraft then sends the snapshot), and `status` shows why. One that follows is
    /// sent (here to a port nobody listens on).
    #[tokio::test]
    async fn entries_that_do_not_follow_prev_are_never_sent() {
        let mut network = Network {
            key: ClusterKey::generate().unwrap(),
            reports: PeerReports::default(),
        };
        let mut peer = network
            .new_client(2, &MetaNode::new("127.0.0.1:1", ""))
            .await;
        let option = || RPCOption::new(Duration::from_millis(200));
        match peer
            .append_entries(append(Some(0), 178_100), option())
            .await
        {
            Ok(AppendEntriesResponse::Conflict) => {}
            other => panic!("a hole was not refused: {other:?}"),
        }
        let reported = network.reports.lock().unwrap().get(&2).cloned().unwrap();
        assert!(reported.last_error.unwrap().contains("do not follow"));
        match peer.append_entries(append(None, 0), option()).await {
            Err(RPCError::Unreachable(_)) => {}
            other => panic!("entries from the start were not sent: {other:?}"),
        }
        match peer.append_entries(append(Some(41), 42), option()).await {
            Err(RPCError::Unreachable(_)) => {}
            other => panic!("entries following prev were not sent: {other:?}"),
        }
    }
}
