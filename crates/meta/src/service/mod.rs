//! The RPC face of the metadata server: decodes each request, runs it as a read (in a read
//! transaction, on the handler's task) or as a mutation (through the group-commit writer),
//! and encodes the reply. Unknown opcodes and undecodable requests close the connection.
//!
//! Every reply carries a [`ReplyStamp`] in its payload: the server's epoch, the transaction
//! of a mutation and the last durable one (issue 10). Mutations of a client (a peer with a
//! client id) are identified by (client id, request id): each one's reply is recorded in
//! its own transaction, so a copy sent again (`FLAG_RESEND` after a lost connection,
//! `FLAG_REPLAY` after a restart) gets the first reply and is never applied twice; a
//! replayed create keeps the inode id the client was first given. During the recovery
//! window new requests wait while clients replay (`recovery.rs`).
//!
//! This module decodes and dispatches; the handlers live by concern: `mutations.rs` (a
//! client's change applied once, with its reply record), `sessions.rs` (sessions, handles,
//! locks, revocations), `servers.rs` (I/O servers, the service map, resync, status) and
//! `reply.rs` (the stamp every reply carries).

use std::sync::Arc;
use tokio::time::Instant;

use freeflow_proto::frame::FLAG_REPLAY;
use freeflow_proto::meta::{
    is_mutation, ChangeIoServer, ChangeMetaMembers, Close, CloseHandles, CloseSession,
    ClusterStatus, FillDone, GetAttr, GetLock, GetServiceMap, GetXattr, InspectInodes,
    LeasesRenewed, ListServers, ListXattr, Lookup, LookupEntry, Open, OpenSession, ReadDir,
    ReadLink, ReclaimSession, RegisterServer, RenewLeases, RenewSession, ReplayDone, ReserveInodes,
    ResyncDone, SetLock, StatFs, Sync, WaitRevocations,
};
use freeflow_proto::{ErrorCode, Request};
use freeflow_rpc::{handle, Frame, PeerInfo, Reply, Service};

use crate::ops::{self};
use crate::shared::Shared;

mod mutations;
/// Longest I/O server address accepted at registration.
mod reply;
mod servers;
mod sessions;

pub use servers::persist_states;

use mutations::{apply_mutation, client_mutation, reserve_inodes, MutationId};
use reply::{stamped, unstamped};
use servers::{cluster_status, inspect_inodes, register_server, resync_done, stat_fs};
use sessions::{
    close_handles, close_session, get_lock, open, open_session, reclaim_session, set_lock,
    wait_revocations, wake_reaper_for,
};

pub struct MetaService {
    pub shared: Arc<Shared>,
}

/// Requests served during the recovery window (the rest wait for its end): sessions, the
/// servers' registrations and status, and what replaying clients need.
fn served_while_recovering(opcode: u16) -> bool {
    matches!(
        opcode,
        OpenSession::OPCODE
            | WaitRevocations::OPCODE
            | RenewLeases::OPCODE
            | RenewSession::OPCODE
            | CloseSession::OPCODE
            | RegisterServer::OPCODE
            | GetServiceMap::OPCODE
            | ResyncDone::OPCODE
            | FillDone::OPCODE
            | ListServers::OPCODE
            | ClusterStatus::OPCODE
            | ChangeMetaMembers::OPCODE
            | StatFs::OPCODE
            | Sync::OPCODE
            | ReplayDone::OPCODE
            | ReclaimSession::OPCODE
            // Reclaims only: a new lock waits for the window's end in `set_lock`.
            | SetLock::OPCODE
    )
}

/// A request answered by a read-only operation (with commit on share).
macro_rules! read_request {
    ($frame:expr, $shared:expr, $client:expr, $request:ty, $operation:path) => {
        handle($frame, |request: $request, _payload| async move {
            let result = $shared
                .read_as($client, |read| $operation(read, &request))
                .await;
            stamped($shared, result)
        })
        .await
    };
}

impl Service for MetaService {
    async fn call(&self, frame: Frame, peer: &PeerInfo) -> Result<Reply, String> {
        let shared = &self.shared;
        let client = peer.client_id;
        if frame.flags & FLAG_REPLAY == 0 && !served_while_recovering(frame.opcode) {
            shared.recovery.wait().await;
        }
        if is_mutation(frame.opcode) {
            if client != 0 {
                // On a task of its own: if this request is dropped (its connection ended),
                // the mutation still finishes before a resend of it is looked at (a resend
                // waits for it in `begin_mutation`, then finds its reply record), instead
                // of running a second time while the first is queued at the writer.
                let shared = self.shared.clone();
                return tokio::spawn(async move { client_mutation(&shared, frame, client).await })
                    .await
                    .unwrap_or_else(|error| Err(format!("a mutation's task failed: {error}")));
            }
            // A peer without a client id: applied, not recorded, never replayed.
            let id = MutationId {
                client: 0,
                request_id: frame.request_id,
                forced_inode: None,
                forced_layout: None,
                replay: false,
            };
            return apply_mutation(shared, frame, id).await;
        }
        match frame.opcode {
            OpenSession::OPCODE => {
                handle(frame, |request: OpenSession, _| {
                    let result = open_session(shared, &request, client);
                    async move { unstamped(shared, result) }
                })
                .await
            }
            RenewSession::OPCODE => {
                handle(frame, |request: RenewSession, _| {
                    let result = shared.sessions().renew(request.session_id, Instant::now());
                    async move { unstamped(shared, result) }
                })
                .await
            }
            CloseSession::OPCODE => {
                handle(frame, |request: CloseSession, _| async move {
                    let result = close_session(shared, request.session_id, client).await;
                    unstamped(shared, result)
                })
                .await
            }
            Lookup::OPCODE => read_request!(frame, shared, client, Lookup, ops::lookup::lookup),
            GetAttr::OPCODE => read_request!(frame, shared, client, GetAttr, ops::lookup::get_attr),
            ReadLink::OPCODE => {
                read_request!(frame, shared, client, ReadLink, ops::lookup::read_link)
            }
            ReadDir::OPCODE => {
                read_request!(frame, shared, client, ReadDir, ops::readdir::read_dir)
            }
            GetXattr::OPCODE => {
                read_request!(frame, shared, client, GetXattr, ops::xattr::get_xattr)
            }
            ListXattr::OPCODE => {
                read_request!(frame, shared, client, ListXattr, ops::xattr::list_xattr)
            }
            Open::OPCODE => {
                handle(frame, |request: Open, _| async move {
                    unstamped(shared, open(shared, &request, client).await)
                })
                .await
            }
            Close::OPCODE => {
                handle(frame, |request: Close, _| {
                    let result = shared
                        .sessions()
                        .close_handle(request.session_id, request.handle_id)
                        .map(|closed| wake_reaper_for(shared, closed.as_slice()));
                    async move { unstamped(shared, result) }
                })
                .await
            }
            CloseHandles::OPCODE => {
                handle(frame, |request: CloseHandles, _| {
                    let result = close_handles(shared, &request);
                    async move { unstamped(shared, result) }
                })
                .await
            }
            StatFs::OPCODE => {
                handle(frame, |_: StatFs, _| {
                    let result = Ok(stat_fs(shared));
                    async move { unstamped(shared, result) }
                })
                .await
            }
            ListServers::OPCODE => {
                handle(frame, |_: ListServers, _| {
                    let result = Ok(shared.registry().records(Instant::now()));
                    async move { unstamped(shared, result) }
                })
                .await
            }
            InspectInodes::OPCODE => {
                handle(frame, |request: InspectInodes, _| {
                    let result = inspect_inodes(shared, &request);
                    async move { unstamped(shared, result) }
                })
                .await
            }
            ChangeMetaMembers::OPCODE => {
                handle(frame, |request: ChangeMetaMembers, _| async move {
                    let result = shared.change_meta_members(&request.change).await;
                    unstamped(shared, result)
                })
                .await
            }
            ClusterStatus::OPCODE => {
                handle(frame, |_: ClusterStatus, _| {
                    let result = Ok(cluster_status(shared));
                    async move { unstamped(shared, result) }
                })
                .await
            }
            RegisterServer::OPCODE => {
                handle(frame, |request: RegisterServer, _| async move {
                    unstamped(shared, register_server(shared, request).await)
                })
                .await
            }
            GetServiceMap::OPCODE => {
                handle(frame, |_: GetServiceMap, _| {
                    let map = shared.registry().service_map();
                    async move { unstamped(shared, Ok(map)) }
                })
                .await
            }
            ResyncDone::OPCODE => {
                handle(frame, |request: ResyncDone, _| async move {
                    unstamped(shared, resync_done(shared, request).await)
                })
                .await
            }
            ChangeIoServer::OPCODE => {
                handle(frame, |request: ChangeIoServer, _| async move {
                    let result = crate::rereplication::change_io_server(
                        shared,
                        request.server_id,
                        request.change,
                    )
                    .await;
                    unstamped(shared, result)
                })
                .await
            }
            FillDone::OPCODE => {
                handle(frame, |request: FillDone, _| async move {
                    let result = crate::rereplication::fill_done(
                        shared,
                        request.server_id,
                        &request.replacements,
                    )
                    .await;
                    unstamped(shared, result)
                })
                .await
            }
            ReclaimSession::OPCODE => {
                handle(frame, |request: ReclaimSession, _| {
                    let result = reclaim_session(shared, &request, client);
                    async move { unstamped(shared, result) }
                })
                .await
            }
            ReserveInodes::OPCODE => {
                handle(frame, |request: ReserveInodes, _| async move {
                    unstamped(shared, reserve_inodes(shared, client, request).await)
                })
                .await
            }
            Sync::OPCODE => {
                handle(frame, |_: Sync, _| async move {
                    unstamped(shared, shared.sync().await.map(|_| ()))
                })
                .await
            }
            ReplayDone::OPCODE => {
                handle(frame, |_: ReplayDone, _| async move {
                    shared.recovery.client_done(client);
                    unstamped(shared, Ok(()))
                })
                .await
            }
            WaitRevocations::OPCODE => {
                handle(frame, |request: WaitRevocations, _| async move {
                    unstamped(shared, wait_revocations(shared, client, request).await)
                })
                .await
            }
            RenewLeases::OPCODE => {
                handle(frame, |_: RenewLeases, _| {
                    let (renewed, revocations_through) = shared.leases.renew(client);
                    let reply = LeasesRenewed {
                        epoch: shared.boot_epoch,
                        renewed,
                        lease_ms: shared.leases.lease_ms(),
                        revocations_through,
                    };
                    async move { unstamped(shared, Ok(reply)) }
                })
                .await
            }
            LookupEntry::OPCODE => {
                handle(frame, |request: LookupEntry, _| async move {
                    let lookup = Lookup {
                        caller: request.caller,
                        parent: request.parent,
                        name: request.name,
                    };
                    let result = shared
                        .read_as(client, |read| match ops::lookup::lookup(read, &lookup) {
                            Ok(attr) => Ok(Some(attr)),
                            Err(ops::OpError::Refused(error))
                                if error.code == ErrorCode::NotFound =>
                            {
                                Ok(None)
                            }
                            Err(error) => Err(error),
                        })
                        .await;
                    stamped(shared, result)
                })
                .await
            }
            SetLock::OPCODE => {
                handle(frame, |request: SetLock, _| async move {
                    unstamped(shared, set_lock(shared, client, request).await)
                })
                .await
            }
            GetLock::OPCODE => {
                handle(frame, |request: GetLock, _| {
                    let result = get_lock(shared, &request);
                    async move { unstamped(shared, result) }
                })
                .await
            }
            other => Err(format!("unknown metadata opcode {other}")),
        }
    }
}
