//! Leases on what clients cache, and their revocation by callback (issue 9, DESIGN.md §4).
//!
//! A client that polls for revocations (`WaitRevocations`) is *lease-capable*: what its
//! reads return is leased to it for `cache_lease_ms`, measured by the client from when it
//! sent the request (so it stops trusting a cache before the server forgets the lease):
//! - the names of a directory whose entries it read (positive and negative lookups,
//!   listings): it may keep them, until a revocation names them;
//! - the attributes of an inode whose record it read: it may keep them, until revoked.
//!
//! Before a mutation's reply, every other client holding a lease on what it changed gets a
//! [`Revocation`] (the names of a directory that changed; the attributes of an inode that
//! changed) through its poll, and the mutation waits until that client acknowledges it
//! (its next poll) or its lease runs out: a dead client delays others by one lease at most.
//!
//! A grant races with changes: a read starts at sequence `since`; if any inode it read was
//! changed by another client after `since` (the change may have missed the lease, not yet
//! registered), no lease is granted. Revocation ids come from the same sequence, so a
//! client that receives a revocation before the reply it races with can tell the reply is
//! older (`ReplyStamp::lease_seq`).
//!
//! A lease is kept past its time by the client's renewals (`RenewLeases`, sent at a
//! fraction of the lease): every lease still good when a renewal of an unbroken run of
//! them arrives lasts until the newest renewal's end, but never longer than
//! `LEASE_RENEWAL_SPAN_MS` after its grant ([`live_until`]). A client that stops renewing
//! (dead, cut off) is still waited for one lease at most, from its last renewal. A renewal
//! tells the client the newest revocation queued to it, and the client counts on it only
//! once it handled that one: a revoked lease is never kept by a renewal.
//!
//! Every table has a bound: clients (`sessions_max`), leases per client, revocations queued
//! per client, and inodes remembered as changed. Past a bound, leases are refused (the
//! client simply does not cache), never the operation.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use foldhash::HashMap;
use freeflow_proto::meta::{Revocation, LEASE_RENEWAL_SPAN_MS};
use freeflow_types::InodeId;
use tokio::sync::Notify;

use crate::store::Touches;

/// Most leases one client holds at once (a lease is one inode, names or attributes).
pub const LEASES_PER_CLIENT_MAX: usize = 1 << 20;
/// Most revocations queued for one client before it polls.
pub const REVOCATIONS_QUEUED_MAX: usize = 65_536;
/// Most inodes remembered as recently changed (for the grant race).
pub const CHANGED_INODES_MAX: usize = 1 << 20;
/// Most names one revocation carries (more: the whole directory).
pub const REVOCATION_NAMES_MAX: usize = 256;
/// Most directories delegated at once (past it, no new delegation: creates go the long way).
pub const DELEGATIONS_MAX: usize = 65_536;

#[derive(Clone, Copy, Debug)]
struct Held {
    client: u64,
    names: bool,
    attributes: bool,
    /// Its own end: the grant's time plus a lease (and a margin).
    until: Instant,
    /// When it was (last) granted: renewals keep it at most `LEASE_RENEWAL_SPAN_MS` longer.
    granted: Instant,
}

/// An unbroken run of a client's lease renewals: each arrived before the previous one's
/// end.
#[derive(Clone, Copy, Debug)]
struct Renewals {
    /// When the first renewal of the run arrived: leases good then are kept by the run.
    since: Instant,
    /// The newest renewal's end.
    until: Instant,
}

/// The server holds a lease a little longer than the client trusts it.
const SERVER_MARGIN: Duration = Duration::from_millis(100);

/// When `held` runs out: its own time, or the end of its client's run of renewals if the
/// lease was still good when the run began, up to `LEASE_RENEWAL_SPAN_MS` after its grant.
fn live_until(held: &Held, clients: &HashMap<u64, CallbackClient>) -> Instant {
    let run = clients.get(&held.client).and_then(|client| client.renewals);
    match run {
        Some(run) if held.until > run.since => {
            let span_end =
                held.granted + Duration::from_millis(LEASE_RENEWAL_SPAN_MS) + SERVER_MARGIN;
            held.until.max(run.until.min(span_end))
        }
        _ => held.until,
    }
}

struct CallbackClient {
    queue: VecDeque<Revocation>,
    /// Every revocation up to this id has been handled by the client.
    acknowledged: u64,
    /// The newest revocation id handed to the client: it cannot acknowledge past it.
    delivered: u64,
    leases: usize,
    /// Counts the client's polls: only its newest is answered (an older one whose reply
    /// the client gave up on must not take what the newest is waiting for).
    polls: u64,
    /// Woken when a revocation is queued or a newer poll arrives.
    wake: std::sync::Arc<Notify>,
    /// The newest revocation queued to the client (a renewal's `revocations_through`).
    queued_through: u64,
    /// Its current run of renewals, if any.
    renewals: Option<Renewals>,
    /// A revocation could not be queued (the client fell too far behind): no renewal is
    /// taken before this time, when every lease it should have ended has run out.
    renewals_refused_until: Option<Instant>,
}

impl CallbackClient {
    fn new() -> CallbackClient {
        CallbackClient {
            queue: VecDeque::new(),
            acknowledged: 0,
            delivered: 0,
            leases: 0,
            polls: 0,
            wake: std::sync::Arc::new(Notify::new()),
            queued_through: 0,
            renewals: None,
            renewals_refused_until: None,
        }
    }
}

/// The last change of an inode: its sequence, by whom, and a bound on the sequence of the
/// last change by anyone else (0: none remembered).
#[derive(Clone, Copy)]
struct Change {
    seq: u64,
    client: u64,
    /// At least the sequence of every remembered change of the inode by a client other
    /// than `client`: the previous change's sequence when another client made it, else
    /// what that change carried. A grant to `client` for a read that began before it is
    /// refused; one that began after it is not (a directory where several clients worked
    /// long ago gets leases again).
    others_seq: u64,
}

#[derive(Default)]
struct Inner {
    next_seq: u64,
    clients: HashMap<u64, CallbackClient>,
    holders: HashMap<InodeId, Vec<Held>>,
    changed: HashMap<InodeId, Change>,
    changed_order: VecDeque<(Instant, InodeId, u64)>,
    /// Directories delegated to one client, by directory: it answers creates in them
    /// before this server has them, so no other client may read or change their names
    /// before the delegation is recalled (see [`Leases::recall_delegations`]). Good while
    /// the holder's names lease on the directory is.
    delegations: HashMap<InodeId, u64>,
}

/// Revocations a mutation must see acknowledged (or expired) before it replies.
#[derive(Debug, Default)]
pub struct Pending {
    waits: Vec<(u64, u64, Instant)>,
}

impl Pending {
    pub fn is_empty(&self) -> bool {
        self.waits.is_empty()
    }

    /// Revocations sent (one per client and inode).
    pub fn len(&self) -> usize {
        self.waits.len()
    }
}

/// What a read was granted: the lease and the sequence it was granted at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Grant {
    pub lease_ms: u32,
    pub seq: u64,
}

pub struct Leases {
    lease: Duration,
    inner: Mutex<Inner>,
    /// Woken when a client acknowledges revocations or goes away.
    acknowledged: Notify,
}

impl Leases {
    pub fn new(lease_ms: u32) -> Leases {
        Leases {
            lease: Duration::from_millis(u64::from(lease_ms)),
            inner: Mutex::new(Inner {
                next_seq: 1,
                ..Inner::default()
            }),
            acknowledged: Notify::new(),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn lease_ms(&self) -> u32 {
        self.lease.as_millis() as u32
    }

    /// The sequence now: what a read that starts now grants at.
    pub fn seq(&self) -> u64 {
        self.inner().next_seq
    }

    pub fn is_capable(&self, client: u64) -> bool {
        client != 0 && self.inner().clients.contains_key(&client)
    }

    /// Leases on what `touches` read (and, for a mutation, changed: its client may keep
    /// what it just made), if nothing of it was changed by another client since `since`.
    pub fn grant(&self, client: u64, touches: &Touches, since: u64) -> Grant {
        if client == 0 || touches.overflowed {
            return Grant::default();
        }
        let now = Instant::now();
        let mut inner = self.inner();
        let seq = inner.next_seq;
        if !inner.clients.contains_key(&client) {
            return Grant::default();
        }
        // One entry per inode: whether its names, its attributes or both are leased.
        let mut wanted: Vec<(InodeId, bool, bool)> = Vec::with_capacity(
            touches.names_read.len()
                + touches.names_changed.len()
                + touches.attributes_read.len()
                + touches.attributes_changed.len(),
        );
        wanted.extend(touches.names_read.iter().map(|inode| (*inode, true, false)));
        wanted.extend(
            touches
                .names_changed
                .iter()
                .map(|(directory, _)| (*directory, true, false)),
        );
        wanted.extend(
            touches
                .attributes_read
                .iter()
                .chain(&touches.attributes_changed)
                .map(|inode| (*inode, false, true)),
        );
        wanted.sort_unstable_by_key(|(inode, _, _)| *inode);
        wanted.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 |= later.1;
                kept.2 |= later.2;
            }
            same
        });
        // Every change takes a number of the sequence: none since the read began, none
        // raced it (the common case, checked without a lookup per inode).
        let raced = inner.next_seq > since
            && wanted.iter().any(|(inode, _, _)| {
                inner.changed.get(inode).is_some_and(|change| {
                    change.seq >= since && (change.client != client || change.others_seq >= since)
                })
            });
        if raced {
            return Grant::default();
        }
        let held = inner.clients.get(&client).map_or(0, |entry| entry.leases);
        if held + wanted.len() > LEASES_PER_CLIENT_MAX {
            // Some of what is counted may have run out since the last sweep.
            sweep(&mut inner, now);
            let held = inner.clients.get(&client).map_or(0, |entry| entry.leases);
            if held + wanted.len() > LEASES_PER_CLIENT_MAX {
                return Grant::default();
            }
        }
        let until = now + self.lease + SERVER_MARGIN;
        let mut added = 0;
        let Inner {
            holders: all_holders,
            clients,
            ..
        } = &mut *inner;
        for (inode, names, attributes) in wanted {
            let holders = all_holders.entry(inode).or_default();
            holders.retain(|held| live_until(held, clients) > now);
            match holders.iter_mut().find(|held| held.client == client) {
                Some(held) => {
                    held.names |= names;
                    held.attributes |= attributes;
                    held.until = until;
                    held.granted = now;
                }
                None => {
                    holders.push(Held {
                        client,
                        names,
                        attributes,
                        until,
                        granted: now,
                    });
                    added += 1;
                }
            }
        }
        if let Some(entry) = inner.clients.get_mut(&client) {
            entry.leases += added;
        }
        Grant {
            lease_ms: self.lease_ms(),
            seq,
        }
    }

    /// Record what `changer` changed and queue revocations to the other clients holding
    /// leases on it; returns what the change must wait for before its reply.
    pub fn changed(&self, changer: u64, touches: &Touches) -> Pending {
        let now = Instant::now();
        let mut inner = self.inner();
        let mut per_client: HashMap<(u64, InodeId), (Vec<String>, bool, bool)> = HashMap::default();
        let all_names: Vec<(InodeId, Option<&str>)> = if touches.overflowed {
            // Too much to say what: everything every other client holds.
            inner.holders.keys().map(|inode| (*inode, None)).collect()
        } else {
            touches
                .names_changed
                .iter()
                .map(|(directory, name)| (*directory, Some(name.as_str())))
                .collect()
        };
        for (directory, _) in &all_names {
            if inner
                .delegations
                .get(directory)
                .is_some_and(|holder| *holder != changer)
            {
                // The recall before the change made this one go already; a change that
                // came another way takes it all the same (its revocation follows below).
                inner.delegations.remove(directory);
            }
        }
        if touches.overflowed {
            inner.delegations.retain(|_, holder| *holder == changer);
        }
        let mut changed_inodes: Vec<InodeId> = all_names.iter().map(|(inode, _)| *inode).collect();
        changed_inodes.extend(&touches.attributes_changed);
        if touches.overflowed {
            changed_inodes.extend(inner.holders.keys().copied().collect::<Vec<_>>());
        }
        let seq = inner.next_seq;
        inner.next_seq += 1;
        for inode in &changed_inodes {
            let previous = inner.changed.get(inode).copied();
            let others_seq = match previous {
                Some(change) if change.client != changer => change.seq,
                Some(change) => change.others_seq,
                None => 0,
            };
            inner.changed.insert(
                *inode,
                Change {
                    seq,
                    client: changer,
                    others_seq,
                },
            );
            inner.changed_order.push_back((now, *inode, seq));
        }
        // Forget changes older than a lease: no read that started before them can still
        // be granted (its grant would be older than that lease).
        let horizon = self.lease * 2 + Duration::from_secs(1);
        while let Some((at, inode, seq)) = inner.changed_order.front().copied() {
            if now.duration_since(at) < horizon && inner.changed_order.len() <= CHANGED_INODES_MAX {
                break;
            }
            inner.changed_order.pop_front();
            if inner
                .changed
                .get(&inode)
                .is_some_and(|change| change.seq == seq)
            {
                inner.changed.remove(&inode);
            }
        }
        for (directory, name) in &all_names {
            for held in inner.holders.get(directory).into_iter().flatten() {
                if held.client == changer || !held.names || live_until(held, &inner.clients) <= now
                {
                    continue;
                }
                let entry = per_client.entry((held.client, *directory)).or_insert((
                    Vec::new(),
                    false,
                    false,
                ));
                match name {
                    Some(name) => entry.0.push((*name).to_string()),
                    None => entry.2 = true,
                }
            }
        }
        for inode in touches
            .attributes_changed
            .iter()
            .chain(if touches.overflowed {
                changed_inodes.iter()
            } else {
                [].iter()
            })
        {
            for held in inner.holders.get(inode).into_iter().flatten() {
                if held.client == changer
                    || !held.attributes
                    || live_until(held, &inner.clients) <= now
                {
                    continue;
                }
                per_client
                    .entry((held.client, *inode))
                    .or_insert((Vec::new(), false, false))
                    .1 = true;
            }
        }
        let mut pending = Pending::default();
        for ((client, inode), (mut names, attributes, all)) in per_client {
            let until = inner
                .holders
                .get(&inode)
                .and_then(|holders| holders.iter().find(|held| held.client == client))
                .map_or(now, |held| live_until(held, &inner.clients));
            // The attribute lease is gone with its revocation; names stay leased but for
            // the ones named (they are re-read at their next lookup).
            if attributes {
                if let Some(holders) = inner.holders.get_mut(&inode) {
                    for held in holders.iter_mut().filter(|held| held.client == client) {
                        held.attributes = false;
                    }
                }
            }
            names.sort();
            names.dedup();
            let whole_directory = all || names.len() > REVOCATION_NAMES_MAX;
            if whole_directory {
                names.clear();
                if let Some(holders) = inner.holders.get_mut(&inode) {
                    for held in holders.iter_mut().filter(|held| held.client == client) {
                        held.names = false;
                    }
                }
            }
            let revocation = Revocation {
                id: 0,
                inode,
                names,
                attributes,
                whole_directory,
            };
            queue_revocation(&mut inner, &mut pending, client, revocation, until);
        }
        pending
    }

    /// Delegate `directory` to `client`, which just made it and holds the lease on its
    /// names: true if it is now delegated. Refused when another client holds a lease on its
    /// names, or past `DELEGATIONS_MAX`.
    pub fn delegate(&self, client: u64, directory: InodeId) -> bool {
        let now = Instant::now();
        let mut inner = self.inner();
        if client == 0 || !inner.clients.contains_key(&client) {
            return false;
        }
        let holds_names =
            |holders: &[Held], holder: u64, clients: &HashMap<u64, CallbackClient>| {
                holders.iter().any(|held| {
                    held.client == holder && held.names && live_until(held, clients) > now
                })
            };
        let (mine, others) = {
            let holders = inner
                .holders
                .get(&directory)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            let others = holders.iter().any(|held| {
                held.client != client && held.names && live_until(held, &inner.clients) > now
            });
            (holds_names(holders, client, &inner.clients), others)
        };
        if !mine || others {
            return false;
        }
        if inner.delegations.len() >= DELEGATIONS_MAX {
            let Inner {
                delegations,
                holders,
                clients,
                ..
            } = &mut *inner;
            delegations.retain(|directory, holder| {
                holders
                    .get(directory)
                    .is_some_and(|held| holds_names(held, *holder, clients))
            });
            if delegations.len() >= DELEGATIONS_MAX {
                return false;
            }
        }
        inner.delegations.insert(directory, client);
        true
    }

    /// Whether any directory is delegated now.
    pub fn has_delegations(&self) -> bool {
        !self.inner().delegations.is_empty()
    }

    /// Whether any of `inodes` is a directory delegated to another client than `requester`
    /// (cheap: a read asks this after every lookup and listing).
    pub fn delegated_elsewhere(&self, requester: u64, inodes: &[InodeId]) -> bool {
        let inner = self.inner();
        if inner.delegations.is_empty() {
            return false;
        }
        inodes.iter().any(|inode| {
            *inode == crate::store::TOUCHED_ALL
                || inner
                    .delegations
                    .get(inode)
                    .is_some_and(|holder| *holder != requester)
        })
    }

    /// Before `requester` reads or changes `inodes`: recall the delegations other clients
    /// hold on any of them. Each holder gets a revocation of the directory's names, which it
    /// acknowledges only once the creates and unlinks it answered there are answered by this
    /// server; the caller waits for that, up to `bound` (the session lease: a holder that
    /// does not answer by then has lost its session and its ops with it), and then reads
    /// what they did. The revocation goes even when the holder's names lease ran out: its
    /// ops may still be on their way (queued behind others, or behind a reconnect).
    pub fn recall_delegations(
        &self,
        requester: u64,
        inodes: &[InodeId],
        bound: Duration,
    ) -> Pending {
        let now = Instant::now();
        let mut inner = self.inner();
        let mut pending = Pending::default();
        if inner.delegations.is_empty() {
            return pending;
        }
        let everything = inodes.contains(&crate::store::TOUCHED_ALL);
        let recalled: Vec<(InodeId, u64)> = inner
            .delegations
            .iter()
            .filter(|(directory, holder)| {
                **holder != requester && (everything || inodes.contains(directory))
            })
            .map(|(directory, holder)| (*directory, *holder))
            .collect();
        for (directory, holder) in recalled {
            inner.delegations.remove(&directory);
            if let Some(held) = inner
                .holders
                .get_mut(&directory)
                .and_then(|holders| holders.iter_mut().find(|held| held.client == holder))
            {
                held.names = false;
            }
            let revocation = Revocation {
                id: 0,
                inode: directory,
                names: Vec::new(),
                attributes: false,
                whole_directory: true,
            };
            queue_revocation(&mut inner, &mut pending, holder, revocation, now + bound);
        }
        pending
    }

    /// Directories delegated now (for metrics).
    pub fn delegation_count(&self) -> usize {
        self.inner().delegations.len()
    }

    /// A truncation by `changer` is about to cut `inode`, which `writers` have open for
    /// writing: each of them gets a revocation of its attributes, lease or not, and
    /// acknowledges it only once the writes it has in flight on the file are answered (the
    /// client's `leases::watch`). A writer that has not polled yet (just connected, or
    /// back after a restart of this server while its writes were in flight) is entered
    /// here and finds the revocation at its first poll. Waited for up to `bound` (the
    /// session lease: a client that stops answering loses its session, and is then
    /// forgotten, by then). The caller forgets again a writer whose last session ended
    /// meanwhile.
    pub fn recall_writes(
        &self,
        changer: u64,
        inode: InodeId,
        writers: &[u64],
        bound: Duration,
    ) -> Pending {
        let until = Instant::now() + bound;
        let mut inner = self.inner();
        let mut pending = Pending::default();
        for client in writers.iter().copied().filter(|client| *client != changer) {
            inner
                .clients
                .entry(client)
                .or_insert_with(CallbackClient::new);
            if let Some(holders) = inner.holders.get_mut(&inode) {
                for held in holders.iter_mut().filter(|held| held.client == client) {
                    held.attributes = false;
                }
            }
            let revocation = Revocation {
                id: 0,
                inode,
                names: Vec::new(),
                attributes: true,
                whole_directory: false,
            };
            queue_revocation(&mut inner, &mut pending, client, revocation, until);
        }
        pending
    }

    /// Wait until every revocation of `pending` is acknowledged or its lease is over;
    /// returns how many were not acknowledged (their lease ran out).
    pub async fn wait(&self, pending: Pending) -> usize {
        if pending.is_empty() {
            return 0;
        }
        loop {
            let notified = self.acknowledged.notified();
            let next_expiry = {
                let inner = self.inner();
                let now = Instant::now();
                let open: Vec<Instant> = pending
                    .waits
                    .iter()
                    .filter(|(client, id, until)| {
                        *until > now
                            && inner
                                .clients
                                .get(client)
                                .is_some_and(|entry| entry.acknowledged < *id)
                    })
                    .map(|(_, _, until)| *until)
                    .collect();
                match open.into_iter().min() {
                    None => {
                        return pending
                            .waits
                            .iter()
                            .filter(|(client, id, _)| {
                                inner
                                    .clients
                                    .get(client)
                                    .is_some_and(|entry| entry.acknowledged < *id)
                            })
                            .count()
                    }
                    Some(until) => until,
                }
            };
            let _ = tokio::time::timeout_at(next_expiry, notified).await;
        }
    }

    /// A client's poll: note what it acknowledged, then hand it what is queued, waiting up
    /// to `wait` for something. The first poll makes the client lease-capable.
    pub async fn poll(&self, client: u64, acknowledged: u64, wait: Duration) -> Vec<Revocation> {
        let (wake, mine) = {
            let mut inner = self.inner();
            let entry = inner
                .clients
                .entry(client)
                .or_insert_with(CallbackClient::new);
            entry.polls += 1;
            entry.acknowledged = entry.acknowledged.max(acknowledged.min(entry.delivered));
            let done = entry.acknowledged;
            while entry
                .queue
                .front()
                .is_some_and(|revocation| revocation.id <= done)
            {
                entry.queue.pop_front();
            }
            // An older poll still waiting gives way to this one.
            entry.wake.notify_waiters();
            (entry.wake.clone(), entry.polls)
        };
        self.acknowledged.notify_waiters();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Created before the queue is looked at: a revocation queued in between wakes it.
            let notified = wake.notified();
            {
                let mut inner = self.inner();
                match inner.clients.get_mut(&client) {
                    Some(entry) if entry.polls != mine => return Vec::new(),
                    Some(entry) if !entry.queue.is_empty() => {
                        let handed: Vec<Revocation> = entry.queue.iter().cloned().collect();
                        let newest = handed.last().map_or(0, |revocation| revocation.id);
                        entry.delivered = entry.delivered.max(newest);
                        return handed;
                    }
                    Some(_) => {}
                    None => return Vec::new(),
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Vec::new();
            }
        }
    }

    /// A client is gone (its last session ended): its leases and queue go, and whoever
    /// waited for it stops waiting.
    pub fn forget_client(&self, client: u64) {
        let mut inner = self.inner();
        if inner.clients.remove(&client).is_none() {
            return;
        }
        for holders in inner.holders.values_mut() {
            holders.retain(|held| held.client != client);
        }
        inner.holders.retain(|_, holders| !holders.is_empty());
        inner.delegations.retain(|_, holder| *holder != client);
        drop(inner);
        self.acknowledged.notify_waiters();
    }

    /// Drop the leases that ran out (called periodically, and when a client reaches its
    /// bound), so that memory follows what is held now.
    pub fn sweep(&self) {
        sweep(&mut self.inner(), Instant::now());
    }

    /// Clients that poll for revocations (for metrics).
    pub fn client_count(&self) -> usize {
        self.inner().clients.len()
    }

    /// Leases held now, over all clients (for metrics).
    pub fn held(&self) -> usize {
        let now = Instant::now();
        let inner = self.inner();
        inner
            .holders
            .values()
            .map(|holders| {
                holders
                    .iter()
                    .filter(|held| live_until(held, &inner.clients) > now)
                    .count()
            })
            .sum()
    }

    /// A client's renewal of its leases (`RenewLeases`): whether it was taken, and the
    /// newest revocation queued to the client, which it must handle before counting on
    /// the renewal. Refused for a client that does not poll, and for a while after a
    /// revocation could not be queued to it.
    pub fn renew(&self, client: u64) -> (bool, u64) {
        let now = Instant::now();
        let mut inner = self.inner();
        let Some(entry) = inner.clients.get_mut(&client) else {
            return (false, 0);
        };
        if entry
            .renewals_refused_until
            .is_some_and(|until| now < until)
        {
            // The run ends on its own time: what it promised is kept.
            return (false, entry.queued_through);
        }
        entry.renewals_refused_until = None;
        let until = now + self.lease + SERVER_MARGIN;
        let since = match entry.renewals {
            Some(run) if now < run.until => run.since,
            _ => now,
        };
        entry.renewals = Some(Renewals { since, until });
        (true, entry.queued_through)
    }
}

/// Number `revocation`, queue it to `client` and note in `pending` that it is to be waited
/// for until `until`.
fn queue_revocation(
    inner: &mut Inner,
    pending: &mut Pending,
    client: u64,
    mut revocation: Revocation,
    until: Instant,
) {
    revocation.id = inner.next_seq;
    inner.next_seq += 1;
    let Some(target) = inner.clients.get_mut(&client) else {
        return;
    };
    if target.queue.len() >= REVOCATIONS_QUEUED_MAX {
        // The client is not keeping up: it will be waited for until `until`, like a client
        // that is gone, and its leases are not renewed before then (it never learns of
        // this revocation).
        target.renewals_refused_until = Some(
            target
                .renewals_refused_until
                .map_or(until, |refused| refused.max(until)),
        );
        pending.waits.push((client, u64::MAX, until));
        return;
    }
    let id = revocation.id;
    target.queued_through = id;
    target.queue.push_back(revocation);
    target.wake.notify_waiters();
    pending.waits.push((client, id, until));
}

/// Drop expired leases and count again what each client holds.
fn sweep(inner: &mut Inner, now: Instant) {
    let Inner {
        holders: all_holders,
        clients,
        ..
    } = &mut *inner;
    all_holders.retain(|_, holders| {
        holders.retain(|held| live_until(held, clients) > now && (held.names || held.attributes));
        !holders.is_empty()
    });
    for entry in inner.clients.values_mut() {
        entry.leases = 0;
    }
    let Inner {
        holders, clients, ..
    } = inner;
    for held in holders.values().flatten() {
        if let Some(entry) = clients.get_mut(&held.client) {
            entry.leases += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(names: &[InodeId], attributes: &[InodeId]) -> Touches {
        Touches {
            names_read: names.to_vec(),
            attributes_read: attributes.to_vec(),
            ..Touches::default()
        }
    }

    fn changed(names: &[(InodeId, &str)], attributes: &[InodeId]) -> Touches {
        Touches {
            names_changed: names
                .iter()
                .map(|(directory, name)| (*directory, name.to_string()))
                .collect(),
            attributes_changed: attributes.to_vec(),
            ..Touches::default()
        }
    }

    #[tokio::test]
    async fn a_change_revokes_other_clients_leases_and_waits_for_their_acknowledgement() {
        let leases = std::sync::Arc::new(Leases::new(10_000));
        // Client 7 polls (becomes lease-capable) and reads directory 1 and inode 5.
        assert!(leases.poll(7, 0, Duration::ZERO).await.is_empty());
        let since = leases.seq();
        let grant = leases.grant(7, &read(&[1], &[1, 5]), since);
        assert_eq!(grant.lease_ms, 10_000);
        // A client that never polled gets no lease.
        assert_eq!(leases.grant(8, &read(&[1], &[]), since).lease_ms, 0);
        // Client 8 renames "a" in directory 1 and changes inode 5.
        let pending = leases.changed(8, &changed(&[(1, "a")], &[5]));
        assert!(!pending.is_empty());
        let waiter = {
            let leases = leases.clone();
            tokio::spawn(async move { leases.wait(pending).await })
        };
        let revocations = leases.poll(7, 0, Duration::from_secs(5)).await;
        assert_eq!(revocations.len(), 2);
        let names = revocations.iter().find(|r| r.inode == 1).unwrap();
        assert_eq!(names.names, vec!["a".to_string()]);
        assert!(!names.attributes && !names.whole_directory);
        assert!(revocations.iter().any(|r| r.inode == 5 && r.attributes));
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "the change waits for the acknowledgement"
        );
        let last = revocations.iter().map(|r| r.id).max().unwrap();
        assert!(leases.poll(7, last, Duration::ZERO).await.is_empty());
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("acknowledged: the change goes on")
            .unwrap();
        // Its own changes are never revoked from a client.
        assert!(leases.changed(7, &changed(&[(1, "b")], &[])).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_keep_leases_good_at_their_start_for_a_span_and_a_silent_client_one_lease() {
        let leases = Leases::new(10_000);
        // Renewals of a client that does not poll are not taken.
        assert_eq!(leases.renew(7), (false, 0));
        leases.poll(7, 0, Duration::ZERO).await;
        leases.poll(8, 0, Duration::ZERO).await;
        let since = leases.seq();
        assert_eq!(leases.grant(7, &read(&[], &[5]), since).lease_ms, 10_000);
        let old = leases.seq();
        tokio::time::advance(Duration::from_secs(11)).await;
        // Inode 6 is granted and runs out before the run begins; 5 is renewed in time.
        assert_eq!(leases.grant(7, &read(&[], &[6]), old).lease_ms, 10_000);
        assert_eq!(leases.held(), 1, "5 ran out");
        let since = leases.seq();
        assert_eq!(leases.grant(7, &read(&[], &[5]), since).lease_ms, 10_000);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(leases.renew(7), (true, 0));
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(5)).await;
            assert_eq!(leases.renew(7), (true, 0));
        }
        // 34 s after 5's second grant, 23 s after 6's: both kept by the run.
        assert_eq!(leases.held(), 2);
        let pending = leases.changed(8, &changed(&[], &[5]));
        assert_eq!(pending.len(), 1, "a renewed lease is revoked");
        let revocations = leases.poll(7, 0, Duration::ZERO).await;
        assert_eq!(revocations.len(), 1);
        // The renewal names the revocation the client must handle first.
        assert_eq!(leases.renew(7), (true, revocations[0].id));
        // Past its span (60 s after its grant), a lease is not kept any more.
        for _ in 0..6 {
            tokio::time::advance(Duration::from_secs(5)).await;
            assert!(leases.renew(7).0);
        }
        assert_eq!(leases.held(), 0, "6 is 63 s old");
        assert!(leases.changed(8, &changed(&[], &[6])).is_empty());
        // A client that stops renewing holds its leases one lease past its last renewal.
        let since = leases.seq();
        assert_eq!(leases.grant(7, &read(&[], &[9]), since).lease_ms, 10_000);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(leases.renew(7).0);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(leases.held(), 1, "9: 10 s after the last renewal");
        let pending = leases.changed(8, &changed(&[], &[9]));
        assert_eq!(pending.len(), 1);
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(
            leases.held(),
            0,
            "one lease and the margin after the last renewal"
        );
        // A renewal after the run ended starts a new one, which keeps nothing older.
        let since = leases.seq();
        assert_eq!(leases.grant(7, &read(&[], &[10]), since).lease_ms, 10_000);
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(leases.renew(7).0);
        assert_eq!(leases.held(), 0);
    }

    #[tokio::test]
    async fn a_directory_other_clients_changed_before_a_read_began_is_leased_again() {
        let leases = Leases::new(10_000);
        leases.poll(7, 0, Duration::ZERO).await;
        leases.poll(8, 0, Duration::ZERO).await;
        // Client 8 changes directory 1; then client 7 starts a mkdir there.
        let _ = leases.changed(8, &changed(&[(1, "theirs")], &[1]));
        let since = leases.seq();
        let _ = leases.changed(7, &changed(&[(1, "mine")], &[1, 20]));
        assert_eq!(
            leases
                .grant(7, &changed(&[(1, "mine")], &[1, 20]), since)
                .lease_ms,
            10_000,
            "8's change came before 7's began"
        );
        // Client 8 changes it again while 7's next mutation is under way: no lease.
        let since = leases.seq();
        let _ = leases.changed(8, &changed(&[(1, "again")], &[1]));
        let _ = leases.changed(7, &changed(&[(1, "mine2")], &[1]));
        assert_eq!(
            leases
                .grant(7, &changed(&[(1, "mine2")], &[1]), since)
                .lease_ms,
            0,
            "8 changed it after 7's began"
        );
        // And 7's own later changes do not hide that.
        let _ = leases.changed(7, &changed(&[(1, "mine3")], &[1]));
        assert_eq!(leases.grant(7, &read(&[1], &[1]), since).lease_ms, 0);
    }

    #[tokio::test]
    async fn only_the_newest_poll_of_a_client_is_answered() {
        let leases = std::sync::Arc::new(Leases::new(10_000));
        leases.poll(7, 0, Duration::ZERO).await;
        leases.grant(7, &read(&[1], &[]), leases.seq());
        // A poll the client gave up on (its call timed out) is still waiting...
        let old = {
            let leases = leases.clone();
            tokio::spawn(async move { leases.poll(7, 0, Duration::from_secs(30)).await })
        };
        tokio::task::yield_now().await;
        // ...when the client polls again: the old one ends empty, the new one gets what
        // is queued.
        let new = {
            let leases = leases.clone();
            tokio::spawn(async move { leases.poll(7, 0, Duration::from_secs(30)).await })
        };
        let old = tokio::time::timeout(Duration::from_secs(5), old)
            .await
            .expect("the old poll gives way")
            .unwrap();
        assert!(old.is_empty());
        leases.changed(8, &changed(&[(1, "a")], &[]));
        let new = tokio::time::timeout(Duration::from_secs(5), new)
            .await
            .expect("the new poll is answered")
            .unwrap();
        assert_eq!(new.len(), 1);
    }

    #[tokio::test]
    async fn a_read_touching_an_inode_several_ways_holds_one_lease_covering_each_way() {
        let leases = Leases::new(10_000);
        leases.poll(7, 0, Duration::ZERO).await;
        let since = leases.seq();
        // A listing of directory 1: its names, its own record and those of 5 and 6, 5 twice.
        let touches = Touches {
            names_read: vec![1],
            attributes_read: vec![5, 1, 6, 5],
            ..Touches::default()
        };
        assert_eq!(leases.grant(7, &touches, since).lease_ms, 10_000);
        assert_eq!(leases.held(), 3, "one lease per inode");
        assert_eq!(leases.inner().clients[&7].leases, 3);
        // Both ways of inode 1 are leased: a rename in it and a change of its record are
        // each revoked from the reader.
        let pending = leases.changed(8, &changed(&[(1, "a")], &[1, 6]));
        assert_eq!(pending.len(), 2, "directory 1 and inode 6");
        let revocations = leases.poll(7, 0, Duration::ZERO).await;
        let directory = revocations.iter().find(|r| r.inode == 1).unwrap();
        assert!(directory.attributes && directory.names == vec!["a".to_string()]);
        assert!(revocations.iter().any(|r| r.inode == 6 && r.attributes));
        assert!(!revocations.iter().any(|r| r.inode == 5));
    }

    #[tokio::test]
    async fn a_read_that_raced_a_change_gets_no_lease() {
        let leases = Leases::new(10_000);
        leases.poll(7, 0, Duration::ZERO).await;
        let since = leases.seq();
        // Another client changes inode 5 after the read began.
        leases.changed(8, &changed(&[], &[5]));
        assert_eq!(leases.grant(7, &read(&[], &[5]), since).lease_ms, 0);
        // A read that began after the change is granted.
        let since = leases.seq();
        assert_eq!(leases.grant(7, &read(&[], &[5]), since).lease_ms, 10_000);
    }

    #[tokio::test]
    async fn a_writer_that_never_polled_finds_the_recall_at_its_first_poll() {
        let leases = std::sync::Arc::new(Leases::new(10_000));
        // Client 7 writes but has not polled yet (it just connected, or this server just
        // restarted); client 8 truncates.
        let pending = leases.recall_writes(8, 5, &[7, 8], Duration::from_secs(10));
        assert_eq!(
            pending.len(),
            1,
            "the writer is recalled, the truncator is not"
        );
        let waiter = {
            let leases = leases.clone();
            tokio::spawn(async move { leases.wait(pending).await })
        };
        // It acknowledges as if it had seen revocations of an earlier run of the server:
        // nothing past what it was handed counts.
        let revocations = leases.poll(7, 99, Duration::from_secs(5)).await;
        assert_eq!(revocations.len(), 1);
        assert!(revocations[0].inode == 5 && revocations[0].attributes);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "the cut waits for the writer");
        leases.poll(7, revocations[0].id, Duration::ZERO).await;
        let expired = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("acknowledged: the cut goes on")
            .unwrap();
        assert_eq!(expired, 0);
    }

    #[tokio::test]
    async fn a_silent_client_is_waited_for_one_lease_at_most() {
        let leases = Leases::new(300);
        leases.poll(7, 0, Duration::ZERO).await;
        let since = leases.seq();
        leases.grant(7, &read(&[1], &[]), since);
        let started = Instant::now();
        let pending = leases.changed(8, &changed(&[(1, "x")], &[]));
        leases.wait(pending).await;
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // Once the client is forgotten, nothing waits for it.
        leases.grant(7, &read(&[1], &[]), leases.seq());
        leases.forget_client(7);
        let pending = leases.changed(8, &changed(&[(1, "y")], &[]));
        assert!(pending.is_empty());
    }
}
