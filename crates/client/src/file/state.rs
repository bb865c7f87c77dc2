//! An open file's shared state: [`FileHandle`], the [`HandleShared`] every task of the
//! handle holds, the [`HandleState`] under its lock, the checks and waits all paths use,
//! and [`HandleHost`], what a handle needs of the client that opened it (defined here and
//! implemented by the client, so the data path never names the client above it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use freeflow_proto::meta::{HandleRef, OpenAccess};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::FILE_SIZE_MAX;
use freeflow_types::{Attr, FileKind, InodeId, Layout, SetAttr};
use futures::future::BoxFuture;
use tokio::sync::{watch, Semaphore};

use super::flights::WriteFlights;
use super::pieces::Unsent;
use super::sizes::SizeState;
use crate::closer::Closer;
use crate::config::ClientConfig;
use crate::error::ClientError;
use crate::local::{LocalObject, LocalReads};
use crate::pool::Pool;
use crate::readahead::ReadAhead;
use crate::space::SpaceGrants;

/// What an open file needs of the client that opened it. The client implements it; a
/// handle holds it as a trait object, so nothing here names the client.
pub(crate) trait HandleHost: Send + Sync + 'static {
    fn pool(&self) -> &Arc<Pool>;
    fn config(&self) -> &ClientConfig;
    /// Write bytes in flight over the whole client (`dirty_bytes_max` permits).
    fn dirty(&self) -> &Arc<Semaphore>;
    /// Bytes fetched ahead over the whole client (see `readahead.rs`).
    fn readahead_room(&self) -> &Arc<Semaphore>;
    /// Space the client holds on the I/O servers (see `space.rs`).
    fn space(&self) -> &SpaceGrants;
    /// Descriptors of objects of I/O servers on this host (see `local.rs`).
    fn local(&self) -> &LocalReads;
    /// Closes nobody waits for (see `closer.rs`).
    fn closer(&self) -> &Arc<Closer>;
    /// The client's current session.
    fn session_id(&self) -> u64;
    /// The meta server epoch the current session was granted under.
    fn session_epoch(&self) -> u64;
    /// Shared memory for write payloads to I/O servers on this host, once one took it.
    fn shared_payload_area(&self) -> Option<&Arc<freeflow_rpc::shared::PayloadArea>>;
    /// Count a handle open (a truncation finds it, a reclaim names it).
    fn register_handle(&self, handle: &Arc<HandleShared>);
    /// The handle closed.
    fn unregister_handle(&self, inode: InodeId, handle: &Arc<HandleShared>);
    /// The client's `setattr` through an open of the file (`Client::setattr_through`).
    fn setattr_through(
        &self,
        inode: InodeId,
        changes: SetAttr,
        through: Option<HandleRef>,
    ) -> BoxFuture<'_, Result<Attr, ClientError>>;
}

/// An open file. Methods take `&self`, so the mount can share one through an `Arc`; the
/// writes of one handle are ordered as described in the module doc.
pub struct FileHandle {
    pub(super) shared: Arc<HandleShared>,
}

pub(crate) struct HandleShared {
    pub(super) client: Arc<dyn HandleHost>,
    pub(super) inode: InodeId,
    pub(super) handle_id: u64,
    pub(super) session_id: u64,
    /// The meta server epoch the handle was opened under: a restart since ended it.
    pub(super) opened_epoch: u64,
    /// The epoch its session was granted under (0: not known), which the open's reply
    /// may have come after (a create answered from its record by a newer leader).
    pub(super) session_epoch: u64,
    pub(super) access: OpenAccess,
    /// The layout of a regular file; None for other kinds (which cannot be read or written).
    pub(super) layout: Option<Layout>,
    pub(super) state: Mutex<HandleState>,
    /// Bumped after each write completes; tasks waiting on in-flight writes re-check then.
    pub(super) completions: watch::Sender<u64>,
    /// The turn to send: held from deciding what a write does (gather, or send what is
    /// gathered and then itself) until its requests are in flight, so that writes go out
    /// in call order, and by everything that must see every earlier write in flight (reads,
    /// flushes, truncations, recalls, close). See [`super::write::SendTurn`].
    pub(super) send_order: Arc<tokio::sync::Mutex<()>>,
    pub(super) closed: AtomicBool,
    /// The meta server did not take this handle back after a restart or a change of
    /// leader (its file was gone): I/O through it fails with `Stale`, and it is never
    /// offered again (a later server might still hold an orphan record of data removed).
    pub(super) lost: AtomicBool,
    /// Another client changed the file's attributes since this handle last read them (a
    /// revocation named it): a read past the known end asks the meta server for the size
    /// once before it answers short (a reader that holds the file open sees others'
    /// appends, as `tail -f` expects).
    pub(super) changed_elsewhere: AtomicBool,
    /// What the I/O servers on this host said about this handle's stripes (`local.rs`),
    /// by stripe index: descriptors kept until the handle closes, objects found missing,
    /// servers found elsewhere.
    pub(super) local: Mutex<HashMap<u32, LocalStripe>>,
    /// Held while asking for a stripe's descriptor.
    pub(super) local_opening: tokio::sync::Mutex<()>,
}

/// A stripe's object as a local-reads socket described it.
#[derive(Clone)]
pub(super) enum LocalStripe {
    Open(Arc<LocalObject>),
    /// It did not exist: reads go through the RPC path until one returns bytes.
    Missing,
    /// Its server is not on this host (not a Unix socket): every read is served, with
    /// nothing asked or locked on the way.
    Remote,
}

pub(super) struct HandleState {
    pub(super) attr: Attr,
    /// What the handle knows of the file's size, and its commits (see `sizes.rs`).
    pub(super) size: SizeState,
    /// Its writes: started, in flight, failed (see `flights.rs`).
    pub(super) writes: WriteFlights,
    /// Written bytes acknowledged and not sent yet: gathered small writes, parked pieces
    /// of stripe units, and batches of them on their way (see `pieces.rs`).
    pub(super) unsent: Unsent,
    /// What a sequential reader has fetched ahead (see `readahead.rs`).
    pub(super) readahead: ReadAhead,
}

impl HandleState {
    pub(super) fn new(attr: Attr) -> HandleState {
        HandleState {
            size: SizeState::new(attr.size_bytes),
            attr,
            writes: WriteFlights::default(),
            unsent: Unsent::default(),
            readahead: ReadAhead::default(),
        }
    }

    /// Whether a change of the file's data through this handle is under way (gathered or
    /// in flight, a truncation, fallocate or a copy): what is read past the reader's range
    /// now may predate it, so it is not fetched ahead or kept.
    pub(super) fn changing_data(&self) -> bool {
        self.unsent.holds_unsent()
            || !self.writes.outstanding.is_empty()
            || self.size.truncates_pending > 0
            || self.readahead.changing > 0
    }

    /// What this handle knows of the file's allocated bytes: the meta server's figure, or
    /// its own reports where they are newer (a lower bound until the next commit).
    pub(super) fn allocated_bytes(&self) -> u64 {
        let reported: u64 = self
            .size
            .stripe_space
            .values()
            .map(|s| s.allocated_bytes)
            .sum();
        self.attr.allocated_bytes.max(reported)
    }

    pub(super) fn absorb_attr(&mut self, attr: Attr) {
        self.size.known_size = self.size.known_size.max(attr.size_bytes);
        self.attr = attr;
    }
}

impl HandleShared {
    pub(super) fn lock(&self) -> MutexGuard<'_, HandleState> {
        self.state.lock().expect("handle state lock not poisoned")
    }

    pub(super) fn check_open(&self) -> Result<(), ClientError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::BadHandle,
                "the handle is closed",
            ));
        }
        if self.lost.load(Ordering::Acquire) {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::Stale,
                "the metadata server did not take this handle back after it restarted (its file is gone)",
            ));
        }
        Ok(())
    }

    /// The meta server refused this handle at a reclaim (see `lost`).
    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
    }

    pub(super) fn require_write(&self) -> Result<(), ClientError> {
        if !self.access.write {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::BadHandle,
                "the handle is not open for writing",
            ));
        }
        Ok(())
    }

    /// `offset + length`, if it stays within the largest file size.
    pub(super) fn checked_end(&self, offset: u64, length: u64) -> Result<u64, ClientError> {
        offset
            .checked_add(length)
            .filter(|end| *end <= FILE_SIZE_MAX)
            .ok_or_else(|| {
                ClientError::inode(
                    self.inode,
                    ErrorCode::FileTooBig,
                    format!(
                        "{length} bytes at {offset} end beyond the largest file size {FILE_SIZE_MAX}"
                    ),
                )
            })
    }

    pub(super) fn check_no_failed_write(&self) -> Result<(), ClientError> {
        match self.lock().writes.earlier_write_error(self.inode) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Wake every task waiting on this handle's state.
    pub(super) fn notify(&self) {
        self.completions
            .send_modify(|count| *count = count.wrapping_add(1));
    }

    pub(super) fn data_layout(&self) -> Result<&Layout, ClientError> {
        let kind = self.lock().attr.kind;
        match (&self.layout, kind) {
            (Some(layout), FileKind::Regular) => Ok(layout),
            (_, FileKind::Directory) => Err(ClientError::inode(
                self.inode,
                ErrorCode::IsDirectory,
                "a directory has no data to read or write",
            )),
            (None, FileKind::Regular) => Err(ClientError::inode(
                self.inode,
                ErrorCode::Io,
                "the meta server gave this regular file no layout",
            )),
            (_, kind) => Err(ClientError::inode(
                self.inode,
                ErrorCode::InvalidArgument,
                format!("a {kind:?} has no data on the I/O servers"),
            )),
        }
    }

    /// A revocation of the file's attributes arrived: see `changed_elsewhere`.
    pub(crate) fn note_changed_elsewhere(&self) {
        self.changed_elsewhere.store(true, Ordering::Release);
    }

    /// Wait until `ready` gives a value, re-checking after each change of the state (write
    /// finished, commit answered, truncation over). `ready` runs under the state lock, so
    /// what it takes is consistent with what it checked.
    pub(super) async fn wait_then<T>(
        &self,
        mut ready: impl FnMut(&mut HandleState) -> Option<T>,
    ) -> T {
        loop {
            let mut receiver = {
                let mut state = self.lock();
                if let Some(value) = ready(&mut state) {
                    return value;
                }
                // Subscribed under the lock: a change after the check is seen.
                self.completions.subscribe()
            };
            // Fails only if the sender is gone, and `self` owns it.
            let _ = receiver.changed().await;
        }
    }

    pub(super) async fn wait_until(&self, done: impl Fn(&HandleState) -> bool) {
        self.wait_then(|state| done(state).then_some(())).await;
    }

    pub(crate) fn inode(&self) -> InodeId {
        self.inode
    }

    /// The handle as a reclaim after a restart of the meta server names it, with the
    /// session it was opened in; None once closed.
    pub(crate) fn reclaimed(&self) -> Option<(u64, freeflow_proto::meta::ReclaimedHandle)> {
        if self.closed.load(Ordering::Acquire) || self.lost.load(Ordering::Acquire) {
            return None;
        }
        Some((
            self.session_id,
            freeflow_proto::meta::ReclaimedHandle {
                handle_id: self.handle_id,
                inode: self.inode,
                access: self.access,
            },
        ))
    }

    /// Whether the handle was opened for writing.
    pub(crate) fn opened_for_writing(&self) -> bool {
        self.access.write
    }

    pub(crate) fn local_size(&self) -> u64 {
        self.lock().size.known_size
    }
}
