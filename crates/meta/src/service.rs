//! The RPC face of the metadata server: decodes each request, runs it as a read (in a read
//! transaction, on the handler's task) or as a mutation (through the group-commit writer),
//! and encodes the reply. Unknown opcodes and undecodable requests close the connection.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use freeflow_proto::meta::{
    Close, CloseSession, ClusterReport, ClusterStatus, CommitSize, Create, CreateReply, FsStats,
    GetAttr, GetXattr, Link, ListServers, ListXattr, Lookup, Mkdir, Open, OpenGrant, OpenSession,
    ReadDir, ReadLink, RegisterReply, RegisterServer, RemoveXattr, Rename, RenewSession, Rmdir,
    SessionGrant, SetAttributes, SetDirLayout, SetXattr, StatFs, Symlink, Unlink,
};
use freeflow_proto::{ErrorCode, Request, WireError};
use freeflow_rpc::{handle, Frame, PeerInfo, Reply, Service};
use freeflow_types::{Attr, FileKind, InodeId};

use crate::cutter::{self, Reach};
use crate::ops::{self, refuse, require_access, ACCESS_READ, ACCESS_WRITE};
use crate::records::{inode_key, ServerEntry};
use crate::shared::Shared;
use crate::store::{StoreRead, TableId};

/// Longest I/O server address accepted at registration.
pub const SERVER_ADDRESS_LENGTH_MAX: usize = 256;

pub struct MetaService {
    pub shared: Arc<Shared>,
}

fn with_empty_payload<T>(result: Result<T, WireError>) -> Result<(T, Bytes), WireError> {
    result.map(|reply| (reply, Bytes::new()))
}

/// A request answered by a read-only operation.
macro_rules! read_request {
    ($frame:expr, $shared:expr, $request:ty, $operation:path) => {
        handle($frame, |request: $request, _payload| {
            let result = $shared.read(|read| $operation(read, &request));
            async move { with_empty_payload(result) }
        })
        .await
    };
}

/// A request answered by a mutation through the writer.
macro_rules! write_request {
    ($frame:expr, $shared:expr, $request:ty, $operation:path) => {
        handle($frame, |request: $request, _payload| async move {
            with_empty_payload(
                $shared
                    .write(move |write, context| $operation(write, context, &request))
                    .await,
            )
        })
        .await
    };
}

impl Service for MetaService {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        let shared = &self.shared;
        match frame.opcode {
            OpenSession::OPCODE => {
                handle(frame, |request: OpenSession, _| {
                    let result = open_session(shared, &request);
                    async move { with_empty_payload(result) }
                })
                .await
            }
            RenewSession::OPCODE => {
                handle(frame, |request: RenewSession, _| {
                    let result = shared.sessions().renew(request.session_id, Instant::now());
                    async move { with_empty_payload(result) }
                })
                .await
            }
            CloseSession::OPCODE => {
                handle(frame, |request: CloseSession, _| {
                    let result = shared.sessions().close_session(request.session_id);
                    let result = result.map(|closed| wake_reaper_for(shared, &closed));
                    async move { with_empty_payload(result) }
                })
                .await
            }
            Lookup::OPCODE => read_request!(frame, shared, Lookup, ops::lookup::lookup),
            GetAttr::OPCODE => read_request!(frame, shared, GetAttr, ops::lookup::get_attr),
            ReadLink::OPCODE => read_request!(frame, shared, ReadLink, ops::lookup::read_link),
            ReadDir::OPCODE => read_request!(frame, shared, ReadDir, ops::readdir::read_dir),
            GetXattr::OPCODE => read_request!(frame, shared, GetXattr, ops::xattr::get_xattr),
            ListXattr::OPCODE => read_request!(frame, shared, ListXattr, ops::xattr::list_xattr),
            SetAttributes::OPCODE => {
                handle(frame, |request: SetAttributes, _| async move {
                    with_empty_payload(set_attributes(shared, request).await)
                })
                .await
            }
            Mkdir::OPCODE => write_request!(frame, shared, Mkdir, ops::create::mkdir),
            Unlink::OPCODE => write_request!(frame, shared, Unlink, ops::remove::unlink),
            Rmdir::OPCODE => write_request!(frame, shared, Rmdir, ops::remove::rmdir),
            Rename::OPCODE => write_request!(frame, shared, Rename, ops::rename::rename),
            Link::OPCODE => write_request!(frame, shared, Link, ops::link::link),
            Symlink::OPCODE => write_request!(frame, shared, Symlink, ops::create::symlink),
            SetXattr::OPCODE => write_request!(frame, shared, SetXattr, ops::xattr::set_xattr),
            RemoveXattr::OPCODE => {
                write_request!(frame, shared, RemoveXattr, ops::xattr::remove_xattr)
            }
            CommitSize::OPCODE => write_request!(frame, shared, CommitSize, ops::size::commit_size),
            SetDirLayout::OPCODE => {
                write_request!(frame, shared, SetDirLayout, ops::size::set_dir_layout)
            }
            Create::OPCODE => {
                handle(frame, |request: Create, _| async move {
                    with_empty_payload(create(shared, request).await)
                })
                .await
            }
            Open::OPCODE => {
                handle(frame, |request: Open, _| {
                    let result = open(shared, &request);
                    async move { with_empty_payload(result) }
                })
                .await
            }
            Close::OPCODE => {
                handle(frame, |request: Close, _| {
                    let result = shared
                        .sessions()
                        .close_handle(request.session_id, request.handle_id)
                        .map(|closed| wake_reaper_for(shared, closed.as_slice()));
                    async move { with_empty_payload(result) }
                })
                .await
            }
            StatFs::OPCODE => {
                handle(frame, |_: StatFs, _| {
                    let result = Ok(stat_fs(shared));
                    async move { with_empty_payload(result) }
                })
                .await
            }
            ListServers::OPCODE => {
                handle(frame, |_: ListServers, _| {
                    let result = Ok(shared.registry().records(Instant::now()));
                    async move { with_empty_payload(result) }
                })
                .await
            }
            ClusterStatus::OPCODE => {
                handle(frame, |_: ClusterStatus, _| {
                    let result = Ok(cluster_status(shared));
                    async move { with_empty_payload(result) }
                })
                .await
            }
            RegisterServer::OPCODE => {
                handle(frame, |request: RegisterServer, _| async move {
                    with_empty_payload(register_server(shared, request).await)
                })
                .await
            }
            other => Err(format!("unknown metadata opcode {other}")),
        }
    }
}

fn open_session(shared: &Shared, request: &OpenSession) -> Result<SessionGrant, WireError> {
    let session_id = shared
        .sessions()
        .open_session(&request.client_name, Instant::now())?;
    tracing::debug!(session_id, client = %request.client_name, "session opened");
    Ok(SessionGrant {
        session_id,
        lease_ms: shared.config.lease_ms,
    })
}

/// Wake the reaper if any of these inodes (just left without open handles) is an orphan.
fn wake_reaper_for(shared: &Shared, inodes: &[InodeId]) {
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
fn open(shared: &Shared, request: &Open) -> Result<OpenGrant, WireError> {
    let handle_id =
        shared
            .sessions()
            .open_handle(request.session_id, request.inode, request.access)?;
    let checked = shared.read(|read| {
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
    match checked {
        Ok(attr) => Ok(OpenGrant { handle_id, attr }),
        Err(error) => {
            release_handle(shared, request.session_id, handle_id);
            Err(error)
        }
    }
}

/// Set attributes; a shrink replies only once the I/O servers cut their objects (or with
/// `Unreachable` naming the server whose cut is left pending: the size is set either way).
async fn set_attributes(shared: &Arc<Shared>, request: SetAttributes) -> Result<Attr, WireError> {
    let inode = request.inode;
    // Pinned before the job is queued (see `CutPin`): an unlink in the same batch cannot
    // have the reaper remove the objects while this cuts them.
    let pin = request.changes.size_bytes.map(|_| shared.pin_cuts(inode));
    // Checked now, not in the job: a handle closed meanwhile was open when asked.
    let through_handle_writable =
        match request.through_handle {
            Some(handle) if request.changes.size_bytes.is_some() => shared
                .sessions()
                .handle_writes(handle.session_id, handle.handle_id, inode),
            _ => false,
        };
    let sessions_of = shared.clone();
    let outcome = shared
        .write(move |write, context| {
            ops::setattr::set_attributes_recording_cuts(
                write,
                context,
                &request,
                |inode| sessions_of.sessions().is_open(inode),
                through_handle_writable,
            )
        })
        .await?;
    if let (Some(record), Some(pin)) = (&outcome.truncation, &pin) {
        let _exclusive = pin.exclusive().await;
        if let Err(error) = cutter::carry_out(shared, inode, record, Reach::All).await {
            tracing::warn!(inode, %error, "truncate: cuts pending");
            shared.reaper_wake.notify_one();
            return Err(error.to_wire());
        }
        // The cuts changed the space the file holds: answer with the settled record.
        if let Ok(Some(found)) = shared.read(|read| Ok(ops::try_load_inode(read, inode)?)) {
            return Ok(found.attr);
        }
    }
    Ok(outcome.attr)
}

/// Create (and maybe open). The handle is reserved before the job is queued and bound to
/// the inode inside the transaction, as `open` registers first: a later operation of the
/// same batch that unlinks the file makes an orphan the reaper already sees open.
async fn create(shared: &Arc<Shared>, request: Create) -> Result<CreateReply, WireError> {
    let reserved = match request.open {
        Some((session_id, access)) => Some((
            session_id,
            shared.sessions().reserve_handle(session_id, access)?,
        )),
        None => None,
    };
    let binder = shared.clone();
    let created = shared
        .write(move |write, context| {
            let mut outcome = ops::create::create(write, context, &request)?;
            if let Some((_, handle_id)) = reserved {
                // Written already: a lost handle (session ended) is reported after the
                // commit, not as a refusal that would leave half a batch entry.
                if binder
                    .sessions()
                    .bind_handle(handle_id, outcome.reply.attr.inode)
                    .is_ok()
                {
                    outcome.reply.handle_id = Some(handle_id);
                }
            }
            Ok(outcome)
        })
        .await;
    match (created, reserved) {
        (Ok(outcome), None) => Ok(outcome.reply),
        (Ok(outcome), Some(_)) if outcome.reply.handle_id.is_some() => Ok(outcome.reply),
        (Ok(_), Some((session_id, _))) => Err(WireError::new(
            ErrorCode::BadHandle,
            format!("session {session_id} ended while the file was created; it is not open"),
        )),
        (Err(error), reserved) => {
            if let Some((session_id, handle_id)) = reserved {
                release_handle(shared, session_id, handle_id);
            }
            Err(error)
        }
    }
}

/// Close a handle of a failed open or create (it may already be gone with its session).
fn release_handle(shared: &Shared, session_id: u64, handle_id: u64) {
    if let Ok(Some(inode)) = shared.sessions().close_handle(session_id, handle_id) {
        wake_reaper_for(shared, &[inode]);
    }
}

fn stat_fs(shared: &Shared) -> FsStats {
    let totals = shared.registry().totals(Instant::now());
    FsStats {
        capacity_bytes: totals.capacity_bytes,
        free_bytes: totals.free_bytes,
        inode_count: shared.inode_count.load(Ordering::Relaxed),
        servers_up: totals.servers_up,
        servers_total: totals.servers_total,
    }
}

fn cluster_status(shared: &Shared) -> ClusterReport {
    ClusterReport {
        servers: shared.registry().records(Instant::now()),
        inode_count: shared.inode_count.load(Ordering::Relaxed),
        orphan_count: shared.orphan_count.load(Ordering::Relaxed),
        ready_ms: shared.ready_ms.load(Ordering::Relaxed),
        uptime_ms: shared.started.elapsed().as_millis() as u64,
        meta_metrics_address: shared.metrics_address.clone(),
    }
}

async fn register_server(
    shared: &Shared,
    request: RegisterServer,
) -> Result<RegisterReply, WireError> {
    if request.address.is_empty() || request.address.len() > SERVER_ADDRESS_LENGTH_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!("server address must be 1..={SERVER_ADDRESS_LENGTH_MAX} bytes"),
        ));
    }
    if let Some(metrics_address) = &request.metrics_address {
        if metrics_address.is_empty() || metrics_address.len() > SERVER_ADDRESS_LENGTH_MAX {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("metrics address must be 1..={SERVER_ADDRESS_LENGTH_MAX} bytes"),
            ));
        }
    }
    let entry = ServerEntry {
        address: request.address.clone(),
        capacity_bytes: request.capacity_bytes,
        free_bytes: request.free_bytes,
        object_count: request.object_count,
    };
    let (needs_persist, known) = {
        let registry = shared.registry();
        (
            registry.needs_persist(request.server_id, &request.address),
            registry.len(),
        )
    };
    if needs_persist {
        let server_id = request.server_id;
        if shared.registry().address(server_id).is_none() && known >= ops::servers::SERVERS_MAX {
            return Err(WireError::new(
                ErrorCode::NoSpace,
                format!(
                    "{} I/O servers are registered, the limit",
                    ops::servers::SERVERS_MAX
                ),
            ));
        }
        let persisted = entry.clone();
        shared
            .write(move |write, _context| ops::servers::put_server(write, server_id, &persisted))
            .await?;
        tracing::info!(server_id, address = %request.address, "I/O server registered");
    }
    let came_up = {
        let mut registry = shared.registry();
        let came_up = registry.heartbeat(request.server_id, entry, Instant::now());
        registry.set_metrics_address(request.server_id, request.metrics_address);
        came_up
    };
    if came_up {
        // Cuts and orphans waiting for this server are retried at once.
        shared.reaper_wake.notify_one();
    }
    Ok(RegisterReply {
        heartbeat_interval_ms: shared.config.heartbeat_interval_ms,
    })
}
