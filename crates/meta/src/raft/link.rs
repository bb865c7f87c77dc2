//! What the leader's writer and service need of Raft: proposing a batch's changes in
//! order, learning when they are committed, and giving up the lead.

use std::time::Duration;

use tokio::sync::{oneshot, watch};

use crate::raft::batch::Batch;
use crate::raft::log_store::LogStore;
use crate::raft::network::PeerReports;
use crate::raft::types::{NodeId, Raft, TypeConfig};
use crate::store::Change;

/// How long the writer waits for a batch it must answer durably to be committed before it
/// gives up the lead (a leader cut off from its followers commits nothing).
pub const COMMIT_WAIT: Duration = Duration::from_secs(10);

pub type CommitReceiver = oneshot::Receiver<
    Result<
        openraft::raft::ClientWriteResponse<TypeConfig>,
        openraft::error::ClientWriteError<NodeId, crate::raft::types::MetaNode>,
    >,
>;

/// The leader's handle on Raft.
pub struct RaftLink {
    pub raft: Raft,
    pub id: NodeId,
    /// This leadership (random, new for each time this server starts leading): carried by
    /// its batches and their undo records, so that a batch of another leadership is never
    /// taken for one of its own, even with the same transaction number.
    pub origin: u64,
    /// The runtime the writer thread enters to propose.
    pub runtime: tokio::runtime::Handle,
    /// Set once this server must stop leading (a proposal failed, a commit did not come
    /// in time, Raft no longer makes it leader); the supervisor and the writer watch it.
    pub deposed: std::sync::Arc<watch::Sender<Option<String>>>,
    /// What sending to each follower last came to (`freeflow status`).
    pub reports: PeerReports,
    /// The log, to count the bytes a follower is behind.
    pub log: LogStore,
}

impl RaftLink {
    /// Hand a batch's changes to Raft, after every batch proposed before it. Called by the
    /// writer thread (never from inside the runtime).
    pub fn propose(&self, txn: u64, changes: &[Change]) -> Result<CommitReceiver, String> {
        let batch = Batch::new(self.origin, txn, changes);
        self.runtime
            .block_on(self.raft.client_write_ff(batch))
            .map_err(|error| format!("raft stopped: {error}"))
    }

    /// Wait (on the writer thread) for a proposed batch's commit; a leadership that ends
    /// meanwhile ends the wait.
    pub fn wait_committed(&self, receiver: CommitReceiver) -> Result<(), String> {
        let mut deposed = self.deposed.subscribe();
        let timer = self.timer(COMMIT_WAIT);
        self.runtime.block_on(async {
            tokio::select! {
                outcome = receiver => committed(outcome),
                elapsed = timer => match elapsed {
                    Ok(()) => Err(format!("not committed within {COMMIT_WAIT:?}")),
                    Err(_) => Err("the server is shutting down".to_string()),
                },
                _ = deposed.wait_for(|reason| reason.is_some()) => {
                    Err("stopped leading while waiting for a commit".to_string())
                }
            }
        })
    }

    /// A timer the writer thread can wait on: it fires after `wait`, and fails at once when
    /// the runtime shuts down (its task is dropped). The writer runs outside the runtime,
    /// where a Tokio timer polled during shutdown panics.
    pub fn timer(&self, wait: Duration) -> oneshot::Receiver<()> {
        let (mut fire, fired) = oneshot::channel();
        self.runtime.spawn(async move {
            // Ends as soon as the wait is over one way or another (the receiver dropped).
            tokio::select! {
                () = tokio::time::sleep(wait) => {
                    let _ = fire.send(());
                }
                () = fire.closed() => {}
            }
        });
        fired
    }

    /// Whether this server has stopped leading.
    pub fn is_deposed(&self) -> bool {
        self.deposed.borrow().is_some()
    }

    /// Stop leading, for `reason`; the supervisor restarts this server as a follower.
    pub fn depose(&self, reason: String) {
        depose(&self.deposed, reason);
    }
}

/// Mark a leadership over (once; the first reason is kept).
pub fn depose(deposed: &watch::Sender<Option<String>>, reason: String) {
    {
        deposed.send_if_modified(|current| {
            if current.is_none() {
                tracing::warn!(%reason, "giving up the metadata lead");
                *current = Some(reason);
                true
            } else {
                false
            }
        });
    }
}

type Outcome = Result<
    Result<
        openraft::raft::ClientWriteResponse<TypeConfig>,
        openraft::error::ClientWriteError<NodeId, crate::raft::types::MetaNode>,
    >,
    oneshot::error::RecvError,
>;

/// Whether a proposal's outcome says it was committed, or why not.
pub fn committed(outcome: Outcome) -> Result<(), String> {
    match outcome {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(format!("not committed: {error}")),
        Err(_) => Err("raft dropped the proposal".to_string()),
    }
}
