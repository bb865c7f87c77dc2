//! Sessions, handles, byte-range locks and revocations.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::{
    CloseHandles, GetLock, LockConflict, Open, OpenGrant, OpenSession, ReclaimSession,
    SessionGrant, SetLock, WaitRevocations, RECLAIM_HANDLES_MAX,
};
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::limits::CLOSE_HANDLES_MAX;
use freeflow_types::{FileKind, InodeId};

use super::reply::at_most;
use crate::locks::{LockOwner, LockRequest};
use crate::ops::{self, refuse, require_access, ACCESS_READ, ACCESS_WRITE};
use crate::records::inode_key;
use crate::sessions::Reclaimed;
use crate::shared::Shared;
use crate::store::{StoreRead, TableId};

/// Most a lock request waits at the server before it answers `WouldBlock` (its client asks
/// again): well under any client's call time-out.
const LOCK_WAIT_MS_MAX: u32 = 5_000;

fn lock_request(
    shared: &Shared,
    session_id: u64,
    inode: InodeId,
    owner: u64,
    pid: u32,
    kind: Option<freeflow_types::LockKind>,
    (start, end): (u64, u64),
) -> Result<LockRequest, WireError> {
    if start > end {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!("lock range {start}..={end} ends before it starts"),
        ));
    }
    if inode == 0 {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            "inode 0 cannot be locked",
        ));
    }
    if !shared.sessions().exists(session_id) {
        return Err(WireError::new(
            ErrorCode::BadHandle,
            format!("session {session_id} does not exist or its lease expired"),
        ));
    }
    Ok(LockRequest {
        inode,
        holder: LockOwner {
            session: session_id,
            owner,
        },
        pid,
        kind,
        start,
        end,
    })
}

pub(super) async fn set_lock(
    shared: &Shared,
    client: u64,
    request: SetLock,
) -> Result<(), WireError> {
    if !request.reclaim {
        // New locks wait until every lock held before a restart has been reclaimed.
        shared.recovery.wait().await;
    }
    if request.kind.is_some() && client != 0 && !shared.client_registered(client) {
        // Recorded durably, so that after a restart the recovery window waits for this
        // client to reclaim its locks.
        shared.write_as(client, true, |_, _| Ok(())).await?;
    }
    let lock = lock_request(
        shared,
        request.session_id,
        request.inode,
        request.owner,
        request.pid,
        request.kind,
        (request.start, request.end),
    )?;
    if request.wait_ms == 0 || request.kind.is_none() {
        return shared.locks.try_set(&lock);
    }
    let wait = Duration::from_millis(u64::from(request.wait_ms.min(LOCK_WAIT_MS_MAX)));
    shared.locks.set_waiting(&lock, wait).await
}

pub(super) fn get_lock(
    shared: &Shared,
    request: &GetLock,
) -> Result<Option<LockConflict>, WireError> {
    let lock = lock_request(
        shared,
        request.session_id,
        request.inode,
        request.owner,
        0,
        Some(request.kind),
        (request.start, request.end),
    )?;
    Ok(shared.locks.test(&lock))
}

pub(super) fn open_session(
    shared: &Shared,
    request: &OpenSession,
    client: u64,
) -> Result<SessionGrant, WireError> {
    let session_id =
        shared
            .sessions()
            .open_session(&request.client_name, client, Instant::now())?;
    tracing::debug!(session_id, client = %request.client_name, "session opened");
    Ok(SessionGrant {
        session_id,
        lease_ms: shared.config.lease_ms,
    })
}

/// Longest a revocation poll is held without anything to say.
const REVOCATION_POLL_MS_MAX: u32 = 60_000;

/// A client's poll for revocations. Its first makes it lease-capable; the client is then
/// recorded durably (as for its first mutation) so that after a restart the recovery window
/// waits for it to drop what it cached under the old server's leases.
pub(super) async fn wait_revocations(
    shared: &Arc<Shared>,
    client: u64,
    request: WaitRevocations,
) -> Result<Vec<freeflow_proto::meta::Revocation>, WireError> {
    if client == 0 {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            "a client without a client id cannot hold leases",
        ));
    }
    if !shared.client_registered(client) {
        // Only a client with a session is recorded (so a restart waits for its replay),
        // and one whose last session closed while it was being recorded is forgotten again.
        let no_session = move || {
            WireError::new(
                ErrorCode::BadHandle,
                format!("client {client:x} has no session: open one before polling"),
            )
        };
        if !shared.sessions().has_sessions_of(client) {
            return Err(no_session());
        }
        // On a task of its own: a poll dropped with its connection must still check.
        let recorder = shared.clone();
        let recorded = tokio::spawn(async move {
            recorder.write_as(client, true, |_, _| Ok(())).await?;
            if !recorder.sessions().has_sessions_of(client) {
                recorder.forget_client(client).await;
                return Err(no_session());
            }
            Ok(())
        });
        recorded.await.map_err(|error| {
            WireError::new(
                ErrorCode::Io,
                format!("recording client {client:x}: {error}"),
            )
        })??;
    }
    let wait =
        std::time::Duration::from_millis(u64::from(request.wait_ms.min(REVOCATION_POLL_MS_MAX)));
    Ok(shared.leases.poll(client, request.acknowledged, wait).await)
}

/// End a session of the client `caller` (the connection's client id); a client left
/// without one is forgotten (its record goes). What was answered early is made durable
/// first: a client that leaves cleanly can no longer replay, so its changes must not
/// depend on it (only a client that dies can lose its own). A session this server does not
/// know (opened with another leader, or expired) is an error, but the caller is forgotten
/// all the same if it holds no other session here: it closes after replaying into this
/// epoch, so it has nothing left to replay, and its record would otherwise make every
/// later failover wait out the recovery window for it.
pub(super) async fn close_session(
    shared: &Shared,
    session_id: u64,
    caller: u64,
) -> Result<(), WireError> {
    shared.sync().await?;
    let outcome = {
        let mut sessions = shared.sessions();
        let client = sessions.client_of(session_id);
        match sessions.close_session(session_id) {
            Ok(closed) => {
                let left = client.is_some_and(|client| sessions.has_sessions_of(client));
                Ok((closed, client, left))
            }
            Err(error) => Err((error, caller != 0 && !sessions.has_sessions_of(caller))),
        }
    };
    let (closed, client, left) = match outcome {
        Ok(closed) => closed,
        Err((error, gone)) => {
            if gone {
                // The session had ended already (it ran out): the record goes all the
                // same, durably before the answer, as below.
                shared.forget_client(caller).await;
                shared.sync().await?;
            }
            return Err(error);
        }
    };
    shared.locks.release_session(session_id);
    wake_reaper_for(shared, &closed);
    if let Some(client) = client.filter(|client| *client != 0 && !left) {
        shared.forget_client(client).await;
        // Durable before the answer: a client told its session is closed exits, and if
        // the removal of its record were lost (a crash, or a leader cut off that takes
        // back what it had not committed) every later server would wait out its whole
        // recovery window for a replay that never comes.
        shared.sync().await?;
    }
    Ok(())
}

/// Wake the reaper if any of these inodes (just left without open handles) is an orphan.
pub(super) fn wake_reaper_for(shared: &Shared, inodes: &[InodeId]) {
    if inodes.is_empty() {
        return;
    }
    let any_orphan = shared
        .read(|read| {
            for inode in inodes {
                if read.get(TableId::Orphans, &inode_key(*inode))?.is_some() {
                    return Ok(true);
                }
            }
            Ok(false)
        })
        .unwrap_or(false);
    if any_orphan {
        shared.reaper_wake.notify_one();
    }
}

fn access_mask(access: freeflow_proto::meta::OpenAccess) -> u32 {
    let mut mask = 0;
    if access.read {
        mask |= ACCESS_READ;
    }
    if access.write {
        mask |= ACCESS_WRITE;
    }
    mask
}

/// Open: the handle is registered before the inode is checked, so an unlink committed after
/// the check cannot miss it (the reaper looks at open handles before removing data).
pub(super) async fn open(
    shared: &Shared,
    request: &Open,
    client: u64,
) -> Result<OpenGrant, WireError> {
    let handle_id =
        shared
            .sessions()
            .open_handle(request.session_id, request.inode, request.access)?;
    let checked = shared.read_as(client, |read| {
        let record = ops::load_inode(read, request.inode)?;
        if record.attr.link_count == 0 {
            return Err(refuse(
                ErrorCode::NotFound,
                format!("inode {} has been unlinked", request.inode),
            ));
        }
        if record.attr.kind == FileKind::Directory && request.access.write {
            return Err(refuse(
                ErrorCode::IsDirectory,
                format!(
                    "inode {} is a directory: it cannot be opened for writing",
                    request.inode
                ),
            ));
        }
        require_access(&record.attr, &request.caller, access_mask(request.access))?;
        Ok(record.attr)
    });
    let checked = checked.await.map(|(attr, _)| attr);
    match checked {
        Ok(attr) => Ok(OpenGrant { handle_id, attr }),
        Err(error) => {
            release_handle(shared, request.session_id, handle_id);
            Err(error)
        }
    }
}

/// `CloseHandles`: close each listed handle of the session; returns the ids that were not
/// open in it.
pub(super) fn close_handles(
    shared: &Shared,
    request: &CloseHandles,
) -> Result<Vec<u64>, WireError> {
    at_most(
        "CloseHandles",
        "handles",
        request.handle_ids.len(),
        CLOSE_HANDLES_MAX,
    )?;
    let mut not_open = Vec::new();
    let mut last_closed = Vec::new();
    {
        let mut sessions = shared.sessions();
        for &handle_id in &request.handle_ids {
            match sessions.close_handle(request.session_id, handle_id) {
                Ok(Some(inode)) => last_closed.push(inode),
                Ok(None) => {}
                Err(_) => not_open.push(handle_id),
            }
        }
    }
    wake_reaper_for(shared, &last_closed);
    Ok(not_open)
}

/// `ReclaimSession`: a client's session and open handles after a restart or a change of
/// leader; returns the handles not taken again. Only inside the recovery window, while the
/// reaper waits for it to end: each handle is counted open first and its file checked after
/// (as `open` does), so an orphan the check finds is one the reaper has not started on and
/// will see open.
pub(super) fn reclaim_session(
    shared: &Shared,
    request: &ReclaimSession,
    client: u64,
) -> Result<Vec<u64>, WireError> {
    at_most(
        "ReclaimSession",
        "handles",
        request.handles.len(),
        RECLAIM_HANDLES_MAX,
    )?;
    if !shared.recovery.is_recovering() {
        return Err(WireError::new(
            ErrorCode::Stale,
            format!(
                "session {} reclaimed outside the recovery window: its handles are lost",
                request.session_id
            ),
        ));
    }
    let session_id = request.session_id;
    let mut lost = Vec::new();
    let mut taken = Vec::new();
    {
        let mut sessions = shared.sessions();
        sessions.reclaim_session(session_id, &request.client_name, client, Instant::now())?;
        for handle in &request.handles {
            match sessions.reclaim_handle(session_id, handle.handle_id, handle.inode, handle.access)
            {
                Reclaimed::Taken => taken.push(*handle),
                Reclaimed::Held => {}
                Reclaimed::Refused => lost.push(handle.handle_id),
            }
        }
    }
    // Checked after the handles are counted: a window still open here was open when they
    // were, so no reaper pass has begun.
    let recovering = shared.recovery.is_recovering();
    let kept = shared.read(|read| {
        let mut kept = Vec::with_capacity(taken.len());
        for handle in &taken {
            let present = match ops::try_load_inode(read, handle.inode)? {
                None => false,
                Some(record) if record.attr.link_count > 0 => true,
                Some(_) => read
                    .get(TableId::Orphans, &inode_key(handle.inode))?
                    .is_some(),
            };
            kept.push(recovering && present);
        }
        Ok(kept)
    });
    let kept = match kept {
        Ok(kept) => kept,
        Err(error) => {
            for handle in &taken {
                release_handle(shared, session_id, handle.handle_id);
            }
            return Err(error);
        }
    };
    for (handle, kept) in taken.iter().zip(kept) {
        if !kept {
            release_handle(shared, session_id, handle.handle_id);
            lost.push(handle.handle_id);
        }
    }
    tracing::debug!(
        session_id,
        handles = request.handles.len(),
        lost = lost.len(),
        "session reclaimed"
    );
    Ok(lost)
}

/// Close a handle of a failed open or create (it may already be gone with its session).
pub(super) fn release_handle(shared: &Shared, session_id: u64, handle_id: u64) {
    if let Ok(Some(inode)) = shared.sessions().close_handle(session_id, handle_id) {
        wake_reaper_for(shared, &[inode]);
    }
}
