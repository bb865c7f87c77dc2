//! The I/O servers and the cluster: registration, service map, resync, status.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

use freeflow_proto::meta::{
    ClusterReport, FsStats, InodeFacts, InspectInodes, MemberState, RegisterReply, RegisterServer,
    ResyncDone, INSPECT_INODES_MAX,
};
use freeflow_proto::{ErrorCode, WireError};

use super::reply::at_most;
use crate::ops;
use crate::records::{decode_versioned, inode_key, ServerEntry};
use crate::shared::Shared;
use crate::store::{StoreRead, TableId};

/// Longest I/O server address accepted at registration.
pub const SERVER_ADDRESS_LENGTH_MAX: usize = 256;

pub(super) fn stat_fs(shared: &Shared) -> FsStats {
    let totals = shared.registry().totals(Instant::now());
    FsStats {
        capacity_bytes: totals.capacity_bytes,
        free_bytes: totals.free_bytes,
        inode_count: shared.inode_count.load(Ordering::Relaxed),
        servers_up: totals.servers_up,
        servers_total: totals.servers_total,
    }
}

/// `InspectInodes` (for `freeflow fsck`): each inode's record, orphan and truncation
/// records, and whether a client has it open for writing, read in one transaction.
pub(super) fn inspect_inodes(
    shared: &Shared,
    request: &InspectInodes,
) -> Result<Vec<InodeFacts>, WireError> {
    at_most(
        "InspectInodes",
        "inodes",
        request.inodes.len(),
        INSPECT_INODES_MAX,
    )?;
    let mut facts = shared.read(|read| {
        let high_water = ops::inode_high_water(read)?;
        let mut facts = Vec::with_capacity(request.inodes.len());
        for inode in &request.inodes {
            let record = ops::try_load_inode(read, *inode)?;
            let orphan = read
                .get(TableId::Orphans, &inode_key(*inode))?
                .map(|bytes| {
                    decode_versioned::<crate::records::OrphanRecord>(TableId::Orphans, &bytes)
                })
                .transpose()?;
            let truncation = ops::truncate::load_truncation(read, *inode)?;
            facts.push(InodeFacts {
                inode: *inode,
                kind: record.as_ref().map(|record| record.attr.kind),
                size_bytes: record.as_ref().map_or(0, |record| record.attr.size_bytes),
                layout: record.and_then(|record| record.attr.layout),
                orphan: orphan.map(|orphan| orphan.layout),
                pending_cuts: truncation.map(|record| record.cuts).unwrap_or_default(),
                open_for_writing: false,
                not_yet_allocated: *inode >= high_water,
            });
        }
        Ok(facts)
    })?;
    let writing = shared.sessions().open_for_writing(&request.inodes);
    for fact in &mut facts {
        fact.open_for_writing = writing.contains(&fact.inode);
    }
    Ok(facts)
}

pub(super) fn cluster_status(shared: &Shared) -> ClusterReport {
    // Taken first: a guard taken inside the literal below would live to its end.
    let replacements = shared.registry().service_map().replacements;
    ClusterReport {
        servers: shared.registry().records(Instant::now()),
        inode_count: shared.inode_count.load(Ordering::Relaxed),
        orphan_count: shared.orphan_count.load(Ordering::Relaxed),
        ready_ms: shared.ready_ms.load(Ordering::Relaxed),
        uptime_ms: shared.started.elapsed().as_millis() as u64,
        meta_metrics_address: shared.metrics_address.clone(),
        meta_members: shared.meta_members(),
        replacements,
    }
}

pub(super) async fn register_server(
    shared: &Arc<Shared>,
    request: RegisterServer,
) -> Result<RegisterReply, WireError> {
    if request.address.is_empty() || request.address.len() > SERVER_ADDRESS_LENGTH_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!("server address must be 1..={SERVER_ADDRESS_LENGTH_MAX} bytes"),
        ));
    }
    if let Some(metrics_address) = &request.metrics_address {
        if metrics_address.is_empty() || metrics_address.len() > SERVER_ADDRESS_LENGTH_MAX {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("metrics address must be 1..={SERVER_ADDRESS_LENGTH_MAX} bytes"),
            ));
        }
    }
    if shared.registry().removed(request.server_id) {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "I/O server {} was removed from the cluster (`freeflow server remove`) and its id is not used again: give this server a new server_id and an empty data directory",
                request.server_id
            ),
        ));
    }
    let entry = ServerEntry {
        address: request.address.clone(),
        capacity_bytes: request.capacity_bytes,
        free_bytes: request.free_bytes,
        object_count: request.object_count,
        // Kept from the registry by `heartbeat`: a heartbeat does not move a server.
        state: MemberState::InService,
        unsynced_since_ms: 0,
        copy_everything: false,
    };
    let (needs_persist, known, known_before) = {
        let registry = shared.registry();
        (
            registry.needs_persist(request.server_id, &request.address),
            registry.len(),
            registry.address(request.server_id).is_some(),
        )
    };
    if needs_persist {
        let server_id = request.server_id;
        if shared.registry().address(server_id).is_none() && known >= ops::servers::SERVERS_MAX {
            return Err(WireError::new(
                ErrorCode::NoSpace,
                format!(
                    "{} I/O servers are registered, the limit",
                    ops::servers::SERVERS_MAX
                ),
            ));
        }
        let mut persisted = entry.clone();
        if let Some(current) = shared.registry().entry(server_id) {
            persisted.state = current.state;
            persisted.unsynced_since_ms = current.unsynced_since_ms;
            persisted.copy_everything = current.copy_everything;
        }
        shared
            .write(move |write, _context| ops::servers::put_server(write, server_id, &persisted))
            .await?;
        tracing::info!(server_id, address = %request.address, "I/O server registered");
    }
    let (came_up, change, resync) = {
        let mut registry = shared.registry();
        let now = Instant::now();
        let came_up = registry.heartbeat(request.server_id, entry, now);
        registry.set_metrics_address(request.server_id, request.metrics_address);
        registry.note_cleaned(request.server_id, request.cleaned_version);
        let change = registry.note_registration(
            request.server_id,
            request.incarnation,
            request.map_version,
            request.fresh,
            known_before,
        );
        (
            came_up,
            change,
            registry.resync_order(request.server_id, now),
        )
    };
    let fill = shared.registry().fill_order(
        request.server_id,
        Instant::now(),
        shared.config.rereplicate_bytes_per_second,
    );
    if let Some(change) = change {
        persist_states(shared, vec![change]).await?;
    }
    if came_up {
        // Orphans waiting for this server are removed at once.
        shared.reaper_wake.notify_one();
    }
    // The cuts it owes are made before it is told it may serve data.
    let cuts_owed = crate::reaper::cuts_owed_by(shared, request.server_id).await;
    if cuts_owed > 0 {
        tracing::info!(
            server_id = request.server_id,
            cuts_owed,
            "registering I/O server still owes truncation cuts; it serves no data until they are made"
        );
    }
    Ok(RegisterReply {
        heartbeat_interval_ms: shared.config.heartbeat_interval_ms,
        cuts_owed,
        map_version: shared.registry().map_version(),
        resync: if cuts_owed == 0 { resync } else { None },
        fill: if cuts_owed == 0 { fill } else { None },
        lease_ms: shared.config.server_down_after_ms / 2,
    })
}

/// Make changes of servers' states in their chains durable: a server put out must stay out
/// after a restart of the meta server, since its copies are stale until it resyncs.
pub async fn persist_states(
    shared: &Arc<Shared>,
    changes: Vec<crate::registry::StateChange>,
) -> Result<(), WireError> {
    let registry_of = Arc::clone(shared);
    shared
        .write(move |write, _context| {
            for (server, stale) in changes {
                // Written as the registry holds it now: a later change is never undone by
                // an earlier one that reached the writer after it.
                let entry = registry_of.registry().entry(server).unwrap_or(stale);
                ops::servers::put_server(write, server, &entry)?;
            }
            Ok(())
        })
        .await?;
    shared.sync().await?;
    Ok(())
}

pub(super) async fn resync_done(
    shared: &Arc<Shared>,
    request: ResyncDone,
) -> Result<(), WireError> {
    let change = shared
        .registry()
        .resync_done(request.server_id, request.map_version)
        .map_err(|reason| WireError::new(ErrorCode::Stale, reason))?;
    if let Some(change) = change {
        tracing::info!(
            server_id = request.server_id,
            "I/O server resynced: back in service"
        );
        persist_states(shared, vec![change]).await?;
    }
    Ok(())
}
