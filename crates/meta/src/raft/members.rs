//! The metadata cluster's members: Raft's membership, which records each member with its
//! addresses (`MetaNode`); the changes an operator asks for (`freeflow meta add|promote|
//! remove|replace`); the mark a leader gives a member once it answered; and the probe a
//! starting member sends its peers before it proposes a membership.
//!
//! A member that lost its disk also lost the entries and votes it acknowledged: counted in a
//! quorum again under its old id, it could help elect a leader without entries a majority
//! committed. So a member that starts with an empty log asks its peers first. If one of them
//! knows a membership where this member is marked started, it refuses to start and says how
//! to come back: under a new id, as a learner that catches up before it votes
//! (`Replace`). A member never marked (its first start came late) may propose the
//! configured membership as the others did: it has acknowledged nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use freeflow_proto::meta::{MetaMemberChange, PROMOTE_LAG_ENTRIES_MAX};
use freeflow_proto::raft::RaftMembers;
use freeflow_rpc::{ClusterKey, ConnectOptions, Connection};
use openraft::ChangeMembers;
use serde::{Deserialize, Serialize};

use crate::raft::types::{MetaNode, NodeId, Raft};

/// What one member knows of the membership (the reply to `RaftMembers`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MembersSeen {
    /// It holds a membership (its log is not empty).
    pub initialized: bool,
    pub leader: Option<NodeId>,
    pub voters: BTreeSet<NodeId>,
    /// Every member, voters and learners, with its addresses.
    pub nodes: BTreeMap<NodeId, MetaNode>,
}

impl MembersSeen {
    /// This member was taken out (`freeflow meta remove`, or replaced): it holds a
    /// membership that does not name it. A member waiting to be added (`join = true`)
    /// holds none yet, so it is not taken for removed.
    pub fn left_out(&self, me: NodeId) -> bool {
        self.initialized && !self.nodes.contains_key(&me)
    }
}

/// The membership as `raft` has it now.
pub fn seen(raft: &Raft) -> MembersSeen {
    let metrics = raft.metrics().borrow().clone();
    let membership = metrics.membership_config.membership();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    let nodes: BTreeMap<NodeId, MetaNode> = membership
        .nodes()
        .map(|(id, node)| (*id, node.clone()))
        .collect();
    MembersSeen {
        initialized: !voters.is_empty(),
        leader: metrics.current_leader,
        voters,
        nodes,
    }
}

/// Where clients reach each member, for the handshake's member list (`ServerProof`).
pub fn client_addresses(raft: &Raft) -> freeflow_rpc::MemberList {
    let raft = raft.clone();
    freeflow_rpc::MemberList(std::sync::Arc::new(move || {
        seen(&raft)
            .nodes
            .values()
            .map(|node| node.address.clone())
            .collect()
    }))
}

/// Ask the member whose Raft service is at `raft_address` what it knows.
pub async fn probe(
    raft_address: &str,
    key: &ClusterKey,
    timeout: Duration,
) -> Result<MembersSeen, String> {
    let options = ConnectOptions {
        client_name: "meta-probe".to_string(),
        call_timeout_ms: timeout.as_millis() as u64,
        connect_timeout_ms: timeout.as_millis() as u64,
        ..ConnectOptions::default()
    };
    let connection = Connection::connect(raft_address, key, &options)
        .await
        .map_err(|error| error.to_string())?;
    let ((), payload) = connection
        .call(&RaftMembers {}, bytes::Bytes::new())
        .await
        .map_err(|error| error.to_string())?;
    postcard::from_bytes(&payload).map_err(|error| format!("malformed reply: {error}"))
}

/// What a member whose log is empty does at start.
#[derive(Debug, PartialEq, Eq)]
pub enum Bootstrap {
    /// Propose the configured membership (the cluster's first start).
    Propose,
    /// Wait to be added by the leader (`join = true`, or the cluster exists without it).
    Wait,
}

/// How long a starting member waits for each peer's answer.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Decide what member `me`, whose log is empty, does (see the module doc): refused when a
/// peer knows it as started. `peers` are the other members' Raft addresses.
pub async fn bootstrap(
    me: NodeId,
    join: bool,
    peers: &[(NodeId, String)],
    key: &ClusterKey,
) -> Result<Bootstrap, String> {
    let mut asked = tokio::task::JoinSet::new();
    for (id, address) in peers {
        let (id, address, key) = (*id, address.clone(), key.clone());
        asked.spawn(async move { (id, probe(&address, &key, PROBE_TIMEOUT).await) });
    }
    let mut known: Vec<(NodeId, MembersSeen)> = Vec::new();
    while let Some(answer) = asked.join_next().await {
        if let Ok((id, Ok(seen))) = answer {
            if seen.initialized {
                known.push((id, seen));
            }
        }
    }
    decide(me, join, &known)
}

/// [`bootstrap`]'s decision from what the peers that answered know.
fn decide(me: NodeId, join: bool, known: &[(NodeId, MembersSeen)]) -> Result<Bootstrap, String> {
    if let Some((peer, _)) = known
        .iter()
        .find(|(_, seen)| seen.nodes.get(&me).is_some_and(|node| node.started))
    {
        return Err(format!(
            "this member's raft log is empty, but member {peer} knows member {me} as one \
             that has run: its disk was lost, and with it what it acknowledged. Rebuild it \
             as a new member: give it a node_id never used and join = true, start it, then \
             run `freeflow meta replace {me} NEW_ID` (docs/operations.md)"
        ));
    }
    if join || !known.is_empty() {
        return Ok(Bootstrap::Wait);
    }
    Ok(Bootstrap::Propose)
}

/// Leading: mark every member that has answered this leader (itself included) as started,
/// in one membership change of node records (no vote changes). Returns whether a change
/// was made.
pub async fn mark_started(raft: &Raft, me: NodeId) -> Result<bool, String> {
    let metrics = raft.metrics().borrow().clone();
    let answered = |id: &NodeId| {
        *id == me
            || metrics
                .replication
                .as_ref()
                .is_some_and(|replication| replication.get(id).copied().flatten().is_some())
    };
    let marked: BTreeMap<NodeId, MetaNode> = metrics
        .membership_config
        .membership()
        .nodes()
        .filter(|(id, node)| !node.started && answered(id))
        .map(|(id, node)| {
            let mut node = node.clone();
            node.started = true;
            (*id, node)
        })
        .collect();
    if marked.is_empty() {
        return Ok(false);
    }
    changed(raft, ChangeMembers::SetNodes(marked), true).await?;
    Ok(true)
}

/// Carry out an operator's change (leading). Each step is checked against the membership
/// first, so a wrong id or address is refused with the reason, not half done.
pub async fn change(raft: &Raft, change: &MetaMemberChange) -> Result<(), String> {
    let now = seen(raft);
    let lag = |id: NodeId| -> Option<u64> {
        let metrics = raft.metrics().borrow().clone();
        let last = metrics.last_log_index.unwrap_or(0);
        let matched = metrics
            .replication
            .as_ref()
            .and_then(|replication| replication.get(&id).copied().flatten())?;
        Some(last.saturating_sub(matched.index))
    };
    let failed = |error: String| format!("the membership change failed: {error}");
    match change {
        MetaMemberChange::AddLearner {
            id,
            address,
            raft_address,
            replaces,
        } => {
            if *id == 0 {
                return Err("member ids start at 1".into());
            }
            if now.nodes.contains_key(id) {
                return Err(format!("member {id} is already in the cluster"));
            }
            if let Some(old) = replaces.filter(|old| !now.voters.contains(old)) {
                return Err(format!(
                    "member {old} is not a voter, so it cannot be replaced"
                ));
            }
            // Sharing an address with the member it replaces is safe: every Raft message
            // names the member it is for, and the new one refuses the old one's.
            if let Some((other, _)) = now.nodes.iter().find(|(other, node)| {
                Some(**other) != *replaces
                    && (node.address == *address || node.raft_address == *raft_address)
            }) {
                return Err(format!(
                    "member {other} already uses address {address} or raft address {raft_address}"
                ));
            }
            for (what, given) in [("address", address), ("raft address", raft_address)] {
                if !given.contains(':') {
                    return Err(format!("{what} {given:?} is not host:port"));
                }
            }
            let node = MetaNode::new(raft_address, address);
            let nodes = BTreeMap::from([(*id, node)]);
            changed(raft, ChangeMembers::AddNodes(nodes), true)
                .await
                .map_err(failed)?;
        }
        MetaMemberChange::Promote { id } => {
            if now.voters.contains(id) {
                return Err(format!("member {id} votes already"));
            }
            if !now.nodes.contains_key(id) {
                return Err(format!("member {id} is not in the cluster (add it first)"));
            }
            check_caught_up(*id, lag(*id))?;
            changed(
                raft,
                ChangeMembers::AddVoterIds(BTreeSet::from([*id])),
                false,
            )
            .await
            .map_err(failed)?;
        }
        MetaMemberChange::Remove { id } => {
            if !now.nodes.contains_key(id) {
                return Err(format!("member {id} is not in the cluster"));
            }
            let changes = if now.voters.contains(id) {
                if now.voters.len() == 1 {
                    return Err(format!("member {id} is the last voter"));
                }
                ChangeMembers::RemoveVoters(BTreeSet::from([*id]))
            } else {
                ChangeMembers::RemoveNodes(BTreeSet::from([*id]))
            };
            changed(raft, changes, false).await.map_err(failed)?;
        }
        MetaMemberChange::Replace { old, new } => {
            if !now.voters.contains(old) {
                return Err(format!("member {old} is not a voter"));
            }
            if now.voters.contains(new) {
                return Err(format!("member {new} votes already"));
            }
            if !now.nodes.contains_key(new) {
                return Err(format!(
                    "member {new} is not in the cluster (add it first: `freeflow meta add {new} ...`)"
                ));
            }
            check_caught_up(*new, lag(*new))?;
            let mut voters = now.voters.clone();
            voters.remove(old);
            voters.insert(*new);
            changed(raft, ChangeMembers::ReplaceAllVoters(voters), false)
                .await
                .map_err(failed)?;
        }
    }
    Ok(())
}

/// Make one membership change, waiting for one in progress (the leader's own marking of
/// started members, or another operator's change) to end first, for a few seconds at most.
async fn changed(
    raft: &Raft,
    changes: ChangeMembers<NodeId, MetaNode>,
    retain: bool,
) -> Result<(), String> {
    let mut tries = 0;
    loop {
        match raft.change_membership(changes.clone(), retain).await {
            Ok(_) => return Ok(()),
            Err(openraft::error::RaftError::APIError(
                openraft::error::ClientWriteError::ChangeMembershipError(
                    openraft::error::ChangeMembershipError::InProgress(_),
                ),
            )) if tries < IN_PROGRESS_TRIES => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// How many times a change waits 100 ms for one in progress.
const IN_PROGRESS_TRIES: u32 = 50;

fn check_caught_up(id: NodeId, lag: Option<u64>) -> Result<(), String> {
    match lag {
        None => Err(format!(
            "member {id} has not answered the leader yet (is it running, with join = true?)"
        )),
        Some(lag) if lag > PROMOTE_LAG_ENTRIES_MAX => Err(format!(
            "member {id} is {lag} entries behind (at most {PROMOTE_LAG_ENTRIES_MAX} to vote): \
             wait for it to catch up (`freeflow status`)"
        )),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen_with(me_started: Option<bool>) -> MembersSeen {
        let mut seen = MembersSeen {
            initialized: true,
            ..MembersSeen::default()
        };
        seen.voters.extend([1, 2, 3]);
        for id in [1, 3] {
            let mut node = MetaNode::new(format!("h:{id}1"), format!("h:{id}0"));
            node.started = true;
            seen.nodes.insert(id, node);
        }
        if let Some(started) = me_started {
            let mut node = MetaNode::new("h:21", "h:20");
            node.started = started;
            seen.nodes.insert(2, node);
        }
        seen
    }

    /// A member is left out once a membership it holds does not name it, never while it
    /// holds none (waiting to be added).
    #[test]
    fn a_member_is_left_out_only_by_a_membership_without_it() {
        assert!(!seen_with(Some(true)).left_out(2));
        assert!(seen_with(None).left_out(2));
        assert!(!MembersSeen::default().left_out(2));
    }

    /// A member with an empty log proposes only when no peer knows a cluster; it waits to
    /// be added when one does; and it refuses to start when a peer knows it as started
    /// (its disk was lost).
    #[test]
    fn an_empty_member_proposes_waits_or_refuses_by_what_its_peers_know() {
        assert_eq!(decide(2, false, &[]), Ok(Bootstrap::Propose));
        assert_eq!(decide(2, true, &[]), Ok(Bootstrap::Wait));
        assert_eq!(
            decide(2, false, &[(1, seen_with(Some(false)))]),
            Ok(Bootstrap::Wait),
            "a first start that came late"
        );
        assert_eq!(
            decide(4, true, &[(1, seen_with(Some(true)))]),
            Ok(Bootstrap::Wait),
            "a new member"
        );
        let refused = decide(2, false, &[(1, seen_with(Some(true)))]).unwrap_err();
        assert!(refused.contains("meta replace 2"), "{refused}");
        assert!(decide(2, true, &[(3, seen_with(Some(true)))]).is_err());
    }
}
