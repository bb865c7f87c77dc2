//! Changes of a file's data without a write through the handle: `fallocate(2)`
//! ([`FileHandle::allocate`]) and copies (`copy_file_range(2)`,
//! [`FileHandle::copy_range_from`]), on the servers where they can be.

use bytes::{Bytes, BytesMut};
use freeflow_proto::io::{AllocateMode, AllocateObject, CopyObjectRange, ObjectSpace};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{ALLOCATE_BYTES_MAX, IO_REQUEST_BYTES_MAX};
use freeflow_types::{Layout, ObjectId};
use futures::StreamExt;

use super::state::{FileHandle, HandleShared};
use crate::error::ClientError;
use crate::plan::ObjectRequest;

/// Most bytes one `copy_range_from` copies; callers loop, as with `copy_file_range(2)`.
pub const COPY_LENGTH_MAX: u64 = 1 << 30;

/// Pieces of one copy in flight at once (each at most one request long).
pub(super) const COPY_PIECES_IN_FLIGHT_MAX: usize = 16;

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
pub(super) struct CopyPiece {
    pub(super) source: ObjectRequest,
    pub(super) target: ObjectRequest,
}

/// Cut a copy into pieces that each lie inside one object of the source and one of the
/// target, merging neighbours that are contiguous in both objects (up to one request).
pub(super) fn plan_copy(
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

/// A change of the file's data made through a handle without a write (fallocate, a copy
/// into it): while it lasts nothing is fetched ahead, and what was is dropped at its start
/// and at its end, however it ends (an error, a cancelled call).
pub(super) struct ChangeUnderWay<'a>(&'a HandleShared);

impl<'a> ChangeUnderWay<'a> {
    pub(super) fn begin(shared: &'a HandleShared) -> ChangeUnderWay<'a> {
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

impl FileHandle {
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
            .wait_until(|state| state.writes.done_through(through))
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
                    .pool()
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
                state.size.note_space(stripe_index, space);
                state.writes.unsynced_stripes.insert(stripe_index);
            }
            if grows {
                state.size.known_size = state.size.known_size.max(end);
                state.size.written_end = state.size.written_end.max(end);
                state.size.acknowledged_end = state.size.acknowledged_end.max(end);
            }
            // A change like a write: the next flush commits the size and the space.
            state.writes.started += 1;
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
                .wait_until(|state| state.writes.done_through(through))
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
                let pool = target.client.pool();
                let source_object = ObjectId {
                    inode: origin.inode,
                    stripe_index: piece.source.stripe_index,
                };
                let target_object = ObjectId {
                    inode: target.inode,
                    stripe_index: piece.target.stripe_index,
                };
                let source_chain = source_layout.chain(piece.source.stripe_index);
                let target_chain = target_layout.chain(piece.target.stripe_index);
                // Not while a drain moves either stripe: the copy must go down its chain.
                let on_one_server = crate::replicated::same_single_server(
                    source_layout,
                    piece.source.stripe_index,
                    target_layout,
                    piece.target.stripe_index,
                ) && pool
                    .direct(source_layout, source_object, &source_chain)
                    .is_some()
                    && pool
                        .direct(target_layout, target_object, &target_chain)
                        .is_some();
                if on_one_server {
                    let request = CopyObjectRange {
                        source: source_object,
                        source_offset: piece.source.object_offset,
                        target: target_object,
                        target_offset: piece.target.object_offset,
                        // A piece is at most IO_REQUEST_BYTES_MAX, which fits u32.
                        length: piece.source.length as u32,
                    };
                    let copied = pool
                        .io_call(target_server, target.inode, &request, Bytes::new(), || {
                            format!(
                                "of {} bytes from inode {} to inode {} on one server",
                                piece.source.length, origin.inode, target.inode
                            )
                        })
                        .await;
                    match copied {
                        Ok((space, _)) => {
                            let piece_end = piece.target.file_offset + piece.source.length;
                            return Ok::<_, ClientError>(Some((
                                piece.target.stripe_index,
                                space,
                                piece_end,
                            )));
                        }
                        // A drain began: read and write instead.
                        Err(error)
                            if pool
                                .drained_meanwhile(&error, source_object, &source_chain)
                                .await
                                || pool.held_service_map().moved(target_object, &target_chain) => {}
                        Err(error) => return Err(error),
                    }
                }
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
                state.size.note_space(stripe_index, space);
                state.writes.unsynced_stripes.insert(stripe_index);
                // Copied on its server: acknowledged. Pieces written through this client
                // raise `acknowledged_end` themselves when their writes are answered.
                state.size.acknowledged_end = state.size.acknowledged_end.max(piece_end);
            }
            state.size.known_size = state.size.known_size.max(end);
            state.size.written_end = state.size.written_end.max(end);
            state.writes.started += 1;
        }
        target.notify();
        Ok(length)
    }
}
