//! Carrying out truncations: after a shrink has committed its size and its pending cuts
//! (`ops/truncate.rs`), each I/O server of the layout is sent `TruncateObject` for its
//! stripes, the servers in parallel, and the cuts they confirmed are settled through the
//! writer. A set-attributes replies only after this, so the client sees its truncate done.
//!
//! Ordering with writes: the client waits for its own writes in flight before sending the
//! set-attributes, and the meta server replies only after the cuts, so a write sent after
//! the reply is never cut. A cut left pending because its server was unreachable is made
//! before that server serves data again: its registration is answered only after the meta
//! server tried the cuts it owes (`reaper::cuts_owed_by`), and the server refuses reads and
//! writes until a reply says none is owed (`ioserver/src/gate.rs`). So no write made after
//! its return is cut, and no byte the truncate removed is read back when the file grows.
//! The caller of the failed truncate was told (`Unreachable`, "cut pending").
//!
//! Replicated stripes are cut on every member of their chain, those syncing last; a member
//! out of its chains is skipped (its copy is remade from a partner when it returns), and a
//! member that fails while a client waits is waited for until it is put out.
//!
//! What is left: a server cut off from the meta server but not from clients goes on
//! serving an unreplicated stripe until its next heartbeat reaches the meta server (it
//! cannot know it owes a cut before then).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::io::TruncateObject;
use freeflow_proto::meta::{MemberState, StripeSpace};
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{InodeId, ObjectId, ServerId};
use tokio::task::JoinSet;

use crate::ops::size::absorb_stripe_space;
use crate::ops::truncate::settle_truncation;
use crate::records::TruncationRecord;
use crate::shared::Shared;

/// Most truncations whose per-member confirmations are remembered (`Shared::cuts_confirmed`).
const CUTS_CONFIRMED_MAX: usize = 65_536;

/// Why the cuts of a truncation are not all done.
#[derive(Debug, thiserror::Error)]
pub enum CutError {
    #[error(
        "the size of inode {inode} is set, but the cut of its data is pending on server \
         {server} ({reason}); it will be retried"
    )]
    Pending {
        inode: InodeId,
        server: ServerId,
        reason: String,
    },
    #[error("the size of inode {inode} is set and its data cut, but settling failed: {error}")]
    Settle { inode: InodeId, error: WireError },
}

impl CutError {
    pub fn to_wire(&self) -> WireError {
        let code = match self {
            CutError::Pending { .. } => ErrorCode::Unreachable,
            CutError::Settle { error, .. } => error.code,
        };
        WireError::new(code, self.to_string())
    }
}

/// Which servers to try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Every server of the layout (a client is waiting: try even those reported down).
    All,
    /// Only servers up in the registry (the reaper: the others are retried when they
    /// re-register).
    UpOnly,
}

/// Send the cuts of `record`, then settle the confirmed ones. Ok when every cut of the
/// record was confirmed; the first failing server otherwise (the rest stay pending).
pub async fn carry_out(
    shared: &Arc<Shared>,
    inode: InodeId,
    record: &TruncationRecord,
    reach: Reach,
) -> Result<(), CutError> {
    let now = Instant::now();
    let mut done_stripes = Vec::new();
    // The space of each stripe cut, as the first confirming member reported it.
    let mut spaces: BTreeMap<u32, StripeSpace> = BTreeMap::new();
    let mut failures: Vec<(ServerId, String)> = Vec::new();
    // Per stripe: the object length to cut at, and the members still to confirm.
    let mut wanted: BTreeMap<u32, (u64, Vec<ServerId>)> = BTreeMap::new();
    let replicated = record.layout.replicas() > 1;
    // Chains as the map makes them: a lost server's stand-in is cut in its place.
    let map = shared.registry().service_map();
    for (stripe, size_bytes) in &record.cuts {
        let object = ObjectId {
            inode,
            stripe_index: *stripe,
        };
        let chain: Vec<ServerId> = map
            .chain(object, &record.layout.chain(*stripe))
            .iter()
            .map(|member| member.server)
            .collect();
        if chain.is_empty() {
            // Not in the layout: no object to cut (a corrupt record); drop the entry.
            tracing::warn!(inode, stripe, "pending cut of a stripe outside the layout");
            done_stripes.push(*stripe);
            continue;
        }
        let length = record.layout.object_length(*size_bytes, *stripe);
        wanted.insert(*stripe, (length, chain));
    }
    let key = (inode, record.generation);
    if replicated {
        // Members that confirmed their cut of this truncation already are not asked again.
        let confirmed = shared
            .cuts_confirmed()
            .get(&key)
            .cloned()
            .unwrap_or_default();
        for (stripe, (_, members)) in wanted.iter_mut() {
            members.retain(|member| !confirmed.contains(&(*stripe, *member)));
        }
    }
    // Each stripe is cut down its chain, as writes go: members in service in chain order,
    // then those syncing (a syncing member copying an object then sees its partners' cut
    // made before its own, `resync.rs`). Each member cuts under its range lock and passes
    // the cut on before releasing it, so a write of another client overlapping the cut is
    // applied on every member on the same side of it. Members out are skipped: their copy
    // is remade when they return.
    // Passes: a member that fails while a client waits is waited for until it is out, and
    // the rest of its chain (which the failure may have kept from the cut) is cut in the
    // next pass; a member out when its chain was built but back (syncing) by the end missed
    // the cut while its resync may already have copied the object, so it is cut too.
    let mut skipped_out: Vec<ServerId> = Vec::new();
    for pass in 0..3 {
        if pass > 0 {
            let again = {
                let registry = shared.registry();
                let back = skipped_out
                    .iter()
                    .any(|server| registry.state(*server) != MemberState::Out);
                let left = wanted.values().any(|(_, members)| {
                    members
                        .iter()
                        .any(|server| registry.state(*server) != MemberState::Out)
                });
                replicated && left && (back || !failures.is_empty())
            };
            if !again {
                break;
            }
            failures.clear();
            skipped_out.clear();
        }
        let chains: Vec<(u32, u64, Vec<ServerId>)> = {
            let map = shared.registry().service_map();
            let registry = shared.registry();
            wanted
                .iter()
                .filter_map(|(stripe, (length, members))| {
                    // The order writes take (members in service, then those syncing or
                    // filling), so a cut and a write meet in the same order everywhere.
                    let order = if replicated {
                        let object = ObjectId {
                            inode,
                            stripe_index: *stripe,
                        };
                        map.write_chain(object, &record.layout.chain(*stripe))
                    } else {
                        members.clone()
                    };
                    skipped_out.extend(members.iter().filter(|server| {
                        replicated && registry.state(**server) == MemberState::Out
                    }));
                    let mut chain: Vec<ServerId> = Vec::with_capacity(members.len());
                    for server in order.iter().filter(|server| members.contains(server)) {
                        if (!replicated || registry.state(*server) == MemberState::InService)
                            && reach == Reach::UpOnly
                            && !registry.server_is_up(*server, now)
                        {
                            failures.push((*server, "server is down".into()));
                            return None;
                        }
                        chain.push(*server);
                    }
                    (!chain.is_empty()).then_some((*stripe, *length, chain))
                })
                .collect()
        };
        let mut tasks = JoinSet::new();
        for (stripe, length, chain) in chains {
            let shared = shared.clone();
            tasks.spawn(async move {
                let outcome = cut_chain(&shared, inode, stripe, length, &chain).await;
                (stripe, outcome)
            });
        }
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((stripe, (confirmed, space, failure))) => {
                    if replicated && !confirmed.is_empty() {
                        let mut done = shared.cuts_confirmed();
                        if !done.contains_key(&key) {
                            // Bounded: an older truncation of the inode is over, and past
                            // the bound all are forgotten (members then owe their cut again
                            // until it settles, which only holds their data back briefly).
                            done.retain(|(other, _), _| *other != inode);
                            if done.len() >= CUTS_CONFIRMED_MAX {
                                done.clear();
                            }
                        }
                        let entry = done.entry(key).or_default();
                        entry.extend(confirmed.iter().map(|server| (stripe, *server)));
                    }
                    if let Some((_, members)) = wanted.get_mut(&stripe) {
                        members.retain(|member| !confirmed.contains(member));
                    }
                    if let Some(space) = space {
                        spaces.entry(stripe).or_insert(space);
                    }
                    if let Some(failure) = failure {
                        failures.push(failure);
                    }
                }
                Err(error) => tracing::error!(inode, %error, "cut task failed"),
            }
        }
        if replicated && reach == Reach::All && !failures.is_empty() {
            // A client waits: a member that failed is about to be put out of its chains
            // (or back); wait for that rather than fail the truncate.
            let failed: Vec<ServerId> = failures.iter().map(|(server, _)| *server).collect();
            wait_until_out(shared, &failed).await;
        }
    }
    {
        let registry = shared.registry();
        for (stripe, (_, members)) in &wanted {
            let left = members
                .iter()
                .any(|server| !(replicated && registry.state(*server) == MemberState::Out));
            if !left {
                done_stripes.push(*stripe);
            }
        }
        failures.retain(|(server, _)| !(replicated && registry.state(*server) == MemberState::Out));
    }
    if replicated && done_stripes.len() >= record.cuts.len() {
        shared.cuts_confirmed().remove(&key);
    }
    // A task that panicked confirmed nothing and reported nothing: its stripes stay pending.
    let unconfirmed = record
        .cuts
        .iter()
        .map(|(stripe, _)| *stripe)
        .find(|stripe| !done_stripes.contains(stripe));
    if !done_stripes.is_empty() {
        let generation = record.generation;
        let spaces: Vec<StripeSpace> = spaces
            .into_iter()
            .filter(|(stripe, _)| done_stripes.contains(stripe))
            .map(|(_, space)| space)
            .collect();
        let settled = shared
            .write(move |write, _context| {
                absorb_stripe_space(write, inode, &spaces)?;
                settle_truncation(write, inode, generation, &done_stripes)
            })
            .await;
        if let Err(error) = settled {
            return Err(CutError::Settle { inode, error });
        }
    }
    if let Some((server, reason)) = failures.into_iter().next() {
        return Err(CutError::Pending {
            inode,
            server,
            reason,
        });
    }
    match unconfirmed {
        Some(stripe) => Err(CutError::Pending {
            inode,
            server: wanted
                .get(&stripe)
                .and_then(|(_, members)| members.first().copied())
                .unwrap_or_default(),
            reason: "the cut task failed".into(),
        }),
        None => Ok(()),
    }
}

/// Wait, up to the time the meta server takes to put a silent server out and a margin,
/// until each of `servers` is out of its chains or answers heartbeats again.
async fn wait_until_out(shared: &Arc<Shared>, servers: &[ServerId]) {
    let limit = Duration::from_millis(
        shared.config.server_down_after_ms + 3 * u64::from(shared.config.heartbeat_interval_ms),
    );
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let settled = {
            let registry = shared.registry();
            servers
                .iter()
                .all(|server| registry.state(*server) == MemberState::Out)
        };
        if settled {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Cut one stripe down its chain: the first member cuts and passes the cut on (see
/// `ioserver/src/service.rs`). Returns the members known to have cut, the space the first
/// one reported, and the failure: a partner's failure comes back as `Unreachable` from the
/// first member, which did cut.
async fn cut_chain(
    shared: &Shared,
    inode: InodeId,
    stripe_index: u32,
    length: u64,
    chain: &[ServerId],
) -> (
    Vec<ServerId>,
    Option<StripeSpace>,
    Option<(ServerId, String)>,
) {
    let Some((&head, rest)) = chain.split_first() else {
        return (Vec::new(), None, None);
    };
    let Some(address) = shared.registry().address(head) else {
        return (
            Vec::new(),
            None,
            Some((head, "server is not registered".into())),
        );
    };
    let connection = match shared.io.get(head, &address).await {
        Ok(connection) => connection,
        Err(reason) => return (Vec::new(), None, Some((head, reason))),
    };
    let request = TruncateObject {
        object: ObjectId {
            inode,
            stripe_index,
        },
        length,
        forward: rest.to_vec(),
    };
    match connection.call(&request, bytes::Bytes::new()).await {
        Ok((space, _)) => (
            chain.to_vec(),
            Some(StripeSpace {
                stripe_index,
                allocated_bytes: space.allocated_bytes,
                stamp: space.stamp,
            }),
            None,
        ),
        Err(freeflow_rpc::RpcError::Remote(error))
            if error.code == ErrorCode::Unreachable && !rest.is_empty() =>
        {
            (vec![head], None, Some((rest[0], error.message)))
        }
        Err(error) => (Vec::new(), None, Some((head, error.to_string()))),
    }
}
