//! The read path of a handle: a read cut into object requests sent at once, read-ahead
//! for a sequential reader (`readahead.rs` keeps the pieces), and reads of objects of I/O
//! servers on this host through their descriptors (`local.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use freeflow_proto::io::ReadObject;
use freeflow_proto::ErrorCode;
use freeflow_types::limits::IO_REQUEST_BYTES_MAX;
use freeflow_types::{Layout, ObjectId};

use super::state::{FileHandle, HandleShared, LocalStripe};
use crate::error::ClientError;
use crate::local::{LocalObject, Opened};
use crate::plan::{plan_requests, ObjectRequest};
use crate::readahead::{Fetched, Piece, Segments};

/// Largest single `read_at`, after clamping to the file size: the bound on the buffer one
/// read allocates.
pub const READ_LENGTH_MAX: u64 = 256 << 20;

/// The size of a piece fetched ahead: one stripe row (every server of the layout reads at
/// once), within 1-16 MiB.
pub(super) fn readahead_piece_bytes(layout: &Layout) -> u64 {
    (u64::from(layout.stripe_unit_bytes) * u64::from(layout.stripe_count()))
        .clamp(1 << 20, 16 << 20)
}

impl HandleShared {
    pub(super) async fn read_piece(
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
            .pool()
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
    pub(super) async fn open_local(
        &self,
        layout: &Layout,
        stripe_index: u32,
    ) -> Option<Arc<LocalObject>> {
        let pool = &self.client.pool();
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
            .local()
            .open(server_id, &address, object_id)
            .await;
        let mut local = self.local.lock().expect("not poisoned");
        match opened {
            Opened::Object(object) => {
                local.insert(stripe_index, LocalStripe::Open(Arc::clone(&object)));
                Some(object)
            }
            Opened::Missing => {
                local.insert(stripe_index, LocalStripe::Missing);
                None
            }
            Opened::Unavailable => {
                local.remove(&stripe_index);
                None
            }
        }
    }

    /// A piece read from an object of an I/O server on this host through its descriptor
    /// (`local.rs`); None when it must go through the RPC path: a replicated stripe (a
    /// copy may lag its chain's head), a stripe a drain moves, a server elsewhere or not
    /// handing descriptors out, a missing object.
    pub(super) async fn read_local(
        &self,
        layout: &Layout,
        request: &ObjectRequest,
    ) -> Result<Option<Bytes>, ClientError> {
        let client = &self.client;
        if !layout.copies.is_empty() || !client.local().enabled() {
            return Ok(None);
        }
        let stripe_index = request.stripe_index;
        let object_id = ObjectId {
            inode: self.inode,
            stripe_index,
        };
        // A drain moves the stripe: its reads go down its chain (the server stopped handing
        // out descriptors of it and closed those it had).
        if client.pool().held_service_map().moved(
            object_id,
            std::slice::from_ref(&layout.servers[stripe_index as usize]),
        ) {
            return Ok(None);
        }
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
        client.pool().metrics.read_locally(data.len() as u64);
        Ok(Some(data))
    }

    /// Read `[offset, offset + length)` from the servers, every request at once, kept as
    /// their replies (see `Segments`: a reader takes views of them); holes and short
    /// objects read as zeros (the caller clamped the range to the size).
    pub(super) async fn fetch_segments(
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
    pub(super) async fn read_ahead(
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
    pub(super) fn forget_pieces(&self, pieces: &[(u64, Fetched)]) {
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
    pub(super) fn fetch_ahead(self: &Arc<Self>, layout: &Layout, from: u64, end: u64) {
        let piece_bytes = readahead_piece_bytes(layout);
        let window_end = end.saturating_add(self.client.config().readahead_bytes);
        let mut state = self.lock();
        if state.changing_data() || state.readahead.suspended {
            return;
        }
        let size = state.size.known_size;
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
                    .readahead_room()
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
}

impl FileHandle {
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
    pub(super) async fn read_segments(
        &self,
        offset: u64,
        length: u64,
    ) -> Result<Segments, ClientError> {
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
                    .all(|request| !state.writes.overlaps_in_flight(request))
            })
            .await;
        if shared.client.config().readahead_bytes > 0 {
            return shared.read_ahead(layout, offset, length).await;
        }
        shared.fetch_segments(layout, offset, length).await
    }
}
