//! The leader's side of re-replication (issue 42): it replaces the I/O servers lost for
//! good and records the stand-ins' copies as they end. What a replacement is and how
//! chains read through it: `replacements.rs`, `ServiceMap::chain`; the copy itself:
//! `ioserver/src/fill.rs`.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::{IoServerChange, ServerRecord};
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::ServerId;

use crate::ops;
use crate::replacements::ReplacementChange;
use crate::shared::Shared;

/// At every heartbeat interval: replaces the servers out past `server_dead_after_ms`, and
/// completes the drains whose seal every server in service holds.
pub(crate) async fn replace_lost_servers(shared: Arc<Shared>) {
    let dead_after = match shared.config.server_dead_after_ms {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    };
    let period = Duration::from_millis(u64::from(shared.config.heartbeat_interval_ms).max(10));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let lost = match dead_after {
            Some(dead_after) => shared.registry().lost(dead_after, Instant::now()),
            None => Vec::new(),
        };
        for server in lost {
            if let Err(error) = replace(&shared, server).await {
                tracing::error!(server, %error, "cannot replace a lost I/O server; trying again");
            }
        }
        if shared.config.rebalance {
            if let Err(error) = rebalance(&shared).await {
                tracing::error!(%error, "cannot start a rebalance; trying again");
            }
        }
        let complete = shared.registry().completable_drains(Instant::now());
        if !complete.is_empty() {
            if let Err(error) = persist(&shared, &complete).await {
                tracing::error!(%error, "cannot complete a drain; trying again");
                continue;
            }
            for (_, record) in &complete {
                tracing::info!(
                    server = record.server,
                    "drain complete: the I/O server is in no chain any more"
                );
            }
            shared.registry().apply_replacements(complete);
        }
    }
}

/// Replace lost `server` in the chains of every replicated stripe of the files that
/// exist now.
async fn replace(shared: &Arc<Shared>, server: ServerId) -> Result<(), WireError> {
    // Every inode made so far is below the high water (numbers are reserved in batches
    // before they are given).
    let inodes_below = shared.read(|read| Ok(ops::inode_high_water(read)?))?;
    let Some(changes) = shared
        .registry()
        .propose_replacement(server, inodes_below, Instant::now())
    else {
        tracing::warn!(
            server,
            "I/O server lost for good, but no other server is in service to take its place"
        );
        return Ok(());
    };
    let by = changes
        .last()
        .map(|(_, record)| record.by.clone())
        .unwrap_or_default();
    persist(shared, &changes).await?;
    shared.registry().apply_replacements(changes);
    tracing::warn!(
        server,
        inodes_below,
        ?by,
        "I/O server out past server_dead_after_ms: lost for good; its copies of replicated stripes are made again on the others"
    );
    Ok(())
}

/// Start a rebalance when the servers' used bytes are uneven (`Registry::rebalance_plan`):
/// each server over its share gives a share of its stripes (a partial drain) to those
/// under theirs.
async fn rebalance(shared: &Arc<Shared>) -> Result<(), WireError> {
    let min_bytes = shared.config.rebalance_min_bytes;
    let Some((givers, takers)) = shared.registry().rebalance_plan(Instant::now(), min_bytes) else {
        return Ok(());
    };
    let inodes_below = shared.read(|read| Ok(ops::inode_high_water(read)?))?;
    let changes = shared
        .registry()
        .propose_rebalance(&givers, &takers, inodes_below);
    persist(shared, &changes).await?;
    shared.registry().apply_replacements(changes);
    tracing::info!(
        ?givers,
        ?takers,
        inodes_below,
        "rebalance: servers over their share of the used bytes give part of their stripes (millionths) to those under"
    );
    Ok(())
}

/// After a create replayed with the layout its first answer gave: if that layout names a
/// server that left the cluster by a record not covering the file (`Registry::uncovered`),
/// a further record covers it, so its stripes are made again or moved like the others.
pub(crate) fn cover_replayed(
    shared: &Arc<Shared>,
    inode: freeflow_types::InodeId,
    layout: freeflow_types::Layout,
) {
    let uncovered = shared.registry().uncovered(inode, &layout);
    if uncovered.is_empty() {
        return;
    }
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        for (server, drained) in uncovered {
            let Some(changes) =
                shared
                    .registry()
                    .propose_cover(server, drained, inode + 1, Instant::now())
            else {
                continue;
            };
            if let Err(error) = persist(&shared, &changes).await {
                tracing::error!(server, inode, %error, "cannot cover a replayed file's layout");
                continue;
            }
            shared.registry().apply_replacements(changes);
            tracing::warn!(
                server,
                inode,
                drained,
                "a create replayed after a leader change names a server that left the cluster: a further record covers it"
            );
        }
    });
}

/// Make replacement records durable (before the map shows a new one: a restart of the
/// leader must not forget where a stripe's writes went).
pub(crate) async fn persist(
    shared: &Arc<Shared>,
    changes: &[ReplacementChange],
) -> Result<(), WireError> {
    let records = changes.to_vec();
    shared
        .write(move |write, _context| {
            for (sequence, record) in &records {
                ops::servers::put_replacement(write, *sequence, record)?;
            }
            Ok(())
        })
        .await?;
    shared.sync().await?;
    Ok(())
}

/// `FillDone`: a stand-in copied what its order asked for these records; it serves reads
/// of those stripes from the next map on.
pub(crate) async fn fill_done(
    shared: &Arc<Shared>,
    server: ServerId,
    records: &[(ServerId, u64)],
) -> Result<(), WireError> {
    let changes = shared.registry().fill_done(server, records);
    if changes.is_empty() {
        return Ok(());
    }
    persist(shared, &changes).await?;
    shared.registry().apply_replacements(changes);
    tracing::info!(
        server,
        ?records,
        "I/O server copied the stripes it takes for these replacements: it serves their reads now"
    );
    Ok(())
}

/// `ChangeIoServer`: drain or remove an I/O server (`freeflow server drain|remove`).
pub(crate) async fn change_io_server(
    shared: &Arc<Shared>,
    server: ServerId,
    change: IoServerChange,
) -> Result<Vec<ServerRecord>, WireError> {
    let refused = |reason: String| WireError::new(ErrorCode::InvalidArgument, reason);
    match change {
        IoServerChange::Drain => {
            let inodes_below = shared.read(|read| Ok(ops::inode_high_water(read)?))?;
            let proposal = shared
                .registry()
                .propose_drain(server, inodes_below, Instant::now())
                .map_err(refused)?;
            let by = proposal.1.by.clone();
            persist(shared, std::slice::from_ref(&proposal)).await?;
            shared.registry().apply_replacements(vec![proposal]);
            tracing::warn!(
                server,
                inodes_below,
                ?by,
                "I/O server drained: its stripes are copied to the others, and new files go elsewhere"
            );
        }
        IoServerChange::Remove { force } => {
            let (id, entry) = shared
                .registry()
                .propose_removal(server, force)
                .map_err(refused)?;
            let persisted = entry.clone();
            shared
                .write(move |write, _context| ops::servers::put_server(write, id, &persisted))
                .await?;
            shared.sync().await?;
            shared.registry().apply_removal(id);
        }
    }
    Ok(shared.registry().records(Instant::now()))
}
