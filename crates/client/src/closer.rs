//! Closes nobody waits for, gathered into `CloseHandles` requests.
//!
//! The kernel sends a FUSE `release` after `close(2)` has returned, so nothing waits for the
//! meta server to forget the handle: the mount closes such handles here
//! ([`crate::FileHandle::close_deferred`]). Each was flushed first, so what is left is
//! bookkeeping at the meta server, and one request per file was a third of the work of a
//! create. The closes of `CLOSE_WAIT_MS` (and those made while a request is on its way) go
//! out together, one request per session of up to `CLOSE_HANDLES_MAX` handles.
//!
//! Until its close arrives the meta server counts the handle open: an unlink meanwhile
//! keeps the file's data as an orphan, reaped at the close; a truncation by another client
//! recalls this client's writes on it, and there are none. A request that fails on its way
//! (connection lost, timed out) is sent once more; one the server refuses is only logged
//! (a restarted server forgot the session, and the handles are gone with it).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use freeflow_proto::meta::CloseHandles;
use freeflow_proto::ErrorCode;
use freeflow_types::limits::CLOSE_HANDLES_MAX;

use crate::pool::Pool;

/// How long a close waits for others to go with it.
pub const CLOSE_WAIT_MS: u64 = 2;

/// Most closes queued; past it a close waits for room (bounded memory when the meta
/// server cannot keep up or is away).
pub const CLOSES_QUEUED_MAX: usize = 65_536;

/// Whether the meta server answered and refused (nothing to gain by sending again).
fn refused(error: &crate::ClientError) -> bool {
    matches!(
        error.code(),
        ErrorCode::BadHandle | ErrorCode::InvalidArgument | ErrorCode::Protocol
    )
}

/// The queue of closes not sent yet, and the task that sends them.
pub(crate) struct Closer {
    pool: Arc<Pool>,
    queue: Mutex<Queue>,
    /// Woken when the sender made room in a full queue.
    room: tokio::sync::Notify,
}

#[derive(Default)]
struct Queue {
    /// (session, handle, sent once already), in close order.
    pending: Vec<(u64, u64, bool)>,
    /// A sender task is running (it sends everything queued before it stops).
    sending: bool,
}

impl Closer {
    pub(crate) fn new(pool: Arc<Pool>) -> Closer {
        Closer {
            pool,
            queue: Mutex::new(Queue::default()),
            room: tokio::sync::Notify::new(),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().expect("close queue not poisoned")
    }

    /// Queue the close of `handle_id` of `session_id`; returns at once unless the queue is
    /// full.
    pub(crate) async fn close_later(self: &Arc<Self>, session_id: u64, handle_id: u64) {
        loop {
            let room = self.room.notified();
            {
                let mut queue = self.queue();
                if queue.pending.len() < CLOSES_QUEUED_MAX {
                    queue.pending.push((session_id, handle_id, false));
                    if !queue.sending {
                        queue.sending = true;
                        tokio::spawn(self.clone().send());
                    }
                    return;
                }
            }
            room.await;
        }
    }

    /// Send what is queued, a batch per session, until the queue is empty.
    async fn send(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(CLOSE_WAIT_MS)).await;
            let batch = {
                let mut queue = self.queue();
                if queue.pending.is_empty() {
                    queue.sending = false;
                    return;
                }
                let take = queue.pending.len().min(CLOSE_HANDLES_MAX);
                queue.pending.drain(..take).collect::<Vec<_>>()
            };
            self.room.notify_waiters();
            let mut sessions: Vec<u64> = batch.iter().map(|(session, _, _)| *session).collect();
            sessions.sort_unstable();
            sessions.dedup();
            for session_id in sessions {
                let handles: Vec<(u64, bool)> = batch
                    .iter()
                    .filter(|(session, _, _)| *session == session_id)
                    .map(|(_, handle, resent)| (*handle, *resent))
                    .collect();
                let count = handles.len();
                let request = CloseHandles {
                    session_id,
                    handle_ids: handles.iter().map(|(handle, _)| *handle).collect(),
                };
                let closed = self
                    .pool
                    .meta_call(&request, || {
                        format!("{count} handles of session {session_id}")
                    })
                    .await;
                match closed {
                    Ok(not_open) if not_open.is_empty() => {}
                    Ok(not_open) => tracing::debug!(
                        session_id,
                        handles = ?not_open,
                        "closed handles the meta server no longer had (a restart ended them)"
                    ),
                    Err(error) if refused(&error) => tracing::debug!(
                        session_id,
                        count,
                        %error,
                        "closing handles refused; they end with their session"
                    ),
                    Err(error) => {
                        // Lost on the way: once more (queued closes are bounded anyway).
                        let again: Vec<(u64, u64, bool)> = handles
                            .iter()
                            .filter(|(_, resent)| !resent)
                            .map(|(handle, _)| (session_id, *handle, true))
                            .collect();
                        tracing::debug!(
                            session_id,
                            count,
                            again = again.len(),
                            %error,
                            "closing handles failed on the way; sending them once more"
                        );
                        self.queue().pending.extend(again);
                    }
                }
            }
        }
    }
}
