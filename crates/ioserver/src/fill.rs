//! Fill: a server named to take a lost server's place in some chains copies those stripes
//! from the survivors (re-replication, issue 42; the meta server's side is
//! `meta/src/rereplication.rs`, the choice of stand-in `ServiceMap::chain`).
//!
//! From the map that names it, the stand-in takes every write of those stripes (at the end
//! of their chains) and serves none of their reads. Once every server in service holds that
//! map, the meta server orders the fill. The fill:
//! 1. lists the objects of every partner not out, of the inodes the replacements cover;
//! 2. reads their layouts and keeps the stripes whose chain, as the map makes it, has this
//!    server filling; each is copied from the first member of its chain in service that is
//!    not filling itself;
//! 3. copies them, stripes with the fewest copies in service first, at most the order's
//!    bytes per second, each under this server's range locks as a resync does (a write
//!    passed on meanwhile lands after the piece it overlaps);
//! 4. makes the copies durable and tells the meta server which records it copied for
//!    (whichever member leads by then); from the next map on, this server serves their
//!    reads.
//!
//! A stripe with no copy in service to copy from holds the fill back (it is tried again at
//! the next order): ending without it would let this server serve a stripe it does not hold.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use freeflow_proto::meta::{FillDone, FillOrder, MemberState};
use freeflow_types::{ObjectId, ServerId};

use crate::copy::{copy_object, layouts, list_partners, spawn_copy, Pacer};
use crate::resync::Resync;

/// How often, and how long apart, a fill asks the meta servers again when none answers (a
/// leader change takes a second or two).
const META_TRIES: u32 = 50;
const META_RETRY: std::time::Duration = std::time::Duration::from_millis(200);

impl Resync {
    /// Start the fill an order asks for, unless one is running.
    pub fn start_fill(self: &Arc<Self>, order: FillOrder) {
        let resync = Arc::clone(self);
        let server_id = self.store.server_id();
        spawn_copy(
            &self.fill_progress,
            server_id,
            "fill done; this server serves reads of those stripes",
            "fill did not finish; it starts again at the next order",
            async move {
                tracing::info!(
                    server_id,
                    bytes_per_second = order.bytes_per_second,
                    "fill starts: copying the stripes this server takes from lost servers"
                );
                resync.fill(order).await
            },
        );
    }

    async fn fill(&self, order: FillOrder) -> Result<u64, String> {
        let me = self.store.server_id();
        let map = self.replication.map_of_order(order.map_version).await?;
        let Some(below) = map
            .filling(me)
            .map(|replacement| replacement.inodes_below)
            .max()
        else {
            return Ok(0);
        };
        // The records this fill is for, as named in its order's map.
        let records: Vec<(ServerId, u64)> = map
            .filling(me)
            .map(|replacement| (replacement.server, replacement.made_ms))
            .collect();
        // 1. Candidates: every object of the covered inodes a partner holds.
        let candidates: BTreeSet<ObjectId> = list_partners(&self.replication, &map, |listed| {
            listed.object.inode < below
        })
        .await?
        .into_keys()
        .collect();
        // 2. Layouts; the stripes this server fills, and a source for each.
        // A leader change breaks the meta connection: asked again (a fill is long to redo).
        let mut tries = 0;
        let layouts = loop {
            let attempt = match self.replication.connect_meta(&self.options).await {
                Ok(meta) => layouts(&meta, candidates.iter()).await,
                Err(error) => Err(error.to_string()),
            };
            match attempt {
                Ok(layouts) => break layouts,
                Err(error) if tries < META_TRIES => {
                    tries += 1;
                    tracing::debug!(%error, "cannot read layouts yet; again");
                    tokio::time::sleep(META_RETRY).await;
                }
                Err(error) => return Err(error),
            }
        };
        let mut work: Vec<(usize, ObjectId, ServerId)> = Vec::new();
        for object in &candidates {
            let Some(layout) = layouts.get(&object.inode) else {
                continue; // Removed meanwhile: the reaper removes it from this server too.
            };
            let chain = map.chain(*object, &layout.chain(object.stripe_index));
            if !chain
                .iter()
                .any(|member| member.server == me && member.filling)
            {
                continue;
            }
            let serving: Vec<ServerId> = chain
                .iter()
                .filter(|member| {
                    member.server != me
                        && !member.filling
                        && map.state(member.server) == MemberState::InService
                })
                .map(|member| member.server)
                .collect();
            let Some(source) = serving.first() else {
                return Err(format!(
                    "{object:?} has no copy in service to copy from (chain {chain:?}); waiting for one"
                ));
            };
            work.push((serving.len(), *object, *source));
        }
        // 3. Fewest copies first: those are the stripes one more loss would take.
        work.sort_by_key(|(copies, object, _)| (*copies, *object));
        let progress = &self.fill_progress;
        progress
            .objects_total
            .store(work.len() as u64, Ordering::Relaxed);
        progress.objects_done.store(0, Ordering::Relaxed);
        let mut pacer = Pacer::new(order.bytes_per_second);
        for (_, object, source) in &work {
            let connection = self
                .replication
                .peer(*source)
                .await
                .map_err(|error| error.to_string())?;
            copy_object(
                &self.store,
                &self.replication,
                &connection,
                *object,
                progress,
                &mut pacer,
            )
            .await?;
            progress.objects_done.fetch_add(1, Ordering::Relaxed);
        }
        let copied: Vec<ObjectId> = work.iter().map(|(_, object, _)| *object).collect();
        for batch in copied.chunks(crate::store::SYNC_OBJECTS_MAX) {
            self.store
                .sync(batch)
                .await
                .map_err(|error| format!("cannot sync the copies: {error}"))?;
        }
        // 4. Done, told whichever leader leads now.
        let done = FillDone {
            server_id: me,
            map_version: order.map_version,
            replacements: records,
        };
        let mut tries = 0;
        loop {
            let attempt = match self.replication.connect_meta(&self.options).await {
                Ok(meta) => meta
                    .call(&done, Bytes::new())
                    .await
                    .map(|_| ())
                    .map_err(|error| error.to_string()),
                Err(error) => Err(error.to_string()),
            };
            match attempt {
                Ok(()) => break,
                Err(error) if tries < META_TRIES => {
                    tries += 1;
                    tracing::debug!(%error, "the end of the fill not taken yet; again");
                    tokio::time::sleep(META_RETRY).await;
                }
                Err(error) => {
                    return Err(format!(
                        "the meta server did not take the end of the fill: {error}"
                    ))
                }
            }
        }
        Ok(work.len() as u64)
    }
}
