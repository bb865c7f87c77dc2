//! Resync: a server back in its chains copies what changed while it was out (DESIGN.md §7).
//!
//! The meta server names a returning server *syncing* and, once every server in service
//! holds the map that says so, orders its copy with a window: objects written within that
//! many milliseconds (the time it was out and a margin; everything when its data directory
//! is new). From then on every replicated write is also passed on to it, at the end of its
//! chains. The copy:
//! 1. lists the objects of every partner not out (in service or syncing) written within
//!    the window, and its own (a write it took just before it failed may never have
//!    reached its partners);
//! 2. asks the meta server for those inodes' layouts and keeps the objects whose chain
//!    names this server, each to be copied from one source: the first member in service;
//! 3. copies each whole object from its source while holding the object's range lock here,
//!    so a write passed on meanwhile lands after the copy (it is on the source already, so
//!    writing it again changes nothing) and a cut waits too; all-zero pieces become holes;
//! 4. tells the meta server it is done, under the map version of its order; the meta server
//!    puts it back in service (reads may come to it again) or, if the map changed in the
//!    meantime, refuses, and the next order starts the copy again.
//!
//! Deleted files need nothing here: the meta server's reaper removes their objects from a
//! server that comes back, and cuts owed are made before it serves data (`gate.rs`).
//!
//! Chains are read through the map's replacements (`ServiceMap::chain`): a server back
//! after it was replaced as lost for good copies none of the stripes it gave up, and
//! removes its old copies of them; a stand-in still filling is no source.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use freeflow_proto::meta::{ChainMember, MemberState, ResyncDone, ResyncOrder, ServiceMap};
use freeflow_rpc::{ClusterKey, ConnectOptions};
use freeflow_types::{ObjectId, ServerId};

use crate::copy::{copy_object, layouts, list_own, list_partners, spawn_copy, CopyProgress, Pacer};
use crate::replication::Replication;
use crate::store::ObjectStore;

pub struct Resync {
    pub store: Arc<ObjectStore>,
    pub replication: Arc<Replication>,
    pub key: ClusterKey,
    pub options: ConnectOptions,
    pub progress: Arc<CopyProgress>,
    /// The fill's (`fill.rs`): a server fills only in service, and resyncs only syncing.
    pub fill_progress: Arc<CopyProgress>,
    /// The map version this server last removed the copies of a completed drain under
    /// (`Resync::clean_after_drain`), and whether it is doing so now.
    pub cleaned_version: AtomicU64,
    pub cleaning: AtomicBool,
}

impl Resync {
    /// Start the copy an order asks for, unless one is running.
    pub fn start(self: &Arc<Self>, order: ResyncOrder) {
        let resync = Arc::clone(self);
        let server_id = self.store.server_id();
        spawn_copy(
            &self.progress,
            server_id,
            "resync done; back in service",
            "resync did not finish; it starts again at the next order",
            async move {
                tracing::info!(server_id, window_ms = order.window_ms, "resync starts");
                resync.run(order).await
            },
        );
    }

    async fn run(&self, order: ResyncOrder) -> Result<u64, String> {
        let me = self.store.server_id();
        // The map of the order, so partners in service are those the meta server named.
        let map = self.replication.map_of_order(order.map_version).await?;
        // A server that went out after this one may hold the only copy of what was written
        // to a chain of the two while this one was away. Its objects cannot be listed while
        // it is out, so the copy waits for it rather than end without them (and put this
        // server back in service with a stale copy, which that server would then copy from
        // when it returns; found by the simulation with two I/O failures overlapping).
        if let Some(server) = fresher_and_out(&map, me) {
            return Err(format!(
                "server {server} went out after this one and may hold writes made while this one was away; waiting for it"
            ));
        }
        let meta = self
            .replication
            .connect_meta(&self.options)
            .await
            .map_err(|error| error.to_string())?;
        // 1. Candidates: (object) -> listed by whom. Syncing partners too: an object whose
        // freshest copy is on one (its chain has no member in service) is copied from it, or
        // waited for (`source_of`); not listing them missed such objects altogether (found
        // by the simulation).
        let recent = |listed: &freeflow_proto::io::ListedObject| listed.age_ms <= order.window_ms;
        let mut candidates: BTreeMap<ObjectId, Vec<ServerId>> =
            list_partners(&self.replication, &map, recent).await?;
        for object in list_own(&self.store, recent).await? {
            candidates.entry(object).or_default();
        }
        // Copies of stripes given up to a stand-in (this server was replaced while out)
        // are not this server's any more.
        self.remove_replaced(&map, &meta).await?;
        // 2. Layouts, and one source per object.
        let layouts = layouts(&meta, candidates.keys()).await?;
        let mut work: Vec<(ObjectId, ServerId)> = Vec::new();
        for object in candidates.keys() {
            let Some(layout) = layouts.get(&object.inode) else {
                continue; // Removed: the reaper takes care of its objects.
            };
            let chain = map.chain(*object, &layout.chain(object.stripe_index));
            if !chain.iter().any(|member| member.server == me) || layout.replicas() < 2 {
                continue;
            }
            match source_of(&map, &chain, me) {
                Source::Partner(source) => work.push((*object, source)),
                Source::Mine => {}
                Source::Away(server) => {
                    return Err(format!(
                        "{object:?}: its freshest copy is on server {server}, which is out; waiting for it"
                    ))
                }
            }
        }
        self.progress
            .objects_total
            .store(work.len() as u64, Ordering::Relaxed);
        self.progress.objects_done.store(0, Ordering::Relaxed);
        // 3. Copy, then make the copies durable before saying so.
        let mut pacer = Pacer::new(0);
        for (object, source) in &work {
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
                &self.progress,
                &mut pacer,
            )
            .await?;
            self.progress.objects_done.fetch_add(1, Ordering::Relaxed);
        }
        let copied: Vec<ObjectId> = work.iter().map(|(object, _)| *object).collect();
        for batch in copied.chunks(crate::store::SYNC_OBJECTS_MAX) {
            self.store
                .sync(batch)
                .await
                .map_err(|error| format!("cannot sync the copies: {error}"))?;
        }
        // 4. Done.
        meta.call(
            &ResyncDone {
                server_id: me,
                map_version: order.map_version,
            },
            Bytes::new(),
        )
        .await
        .map_err(|error| format!("the meta server did not take the end of the resync: {error}"))?;
        Ok(work.len() as u64)
    }
}

impl Resync {
    /// Once a drain of this server is complete in the map it holds (`map_version`), remove
    /// the copies it gave up, once per map version, in the background.
    pub fn clean_after_drain(self: &Arc<Self>, map_version: u64) {
        if self.cleaned_version.load(Ordering::Acquire) == map_version
            || self.cleaning.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let resync = Arc::clone(self);
        tokio::spawn(async move {
            let me = resync.store.server_id();
            let map = resync.replication.map().await;
            let drained = map.replacements.iter().any(|replacement| {
                replacement.server == me && replacement.drain && replacement.complete
            });
            let cleaned = if drained {
                match resync.replication.connect_meta(&resync.options).await {
                    Ok(meta) => resync.remove_replaced(&map, &meta).await,
                    Err(error) => Err(error.to_string()),
                }
            } else {
                Ok(())
            };
            match cleaned {
                Ok(()) => resync.cleaned_version.store(map.version, Ordering::Release),
                Err(error) => {
                    tracing::warn!(server_id = me, %error, "cannot remove the copies a drain gave up yet; trying again")
                }
            }
            resync.cleaning.store(false, Ordering::Release);
        });
    }

    /// Remove this server's copies of the stripes it was replaced for (lost for good,
    /// then back, or drained): the map gives them to stand-ins, so they are never read or
    /// written here again. Objects of files that are gone are left (the reaper sent their removal
    /// to the stand-ins; `freeflow fsck --repair` finds them).
    async fn remove_replaced(
        &self,
        map: &ServiceMap,
        meta: &freeflow_rpc::Connection,
    ) -> Result<(), String> {
        let me = self.store.server_id();
        let Some(below) = map
            .replacements
            .iter()
            .filter(|replacement| replacement.server == me)
            .map(|replacement| replacement.inodes_below)
            .max()
        else {
            return Ok(());
        };
        let own = list_own(&self.store, |listed| listed.object.inode < below).await?;
        let layouts = layouts(meta, own.iter()).await?;
        let mut removed = 0u64;
        for object in own {
            let Some(layout) = layouts.get(&object.inode) else {
                continue;
            };
            if layout.keeps(object.stripe_index, me) && !map.keeps(object, layout, me) {
                self.store
                    .remove_one(object)
                    .await
                    .map_err(|error| format!("cannot remove {object:?}, given up: {error}"))?;
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(
                server_id = me,
                objects = removed,
                "removed the copies this server was replaced for while it was lost"
            );
        }
        Ok(())
    }
}

/// Where a syncing member's copy of a stripe comes from.
#[derive(Debug, PartialEq, Eq)]
enum Source {
    Partner(ServerId),
    /// No member is fresher than this one: its copy stands.
    Mine,
    /// The freshest copy is on a member that is out: wait for it.
    Away(ServerId),
}

/// Where a syncing member copies a stripe from: the first member of its chain in service
/// (a stand-in still filling is none); if none is, the member that went out last (it
/// missed the fewest writes), if that one went out after this one.
fn source_of(map: &ServiceMap, chain: &[ChainMember], me: ServerId) -> Source {
    let partners = || {
        chain
            .iter()
            .filter(|member| member.server != me && !member.filling)
            .map(|member| member.server)
    };
    if let Some(server) = partners().find(|server| map.state(*server) == MemberState::InService) {
        return Source::Partner(server);
    }
    let since = |server: ServerId| {
        map.member(server)
            .map_or(0, |member| member.unsynced_since_ms)
    };
    let freshest = partners().max_by_key(|server| since(*server));
    match freshest {
        Some(server) if since(server) > since(me) => {
            if map.state(server) == MemberState::Syncing {
                Source::Partner(server)
            } else {
                Source::Away(server)
            }
        }
        _ => Source::Mine,
    }
}

/// A member out that went out after `me` did (the freshest such), if any: until it returns,
/// no listing shows what it alone may hold.
fn fresher_and_out(map: &ServiceMap, me: ServerId) -> Option<ServerId> {
    let mine = map.member(me).map_or(0, |member| member.unsynced_since_ms);
    map.members
        .iter()
        .filter(|member| {
            member.server_id != me
                && member.state == MemberState::Out
                && member.unsynced_since_ms > mine
                // Lost for good: its stripes are made again from the others.
                && !map.replaced_while_out(member.server_id)
        })
        .max_by_key(|member| member.unsynced_since_ms)
        .map(|member| member.server_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_proto::meta::Member;

    #[test]
    fn the_source_is_the_first_partner_in_service_else_the_freshest() {
        let member = |server_id, state, unsynced_since_ms| Member {
            server_id,
            address: String::new(),
            state,
            incarnation: 1,
            unsynced_since_ms,
        };
        let chain = |servers: &[ServerId]| -> Vec<ChainMember> {
            servers
                .iter()
                .map(|server| ChainMember {
                    server: *server,
                    filling: false,
                })
                .collect()
        };
        let map = ServiceMap {
            replacements: Vec::new(),
            version: 3,
            members: vec![
                member(1, MemberState::Out, 500),
                member(2, MemberState::InService, 0),
                member(3, MemberState::Syncing, 100),
                member(4, MemberState::InService, 0),
                member(5, MemberState::Syncing, 300),
            ],
        };
        assert_eq!(
            source_of(&map, &chain(&[1, 3, 4, 2]), 3),
            Source::Partner(4)
        );
        // No member in service: the one that went out last, if after this one.
        assert_eq!(source_of(&map, &chain(&[3, 5]), 3), Source::Partner(5));
        assert_eq!(source_of(&map, &chain(&[3, 5]), 5), Source::Mine);
        assert_eq!(source_of(&map, &chain(&[3, 1]), 3), Source::Away(1));
        // Server 1 went out after 3 and 5 became unsynced: their copies wait for it.
        assert_eq!(fresher_and_out(&map, 3), Some(1));
        assert_eq!(fresher_and_out(&map, 5), Some(1));
        assert_eq!(fresher_and_out(&map, 1), None);
        let mut later = map.clone();
        later.members[0].unsynced_since_ms = 50;
        assert_eq!(fresher_and_out(&later, 3), None);
    }
}
