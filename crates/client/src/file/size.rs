//! A handle's size and durability: size commits (in the background, at flush, fsync and
//! close), `flush` and `fsync`, growth without bytes (`extend_to`), what the handle learns
//! of the size from the meta server, and [`Truncation`], which holds commits back across a
//! size change by this client.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

use freeflow_proto::io::SyncObjects;
use freeflow_proto::meta::{CommitSize, GetAttr, StripeSpace};
use freeflow_proto::ErrorCode;
use freeflow_types::{Attr, ObjectId, TimeSpec};

use super::state::{FileHandle, HandleShared, HandleState};
use crate::error::ClientError;

/// The wall clock as a `TimeSpec` (mtime of writes).
pub(crate) fn now() -> TimeSpec {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    TimeSpec::new(since_epoch.as_secs() as i64, since_epoch.subsec_nanos())
}

/// A size commit between its computation and its reply.
pub(super) struct CommitTicket {
    pub(super) size_bytes: u64,
    /// Answered only once durable at the meta server (the commit ending an fsync).
    pub(super) durable: bool,
    /// `writes.started` it covers (all those writes were acknowledged when computed).
    pub(super) covers_writes: u64,
    pub(super) truncate_epoch: u64,
}

impl HandleState {
    /// Register a commit of the acknowledged size (the caller checked no truncation is
    /// pending).
    pub(super) fn start_commit(&mut self, covers_writes: u64, durable: bool) -> CommitTicket {
        if let Some((through, end)) = self.size.pending_extension {
            if self.writes.done_through(through) {
                self.size.acknowledged_end = self.size.acknowledged_end.max(end);
                self.size.pending_extension = None;
            }
        }
        self.size.commits_running += 1;
        CommitTicket {
            size_bytes: self.size.acknowledged_end,
            durable,
            covers_writes,
            truncate_epoch: self.size.truncate_epoch,
        }
    }
}

/// A size change of a file by this client, holding back the size commits of its open
/// handles (see the module doc). Dropped without [`Truncation::finish`] (an error or a
/// cancelled call), it lets them go on without touching their sizes.
pub(crate) struct Truncation {
    pub(super) handles: Vec<Arc<HandleShared>>,
}

impl Truncation {
    /// Wait for the writes through `handles` that started before this call, stop new size
    /// commits, and wait for those already sent.
    pub(crate) async fn begin(handles: Vec<Arc<HandleShared>>) -> Truncation {
        for handle in &handles {
            // A failure is kept on the handle, reported by its next call.
            let _ = handle.send_gathered().await;
        }
        let snapshots: Vec<u64> = handles
            .iter()
            .map(|handle| handle.lock().writes.started)
            .collect();
        for (handle, &sequence) in handles.iter().zip(&snapshots) {
            handle
                .wait_then(|state| state.writes.done_through(sequence).then_some(()))
                .await;
        }
        for handle in &handles {
            let mut state = handle.lock();
            state.size.truncates_pending += 1;
            state.size.truncate_epoch += 1;
            // Charges count from the new size (set in `attr` by the truncation's reply).
            state.writes.charged_through.clear();
            state.readahead.clear();
        }
        // Made before the next await, so a cancelled call still lets the commits go.
        let truncation = Truncation { handles };
        for handle in &truncation.handles {
            handle
                .wait_then(|state| (state.size.commits_running == 0).then_some(()))
                .await;
        }
        truncation
    }

    /// The meta server set the size: the handles forget what they wrote beyond it, so a
    /// later commit does not grow the file back.
    pub(crate) fn finish(mut self, attr: &Attr) {
        for handle in std::mem::take(&mut self.handles) {
            {
                let mut state = handle.lock();
                state.size.truncates_pending -= 1;
                let size = attr.size_bytes;
                state.size.known_size = size;
                state.size.written_end = state.size.written_end.min(size);
                state.size.acknowledged_end = state.size.acknowledged_end.min(size);
                state.size.pending_extension = state
                    .size
                    .pending_extension
                    .map(|(through, end)| (through, end.min(size)));
                // Reports from before the cut are stale; the meta server has the cut's own.
                state.size.stripe_space.clear();
                state.attr = attr.clone();
                state.readahead.clear();
                state.writes.charged_through.clear();
            }
            handle.notify();
        }
    }
}

impl Drop for Truncation {
    fn drop(&mut self) {
        for handle in &self.handles {
            handle.lock().size.truncates_pending -= 1;
            handle.notify();
        }
    }
}

impl HandleShared {
    pub(super) async fn commit_size(
        &self,
        size_bytes: u64,
        durable: bool,
    ) -> Result<Attr, ClientError> {
        let inode = self.inode;
        let space = self
            .lock()
            .size
            .stripe_space
            .iter()
            .map(|(&stripe_index, space)| StripeSpace {
                stripe_index,
                allocated_bytes: space.allocated_bytes,
                stamp: space.stamp,
            })
            .collect();
        let request = CommitSize {
            inode,
            size_bytes,
            modify_time: now(),
            space,
            durable,
        };
        self.client
            .pool()
            .meta_call(&request, || format!("inode {inode} size {size_bytes}"))
            .await
    }

    /// Record the reply to a commit: absorbed only if no truncation started since it was
    /// computed (its size may be from before the truncation).
    pub(super) fn finish_commit(&self, ticket: &CommitTicket, result: &Result<Attr, ClientError>) {
        {
            let mut state = self.lock();
            state.size.commits_running -= 1;
            state.size.last_commit = Instant::now();
            match result {
                Ok(attr) if ticket.truncate_epoch == state.size.truncate_epoch => {
                    state.absorb_attr(attr.clone());
                    state.size.writes_committed =
                        state.size.writes_committed.max(ticket.covers_writes);
                }
                Ok(_) => tracing::debug!(
                    inode = self.inode,
                    size_bytes = ticket.size_bytes,
                    "dropping the reply to a size commit computed before a truncation"
                ),
                Err(_) => {}
            }
        }
        self.notify();
    }

    /// Start a background size commit if the interval has passed since the last one.
    pub(super) fn commit_if_due(self: &Arc<Self>) {
        let interval = Duration::from_millis(self.client.config().size_commit_interval_ms);
        let ticket = {
            let mut state = self.lock();
            let due = state.size.commits_running == 0
                && state.size.truncates_pending == 0
                && state.writes.started != state.size.writes_committed
                && state.size.last_commit.elapsed() >= interval;
            if !due {
                return;
            }
            // Only acknowledged bytes: readers elsewhere should not see a size that covers
            // data still on its way. It covers no new writes: some may still be in flight.
            let covers_writes = state.size.writes_committed;
            state.start_commit(covers_writes, false)
        };
        let commit = self.spawn_commit(ticket);
        let inode = self.inode;
        tokio::spawn(async move {
            // Not fatal: the next flush, fsync or close commits again and reports.
            if let Ok(Err(error)) = commit.await {
                tracing::warn!(inode, %error, "background size commit failed");
            }
        });
    }

    /// Send a commit and record its reply on a task of its own: a caller that stops
    /// waiting (a cancelled flush) must not leave it counted as running forever, nor
    /// unrecorded while the request may still reach the meta server.
    pub(super) fn spawn_commit(
        self: &Arc<Self>,
        ticket: CommitTicket,
    ) -> tokio::task::JoinHandle<Result<Attr, ClientError>> {
        let handle = self.clone();
        tokio::spawn(async move {
            let result = handle.commit_size(ticket.size_bytes, ticket.durable).await;
            handle.finish_commit(&ticket, &result);
            result
        })
    }

    /// The sequence number of the last write started: what a call that must see every
    /// earlier write waits for.
    pub(super) fn writes_started(&self) -> u64 {
        self.lock().writes.started
    }

    /// Wait for the writes up to sequence `through`, report a failed one, and commit the
    /// size if anything was written since the last commit. With `durable`, the metadata is
    /// durable at the meta server when this returns (the commit is made durable, or, with
    /// nothing to commit, everything answered so far is: the file's create too).
    pub(super) async fn flush_through(
        self: &Arc<Self>,
        through: u64,
        durable: bool,
    ) -> Result<(), ClientError> {
        if !self.access.write {
            if durable {
                self.client.pool().sync_meta().await?;
            }
            return Ok(());
        }
        let ticket = self
            .wait_then(|state| {
                if !state.writes.done_through(through) || state.size.truncates_pending > 0 {
                    return None;
                }
                if let Some(error) = state.writes.earlier_write_error(self.inode) {
                    return Some(Err(error));
                }
                let covers_writes = through.min(state.writes.started);
                if state.size.writes_committed >= covers_writes {
                    return Some(Ok(None));
                }
                Some(Ok(Some(state.start_commit(covers_writes, durable))))
            })
            .await?;
        let Some(ticket) = ticket else {
            if durable {
                self.client.pool().sync_meta().await?;
            }
            return Ok(());
        };
        match self.spawn_commit(ticket).await {
            Ok(result) => result.map(|_| ()),
            // Only if the runtime is shutting down.
            Err(error) => Err(ClientError::inode(
                self.inode,
                ErrorCode::Io,
                format!("the size commit task ended early: {error}"),
            )),
        }
    }

    pub(super) async fn flush(self: &Arc<Self>) -> Result<(), ClientError> {
        self.send_gathered().await?;
        self.flush_through(self.writes_started(), false).await
    }

    pub(super) async fn fsync(self: &Arc<Self>) -> Result<(), ClientError> {
        if !self.access.write {
            // Nothing of this handle's to sync; the file's own metadata still must be.
            return self.client.pool().sync_meta().await;
        }
        self.send_gathered().await?;
        let through = self.writes_started();
        let layout = self.data_layout()?.clone();
        // Taken under the lock that sees the writes done: every write acknowledged by then
        // is in the set.
        let stripes = self
            .wait_then(|state| {
                if !state.writes.done_through(through) {
                    return None;
                }
                if let Some(error) = state.writes.earlier_write_error(self.inode) {
                    return Some(Err(error));
                }
                Some(Ok(std::mem::take(&mut state.writes.unsynced_stripes)))
            })
            .await?;
        let syncs = stripes.iter().map(|&stripe_index| {
            let request = SyncObjects {
                objects: vec![ObjectId {
                    inode: self.inode,
                    stripe_index,
                }],
            };
            let layout = &layout;
            async move {
                self.client
                    .pool()
                    .chain_sync(layout, stripe_index, self.inode, &request, || {
                        format!("of inode {} stripe {stripe_index}", self.inode)
                    })
                    .await
            }
        });
        if let Err(error) = futures::future::try_join_all(syncs).await {
            // Bytes acknowledged but not synced may be lost with that server: the handle
            // reports the failure from now on.
            let mut state = self.lock();
            state.writes.unsynced_stripes.extend(stripes);
            if state.writes.first_error.is_none() {
                state.writes.first_error = Some(error.clone());
            }
            return Err(error);
        }
        self.flush_through(through, true).await
    }
}

impl FileHandle {
    /// The size this handle knows, including its own writes not yet committed.
    pub fn size(&self) -> u64 {
        self.shared.local_size()
    }

    /// The file's attributes as the meta server has them now.
    pub(super) async fn fetch_attr(&self) -> Result<Attr, ClientError> {
        let inode = self.shared.inode;
        self.shared
            .client
            .pool()
            .meta_call(&GetAttr { inode }, || format!("inode {inode}"))
            .await
    }

    /// Raise the known size to the meta server's if that is larger (another client's
    /// committed appends); never lowers it, so a reply older than this handle's own
    /// truncation or size commit cannot undo them. Returns the known size.
    pub async fn learn_growth(&self) -> Result<u64, ClientError> {
        let epoch = self.shared.lock().size.truncate_epoch;
        let attr = self.fetch_attr().await?;
        let mut state = self.shared.lock();
        // A truncation through this handle since the request: the reply may predate it.
        let truncated = state.size.truncate_epoch != epoch || state.size.truncates_pending > 0;
        if attr.size_bytes > state.size.known_size && !truncated {
            state.readahead.clear();
            state.size.known_size = attr.size_bytes;
        }
        Ok(state.size.known_size)
    }

    /// Fetch the attributes from the meta server again (to see other clients' committed
    /// writes; close-to-open does not need it).
    pub async fn refresh(&self) -> Result<Attr, ClientError> {
        let attr = self.fetch_attr().await?;
        let mut state = self.shared.lock();
        if attr.generation < state.attr.generation {
            // Older than what the handle took from a reply that came meanwhile (its own
            // size commit or truncation): taken, it would set the size back below bytes
            // written and committed here, and reads would stop short of them.
            let mut attr = state.attr.clone();
            attr.size_bytes = state.size.known_size;
            return Ok(attr);
        }
        // A refresh sees other clients' changes: so must the next read.
        state.readahead.clear();
        state.readahead.suspended = false;
        let uncommitted =
            state.writes.started != state.size.writes_committed || state.unsent.holds_unsent();
        state.size.known_size = if uncommitted {
            attr.size_bytes.max(state.size.written_end)
        } else {
            attr.size_bytes
        };
        state.attr = attr;
        let mut attr = state.attr.clone();
        attr.size_bytes = state.size.known_size;
        Ok(attr)
    }

    /// Grow the file to at least `end` bytes without writing a byte there: a writeback
    /// mount's write-back that ends past what its host knows the file holds, but whose last
    /// bytes are the kernel's filling, not the host's own (`fuse/src/shadow.rs`; writing
    /// them would put zeros over another client's bytes). The size is committed like a
    /// write's end (a maximum at the meta server) by the first commit after every write
    /// started before this call is acknowledged (readers elsewhere never see a size
    /// covering bytes still on their way); reads here see it at once.
    pub fn extend_to(&self, end: u64) -> Result<(), ClientError> {
        let shared = &self.shared;
        shared.check_open()?;
        shared.require_write()?;
        {
            let mut state = shared.lock();
            state.size.known_size = state.size.known_size.max(end);
            state.size.written_end = state.size.written_end.max(end);
            // A change like a write: the next flush commits the size.
            state.writes.started += 1;
            let through = state.writes.started;
            let end = state
                .size
                .pending_extension
                .map_or(end, |(_, pending)| pending.max(end));
            state.size.pending_extension = Some((through, end));
        }
        shared.notify();
        Ok(())
    }

    /// Make every byte written through this handle durable on its servers and commit the
    /// size and mtime at the meta server.
    pub async fn fsync(&self) -> Result<(), ClientError> {
        self.shared.check_open()?;
        self.shared.fsync().await
    }

    /// Wait for the writes in flight and commit the size (close-time flush, no disk sync).
    pub async fn flush(&self) -> Result<(), ClientError> {
        self.shared.check_open()?;
        self.shared.flush().await
    }

    /// Whether [`FileHandle::flush`] would do nothing now: open, nothing gathered or parked, no write
    /// in flight or uncommitted, no truncation or size commit running, no failure to report
    /// (a file closed without being written).
    pub fn flush_is_empty(&self) -> bool {
        if self.shared.closed.load(Ordering::Acquire) {
            return false;
        }
        let state = self.shared.lock();
        !state.unsent.holds_unsent()
            && state.writes.outstanding.is_empty()
            && state.size.truncates_pending == 0
            && state.size.commits_running == 0
            && state.writes.first_error.is_none()
            && state.size.writes_committed >= state.writes.started
    }
}
