//! Copying objects from other servers: what a resync (`resync.rs`) and a fill
//! (`fill.rs`) share. Listing a server's objects, reading layouts from the meta server,
//! and copying one object piece by piece under this server's range locks, at a paced rate.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_proto::io::{
    AllocateMode, ListObjects, ListedObject, ReadObject, LIST_OBJECTS_MAX, MAP_VERSION_COPY,
};
use freeflow_proto::meta::{InspectInodes, INSPECT_INODES_MAX};
use freeflow_rpc::Connection;
use freeflow_types::{InodeId, Layout, ObjectId, ServerId};

use crate::replication::Replication;
use crate::store::{ObjectStore, SHARD_COUNT};

/// Bytes copied per read from the source.
const COPY_PIECE_BYTES: u32 = 1 << 20;

/// Progress of a copy (a resync or a fill), for metrics and `freeflow status`.
#[derive(Default)]
pub struct CopyProgress {
    pub running: AtomicBool,
    pub objects_total: AtomicU64,
    pub objects_done: AtomicU64,
    pub bytes_copied: AtomicU64,
}

/// Run `copy` (a resync or a fill) in the background, unless one of its kind runs
/// (`progress.running`), and log its end: `done` with the objects, bytes and time it took,
/// or `failed` with the reason (the next order starts it again).
pub fn spawn_copy<F>(
    progress: &Arc<CopyProgress>,
    server_id: ServerId,
    done: &'static str,
    failed: &'static str,
    copy: F,
) where
    F: std::future::Future<Output = Result<u64, String>> + Send + 'static,
{
    if progress.running.swap(true, Ordering::AcqRel) {
        return;
    }
    let progress = Arc::clone(progress);
    tokio::spawn(async move {
        let started = Instant::now();
        match copy.await {
            Ok(copied) => tracing::info!(
                server_id,
                objects = copied,
                bytes = progress.bytes_copied.load(Ordering::Relaxed),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "{done}"
            ),
            Err(error) => tracing::warn!(server_id, %error, "{failed}"),
        }
        progress.running.store(false, Ordering::Release);
    });
}

/// Holds a copy to a number of bytes per second (0: no limit), measured from its start.
pub struct Pacer {
    bytes_per_second: u64,
    started: Instant,
    bytes: u64,
}

impl Pacer {
    pub fn new(bytes_per_second: u64) -> Pacer {
        Pacer {
            bytes_per_second,
            started: Instant::now(),
            bytes: 0,
        }
    }

    /// Count `bytes` copied, and wait until the rate allows them.
    pub async fn paid(&mut self, bytes: u64) {
        self.bytes += bytes;
        if self.bytes_per_second == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.bytes as f64 / self.bytes_per_second as f64);
        let elapsed = self.started.elapsed();
        if due > elapsed {
            tokio::time::sleep(due - elapsed).await;
        }
    }
}

/// The objects of a server (through `connection`) that `keep` takes.
pub async fn list_objects(
    connection: &Connection,
    keep: impl Fn(&ListedObject) -> bool,
) -> Result<Vec<ObjectId>, String> {
    let mut kept = Vec::new();
    for shard in 0..SHARD_COUNT as u32 {
        let mut after = None;
        loop {
            let (listing, _) = connection
                .call(
                    &ListObjects {
                        shard,
                        after,
                        limit: LIST_OBJECTS_MAX,
                    },
                    Bytes::new(),
                )
                .await
                .map_err(|error| format!("cannot list a partner's objects: {error}"))?;
            after = listing.objects.last().map(|listed| listed.object);
            kept.extend(
                listing
                    .objects
                    .iter()
                    .filter(|listed| keep(listed))
                    .map(|listed| listed.object),
            );
            if !listing.more || after.is_none() {
                break;
            }
        }
    }
    Ok(kept)
}

/// The objects every partner not out (in service or syncing) holds that `keep` takes,
/// each with the partners listing it.
pub async fn list_partners(
    replication: &Replication,
    map: &freeflow_proto::meta::ServiceMap,
    keep: impl Fn(&ListedObject) -> bool,
) -> Result<BTreeMap<ObjectId, Vec<ServerId>>, String> {
    let me = replication.server_id();
    let mut listed: BTreeMap<ObjectId, Vec<ServerId>> = BTreeMap::new();
    for member in &map.members {
        if member.state == freeflow_proto::meta::MemberState::Out || member.server_id == me {
            continue;
        }
        let connection = replication
            .peer(member.server_id)
            .await
            .map_err(|error| error.to_string())?;
        for object in list_objects(&connection, &keep).await? {
            listed.entry(object).or_default().push(member.server_id);
        }
    }
    Ok(listed)
}

/// The objects of this server that `keep` takes.
pub async fn list_own(
    store: &ObjectStore,
    keep: impl Fn(&ListedObject) -> bool,
) -> Result<Vec<ObjectId>, String> {
    let mut kept = Vec::new();
    for shard in 0..SHARD_COUNT {
        let mut after = None;
        loop {
            let (objects, more) = store
                .list(shard, after, LIST_OBJECTS_MAX as usize)
                .await
                .map_err(|error| error.to_string())?;
            after = objects.last().map(|listed| listed.object);
            kept.extend(
                objects
                    .iter()
                    .filter(|listed| keep(listed))
                    .map(|listed| listed.object),
            );
            if !more || after.is_none() {
                break;
            }
        }
    }
    Ok(kept)
}

/// The layouts of the inodes of `objects` that still exist, from the meta server.
pub async fn layouts<'a>(
    meta: &Connection,
    objects: impl Iterator<Item = &'a ObjectId>,
) -> Result<BTreeMap<InodeId, Layout>, String> {
    let mut inodes: Vec<InodeId> = objects.map(|object| object.inode).collect();
    inodes.sort_unstable();
    inodes.dedup();
    let mut layouts = BTreeMap::new();
    for batch in inodes.chunks(INSPECT_INODES_MAX) {
        let (facts, _) = meta
            .call(
                &InspectInodes {
                    inodes: batch.to_vec(),
                },
                Bytes::new(),
            )
            .await
            .map_err(|error| format!("cannot read layouts from the meta server: {error}"))?;
        for fact in facts {
            if let Some(layout) = fact.layout {
                layouts.insert(fact.inode, layout);
            }
        }
    }
    Ok(layouts)
}

/// Make the local copy of `object` equal the source's. Each piece is copied under this
/// server's range lock of everything from the piece on: a write passed on meanwhile waits
/// and lands after it (the source had it before it was passed on, so writing it again
/// changes nothing), a cut waits too, and a write past the piece (an append) cannot land
/// between the read of the source's last piece and the cut of the copy to the source's
/// length, which would take it away again. The lock is per piece so that no write waits
/// long.
pub async fn copy_object(
    store: &ObjectStore,
    replication: &Replication,
    source: &Connection,
    object: ObjectId,
    progress: &CopyProgress,
    pacer: &mut Pacer,
) -> Result<(), String> {
    let mut offset = 0u64;
    loop {
        // From the byte before the piece: the end of the copy may be written below.
        let rest = replication
            .ranges
            .acquire(object, offset.saturating_sub(1), u64::MAX)
            .await;
        let (reply, data) = source
            .call(
                &ReadObject {
                    object,
                    offset,
                    length: COPY_PIECE_BYTES,
                    map_version: MAP_VERSION_COPY,
                },
                Bytes::new(),
            )
            .await
            .map_err(|error| format!("cannot read {object:?} from its source: {error}"))?;
        let length = u64::from(reply.length).min(data.len() as u64);
        if length > 0 {
            let punched = data.iter().all(|byte| *byte == 0);
            let written = if punched {
                store
                    .allocate(object, offset, length, AllocateMode::PunchHole)
                    .await
            } else {
                store
                    .write(object, offset, data.slice(..length as usize))
                    .await
            };
            if let Err(error) = written {
                return Err(format!("cannot write {object:?} here: {error}"));
            }
            progress.bytes_copied.fetch_add(length, Ordering::Relaxed);
        }
        if length < u64::from(COPY_PIECE_BYTES) {
            // The source ends here: so does the copy, still under the lock. A punched
            // tail leaves the copy short (holes do not lengthen a file): its last byte, a
            // zero, is written; the cut removes what is past the end.
            let end = offset + length;
            let here = store
                .object_length(object)
                .await
                .map_err(|error| format!("cannot read the length of {object:?} here: {error}"))?;
            if here < end {
                store
                    .write(object, end - 1, Bytes::from_static(&[0]))
                    .await
                    .map_err(|error| format!("cannot write {object:?} here: {error}"))?;
            }
            store
                .truncate(object, end)
                .await
                .map_err(|error| format!("cannot cut {object:?} here: {error}"))?;
            drop(rest);
            pacer.paid(length).await;
            return Ok(());
        }
        drop(rest);
        // Paced outside the lock: a write waiting for the piece is not held by the pace.
        pacer.paid(length).await;
        offset += length;
    }
}
