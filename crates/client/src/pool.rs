//! The client's connections: one to the meta server and one per I/O server.
//!
//! Each connection is pipelined (many requests in flight, replies in any order), so one per
//! server is enough. They are made lazily and made again when found closed; the addresses of
//! I/O servers come from the meta server's `ListServers` and are fetched again when a layout
//! names an unknown server or a server cannot be reached at its old address (it may have
//! restarted elsewhere). Every call ends within the connect timeout plus the call timeout:
//! a server that is down gives an error naming it, never a hang.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use freeflow_proto::frame::{FLAG_REPLAY, FLAG_RESEND};
use freeflow_proto::io::{ReadObject, SyncObjects, WriteObject};
use freeflow_proto::meta::{
    is_mutation, CloseSession, GetServiceMap, ListServers, ReplayDone, ReplayOf, ReplyStamp,
    ServerRecord, ServiceMap, Sync,
};
use freeflow_proto::{decode, encode, ErrorCode, Request, WireError};
use freeflow_rpc::{ClusterKey, ConnectOptions, Connection, LeaderSearch, RawFrame, RpcError};
use freeflow_types::{Attr, InodeId, ServerId};

use crate::lease::{Lease, HANDLER_WAIT_MS};
use crate::metrics::ClientMetrics;
use crate::replay::{Kept, KeptLog};
use crate::ClientError;

/// A mutation sent patiently and not answered yet (see `Pool::patient`).
#[derive(Clone)]
struct PatientMutation {
    opcode: u16,
    name: &'static str,
    request: Vec<u8>,
    /// The reply its caller answered with, as the server would have given it (a replay
    /// carries its original reply: a create's holds its inode number).
    answered: Vec<u8>,
    /// Replayed to a restarted server already: its own send is then a resend.
    replayed: bool,
}

/// Removes a patient mutation from the pool's table when its call ends.
struct PatientEntry<'a> {
    pool: &'a Pool,
    request_id: u64,
}

impl Drop for PatientEntry<'_> {
    fn drop(&mut self) {
        self.pool.patient().remove(&self.request_id);
    }
}

/// Pause before a request whose connection broke is sent again.
const RESEND_PAUSE_MS: u64 = 100;

/// A connection slot for one server address, connected on first use.
struct Endpoint {
    /// One address, or for the metadata service of a replicated cluster several, comma
    /// separated (see `Connection::connect_leader`).
    address: String,
    /// With several addresses: the one that led last is tried first.
    leader: LeaderSearch,
    /// The identity the server must announce in its hello ("meta", "io:<id>"): a server
    /// answering at a stale address must not receive another server's data.
    identity: String,
    current: Mutex<Option<Connection>>,
    /// Held while connecting, so that many callers finding the connection closed make one
    /// new connection between them.
    connecting: tokio::sync::Mutex<()>,
    /// Set once a connection was made: a server reached before and unreachable now is
    /// most likely restarting, and calls wait for it (up to their deadline) rather than
    /// fail at once as they do for a server never reached (a wrong address).
    reached: AtomicBool,
}

impl Endpoint {
    fn new(address: String, identity: String) -> Endpoint {
        Endpoint {
            leader: LeaderSearch::new(address.clone()),
            address,
            identity,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            reached: AtomicBool::new(false),
        }
    }

    fn open_connection(&self) -> Option<Connection> {
        let current = self.current.lock().expect("not poisoned");
        current
            .as_ref()
            .filter(|connection| !connection.is_closed())
            .cloned()
    }

    async fn get(
        &self,
        key: &ClusterKey,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        if let Some(connection) = self.open_connection() {
            return Ok(connection);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(connection) = self.open_connection() {
            return Ok(connection);
        }
        // One address or several: a replicated metadata cluster's leader names its members
        // when connected to, and the search takes them (members come and go).
        let connection = self.leader.connect(key, options).await?;
        if connection.identity() != self.identity {
            return Err(RpcError::Protocol {
                address: self.address.clone(),
                reason: format!(
                    "the server answered as {:?}, expected {:?}",
                    connection.identity(),
                    self.identity
                ),
            });
        }
        tracing::debug!(
            client = %options.client_name,
            address = connection.address(),
            epoch = connection.epoch(),
            "connected"
        );
        *self.current.lock().expect("not poisoned") = Some(connection.clone());
        self.reached.store(true, Ordering::Relaxed);
        Ok(connection)
    }

    /// Whether a connection to this server was ever made.
    fn reached(&self) -> bool {
        self.reached.load(Ordering::Relaxed)
    }

    /// Several addresses: the members of a replicated metadata cluster.
    fn replicated(&self) -> bool {
        self.leader.several()
    }

    /// Stop using `connection` (its server no longer leads): the next call finds the
    /// leader again, starting with the next address.
    fn forget(&self, connection: &Connection) {
        let mut current = self.current.lock().expect("not poisoned");
        if current
            .as_ref()
            .is_some_and(|kept| Connection::same(kept, connection))
        {
            *current = None;
            self.leader.pass_over();
        }
    }
}

/// Whether a reply frame is the `NotLeader` error of a metadata server that does not
/// lead (its header is a postcard `Result`: variant 1, then the `WireError`).
fn is_not_leader(frame: &RawFrame) -> bool {
    frame.header.first() == Some(&1)
        && decode::<WireError>(&frame.header[1..])
            .is_ok_and(|error| error.code == ErrorCode::NotLeader)
}

pub(crate) struct Pool {
    key: ClusterKey,
    options: ConnectOptions,
    meta: Endpoint,
    /// I/O servers by id. Bounded by the number of servers in the cluster.
    io: Mutex<HashMap<ServerId, std::sync::Arc<Endpoint>>>,
    /// Serialises `ListServers` refreshes.
    refreshing: tokio::sync::Mutex<()>,
    /// The service map of replicated stripes (`replicated.rs`'s calls), fetched when first
    /// needed and again whenever a chain call fails.
    service_map: Mutex<std::sync::Arc<ServiceMap>>,
    /// Serialises service map fetches, and when the last one was made.
    fetching_map: tokio::sync::Mutex<Option<Instant>>,
    pub(crate) metrics: ClientMetrics,
    /// Request ids of meta calls, unique over this client's meta connections, so a request
    /// sent again on a new connection keeps its id (the server applies a mutation once per
    /// client id and request id).
    next_meta_request: AtomicU64,
    /// Mutations answered but not known durable (see `replay.rs`).
    kept: Mutex<KeptLog>,
    /// Mutations sent patiently (their caller answered them already, `delegation.rs`) and
    /// not answered yet, by request id. At a restart of the meta server they are replayed
    /// right after the kept ones, inside the recovery window, so that no other client acts
    /// on their directory before them. Bounded by the ops answered ahead at once.
    patient: Mutex<BTreeMap<u64, PatientMutation>>,
    /// Held while kept mutations are replayed to a restarted meta server.
    replaying: tokio::sync::Mutex<()>,
    /// The transaction that applied the last mutation answered (0: none yet).
    last_mutation_txn: AtomicU64,
    /// Called when the meta server restarted, before this client says `ReplayDone`:
    /// everything cached under the old server's leases must go (`Client::watch_revocations`).
    pub(crate) on_new_epoch: Mutex<Option<std::sync::Arc<dyn Fn() + Send + std::marker::Sync>>>,
    /// Called when the meta server restarted, on the new connection, after the replay and
    /// before `ReplayDone`: what must be taken again inside the recovery window (locks).
    pub(crate) on_recover: Mutex<Option<RecoverHook>>,
    /// The post-operation attributes of this client's own mutations, with their lease and
    /// transaction, by inode; checked against revocations when used. (Replies to reads are
    /// not kept: one sent before a mutation may arrive after it, with older attributes.)
    attributes: Mutex<KeptAttributes>,
    /// The meta server epoch whose leases are trusted: the new one from the moment a
    /// restart is noticed, before anything is replayed (the kept log moves to it last).
    lease_epoch: AtomicU64,
}

/// Most post-operation attributes kept; past it those whose lease can no longer be good
/// go, then the older half (see [`make_room`]).
const ATTRIBUTES_KEPT_MAX: usize = 65_536;

/// Post-operation attributes kept, by inode: each with its lease and the transaction that
/// returned it. Asked for every entry of a listing the mount answers from them.
type KeptAttributes = foldhash::HashMap<InodeId, (Attr, Lease, u64)>;

/// Room in a full table of kept attributes: first what renewals can no longer keep (past
/// its lease's span), then, if that freed less than a quarter, every entry older than the
/// newest half (by transaction: the files of a job long done, or unlinked since, go
/// before those it is working on).
fn make_room(kept: &mut KeptAttributes) {
    let now = Instant::now();
    kept.retain(|_, (_, lease, _)| !lease.ended_for_good(now));
    if kept.len() < ATTRIBUTES_KEPT_MAX / 4 * 3 {
        return;
    }
    let mut txns: Vec<u64> = kept.values().map(|(_, _, txn)| *txn).collect();
    let middle = txns.len() / 2;
    let (_, newest_old, _) = txns.select_nth_unstable(middle);
    let cut = *newest_old;
    kept.retain(|_, (_, _, txn)| *txn > cut);
}

/// See [`Pool::on_recover`].
pub(crate) type RecoverHook = std::sync::Arc<
    dyn Fn(Connection) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send
        + std::marker::Sync,
>;

impl Pool {
    pub fn new(
        meta_address: String,
        key: ClusterKey,
        options: ConnectOptions,
        metrics: ClientMetrics,
    ) -> Pool {
        Pool {
            metrics,
            key,
            options,
            meta: Endpoint::new(meta_address, "meta".to_string()),
            io: Mutex::new(HashMap::new()),
            refreshing: tokio::sync::Mutex::new(()),
            service_map: Mutex::new(std::sync::Arc::new(ServiceMap::default())),
            fetching_map: tokio::sync::Mutex::new(None),
            next_meta_request: AtomicU64::new(1),
            kept: Mutex::new(KeptLog::default()),
            patient: Mutex::new(BTreeMap::new()),
            replaying: tokio::sync::Mutex::new(()),
            last_mutation_txn: AtomicU64::new(0),
            on_new_epoch: Mutex::new(None),
            on_recover: Mutex::new(None),
            attributes: Mutex::new(KeptAttributes::default()),
            lease_epoch: AtomicU64::new(0),
        }
    }

    fn attributes(&self) -> MutexGuard<'_, KeptAttributes> {
        self.attributes.lock().expect("attributes not poisoned")
    }

    /// Attributes kept for `inode` and their lease (to be checked by the caller).
    pub(crate) fn kept_attributes(&self, inode: InodeId) -> Option<(Attr, Lease)> {
        self.attributes()
            .get(&inode)
            .map(|(attr, lease, _)| (attr.clone(), *lease))
    }

    /// [`Pool::kept_attributes`] of each of `inodes`, under one lock.
    pub(crate) fn kept_attributes_of(&self, inodes: &[InodeId]) -> Vec<Option<(Attr, Lease)>> {
        let kept = self.attributes();
        inodes
            .iter()
            .map(|inode| {
                kept.get(inode)
                    .map(|(attr, lease, _)| (attr.clone(), *lease))
            })
            .collect()
    }

    /// A mutation's post-operation attributes replace what was kept from an earlier
    /// transaction (replies of concurrent mutations may arrive out of order); without a
    /// lease they only drop it. If the server could not list everything the mutation
    /// changed, everything kept goes.
    fn note_changed(&self, stamp: &ReplyStamp, lease: Lease) {
        if stamp.txn == 0 {
            return;
        }
        let mut kept = self.attributes();
        if !stamp.changed_complete {
            kept.clear();
        }
        for attr in &stamp.changed {
            if lease.until.is_none() {
                kept.remove(&attr.inode);
                continue;
            }
            if kept.len() >= ATTRIBUTES_KEPT_MAX {
                make_room(&mut kept);
            }
            match kept.get(&attr.inode) {
                Some((_, _, txn)) if *txn > stamp.txn => {}
                _ => {
                    kept.insert(attr.inode, (attr.clone(), lease, stamp.txn));
                }
            }
        }
    }

    /// A request id for a call made directly on a meta connection (ids are unique over
    /// all of this client's meta connections).
    pub fn next_meta_request_id(&self) -> u64 {
        self.next_meta_request.fetch_add(1, Ordering::Relaxed)
    }

    /// How long a call may take before it fails.
    pub fn call_timeout_ms(&self) -> u64 {
        self.options.call_timeout_ms
    }

    /// The meta server epoch whose leases this client trusts (0 before its first
    /// connection).
    pub fn lease_epoch(&self) -> u64 {
        self.lease_epoch.load(Ordering::Acquire)
    }

    pub fn last_mutation_txn(&self) -> u64 {
        self.last_mutation_txn.load(Ordering::Acquire)
    }

    fn patient(&self) -> MutexGuard<'_, BTreeMap<u64, PatientMutation>> {
        self.patient.lock().expect("patient table not poisoned")
    }

    fn kept(&self) -> MutexGuard<'_, KeptLog> {
        self.kept.lock().expect("kept log not poisoned")
    }

    /// Mutations answered and not known durable (for tests and metrics).
    pub fn kept_mutations(&self) -> usize {
        self.kept().len()
    }

    /// One request to the meta server. `target` names what it is about, for the error.
    ///
    /// A request whose connection broke is sent again, under the same request id, until
    /// the call timeout: a mutation the server applied is answered from its record, never
    /// applied twice. A mutation answered before it was durable is kept until a reply shows
    /// it durable, and replayed if the server restarts first (`replay.rs`).
    pub async fn meta_call<R: Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
    ) -> Result<R::Reply, ClientError> {
        self.meta_call_leased(request, target)
            .await
            .map(|(reply, _)| reply)
    }

    /// [`Pool::meta_call`], with the lease the reply granted (see [`Lease`]).
    pub async fn meta_call_leased<R: Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
    ) -> Result<(R::Reply, Lease), ClientError> {
        self.meta_call_leased_as(request, target, None, &mut false)
            .await
    }

    /// [`Pool::meta_call`], saying whether the request was sent again after a connection
    /// broke with it sent and unanswered: that earlier attempt may have been carried out.
    /// For requests the server keeps no reply record of (`Close`), where the second attempt
    /// finds the first one's work done.
    pub async fn meta_call_noting_resend<R: Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
    ) -> (Result<R::Reply, ClientError>, bool) {
        let mut resent = false;
        let result = self
            .meta_call_leased_as(request, target, None, &mut resent)
            .await
            .map(|(reply, _)| reply);
        (result, resent)
    }

    /// [`Pool::meta_call_leased`] for a mutation its caller already answered (a create or
    /// unlink answered ahead, `delegation.rs`): a server that cannot be reached is tried
    /// again until the call timeout, as a broken connection is, instead of failing at once.
    /// `answered` is the reply the caller gave, as the server would encode it: replayed
    /// to a restarted server with the request (see `Pool::patient`).
    pub async fn meta_call_leased_patient<R: Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
        answered: Vec<u8>,
    ) -> Result<(R::Reply, Lease), ClientError> {
        self.meta_call_leased_as(request, target, Some(answered), &mut false)
            .await
    }

    async fn meta_call_leased_as<R: Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
        patient: Option<Vec<u8>>,
        resent: &mut bool,
    ) -> Result<(R::Reply, Lease), ClientError> {
        let started = Instant::now();
        let result = self.meta_call_unmetered(request, patient, resent).await;
        self.metrics
            .request_done(R::OPCODE, started, result.is_ok());
        result
            .map(|(reply, stamp)| {
                let lease = Lease::from_stamp(&stamp, started);
                self.note_changed(&stamp, lease);
                (reply, lease)
            })
            .map_err(|source| ClientError::Meta {
                operation: R::NAME,
                target: target(),
                address: self.meta.address.clone(),
                source,
            })
    }

    async fn meta_call_unmetered<R: Request>(
        &self,
        request: &R,
        patient: Option<Vec<u8>>,
        resent: &mut bool,
    ) -> Result<(R::Reply, ReplyStamp), RpcError> {
        let mutation = is_mutation(R::OPCODE);
        if mutation {
            self.make_room().await?;
        }
        let header = encode(request);
        let request_id = self.next_meta_request.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_millis(self.options.call_timeout_ms);
        let mut flags = 0;
        let is_patient = patient.is_some();
        let _entry = patient.map(|answered| {
            self.patient().insert(
                request_id,
                PatientMutation {
                    opcode: R::OPCODE,
                    name: R::NAME,
                    request: header.clone(),
                    answered,
                    replayed: false,
                },
            );
            PatientEntry {
                pool: self,
                request_id,
            }
        });
        let replicated = self.meta.replicated();
        loop {
            let attempt = match self.meta_connection().await {
                Ok(connection) => {
                    if is_patient
                        && self
                            .patient()
                            .get(&request_id)
                            .is_some_and(|entry| entry.replayed)
                    {
                        // Replayed by the recovery already: answered from its record.
                        flags = FLAG_RESEND;
                    }
                    connection
                        .call_raw(
                            R::OPCODE,
                            R::NAME,
                            request_id,
                            flags,
                            header.clone(),
                            Bytes::new(),
                        )
                        .await
                        .map(|frame| (frame, connection))
                }
                Err(error) => Err(error),
            };
            match attempt {
                // A member that stopped leading: the leader is elsewhere (or being
                // elected); the same request goes there.
                Ok((frame, connection)) if is_not_leader(&frame) && Instant::now() < deadline => {
                    tracing::debug!(request = R::NAME, request_id, "not the leader; finding it");
                    self.meta.forget(&connection);
                    flags = FLAG_RESEND;
                    tokio::time::sleep(Duration::from_millis(RESEND_PAUSE_MS)).await;
                }
                Ok((frame, connection)) => {
                    match self.meta_reply::<R>(frame, request_id, header.clone()) {
                        Some(result) => return result,
                        // Answered by a leader this client has left, and not durable: the
                        // same request goes to the new one.
                        None if Instant::now() < deadline => {
                            tracing::info!(
                                request = R::NAME,
                                request_id,
                                "answered by a server this client has left; sending again"
                            );
                            self.meta.forget(&connection);
                            flags = FLAG_RESEND;
                            // The recovery that left it may still be running: no spin.
                            tokio::time::sleep(Duration::from_millis(RESEND_PAUSE_MS)).await;
                        }
                        None => {
                            return Err(RpcError::Disconnected {
                                address: connection.address().to_string(),
                            })
                        }
                    }
                }
                // Sent, and the connection broke before the reply (the server may be
                // restarting): the same request again on a new one. So too a request
                // that finds a server reached before unreachable (it is restarting: a
                // request made in the moment between its death and its return waits like
                // the ones it cut off). Only a server never reached fails the first
                // attempt at once: it is simply not there, or the address is wrong. (A
                // client shutting down waits too: its closing call replays what it kept,
                // and a session left open would make a restarted server or a new leader
                // wait out its recovery window for a client that never comes back.)
                Err(
                    error @ (RpcError::Disconnected { .. }
                    | RpcError::Connect { .. }
                    | RpcError::Handshake { .. }),
                ) if (flags != 0
                    || is_patient
                    || replicated
                    || self.meta.reached()
                    || matches!(error, RpcError::Disconnected { .. }))
                    && Instant::now() < deadline =>
                {
                    tracing::debug!(%error, request = R::NAME, request_id, "sending again");
                    flags = FLAG_RESEND;
                    // Only a request sent and then cut off may have been carried out.
                    *resent |= matches!(error, RpcError::Disconnected { .. });
                    tokio::time::sleep(Duration::from_millis(RESEND_PAUSE_MS)).await;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Decode a meta reply, note its stamp, and keep a mutation answered early. None for
    /// a mutation's answer that cannot be trusted: not durable, and from a server epoch
    /// this client has left or is leaving (see `KeptLog::answered`); it must be sent again.
    fn meta_reply<R: Request>(
        &self,
        frame: RawFrame,
        request_id: u64,
        request: Vec<u8>,
    ) -> Option<Result<(R::Reply, ReplyStamp), RpcError>> {
        let result: Result<R::Reply, WireError> = match decode(&frame.header) {
            Ok(result) => result,
            Err(error) => {
                return Some(Err(RpcError::Protocol {
                    address: self.meta.address.clone(),
                    reason: format!("undecodable reply to {}: {}", R::NAME, error.message),
                }))
            }
        };
        let stamp = decode::<ReplyStamp>(&frame.payload).unwrap_or_default();
        if stamp.epoch != 0 {
            let mut kept = self.kept();
            kept.durable(stamp.epoch, stamp.durable_txn);
            if result.is_ok() && is_mutation(R::OPCODE) {
                let trusted = kept.answered(
                    stamp.epoch,
                    stamp.txn,
                    Kept {
                        opcode: R::OPCODE,
                        name: R::NAME,
                        request_id,
                        request,
                        reply: frame.header.to_vec(),
                    },
                );
                if !trusted {
                    return None;
                }
                self.last_mutation_txn.store(stamp.txn, Ordering::Release);
            }
        }
        Some(result.map(|reply| (reply, stamp)).map_err(RpcError::Remote))
    }

    /// Wait until the kept log has room for one more mutation: ask for a durable commit.
    async fn make_room(&self) -> Result<(), RpcError> {
        while !self.kept().has_room() {
            Box::pin(self.meta_call_unmetered(&Sync {}, None, &mut false)).await?;
        }
        Ok(())
    }

    /// Make every mutation answered so far durable at the meta server.
    pub async fn sync_meta(&self) -> Result<(), ClientError> {
        self.meta_call(&Sync {}, || "of the metadata".to_string())
            .await
    }

    /// The meta connection; a new server epoch first gets what this client kept replayed.
    /// Close `session_id` at the meta server this client knows, once, best effort: never
    /// over a connection to a server that restarted since (the session died with it, and
    /// this must not replay anything: a dropped client is gone).
    pub(crate) async fn close_session_quietly(&self, session_id: u64) {
        let Ok(connection) = self.meta.get(&self.key, &self.options).await else {
            return;
        };
        if connection.epoch() != self.kept().epoch {
            return;
        }
        let request_id = self.next_meta_request.fetch_add(1, Ordering::Relaxed);
        let request = CloseSession { session_id };
        let sent = connection
            .call_raw(
                CloseSession::OPCODE,
                CloseSession::NAME,
                request_id,
                0,
                encode(&request),
                Bytes::new(),
            )
            .await;
        if let Err(error) = sent {
            tracing::debug!(%error, session_id, "closing the session of a dropped client failed");
        }
    }

    async fn meta_connection(&self) -> Result<Connection, RpcError> {
        let connection = self.meta.get(&self.key, &self.options).await?;
        if connection.epoch() != self.kept().epoch {
            self.recover(&connection).await?;
        }
        Ok(connection)
    }

    /// The meta server restarted (or this is the first connection): replay, in the order
    /// they were applied, the mutations it answered but may have lost, then say so.
    async fn recover(&self, connection: &Connection) -> Result<(), RpcError> {
        let _replaying = self.replaying.lock().await;
        let result = self.replay_to(connection).await;
        if let Err(error) = &result {
            tracing::debug!(
                client = %self.options.client_name,
                %error,
                epoch = connection.epoch(),
                "replay to a new metadata epoch failed; the next connection tries again"
            );
            // Not done: everything kept stays, to be replayed to the next server found,
            // and answers of the old epoch are kept again meanwhile.
            self.kept().unseal();
        }
        result
    }

    async fn replay_to(&self, connection: &Connection) -> Result<(), RpcError> {
        let (old_epoch, entries) = {
            let mut kept = self.kept();
            if kept.epoch == connection.epoch() {
                return Ok(());
            }
            if kept.epoch == 0 {
                kept.start_epoch(connection.epoch());
                drop(kept);
                self.lease_epoch
                    .store(connection.epoch(), Ordering::Release);
                return Ok(());
            }
            (kept.epoch, kept.seal())
        };
        // Nothing the old server leased is trusted from here on: not the attributes kept
        // from this client's own mutations (the new server's transaction numbers start
        // over, too), not a reply already in hand.
        self.lease_epoch
            .store(connection.epoch(), Ordering::Release);
        self.attributes().clear();
        tracing::info!(
            client = %self.options.client_name,
            old_epoch,
            new_epoch = connection.epoch(),
            kept = entries.len(),
            "the metadata server restarted: replaying what it may have lost"
        );
        let mut replayed = Vec::with_capacity(entries.len());
        for (txn, kept) in entries {
            let original = ReplayOf {
                epoch: old_epoch,
                txn,
                reply: kept.reply.clone(),
            };
            let frame = connection
                .call_raw(
                    kept.opcode,
                    kept.name,
                    kept.request_id,
                    FLAG_REPLAY,
                    kept.request.clone(),
                    Bytes::from(encode(&original)),
                )
                .await?;
            self.stepped_down(connection, &frame)?;
            let stamp = decode::<ReplyStamp>(&frame.payload).unwrap_or_default();
            match decode::<Result<(), WireError>>(&frame.header) {
                // Any reply type: only Err is looked at (it encodes the same for all).
                Ok(Err(error)) => {
                    self.metrics.replayed(true);
                    tracing::error!(
                        request = kept.name,
                        request_id = kept.request_id,
                        %error,
                        "a change answered before the metadata server restarted was lost"
                    )
                }
                _ => {
                    self.metrics.replayed(false);
                    replayed.push((stamp, kept));
                }
            }
        }
        // Then what this client answered ahead and the old server had not answered: inside
        // the window too, so that nobody acts on its directory before it lands.
        let patient: Vec<(u64, PatientMutation)> = self
            .patient()
            .iter_mut()
            .map(|(request_id, entry)| {
                entry.replayed = true;
                (*request_id, entry.clone())
            })
            .collect();
        for (request_id, entry) in patient {
            let name = entry.name;
            let original = ReplayOf {
                epoch: old_epoch,
                txn: 0,
                reply: entry.answered,
            };
            let frame = connection
                .call_raw(
                    entry.opcode,
                    name,
                    request_id,
                    FLAG_REPLAY,
                    entry.request,
                    Bytes::from(encode(&original)),
                )
                .await?;
            self.stepped_down(connection, &frame)?;
            match decode::<Result<(), WireError>>(&frame.header) {
                Ok(Err(error)) => tracing::error!(
                    request = name,
                    request_id,
                    %error,
                    "a change answered ahead before the metadata server restarted was refused"
                ),
                _ => tracing::debug!(
                    request = name,
                    request_id,
                    "a change answered ahead, unanswered by the old server, replayed"
                ),
            }
        }
        // Leases of the old server are void: drop what was cached under them first.
        let hook = self.on_new_epoch.lock().expect("not poisoned").clone();
        if let Some(hook) = hook {
            // Off the runtime, and waited for a little only: the kernel's invalidations
            // take directory locks that requests waiting here for this replay may hold.
            let dropping = tokio::task::spawn_blocking(move || hook());
            let wait = Duration::from_millis(HANDLER_WAIT_MS);
            let _ = tokio::time::timeout(wait, dropping).await;
        }
        let hook = self.on_recover.lock().expect("not poisoned").clone();
        if let Some(hook) = hook {
            hook(connection.clone()).await;
        }
        let done_id = self.next_meta_request.fetch_add(1, Ordering::Relaxed);
        let frame = connection
            .call_raw(
                ReplayDone::OPCODE,
                ReplayDone::NAME,
                done_id,
                0,
                encode(&ReplayDone {}),
                Bytes::new(),
            )
            .await?;
        self.stepped_down(connection, &frame)?;
        let mut kept = self.kept();
        kept.start_epoch(connection.epoch());
        // Kept again under their new transactions, with the replies first given (a create
        // replayed a second time must keep its inode id again).
        for (stamp, entry) in replayed {
            let _kept = kept.answered(stamp.epoch, stamp.txn, entry);
        }
        if let Ok(stamp) = decode::<ReplyStamp>(&frame.payload) {
            kept.durable(stamp.epoch, stamp.durable_txn);
        }
        Ok(())
    }

    /// A replay answered `NotLeader`: the server stopped leading in the middle of the
    /// recovery. Nothing kept is dropped; the connection is given up, so the caller's
    /// resend finds the next leader and replays everything to it.
    fn stepped_down(&self, connection: &Connection, frame: &RawFrame) -> Result<(), RpcError> {
        if !is_not_leader(frame) {
            return Ok(());
        }
        self.meta.forget(connection);
        Err(RpcError::Disconnected {
            address: connection.address().to_string(),
        })
    }

    /// Fetch the server list from the meta server and update the addresses we know.
    pub async fn refresh_servers(&self) -> Result<Vec<ServerRecord>, ClientError> {
        let _refreshing = self.refreshing.lock().await;
        let servers = self
            .meta_call(&ListServers {}, || "of the cluster".to_string())
            .await?;
        self.learn_addresses(
            servers
                .iter()
                .map(|server| (server.server_id, server.address.as_str())),
        );
        Ok(servers)
    }

    /// Where each I/O server listens, as the meta server said: an endpoint at a new address
    /// replaces the old one.
    fn learn_addresses<'a>(&self, servers: impl Iterator<Item = (ServerId, &'a str)>) {
        let mut io = self.io.lock().expect("not poisoned");
        for (server_id, address) in servers {
            let stale = io
                .get(&server_id)
                .is_none_or(|endpoint| endpoint.address != address);
            if stale {
                io.insert(
                    server_id,
                    std::sync::Arc::new(Endpoint::new(
                        address.to_string(),
                        format!("io:{server_id}"),
                    )),
                );
            }
        }
    }

    /// Where I/O server `server_id` listens, if known.
    pub(crate) fn io_address(&self, server_id: ServerId) -> Option<String> {
        self.io_endpoint(server_id)
            .map(|endpoint| endpoint.address.clone())
    }

    fn io_endpoint(&self, server_id: ServerId) -> Option<std::sync::Arc<Endpoint>> {
        self.io
            .lock()
            .expect("not poisoned")
            .get(&server_id)
            .cloned()
    }

    /// A connection to I/O server `server_id` (checked to be that server when made).
    async fn io_connection(
        &self,
        server_id: ServerId,
        inode: InodeId,
    ) -> Result<Connection, ClientError> {
        let endpoint = match self.io_endpoint(server_id) {
            Some(endpoint) => endpoint,
            None => {
                self.refresh_servers().await?;
                self.io_endpoint(server_id)
                    .ok_or(ClientError::ServerUnknown { server_id, inode })?
            }
        };
        let connection = match endpoint.get(&self.key, &self.options).await {
            Ok(connection) => connection,
            Err(first_error) => {
                // The server may have come back at another address.
                self.refresh_servers().await?;
                let refreshed = self
                    .io_endpoint(server_id)
                    .ok_or(ClientError::ServerUnknown { server_id, inode })?;
                if refreshed.address == endpoint.address {
                    return Err(ClientError::Io {
                        operation: "connect",
                        target: format!("for inode {inode}"),
                        server_id,
                        address: endpoint.address.clone(),
                        source: first_error,
                    });
                }
                refreshed
                    .get(&self.key, &self.options)
                    .await
                    .map_err(|source| ClientError::Io {
                        operation: "connect",
                        target: format!("for inode {inode}"),
                        server_id,
                        address: refreshed.address.clone(),
                        source,
                    })?
            }
        };
        Ok(connection)
    }

    /// One request to I/O server `server_id`. A read or a sync whose connection broke is
    /// sent once more on a new connection: it changes nothing, so a second copy is harmless.
    /// A write or a truncate is never sent again (see [`resend_is_safe`]): the server may
    /// still be running the first copy, which could land after a newer overlapping write.
    pub async fn io_call<R: Request>(
        &self,
        server_id: ServerId,
        inode: InodeId,
        request: &R,
        payload: Bytes,
        target: impl Fn() -> String,
    ) -> Result<(R::Reply, Bytes), ClientError> {
        let started = Instant::now();
        let payload_bytes = payload.len() as u64;
        let result = self
            .io_call_unmetered(server_id, inode, request, payload, target)
            .await;
        self.meter::<R>(started, payload_bytes, &result);
        result
    }

    /// Count an I/O request that ended: its latency and outcome, and the bytes it moved.
    fn meter<R: Request>(
        &self,
        started: Instant,
        payload_bytes: u64,
        result: &Result<(R::Reply, Bytes), ClientError>,
    ) {
        self.metrics
            .request_done(R::OPCODE, started, result.is_ok());
        if let Ok((_, reply_payload)) = result {
            if R::OPCODE == WriteObject::OPCODE {
                self.metrics.written(payload_bytes);
            } else if R::OPCODE == ReadObject::OPCODE {
                self.metrics.read(reply_payload.len() as u64);
            }
        }
    }

    /// The service map held, as it is (version 0: none fetched yet).
    pub(crate) fn held_service_map(&self) -> std::sync::Arc<ServiceMap> {
        self.service_map.lock().expect("not poisoned").clone()
    }

    /// The service map held (fetched if none is yet).
    pub(crate) async fn service_map(&self) -> Result<std::sync::Arc<ServiceMap>, ClientError> {
        let held = self.service_map.lock().expect("not poisoned").clone();
        if held.version != 0 {
            return Ok(held);
        }
        self.fetch_service_map(0).await
    }

    /// Fetch the service map, unless one newer than `seen` arrived meanwhile.
    pub(crate) async fn fetch_service_map(
        &self,
        seen: u64,
    ) -> Result<std::sync::Arc<ServiceMap>, ClientError> {
        let mut fetched_at = self.fetching_map.lock().await;
        let held = self.service_map.lock().expect("not poisoned").clone();
        if held.version != 0 && held.version != seen {
            return Ok(held);
        }
        // Many requests waiting on a failed server ask at once: one fetch serves them all.
        if held.version != 0
            && fetched_at.is_some_and(|at| at.elapsed() < Duration::from_millis(MAP_FETCH_GAP_MS))
        {
            return Ok(held);
        }
        *fetched_at = Some(Instant::now());
        let map = std::sync::Arc::new(
            self.meta_call(&GetServiceMap {}, || "of the cluster".to_string())
                .await?,
        );
        self.learn_addresses(
            map.members
                .iter()
                .map(|member| (member.server_id, member.address.as_str())),
        );
        *self.service_map.lock().expect("not poisoned") = map.clone();
        Ok(map)
    }

    /// One attempt of a request to one I/O server: no resend, no wait.
    pub(crate) async fn io_attempt<R: Request>(
        &self,
        server_id: ServerId,
        inode: InodeId,
        request: &R,
        payload: Bytes,
        target: impl Fn() -> String,
    ) -> Result<(R::Reply, Bytes), ClientError> {
        let started = Instant::now();
        let payload_bytes = payload.len() as u64;
        let connection = match self.io_connection(server_id, inode).await {
            Ok(connection) => connection,
            Err(error) => {
                self.metrics.request_done(R::OPCODE, started, false);
                return Err(error);
            }
        };
        let result = connection
            .call(request, payload)
            .await
            .map_err(|source| ClientError::Io {
                operation: R::NAME,
                target: target(),
                server_id,
                address: connection.address().to_string(),
                source,
            });
        self.meter::<R>(started, payload_bytes, &result);
        result
    }

    async fn io_call_unmetered<R: Request>(
        &self,
        server_id: ServerId,
        inode: InodeId,
        request: &R,
        payload: Bytes,
        target: impl Fn() -> String,
    ) -> Result<(R::Reply, Bytes), ClientError> {
        let mut retried = false;
        let busy_deadline = Instant::now() + Duration::from_millis(self.options.call_timeout_ms);
        let mut busy_wait_ms = IO_BUSY_WAIT_MIN_MS;
        loop {
            let connection = self.io_connection(server_id, inode).await?;
            match connection.call(request, payload.clone()).await {
                Ok(reply) => return Ok(reply),
                Err(RpcError::Disconnected { .. }) if !retried && resend_is_safe(R::OPCODE) => {
                    retried = true
                }
                // Refused before it did anything (the server owes truncation cuts, see
                // `ioserver/src/gate.rs`): sent again, whatever it is. A write of this
                // handle that overlaps it waits for it, so no later bytes can pass it.
                Err(RpcError::Remote(error))
                    if error.code == ErrorCode::Busy && Instant::now() < busy_deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(busy_wait_ms)).await;
                    busy_wait_ms = (busy_wait_ms * 2).min(IO_BUSY_WAIT_MAX_MS);
                }
                Err(source) => {
                    let address = connection.address().to_string();
                    return Err(ClientError::Io {
                        operation: R::NAME,
                        target: target(),
                        server_id,
                        address,
                        source,
                    });
                }
            }
        }
    }
}

/// Shortest time between two fetches of the service map.
const MAP_FETCH_GAP_MS: u64 = 100;

/// The first and longest wait before sending again a request an I/O server refused as
/// `Busy` (it serves no data until its owed truncation cuts are made).
const IO_BUSY_WAIT_MIN_MS: u64 = 5;
const IO_BUSY_WAIT_MAX_MS: u64 = 200;

/// Whether an I/O request may be sent again after its connection broke (or it timed out)
/// with no reply. Only requests that change nothing: reads, and syncs (which only wait for
/// the disk). A write or truncate resent on a new connection can land after the server's
/// first copy, which may itself land after a newer overlapping write of the same client:
/// the older bytes would win. So those fail, and the failure sticks on the handle.
pub(crate) fn resend_is_safe(opcode: u16) -> bool {
    opcode == ReadObject::OPCODE || opcode == SyncObjects::OPCODE
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_proto::io::TruncateObject;

    #[test]
    fn only_reads_and_syncs_are_resent() {
        assert!(resend_is_safe(ReadObject::OPCODE));
        assert!(resend_is_safe(SyncObjects::OPCODE));
        assert!(!resend_is_safe(WriteObject::OPCODE));
        assert!(!resend_is_safe(TruncateObject::OPCODE));
    }

    #[test]
    fn a_full_table_of_kept_attributes_forgets_the_dead_then_the_older_half() {
        let now = Instant::now();
        let lease = |span: Duration| Lease {
            until: Some(now + span.min(Duration::from_secs(9))),
            seq: 1,
            epoch: 1,
            delegated: false,
            span_until: Some(now + span),
        };
        let attr = |inode| {
            Attr::new_inode(
                inode,
                freeflow_types::FileKind::Regular,
                0o644,
                0,
                0,
                freeflow_types::TimeSpec::default(),
            )
        };
        let mut kept = KeptAttributes::default();
        let full = ATTRIBUTES_KEPT_MAX as u64;
        for inode in 1..=full {
            // An eighth of them past their span: not enough room, the older half goes too.
            let span = if inode % 8 == 0 {
                Duration::ZERO
            } else {
                Duration::from_secs(60)
            };
            kept.insert(inode, (attr(inode), lease(span), inode));
        }
        make_room(&mut kept);
        assert!(kept
            .values()
            .all(|(_, lease, _)| lease.span_until.unwrap() > now));
        let left = kept.len() as u64;
        assert!(
            left <= full / 2 && left > full / 4,
            "{left} of {full} left: the dead went, then the older half"
        );
        let oldest_left = kept.values().map(|(_, _, txn)| *txn).min().unwrap();
        assert!(
            kept.values().all(|(_, _, txn)| *txn >= oldest_left)
                && (oldest_left..=full)
                    .filter(|txn| txn % 8 != 0)
                    .all(|txn| kept.contains_key(&txn)),
            "the newest are kept"
        );
    }
}
