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

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use freeflow_proto::frame::{FLAG_REPLAY, FLAG_RESEND};
use freeflow_proto::meta::{
    is_mutation, ChangeMetaMembers, Close, CloseHandles, CloseSession, ClusterReport,
    ClusterStatus, CommitSize, Create, CreateReply, FsStats, GetAttr, GetLock, GetServiceMap,
    GetXattr, InodeFacts, InodeRange, InspectInodes, LeasesRenewed, Link, ListServers, ListXattr,
    LockConflict, Lookup, LookupEntry, MemberState, Mkdir, Open, OpenGrant, OpenSession, ReadDir,
    ReadLink, ReclaimSession, RegisterReply, RegisterServer, RemoveXattr, Rename, RenewLeases,
    RenewSession, ReplayDone, ReplayOf, ReplyStamp, ReserveInodes, ResyncDone, Rmdir, SessionGrant,
    SetAttributes, SetDirLayout, SetLock, SetXattr, StatFs, Symlink, Sync, Unlink, WaitRevocations,
    INSPECT_INODES_MAX, RECLAIM_HANDLES_MAX,
};
use freeflow_proto::{decode, encode, ErrorCode, Request, WireError};
use freeflow_rpc::{handle, Frame, PeerInfo, Reply, Service};
use freeflow_types::limits::{CLOSE_HANDLES_MAX, INODE_RESERVE_MAX};
use freeflow_types::{Attr, FileKind, InodeId};
use serde::Serialize;

use crate::cutter::{self, Reach};
use crate::locks::{LockOwner, LockRequest};
use crate::ops::{self, refuse, require_access, OpContext, OpResult, ACCESS_READ, ACCESS_WRITE};
use crate::records::{
    decode_versioned, encode_versioned, inode_key, reply_expiry_key, reply_key, ReplyRecord,
    ServerEntry,
};
use crate::sessions::Reclaimed;
use crate::shared::{Answered, Shared};
use crate::store::{RedbWrite, StoreRead, StoreWrite, TableId};

/// Longest I/O server address accepted at registration.
pub const SERVER_ADDRESS_LENGTH_MAX: usize = 256;

pub struct MetaService {
    pub shared: Arc<Shared>,
}

/// The stamp of a reply: the transaction of a mutation (0 for anything else) and the
/// lease granted on what it read or changed.
fn stamp(shared: &Shared, answered: Answered) -> Bytes {
    Bytes::from(encode(&ReplyStamp {
        epoch: shared.boot_epoch,
        txn: answered.txn,
        durable_txn: shared.durable_txn(),
        lease_ms: answered.grant.lease_ms,
        lease_seq: answered.grant.seq,
        changed: answered.changed,
        changed_complete: answered.changed_complete,
        delegated: answered.delegated,
    }))
}

fn stamped<T>(
    shared: &Shared,
    result: Result<(T, Answered), WireError>,
) -> Result<(T, Bytes), WireError> {
    result.map(|(reply, answered)| (reply, stamp(shared, answered)))
}

fn unstamped<T>(shared: &Shared, result: Result<T, WireError>) -> Result<(T, Bytes), WireError> {
    result.map(|reply| (reply, stamp(shared, Answered::default())))
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

/// Record the reply to mutation (`client`, `request_id`) in the transaction that applies it.
fn record_reply<T: Serialize>(
    write: &mut RedbWrite,
    client: u64,
    request_id: u64,
    txn: u64,
    value: &T,
) -> OpResult<()> {
    if client == 0 {
        return Ok(());
    }
    let record = ReplyRecord {
        txn,
        reply: encode(&Ok::<&T, WireError>(value)),
    };
    write.put(
        TableId::Replies,
        &reply_key(client, request_id),
        &encode_versioned(&record),
    )?;
    write.put(
        TableId::ReplyExpiry,
        &reply_expiry_key(txn, client, request_id),
        &[],
    )?;
    Ok(())
}

/// What identifies one mutation and how it is to be applied.
#[derive(Clone)]
struct MutationId {
    client: u64,
    request_id: u64,
    /// The inode id a replayed create must keep.
    forced_inode: Option<InodeId>,
    /// The layout a replayed create of a regular file must keep.
    forced_layout: Option<freeflow_types::Layout>,
    /// A replay after a restart (a create then opens nothing: its session is gone).
    replay: bool,
}

/// A mutation through the writer, its reply recorded in its transaction.
async fn mutation<R, F>(
    shared: &Arc<Shared>,
    frame: Frame,
    id: MutationId,
    durable: impl FnOnce(&R) -> bool,
    operation: F,
) -> Result<Reply, String>
where
    R: Request + NamesInodes,
    R::Reply: Serialize,
    F: FnOnce(&mut RedbWrite, &mut OpContext<'_>, &R) -> OpResult<R::Reply> + Send + 'static,
{
    handle(frame, |request: R, _payload| async move {
        recall_delegations(shared, id.client, request.named(shared)).await;
        let durable = durable(&request);
        let result = shared
            .mutate(id.client, durable, move |write, context| {
                context.forced_inode = id.forced_inode;
                let value = operation(write, context, &request)?;
                record_reply(write, id.client, id.request_id, context.txn, &value)?;
                Ok(value)
            })
            .await;
        stamped(shared, result)
    })
    .await
}

/// The inodes a mutation request acts on, by number or by name: a directory among them
/// delegated to another client is recalled before the mutation is applied (that client may
/// have answered creates there that this server does not have yet).
trait NamesInodes {
    fn named(&self, shared: &Shared) -> Vec<InodeId>;
}

/// The inodes `names` (directory, name) stand for now, as far as they exist: a directory
/// removed or replaced by name is delegated under its own number.
fn named_children(shared: &Shared, names: &[(InodeId, &str)]) -> Vec<InodeId> {
    if !shared.leases.has_delegations() {
        return Vec::new();
    }
    shared
        .read(|read| {
            let mut found = Vec::new();
            for (parent, name) in names {
                if let Some((inode, FileKind::Directory)) = ops::lookup_entry(read, *parent, name)?
                {
                    found.push(inode);
                }
            }
            Ok(found)
        })
        .unwrap_or_default()
}

macro_rules! names_parent {
    ($($request:ty),*) => {$(
        impl NamesInodes for $request {
            fn named(&self, _shared: &Shared) -> Vec<InodeId> {
                vec![self.parent]
            }
        }
    )*};
}
names_parent!(Mkdir, Unlink, Symlink, Create);

macro_rules! names_inode {
    ($($request:ty),*) => {$(
        impl NamesInodes for $request {
            fn named(&self, _shared: &Shared) -> Vec<InodeId> {
                vec![self.inode]
            }
        }
    )*};
}
names_inode!(
    SetXattr,
    RemoveXattr,
    CommitSize,
    SetDirLayout,
    SetAttributes
);

impl NamesInodes for Rmdir {
    fn named(&self, shared: &Shared) -> Vec<InodeId> {
        let mut named = named_children(shared, &[(self.parent, &self.name)]);
        named.push(self.parent);
        named
    }
}

impl NamesInodes for Rename {
    fn named(&self, shared: &Shared) -> Vec<InodeId> {
        let mut named = named_children(
            shared,
            &[
                (self.source_parent, &self.source_name),
                (self.target_parent, &self.target_name),
            ],
        );
        named.extend([self.source_parent, self.target_parent]);
        named
    }
}

impl NamesInodes for Link {
    fn named(&self, _shared: &Shared) -> Vec<InodeId> {
        vec![self.target_parent, self.inode]
    }
}

/// Recall the delegations other clients than `client` hold on `inodes`, and wait until
/// their holders have answered what they made there (or one lease).
async fn recall_delegations(shared: &Shared, client: u64, inodes: Vec<InodeId>) {
    let bound = Duration::from_millis(u64::from(shared.config.lease_ms));
    let pending = shared.leases.recall_delegations(client, &inodes, bound);
    if !pending.is_empty() {
        let (started, sent) = (Instant::now(), pending.len());
        let expired = shared.leases.wait(pending).await;
        shared.metrics.revoked(sent, expired, started);
    }
}

/// The durability wish of most mutations: none (durable within the commit interval).
fn not_durable<R>(_: &R) -> bool {
    false
}

/// Marks a mutation as being applied; a copy of it waits until the first is done.
struct InProgress<'a> {
    shared: &'a Shared,
    key: (u64, u64),
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.shared
            .mutations_in_progress
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&self.key);
        self.shared.mutation_finished.notify_waiters();
    }
}

async fn begin_mutation(shared: &Shared, key: (u64, u64)) -> InProgress<'_> {
    loop {
        let finished = shared.mutation_finished.notified();
        {
            let mut in_progress = shared
                .mutations_in_progress
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if in_progress.insert(key) {
                return InProgress { shared, key };
            }
        }
        finished.await;
    }
}

/// The reply recorded for mutation (`client`, `request_id`), if it was applied.
fn recorded_reply(
    shared: &Shared,
    client: u64,
    request_id: u64,
) -> Result<Option<ReplyRecord>, WireError> {
    shared.read(|read| {
        read.get(TableId::Replies, &reply_key(client, request_id))?
            .map(|bytes| decode_versioned(TableId::Replies, &bytes))
            .transpose()
            .map_err(Into::into)
    })
}

/// The recorded reply of a create that also opened the file, as a resend or replay gets
/// it: the handle it names was opened by the server (or the leadership) that applied the
/// create, and this one may not hold it (a restart, a new metadata leader). When the
/// client's session is here and the handle is not, the file is opened again in it and the
/// reply names the new handle, so the client's handle is known here and its close works;
/// otherwise the record is answered as it is (the client finds its session gone).
fn opened_again(shared: &Shared, frame: &Frame, client: u64, reply: Vec<u8>) -> Vec<u8> {
    // A replay's reply is not used by its client (which reclaims the handles it still
    // holds): opening again would count the file open for nobody.
    if frame.flags & FLAG_REPLAY != 0 {
        return reply;
    }
    let Ok(request) = decode::<Create>(&frame.header) else {
        return reply;
    };
    let Some((session_id, access)) = request.open else {
        return reply;
    };
    let Ok(Ok(mut created)) = decode::<Result<CreateReply, WireError>>(&reply) else {
        return reply;
    };
    let Some(handle_id) = created.handle_id else {
        return reply;
    };
    let mut sessions = shared.sessions();
    if sessions.holds(session_id, handle_id) || !sessions.exists(session_id) {
        return reply;
    }
    // Opened again once per recorded handle (a second resend gets the same handle); a
    // failure is the answer (the old handle is not held here: its file would not count
    // as open).
    match sessions.open_again(session_id, client, handle_id, created.attr.inode, access) {
        Ok(opened) => {
            created.handle_id = Some(opened);
            encode(&Ok::<CreateReply, WireError>(created))
        }
        Err(error) => encode(&Err::<CreateReply, WireError>(error)),
    }
}

/// An error reply, whatever the request's reply type (`Err` encodes the same for all).
fn error_reply(shared: &Shared, error: WireError) -> Reply {
    Reply {
        header: encode(&Err::<(), WireError>(error)).into(),
        payload: stamp(shared, Answered::default()),
    }
}

/// How many epochs back a replayed change may have been answered: the restarts (or
/// changes of leader) in a row a client may have missed while it replays.
const REPLAY_EPOCHS_MAX: u64 = 8;

/// The inode id a replayed create was given the first time, from its original reply.
/// and the layout a regular file was given (its client may have written by it already).
fn replayed_inode(
    replay: &ReplayOf,
    opcode: u16,
) -> Result<(Option<InodeId>, Option<freeflow_types::Layout>), WireError> {
    let replayed = match opcode {
        Create::OPCODE => decode::<Result<CreateReply, WireError>>(&replay.reply)?
            .ok()
            .map(|reply| (Some(reply.attr.inode), reply.attr.layout))
            .unwrap_or_default(),
        Mkdir::OPCODE | Symlink::OPCODE => (
            decode::<Result<Attr, WireError>>(&replay.reply)?
                .ok()
                .map(|attr| attr.inode),
            None,
        ),
        _ => (None, None),
    };
    Ok(replayed)
}

impl MetaService {
    /// A mutation of a client: applied once, however often it is sent.
    async fn client_mutation(&self, frame: Frame, client: u64) -> Result<Reply, String> {
        let shared = &self.shared;
        // A leadership that is over answers nothing, not even from a reply record of a
        // batch it may have run ahead of a commit that never came.
        if shared.raft.as_ref().is_some_and(|link| link.is_deposed()) {
            return Ok(error_reply(
                shared,
                WireError::new(ErrorCode::NotLeader, "this metadata server stopped leading"),
            ));
        }
        let key = (client, frame.request_id);
        let _in_progress = begin_mutation(shared, key).await;
        let resent = frame.flags & (FLAG_RESEND | FLAG_REPLAY) != 0;
        if resent {
            // The first copy may have been answered with its commit still running.
            shared.visible().await;
            match recorded_reply(shared, client, frame.request_id) {
                Ok(Some(record)) => {
                    let answered = Answered {
                        txn: record.txn,
                        ..Answered::default()
                    };
                    let header = if frame.opcode == Create::OPCODE {
                        opened_again(shared, &frame, client, record.reply)
                    } else {
                        record.reply
                    };
                    return Ok(Reply {
                        header: header.into(),
                        payload: stamp(shared, answered),
                    });
                }
                Ok(None) => {}
                Err(error) => return Ok(error_reply(shared, error)),
            }
        }
        let replay = frame.flags & FLAG_REPLAY != 0;
        let (forced_inode, forced_layout) = if replay {
            let original: ReplayOf = match decode(&frame.payload) {
                Ok(original) => original,
                Err(error) => return Err(format!("a replay without its original reply: {error}")),
            };
            // Only what the run just before this one answered, and only while the window
            // is open: anything else was lost (its client came back too late).
            // A replicated cluster may change leader again in the middle of a recovery, so
            // a change answered a few epochs back is still taken (its reply record, kept
            // for two leases after it is durable, answers it if it was applied).
            if !shared.recovery.is_recovering()
                || original.epoch >= shared.boot_epoch
                || shared.boot_epoch - original.epoch > REPLAY_EPOCHS_MAX
            {
                return Ok(error_reply(
                    shared,
                    WireError::new(
                        ErrorCode::Stale,
                        format!(
                            "a change answered in epoch {} replayed in epoch {} outside its \
                             recovery window: it was lost",
                            original.epoch, shared.boot_epoch
                        ),
                    ),
                ));
            }
            match replayed_inode(&original, frame.opcode) {
                Ok(replayed) => replayed,
                Err(error) => return Err(format!("a replay with an undecodable reply: {error}")),
            }
        } else {
            (None, None)
        };
        let id = MutationId {
            client,
            request_id: frame.request_id,
            forced_inode,
            forced_layout,
            replay,
        };
        self.apply_mutation(frame, id).await
    }

    /// Apply a mutation (any client, or none) through the writer.
    async fn apply_mutation(&self, frame: Frame, id: MutationId) -> Result<Reply, String> {
        let shared = &self.shared;
        match frame.opcode {
            Mkdir::OPCODE => {
                handle(frame, |request: Mkdir, _| async move {
                    stamped(shared, mkdir(shared, request, id).await)
                })
                .await
            }
            Unlink::OPCODE => mutation(shared, frame, id, not_durable, ops::remove::unlink).await,
            Rmdir::OPCODE => mutation(shared, frame, id, not_durable, ops::remove::rmdir).await,
            Rename::OPCODE => mutation(shared, frame, id, not_durable, ops::rename::rename).await,
            Link::OPCODE => mutation(shared, frame, id, not_durable, ops::link::link).await,
            Symlink::OPCODE => mutation(shared, frame, id, not_durable, ops::create::symlink).await,
            SetXattr::OPCODE => {
                mutation(shared, frame, id, not_durable, ops::xattr::set_xattr).await
            }
            RemoveXattr::OPCODE => {
                mutation(shared, frame, id, not_durable, ops::xattr::remove_xattr).await
            }
            CommitSize::OPCODE => {
                let durable = |request: &CommitSize| request.durable;
                mutation(shared, frame, id, durable, ops::size::commit_size).await
            }
            SetDirLayout::OPCODE => {
                mutation(shared, frame, id, not_durable, ops::size::set_dir_layout).await
            }
            SetAttributes::OPCODE => {
                handle(frame, |request: SetAttributes, _| async move {
                    recall_delegations(shared, id.client, request.named(shared)).await;
                    stamped(shared, set_attributes(shared, request, id).await)
                })
                .await
            }
            Create::OPCODE => {
                handle(frame, |mut request: Create, _| async move {
                    if id.replay {
                        // The session the original opened in is gone with the restart.
                        request.open = None;
                    }
                    recall_delegations(shared, id.client, request.named(shared)).await;
                    stamped(shared, create(shared, request, id).await)
                })
                .await
            }
            other => Err(format!("opcode {other} is not a mutation")),
        }
    }
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
                let service = MetaService {
                    shared: self.shared.clone(),
                };
                return tokio::spawn(async move { service.client_mutation(frame, client).await })
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
            return self.apply_mutation(frame, id).await;
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

async fn set_lock(shared: &Shared, client: u64, request: SetLock) -> Result<(), WireError> {
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

fn get_lock(shared: &Shared, request: &GetLock) -> Result<Option<LockConflict>, WireError> {
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

fn open_session(
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
async fn wait_revocations(
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
async fn close_session(shared: &Shared, session_id: u64, caller: u64) -> Result<(), WireError> {
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
fn wake_reaper_for(shared: &Shared, inodes: &[InodeId]) {
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
async fn open(shared: &Shared, request: &Open, client: u64) -> Result<OpenGrant, WireError> {
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

/// Set attributes; a shrink replies only once the I/O servers cut their objects (or with
/// `Unreachable` naming the server whose cut is left pending: the size is set either way).
async fn set_attributes(
    shared: &Arc<Shared>,
    request: SetAttributes,
    id: MutationId,
) -> Result<(Attr, Answered), WireError> {
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
    let (outcome, answered) = shared
        .mutate(id.client, false, move |write, context| {
            let outcome = ops::setattr::set_attributes_recording_cuts(
                write,
                context,
                &request,
                |inode| sessions_of.sessions().is_open(inode),
                through_handle_writable,
            )?;
            record_reply(write, id.client, id.request_id, context.txn, &outcome.attr)?;
            Ok(outcome)
        })
        .await?;
    if let (Some(record), Some(pin)) = (&outcome.truncation, &pin) {
        // Writes other clients have in flight on the file land before the cuts, not after
        // them (where they would bring back bytes written before this truncation).
        let writers = shared.sessions().writing_clients(inode);
        let bound = Duration::from_millis(u64::from(shared.config.lease_ms));
        let recall = shared
            .leases
            .recall_writes(id.client, inode, &writers, bound);
        for writer in &writers {
            // Its last session ended between the two looks: its entry must not stay.
            if !shared.sessions().has_sessions_of(*writer) {
                shared.leases.forget_client(*writer);
            }
        }
        if !recall.is_empty() {
            let (started, sent) = (Instant::now(), recall.len());
            let expired = shared.leases.wait(recall).await;
            shared.metrics.revoked(sent, expired, started);
        }
        let _exclusive = pin.exclusive().await;
        if let Err(error) = cutter::carry_out(shared, inode, record, Reach::All).await {
            tracing::warn!(inode, %error, "truncate: cuts pending");
            shared.reaper_wake.notify_one();
            return Err(error.to_wire());
        }
        // The cuts changed the space the file holds: answer with the settled record.
        if let Ok(Some(found)) = shared.read(|read| Ok(ops::try_load_inode(read, inode)?)) {
            return Ok((found.attr, answered));
        }
    }
    Ok((outcome.attr, answered))
}

/// Create (and maybe open). The handle is reserved before the job is queued and bound to
/// the inode inside the transaction, as `open` registers first: a later operation of the
/// same batch that unlinks the file makes an orphan the reaper already sees open.
async fn create(
    shared: &Arc<Shared>,
    request: Create,
    mut id: MutationId,
) -> Result<(CreateReply, Answered), WireError> {
    if let Some(inode) = request.inode {
        // The number the client reserved (`ReserveInodes`), or, for a replay, the one its
        // original reply gave. `OpContext::allocate_inode` checks that it lies below the
        // allocator (reserved numbers are never given out again, in this run or a later
        // one) and is not in use. A first send may come after a restart of this server,
        // so this run's reservations are not asked for.
        if !id.replay {
            id.forced_inode = Some(inode);
        }
    }
    let reserved = match request.open {
        Some((session_id, access)) => Some((
            session_id,
            shared.sessions().reserve_handle(session_id, access)?,
        )),
        None => None,
    };
    let binder = shared.clone();
    let created = shared
        .mutate(id.client, false, move |write, context| {
            context.forced_inode = id.forced_inode;
            context.forced_layout = id.forced_layout;
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
            record_reply(write, id.client, id.request_id, context.txn, &outcome.reply)?;
            Ok(outcome)
        })
        .await;
    match (created, reserved) {
        (Ok((outcome, answered)), None) => Ok((outcome.reply, answered)),
        (Ok((outcome, answered)), Some(_)) if outcome.reply.handle_id.is_some() => {
            Ok((outcome.reply, answered))
        }
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

/// A mkdir; a client that polls for revocations and was leased the new directory's names
/// is also delegated it (`Leases::delegate`): it may answer creates there before this
/// server has them.
async fn mkdir(
    shared: &Arc<Shared>,
    request: Mkdir,
    id: MutationId,
) -> Result<(Attr, Answered), WireError> {
    recall_delegations(shared, id.client, request.named(shared)).await;
    let (attr, mut answered) = shared
        .mutate(id.client, false, move |write, context| {
            context.forced_inode = id.forced_inode;
            let attr = ops::create::mkdir(write, context, &request)?;
            record_reply(write, id.client, id.request_id, context.txn, &attr)?;
            Ok(attr)
        })
        .await?;
    if answered.grant.lease_ms > 0 && shared.leases.delegate(id.client, attr.inode) {
        answered.delegated.push(attr.inode);
    }
    Ok((attr, answered))
}

/// `ReserveInodes`: `count` numbers from the allocator for this client's creates with a
/// chosen inode (never given to anyone else: the allocator moved past them).
async fn reserve_inodes(
    shared: &Arc<Shared>,
    client: u64,
    request: ReserveInodes,
) -> Result<InodeRange, WireError> {
    if client == 0 {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            "a peer without a client id cannot reserve inode numbers",
        ));
    }
    if request.count == 0 || request.count > INODE_RESERVE_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "ReserveInodes asks for {} numbers; 1..={INODE_RESERVE_MAX} may be reserved at once",
                request.count
            ),
        ));
    }
    let count = request.count;
    let (first, _) = shared
        .write_as(client, false, move |write, context| {
            Ok(context.state.reserve_inodes(write, u64::from(count))?)
        })
        .await?;
    Ok(InodeRange { first, count })
}

/// `InvalidArgument` when a `request` lists more than `max` of `what`.
fn at_most(request: &str, what: &str, listed: usize, max: usize) -> Result<(), WireError> {
    if listed > max {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!("{request} lists {listed} {what}, more than {max}"),
        ));
    }
    Ok(())
}

/// `CloseHandles`: close each listed handle of the session; returns the ids that were not
/// open in it.
fn close_handles(shared: &Shared, request: &CloseHandles) -> Result<Vec<u64>, WireError> {
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
fn reclaim_session(
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

/// `InspectInodes` (for `freeflow fsck`): each inode's record, orphan and truncation
/// records, and whether a client has it open for writing, read in one transaction.
fn inspect_inodes(shared: &Shared, request: &InspectInodes) -> Result<Vec<InodeFacts>, WireError> {
    at_most(
        "InspectInodes",
        "inodes",
        request.inodes.len(),
        INSPECT_INODES_MAX,
    )?;
    let mut facts = shared.read(|read| {
        let high_water = ops::inode_high_water(read)?;
        let mut facts = Vec::with_capacity(request.inodes.len());
        for inode in &request.inodes {
            let record = ops::try_load_inode(read, *inode)?;
            let orphan = read
                .get(TableId::Orphans, &inode_key(*inode))?
                .map(|bytes| {
                    decode_versioned::<crate::records::OrphanRecord>(TableId::Orphans, &bytes)
                })
                .transpose()?;
            let truncation = ops::truncate::load_truncation(read, *inode)?;
            facts.push(InodeFacts {
                inode: *inode,
                kind: record.as_ref().map(|record| record.attr.kind),
                size_bytes: record.as_ref().map_or(0, |record| record.attr.size_bytes),
                layout: record.and_then(|record| record.attr.layout),
                orphan: orphan.map(|orphan| orphan.layout),
                pending_cuts: truncation.map(|record| record.cuts).unwrap_or_default(),
                open_for_writing: false,
                not_yet_allocated: *inode >= high_water,
            });
        }
        Ok(facts)
    })?;
    let writing = shared.sessions().open_for_writing(&request.inodes);
    for fact in &mut facts {
        fact.open_for_writing = writing.contains(&fact.inode);
    }
    Ok(facts)
}

fn cluster_status(shared: &Shared) -> ClusterReport {
    ClusterReport {
        servers: shared.registry().records(Instant::now()),
        inode_count: shared.inode_count.load(Ordering::Relaxed),
        orphan_count: shared.orphan_count.load(Ordering::Relaxed),
        ready_ms: shared.ready_ms.load(Ordering::Relaxed),
        uptime_ms: shared.started.elapsed().as_millis() as u64,
        meta_metrics_address: shared.metrics_address.clone(),
        meta_members: shared.meta_members(),
    }
}

async fn register_server(
    shared: &Arc<Shared>,
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
        // Kept from the registry by `heartbeat`: a heartbeat does not move a server.
        state: MemberState::InService,
        unsynced_since_ms: 0,
        copy_everything: false,
    };
    let (needs_persist, known, known_before) = {
        let registry = shared.registry();
        (
            registry.needs_persist(request.server_id, &request.address),
            registry.len(),
            registry.address(request.server_id).is_some(),
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
        let mut persisted = entry.clone();
        if let Some(current) = shared.registry().entry(server_id) {
            persisted.state = current.state;
            persisted.unsynced_since_ms = current.unsynced_since_ms;
            persisted.copy_everything = current.copy_everything;
        }
        shared
            .write(move |write, _context| ops::servers::put_server(write, server_id, &persisted))
            .await?;
        tracing::info!(server_id, address = %request.address, "I/O server registered");
    }
    let (came_up, change, resync) = {
        let mut registry = shared.registry();
        let now = Instant::now();
        let came_up = registry.heartbeat(request.server_id, entry, now);
        registry.set_metrics_address(request.server_id, request.metrics_address);
        let change = registry.note_registration(
            request.server_id,
            request.incarnation,
            request.map_version,
            request.fresh,
            known_before,
        );
        (
            came_up,
            change,
            registry.resync_order(request.server_id, now),
        )
    };
    if let Some(change) = change {
        persist_states(shared, vec![change]).await?;
    }
    if came_up {
        // Orphans waiting for this server are removed at once.
        shared.reaper_wake.notify_one();
    }
    // The cuts it owes are made before it is told it may serve data.
    let cuts_owed = crate::reaper::cuts_owed_by(shared, request.server_id).await;
    if cuts_owed > 0 {
        tracing::info!(
            server_id = request.server_id,
            cuts_owed,
            "registering I/O server still owes truncation cuts; it serves no data until they are made"
        );
    }
    Ok(RegisterReply {
        heartbeat_interval_ms: shared.config.heartbeat_interval_ms,
        cuts_owed,
        map_version: shared.registry().map_version(),
        resync: if cuts_owed == 0 { resync } else { None },
        lease_ms: shared.config.server_down_after_ms / 2,
    })
}

/// Make changes of servers' states in their chains durable: a server put out must stay out
/// after a restart of the meta server, since its copies are stale until it resyncs.
pub async fn persist_states(
    shared: &Arc<Shared>,
    changes: Vec<crate::registry::StateChange>,
) -> Result<(), WireError> {
    let registry_of = Arc::clone(shared);
    shared
        .write(move |write, _context| {
            for (server, stale) in changes {
                // Written as the registry holds it now: a later change is never undone by
                // an earlier one that reached the writer after it.
                let entry = registry_of.registry().entry(server).unwrap_or(stale);
                ops::servers::put_server(write, server, &entry)?;
            }
            Ok(())
        })
        .await?;
    shared.sync().await?;
    Ok(())
}

async fn resync_done(shared: &Arc<Shared>, request: ResyncDone) -> Result<(), WireError> {
    let change = shared
        .registry()
        .resync_done(request.server_id, request.map_version)
        .map_err(|reason| WireError::new(ErrorCode::Stale, reason))?;
    if let Some(change) = change {
        tracing::info!(
            server_id = request.server_id,
            "I/O server resynced: back in service"
        );
        persist_states(shared, vec![change]).await?;
    }
    Ok(())
}
