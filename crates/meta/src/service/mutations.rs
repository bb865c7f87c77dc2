//! Mutations: each client's changes run once through the writer, their replies recorded;
//! the ones that need more than the writer (attributes, creates, inode reservations).

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::frame::{FLAG_REPLAY, FLAG_RESEND};
use freeflow_proto::meta::{
    CommitSize, Create, CreateReply, InodeRange, Link, Mkdir, RemoveXattr, Rename, ReplayOf,
    ReserveInodes, Rmdir, SetAttributes, SetDirLayout, SetXattr, Symlink, Unlink,
};
use freeflow_proto::{decode, encode, ErrorCode, Request, WireError};
use freeflow_rpc::{handle, Frame, Reply};
use freeflow_types::limits::INODE_RESERVE_MAX;
use freeflow_types::{Attr, FileKind, InodeId};
use serde::Serialize;

use super::reply::{stamp, stamped};
use super::sessions::release_handle;
use crate::cutter::{self, Reach};
use crate::ops::{self, OpContext, OpResult};
use crate::records::{
    decode_versioned, encode_versioned, reply_expiry_key, reply_key, ReplyRecord,
};
use crate::shared::{Answered, Shared};
use crate::store::{RedbWrite, StoreRead, StoreWrite, TableId};

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
pub(super) struct MutationId {
    pub(super) client: u64,
    pub(super) request_id: u64,
    /// The inode id a replayed create must keep.
    pub(super) forced_inode: Option<InodeId>,
    /// The layout a replayed create of a regular file must keep.
    pub(super) forced_layout: Option<freeflow_types::Layout>,
    /// A replay after a restart (a create then opens nothing: its session is gone).
    pub(super) replay: bool,
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

/// A mutation of a client: applied once, however often it is sent.
pub(super) async fn client_mutation(
    shared: &Arc<Shared>,
    frame: Frame,
    client: u64,
) -> Result<Reply, String> {
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
    apply_mutation(shared, frame, id).await
}

/// Apply a mutation (any client, or none) through the writer.
pub(super) async fn apply_mutation(
    shared: &Arc<Shared>,
    frame: Frame,
    id: MutationId,
) -> Result<Reply, String> {
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
        SetXattr::OPCODE => mutation(shared, frame, id, not_durable, ops::xattr::set_xattr).await,
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
pub(super) async fn create(
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
    let replayed_layout = id.forced_layout.is_some();
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
    if let (Ok((outcome, _)), true) = (&created, replayed_layout) {
        if let Some(layout) = &outcome.reply.attr.layout {
            crate::rereplication::cover_replayed(shared, outcome.reply.attr.inode, layout.clone());
        }
    }
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
pub(super) async fn reserve_inodes(
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
