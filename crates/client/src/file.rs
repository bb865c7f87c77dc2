//! Open files: the data path (DESIGN.md §4-6).
//!
//! A write is cut into object requests ([`crate::plan`]) that are all sent at once, each on a
//! spawned task, and `write_at` returns as soon as they are in flight (write-behind). Their
//! payloads are slices of the caller's buffer, never copies. Small writes are the exception:
//! one shorter than [`GATHER_WRITE_MAX`] is copied into the handle's gathering buffer, which
//! adjacent small writes join (the mount's session threads append to it directly,
//! `write_gathered`), and which goes out as one write at most `gather_wait_ms` later, or as
//! soon as anything must see it (every path that waits for earlier writes sends it first).
//! A large write whose first or last piece covers only part of a stripe unit *parks* that
//! piece (acknowledged, not sent) until the rest of the unit comes, so the servers get
//! whole, aligned units (`write_in_units`); parked pieces follow the same rules as gathered
//! bytes, and a small write sends them all before it gathers. The bytes in flight over the
//! whole client are bounded by a semaphore of `dirty_bytes_max` bytes: a writer past it waits.
//! The first failure of a write is kept on the handle and returned by every later write,
//! flush, fsync and close (it is never lost, and the handle stays failed: the data is gone).
//!
//! Order: requests to one server are pipelined and may complete in any order, so a write that
//! overlaps one still in flight on the same handle waits for it first; otherwise a later write
//! could be overtaken by an earlier one. Reads wait for the handle's own writes in flight, so
//! a handle always reads what it wrote.
//!
//! Waiting: each `write_at` gets a sequence number. `flush`, `fsync` and a truncating
//! `setattr` wait only for the writes that started before they did, so a writer that keeps
//! the handle busy cannot hold them up forever; `close` waits for all (no write can start
//! after it).
//!
//! Size: the handle keeps the highest end acknowledged by the servers and commits it to the
//! meta server (`CommitSize`, a maximum there) on flush, fsync and close, and in the
//! background when `size_commit_interval_ms` has passed since the last commit. A commit
//! computed before a truncation must not land after it (it would grow the file back): a
//! truncation first stops new commits, bumps the handle's truncate epoch and waits for the
//! commits already sent; a reply to a commit of an older epoch is dropped.
//!
//! Durability: a stripe joins the handle's unsynced set when a write to it is acknowledged,
//! never earlier; `fsync` takes the set under the same lock that sees its writes done, so
//! every write acknowledged before its wait ended is in the set it syncs (`SyncObjects` on
//! each server, in parallel), and then commits the size: when it returns, the data and the
//! size survive a crash of any server.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

use bytes::{Bytes, BytesMut};
use freeflow_proto::io::{
    AllocateMode, AllocateObject, CopyObjectRange, ObjectSpace, ReadObject, SyncObjects,
    WriteObject,
};
use freeflow_proto::meta::{Close, CommitSize, GetAttr, HandleRef, OpenAccess, StripeSpace};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{ALLOCATE_BYTES_MAX, FILE_SIZE_MAX, IO_REQUEST_BYTES_MAX};
use freeflow_types::{Attr, FileKind, InodeId, Layout, ObjectId, SetAttr, TimeSpec};
use futures::StreamExt;
use tokio::sync::{watch, OwnedSemaphorePermit};

use crate::plan::{plan_requests, ObjectRequest};
use crate::readahead::{Fetched, Piece, ReadAhead, Segments};
use crate::{Client, ClientError};

/// Largest single `read_at`, after clamping to the file size: the bound on the buffer one
/// read allocates.
pub const READ_LENGTH_MAX: u64 = 256 << 20;

/// Writes shorter than this are gathered: a write that starts where the gathered ones end
/// joins them; the gathered bytes go out as one request when a write that cannot join
/// comes, when anything must see them (a read, flush, fsync, close, truncation, fallocate,
/// copy, or another client's recall), or `gather_wait_ms` (client config) after gathering
/// started.
pub const GATHER_WRITE_MAX: usize = 128 << 10;
/// Most bytes gathered before they are sent.
pub const GATHER_BYTES_MAX: usize = 1 << 20;
/// Room first made for gathering (it grows up to `GATHER_BYTES_MAX`).
const GATHER_CAPACITY_START: usize = 64 << 10;

/// Most bytes of large writes parked at once, waiting for the rest of their stripe unit
/// (see [`HandleState::parked`]). Units longer than half of it are never parked.
pub const PARKED_BYTES_MAX: usize = 8 << 20;

/// Most bytes one `copy_range_from` copies; callers loop, as with `copy_file_range(2)`.
pub const COPY_LENGTH_MAX: u64 = 1 << 30;

/// Pieces of one copy in flight at once (each at most one request long).
const COPY_PIECES_IN_FLIGHT_MAX: usize = 16;

/// How [`FileHandle::allocate`] changes a range (the `fallocate(2)` modes Freeflow keeps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Reserve blocks (mode 0; `FALLOC_FL_KEEP_SIZE` with `keep_size`).
    Allocate { keep_size: bool },
    /// Free the range's blocks; it reads as zeros, and the size never changes
    /// (`FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`).
    PunchHole,
    /// Make the range read as zeros (`FALLOC_FL_ZERO_RANGE`).
    ZeroRange { keep_size: bool },
}

/// One piece of a copy: the same bytes as a request on the source and on the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CopyPiece {
    source: ObjectRequest,
    target: ObjectRequest,
}

/// Cut a copy into pieces that each lie inside one object of the source and one of the
/// target, merging neighbours that are contiguous in both objects (up to one request).
fn plan_copy(
    source_layout: &Layout,
    source_offset: u64,
    target_layout: &Layout,
    target_offset: u64,
    length: u64,
) -> Vec<CopyPiece> {
    let mut pieces: Vec<CopyPiece> = Vec::new();
    let mut done = 0u64;
    while done < length {
        let (source_stripe, source_object) = source_layout.locate(source_offset + done);
        let (target_stripe, target_object) = target_layout.locate(target_offset + done);
        let source_unit = u64::from(source_layout.stripe_unit_bytes);
        let target_unit = u64::from(target_layout.stripe_unit_bytes);
        let piece = (length - done)
            .min(source_unit - source_object % source_unit)
            .min(target_unit - target_object % target_unit);
        let source = ObjectRequest {
            stripe_index: source_stripe,
            object_offset: source_object,
            file_offset: source_offset + done,
            length: piece,
        };
        let target = ObjectRequest {
            stripe_index: target_stripe,
            object_offset: target_object,
            file_offset: target_offset + done,
            length: piece,
        };
        match pieces.last_mut() {
            Some(last)
                if last.source.stripe_index == source_stripe
                    && last.target.stripe_index == target_stripe
                    && last.source.object_end() == source_object
                    && last.target.object_end() == target_object
                    && last.source.file_end() == source.file_offset
                    && last.source.length + piece <= u64::from(IO_REQUEST_BYTES_MAX) =>
            {
                last.source.length += piece;
                last.target.length += piece;
            }
            _ => pieces.push(CopyPiece { source, target }),
        }
        done += piece;
    }
    pieces
}

/// The wall clock as a `TimeSpec` (mtime of writes).
pub(crate) fn now() -> TimeSpec {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    TimeSpec::new(since_epoch.as_secs() as i64, since_epoch.subsec_nanos())
}

/// An open file. Methods take `&self`, so the mount can share one through an `Arc`; the
/// writes of one handle are ordered as described in the module doc.
pub struct FileHandle {
    shared: Arc<HandleShared>,
}

pub(crate) struct HandleShared {
    client: Client,
    inode: InodeId,
    handle_id: u64,
    session_id: u64,
    /// The meta server epoch the handle was opened under: a restart since ended it.
    opened_epoch: u64,
    /// The epoch its session was granted under (0: not known), which the open's reply
    /// may have come after (a create answered from its record by a newer leader).
    session_epoch: u64,
    access: OpenAccess,
    /// The layout of a regular file; None for other kinds (which cannot be read or written).
    layout: Option<Layout>,
    state: Mutex<HandleState>,
    /// Bumped after each write completes; tasks waiting on in-flight writes re-check then.
    completions: watch::Sender<u64>,
    /// The turn to send: held from deciding what a write does (gather, or send what is
    /// gathered and then itself) until its requests are in flight, so that writes go out
    /// in call order, and by everything that must see every earlier write in flight (reads,
    /// flushes, truncations, recalls, close). See [`SendTurn`].
    send_order: Arc<tokio::sync::Mutex<()>>,
    closed: AtomicBool,
    /// The meta server did not take this handle back after a restart or a change of
    /// leader (its file was gone): I/O through it fails with `Stale`, and it is never
    /// offered again (a later server might still hold an orphan record of data removed).
    lost: AtomicBool,
    /// Another client changed the file's attributes since this handle last read them (a
    /// revocation named it): a read past the known end asks the meta server for the size
    /// once before it answers short (a reader that holds the file open sees others'
    /// appends, as `tail -f` expects).
    changed_elsewhere: AtomicBool,
    /// What the I/O servers on this host said about this handle's stripes (`local.rs`),
    /// by stripe index: descriptors kept until the handle closes, objects found missing,
    /// servers found elsewhere.
    local: Mutex<HashMap<u32, LocalStripe>>,
    /// Held while asking for a stripe's descriptor.
    local_opening: tokio::sync::Mutex<()>,
}

/// A stripe's object as a local-reads socket described it.
#[derive(Clone)]
enum LocalStripe {
    Open(Arc<crate::local::LocalObject>),
    /// It did not exist: reads go through the RPC path until one returns bytes.
    Missing,
    /// Its server is not on this host (not a Unix socket): every read is served, with
    /// nothing asked or locked on the way.
    Remote,
}

struct HandleState {
    attr: Attr,
    /// The size reads clamp to and appends write at: the meta server's size or this
    /// handle's own extension, whichever is larger.
    known_size: u64,
    /// Highest end of any write started through this handle.
    written_end: u64,
    /// Highest end of any write acknowledged by its server.
    acknowledged_end: u64,
    /// A growth without bytes (`FileHandle::extend_to`) waiting for the writes started
    /// before it: (the last of them, the end), joined to `acknowledged_end` once they are
    /// all acknowledged.
    pending_extension: Option<(u64, u64)>,
    /// Count of `write_at` calls (the last write's sequence number), and its value when a
    /// commit last covered all of them.
    writes_started: u64,
    writes_committed: u64,
    last_commit: Instant,
    /// Size commits sent and not answered yet (background, flush, fsync, close).
    commits_running: u32,
    /// Truncations by this client between their start and their reply: no commit starts
    /// while one is pending.
    truncates_pending: u32,
    /// Bumped when a truncation starts; a commit reply of an older epoch is dropped.
    truncate_epoch: u64,
    first_error: Option<ClientError>,
    /// Writes in flight: (stripe index, object offset) → object end. Overlapping entries never
    /// coexist, so the start is a unique key. Bounded by `dirty_bytes_max` / request size.
    in_flight: BTreeMap<(u32, u64), u64>,
    /// Writes not finished: sequence number → its requests not finished yet. Bounded by the
    /// writes in flight (each holds dirty bytes) plus the `write_at` calls running.
    writes_outstanding: BTreeMap<u64, usize>,
    /// Stripes with a write acknowledged since the last successful sync.
    unsynced_stripes: BTreeSet<u32>,
    /// The newest space report of each stripe this handle changed (stripe → report), sent
    /// with every size commit so `st_blocks` follows what the servers store. Bounded by the
    /// stripe count.
    stripe_space: BTreeMap<u32, ObjectSpace>,
    /// Small writes gathered and not sent yet (see [`GATHER_WRITE_MAX`]); not counted in
    /// `writes_started` until they are sent.
    gathered: Option<Gathered>,
    /// Bumped each time gathering starts, so a timer sends only what it was set for.
    gather_generation: u64,
    /// Pieces of large writes that cover only part of a stripe unit, kept until the rest of
    /// their unit comes (a later write, or one that came first: the mount's session
    /// threads hand the kernel's write-back over out of order), so the unit goes out whole
    /// and aligned: file offset → piece. Pieces never overlap; at most
    /// [`PARKED_BYTES_MAX`] bytes in all; each is sent at most `gather_wait_ms` after it
    /// was parked, or as soon as anything must see it, as gathered bytes are. Never held
    /// together with `gathered` (a small write sends what is parked before it gathers; a
    /// large one sends what is gathered before it parks).
    parked: BTreeMap<u64, ParkedPiece>,
    parked_bytes: usize,
    /// Whether a timer task is watching the parked pieces' age.
    park_timer: bool,
    /// Batches of gathered or parked pieces taken from the handle and not yet all started
    /// (`send_pieces_ordered`): between the two, the bytes are neither held here nor
    /// counted in `writes_started`, and a flush that looked only at those would find
    /// nothing to do and commit no size (a close answered before its write's size
    /// reached the meta server, so the next open saw the file shorter).
    batches_in_transit: u32,
    /// Per stripe, the object end this handle's requests charged space up to (see
    /// `charge_request`; from the size at open, or at the last truncation). Bounded by the
    /// stripe count.
    charged_through: BTreeMap<u32, u64>,
    /// What a sequential reader has fetched ahead (see `readahead.rs`).
    readahead: ReadAhead,
}

/// A part of a stripe unit written and not sent yet (see [`HandleState::parked`]).
struct ParkedPiece {
    data: Bytes,
    /// Memory it holds, counted against `PARKED_BYTES_MAX`: the whole buffer of the write
    /// when it is a slice of it.
    held: usize,
    since: Instant,
}

/// Whether `start..end` makes whole a stripe unit of `unit` bytes with the `parked`
/// pieces of that unit (it lies inside the unit and overlaps none of them).
fn completes_unit(parked: &BTreeMap<u64, ParkedPiece>, start: u64, end: u64, unit: u64) -> bool {
    let unit_start = start - start % unit;
    let unit_end = unit_start + unit;
    if end <= start || end > unit_end || parked.is_empty() {
        return false;
    }
    let mut covered = end - start;
    for (offset, piece) in parked.range(unit_start..unit_end) {
        let piece_end = *offset + piece.data.len() as u64;
        if *offset < end && piece_end > start {
            return false;
        }
        covered += piece.data.len() as u64;
    }
    covered == unit
}

/// Small adjacent writes gathered into one request.
struct Gathered {
    offset: u64,
    data: GatherBuffer,
}

/// Where gathered bytes (or a stripe unit put together from parked pieces) are kept: in a
/// place of the client's payload area when it shares one with a server of this host (the
/// batch goes from there without another copy, and the place never grows by copying),
/// else on the heap.
enum GatherBuffer {
    Heap(BytesMut),
    Shared(freeflow_rpc::shared::PlaceMut),
}

// A place holds a whole gathering.
const _: () = assert!(GATHER_BYTES_MAX <= freeflow_rpc::shared::REGION_SLOT_BYTES);

impl GatherBuffer {
    /// A buffer holding `data`, the first write of a gathering.
    fn new(area: Option<&Arc<freeflow_rpc::shared::PayloadArea>>, data: &[u8]) -> GatherBuffer {
        let mut buffer = GatherBuffer::empty(area, data.len().max(GATHER_CAPACITY_START));
        buffer.extend_from_slice(data);
        buffer
    }

    /// An empty buffer for up to `capacity` bytes: a place of `area` if it holds that
    /// many and one is free, else heap memory of that capacity (it may grow).
    fn empty(
        area: Option<&Arc<freeflow_rpc::shared::PayloadArea>>,
        capacity: usize,
    ) -> GatherBuffer {
        let place = area
            .filter(|_| capacity <= freeflow_rpc::shared::REGION_SLOT_BYTES)
            .and_then(|area| area.take());
        match place {
            Some(place) => GatherBuffer::Shared(place),
            None => GatherBuffer::Heap(BytesMut::with_capacity(capacity)),
        }
    }

    fn len(&self) -> usize {
        match self {
            GatherBuffer::Heap(bytes) => bytes.len(),
            GatherBuffer::Shared(place) => place.len(),
        }
    }

    /// Callers keep a gathering within `GATHER_BYTES_MAX`.
    fn extend_from_slice(&mut self, data: &[u8]) {
        match self {
            GatherBuffer::Heap(bytes) => bytes.extend_from_slice(data),
            GatherBuffer::Shared(place) => place.extend_from_slice(data),
        }
    }

    fn freeze(self) -> Bytes {
        match self {
            GatherBuffer::Heap(bytes) => bytes.freeze(),
            GatherBuffer::Shared(place) => place.freeze(),
        }
    }
}

/// The turn to send writes of one handle (its `send_order` lock), owned so that it can
/// move into the task that sends gathered bytes.
type SendTurn = tokio::sync::OwnedMutexGuard<()>;

/// A change of the file's data made through a handle without a write (fallocate, a copy
/// into it): while it lasts nothing is fetched ahead, and what was is dropped at its start
/// and at its end, however it ends (an error, a cancelled call).
struct ChangeUnderWay<'a>(&'a HandleShared);

impl<'a> ChangeUnderWay<'a> {
    fn begin(shared: &'a HandleShared) -> ChangeUnderWay<'a> {
        let mut state = shared.lock();
        state.readahead.clear();
        state.readahead.changing += 1;
        ChangeUnderWay(shared)
    }
}

impl Drop for ChangeUnderWay<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.readahead.changing -= 1;
        state.readahead.clear();
    }
}

/// A size commit between its computation and its reply.
struct CommitTicket {
    size_bytes: u64,
    /// Answered only once durable at the meta server (the commit ending an fsync).
    durable: bool,
    /// `writes_started` it covers (all those writes were acknowledged when computed).
    covers_writes: u64,
    truncate_epoch: u64,
}

impl HandleState {
    /// The bytes of space grant a write request carries (`WriteObject::charged`): what its
    /// object range adds past what this handle charged on its stripe before.
    fn charge_request(&mut self, layout: &Layout, request: &ObjectRequest) -> u64 {
        let size = self.attr.size_bytes;
        let through = self
            .charged_through
            .entry(request.stripe_index)
            .or_insert_with(|| layout.object_length(size, request.stripe_index));
        let end = request.object_end();
        let charged = end.saturating_sub(request.object_offset.max(*through));
        *through = (*through).max(end);
        charged
    }

    /// Whether written bytes wait on this handle to be sent (gathered or parked).
    fn holds_unsent(&self) -> bool {
        self.gathered.is_some() || !self.parked.is_empty() || self.batches_in_transit > 0
    }

    /// A batch of pieces was just taken (`taken`: not empty) to be sent by
    /// `send_pieces_ordered`, which counts it off.
    fn in_transit(&mut self, taken: bool) {
        self.batches_in_transit += u32::from(taken);
    }

    /// Begin gathering with the write of `data` at `offset` (nothing is gathered now);
    /// returns the gathering's generation.
    fn gather_anew(
        &mut self,
        area: Option<&Arc<freeflow_rpc::shared::PayloadArea>>,
        offset: u64,
        data: &[u8],
        end: u64,
    ) -> u64 {
        self.gathered = Some(Gathered {
            offset,
            data: GatherBuffer::new(area, data),
        });
        self.gather_generation += 1;
        self.known_size = self.known_size.max(end);
        self.written_end = self.written_end.max(end);
        self.gather_generation
    }

    /// If `piece` (at file offset `start`) and the parked pieces of its stripe unit make
    /// the whole unit, take those pieces and return them all in file order (`piece`
    /// among them); None otherwise.
    fn take_unit(&mut self, start: u64, piece: &Bytes, unit: u64) -> Option<Vec<(u64, Bytes)>> {
        let unit_start = start - start % unit;
        let unit_end = unit_start + unit;
        let mut covered = piece.len() as u64;
        for (offset, parked) in self.parked.range(unit_start..unit_end) {
            debug_assert!(*offset + parked.data.len() as u64 <= unit_end);
            covered += parked.data.len() as u64;
        }
        // Parked pieces never overlap each other or this one (the overlapped ones were
        // sent first), and none crosses a unit boundary: the lengths tell.
        debug_assert!(covered <= unit, "parked pieces overlap");
        if covered != unit {
            return None;
        }
        let mut pieces = self.take_parked(|offset, _| (unit_start..unit_end).contains(&offset));
        pieces.push((start, piece.clone()));
        pieces.sort_by_key(|(offset, _)| *offset);
        Some(pieces)
    }

    /// Take the parked pieces that `select` keeps, in file order.
    fn take_parked(&mut self, select: impl Fn(u64, &ParkedPiece) -> bool) -> Vec<(u64, Bytes)> {
        let offsets: Vec<u64> = self
            .parked
            .iter()
            .filter(|(offset, piece)| select(**offset, piece))
            .map(|(offset, _)| *offset)
            .collect();
        offsets
            .into_iter()
            .filter_map(|offset| {
                let piece = self.parked.remove(&offset)?;
                self.parked_bytes -= piece.held;
                Some((offset, piece.data))
            })
            .collect()
    }

    /// Whether a change of the file's data through this handle is under way (gathered or
    /// in flight, a truncation, fallocate or a copy): what is read past the reader's range
    /// now may predate it, so it is not fetched ahead or kept.
    fn changing_data(&self) -> bool {
        self.holds_unsent()
            || !self.writes_outstanding.is_empty()
            || self.truncates_pending > 0
            || self.readahead.changing > 0
    }

    fn overlaps_in_flight(&self, request: &ObjectRequest) -> bool {
        // No request is longer than IO_REQUEST_BYTES_MAX, so any overlapping one starts
        // at most that far before this one.
        let lowest_start = request
            .object_offset
            .saturating_sub(u64::from(IO_REQUEST_BYTES_MAX));
        self.in_flight
            .range(
                (request.stripe_index, lowest_start)..(request.stripe_index, request.object_end()),
            )
            .any(|(_, &end)| end > request.object_offset)
    }

    /// Keep `space` as stripe `stripe_index`'s report if it is newer than the one kept.
    fn note_space(&mut self, stripe_index: u32, space: ObjectSpace) {
        let kept = self.stripe_space.entry(stripe_index).or_default();
        if space.stamp > kept.stamp {
            *kept = space;
        }
    }

    /// What this handle knows of the file's allocated bytes: the meta server's figure, or
    /// its own reports where they are newer (a lower bound until the next commit).
    fn allocated_bytes(&self) -> u64 {
        let reported: u64 = self.stripe_space.values().map(|s| s.allocated_bytes).sum();
        self.attr.allocated_bytes.max(reported)
    }

    fn absorb_attr(&mut self, attr: Attr) {
        self.known_size = self.known_size.max(attr.size_bytes);
        self.attr = attr;
    }

    /// Whether every write with a sequence number up to `sequence` has finished.
    fn writes_done_through(&self, sequence: u64) -> bool {
        self.writes_outstanding.range(..=sequence).next().is_none()
    }

    fn finish_requests(&mut self, sequence: u64, count: usize) {
        if let Some(remaining) = self.writes_outstanding.get_mut(&sequence) {
            *remaining = remaining.saturating_sub(count);
            if *remaining == 0 {
                self.writes_outstanding.remove(&sequence);
            }
        }
    }

    fn earlier_write_error(&self, inode: InodeId) -> Option<ClientError> {
        self.first_error
            .as_ref()
            .map(|error| ClientError::EarlierWrite {
                inode,
                source: Box::new(error.clone()),
            })
    }

    /// Register a commit of the acknowledged size (the caller checked no truncation is
    /// pending).
    fn start_commit(&mut self, covers_writes: u64, durable: bool) -> CommitTicket {
        if let Some((through, end)) = self.pending_extension {
            if self.writes_done_through(through) {
                self.acknowledged_end = self.acknowledged_end.max(end);
                self.pending_extension = None;
            }
        }
        self.commits_running += 1;
        CommitTicket {
            size_bytes: self.acknowledged_end,
            durable,
            covers_writes,
            truncate_epoch: self.truncate_epoch,
        }
    }
}

/// The requests of one `write_at` not handed to a task yet; if the call is cancelled, they
/// are marked finished so that nobody waits for them.
struct UnsentRequests<'a> {
    shared: &'a HandleShared,
    sequence: u64,
    count: usize,
}

impl Drop for UnsentRequests<'_> {
    fn drop(&mut self) {
        if self.count > 0 {
            self.shared
                .lock()
                .finish_requests(self.sequence, self.count);
            self.shared.notify();
        }
    }
}

/// A size change of a file by this client, holding back the size commits of its open
/// handles (see the module doc). Dropped without [`Truncation::finish`] (an error or a
/// cancelled call), it lets them go on without touching their sizes.
pub(crate) struct Truncation {
    handles: Vec<Arc<HandleShared>>,
}

impl Truncation {
    /// Wait for the writes through `handles` that started before this call, stop new size
    /// commits, and wait for those already sent.
    pub(crate) async fn begin(handles: Vec<Arc<HandleShared>>) -> Truncation {
        for handle in &handles {
            // A failure is kept on the handle, reported by its next call.
            let _ = handle.send_gathered().await;
        }
        let snapshots: Vec<u64> = handles
            .iter()
            .map(|handle| handle.lock().writes_started)
            .collect();
        for (handle, &sequence) in handles.iter().zip(&snapshots) {
            handle
                .wait_then(|state| state.writes_done_through(sequence).then_some(()))
                .await;
        }
        for handle in &handles {
            let mut state = handle.lock();
            state.truncates_pending += 1;
            state.truncate_epoch += 1;
            // Charges count from the new size (set in `attr` by the truncation's reply).
            state.charged_through.clear();
            state.readahead.clear();
        }
        // Made before the next await, so a cancelled call still lets the commits go.
        let truncation = Truncation { handles };
        for handle in &truncation.handles {
            handle
                .wait_then(|state| (state.commits_running == 0).then_some(()))
                .await;
        }
        truncation
    }

    /// The meta server set the size: the handles forget what they wrote beyond it, so a
    /// later commit does not grow the file back.
    pub(crate) fn finish(mut self, attr: &Attr) {
        for handle in std::mem::take(&mut self.handles) {
            {
                let mut state = handle.lock();
                state.truncates_pending -= 1;
                let size = attr.size_bytes;
                state.known_size = size;
                state.written_end = state.written_end.min(size);
                state.acknowledged_end = state.acknowledged_end.min(size);
                state.pending_extension = state
                    .pending_extension
                    .map(|(through, end)| (through, end.min(size)));
                // Reports from before the cut are stale; the meta server has the cut's own.
                state.stripe_space.clear();
                state.attr = attr.clone();
                state.readahead.clear();
                state.charged_through.clear();
            }
            handle.notify();
        }
    }
}

impl Drop for Truncation {
    fn drop(&mut self) {
        for handle in &self.handles {
            handle.lock().truncates_pending -= 1;
            handle.notify();
        }
    }
}

impl HandleShared {
    /// Cut a write into requests and send them, each on its own task; returns once all are
    /// in flight. The caller holds `send_order`.
    async fn start_write(self: &Arc<Self>, offset: u64, data: Bytes) -> Result<(), ClientError> {
        let shared = self;
        shared.check_no_failed_write()?;
        let layout = shared.data_layout()?;
        let length = data.len() as u64;
        let end = offset + length;
        let requests = plan_requests(layout, offset, length, u64::from(IO_REQUEST_BYTES_MAX));
        let sequence = {
            let mut state = shared.lock();
            // What was fetched ahead may be older than this write.
            state.readahead.clear();
            state.known_size = state.known_size.max(end);
            state.written_end = state.written_end.max(end);
            state.writes_started += 1;
            let sequence = state.writes_started;
            state.writes_outstanding.insert(sequence, requests.len());
            sequence
        };
        let mut unsent = UnsentRequests {
            shared,
            sequence,
            count: requests.len(),
        };
        let dirty = &shared.client.shared.dirty;
        for request in requests {
            let start = (request.file_offset - offset) as usize;
            let payload = data.slice(start..start + request.length as usize);
            // The semaphore is never closed; a request (≤ IO_REQUEST_BYTES_MAX) fits u32 and
            // config validation keeps dirty_bytes_max at least that large.
            let permit = match dirty.clone().try_acquire_many_owned(request.length as u32) {
                Ok(permit) => permit,
                Err(_) => {
                    let _throttled = shared.client.shared.pool.metrics.throttled();
                    dirty
                        .clone()
                        .acquire_many_owned(request.length as u32)
                        .await
                        .expect("dirty semaphore never closed")
                }
            };
            shared.begin_write(&request).await;
            unsent.count -= 1;
            let charged = shared.lock().charge_request(layout, &request);
            tokio::spawn(shared.clone().send_write(
                layout.clone(),
                request,
                sequence,
                payload,
                permit,
                charged,
            ));
        }
        drop(unsent);
        shared.commit_if_due();
        Ok(())
    }

    /// Whether a write of `offset..end` makes a parked piece's stripe unit whole.
    fn completes_parked(&self, offset: u64, end: u64) -> Result<bool, ClientError> {
        let unit = u64::from(self.data_layout()?.stripe_unit_bytes);
        Ok(completes_unit(&self.lock().parked, offset, end, unit))
    }

    /// Whether a write of `length` bytes at `offset` may be made: Some(its end), None when
    /// there is nothing to write.
    fn check_write(&self, offset: u64, length: usize) -> Result<Option<u64>, ClientError> {
        self.check_open()?;
        if !self.access.write {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::BadHandle,
                "the handle is not open for writing",
            ));
        }
        self.check_no_failed_write()?;
        self.data_layout()?;
        if length == 0 {
            return Ok(None);
        }
        let length = length as u64;
        let end = offset.checked_add(length).filter(|end| *end <= FILE_SIZE_MAX).ok_or_else(|| {
            ClientError::inode(
                self.inode,
                ErrorCode::FileTooBig,
                format!("a write of {length} bytes at {offset} ends beyond the largest file size {FILE_SIZE_MAX}"),
            )
        })?;
        Ok(Some(end))
    }

    /// Append a small write to what is gathered if it starts where that ends (and fits);
    /// false if it does not.
    fn try_gather(&self, offset: u64, data: &[u8], end: u64) -> bool {
        let mut state = self.lock();
        let Some(gathered) = state.gathered.as_mut() else {
            return false;
        };
        if data.len() >= GATHER_WRITE_MAX
            || offset != gathered.offset + gathered.data.len() as u64
            || gathered.data.len() + data.len() > GATHER_BYTES_MAX
        {
            return false;
        }
        gathered.data.extend_from_slice(data);
        state.known_size = state.known_size.max(end);
        state.written_end = state.written_end.max(end);
        true
    }

    /// A large write, given the turn: its whole stripe units are sent at once; a piece that
    /// covers only part of a unit (its first or last) joins the parked pieces of that unit
    /// and goes out with them once they make the whole unit, or parks. The I/O servers then
    /// see whole, aligned units, which they write past their page cache (O_DIRECT),
    /// instead of two partial pieces of every unit when the writes do not follow unit
    /// boundaries (the kernel's write-back of a writeback mount drifts off them).
    async fn write_in_units(
        self: &Arc<Self>,
        turn: SendTurn,
        offset: u64,
        data: Bytes,
    ) -> Result<(), ClientError> {
        let unit = u64::from(self.data_layout()?.stripe_unit_bytes);
        let end = offset + data.len() as u64;
        // First what this write must not be overtaken by: anything gathered (newer than
        // every parked piece, so those go first), else the parked pieces it overlaps.
        let earlier = {
            let mut state = self.lock();
            let earlier = if let Some(gathered) = state.gathered.take() {
                debug_assert!(state.parked.is_empty(), "parked and gathered at once");
                vec![(gathered.offset, gathered.data.freeze())]
            } else {
                state.take_parked(|start, piece| {
                    start < end && start + piece.data.len() as u64 > offset
                })
            };
            state.in_transit(!earlier.is_empty());
            earlier
        };
        let (sent, turn) = self.send_pieces_ordered(turn, earlier).await;
        sent?;
        if unit > (PARKED_BYTES_MAX / 2) as u64 {
            return self.start_write(offset, data).await;
        }
        // Cut at unit boundaries: a partial first piece, whole units, a partial last piece.
        let head_end = offset.next_multiple_of(unit).min(end);
        let tail_start = (end - end % unit).max(head_end);
        // A piece kept as a slice holds the whole buffer of the write: a piece of a buffer
        // longer than two units is copied, so what is parked holds at most about
        // `PARKED_BYTES_MAX` bytes of memory.
        let keep_slices = data.len() as u64 <= 2 * unit;
        let held_per_piece = |piece: &Bytes| {
            if keep_slices {
                data.len()
            } else {
                piece.len()
            }
        };
        let slice =
            |from: u64, to: u64| data.slice((from - offset) as usize..(to - offset) as usize);
        // The whole units go first: should that fail, or the caller give up, no part of
        // this write was parked (nothing of it was acknowledged).
        if tail_start > head_end {
            self.start_write(head_end, slice(head_end, tail_start))
                .await?;
        }
        let mut partial = Vec::new();
        if head_end > offset {
            partial.push((offset, slice(offset, head_end)));
        }
        if end > tail_start {
            partial.push((tail_start, slice(tail_start, end)));
        }
        // Units made whole (their parked pieces taken) and parked pieces sent for room:
        // acknowledged bytes, sent on a task of their own below.
        let mut units: Vec<Vec<(u64, Bytes)>> = Vec::new();
        let mut room: Vec<(u64, Bytes)> = Vec::new();
        let mut parks = false;
        {
            let mut state = self.lock();
            for (start, piece) in partial {
                if let Some(pieces) = state.take_unit(start, &piece, unit) {
                    units.push(pieces);
                    continue;
                }
                let piece = if keep_slices {
                    piece
                } else {
                    Bytes::copy_from_slice(&piece)
                };
                let held = held_per_piece(&piece);
                // Room first: what is parked goes out (it overlaps none of this write).
                if state.parked_bytes + held > PARKED_BYTES_MAX {
                    room.append(&mut state.take_parked(|_, _| true));
                }
                state.parked_bytes += held;
                let piece_end = start + piece.len() as u64;
                state.known_size = state.known_size.max(piece_end);
                state.written_end = state.written_end.max(piece_end);
                state.parked.insert(
                    start,
                    ParkedPiece {
                        data: piece,
                        held,
                        since: Instant::now(),
                    },
                );
                if !state.park_timer {
                    state.park_timer = true;
                    parks = true;
                }
            }
            // Sent below, as `sends`.
            state.in_transit(!units.is_empty() || !room.is_empty());
        }
        if parks {
            self.watch_parked();
        }
        // Units are put together outside the state lock (a copy of up to a unit).
        // In a place of the payload area where it can be, so the unit is sent from there.
        let mut sends = room;
        let area = self.client.shared_payload_area();
        for pieces in units {
            let unit_start = pieces[0].0;
            let mut whole = GatherBuffer::empty(area, unit as usize);
            for (_, bytes) in pieces {
                whole.extend_from_slice(&bytes);
            }
            sends.push((unit_start, whole.freeze()));
        }
        self.send_pieces_ordered(turn, sends).await.0
    }

    /// Send parked pieces once they waited `gather_wait_ms`, until none is left. Holds the
    /// handle: parked bytes are sent even if it is dropped without a close.
    fn watch_parked(self: &Arc<Self>) {
        let shared = self.clone();
        let wait = Duration::from_millis(self.client.shared.config.gather_wait_ms);
        tokio::spawn(async move {
            loop {
                let oldest = {
                    let mut state = shared.lock();
                    match state.parked.values().map(|piece| piece.since).min() {
                        Some(oldest) => oldest,
                        None => {
                            state.park_timer = false;
                            return;
                        }
                    }
                };
                tokio::time::sleep_until(oldest + wait).await;
                let turn = shared.send_turn().await;
                let due = {
                    let mut state = shared.lock();
                    let due = state.take_parked(|_, piece| piece.since.elapsed() >= wait);
                    state.in_transit(!due.is_empty());
                    due
                };
                // A failure is kept on the handle like any write's.
                let _ = shared.send_pieces_ordered(turn, due).await;
            }
        });
    }

    /// Gather a small write (none is gathered now); it is sent by the next call that needs
    /// it on its way, or after `gather_wait_ms` at most.
    fn start_gathering(self: &Arc<Self>, offset: u64, data: &[u8], end: u64) {
        let area = self.client.shared_payload_area();
        let generation = self.lock().gather_anew(area, offset, data, end);
        self.send_gathered_later(generation);
    }

    /// A small write that cannot join what is gathered (nothing is, it does not start
    /// where they end, or they are full), done as [`FileHandle::write_at`] would do it but
    /// without waiting: if the turn to send is free now, what is gathered goes on a task
    /// that keeps the turn until it is in flight, and this write begins the next
    /// gathering (the mount's session thread answers it at once, instead of handing it to
    /// a task and waiting for the turn). False, with nothing done, when the turn is taken
    /// (by a batch before, a close or a large write: the long way keeps the order), when
    /// pieces are parked (the long way sends them as whole units), or when this client
    /// does not gather. Needs a runtime context.
    fn try_gather_anew(self: &Arc<Self>, offset: u64, data: &[u8], end: u64) -> bool {
        if data.len() >= GATHER_WRITE_MAX || self.client.shared.config.gather_wait_ms == 0 {
            return false;
        }
        let Ok(turn) = self.send_order.clone().try_lock_owned() else {
            return false;
        };
        // A close marks the handle closed before it takes the turn: one that has it next
        // must find nothing of this write anywhere.
        if self.check_open().is_err() {
            return false;
        }
        let (gathered, generation) = {
            let mut state = self.lock();
            if !state.parked.is_empty() {
                return false;
            }
            let gathered = state.gathered.take();
            state.in_transit(gathered.is_some());
            let area = self.client.shared_payload_area();
            (gathered, state.gather_anew(area, offset, data, end))
        };
        if let Some(gathered) = gathered {
            let (shared, pieces) = (
                self.clone(),
                vec![(gathered.offset, gathered.data.freeze())],
            );
            tokio::spawn(async move {
                // A failure is kept on the handle like any write's.
                let _ = shared.send_pieces_ordered(turn, pieces).await;
            });
        }
        self.send_gathered_later(generation);
        true
    }

    /// Send what gathering `generation` holds after `gather_wait_ms`, unless it went
    /// before.
    fn send_gathered_later(self: &Arc<Self>, generation: u64) {
        // Holds the handle: gathered bytes are sent even if it is dropped without a close.
        let shared = self.clone();
        let wait = Duration::from_millis(self.client.shared.config.gather_wait_ms);
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let turn = shared.send_turn().await;
            if shared.lock().gather_generation == generation {
                // A failure is kept on the handle like any write's.
                let _ = shared.send_gathered_ordered(turn).await;
            }
        });
    }

    /// What a write of `[offset, end)` adds past the size this handle knows, on each
    /// server that keeps it.
    fn space_needs(&self, offset: u64, end: u64) -> Vec<(freeflow_types::ServerId, u64)> {
        let known = self.lock().known_size;
        match &self.layout {
            Some(layout) if end > known => crate::space::needs(layout, offset.max(known), end),
            _ => Vec::new(),
        }
    }

    /// Take `needs` (the space a write of `[offset, end)` adds) from this client's grants.
    async fn take_needs(
        &self,
        offset: u64,
        end: u64,
        needs: &[(freeflow_types::ServerId, u64)],
    ) -> Result<(), ClientError> {
        if needs.is_empty() {
            return Ok(());
        }
        let shared = &self.client.shared;
        shared
            .space
            .take(
                &shared.pool,
                self.inode,
                needs,
                self.layout
                    .as_ref()
                    .is_some_and(|layout| layout.replicas() > 1),
            )
            .await
            .map_err(|error| match error.code() {
                ErrorCode::NoSpace => ClientError::inode(
                    self.inode,
                    ErrorCode::NoSpace,
                    format!(
                        "no space for a write of {} bytes at {offset}: {error}",
                        end - offset
                    ),
                ),
                _ => error,
            })
    }

    /// Wait for the turn to send: once it is taken, every write of an earlier call is in
    /// flight or gathered.
    async fn send_turn(&self) -> SendTurn {
        self.send_order.clone().lock_owned().await
    }

    /// Send what is gathered, if anything, ahead of any later write. Returns once every
    /// write of an earlier call is in flight (`in_flight` shows them all): bytes another
    /// task took from the gathering buffer and is still sending are waited for too.
    pub(crate) async fn send_gathered(self: &Arc<Self>) -> Result<(), ClientError> {
        let turn = self.send_turn().await;
        self.send_gathered_ordered(turn).await.0
    }

    /// As `send_gathered`, given the turn, which it hands back. The bytes were acknowledged
    /// to their writers already, so they are sent on a task of their own that keeps the
    /// turn until they are in flight: a caller cancelled meanwhile (a dropped future) loses
    /// nothing, and no later write overtakes them.
    async fn send_gathered_ordered(
        self: &Arc<Self>,
        turn: SendTurn,
    ) -> (Result<(), ClientError>, SendTurn) {
        let pieces = {
            let mut state = self.lock();
            let mut pieces = state.take_parked(|_, _| true);
            if let Some(gathered) = state.gathered.take() {
                pieces.push((gathered.offset, gathered.data.freeze()));
            }
            state.in_transit(!pieces.is_empty());
            pieces
        };
        self.send_pieces_ordered(turn, pieces).await
    }

    /// Send acknowledged pieces taken from the handle (gathered or parked), in the order
    /// given, on a task that keeps the turn until all are in flight (as
    /// `send_gathered_ordered`). The caller counted them in transit (`in_transit`) in the
    /// lock it took them under; they are counted off once started (or failed).
    async fn send_pieces_ordered(
        self: &Arc<Self>,
        turn: SendTurn,
        pieces: Vec<(u64, Bytes)>,
    ) -> (Result<(), ClientError>, SendTurn) {
        if pieces.is_empty() {
            return (Ok(()), turn);
        }
        let shared = self.clone();
        let sending = tokio::spawn(async move {
            let mut sent = Ok(());
            for (offset, data) in pieces {
                // Fails only on a handle failed already, which every later call reports.
                if let Err(error) = shared.start_write(offset, data).await {
                    sent = Err(error);
                    break;
                }
            }
            shared.lock().batches_in_transit -= 1;
            shared.notify();
            (sent, turn)
        });
        match sending.await {
            Ok(sent) => sent,
            // start_write does not panic; if it did, the panic is the caller's too.
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            // The runtime is shutting down: the turn went with the task.
            Err(_) => {
                let error = ClientError::inode(
                    self.inode,
                    ErrorCode::Io,
                    "the runtime stopped while gathered or parked writes were being sent",
                );
                self.lock().first_error.get_or_insert(error.clone());
                let turn = self.send_turn().await;
                (Err(error), turn)
            }
        }
    }
}

impl HandleShared {
    fn lock(&self) -> MutexGuard<'_, HandleState> {
        self.state.lock().expect("handle state lock not poisoned")
    }

    fn check_open(&self) -> Result<(), ClientError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::BadHandle,
                "the handle is closed",
            ));
        }
        if self.lost.load(Ordering::Acquire) {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::Stale,
                "the metadata server did not take this handle back after it restarted (its file is gone)",
            ));
        }
        Ok(())
    }

    /// The meta server refused this handle at a reclaim (see `lost`).
    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
    }

    fn require_write(&self) -> Result<(), ClientError> {
        if !self.access.write {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::BadHandle,
                "the handle is not open for writing",
            ));
        }
        Ok(())
    }

    /// `offset + length`, if it stays within the largest file size.
    fn checked_end(&self, offset: u64, length: u64) -> Result<u64, ClientError> {
        offset
            .checked_add(length)
            .filter(|end| *end <= FILE_SIZE_MAX)
            .ok_or_else(|| {
                ClientError::inode(
                    self.inode,
                    ErrorCode::FileTooBig,
                    format!(
                        "{length} bytes at {offset} end beyond the largest file size {FILE_SIZE_MAX}"
                    ),
                )
            })
    }

    fn check_no_failed_write(&self) -> Result<(), ClientError> {
        match self.lock().earlier_write_error(self.inode) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Wake every task waiting on this handle's state.
    fn notify(&self) {
        self.completions
            .send_modify(|count| *count = count.wrapping_add(1));
    }

    fn data_layout(&self) -> Result<&Layout, ClientError> {
        let kind = self.lock().attr.kind;
        match (&self.layout, kind) {
            (Some(layout), FileKind::Regular) => Ok(layout),
            (_, FileKind::Directory) => Err(ClientError::inode(
                self.inode,
                ErrorCode::IsDirectory,
                "a directory has no data to read or write",
            )),
            (None, FileKind::Regular) => Err(ClientError::inode(
                self.inode,
                ErrorCode::Io,
                "the meta server gave this regular file no layout",
            )),
            (_, kind) => Err(ClientError::inode(
                self.inode,
                ErrorCode::InvalidArgument,
                format!("a {kind:?} has no data on the I/O servers"),
            )),
        }
    }

    /// Wait until every write started through this handle so far is answered by its I/O
    /// servers (or failed): what another client's truncation recalls (`leases::watch`).
    /// A revocation of the file's attributes arrived: see `changed_elsewhere`.
    pub(crate) fn note_changed_elsewhere(&self) {
        self.changed_elsewhere.store(true, Ordering::Release);
    }

    pub(crate) async fn wait_for_started_writes(self: &Arc<Self>) {
        // Gathered writes were made before the recall too: they go out first.
        // A failure is kept on the handle, reported by its next call.
        let _ = self.send_gathered().await;
        let sequence = {
            let mut state = self.lock();
            // The file is about to change under what was fetched ahead: nothing more is
            // fetched ahead until the handle learns the change (refresh).
            state.readahead.clear();
            state.readahead.suspended = true;
            state.writes_started
        };
        self.wait_then(|state| state.writes_done_through(sequence).then_some(()))
            .await;
    }

    /// Wait until `ready` gives a value, re-checking after each change of the state (write
    /// finished, commit answered, truncation over). `ready` runs under the state lock, so
    /// what it takes is consistent with what it checked.
    async fn wait_then<T>(&self, mut ready: impl FnMut(&mut HandleState) -> Option<T>) -> T {
        loop {
            let mut receiver = {
                let mut state = self.lock();
                if let Some(value) = ready(&mut state) {
                    return value;
                }
                // Subscribed under the lock: a change after the check is seen.
                self.completions.subscribe()
            };
            // Fails only if the sender is gone, and `self` owns it.
            let _ = receiver.changed().await;
        }
    }

    async fn wait_until(&self, done: impl Fn(&HandleState) -> bool) {
        self.wait_then(|state| done(state).then_some(())).await;
    }

    /// Wait until no write in flight overlaps `request`, then register it as in flight.
    async fn begin_write(&self, request: &ObjectRequest) {
        loop {
            let mut receiver = {
                let mut state = self.lock();
                if !state.overlaps_in_flight(request) {
                    state.in_flight.insert(
                        (request.stripe_index, request.object_offset),
                        request.object_end(),
                    );
                    return;
                }
                self.completions.subscribe()
            };
            let _ = receiver.changed().await;
        }
    }

    /// Send one write request (part of write `sequence`) and record how it ended.
    async fn send_write(
        self: Arc<Self>,
        layout: Layout,
        request: ObjectRequest,
        sequence: u64,
        payload: Bytes,
        permit: OwnedSemaphorePermit,
        charged: u64,
    ) {
        let object = ObjectId {
            inode: self.inode,
            stripe_index: request.stripe_index,
        };
        let space = &self.client.shared.space;
        let grant = space.id;
        let chain = layout.chain(request.stripe_index);
        space.charge(&chain, charged, Instant::now());
        let make = |map_version, forward| WriteObject {
            object,
            offset: request.object_offset,
            map_version,
            forward,
            grant,
            charged,
        };
        let result = self
            .client
            .shared
            .pool
            .chain_write(
                &layout,
                request.stripe_index,
                self.inode,
                make,
                payload,
                || {
                    format!(
                        "of {} bytes at inode {} stripe {} offset {}",
                        request.length, self.inode, request.stripe_index, request.object_offset
                    )
                },
            )
            .await;
        drop(permit);
        {
            let mut state = self.lock();
            state
                .in_flight
                .remove(&(request.stripe_index, request.object_offset));
            state.finish_requests(sequence, 1);
            match result {
                Ok((space, _)) => {
                    // The servers of the chain saw the grant in use when this was sent.
                    state.note_space(request.stripe_index, space);
                    state.acknowledged_end = state.acknowledged_end.max(request.file_end());
                    // Only now: an fsync that took the set before this write landed must not
                    // count it as synced.
                    state.unsynced_stripes.insert(request.stripe_index);
                }
                Err(error) => {
                    if state.first_error.is_none() {
                        tracing::debug!(inode = self.inode, %error, "write failed; the handle reports it next");
                        state.first_error = Some(error);
                    }
                }
            }
        }
        self.notify();
    }

    async fn commit_size(&self, size_bytes: u64, durable: bool) -> Result<Attr, ClientError> {
        let inode = self.inode;
        let space = self
            .lock()
            .stripe_space
            .iter()
            .map(|(&stripe_index, space)| StripeSpace {
                stripe_index,
                allocated_bytes: space.allocated_bytes,
                stamp: space.stamp,
            })
            .collect();
        let request = CommitSize {
            inode,
            size_bytes,
            modify_time: now(),
            space,
            durable,
        };
        self.client
            .shared
            .pool
            .meta_call(&request, || format!("inode {inode} size {size_bytes}"))
            .await
    }

    /// Record the reply to a commit: absorbed only if no truncation started since it was
    /// computed (its size may be from before the truncation).
    fn finish_commit(&self, ticket: &CommitTicket, result: &Result<Attr, ClientError>) {
        {
            let mut state = self.lock();
            state.commits_running -= 1;
            state.last_commit = Instant::now();
            match result {
                Ok(attr) if ticket.truncate_epoch == state.truncate_epoch => {
                    state.absorb_attr(attr.clone());
                    state.writes_committed = state.writes_committed.max(ticket.covers_writes);
                }
                Ok(_) => tracing::debug!(
                    inode = self.inode,
                    size_bytes = ticket.size_bytes,
                    "dropping the reply to a size commit computed before a truncation"
                ),
                Err(_) => {}
            }
        }
        self.notify();
    }

    /// Start a background size commit if the interval has passed since the last one.
    fn commit_if_due(self: &Arc<Self>) {
        let interval = Duration::from_millis(self.client.shared.config.size_commit_interval_ms);
        let ticket = {
            let mut state = self.lock();
            let due = state.commits_running == 0
                && state.truncates_pending == 0
                && state.writes_started != state.writes_committed
                && state.last_commit.elapsed() >= interval;
            if !due {
                return;
            }
            // Only acknowledged bytes: readers elsewhere should not see a size that covers
            // data still on its way. It covers no new writes: some may still be in flight.
            let covers_writes = state.writes_committed;
            state.start_commit(covers_writes, false)
        };
        let commit = self.spawn_commit(ticket);
        let inode = self.inode;
        tokio::spawn(async move {
            // Not fatal: the next flush, fsync or close commits again and reports.
            if let Ok(Err(error)) = commit.await {
                tracing::warn!(inode, %error, "background size commit failed");
            }
        });
    }

    /// Send a commit and record its reply on a task of its own: a caller that stops
    /// waiting (a cancelled flush) must not leave it counted as running forever, nor
    /// unrecorded while the request may still reach the meta server.
    fn spawn_commit(
        self: &Arc<Self>,
        ticket: CommitTicket,
    ) -> tokio::task::JoinHandle<Result<Attr, ClientError>> {
        let handle = self.clone();
        tokio::spawn(async move {
            let result = handle.commit_size(ticket.size_bytes, ticket.durable).await;
            handle.finish_commit(&ticket, &result);
            result
        })
    }

    /// The sequence number of the last write started: what a call that must see every
    /// earlier write waits for.
    fn writes_started(&self) -> u64 {
        self.lock().writes_started
    }

    /// Wait for the writes up to sequence `through`, report a failed one, and commit the
    /// size if anything was written since the last commit. With `durable`, the metadata is
    /// durable at the meta server when this returns (the commit is made durable, or, with
    /// nothing to commit, everything answered so far is: the file's create too).
    async fn flush_through(
        self: &Arc<Self>,
        through: u64,
        durable: bool,
    ) -> Result<(), ClientError> {
        if !self.access.write {
            if durable {
                self.client.shared.pool.sync_meta().await?;
            }
            return Ok(());
        }
        let ticket = self
            .wait_then(|state| {
                if !state.writes_done_through(through) || state.truncates_pending > 0 {
                    return None;
                }
                if let Some(error) = state.earlier_write_error(self.inode) {
                    return Some(Err(error));
                }
                let covers_writes = through.min(state.writes_started);
                if state.writes_committed >= covers_writes {
                    return Some(Ok(None));
                }
                Some(Ok(Some(state.start_commit(covers_writes, durable))))
            })
            .await?;
        let Some(ticket) = ticket else {
            if durable {
                self.client.shared.pool.sync_meta().await?;
            }
            return Ok(());
        };
        match self.spawn_commit(ticket).await {
            Ok(result) => result.map(|_| ()),
            // Only if the runtime is shutting down.
            Err(error) => Err(ClientError::inode(
                self.inode,
                ErrorCode::Io,
                format!("the size commit task ended early: {error}"),
            )),
        }
    }

    async fn flush(self: &Arc<Self>) -> Result<(), ClientError> {
        self.send_gathered().await?;
        self.flush_through(self.writes_started(), false).await
    }

    async fn fsync(self: &Arc<Self>) -> Result<(), ClientError> {
        if !self.access.write {
            // Nothing of this handle's to sync; the file's own metadata still must be.
            return self.client.shared.pool.sync_meta().await;
        }
        self.send_gathered().await?;
        let through = self.writes_started();
        let layout = self.data_layout()?.clone();
        // Taken under the lock that sees the writes done: every write acknowledged by then
        // is in the set.
        let stripes = self
            .wait_then(|state| {
                if !state.writes_done_through(through) {
                    return None;
                }
                if let Some(error) = state.earlier_write_error(self.inode) {
                    return Some(Err(error));
                }
                Some(Ok(std::mem::take(&mut state.unsynced_stripes)))
            })
            .await?;
        let syncs = stripes.iter().map(|&stripe_index| {
            let request = SyncObjects {
                objects: vec![ObjectId {
                    inode: self.inode,
                    stripe_index,
                }],
            };
            let layout = &layout;
            async move {
                self.client
                    .shared
                    .pool
                    .chain_sync(layout, stripe_index, self.inode, &request, || {
                        format!("of inode {} stripe {stripe_index}", self.inode)
                    })
                    .await
            }
        });
        if let Err(error) = futures::future::try_join_all(syncs).await {
            // Bytes acknowledged but not synced may be lost with that server: the handle
            // reports the failure from now on.
            let mut state = self.lock();
            state.unsynced_stripes.extend(stripes);
            if state.first_error.is_none() {
                state.first_error = Some(error.clone());
            }
            return Err(error);
        }
        self.flush_through(through, true).await
    }

    async fn read_piece(
        &self,
        layout: &Layout,
        request: &ObjectRequest,
    ) -> Result<Bytes, ClientError> {
        let object = ObjectId {
            inode: self.inode,
            stripe_index: request.stripe_index,
        };
        if let Some(data) = self.read_local(layout, request).await? {
            return Ok(data);
        }
        // A request is at most IO_REQUEST_BYTES_MAX, which fits u32.
        let read = ReadObject {
            object,
            offset: request.object_offset,
            length: request.length as u32,
            map_version: 0,
        };
        let server_id = layout.servers[request.stripe_index as usize];
        let (reply, payload) = self
            .client
            .shared
            .pool
            .chain_read(layout, request.stripe_index, self.inode, &read, || {
                format!(
                    "of {} bytes at inode {} stripe {} offset {}",
                    request.length, self.inode, request.stripe_index, request.object_offset
                )
            })
            .await?;
        if reply.length as usize != payload.len() || payload.len() as u64 > request.length {
            return Err(ClientError::inode(
                self.inode,
                ErrorCode::Protocol,
                format!(
                    "I/O server {server_id} answered a read of {} bytes with {} bytes (header says {})",
                    request.length,
                    payload.len(),
                    reply.length
                ),
            ));
        }
        if !payload.is_empty() {
            // The object exists now: the next read may ask for its descriptor.
            let mut local = self.local.lock().expect("not poisoned");
            if matches!(local.get(&request.stripe_index), Some(LocalStripe::Missing)) {
                local.remove(&request.stripe_index);
            }
        }
        Ok(payload)
    }

    /// Ask the server of stripe `stripe_index` for its object's descriptor, and note the
    /// answer; None when the read goes through the RPC path.
    async fn open_local(
        &self,
        layout: &Layout,
        stripe_index: u32,
    ) -> Option<Arc<crate::local::LocalObject>> {
        let pool = &self.client.shared.pool;
        let server_id = layout.servers[stripe_index as usize];
        let address = match pool.io_address(server_id) {
            Some(address) => address,
            None => {
                // Not learned yet (the RPC path would ask the same).
                let _ = pool.refresh_servers().await;
                pool.io_address(server_id)?
            }
        };
        if freeflow_rpc::unix_socket_path(&address).is_none() {
            let mut local = self.local.lock().expect("not poisoned");
            local.insert(stripe_index, LocalStripe::Remote);
            return None;
        }
        let object_id = ObjectId {
            inode: self.inode,
            stripe_index,
        };
        let opened = self
            .client
            .shared
            .local
            .open(server_id, &address, object_id)
            .await;
        let mut local = self.local.lock().expect("not poisoned");
        match opened {
            crate::local::Opened::Object(object) => {
                local.insert(stripe_index, LocalStripe::Open(Arc::clone(&object)));
                Some(object)
            }
            crate::local::Opened::Missing => {
                local.insert(stripe_index, LocalStripe::Missing);
                None
            }
            crate::local::Opened::Unavailable => {
                local.remove(&stripe_index);
                None
            }
        }
    }

    /// A piece read from an object of an I/O server on this host through its descriptor
    /// (`local.rs`); None when it must go through the RPC path: a replicated stripe (a
    /// copy may lag its chain's head), a server elsewhere or not handing descriptors out,
    /// a missing object.
    async fn read_local(
        &self,
        layout: &Layout,
        request: &ObjectRequest,
    ) -> Result<Option<Bytes>, ClientError> {
        let shared = &self.client.shared;
        if !layout.copies.is_empty() || !shared.local.enabled() {
            return Ok(None);
        }
        let stripe_index = request.stripe_index;
        let known = || {
            self.local
                .lock()
                .expect("not poisoned")
                .get(&stripe_index)
                .cloned()
        };
        let object = match known() {
            Some(LocalStripe::Open(object)) if object.usable() => object,
            Some(LocalStripe::Missing | LocalStripe::Remote) => return Ok(None),
            _ => {
                // One question per stripe however many pieces of a read want it.
                let _opening = self.local_opening.lock().await;
                match known() {
                    Some(LocalStripe::Open(object)) if object.usable() => object,
                    Some(LocalStripe::Missing | LocalStripe::Remote) => return Ok(None),
                    _ => match self.open_local(layout, stripe_index).await {
                        // Checked like a kept one: the gate may have closed since.
                        Some(object) if object.usable() => object,
                        _ => return Ok(None),
                    },
                }
            }
        };
        // A request is at most IO_REQUEST_BYTES_MAX, which fits usize.
        let data = object
            .read(request.object_offset, request.length as usize)
            .await
            .map_err(|error| {
                ClientError::inode(
                    self.inode,
                    ErrorCode::Io,
                    format!(
                        "local read of {} bytes at stripe {stripe_index} offset {} failed: {error}",
                        request.length, request.object_offset
                    ),
                )
            })?;
        shared.pool.metrics.read_locally(data.len() as u64);
        Ok(Some(data))
    }

    pub(crate) fn inode(&self) -> InodeId {
        self.inode
    }

    /// The handle as a reclaim after a restart of the meta server names it, with the
    /// session it was opened in; None once closed.
    pub(crate) fn reclaimed(&self) -> Option<(u64, freeflow_proto::meta::ReclaimedHandle)> {
        if self.closed.load(Ordering::Acquire) || self.lost.load(Ordering::Acquire) {
            return None;
        }
        Some((
            self.session_id,
            freeflow_proto::meta::ReclaimedHandle {
                handle_id: self.handle_id,
                inode: self.inode,
                access: self.access,
            },
        ))
    }

    /// Whether the handle was opened for writing.
    pub(crate) fn opened_for_writing(&self) -> bool {
        self.access.write
    }

    /// Read `[offset, offset + length)` from the servers, every request at once, kept as
    /// their replies (see `Segments`: a reader takes views of them); holes and short
    /// objects read as zeros (the caller clamped the range to the size).
    async fn fetch_segments(
        &self,
        layout: &Layout,
        offset: u64,
        length: u64,
    ) -> Result<Segments, ClientError> {
        let requests = plan_requests(layout, offset, length, u64::from(IO_REQUEST_BYTES_MAX));
        let pieces = futures::future::try_join_all(
            requests
                .iter()
                .map(|request| self.read_piece(layout, request)),
        )
        .await?;
        let mut replies: Vec<(&ObjectRequest, Bytes)> = requests.iter().zip(pieces).collect();
        replies.sort_by_key(|(request, _)| request.file_offset);
        let mut segments = Segments::default();
        for (request, piece) in replies {
            let short = request.length - piece.len() as u64;
            segments.push(request.file_offset, piece);
            if short > 0 {
                // A hole or a short object: zeros up to the request's end.
                let at = request.file_offset + request.length - short;
                segments.push(at, Bytes::from(vec![0u8; short as usize]));
            }
        }
        Ok(segments)
    }

    /// A read with read-ahead (see `readahead.rs`): the pieces covering the range, fetched
    /// ahead or started now, and, for a sequential reader, the next `readahead_bytes`
    /// fetched ahead. The caller waited for this handle's writes to the range.
    async fn read_ahead(
        self: &Arc<Self>,
        layout: &Layout,
        offset: u64,
        length: u64,
    ) -> Result<Segments, ClientError> {
        let piece_bytes = readahead_piece_bytes(layout);
        let end = offset + length;
        let (first, last) = (offset / piece_bytes, (end - 1) / piece_bytes);
        let sequential = {
            let mut state = self.lock();
            // The first read of a handle never is sequential, so a file read once at its
            // start costs no read-ahead.
            let sequential = state.readahead.follows(offset, end, first);
            // Reads longer than a piece are fetched as they are (all their requests at
            // once already), without read-ahead.
            if !sequential
                || state.readahead.suspended
                || state.readahead.changing > 0
                || length > piece_bytes
            {
                state.readahead.clear();
                false
            } else {
                state.readahead.drop_behind(offset, piece_bytes);
                true
            }
        };
        if !sequential {
            return self.fetch_segments(layout, offset, length).await;
        }
        // This read's pieces and the next ones start on their way (those not already),
        // before this read waits for its own; none while a change of this handle is under
        // way (the read waited only for its own range) or past the client's room.
        self.fetch_ahead(layout, first, end);
        let needed: Option<Vec<(u64, Fetched)>> = {
            let state = self.lock();
            (first..=last)
                .map(|index| {
                    state
                        .readahead
                        .pieces
                        .get(&index)
                        .map(|piece| (index, piece.fetched.clone()))
                })
                .collect()
        };
        let Some(needed) = needed else {
            return self.fetch_segments(layout, offset, length).await;
        };
        let mut datas = Vec::with_capacity(needed.len());
        for (_, fetched) in &needed {
            match fetched.clone().await {
                Some(data) => datas.push(data),
                // Stopped by a change meanwhile, or failed: read the range itself (a
                // failed piece goes, so the next read fetches it again).
                None => {
                    self.forget_pieces(&needed);
                    return self.fetch_segments(layout, offset, length).await;
                }
            }
        }
        // The range as views of the pieces' replies (no copy); what they do not cover (the
        // file grew since they were fetched) is read directly.
        let mut range = Segments::default();
        let mut contiguous = true;
        for data in &datas {
            contiguous = contiguous && data.views_into(offset, end, &mut range);
        }
        if contiguous && range.len() as u64 == length {
            Ok(range)
        } else {
            // Fetched before the file grew past them: they go, and are fetched again.
            self.forget_pieces(&needed);
            self.fetch_segments(layout, offset, length).await
        }
    }

    /// Drop those of `pieces` still in the read-ahead (not replaced meanwhile).
    fn forget_pieces(&self, pieces: &[(u64, Fetched)]) {
        let mut state = self.lock();
        for (index, fetched) in pieces {
            if state
                .readahead
                .pieces
                .get(index)
                .is_some_and(|piece| piece.fetched.ptr_eq(fetched))
            {
                state.readahead.pieces.remove(index);
            }
        }
    }

    /// Fetch ahead the pieces from index `from` on, up to `readahead_bytes` past `end`
    /// and within the size; not while this handle has a change under way, and not past
    /// the client's room.
    fn fetch_ahead(self: &Arc<Self>, layout: &Layout, from: u64, end: u64) {
        let piece_bytes = readahead_piece_bytes(layout);
        let window_end = end.saturating_add(self.client.shared.config.readahead_bytes);
        let mut state = self.lock();
        if state.changing_data() || state.readahead.suspended {
            return;
        }
        let size = state.known_size;
        let mut index = from;
        while index * piece_bytes < window_end.min(size) {
            if let std::collections::btree_map::Entry::Vacant(vacant) =
                state.readahead.pieces.entry(index)
            {
                let start = index * piece_bytes;
                let length = (start + piece_bytes).min(size) - start;
                // A piece is at most 16 MiB, well within u32.
                let Ok(permit) = self
                    .client
                    .shared
                    .readahead_room
                    .clone()
                    .try_acquire_many_owned(length as u32)
                else {
                    return;
                };
                let (shared, layout) = (self.clone(), layout.clone());
                let task =
                    tokio::spawn(
                        async move { shared.fetch_segments(&layout, start, length).await },
                    );
                vacant.insert(Piece::new(task, permit));
            }
            index += 1;
        }
    }

    pub(crate) fn local_size(&self) -> u64 {
        self.lock().known_size
    }

    /// Flush and close at the meta server; the handle is unusable afterwards. With
    /// `deferred`, the close at the meta server is queued (see `closer.rs`) and not waited
    /// for: the flush is.
    async fn close(self: &Arc<Self>, deferred: bool) -> Result<(), ClientError> {
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
                    .shared
                    .closer
                    .close_later(session_id, handle_id)
                    .await;
            }
            return flushed;
        }
        let (closed, resent) = self
            .client
            .shared
            .pool
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
                        || self.opened_epoch != self.client.shared.pool.lease_epoch()
                        || self.session_epoch != self.client.shared.pool.lease_epoch()) =>
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

/// The size of a piece fetched ahead: one stripe row (every server of the layout reads at
/// once), within 1-16 MiB.
fn readahead_piece_bytes(layout: &Layout) -> u64 {
    (u64::from(layout.stripe_unit_bytes) * u64::from(layout.stripe_count()))
        .clamp(1 << 20, 16 << 20)
}

impl FileHandle {
    pub(crate) fn new(
        client: Client,
        attr: Attr,
        handle_id: u64,
        session_id: u64,
        access: OpenAccess,
    ) -> FileHandle {
        let (completions, _) = watch::channel(0);
        let layout = attr.layout.clone();
        let opened_epoch = client.shared.pool.lease_epoch();
        let session_epoch = if session_id == client.session_id() {
            client.shared.session_epoch.load(Ordering::Acquire)
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
            state: Mutex::new(HandleState {
                known_size: attr.size_bytes,
                attr,
                written_end: 0,
                acknowledged_end: 0,
                pending_extension: None,
                writes_started: 0,
                writes_committed: 0,
                last_commit: Instant::now(),
                commits_running: 0,
                truncates_pending: 0,
                truncate_epoch: 0,
                first_error: None,
                in_flight: BTreeMap::new(),
                writes_outstanding: BTreeMap::new(),
                unsynced_stripes: BTreeSet::new(),
                stripe_space: BTreeMap::new(),
                gathered: None,
                gather_generation: 0,
                parked: BTreeMap::new(),
                parked_bytes: 0,
                park_timer: false,
                batches_in_transit: 0,
                charged_through: BTreeMap::new(),
                readahead: ReadAhead::default(),
            }),
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
        attr.size_bytes = state.known_size;
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
    /// [`Client::setattr`]).
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

    /// The size this handle knows, including its own writes not yet committed.
    pub fn size(&self) -> u64 {
        self.shared.local_size()
    }

    /// The file's attributes as the meta server has them now.
    async fn fetch_attr(&self) -> Result<Attr, ClientError> {
        let inode = self.shared.inode;
        self.shared
            .client
            .shared
            .pool
            .meta_call(&GetAttr { inode }, || format!("inode {inode}"))
            .await
    }

    /// Raise the known size to the meta server's if that is larger (another client's
    /// committed appends); never lowers it, so a reply older than this handle's own
    /// truncation or size commit cannot undo them. Returns the known size.
    pub async fn learn_growth(&self) -> Result<u64, ClientError> {
        let epoch = self.shared.lock().truncate_epoch;
        let attr = self.fetch_attr().await?;
        let mut state = self.shared.lock();
        // A truncation through this handle since the request: the reply may predate it.
        let truncated = state.truncate_epoch != epoch || state.truncates_pending > 0;
        if attr.size_bytes > state.known_size && !truncated {
            state.readahead.clear();
            state.known_size = attr.size_bytes;
        }
        Ok(state.known_size)
    }

    /// Fetch the attributes from the meta server again (to see other clients' committed
    /// writes; close-to-open does not need it).
    pub async fn refresh(&self) -> Result<Attr, ClientError> {
        let attr = self.fetch_attr().await?;
        let mut state = self.shared.lock();
        if attr.generation < state.attr.generation {
            // Older than what the handle took from a reply that came meanwhile (its own
            // size commit or truncation): taken, it would set the size back below bytes
            // written and committed here, and reads would stop short of them.
            let mut attr = state.attr.clone();
            attr.size_bytes = state.known_size;
            return Ok(attr);
        }
        // A refresh sees other clients' changes: so must the next read.
        state.readahead.clear();
        state.readahead.suspended = false;
        let uncommitted = state.writes_started != state.writes_committed || state.holds_unsent();
        state.known_size = if uncommitted {
            attr.size_bytes.max(state.written_end)
        } else {
            attr.size_bytes
        };
        state.attr = attr;
        let mut attr = state.attr.clone();
        attr.size_bytes = state.known_size;
        Ok(attr)
    }

    /// Read up to `length` bytes at `offset`; shorter only at the end of the file. Holes
    /// read as zeros. Sees every write made through this handle before the call (it waits
    /// for those still in flight that overlap the range).
    pub async fn read_at(&self, offset: u64, length: u64) -> Result<Bytes, ClientError> {
        let segments = self.read_segments(offset, length).await?;
        Ok(segments.range(offset, offset + segments.len() as u64))
    }

    /// As [`FileHandle::read_at`], the bytes as the servers' replies hold them, in file
    /// order, never copied together (a reader that writes them on, such as `freeflow cp`,
    /// saves a copy of every byte).
    pub async fn read_parts_at(&self, offset: u64, length: u64) -> Result<Vec<Bytes>, ClientError> {
        Ok(self.read_segments(offset, length).await?.into_parts())
    }

    /// The bytes of a read, as replies (see `Segments`): empty at or past the end.
    async fn read_segments(&self, offset: u64, length: u64) -> Result<Segments, ClientError> {
        let shared = &self.shared;
        shared.check_open()?;
        if !shared.access.read {
            return Err(ClientError::inode(
                shared.inode,
                ErrorCode::BadHandle,
                "the handle is not open for reading",
            ));
        }
        let layout = shared.data_layout()?;
        let mut size = shared.local_size();
        if offset.saturating_add(length) > size
            && shared.changed_elsewhere.swap(false, Ordering::AcqRel)
        {
            size = self.learn_growth().await?;
        }
        if length == 0 || offset >= size {
            return Ok(Segments::default());
        }
        let length = length.min(size - offset);
        if length > READ_LENGTH_MAX {
            return Err(ClientError::inode(
                shared.inode,
                ErrorCode::InvalidArgument,
                format!("a read of {length} bytes is above the bound of {READ_LENGTH_MAX}"),
            ));
        }
        let requests = plan_requests(layout, offset, length, u64::from(IO_REQUEST_BYTES_MAX));
        // This handle's own writes to the range land first, so it reads what it wrote.
        shared.send_gathered().await?;
        shared
            .wait_until(|state| {
                requests
                    .iter()
                    .all(|request| !state.overlaps_in_flight(request))
            })
            .await;
        if shared.client.shared.config.readahead_bytes > 0 {
            return shared.read_ahead(layout, offset, length).await;
        }
        shared.fetch_segments(layout, offset, length).await
    }

    /// Grow the file to at least `end` bytes without writing a byte there: a writeback
    /// mount's write-back that ends past what its host knows the file holds, but whose last
    /// bytes are the kernel's filling, not the host's own (`fuse/src/shadow.rs`; writing
    /// them would put zeros over another client's bytes). The size is committed like a
    /// write's end (a maximum at the meta server) by the first commit after every write
    /// started before this call is acknowledged (readers elsewhere never see a size
    /// covering bytes still on their way); reads here see it at once.
    pub fn extend_to(&self, end: u64) -> Result<(), ClientError> {
        let shared = &self.shared;
        shared.check_open()?;
        shared.require_write()?;
        {
            let mut state = shared.lock();
            state.known_size = state.known_size.max(end);
            state.written_end = state.written_end.max(end);
            // A change like a write: the next flush commits the size.
            state.writes_started += 1;
            let through = state.writes_started;
            let end = state
                .pending_extension
                .map_or(end, |(_, pending)| pending.max(end));
            state.pending_extension = Some((through, end));
        }
        shared.notify();
        Ok(())
    }

    /// Write `data` at `offset`. Returns once every request is in flight, gathered or
    /// parked (see the module doc); a failure is
    /// reported by the next write, flush, fsync or close.
    pub async fn write_at(&self, offset: u64, data: Bytes) -> Result<(), ClientError> {
        let shared = &self.shared;
        shared.check_open()?;
        if !shared.access.write {
            return Err(ClientError::inode(
                shared.inode,
                ErrorCode::BadHandle,
                "the handle is not open for writing",
            ));
        }
        let Some(end) = shared.check_write(offset, data.len())? else {
            return Ok(());
        };
        // Room for what the write adds, before it is acknowledged: a write with no room
        // fails here, with nothing of it sent. Before the turn: the servers' answers must
        // not hold up what is gathered or parked.
        let needs = shared.space_needs(offset, end);
        shared.take_needs(offset, end, &needs).await?;
        let written = async {
            let turn = shared.send_turn().await;
            // A close that took the turn first has flushed without this write: it must
            // fail (close takes the turn after marking the handle closed).
            shared.check_open()?;
            // Small writes just past what is gathered join it, and are sent with it.
            if shared.try_gather(offset, &data, end) {
                return Ok(());
            }
            let gathering = shared.client.shared.config.gather_wait_ms > 0;
            // A small write that makes a parked piece's stripe unit whole goes with it (the
            // kernel's direct writes from a buffer not aligned to a page end each stripe unit
            // with such a write: the pages it could pin fell short by the misalignment).
            if gathering
                && (data.len() >= GATHER_WRITE_MAX || shared.completes_parked(offset, end)?)
            {
                return shared.write_in_units(turn, offset, data).await;
            }
            let (sent, _turn) = shared.send_gathered_ordered(turn).await;
            sent?;
            if data.len() < GATHER_WRITE_MAX && gathering {
                shared.start_gathering(offset, &data, end);
                return Ok(());
            }
            shared.start_write(offset, data).await
        }
        .await;
        if written.is_err() {
            // Not acknowledged: what it took goes back (its requests, if any went, carry
            // their own charges).
            shared.client.shared.space.put_back(&needs);
        }
        written
    }

    /// Write a small `data` at `offset` without waiting: it joins the writes this handle
    /// is gathering (it starts where they end, and fits), or, when the turn to send is
    /// free, what is gathered goes on its way on a task and it begins the next gathering:
    /// the mount's fast path for small writes. Ok(false): nothing was done, use
    /// [`FileHandle::write_at`]. Call it inside a tokio runtime's context.
    pub fn write_gathered(&self, offset: u64, data: &[u8]) -> Result<bool, ClientError> {
        let shared = &self.shared;
        let Some(end) = shared.check_write(offset, data.len())? else {
            return Ok(true);
        };
        // Room for what it adds must be held already: asking takes the long way.
        let needs = shared.space_needs(offset, end);
        if !shared.client.shared.space.try_take(&needs) {
            return Ok(false);
        }
        if shared.try_gather(offset, data, end) || shared.try_gather_anew(offset, data, end) {
            return Ok(true);
        }
        shared.client.shared.space.put_back(&needs);
        Ok(false)
    }

    /// Change the storage of a range without writing through it: preallocate, punch a
    /// hole, or zero it (`fallocate(2)`). Ordered after every write started on this handle
    /// before the call. Without `keep_size`, allocating or zeroing past the end grows the
    /// file as a write would (committed at the next flush, fsync or close).
    pub async fn allocate(
        &self,
        offset: u64,
        length: u64,
        how: Allocation,
    ) -> Result<(), ClientError> {
        let shared = &self.shared;
        shared.check_open()?;
        shared.require_write()?;
        let _change = ChangeUnderWay::begin(shared);
        shared.send_gathered().await?;
        shared.check_no_failed_write()?;
        let layout = shared.data_layout()?.clone();
        if length == 0 {
            return Err(ClientError::inode(
                shared.inode,
                ErrorCode::InvalidArgument,
                "an allocation of 0 bytes",
            ));
        }
        let end = shared.checked_end(offset, length)?;
        let (mode, grows) = match how {
            Allocation::Allocate { keep_size } => (AllocateMode::Allocate, !keep_size),
            Allocation::PunchHole => (AllocateMode::PunchHole, false),
            Allocation::ZeroRange { keep_size } => (AllocateMode::ZeroRange, !keep_size),
        };
        let through = shared.writes_started();
        shared
            .wait_until(|state| state.writes_done_through(through))
            .await;
        // Each stripe's share of a file range is one contiguous range of its object, sent
        // in pieces of at most ALLOCATE_BYTES_MAX (the servers' bound per request).
        let mut requests: Vec<(u32, AllocateObject)> = Vec::new();
        for stripe_index in 0..layout.stripe_count() {
            let mut start = layout.object_length(offset, stripe_index);
            let stop = layout.object_length(end, stripe_index);
            while start < stop {
                let length = (stop - start).min(ALLOCATE_BYTES_MAX);
                requests.push((
                    stripe_index,
                    AllocateObject {
                        object: ObjectId {
                            inode: shared.inode,
                            stripe_index,
                        },
                        offset: start,
                        length,
                        mode,
                        map_version: 0,
                        forward: Vec::new(),
                    },
                ));
                start += length;
            }
        }
        let calls = requests.iter().map(|(stripe_index, request)| {
            let layout = &layout;
            async move {
                let make = |map_version, forward| AllocateObject {
                    map_version,
                    forward,
                    ..request.clone()
                };
                let (space, _) = shared
                    .client
                    .shared
                    .pool
                    .chain_write(
                        layout,
                        *stripe_index,
                        shared.inode,
                        make,
                        Bytes::new(),
                        || {
                            format!(
                                "{mode:?} of {} bytes at inode {} stripe {stripe_index} offset {}",
                                request.length, shared.inode, request.offset
                            )
                        },
                    )
                    .await?;
                Ok::<_, ClientError>((*stripe_index, space))
            }
        });
        let spaces = futures::future::try_join_all(calls).await?;
        {
            let mut state = shared.lock();
            for (stripe_index, space) in spaces {
                state.note_space(stripe_index, space);
                state.unsynced_stripes.insert(stripe_index);
            }
            if grows {
                state.known_size = state.known_size.max(end);
                state.written_end = state.written_end.max(end);
                state.acknowledged_end = state.acknowledged_end.max(end);
            }
            // A change like a write: the next flush commits the size and the space.
            state.writes_started += 1;
        }
        shared.notify();
        Ok(())
    }

    /// Copy `length` bytes at `source_offset` of `source` to `target_offset` of this file
    /// (`copy_file_range(2)`); returns the bytes copied, fewer only when the source ends
    /// first. Pieces whose source and target objects are on one I/O server are copied
    /// there (`CopyObjectRange`: the data never leaves it); the others are read and written
    /// through this client. Ordered after every write started on either handle before the
    /// call; the copy is written like a write (durable at fsync, errors reported by then
    /// at the latest).
    pub async fn copy_range_from(
        &self,
        source: &FileHandle,
        source_offset: u64,
        target_offset: u64,
        length: u64,
    ) -> Result<u64, ClientError> {
        let target = &self.shared;
        let origin = &source.shared;
        target.check_open()?;
        origin.check_open()?;
        target.require_write()?;
        let _change = ChangeUnderWay::begin(target);
        target.send_gathered().await?;
        origin.send_gathered().await?;
        if !origin.access.read {
            return Err(ClientError::inode(
                origin.inode,
                ErrorCode::BadHandle,
                "the source handle is not open for reading",
            ));
        }
        target.check_no_failed_write()?;
        let target_layout = target.data_layout()?.clone();
        let source_layout = origin.data_layout()?.clone();
        let length = length.min(COPY_LENGTH_MAX);
        for shared in [origin, target] {
            let through = shared.writes_started();
            shared
                .wait_until(|state| state.writes_done_through(through))
                .await;
        }
        let source_size = origin.local_size();
        if length == 0 || source_offset >= source_size {
            return Ok(0);
        }
        let length = length.min(source_size - source_offset);
        target.checked_end(target_offset, length)?;
        if origin.inode == target.inode
            && source_offset < target_offset + length
            && target_offset < source_offset + length
        {
            return Err(ClientError::inode(
                target.inode,
                ErrorCode::InvalidArgument,
                "the source and target ranges of a copy within one file overlap",
            ));
        }
        let pieces = plan_copy(
            &source_layout,
            source_offset,
            &target_layout,
            target_offset,
            length,
        );
        let copies = pieces.into_iter().map(|piece| {
            let (source_layout, target_layout) = (&source_layout, &target_layout);
            async move {
                let target_server = target_layout.servers[piece.target.stripe_index as usize];
                if crate::replicated::same_single_server(
                    source_layout,
                    piece.source.stripe_index,
                    target_layout,
                    piece.target.stripe_index,
                ) {
                    let request = CopyObjectRange {
                        source: ObjectId {
                            inode: origin.inode,
                            stripe_index: piece.source.stripe_index,
                        },
                        source_offset: piece.source.object_offset,
                        target: ObjectId {
                            inode: target.inode,
                            stripe_index: piece.target.stripe_index,
                        },
                        target_offset: piece.target.object_offset,
                        // A piece is at most IO_REQUEST_BYTES_MAX, which fits u32.
                        length: piece.source.length as u32,
                    };
                    let (space, _) = target
                        .client
                        .shared
                        .pool
                        .io_call(target_server, target.inode, &request, Bytes::new(), || {
                            format!(
                                "of {} bytes from inode {} to inode {} on one server",
                                piece.source.length, origin.inode, target.inode
                            )
                        })
                        .await?;
                    let piece_end = piece.target.file_offset + piece.source.length;
                    Ok::<_, ClientError>(Some((piece.target.stripe_index, space, piece_end)))
                } else {
                    let data = origin.read_piece(source_layout, &piece.source).await?;
                    let data = if data.len() as u64 == piece.source.length {
                        data
                    } else {
                        // Past the source object's end it reads as zeros.
                        let mut filled = BytesMut::zeroed(piece.source.length as usize);
                        filled[..data.len()].copy_from_slice(&data);
                        filled.freeze()
                    };
                    self.write_at(piece.target.file_offset, data).await?;
                    Ok(None)
                }
            }
        });
        let done: Vec<Option<(u32, ObjectSpace, u64)>> = futures::stream::iter(copies)
            .buffer_unordered(COPY_PIECES_IN_FLIGHT_MAX)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        let end = target_offset + length;
        {
            let mut state = target.lock();
            for (stripe_index, space, piece_end) in done.into_iter().flatten() {
                state.note_space(stripe_index, space);
                state.unsynced_stripes.insert(stripe_index);
                // Copied on its server: acknowledged. Pieces written through this client
                // raise `acknowledged_end` themselves when their writes are answered.
                state.acknowledged_end = state.acknowledged_end.max(piece_end);
            }
            state.known_size = state.known_size.max(end);
            state.written_end = state.written_end.max(end);
            state.writes_started += 1;
        }
        target.notify();
        Ok(length)
    }

    /// Write `data` at the end of the file as this handle knows it; returns the offset used.
    /// Appends through one handle never overlap; appends from several clients at once are
    /// not ordered against each other (the size is committed lazily).
    pub async fn append(&self, data: Bytes) -> Result<u64, ClientError> {
        self.shared.check_open()?;
        self.shared.check_no_failed_write()?;
        let length = data.len() as u64;
        let (offset, needs) = {
            let mut state = self.shared.lock();
            let offset = state.known_size;
            let end = offset.saturating_add(length);
            let needs = match &self.shared.layout {
                Some(layout) => crate::space::needs(layout, offset, end),
                None => Vec::new(),
            };
            state.known_size = end;
            (offset, needs)
        };
        // The appended bytes are past the size this handle knew: they take space (the
        // size was raised first, so `write_at` sees none to take).
        if let Err(error) = self
            .shared
            .take_needs(offset, offset + length, &needs)
            .await
        {
            let mut state = self.shared.lock();
            if state.known_size == offset + length {
                state.known_size = offset;
            }
            return Err(error);
        }
        if let Err(error) = self.write_at(offset, data).await {
            self.shared.client.shared.space.put_back(&needs);
            return Err(error);
        }
        Ok(offset)
    }

    /// Make every byte written through this handle durable on its servers and commit the
    /// size and mtime at the meta server.
    pub async fn fsync(&self) -> Result<(), ClientError> {
        self.shared.check_open()?;
        self.shared.fsync().await
    }

    /// Wait for the writes in flight and commit the size (close-time flush, no disk sync).
    pub async fn flush(&self) -> Result<(), ClientError> {
        self.shared.check_open()?;
        self.shared.flush().await
    }

    /// Whether [`FileHandle::flush`] would do nothing now: open, nothing gathered or parked, no write
    /// in flight or uncommitted, no truncation or size commit running, no failure to report
    /// (a file closed without being written).
    pub fn flush_is_empty(&self) -> bool {
        if self.shared.closed.load(Ordering::Acquire) {
            return false;
        }
        let state = self.shared.lock();
        !state.holds_unsent()
            && state.writes_outstanding.is_empty()
            && state.truncates_pending == 0
            && state.commits_running == 0
            && state.first_error.is_none()
            && state.writes_committed >= state.writes_started
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(pieces: &[(u64, usize)]) -> BTreeMap<u64, ParkedPiece> {
        pieces
            .iter()
            .map(|&(offset, length)| {
                let piece = ParkedPiece {
                    data: Bytes::from(vec![0u8; length]),
                    held: length,
                    since: Instant::now(),
                };
                (offset, piece)
            })
            .collect()
    }

    /// The short write a direct write from an unaligned buffer ends each unit with makes
    /// the unit whole with its parked piece; a write that leaves a gap, crosses the unit's
    /// end, overlaps a piece or finds nothing parked does not.
    #[test]
    fn a_short_write_completes_the_unit_its_parked_piece_began() {
        let unit = 1 << 20;
        let head = parked(&[(3 * unit, unit as usize - 16)]);
        assert!(completes_unit(&head, 4 * unit - 16, 4 * unit, unit));
        assert!(
            !completes_unit(&head, 4 * unit - 8, 4 * unit, unit),
            "a gap"
        );
        assert!(
            !completes_unit(&head, 4 * unit - 16, 4 * unit + 8, unit),
            "past the unit"
        );
        assert!(
            !completes_unit(&head, 4 * unit - 20, 4 * unit - 4, unit),
            "overlaps"
        );
        assert!(!completes_unit(&BTreeMap::new(), 3 * unit, 4 * unit, unit));
        // Pieces on both sides of the hole.
        let both = parked(&[(0, 100), (200, unit as usize - 200)]);
        assert!(completes_unit(&both, 100, 200, unit));
        assert!(!completes_unit(&both, 100, 150, unit));
        // A piece of another unit does not count.
        let other = parked(&[(unit, unit as usize - 16)]);
        assert!(!completes_unit(&other, unit - 16, unit, unit));
    }
}
