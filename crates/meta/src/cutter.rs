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
//! What is left: a server cut off from the meta server but not from clients goes on
//! serving until its next heartbeat reaches the meta server (it cannot know it owes a cut
//! before then). Replicated data with versioned chain membership (issue 11) closes that.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use freeflow_proto::io::TruncateObject;
use freeflow_proto::meta::StripeSpace;
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{InodeId, ObjectId, ServerId};
use tokio::task::JoinSet;

use crate::ops::size::absorb_stripe_space;
use crate::ops::truncate::settle_truncation;
use crate::records::TruncationRecord;
use crate::shared::Shared;

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

/// Cuts of one server: (stripe index, object length to cut at).
type ServerCuts = Vec<(u32, u64)>;

/// Send the cuts of `record`, then settle the confirmed ones. Ok when every cut of the
/// record was confirmed; the first failing server otherwise (the rest stay pending).
pub async fn carry_out(
    shared: &Arc<Shared>,
    inode: InodeId,
    record: &TruncationRecord,
    reach: Reach,
) -> Result<(), CutError> {
    let now = Instant::now();
    let mut by_server: BTreeMap<ServerId, ServerCuts> = BTreeMap::new();
    let mut done_stripes = Vec::new();
    // The space of each stripe cut, as its server reported it after the cut.
    let mut spaces: Vec<StripeSpace> = Vec::new();
    let mut failures: Vec<(ServerId, String)> = Vec::new();
    for (stripe, size_bytes) in &record.cuts {
        let Some(server) = record.layout.servers.get(*stripe as usize) else {
            // Not in the layout: no object to cut (a corrupt record); drop the entry.
            tracing::warn!(inode, stripe, "pending cut of a stripe outside the layout");
            done_stripes.push(*stripe);
            continue;
        };
        if reach == Reach::UpOnly && !shared.registry().server_is_up(*server, now) {
            failures.push((*server, "server is down".into()));
            continue;
        }
        let length = record.layout.object_length(*size_bytes, *stripe);
        by_server
            .entry(*server)
            .or_default()
            .push((*stripe, length));
    }
    let mut tasks = JoinSet::new();
    for (server, cuts) in by_server {
        let shared = shared.clone();
        tasks.spawn(async move {
            let (done, failure) = cut_on_server(&shared, inode, server, &cuts).await;
            (server, done, failure)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((server, done, failure)) => {
                done_stripes.extend(done.iter().map(|space| space.stripe_index));
                spaces.extend(done);
                if let Some(reason) = failure {
                    failures.push((server, reason));
                }
            }
            Err(error) => tracing::error!(inode, %error, "cut task failed"),
        }
    }
    // A task that panicked confirmed nothing and reported nothing: its stripes stay pending.
    let unconfirmed = record
        .cuts
        .iter()
        .map(|(stripe, _)| *stripe)
        .find(|stripe| !done_stripes.contains(stripe));
    if !done_stripes.is_empty() {
        let generation = record.generation;
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
            server: record
                .layout
                .servers
                .get(stripe as usize)
                .copied()
                .unwrap_or_default(),
            reason: "the cut task failed".into(),
        }),
        None => Ok(()),
    }
}

/// Cut the stripes of one server in order; stops at the first failure. Returns the stripes
/// cut, with the space each object holds after its cut, and the failure.
async fn cut_on_server(
    shared: &Shared,
    inode: InodeId,
    server: ServerId,
    cuts: &[(u32, u64)],
) -> (Vec<StripeSpace>, Option<String>) {
    let mut done = Vec::with_capacity(cuts.len());
    let Some(address) = shared.registry().address(server) else {
        return (done, Some("server is not registered".into()));
    };
    let connection = match shared.io.get(server, &address).await {
        Ok(connection) => connection,
        Err(reason) => return (done, Some(reason)),
    };
    for (stripe_index, length) in cuts {
        let request = TruncateObject {
            object: ObjectId {
                inode,
                stripe_index: *stripe_index,
            },
            length: *length,
        };
        match connection.call(&request, bytes::Bytes::new()).await {
            Ok((space, _)) => done.push(StripeSpace {
                stripe_index: *stripe_index,
                allocated_bytes: space.allocated_bytes,
                stamp: space.stamp,
            }),
            Err(error) => return (done, Some(error.to_string())),
        }
    }
    (done, None)
}
