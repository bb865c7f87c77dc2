//! The RPC face of the object store: decodes `proto::io` requests, runs them on the
//! [`ObjectStore`], encodes replies. Bad arguments come back as wire errors with the right
//! code (see [`StoreError::code`]); an unknown opcode or undecodable header closes the
//! connection, since the peer is not speaking our protocol.

use std::sync::Arc;

use bytes::Bytes;
use freeflow_proto::io::{
    AllocateMode, AllocateObject, CopyObjectRange, IoStats, ListObjects, ObjectListing, ReadObject,
    ReadReply, RemoveObject, RemoveObjects, ReserveSpace, ServerStats, SyncObjects, TruncateObject,
    WriteObject, LIST_OBJECTS_MAX, MAP_VERSION_COPY,
};
use freeflow_proto::{Request, WireError};
use freeflow_rpc::{handle, Frame, PeerInfo, Reply, Service};
use freeflow_types::ObjectId;

use crate::error::StoreError;
use crate::gate::DataGate;
use crate::replication::Replication;
use crate::space::{Admitted, NoRoom, SpaceLedger};
use crate::store::ObjectStore;

pub struct IoService {
    store: Arc<ObjectStore>,
    /// Closed until the meta server says no truncation cut is owed here (see `gate.rs`).
    gate: Arc<DataGate>,
    /// Writes of replicated stripes (see `replication.rs`).
    replication: Arc<Replication>,
    /// Space held by writing clients (see `space.rs`).
    space: SpaceLedger,
}

impl IoService {
    pub fn new(
        store: Arc<ObjectStore>,
        gate: Arc<DataGate>,
        replication: Arc<Replication>,
    ) -> IoService {
        IoService {
            store,
            gate,
            replication,
            space: SpaceLedger::default(),
        }
    }

    /// Let in a write of `length` bytes at `offset` of `object` under `grant`, charging
    /// `charged` bytes to it (see `space.rs`).
    async fn admit_write(
        &self,
        grant: u64,
        charged: u64,
        object: ObjectId,
        offset: u64,
        length: u64,
    ) -> Result<Admitted<'_>, WireError> {
        // The object's length is only needed for a write without a grant, while grants are
        // held (the ledger asks for it then): read it first only in that case.
        let on_disk = if grant == 0 && self.space.any_held() {
            Some(self.store.object_length(object).await?)
        } else {
            None
        };
        let growth = || -> Result<u64, WireError> {
            let end = offset.saturating_add(length);
            Ok(end.saturating_sub(on_disk.unwrap_or(0)).min(length))
        };
        let space = || -> Result<(u64, u64), WireError> {
            let space = self.store.space()?;
            Ok((space.free_bytes, space.capacity_bytes))
        };
        self.space
            .admit(grant, charged, growth, space)?
            .map_err(|room| self.no_room(room, "write"))
    }

    fn no_room(&self, room: NoRoom, what: &str) -> WireError {
        WireError::new(
            freeflow_proto::ErrorCode::NoSpace,
            format!(
                "I/O server {}: no space for this {what}: {} bytes needed beyond the writer's grant, {} free that no other writer holds ({})",
                self.store.server_id(),
                room.needed,
                room.unreserved,
                self.store.data_dir().display(),
            ),
        )
    }

    /// The reply to `ServerStats`, also what the registration sends.
    pub fn stats(store: &ObjectStore) -> Result<IoStats, StoreError> {
        let space = store.space()?;
        Ok(IoStats {
            server_id: store.server_id(),
            capacity_bytes: space.capacity_bytes,
            free_bytes: space.free_bytes,
            object_count: store.object_count().objects,
            engine: store.engine().name().to_owned(),
        })
    }
}

impl Service for IoService {
    /// A read brings back up to its length: counted against the connection's window and
    /// the payload budget (undecodable requests count nothing; `call` refuses them).
    fn reply_bytes(&self, opcode: u16, header: &[u8]) -> u32 {
        if opcode != ReadObject::OPCODE {
            return 0;
        }
        freeflow_proto::decode::<ReadObject>(header).map_or(0, |read| read.length)
    }

    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        let store = &*self.store;
        let gate = &*self.gate;
        let replication = &*self.replication;
        // A payload in a region a client on this host shared (`freeflow_rpc::shared`).
        let shared_payload = frame.flags & freeflow_proto::frame::FLAG_SHARED_PAYLOAD != 0;
        match frame.opcode {
            WriteObject::OPCODE => {
                handle(frame, |request: WriteObject, payload| async move {
                    gate.check()?;
                    let admitted = self
                        .admit_write(
                            request.grant,
                            request.charged,
                            request.object,
                            request.offset,
                            payload.len() as u64,
                        )
                        .await?;
                    if request.map_version == 0 {
                        let _unversioned = match gate.admit_unversioned(&[request.object]) {
                            Ok(admitted) => admitted,
                            Err(error) => {
                                admitted.failed();
                                return Err(error);
                            }
                        };
                        return match store.write(request.object, request.offset, payload).await {
                            Ok(space) => Ok((space, Bytes::new())),
                            Err(error) => {
                                admitted.failed();
                                Err(error.into())
                            }
                        };
                    }
                    let end = request.offset.saturating_add(payload.len() as u64);
                    // Passed on, the bytes may still be on their way to the next member
                    // after this request failed and the client took their place back (a
                    // member put out, a timeout), and every member must write the same
                    // bytes whatever the client does to its region meanwhile: copied.
                    let payload = if shared_payload {
                        Bytes::copy_from_slice(&payload)
                    } else {
                        payload
                    };
                    let local = payload.clone();
                    let space = replication
                        .apply_and_pass_on(
                            request.object,
                            (request.offset, end),
                            request.map_version,
                            &request.forward,
                            || store.write(request.object, request.offset, local),
                            |forward| WriteObject {
                                forward,
                                ..request.clone()
                            },
                            payload,
                        )
                        .await;
                    match space {
                        Ok(space) => Ok((space, Bytes::new())),
                        Err(error) => {
                            admitted.failed();
                            Err(error)
                        }
                    }
                })
                .await
            }
            ReadObject::OPCODE => {
                handle(frame, |request: ReadObject, _| async move {
                    gate.check()?;
                    // A copy for a resync or a fill reads whatever map is held (see
                    // `MAP_VERSION_COPY`); a client's read without a version, only what
                    // is not leaving this server.
                    let _unversioned = match request.map_version {
                        MAP_VERSION_COPY => None,
                        0 => Some(gate.admit_unversioned(&[request.object])?),
                        version => {
                            drop(replication.hold(version).await?);
                            None
                        }
                    };
                    let data = store
                        .read(request.object, request.offset, request.length)
                        .await?;
                    // `data` is at most `request.length` (a u32) long.
                    let length = u32::try_from(data.len()).map_err(|_| {
                        WireError::new(freeflow_proto::ErrorCode::Io, "read returned too much")
                    })?;
                    Ok((ReadReply { length }, data))
                })
                .await
            }
            TruncateObject::OPCODE => {
                handle(frame, |request: TruncateObject, _| async move {
                    // After any write or copy of the object in progress here (a resync's
                    // copy must not bring back what the cut removes).
                    let _range = replication
                        .ranges
                        .acquire(request.object, request.length, u64::MAX)
                        .await;
                    if !request.forward.is_empty() {
                        replication.check_forward(&request.forward)?;
                    }
                    let space = store.truncate(request.object, request.length).await?;
                    if let Some((next, rest)) = request.forward.split_first() {
                        let passed = TruncateObject {
                            object: request.object,
                            length: request.length,
                            forward: rest.to_vec(),
                        };
                        // Any failure further down is the partner's: this server did cut.
                        replication
                            .pass_on(*next, &passed, Bytes::new())
                            .await
                            .map_err(|error| {
                                WireError::new(
                                    freeflow_proto::ErrorCode::Unreachable,
                                    format!("cut here, not passed on: {}", error.message),
                                )
                            })?;
                    }
                    Ok((space, Bytes::new()))
                })
                .await
            }
            AllocateObject::OPCODE => {
                handle(frame, |request: AllocateObject, _| async move {
                    gate.check()?;
                    // An allocation has no grant: it may use only what no writer holds.
                    if request.mode == AllocateMode::Allocate && self.space.any_held() {
                        let space = store.space()?;
                        let unreserved = self
                            .space
                            .unreserved(space.free_bytes, space.capacity_bytes);
                        if request.length > unreserved {
                            return Err(self.no_room(
                                NoRoom {
                                    needed: request.length,
                                    unreserved,
                                },
                                "allocation",
                            ));
                        }
                    }
                    if request.map_version == 0 {
                        let _unversioned = gate.admit_unversioned(&[request.object])?;
                        let space = store
                            .allocate(request.object, request.offset, request.length, request.mode)
                            .await?;
                        return Ok((space, Bytes::new()));
                    }
                    let end = request.offset.saturating_add(request.length);
                    let space = replication
                        .apply_and_pass_on(
                            request.object,
                            (request.offset, end),
                            request.map_version,
                            &request.forward,
                            || {
                                store.allocate(
                                    request.object,
                                    request.offset,
                                    request.length,
                                    request.mode,
                                )
                            },
                            |forward| AllocateObject {
                                forward,
                                ..request.clone()
                            },
                            Bytes::new(),
                        )
                        .await?;
                    Ok((space, Bytes::new()))
                })
                .await
            }
            CopyObjectRange::OPCODE => {
                handle(frame, |request: CopyObjectRange, _| async move {
                    gate.check()?;
                    let _unversioned = gate.admit_unversioned(&[request.source, request.target])?;
                    let space = store
                        .copy_range(
                            request.source,
                            request.source_offset,
                            request.target,
                            request.target_offset,
                            request.length,
                        )
                        .await?;
                    Ok((space, Bytes::new()))
                })
                .await
            }
            ReserveSpace::OPCODE => {
                handle(frame, |request: ReserveSpace, _| async move {
                    if request.grant == 0 {
                        return Err(WireError::new(
                            freeflow_proto::ErrorCode::InvalidArgument,
                            "grant id 0 names no grant",
                        ));
                    }
                    let space = store.space()?;
                    let grant = self
                        .space
                        .reserve(
                            request.grant,
                            request.give_back,
                            request.need,
                            request.want,
                            space.free_bytes,
                            space.capacity_bytes,
                        )
                        .map_err(|room| self.no_room(room, "reservation"))?;
                    Ok((grant, Bytes::new()))
                })
                .await
            }
            SyncObjects::OPCODE => {
                handle(frame, |request: SyncObjects, _| async move {
                    store.sync(&request.objects).await?;
                    Ok(((), Bytes::new()))
                })
                .await
            }
            RemoveObjects::OPCODE => {
                handle(frame, |request: RemoveObjects, _| async move {
                    store.remove(request.inode, &request.stripes).await?;
                    Ok(((), Bytes::new()))
                })
                .await
            }
            RemoveObject::OPCODE => {
                handle(frame, |request: RemoveObject, _| async move {
                    store.remove_one(request.object).await?;
                    Ok(((), Bytes::new()))
                })
                .await
            }
            ServerStats::OPCODE => {
                handle(frame, |_: ServerStats, _| async move {
                    Ok((IoService::stats(store)?, Bytes::new()))
                })
                .await
            }
            ListObjects::OPCODE => {
                handle(frame, |request: ListObjects, _| async move {
                    let shard = usize::try_from(request.shard)
                        .ok()
                        .filter(|shard| *shard < crate::store::SHARD_COUNT)
                        .ok_or_else(|| {
                            WireError::new(
                                freeflow_proto::ErrorCode::InvalidArgument,
                                format!(
                                    "shard {} is not below {}",
                                    request.shard,
                                    crate::store::SHARD_COUNT
                                ),
                            )
                        })?;
                    if request.limit == 0 || request.limit > LIST_OBJECTS_MAX {
                        return Err(WireError::new(
                            freeflow_proto::ErrorCode::InvalidArgument,
                            format!("limit {} is not in 1..={LIST_OBJECTS_MAX}", request.limit),
                        ));
                    }
                    let (objects, more) = store
                        .list(shard, request.after, request.limit as usize)
                        .await?;
                    Ok((ObjectListing { objects, more }, Bytes::new()))
                })
                .await
            }
            opcode => Err(format!("unknown opcode {opcode} for an I/O server")),
        }
    }
}
