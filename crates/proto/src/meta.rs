//! Requests served by the metadata server (opcodes 100-199).

use freeflow_types::{
    Attr, FileKind, InodeId, Layout, LockKind, ObjectId, ServerId, SetAttr, TimeSpec,
};
use serde::{Deserialize, Serialize};

use crate::requests;

/// Who is asking, for POSIX permission checks on the metadata server. User 0 is root.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caller {
    pub user_id: u32,
    pub group_id: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

impl Caller {
    pub fn root() -> Caller {
        Caller::default()
    }
}

/// How a rename treats an existing target (Linux `renameat2` flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RenameMode {
    /// Replace an existing target (plain `rename`).
    Replace,
    /// Fail with `Exists` if the target exists (`RENAME_NOREPLACE`).
    NoReplace,
    /// Swap source and target atomically; both must exist (`RENAME_EXCHANGE`).
    Exchange,
}

/// How a setxattr treats an existing attribute (`XATTR_CREATE`, `XATTR_REPLACE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum XattrSetMode {
    Any,
    CreateOnly,
    ReplaceOnly,
}

/// Access wanted by an open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenAccess {
    pub read: bool,
    pub write: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionGrant {
    pub session_id: u64,
    /// The session and its open handles end if not renewed within this time.
    pub lease_ms: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateReply {
    pub attr: Attr,
    /// False when a non-exclusive create found an existing regular file.
    pub created: bool,
    /// Set when the create also opened the file for the given session.
    pub handle_id: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenGrant {
    pub handle_id: u64,
    pub attr: Attr,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub inode: InodeId,
    pub kind: FileKind,
    /// Present when the readdir asked for attributes (readdirplus).
    pub attr: Option<Attr>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirPage {
    /// Entries in name order, after the request's cursor. "." and ".." are not included.
    pub entries: Vec<DirEntry>,
    /// True when no entries follow the last one returned.
    pub end: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsStats {
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub inode_count: u64,
    pub servers_up: u32,
    pub servers_total: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRecord {
    pub server_id: ServerId,
    pub address: String,
    pub up: bool,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub object_count: u64,
    /// Milliseconds since the last heartbeat; None if never seen since the meta server started.
    pub last_seen_ms: Option<u64>,
    /// `host:port` of the server's metrics endpoint, as in its last heartbeat (None: off).
    pub metrics_address: Option<String>,
    /// Its place in the chains of replicated files.
    pub state: MemberState,
}

/// An I/O server's place in the chains of replicated stripes (DESIGN.md §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberState {
    /// Takes writes and serves reads.
    InService,
    /// Silent past `server_down_after_ms`: left out of every chain, writes go on without it.
    Out,
    /// Back after being out: takes every write again (at the end of its chains) while it
    /// copies what changed in its absence, and serves no reads of replicated stripes.
    Syncing,
    /// Removed from the cluster (`freeflow server remove`): in no chain, no placement and
    /// no map; its id is never used again and its registrations are refused.
    Removed,
}

/// One I/O server in the [`ServiceMap`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub server_id: ServerId,
    pub address: String,
    pub state: MemberState,
    /// Changes each time the server process starts: a client that lost a connection to
    /// it knows, from a new value, that the old process (and any request it held) is gone.
    pub incarnation: u64,
    /// Out or syncing: since when (Unix ms, the meta server's clock) it may lack writes;
    /// 0 in service. Of two members neither in service, the later one is the fresher.
    pub unsynced_since_ms: u64,
}

/// Which I/O servers are in which state, versioned: every change of a state gives a new
/// version, and a replicated write is taken only by servers that hold the version its
/// client used, so a server left out of its chains cannot take writes for them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceMap {
    pub version: u64,
    pub members: Vec<Member>,
    /// Servers whose copies of replicated stripes are kept on others now (re-replication,
    /// issue 42), oldest first: every chain is read through them ([`ServiceMap::chain`]).
    pub replacements: Vec<Replacement>,
}

/// A server lost for good (out past `server_dead_after_ms`), or drained by an operator
/// (`drain`): in the chain of every stripe of a file made before, another server takes its
/// place, chosen per stripe among `by` ([`ServiceMap::chain`]), and copies the stripe
/// while it takes every new write (`ioserver/src/fill.rs`). A lost server gives up only
/// stripes with more than one copy (nothing else holds the others); a drained one gives
/// up every stripe, and keeps its place until its stand-ins are done (see `complete`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replacement {
    /// The server replaced.
    pub server: ServerId,
    /// Only stripes of inodes below this number are taken from it (every inode that existed
    /// when it was replaced): a server that comes back takes new files again.
    pub inodes_below: InodeId,
    /// The servers its stripes go to (in service when it was replaced).
    pub by: Vec<ServerId>,
    /// Those of `by` still copying their stripes: they take writes, serve no reads of
    /// the stripes they take, and are no source of a copy.
    pub filling: Vec<ServerId>,
    /// When it was replaced (Unix ms, the meta server's clock).
    pub made_ms: u64,
    /// Drained while it runs (`freeflow server drain`): while stand-ins copy, it keeps its
    /// place and they come after it; once all copied (sealed), they serve reads and it
    /// takes writes only; once every server in service holds the sealed map, `complete`:
    /// the stand-ins have its places. Its copy thus stays current until no read can reach it.
    pub drain: bool,
    /// A drain whose stand-ins have its places (see `drain`).
    pub complete: bool,
    /// The part of the server's stripes the record takes, in millionths ([`SHARE_ALL`]:
    /// all): a rebalance drains part of a full server onto emptier ones. Which stripes is
    /// fixed per object by a hash ([`Replacement::takes`]).
    pub share_ppm: u32,
}

/// [`Replacement::share_ppm`] of a record that takes every stripe.
pub const SHARE_ALL: u32 = 1_000_000;

impl Replacement {
    /// Whether this record takes `object` from its server (its inode is covered and the
    /// object falls in its share).
    pub fn takes(&self, object: ObjectId) -> bool {
        object.inode < self.inodes_below
            && (self.share_ppm >= SHARE_ALL || self.share_rank(object) < u64::from(self.share_ppm))
    }

    /// Where `object` falls in 0..SHARE_ALL for this record's share: a hash of the object
    /// and the record (its server and time), so that the next rebalance of the same server
    /// draws other stripes than the last one, which moved those it drew already.
    fn share_rank(&self, object: ObjectId) -> u64 {
        let seed = (u64::from(self.server) << 32) ^ self.made_ms ^ 0x5BD1_E995;
        let mixed = replacement_rank(object, (seed ^ (seed >> 32)) as ServerId);
        replacement_rank(
            ObjectId {
                inode: mixed ^ self.made_ms,
                stripe_index: object.stripe_index,
            },
            self.server,
        ) % u64::from(SHARE_ALL)
    }

    /// Whether this record is a drain of every stripe of its server.
    pub fn drains_all(&self) -> bool {
        self.drain && self.share_ppm >= SHARE_ALL
    }
}

/// One member of a stripe's chain as the service map makes it ([`ServiceMap::chain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainMember {
    pub server: ServerId,
    /// Took the place of a replaced server and is still copying the stripe.
    pub filling: bool,
}

/// Rank of `server` for taking `object` from a replaced server (rendezvous hashing: the
/// highest rank among the candidates wins, so objects spread evenly over them and a
/// candidate's choice does not depend on the others). Fixed here for every binary.
fn replacement_rank(object: ObjectId, server: ServerId) -> u64 {
    let mut x = object
        .inode
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(object.stripe_index).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(u64::from(server).wrapping_mul(0x1656_67B1_9E37_79F9));
    // splitmix64's finaliser.
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl ServiceMap {
    pub fn member(&self, server_id: ServerId) -> Option<&Member> {
        self.members
            .iter()
            .find(|member| member.server_id == server_id)
    }

    pub fn state(&self, server_id: ServerId) -> MemberState {
        self.member(server_id)
            .map_or(MemberState::InService, |member| member.state)
    }

    /// The chain of `object` whose layout gives `layout_chain`, with every replaced server
    /// taken out and its stand-in put in its place. Replacements apply oldest first; each
    /// chooses among its candidates not yet in the chain (the layout's servers and earlier
    /// stand-ins), so a newer replacement never changes an older one's choice. A lost
    /// server's slot with no candidate left is dropped (the stripe keeps fewer copies); a
    /// drained server's stays its own. A lost server's stripes with one copy are not
    /// replaced: there is nothing to copy them from. A drain not complete keeps the
    /// drained server in its slot (taking writes; serving reads until sealed) and puts the
    /// stand-in at the end (filling until sealed).
    pub fn chain(&self, object: ObjectId, layout_chain: &[ServerId]) -> Vec<ChainMember> {
        let mut slots: Vec<ChainMember> = layout_chain
            .iter()
            .map(|server| ChainMember {
                server: *server,
                filling: false,
            })
            .collect();
        let mut taken: Vec<ServerId> = layout_chain.to_vec();
        for replacement in &self.replacements {
            if !replacement.takes(object) || (!replacement.drain && layout_chain.len() < 2) {
                continue;
            }
            let mut index = 0;
            while index < slots.len() {
                if slots[index].server != replacement.server {
                    index += 1;
                    continue;
                }
                let pick = replacement
                    .by
                    .iter()
                    .copied()
                    .filter(|candidate| !taken.contains(candidate))
                    .max_by_key(|candidate| replacement_rank(object, *candidate));
                taken.extend(pick);
                match pick {
                    None if replacement.drain => {}
                    None => {
                        slots.remove(index);
                        continue;
                    }
                    Some(server) if !replacement.drain => {
                        slots[index] = ChainMember {
                            server,
                            filling: replacement.filling.contains(&server),
                        };
                    }
                    Some(server) if !replacement.filling.is_empty() => {
                        slots.push(ChainMember {
                            server,
                            filling: true,
                        });
                    }
                    Some(server) if !replacement.complete => {
                        slots[index].filling = true;
                        slots.push(ChainMember {
                            server,
                            filling: false,
                        });
                    }
                    Some(server) => {
                        slots[index] = ChainMember {
                            server,
                            filling: false,
                        };
                    }
                }
                index += 1;
            }
        }
        slots
    }

    /// Every (stripe, server) the objects of `inode` (with `layout`) are kept on, as the
    /// map makes the chains.
    pub fn placements(&self, inode: InodeId, layout: &Layout) -> Vec<(u32, ServerId)> {
        (0..layout.stripe_count())
            .flat_map(|stripe_index| {
                let object = ObjectId {
                    inode,
                    stripe_index,
                };
                self.chain(object, &layout.chain(stripe_index))
                    .into_iter()
                    .map(move |member| (stripe_index, member.server))
            })
            .collect()
    }

    /// Whether `server` keeps a copy of `object` (with `layout`), as the map makes the
    /// chains.
    pub fn keeps(&self, object: ObjectId, layout: &Layout, server: ServerId) -> bool {
        self.chain(object, &layout.chain(object.stripe_index))
            .iter()
            .any(|member| member.server == server)
    }

    /// Where a replicated write of `object` goes: the members of its chain in service (and
    /// not filling) in chain order, then the others not out (syncing, filling: they must
    /// not miss a write while they copy). None when no member is in service: the freshest
    /// copy may be on one that is out.
    pub fn write_chain(&self, object: ObjectId, layout_chain: &[ServerId]) -> Vec<ServerId> {
        let chain = self.chain(object, layout_chain);
        let serving = |member: &ChainMember| {
            !member.filling && self.state(member.server) == MemberState::InService
        };
        let mut members: Vec<ServerId> = chain
            .iter()
            .filter(|member| serving(member))
            .map(|member| member.server)
            .collect();
        if members.is_empty() {
            return members;
        }
        members.extend(
            chain
                .iter()
                .filter(|member| !serving(member) && self.state(member.server) != MemberState::Out)
                .map(|member| member.server),
        );
        members
    }

    /// Which copies of a replicated `object` may serve a read, best first: the members in
    /// service (and not filling) from the tail (it holds only what every member
    /// acknowledged). None when no member is in service.
    pub fn read_chain(&self, object: ObjectId, layout_chain: &[ServerId]) -> Vec<ServerId> {
        self.chain(object, layout_chain)
            .iter()
            .rev()
            .filter(|member| !member.filling && self.state(member.server) == MemberState::InService)
            .map(|member| member.server)
            .collect()
    }

    /// Whether `server` is out and was replaced since it went out: its copies are made
    /// again elsewhere, so nothing waits for it to come back.
    pub fn replaced_while_out(&self, server: ServerId) -> bool {
        self.member(server).is_some_and(|member| {
            member.state == MemberState::Out
                && self.replacements.iter().any(|replacement| {
                    replacement.server == server
                        && !replacement.drain
                        && replacement.made_ms >= member.unsynced_since_ms
                })
        })
    }

    /// The drains of `server` (whole or a share, under way or complete): the objects they
    /// take leave it, so it takes no request for them outside their chains (without a
    /// map version).
    pub fn leaving(&self, server: ServerId) -> Vec<Replacement> {
        self.replacements
            .iter()
            .filter(|replacement| replacement.drain && replacement.server == server)
            .cloned()
            .collect()
    }

    /// Whether requests for `object` of a file with `layout_chain` for this stripe must go
    /// down its chain as the map makes it (with the map version), not straight to the
    /// layout's one server: a stripe with one copy whose server is being drained or was.
    pub fn moved(&self, object: ObjectId, layout_chain: &[ServerId]) -> bool {
        // The common case, on every request of a stripe with one copy: nothing applies.
        let applies = |replacement: &Replacement| {
            (replacement.drain || layout_chain.len() >= 2) && replacement.takes(object)
        };
        if !self.replacements.iter().any(applies) {
            return false;
        }
        let chain = self.chain(object, layout_chain);
        chain.len() != layout_chain.len()
            || chain
                .iter()
                .zip(layout_chain)
                .any(|(member, server)| member.server != *server || member.filling)
    }

    /// The replacements `server` still copies stripes for.
    pub fn filling(&self, server: ServerId) -> impl Iterator<Item = &Replacement> {
        self.replacements
            .iter()
            .filter(move |replacement| replacement.filling.contains(&server))
    }
}

/// Sent to a server that takes the place of a replaced one in some chains, once every
/// server in service holds the map that says so: copy those stripes from the survivors
/// (`ioserver/src/fill.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillOrder {
    /// The map version the order was given under.
    pub map_version: u64,
    /// The most bytes per second the copy may read from the survivors (0: no limit).
    pub bytes_per_second: u64,
}

/// Sent to a server back from being out, once every server in service holds the map that
/// names it syncing: copy from its chain partners what changed in its absence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncOrder {
    /// Copy objects written within this many milliseconds (on the partner's clock);
    /// `u64::MAX` (a server whose data directory is new): every object.
    pub window_ms: u64,
    /// The map version the order was given under.
    pub map_version: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterReply {
    /// How often the I/O server should send `RegisterServer` again.
    pub heartbeat_interval_ms: u32,
    /// Truncation cuts this server still owes after the meta server tried them while
    /// answering: an object of a file that was shrunk while the server could not be
    /// reached. Until a reply says 0, the server serves no data (reads, writes), so no
    /// write lands before a cut that would destroy it and no stale byte is read.
    pub cuts_owed: u32,
    /// The current [`ServiceMap`] version: a server holding another fetches the map.
    pub map_version: u64,
    /// Set while this server is syncing and may copy (see [`ResyncOrder`]).
    pub resync: Option<ResyncOrder>,
    /// Set while this server takes the place of a replaced one and may copy its stripes
    /// (see [`FillOrder`]).
    pub fill: Option<FillOrder>,
    /// How long after sending this registration the server may serve replicated stripes
    /// without hearing from the meta server again: shorter than the silence after which
    /// the meta server puts it out of its chains, so a server cut off from the meta server
    /// stops before its partners go on without it.
    pub lease_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterReport {
    pub servers: Vec<ServerRecord>,
    pub inode_count: u64,
    /// Unlinked inodes whose data is still to be removed.
    pub orphan_count: u64,
    pub ready_ms: u64,
    pub uptime_ms: u64,
    /// `host:port` of the meta server's metrics endpoint (None: off).
    pub meta_metrics_address: Option<String>,
    /// A replicated metadata cluster's members as the leader sees them (empty for a
    /// single server).
    pub meta_members: Vec<MetaMember>,
    /// I/O servers lost for good and who takes their place (as the service map has them).
    pub replacements: Vec<Replacement>,
}

/// One member of a replicated metadata cluster, in a [`ClusterReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaMember {
    pub id: u64,
    /// Where clients reach it.
    pub address: String,
    pub leader: bool,
    /// The Raft term the leader leads in.
    pub term: u64,
    /// Log entries it is behind the leader's last (None: not heard from in this term).
    pub lag_entries: Option<u64>,
    /// The bytes of those entries in the leader's log (None: not known, or purged: it
    /// gets a snapshot).
    pub lag_bytes: Option<u64>,
    /// Milliseconds since it last answered the leader (None: the leader itself, or never
    /// in this leadership).
    pub silent_ms: Option<u64>,
    /// Why the leader's last message to it failed, if it did.
    pub last_error: Option<String>,
    /// A snapshot on its way to it: (bytes sent, bytes in all).
    pub snapshot: Option<(u64, u64)>,
    /// It votes; false: a learner, catching up before it is promoted.
    pub voter: bool,
}

/// A change of an I/O server's place in the cluster (`freeflow server drain|remove`), made
/// by the metadata leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IoServerChange {
    /// Move every stripe off the server, under the writers; new files are placed
    /// elsewhere. Refused when no other server is in service to take them.
    Drain,
    /// Take the server out of the cluster for good. Refused while it holds objects (drain
    /// it first) unless it was lost for good and `force` says its stripes with one copy
    /// may go with it.
    Remove { force: bool },
}

/// A change of the metadata cluster's members (`freeflow meta add|promote|remove|replace`),
/// made by the leader through Raft membership changes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaMemberChange {
    /// A new member as a learner: it is sent the namespace and follows the log, without a
    /// vote. Its id must be new (a member that lost its disk comes back under a new id).
    AddLearner {
        id: u64,
        /// Where clients reach it.
        address: String,
        /// Where the other members reach its Raft service.
        raft_address: String,
        /// The member it is to replace, whose addresses it may take (the same host and
        /// ports with a new disk); any other member's addresses are refused.
        replaces: Option<u64>,
    },
    /// A learner becomes a voter (refused while it is further behind than
    /// `PROMOTE_LAG_ENTRIES_MAX`).
    Promote { id: u64 },
    /// A member leaves (a voter or a learner); the last voter cannot.
    Remove { id: u64 },
    /// The voter `old` leaves and the learner `new` takes its vote, in one change.
    Replace { old: u64, new: u64 },
}

/// Most entries a learner may be behind the leader to be promoted: a voter far behind
/// would slow every commit that needs it.
pub const PROMOTE_LAG_ENTRIES_MAX: u64 = 1_000;

/// The space one stripe object of a file occupies, as its I/O server last reported it
/// (see `io::ObjectSpace`); writers send what they learnt with their size commits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeSpace {
    pub stripe_index: u32,
    pub allocated_bytes: u64,
    pub stamp: u64,
}

/// An open handle of the requesting client, named in a set-attributes that changes the
/// size through it (`ftruncate`): the change is authorised by the handle's write access
/// instead of the caller's permission bits, as POSIX does for a descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandleRef {
    pub session_id: u64,
    pub handle_id: u64,
}

/// In the payload section of every metadata server reply: where the reply stands in the
/// server's history. Mutations are applied and answered before they are durable; a client
/// keeps every mutation answered with `txn > durable_txn` and replays it if the server
/// restarts (a new `epoch`) before it became durable.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyStamp {
    /// The server's boot epoch.
    pub epoch: u64,
    /// The transaction that applied this mutation; 0 for a reply that changed nothing.
    pub txn: u64,
    /// Every transaction up to this one is on stable storage.
    pub durable_txn: u64,
    /// When not 0, what the request read (and a mutation changed) is leased to the client
    /// for this long, measured from when it sent the request: it may cache it until then,
    /// or until a revocation for it arrives (issue 9).
    pub lease_ms: u32,
    /// The server's lease sequence at the grant: a revocation with an id at least this,
    /// received before the reply was used, makes the reply's leased parts stale.
    pub lease_seq: u64,
    /// For a mutation of a client that polls for revocations: the attributes, after it, of
    /// every inode it changed (the parent directory of a create, an unlinked file's link
    /// count), so that the client need not ask for them again; leased with the rest when
    /// `lease_ms` is not 0.
    pub changed: Vec<Attr>,
    /// Whether `changed` lists every inode the mutation changed (false: more changed than
    /// are listed; the client forgets every attribute it kept).
    pub changed_complete: bool,
    /// Directories delegated to this client by this reply (a `Mkdir` of a client that
    /// polls for revocations: the new directory): until its names lease ends or is
    /// revoked, no other client reads or changes its names without first revoking that
    /// lease, and the client answers creates in it before the meta server has them (it
    /// acknowledges the revocation only once they are answered).
    pub delegated: Vec<InodeId>,
}

/// What a client must stop trusting (the reply to `WaitRevocations`): some names of a
/// directory (their entries, positive or negative), all of its names, or an inode's
/// attributes. Acknowledged by the client's next poll, once its caches dropped them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revocation {
    /// Increasing per server; acknowledged in order.
    pub id: u64,
    pub inode: InodeId,
    /// Names of directory `inode` that changed.
    pub names: Vec<String>,
    /// The attributes of `inode` changed.
    pub attributes: bool,
    /// Every name of directory `inode` (too many changed to list).
    pub whole_directory: bool,
}

/// Whether requests of this opcode change the namespace: those are applied once per
/// (client id, request id), answered before they are durable, and kept by their client until
/// a reply shows them durable (see [`ReplyStamp`]).
pub fn is_mutation(opcode: u16) -> bool {
    use crate::Request;
    matches!(
        opcode,
        SetAttributes::OPCODE
            | Create::OPCODE
            | Mkdir::OPCODE
            | Unlink::OPCODE
            | Rmdir::OPCODE
            | Rename::OPCODE
            | Link::OPCODE
            | Symlink::OPCODE
            | SetXattr::OPCODE
            | RemoveXattr::OPCODE
            | CommitSize::OPCODE
            | SetDirLayout::OPCODE
    )
}

/// The payload of a request sent with `FLAG_REPLAY`: what the client was told the first
/// time, so a create is replayed under the inode id the client already knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayOf {
    pub epoch: u64,
    pub txn: u64,
    /// The reply's header section as it was received (`Result<Reply, WireError>`).
    pub reply: Vec<u8>,
}

requests! {
    /// Start a client session; open handles belong to it and end with it.
    OpenSession = 100 => SessionGrant { client_name: String }
    RenewSession = 101 => () { session_id: u64 }
    CloseSession = 102 => () { session_id: u64 }
    Lookup = 110 => Attr { caller: Caller, parent: InodeId, name: String }
    GetAttr = 111 => Attr { inode: InodeId }
    SetAttributes = 112 => Attr {
        caller: Caller,
        inode: InodeId,
        changes: SetAttr,
        /// Set when the size is changed through this open handle (see [`HandleRef`]).
        through_handle: Option<HandleRef>,
    }
    /// Create a regular file, fifo, socket or device node. Not for directories or symlinks.
    Create = 113 => CreateReply {
        caller: Caller,
        parent: InodeId,
        name: String,
        kind: FileKind,
        permissions: u32,
        device: u64,
        /// Fail with `Exists` if the name exists (O_EXCL); otherwise an existing regular
        /// file is returned with `created: false`.
        exclusive: bool,
        /// Also open the new file for this session with this access.
        open: Option<(u64, OpenAccess)>,
        /// The inode number the new file must get: one this client reserved with
        /// `ReserveInodes` (an answer it gave before sending, see `ReserveInodes`).
        inode: Option<InodeId>,
    }
    Mkdir = 114 => Attr { caller: Caller, parent: InodeId, name: String, permissions: u32 }
    Unlink = 115 => () { caller: Caller, parent: InodeId, name: String }
    Rmdir = 116 => () { caller: Caller, parent: InodeId, name: String }
    Rename = 117 => () {
        caller: Caller,
        source_parent: InodeId,
        source_name: String,
        target_parent: InodeId,
        target_name: String,
        mode: RenameMode,
    }
    Link = 118 => Attr { caller: Caller, inode: InodeId, target_parent: InodeId, target_name: String }
    Symlink = 119 => Attr { caller: Caller, parent: InodeId, name: String, target: String }
    ReadLink = 120 => String { inode: InodeId }
    ReadDir = 121 => DirPage {
        caller: Caller,
        inode: InodeId,
        /// Resume after this name (None: from the start).
        after: Option<String>,
        limit: u32,
        with_attributes: bool,
    }
    StatFs = 122 => FsStats {}
    SetXattr = 123 => () { caller: Caller, inode: InodeId, name: String, value: Vec<u8>, mode: XattrSetMode }
    GetXattr = 124 => Vec<u8> { caller: Caller, inode: InodeId, name: String }
    ListXattr = 125 => Vec<String> { caller: Caller, inode: InodeId }
    RemoveXattr = 126 => () { caller: Caller, inode: InodeId, name: String }
    Open = 127 => OpenGrant { caller: Caller, session_id: u64, inode: InodeId, access: OpenAccess }
    Close = 128 => () { session_id: u64, handle_id: u64 }
    /// Grow the size to at least `size_bytes` (never shrinks) and set the mtime: how
    /// writers commit what they wrote. `space` carries the stripes' allocation as the
    /// writer's I/O servers reported it; a report older (by stamp) than the one kept is
    /// ignored.
    CommitSize = 129 => Attr {
        inode: InodeId,
        size_bytes: u64,
        modify_time: TimeSpec,
        space: Vec<StripeSpace>,
        /// Reply only once this commit (and everything before it) is durable: the size
        /// commit that ends an fsync.
        durable: bool,
    }
    /// Set the layout new files in a directory inherit.
    SetDirLayout = 130 => Attr { caller: Caller, inode: InodeId, stripe_unit_bytes: Option<u32>, stripe_count: Option<u32>, replicas: Option<u32> }
    ListServers = 131 => Vec<ServerRecord> {}
    /// Sent by an I/O server at start and then as its heartbeat.
    RegisterServer = 132 => RegisterReply {
        server_id: ServerId,
        address: String,
        capacity_bytes: u64,
        free_bytes: u64,
        object_count: u64,
        /// `host:port` of the server's metrics endpoint for `freeflow top` (None: off).
        metrics_address: Option<String>,
        /// Random per start of the server process (see [`Member::incarnation`]).
        incarnation: u64,
        /// The [`ServiceMap`] version the server holds.
        map_version: u64,
        /// Its data directory was created by this start: it holds no object at all.
        fresh: bool,
        /// The map version under which it last removed the copies a complete drain (or a
        /// rebalance's share) of it gave up (0: never): a rebalance waits for it, since
        /// the disk's usage tells the truth only after.
        cleaned_version: u64,
    }
    ClusterStatus = 133 => ClusterReport {}
    /// Make every change applied so far durable before replying (fsync of a directory,
    /// syncfs, a client whose kept mutations reach their bound).
    Sync = 134 => () {}
    /// This client has replayed every mutation it kept from before the server's restart:
    /// the server need not wait for it any longer before serving new requests.
    ReplayDone = 135 => () {}
    /// A client's poll for revocations (issue 9): acknowledges every revocation up to
    /// `acknowledged`, then returns those queued for it, waiting up to `wait_ms` for some.
    /// Polling makes the client lease-capable: its reads are leased to it from then on.
    WaitRevocations = 136 => Vec<Revocation> { acknowledged: u64, wait_ms: u32 }
    /// A lookup that answers a missing name with `None` instead of an error, so that the
    /// answer can carry a lease (a cached negative entry).
    LookupEntry = 137 => Option<Attr> { caller: Caller, parent: InodeId, name: String }
    /// Set or release a byte-range lock of `owner` (the kernel's lock owner on this client)
    /// within the session: `WouldBlock` when another owner's lock conflicts, after waiting
    /// up to `wait_ms` for it to go (0: fail at once).
    SetLock = 138 => () {
        session_id: u64,
        inode: InodeId,
        owner: u64,
        /// The process asking, reported to others' `GetLock`.
        pid: u32,
        /// None: unlock the range (and end the owner's own requests still waiting).
        kind: Option<LockKind>,
        start: u64,
        /// Inclusive; `u64::MAX`: to the end of the file.
        end: u64,
        wait_ms: u32,
        /// A lock the client held before the server restarted, taken again during the
        /// recovery window (before any new lock is granted).
        reclaim: bool,
    }
    /// The first lock of another owner that would conflict with this one (`F_GETLK`).
    GetLock = 139 => Option<LockConflict> {
        session_id: u64,
        inode: InodeId,
        owner: u64,
        kind: LockKind,
        start: u64,
        end: u64,
    }
    /// Close several handles of one session at once (closes nobody waits for, gathered by
    /// the client: the mount's releases). At most `CLOSE_HANDLES_MAX` ids. Replies with
    /// the ids that were not open in the session (already gone with a restart); the others
    /// are closed whatever happens to those.
    CloseHandles = 140 => Vec<u64> { session_id: u64, handle_ids: Vec<u64> }
    /// Reserve `count` inode numbers (at most `INODE_RESERVE_MAX`) for this client's
    /// creates with a chosen inode: a mount answers a create in a directory delegated to it
    /// before the meta server has the file, so it must know the number already. Reserved
    /// numbers are never given to anyone else; they are good for creates until this server
    /// restarts (replays of creates answered before keep theirs).
    ReserveInodes = 141 => InodeRange { count: u32 }
    /// What the meta server knows of each of `inodes` (at most [`INSPECT_INODES_MAX`]), for
    /// `freeflow fsck`: it compares them with the objects the I/O servers hold.
    InspectInodes = 142 => Vec<InodeFacts> { inodes: Vec<InodeId> }
    /// The I/O servers' states in the chains of replicated files.
    GetServiceMap = 143 => ServiceMap {}
    /// Sent by a syncing I/O server that copied everything its order asked for: it is put
    /// back in service (its order must be of the current map version).
    ResyncDone = 144 => () { server_id: ServerId, map_version: u64 }
    /// After a restart or a change of leader (a new epoch), a client's session and open
    /// handles taken again inside the recovery window, under their old ids: the session is
    /// made again if this server does not hold it (ids issued before this server started
    /// are never issued again), and each handle counts its file open again, so an unlinked
    /// file a client still has open keeps its data. At most [`RECLAIM_HANDLES_MAX`] handles
    /// per request. Replies with the handles that could not be taken again (their file is
    /// gone, or was unlinked and may be reaped already); the others are held.
    ReclaimSession = 145 => Vec<u64> {
        session_id: u64,
        client_name: String,
        handles: Vec<ReclaimedHandle>,
    }
    /// A lease-capable client's renewal of every lease it holds (issue 9): a lease still
    /// good when the server takes this is kept for another `lease_ms` from now, up to
    /// [`LEASE_RENEWAL_SPAN_MS`] after its grant (see [`LeasesRenewed`]). Sent at a
    /// fraction of the lease, so a warm cache outlives one lease while the client lives.
    RenewLeases = 146 => LeasesRenewed {}
    /// Change the metadata cluster's members (leader only); replies with the members after
    /// the change is committed.
    ChangeMetaMembers = 147 => Vec<MetaMember> { change: MetaMemberChange }
    /// Sent by an I/O server that copied every stripe it takes for these replacements
    /// (each named by its server and `made_ms`, as in the map of its order, given under
    /// `map_version`): it serves reads of them from then on. Named rather than by map
    /// version, so a fill ordered by one metadata leader counts with the next.
    FillDone = 148 => () { server_id: ServerId, map_version: u64, replacements: Vec<(ServerId, u64)> }
    /// Drain or remove an I/O server (leader only); replies with the servers after the
    /// change is durable.
    ChangeIoServer = 149 => Vec<ServerRecord> { server_id: ServerId, change: IoServerChange }
}

/// How long after its grant a lease can be kept by renewals ([`RenewLeases`]); past it the
/// client asks again. Bounds what a client holds to what it read within this time.
pub const LEASE_RENEWAL_SPAN_MS: u64 = 60_000;

/// The reply to [`RenewLeases`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeasesRenewed {
    /// The server's boot epoch: a renewal holds only for leases of this epoch.
    pub epoch: u64,
    /// False: nothing renewed (the client does not poll for revocations, or it fell too
    /// far behind with them); its leases end on their own time.
    pub renewed: bool,
    /// The length of the renewal, from when the client sent the request.
    pub lease_ms: u32,
    /// The newest revocation queued to this client when the renewal was taken: the client
    /// may count on the renewal only once it has handled every revocation up to this one
    /// (a revoked lease is not renewed, and the client must drop what it covers first).
    pub revocations_through: u64,
}

/// Most handles one `ReclaimSession` carries.
pub const RECLAIM_HANDLES_MAX: usize = 4096;

/// One open handle of a session being reclaimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimedHandle {
    pub handle_id: u64,
    pub inode: InodeId,
    pub access: OpenAccess,
}

/// Most inodes one `InspectInodes` asks about.
pub const INSPECT_INODES_MAX: usize = 4096;

/// One inode as `freeflow fsck` needs it (the reply to `InspectInodes`, in request order).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeFacts {
    pub inode: InodeId,
    /// None: no inode of that number exists.
    pub kind: Option<FileKind>,
    pub size_bytes: u64,
    /// Where a regular file's data lives.
    pub layout: Option<Layout>,
    /// Unlinked and waiting for the reaper to remove its data from these servers.
    pub orphan: Option<Layout>,
    /// A shrink whose cuts are not all made yet: (stripe index, size to cut it at).
    pub pending_cuts: Vec<(u32, u64)>,
    /// Some client has it open for writing: its objects may run past the size until the
    /// writer commits it.
    pub open_for_writing: bool,
    /// The number is at or past the lowest one the server has not given out or reserved
    /// for a create answered ahead (such a file may still be on its way).
    pub not_yet_allocated: bool,
}

/// Inode numbers reserved for one client: `first` up to, not including, `first + count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeRange {
    pub first: InodeId,
    pub count: u32,
}

/// A lock that stands in the way (the reply to `GetLock`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockConflict {
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
    /// The process that holds it, on its own client.
    pub pid: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(server_id: ServerId, state: MemberState) -> Member {
        Member {
            server_id,
            address: String::new(),
            state,
            incarnation: 1,
            unsynced_since_ms: if state == MemberState::InService {
                0
            } else {
                5
            },
        }
    }

    fn object(inode: InodeId, stripe_index: u32) -> ObjectId {
        ObjectId {
            inode,
            stripe_index,
        }
    }

    #[test]
    fn a_replaced_server_gives_its_place_to_a_candidate_not_in_the_chain() {
        let mut map = ServiceMap {
            version: 7,
            members: vec![
                member(1, MemberState::Out),
                member(2, MemberState::InService),
                member(3, MemberState::InService),
                member(4, MemberState::InService),
            ],
            replacements: Vec::new(),
        };
        let o = object(10, 0);
        // Out and not replaced: left out of writes and reads only.
        assert_eq!(map.write_chain(o, &[1, 2]), vec![2]);
        assert_eq!(map.chain(o, &[1, 2]).len(), 2);
        map.replacements.push(Replacement {
            server: 1,
            inodes_below: 100,
            by: vec![2, 3],
            filling: vec![3],
            made_ms: 10,
            drain: false,
            complete: false,
            share_ppm: SHARE_ALL,
        });
        assert!(map.replaced_while_out(1));
        // Server 2 is in the chain already: server 3 takes the place, filling.
        let chain = map.chain(o, &[1, 2]);
        assert_eq!(
            chain,
            vec![
                ChainMember {
                    server: 3,
                    filling: true
                },
                ChainMember {
                    server: 2,
                    filling: false
                }
            ]
        );
        assert_eq!(map.write_chain(o, &[1, 2]), vec![2, 3]);
        assert_eq!(map.read_chain(o, &[1, 2]), vec![2]);
        // Filled: it serves reads, from the tail.
        map.replacements[0].filling.clear();
        assert_eq!(map.write_chain(o, &[1, 2]), vec![3, 2]);
        assert_eq!(map.read_chain(o, &[1, 2]), vec![2, 3]);
        // Files made after the replacement, and stripes with one copy, keep their server.
        assert_eq!(map.chain(object(100, 0), &[1, 2])[0].server, 1);
        assert_eq!(map.chain(o, &[1])[0].server, 1);
        // No candidate left: the slot is dropped.
        assert_eq!(map.write_chain(o, &[1, 2, 3]), vec![2, 3]);
        // A stand-in replaced in turn takes another.
        map.replacements.push(Replacement {
            server: 3,
            inodes_below: 200,
            by: vec![2, 4],
            filling: vec![4],
            made_ms: 20,
            drain: false,
            complete: false,
            share_ppm: SHARE_ALL,
        });
        assert_eq!(map.write_chain(o, &[1, 2]), vec![2, 4]);
        assert_eq!(map.filling(4).count(), 1);
    }

    fn replacements() -> impl Strategy<Value = Vec<Replacement>> {
        proptest::collection::vec(
            (
                1u32..=8,
                1u64..40,
                proptest::collection::vec(1u32..=8, 0..6),
                proptest::collection::vec(1u32..=8, 0..3),
                proptest::bool::weighted(0.3),
                any::<bool>(),
                prop_oneof![Just(SHARE_ALL), 0..SHARE_ALL],
            )
                .prop_map(
                    |(server, inodes_below, by, filling, drain, complete, share_ppm)| {
                        Replacement {
                            server,
                            inodes_below,
                            complete: complete && filling.is_empty(),
                            by,
                            filling,
                            made_ms: 1,
                            drain,
                            // Only drains take a share (a rebalance).
                            share_ppm: if drain { share_ppm } else { SHARE_ALL },
                        }
                    },
                ),
            0..6,
        )
    }

    #[test]
    fn a_drained_server_keeps_its_place_until_its_stand_ins_are_done() {
        let mut map = ServiceMap {
            version: 7,
            members: vec![
                member(1, MemberState::InService),
                member(2, MemberState::InService),
                member(3, MemberState::InService),
            ],
            replacements: vec![Replacement {
                server: 1,
                inodes_below: 100,
                by: vec![2, 3],
                filling: vec![2, 3],
                made_ms: 10,
                drain: true,
                complete: false,
                share_ppm: SHARE_ALL,
            }],
        };
        let o = object(10, 0);
        // Filling: server 1 reads and writes, its stand-in only takes the writes; one copy
        // files too (a drain takes them all).
        let stand_in = map.chain(o, &[1])[1].server;
        assert_eq!(map.write_chain(o, &[1]), vec![1, stand_in]);
        assert_eq!(map.read_chain(o, &[1]), vec![1]);
        assert!(map.moved(o, &[1]) && !map.moved(object(100, 0), &[1]));
        assert_eq!(map.leaving(1).len(), 1);
        assert!(!map.replaced_while_out(1));
        // One stand-in done, the other not: nothing changes yet.
        map.replacements[0].filling = vec![3];
        assert_eq!(map.read_chain(o, &[1]), vec![1]);
        // Sealed: the stand-in serves, server 1 only takes writes.
        map.replacements[0].filling.clear();
        assert_eq!(map.write_chain(o, &[1]), vec![stand_in, 1]);
        assert_eq!(map.read_chain(o, &[1]), vec![stand_in]);
        // Complete: the stand-in alone.
        map.replacements[0].complete = true;
        assert_eq!(map.write_chain(o, &[1]), vec![stand_in]);
        assert!(map.moved(o, &[1]));
        // A two-copy chain whose other member is the only candidate keeps server 1.
        assert_eq!(map.write_chain(o, &[1, 2, 3]), vec![1, 2, 3]);
    }

    proptest! {
        /// Whatever the replacements: a chain never names a server twice, never more
        /// members than the layout's, never a replaced server for the stripes it gave up;
        /// and a newer replacement changes only the slots held by the server it replaces,
        /// so stand-ins that copied a stripe keep it.
        #[test]
        fn chains_are_stable_under_newer_replacements(
            replacements in replacements(),
            inode in 1u64..40,
            stripe in 0u32..4,
            layout_chain in proptest::sample::subsequence((1u32..=8).collect::<Vec<_>>(), 1..=3),
        ) {
            let o = object(inode, stripe);
            let mut map = ServiceMap::default();
            let mut before = map.chain(o, &layout_chain);
            prop_assert_eq!(before.len(), layout_chain.len());
            let mut drains = 0;
            for replacement in replacements {
                let replaced = replacement.server;
                let drain = replacement.drain;
                let applies = replacement.takes(o) && (drain || layout_chain.len() >= 2);
                drains += usize::from(applies && drain);
                map.replacements.push(replacement);
                let after = map.chain(o, &layout_chain);
                prop_assert!(after.len() <= layout_chain.len() + drains);
                for (index, member) in after.iter().enumerate() {
                    prop_assert!(!after[..index].iter().any(|other| other.server == member.server));
                }
                if applies && !drain {
                    prop_assert!(!after.iter().any(|member| member.server == replaced));
                }
                if drain {
                    // A drain never takes a copy away without a stand-in for it.
                    prop_assert!(after.len() >= before.len());
                }
                // Every member of the old chain not replaced now is still there.
                for member in &before {
                    if member.server != replaced || !applies {
                        prop_assert!(after.iter().any(|kept| kept.server == member.server));
                    }
                }
                before = after;
            }
        }
    }
}
