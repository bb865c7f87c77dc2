//! Requests served by the I/O servers (opcodes 200-299). Data travels in the payload.

use freeflow_types::{InodeId, ObjectId, ServerId};
use serde::{Deserialize, Serialize};

use crate::requests;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadReply {
    /// Bytes in the payload; fewer than asked when the object ends first. The reader
    /// treats the rest as a hole (zeros) up to the file size it knows from the meta server.
    pub length: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoStats {
    pub server_id: ServerId,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub object_count: u64,
    /// "io_uring" or "threads".
    pub engine: String,
}

/// What an object occupies on its server's disk after a change, with a stamp that orders
/// the reports of one server: of two reports about one object, the one with the larger
/// stamp is the newer. Stamps are strictly increasing per server (nanoseconds of the wall
/// clock, bumped past the last one given), so they also order reports across restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectSpace {
    /// `st_blocks × 512` of the object: data and preallocated blocks, holes excluded.
    pub allocated_bytes: u64,
    pub stamp: u64,
}

/// What an `AllocateObject` does to the range (Linux `fallocate(2)` modes, always with
/// `FALLOC_FL_KEEP_SIZE` on the object: an object's length is not the file's size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocateMode {
    /// Reserve blocks for the range; data already there is kept.
    Allocate,
    /// Free the blocks of the range: it reads as zeros.
    PunchHole,
    /// Make the range read as zeros, keeping blocks allocated.
    ZeroRange,
}

requests! {
    /// Write the payload at `offset` of the object, creating the object if needed. For a
    /// replicated stripe (`map_version` not 0) the server takes it only under that service
    /// map version, and passes it on to `forward[0]` with the rest of `forward`; the reply
    /// comes once every server of the chain wrote it.
    ///
    /// `grant` names the writer's space grant here (see `ReserveSpace`; 0: none) and
    /// `charged` the bytes of it this write uses (what it adds to the file, as the client
    /// counted when it acknowledged the write): taken from the grant as the write is let in.
    /// A write without a grant may only use the space no grant holds (else `NoSpace`); a
    /// write with one is refused only when the file system itself has no room for what
    /// its grant no longer covers. A chain passes both on, each server taking from its own
    /// grant of that id.
    WriteObject = 200 => ObjectSpace { object: ObjectId, offset: u64, map_version: u64, forward: Vec<ServerId>, grant: u64, charged: u64 }
    /// Read up to `length` bytes at `offset`; the data comes back in the reply payload.
    /// For a replicated stripe (`map_version` not 0) the server serves it only while its
    /// lease from the meta server holds: one cut off from the meta server stops serving
    /// such reads before it can be put out of its chains, so no stale copy is read.
    ReadObject = 201 => ReadReply { object: ObjectId, offset: u64, length: u32, map_version: u64 }
    /// Cut the object to `length` bytes if it is longer. Never extends an object and never
    /// creates one: a file's size lives at the meta server, and bytes past an object's end
    /// read as zeros.
    ///
    /// With `forward` (a replicated stripe, sent by the meta server), the server cuts under
    /// the range lock of the cut bytes and passes the cut on to `forward[0]` before it
    /// releases it, so an overlapping write is on the same side of the cut on every copy; a
    /// partner's failure comes back as `Unreachable` (this server did cut).
    TruncateObject = 202 => ObjectSpace { object: ObjectId, length: u64, forward: Vec<ServerId> }
    /// Make every byte written to these objects durable (fdatasync).
    SyncObjects = 203 => () { objects: Vec<ObjectId> }
    /// Remove the objects of these stripes of an inode; missing objects are not an error.
    RemoveObjects = 204 => () { inode: InodeId, stripes: Vec<u32> }
    ServerStats = 205 => IoStats {}
    /// `fallocate` of `length` bytes at `offset` of the object (see [`AllocateMode`]).
    /// Allocating creates the object; punching or zeroing a missing object does nothing.
    /// Replicated stripes are passed down their chain as `WriteObject` is.
    AllocateObject = 206 => ObjectSpace { object: ObjectId, offset: u64, length: u64, mode: AllocateMode, map_version: u64, forward: Vec<ServerId> }
    /// Make `length` bytes at `target_offset` of `target` equal those at `source_offset` of
    /// `source` (both objects on this server), without the data leaving the server. Bytes
    /// past the end of the source read as zeros, so they become zeros (a hole) in the
    /// target. The space reported is the target's.
    CopyObjectRange = 207 => ObjectSpace {
        source: ObjectId,
        source_offset: u64,
        target: ObjectId,
        target_offset: u64,
        length: u32,
    }
    /// The objects of shard directory `shard` (0..256) that sort after `after`, at most
    /// `limit` (up to [`LIST_OBJECTS_MAX`]), in order, for `freeflow fsck`.
    ListObjects = 208 => ObjectListing { shard: u32, after: Option<ObjectId>, limit: u32 }
    /// Remove one object whose inode's other objects stay writable here (unlike
    /// `RemoveObjects`, which also refuses later writes to the inode): `freeflow fsck`'s
    /// repair of an object outside its file's layout. A missing object is not an error.
    RemoveObject = 209 => () { object: ObjectId }
    /// Space reservation (a capacity grant, seed 000's fastwrite): a writing client holds
    /// bytes of this server's free space under a grant id of its own, so it can tell a
    /// writer there is no room at the write itself, before acknowledging it, and never
    /// after. Gives back `give_back` bytes of the grant, then adds at least `need` bytes
    /// (or fails with `NoSpace`, adding none) and up to `want` if there is room. A grant
    /// not used for [`GRANT_IDLE_MS`] lapses (sooner, [`GRANT_RECLAIM_MS`], when another
    /// writer is short of space); its holder stops counting on it after
    /// [`GRANT_TRUST_MS`] without a request that used it.
    ReserveSpace = 210 => SpaceGrant { grant: u64, give_back: u64, need: u64, want: u64 }
}

/// The `map_version` of a `ReadObject` made by a server copying an object for a resync
/// or a fill: served whatever map the server holds and without its lease, and also for
/// objects being drained from it (the copier works under its own order's map). Map
/// versions count microseconds from the Unix epoch and never reach it.
pub const MAP_VERSION_COPY: u64 = u64::MAX;

/// A grant unused this long lapses at its server.
pub const GRANT_IDLE_MS: u64 = 30_000;
/// A grant unused this long is taken back when another writer's `need` does not fit.
pub const GRANT_RECLAIM_MS: u64 = 2_000;
/// How long a client counts on a grant after sending the last request that used it (less
/// than [`GRANT_RECLAIM_MS`]: the server measures from the request's arrival, later).
pub const GRANT_TRUST_MS: u64 = 1_000;

/// The reply to `ReserveSpace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpaceGrant {
    /// Bytes added to the grant by this request.
    pub added: u64,
    /// Bytes the grant holds now.
    pub held: u64,
}

/// Most objects one `ListObjects` returns.
pub const LIST_OBJECTS_MAX: u32 = 4096;

/// One object as its I/O server holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedObject {
    pub object: ObjectId,
    /// Its length in bytes (`st_size`).
    pub length: u64,
    /// How long ago it was last written, on the server's clock (ms).
    pub age_ms: u64,
}

/// The reply to `ListObjects`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectListing {
    pub objects: Vec<ListedObject>,
    /// More objects of the shard follow the last one.
    pub more: bool,
}

/// A packet a client sends on an I/O server's local socket (`freeflow_rpc::local`; not an
/// RPC, no opcode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LocalRequest {
    /// Asks for a read-only descriptor of an object (local reads).
    Open(OpenForReading),
    /// Shares a region of memory for write payloads (`ShareRegion`).
    ShareRegion(ShareRegion),
    /// Asks, on the connection that shared a region, to be told once the server can no
    /// longer read it (`ReleaseRegion`).
    ReleaseRegion(ReleaseRegion),
}

/// A client on the server's host asks for a read-only descriptor of an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenForReading {
    /// [`crate::PROTOCOL_VERSION`] of the asking client; another is refused.
    pub version: u8,
    pub object: ObjectId,
}

/// The answer to [`OpenForReading`], as `Result<OpenedForReading, WireError>`; when
/// `exists`, the object's descriptor travels with the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenedForReading {
    /// The object asked about (a client checks it is the one it asked about).
    pub object: ObjectId,
    /// Whether the object exists (a missing one reads as zeros; it may be made later).
    pub exists: bool,
}

/// A client on the server's host shares a sealed memory file (its descriptor travels with
/// the packet) that the payloads of its writes on one RPC connection are then placed in
/// (`freeflow_proto::frame::FLAG_SHARED_PAYLOAD`). The region stays registered until the
/// client closes the local connection it came on or releases the region there
/// ([`ReleaseRegion`]); that connection carries nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareRegion {
    /// [`crate::PROTOCOL_VERSION`] of the asking client; another is refused.
    pub version: u8,
}

/// A client done with a region it shared asks the server to forget it and to answer
/// (`Result<RegionReleased, WireError>`) once no request of the server still holds a view
/// of it: from then on the server cannot read the region, so the client may reuse places
/// whose requests ended without a reply. The only packet the region's connection carries
/// after [`ShareRegion`]; the server closes the connection after its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRegion {
    /// The region's name ([`RegionShared::region`]).
    pub region: u64,
}

/// The answer to [`ReleaseRegion`]: the region is unmapped at the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionReleased {
    pub region: u64,
}

/// The answer to [`ShareRegion`], as `Result<RegionShared, WireError>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionShared {
    /// The name frames give the region: chosen at random by the server, known only to it
    /// and the client that shared the region.
    pub region: u64,
}
