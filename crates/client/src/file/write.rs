//! The write path of a handle: gathering small writes, parking partial stripe units,
//! taking space from the client's grants, the turn that keeps writes in call order, and
//! the requests sent (bounded by the client's dirty bytes, never overlapping one in
//! flight). See the module doc of `file` for the rules.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use freeflow_proto::io::WriteObject;
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{FILE_SIZE_MAX, IO_REQUEST_BYTES_MAX};
use freeflow_types::{Layout, ObjectId};
use tokio::sync::OwnedSemaphorePermit;

use super::pieces::{
    completes_unit, GatherBuffer, Gathered, ParkedPiece, GATHER_BYTES_MAX, GATHER_WRITE_MAX,
    PARKED_BYTES_MAX,
};
use super::state::{FileHandle, HandleShared, HandleState};
use crate::error::ClientError;
use crate::plan::{plan_requests, ObjectRequest};

/// The turn to send writes of one handle (its `send_order` lock), owned so that it can
/// move into the task that sends gathered bytes.
pub(super) type SendTurn = tokio::sync::OwnedMutexGuard<()>;

/// The requests of one `write_at` not handed to a task yet; if the call is cancelled, they
/// are marked finished so that nobody waits for them.
pub(super) struct UnsentRequests<'a> {
    pub(super) shared: &'a HandleShared,
    pub(super) sequence: u64,
    pub(super) count: usize,
}

impl Drop for UnsentRequests<'_> {
    fn drop(&mut self) {
        if self.count > 0 {
            self.shared
                .lock()
                .writes
                .finish_requests(self.sequence, self.count);
            self.shared.notify();
        }
    }
}

impl HandleState {
    /// The bytes of space grant a write request carries (`WriteObject::charged`): what its
    /// object range adds past what this handle charged on its stripe before.
    pub(super) fn charge_request(&mut self, layout: &Layout, request: &ObjectRequest) -> u64 {
        let size = self.attr.size_bytes;
        let through = self
            .writes
            .charged_through
            .entry(request.stripe_index)
            .or_insert_with(|| layout.object_length(size, request.stripe_index));
        let end = request.object_end();
        let charged = end.saturating_sub(request.object_offset.max(*through));
        *through = (*through).max(end);
        charged
    }

    /// Begin gathering with the write of `data` at `offset` (nothing is gathered now);
    /// returns the gathering's generation.
    pub(super) fn gather_anew(
        &mut self,
        area: Option<&Arc<freeflow_rpc::shared::PayloadArea>>,
        offset: u64,
        data: &[u8],
        end: u64,
    ) -> u64 {
        self.unsent.gathered = Some(Gathered {
            offset,
            data: GatherBuffer::new(area, data),
        });
        self.unsent.gather_generation += 1;
        self.size.known_size = self.size.known_size.max(end);
        self.size.written_end = self.size.written_end.max(end);
        self.unsent.gather_generation
    }
}

impl HandleShared {
    /// Cut a write into requests and send them, each on its own task; returns once all are
    /// in flight. The caller holds `send_order`.
    pub(super) async fn start_write(
        self: &Arc<Self>,
        offset: u64,
        data: Bytes,
    ) -> Result<(), ClientError> {
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
            state.size.known_size = state.size.known_size.max(end);
            state.size.written_end = state.size.written_end.max(end);
            state.writes.started += 1;
            let sequence = state.writes.started;
            state.writes.outstanding.insert(sequence, requests.len());
            sequence
        };
        let mut unsent = UnsentRequests {
            shared,
            sequence,
            count: requests.len(),
        };
        let dirty = shared.client.dirty();
        for request in requests {
            let start = (request.file_offset - offset) as usize;
            let payload = data.slice(start..start + request.length as usize);
            // The semaphore is never closed; a request (≤ IO_REQUEST_BYTES_MAX) fits u32 and
            // config validation keeps dirty_bytes_max at least that large.
            let permit = match dirty.clone().try_acquire_many_owned(request.length as u32) {
                Ok(permit) => permit,
                Err(_) => {
                    let _throttled = shared.client.pool().metrics.throttled();
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
    pub(super) fn completes_parked(&self, offset: u64, end: u64) -> Result<bool, ClientError> {
        let unit = u64::from(self.data_layout()?.stripe_unit_bytes);
        Ok(completes_unit(
            &self.lock().unsent.parked,
            offset,
            end,
            unit,
        ))
    }

    /// Whether a write of `length` bytes at `offset` may be made: Some(its end), None when
    /// there is nothing to write.
    pub(super) fn check_write(
        &self,
        offset: u64,
        length: usize,
    ) -> Result<Option<u64>, ClientError> {
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
    pub(super) fn try_gather(&self, offset: u64, data: &[u8], end: u64) -> bool {
        let mut state = self.lock();
        let Some(gathered) = state.unsent.gathered.as_mut() else {
            return false;
        };
        if data.len() >= GATHER_WRITE_MAX
            || offset != gathered.offset + gathered.data.len() as u64
            || gathered.data.len() + data.len() > GATHER_BYTES_MAX
        {
            return false;
        }
        gathered.data.extend_from_slice(data);
        state.size.known_size = state.size.known_size.max(end);
        state.size.written_end = state.size.written_end.max(end);
        true
    }

    /// A large write, given the turn: its whole stripe units are sent at once; a piece that
    /// covers only part of a unit (its first or last) joins the parked pieces of that unit
    /// and goes out with them once they make the whole unit, or parks. The I/O servers then
    /// see whole, aligned units, which they write past their page cache (O_DIRECT),
    /// instead of two partial pieces of every unit when the writes do not follow unit
    /// boundaries (the kernel's write-back of a writeback mount drifts off them).
    pub(super) async fn write_in_units(
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
            let earlier = if let Some(gathered) = state.unsent.gathered.take() {
                debug_assert!(
                    state.unsent.parked.is_empty(),
                    "parked and gathered at once"
                );
                vec![(gathered.offset, gathered.data.freeze())]
            } else {
                state.unsent.take_parked(|start, piece| {
                    start < end && start + piece.data.len() as u64 > offset
                })
            };
            state.unsent.in_transit(!earlier.is_empty());
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
                if let Some(pieces) = state.unsent.take_unit(start, &piece, unit) {
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
                if state.unsent.parked_bytes + held > PARKED_BYTES_MAX {
                    room.append(&mut state.unsent.take_parked(|_, _| true));
                }
                state.unsent.parked_bytes += held;
                let piece_end = start + piece.len() as u64;
                state.size.known_size = state.size.known_size.max(piece_end);
                state.size.written_end = state.size.written_end.max(piece_end);
                state.unsent.parked.insert(
                    start,
                    ParkedPiece {
                        data: piece,
                        held,
                        since: Instant::now(),
                    },
                );
                if !state.unsent.park_timer {
                    state.unsent.park_timer = true;
                    parks = true;
                }
            }
            // Sent below, as `sends`.
            state
                .unsent
                .in_transit(!units.is_empty() || !room.is_empty());
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
    pub(super) fn watch_parked(self: &Arc<Self>) {
        let shared = self.clone();
        let wait = Duration::from_millis(self.client.config().gather_wait_ms);
        tokio::spawn(async move {
            loop {
                let oldest = {
                    let mut state = shared.lock();
                    match state.unsent.parked.values().map(|piece| piece.since).min() {
                        Some(oldest) => oldest,
                        None => {
                            state.unsent.park_timer = false;
                            return;
                        }
                    }
                };
                tokio::time::sleep_until(oldest + wait).await;
                let turn = shared.send_turn().await;
                let due = {
                    let mut state = shared.lock();
                    let due = state
                        .unsent
                        .take_parked(|_, piece| piece.since.elapsed() >= wait);
                    state.unsent.in_transit(!due.is_empty());
                    due
                };
                // A failure is kept on the handle like any write's.
                let _ = shared.send_pieces_ordered(turn, due).await;
            }
        });
    }

    /// Gather a small write (none is gathered now); it is sent by the next call that needs
    /// it on its way, or after `gather_wait_ms` at most.
    pub(super) fn start_gathering(self: &Arc<Self>, offset: u64, data: &[u8], end: u64) {
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
    pub(super) fn try_gather_anew(self: &Arc<Self>, offset: u64, data: &[u8], end: u64) -> bool {
        if data.len() >= GATHER_WRITE_MAX || self.client.config().gather_wait_ms == 0 {
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
            if !state.unsent.parked.is_empty() {
                return false;
            }
            let gathered = state.unsent.gathered.take();
            state.unsent.in_transit(gathered.is_some());
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
    pub(super) fn send_gathered_later(self: &Arc<Self>, generation: u64) {
        // Holds the handle: gathered bytes are sent even if it is dropped without a close.
        let shared = self.clone();
        let wait = Duration::from_millis(self.client.config().gather_wait_ms);
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let turn = shared.send_turn().await;
            if shared.lock().unsent.gather_generation == generation {
                // A failure is kept on the handle like any write's.
                let _ = shared.send_gathered_ordered(turn).await;
            }
        });
    }

    /// What a write of `[offset, end)` adds past the size this handle knows, on each
    /// server that keeps it.
    pub(super) fn space_needs(
        &self,
        offset: u64,
        end: u64,
    ) -> Vec<(freeflow_types::ServerId, u64)> {
        let known = self.lock().size.known_size;
        match &self.layout {
            Some(layout) if end > known => crate::space::needs(layout, offset.max(known), end),
            _ => Vec::new(),
        }
    }

    /// Take `needs` (the space a write of `[offset, end)` adds) from this client's grants.
    pub(super) async fn take_needs(
        &self,
        offset: u64,
        end: u64,
        needs: &[(freeflow_types::ServerId, u64)],
    ) -> Result<(), ClientError> {
        if needs.is_empty() {
            return Ok(());
        }
        self.client
            .space()
            .take(
                self.client.pool(),
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
    pub(super) async fn send_turn(&self) -> SendTurn {
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
    pub(super) async fn send_gathered_ordered(
        self: &Arc<Self>,
        turn: SendTurn,
    ) -> (Result<(), ClientError>, SendTurn) {
        let pieces = {
            let mut state = self.lock();
            let mut pieces = state.unsent.take_parked(|_, _| true);
            if let Some(gathered) = state.unsent.gathered.take() {
                pieces.push((gathered.offset, gathered.data.freeze()));
            }
            state.unsent.in_transit(!pieces.is_empty());
            pieces
        };
        self.send_pieces_ordered(turn, pieces).await
    }

    /// Send acknowledged pieces taken from the handle (gathered or parked), in the order
    /// given, on a task that keeps the turn until all are in flight (as
    /// `send_gathered_ordered`). The caller counted them in transit (`in_transit`) in the
    /// lock it took them under; they are counted off once started (or failed).
    pub(super) async fn send_pieces_ordered(
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
            shared.lock().unsent.batches_in_transit -= 1;
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
                self.lock().writes.first_error.get_or_insert(error.clone());
                let turn = self.send_turn().await;
                (Err(error), turn)
            }
        }
    }

    /// Wait until every write started through this handle so far is answered by its I/O
    /// servers (or failed): what another client's truncation recalls (`leases::watch`).
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
            state.writes.started
        };
        self.wait_then(|state| state.writes.done_through(sequence).then_some(()))
            .await;
    }

    /// Wait until no write in flight overlaps `request`, then register it as in flight.
    pub(super) async fn begin_write(&self, request: &ObjectRequest) {
        loop {
            let mut receiver = {
                let mut state = self.lock();
                if !state.writes.overlaps_in_flight(request) {
                    state.writes.in_flight.insert(
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
    pub(super) async fn send_write(
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
        let space = &self.client.space();
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
            .pool()
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
                .writes
                .in_flight
                .remove(&(request.stripe_index, request.object_offset));
            state.writes.finish_requests(sequence, 1);
            match result {
                Ok((space, _)) => {
                    // The servers of the chain saw the grant in use when this was sent.
                    state.size.note_space(request.stripe_index, space);
                    state.size.acknowledged_end =
                        state.size.acknowledged_end.max(request.file_end());
                    // Only now: an fsync that took the set before this write landed must not
                    // count it as synced.
                    state.writes.unsynced_stripes.insert(request.stripe_index);
                }
                Err(error) => {
                    if state.writes.first_error.is_none() {
                        tracing::debug!(inode = self.inode, %error, "write failed; the handle reports it next");
                        state.writes.first_error = Some(error);
                    }
                }
            }
        }
        self.notify();
    }
}

impl FileHandle {
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
            let gathering = shared.client.config().gather_wait_ms > 0;
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
            shared.client.space().put_back(&needs);
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
        if !shared.client.space().try_take(&needs) {
            return Ok(false);
        }
        if shared.try_gather(offset, data, end) || shared.try_gather_anew(offset, data, end) {
            return Ok(true);
        }
        shared.client.space().put_back(&needs);
        Ok(false)
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
            let offset = state.size.known_size;
            let end = offset.saturating_add(length);
            let needs = match &self.shared.layout {
                Some(layout) => crate::space::needs(layout, offset, end),
                None => Vec::new(),
            };
            state.size.known_size = end;
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
            if state.size.known_size == offset + length {
                state.size.known_size = offset;
            }
            return Err(error);
        }
        if let Err(error) = self.write_at(offset, data).await {
            self.shared.client.space().put_back(&needs);
            return Err(error);
        }
        Ok(offset)
    }
}
