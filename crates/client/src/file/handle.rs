//! Opening and closing a handle, and what it tells of itself (ids, access, attributes):
//! the rest of [`FileHandle`]'s methods are in the rooms of their concern.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use freeflow_proto::meta::{Close, HandleRef, OpenAccess};
use freeflow_proto::ErrorCode;
use freeflow_types::{Attr, InodeId, SetAttr};
use tokio::sync::watch;

use super::state::{FileHandle, HandleHost, HandleShared, HandleState};
use crate::error::ClientError;

impl HandleShared {
    /// Flush and close at the meta server; the handle is unusable afterwards. With
    /// `deferred`, the close at the meta server is queued (see `closer.rs`) and not waited
    /// for: the flush is.
    pub(super) async fn close(self: &Arc<Self>, deferred: bool) -> Result<(), ClientError> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::BadHandle,
                "the handle is already closed",
            ));
        }
        // No write starts after `closed` is set: a `write_at` that took the turn to send
        // before this call does is gathered, parked or in flight when `send_gathered` has its turn,
        // and one that takes it after fails. So waiting for all of them ends.
        let sent = self.send_gathered().await;
        let flushed = self.flush_through(u64::MAX, false).await.and(sent);
        // Local-read descriptors go now, not with the last reference to the handle.
        self.local.lock().expect("not poisoned").clear();
        let (session_id, handle_id) = (self.session_id, self.handle_id);
        if deferred {
            self.client.unregister_handle(self.inode, self);
            // A handle of a replaced session is gone with it already.
            if session_id == self.client.session_id() {
                self.client
                    .closer()
                    .close_later(session_id, handle_id)
                    .await;
            }
            return flushed;
        }
        let (closed, resent) = self
            .client
            .pool()
            .meta_call_noting_resend(
                &Close {
                    session_id,
                    handle_id,
                },
                || format!("handle {handle_id} of inode {}", self.inode),
            )
            .await;
        self.client.unregister_handle(self.inode, self);
        flushed?;
        match closed {
            // The meta server forgot the session this handle was opened in (restart, new
            // metadata leader, lease lost) and the client has opened another, or it
            // restarted since the open (the client may not have noticed yet that its session
            // is gone): the handle is gone with it, which is what close wanted; the data was
            // flushed above. A handle of the current session the server lost otherwise is
            // still an error (its file was not counted open meanwhile).
            Err(error)
                if error.code() == ErrorCode::BadHandle
                    && (session_id != self.client.session_id()
                        || self.opened_epoch != self.client.pool().lease_epoch()
                        || self.session_epoch != self.client.pool().lease_epoch()) =>
            {
                tracing::debug!(
                    inode = self.inode,
                    handle_id,
                    session_id,
                    %error,
                    "closing a handle of a replaced session: already gone"
                );
                Ok(())
            }
            // Sent again after its connection broke: the first attempt closed it (the
            // server keeps no reply record of a close, found by the simulation).
            Err(error) if error.code() == ErrorCode::BadHandle && resent => {
                tracing::debug!(
                    inode = self.inode,
                    handle_id,
                    %error,
                    "a close sent again found the handle closed by the first attempt"
                );
                Ok(())
            }
            closed => closed,
        }
    }
}

impl FileHandle {
    pub(crate) fn new(
        client: Arc<dyn HandleHost>,
        attr: Attr,
        handle_id: u64,
        session_id: u64,
        access: OpenAccess,
    ) -> FileHandle {
        let (completions, _) = watch::channel(0);
        let layout = attr.layout.clone();
        let opened_epoch = client.pool().lease_epoch();
        let session_epoch = if session_id == client.session_id() {
            client.session_epoch()
        } else {
            0
        };
        let shared = Arc::new(HandleShared {
            inode: attr.inode,
            handle_id,
            session_id,
            opened_epoch,
            session_epoch,
            access,
            layout,
            state: Mutex::new(HandleState::new(attr)),
            send_order: Arc::new(tokio::sync::Mutex::new(())),
            completions,
            closed: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            changed_elsewhere: AtomicBool::new(false),
            local: Mutex::new(HashMap::new()),
            local_opening: tokio::sync::Mutex::new(()),
            client: client.clone(),
        });
        client.register_handle(&shared);
        FileHandle { shared }
    }

    pub fn inode(&self) -> InodeId {
        self.shared.inode
    }

    /// The handle id the meta server gave this open.
    pub fn handle_id(&self) -> u64 {
        self.shared.handle_id
    }

    pub fn access(&self) -> OpenAccess {
        self.shared.access
    }

    /// The attributes as last seen, with the size and allocated bytes this handle knows
    /// (including its own writes not yet committed).
    pub fn attr(&self) -> Attr {
        let state = self.shared.lock();
        let mut attr = state.attr.clone();
        attr.size_bytes = state.size.known_size;
        attr.allocated_bytes = state.allocated_bytes();
        attr
    }

    /// The allocated bytes this handle knows of (see [`FileHandle::attr`]).
    pub fn allocated_bytes(&self) -> u64 {
        self.shared.lock().allocated_bytes()
    }

    /// This open as the meta server knows it, for requests that act through it.
    pub fn handle_ref(&self) -> HandleRef {
        HandleRef {
            session_id: self.shared.session_id,
            handle_id: self.shared.handle_id,
        }
    }

    /// Change attributes through this open (`ftruncate`, `futimens`): a size change is
    /// authorised by the handle's write access, not by the file's mode bits, and is
    /// ordered after every write made through this client before the call (see
    /// [`crate::Client::setattr`]).
    pub async fn set_attributes(&self, changes: SetAttr) -> Result<Attr, ClientError> {
        self.shared.check_open()?;
        let through =
            (changes.size_bytes.is_some() && self.shared.access.write).then(|| self.handle_ref());
        self.shared
            .client
            .setattr_through(self.shared.inode, changes, through)
            .await
    }

    /// Set the size through this open (`ftruncate`).
    pub async fn set_size(&self, size_bytes: u64) -> Result<Attr, ClientError> {
        self.set_attributes(SetAttr {
            size_bytes: Some(size_bytes),
            ..SetAttr::default()
        })
        .await
    }

    /// Flush and close.
    pub async fn close(self) -> Result<(), ClientError> {
        self.shared.close(false).await
    }

    /// Flush and close a handle shared through an `Arc`; any later call on it fails with
    /// `BadHandle`.
    pub async fn close_shared(&self) -> Result<(), ClientError> {
        self.shared.close(false).await
    }

    /// As [`FileHandle::close_shared`], but the close at the meta server is gathered with
    /// others and not waited for (the flush is, and its errors are returned): for closes
    /// nobody waits for, like the mount's `release`. Until it arrives, the meta server
    /// counts the file open.
    pub async fn close_deferred(&self) -> Result<(), ClientError> {
        self.shared.close(true).await
    }
}

impl Drop for FileHandle {
    /// A handle dropped without close is closed in the background (best effort), so the
    /// meta server does not keep it open until the session ends.
    fn drop(&mut self) {
        if self.shared.closed.load(Ordering::Acquire) {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let shared = self.shared.clone();
            runtime.spawn(async move {
                if let Err(error) = shared.close(false).await {
                    tracing::warn!(inode = shared.inode, %error, "closing a dropped handle failed");
                }
            });
        }
    }
}

impl std::fmt::Debug for FileHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileHandle")
            .field("inode", &self.shared.inode)
            .field("handle_id", &self.shared.handle_id)
            .field("access", &self.shared.access)
            .finish_non_exhaustive()
    }
}
