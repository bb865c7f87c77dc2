//! The I/O server registry: which servers exist, where they listen, how full they are and
//! whether they are up (seen within `server_down_after_ms`).
//!
//! Ids and addresses are persisted (the reaper and new layouts need them after a restart);
//! capacity figures from heartbeats are kept in memory and written only with an address
//! change, so a heartbeat costs no fsync.
//!
//! It also keeps the service map (DESIGN.md §7): each server's place in the chains of
//! replicated stripes. A server silent past `server_down_after_ms` is put out (writes go on
//! without it); when it registers again it is syncing (it takes every write again while it
//! copies what changed in its absence, see `ioserver/src/resync.rs`), and back in service
//! once it says its copy is done. Every change gives the map a new version; states are
//! persisted with the server's entry, so an out server stays out across a restart.
//!
//! A server out past `server_dead_after_ms` is replaced in the chains of replicated
//! stripes (`replacements.rs`); the registry gives the servers that take its place their
//! order to copy once every server in service holds the map that names them.

use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::{
    FillOrder, Member, MemberState, Replacement, ResyncOrder, ServerRecord, ServiceMap, SHARE_ALL,
};
use freeflow_types::{InodeId, ServerId};

use crate::records::ServerEntry;
use crate::replacements::{ReplacementChange, Replacements};

/// A rebalance: the servers over their share, each with the part of its stripes to give
/// (millionths), and the servers under theirs that take them.
pub type RebalancePlan = (Vec<(ServerId, u32)>, Vec<ServerId>);

/// A server holding more than its share of the used bytes by more than this percentage of
/// its share (and `rebalance_min_bytes`) gives the excess to servers under their share.
pub const REBALANCE_SLACK_PERCENT: u64 = 5;

/// Added to the time a server was out when telling it how far back to copy: covers writes
/// made while it was already silent but not yet put out, and clock-rate differences.
pub const RESYNC_MARGIN_MS: u64 = 60_000;

#[derive(Clone, Debug)]
struct ServerState {
    entry: ServerEntry,
    last_seen: Option<Instant>,
    /// From the last heartbeat; in memory only.
    metrics_address: Option<String>,
    /// Per start of the server process, from its heartbeat (0: not heard since our start).
    incarnation: u64,
    /// The map version its last heartbeat said it holds.
    held_version: u64,
    /// The map version at which it last became syncing: a copy ordered before does not
    /// count.
    syncing_since_version: u64,
    /// The map version under which it last removed what a complete drain of it gave up
    /// (from its registration).
    cleaned_version: u64,
}

#[derive(Debug)]
pub struct Registry {
    servers: BTreeMap<ServerId, ServerState>,
    down_after: Duration,
    map_version: u64,
    started: Instant,
    replacements: Replacements,
}

/// A server's state changed: its entry must be persisted.
pub type StateChange = (ServerId, ServerEntry);

/// Milliseconds since the Unix epoch on this host's clock.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// Sums over the registry for statfs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryTotals {
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub servers_up: u32,
    pub servers_total: u32,
}

impl Registry {
    pub fn new(
        persisted: Vec<(ServerId, ServerEntry)>,
        replacements: Vec<(u64, Replacement)>,
        down_after: Duration,
    ) -> Registry {
        let started = Instant::now();
        let servers = persisted
            .into_iter()
            .map(|(id, entry)| {
                (
                    id,
                    ServerState {
                        entry,
                        last_seen: None,
                        metrics_address: None,
                        incarnation: 0,
                        held_version: 0,
                        syncing_since_version: 0,
                        cleaned_version: 0,
                    },
                )
            })
            .collect();
        // Versions from an earlier run of the meta server were smaller: it counted up from
        // its own start time, and never gives more than one version per microsecond.
        let map_version = unix_ms().saturating_mul(1000).max(1);
        Registry {
            servers,
            down_after,
            map_version,
            started,
            replacements: Replacements::new(replacements, map_version),
        }
    }

    /// A server's place in its chains (an unknown server counts as in service).
    pub fn state(&self, server: ServerId) -> MemberState {
        self.servers
            .get(&server)
            .map_or(MemberState::InService, |state| state.entry.state)
    }

    pub fn map_version(&self) -> u64 {
        self.map_version
    }

    /// The service map as clients and I/O servers fetch it.
    pub fn service_map(&self) -> ServiceMap {
        ServiceMap {
            version: self.map_version,
            members: self
                .servers
                .iter()
                .filter(|(_, state)| state.entry.state != MemberState::Removed)
                .map(|(id, state)| Member {
                    server_id: *id,
                    address: state.entry.address.clone(),
                    state: state.entry.state,
                    incarnation: state.incarnation,
                    unsynced_since_ms: state.entry.unsynced_since_ms,
                })
                .collect(),
            replacements: self.replacements.records(),
        }
    }

    /// The servers out for at least `dead_after`, not replaced since they went out: lost
    /// for good. Out that long by the wall clock since it may lack writes (persisted, so a
    /// leader change does not start the wait again), or by this leader's own clock since it
    /// last heard from it (or since its start).
    pub fn lost(&self, dead_after: Duration, now: Instant) -> Vec<ServerId> {
        let now_ms = unix_ms();
        self.servers
            .iter()
            .filter(|(id, state)| {
                let out_for_ms = now_ms.saturating_sub(state.entry.unsynced_since_ms);
                let silent_for =
                    now.saturating_duration_since(state.last_seen.unwrap_or(self.started));
                state.entry.state == MemberState::Out
                    && (out_for_ms >= dead_after.as_millis() as u64 || silent_for >= dead_after)
                    && !self
                        .replacements
                        .replaced_since(**id, state.entry.unsynced_since_ms)
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// The servers that may take `server`'s place: up, in service, and not drained
    /// themselves.
    fn stand_ins_for(&self, server: ServerId, now: Instant) -> Vec<ServerId> {
        self.servers
            .iter()
            .filter(|(id, state)| {
                **id != server
                    && state.entry.state == MemberState::InService
                    && self.is_up(state, now)
                    && !self.replacements.drains(**id)
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// The records that replace lost `server` for the inodes below `inodes_below`: the
    /// servers up, in service and not drained take its place. None when there is none.
    pub fn propose_replacement(
        &self,
        server: ServerId,
        inodes_below: InodeId,
        now: Instant,
    ) -> Option<Vec<ReplacementChange>> {
        let by = self.stand_ins_for(server, now);
        if by.is_empty() {
            return None;
        }
        Some(
            self.replacements
                .propose(server, inodes_below, by, unix_ms()),
        )
    }

    /// Take replacement records as persisted: the map changes.
    pub fn apply_replacements(&mut self, changes: Vec<ReplacementChange>) {
        if changes.is_empty() {
            return;
        }
        self.map_version += 1;
        self.replacements.apply(changes, self.map_version);
    }

    /// The copy a server taking a lost one's place may start: only once every server in
    /// service and up holds the map that names it, so every write taken from then on is
    /// passed on to it and every write taken before is on the survivors it copies from.
    pub fn fill_order(
        &self,
        server: ServerId,
        now: Instant,
        bytes_per_second: u64,
    ) -> Option<FillOrder> {
        let since = self.replacements.filling_since(server)?;
        let state = self.servers.get(&server)?;
        if state.entry.state != MemberState::InService {
            return None;
        }
        let all_hold = self.servers.values().all(|other| {
            other.entry.state != MemberState::InService
                || !self.is_up(other, now)
                || other.held_version >= since
        });
        all_hold.then_some(FillOrder {
            map_version: self.map_version,
            bytes_per_second,
        })
    }

    /// `server` copied what its order asked for these records: them, changed, to persist
    /// before [`Registry::apply_replacements`].
    pub fn fill_done(
        &self,
        server: ServerId,
        records: &[(ServerId, u64)],
    ) -> Vec<ReplacementChange> {
        self.replacements.fill_done(server, records)
    }

    /// The map version from which `server` may copy what it fills (None: it fills
    /// nothing).
    pub fn filling_since(&self, server: ServerId) -> Option<u64> {
        self.replacements.filling_since(server)
    }

    /// Whether `server` was removed from the cluster (its registrations are refused).
    pub fn removed(&self, server: ServerId) -> bool {
        self.state(server) == MemberState::Removed
    }

    /// The servers of `layout` (a file's, of inode `inode`) that left the cluster — lost
    /// for good (a stripe with more than one copy) or drained — by a record that does not
    /// cover this inode: a create replayed after a leader change keeps the layout its first
    /// answer gave, made before the record but numbered past its bound. Each with whether
    /// it was drained.
    pub fn uncovered(
        &self,
        inode: InodeId,
        layout: &freeflow_types::Layout,
    ) -> Vec<(ServerId, bool)> {
        let map = self.service_map();
        let mut servers: Vec<ServerId> = layout.servers.clone();
        servers.extend(layout.copies.iter().copied());
        servers.sort_unstable();
        servers.dedup();
        servers
            .into_iter()
            .filter_map(|server| {
                let drained = self.replacements.drains(server);
                let lost = layout.replicas() >= 2 && map.replaced_while_out(server);
                let covered = map.replacements.iter().any(|replacement| {
                    replacement.server == server
                        && replacement.share_ppm >= SHARE_ALL
                        && replacement.drain == drained
                        && inode < replacement.inodes_below
                });
                ((drained || lost) && !covered).then_some((server, drained))
            })
            .collect()
    }

    /// A further drain record of `server` (drained already) for the inodes below
    /// `inodes_below`, or a further replacement of it (lost): see [`Registry::uncovered`].
    pub fn propose_cover(
        &self,
        server: ServerId,
        drained: bool,
        inodes_below: InodeId,
        now: Instant,
    ) -> Option<Vec<ReplacementChange>> {
        if !drained {
            return self.propose_replacement(server, inodes_below, now);
        }
        let by = self.stand_ins_for(server, now);
        (!by.is_empty()).then(|| {
            vec![self
                .replacements
                .propose_drain(server, inodes_below, by, unix_ms(), SHARE_ALL)]
        })
    }

    /// The record that drains `server` for the inodes below `inodes_below`, by every other
    /// server in service and up that is not drained itself; why not, if it cannot be.
    pub fn propose_drain(
        &self,
        server: ServerId,
        inodes_below: InodeId,
        now: Instant,
    ) -> Result<ReplacementChange, String> {
        match self.servers.get(&server) {
            None => return Err(format!("I/O server {server} is not registered")),
            Some(state) if state.entry.state == MemberState::Removed => {
                return Err(format!("I/O server {server} was removed from the cluster"))
            }
            Some(_) => {}
        }
        if self.replacements.drains(server) {
            return Err(format!(
                "I/O server {server} is drained already (see `freeflow status`)"
            ));
        }
        let by = self.stand_ins_for(server, now);
        if by.is_empty() {
            return Err(format!(
                "no other I/O server is in service to take the stripes of server {server}"
            ));
        }
        Ok(self
            .replacements
            .propose_drain(server, inodes_below, by, unix_ms(), SHARE_ALL))
    }

    /// Drains whose every stand-in is done, sealed in a map that every server in service
    /// and up holds: they can complete.
    pub fn completable_drains(&self, now: Instant) -> Vec<ReplacementChange> {
        let held = self
            .servers
            .values()
            .filter(|state| state.entry.state == MemberState::InService && self.is_up(state, now))
            .map(|state| state.held_version)
            .min()
            .unwrap_or(0);
        self.replacements.completable(held)
    }

    /// The entry that removes `server` from the cluster, to persist before
    /// [`Registry::apply_removal`]; why not, if it cannot be. A server is removed once its
    /// drain is complete and it holds no object, or (with `force`) once it was lost for
    /// good: its stripes with one copy are lost with it.
    pub fn propose_removal(&self, server: ServerId, force: bool) -> Result<StateChange, String> {
        let Some(state) = self.servers.get(&server) else {
            return Err(format!("I/O server {server} is not registered"));
        };
        if state.entry.state == MemberState::Removed {
            return Err(format!("I/O server {server} was removed already"));
        }
        let lost = state.entry.state == MemberState::Out
            && self
                .replacements
                .replaced_since(server, state.entry.unsynced_since_ms);
        let may_go = self.replacements.drained(server) || (force && lost);
        if !may_go {
            return Err(if lost {
                format!(
                    "I/O server {server} was lost for good and its stripes with more than one copy were made again, but it may hold stripes with one copy: drain it if it can run again, or remove it with --force to give them up"
                )
            } else {
                format!(
                    "I/O server {server} still holds stripes: drain it first (`freeflow server drain {server}`) and wait until `freeflow status` shows the drain complete"
                )
            });
        }
        if !lost && state.entry.object_count > 0 {
            return Err(format!(
                "I/O server {server} still reports {} objects: wait until it has removed the copies it gave up (it does so once the drain completes), or see `freeflow fsck`",
                state.entry.object_count
            ));
        }
        let mut entry = state.entry.clone();
        entry.state = MemberState::Removed;
        Ok((server, entry))
    }

    /// Remove a server as [`Registry::propose_removal`] proposed and the store now says.
    pub fn apply_removal(&mut self, server: ServerId) {
        if self.set_state(server, MemberState::Removed).is_some() {
            tracing::warn!(server, "I/O server removed from the cluster");
        }
    }

    /// What a registration said of the copies a drain gave up: removed under this map.
    pub fn note_cleaned(&mut self, server: ServerId, cleaned_version: u64) {
        if let Some(state) = self.servers.get_mut(&server) {
            state.cleaned_version = cleaned_version;
        }
    }

    /// The next rebalance, if usage is uneven (a server's used bytes off its share, by
    /// capacity, by more than [`REBALANCE_SLACK_PERCENT`] of it and `min_bytes`): every
    /// server over its share with the part of its stripes to move (in millionths), and the
    /// servers furthest under theirs that take them. None while copies still move or a drained
    /// server has not yet removed what it gave up (its usage would mislead), or when
    /// usage is even. Used bytes are the disks' (capacity less free): a server with a
    /// disk of its own.
    pub fn rebalance_plan(&self, now: Instant, min_bytes: u64) -> Option<RebalancePlan> {
        if self.replacements.moving() {
            return None;
        }
        let cleaning = self
            .replacements
            .completed_drains()
            .any(|(server, version)| {
                self.servers.get(&server).is_some_and(|state| {
                    state.entry.state == MemberState::InService
                        && self.is_up(state, now)
                        && state.cleaned_version < version
                })
            });
        if cleaning {
            return None;
        }
        let usage: Vec<(ServerId, u64, u64)> = self
            .servers
            .iter()
            .filter(|(id, state)| {
                state.entry.state == MemberState::InService
                    && self.is_up(state, now)
                    && !self.replacements.drains(**id)
                    && state.entry.capacity_bytes > 0
            })
            .map(|(id, state)| {
                let used = state
                    .entry
                    .capacity_bytes
                    .saturating_sub(state.entry.free_bytes);
                (*id, used, state.entry.capacity_bytes)
            })
            .collect();
        let total_used: u128 = usage.iter().map(|(_, used, _)| u128::from(*used)).sum();
        let total_capacity: u128 = usage
            .iter()
            .map(|(_, _, capacity)| u128::from(*capacity))
            .sum();
        if usage.len() < 2 || total_capacity == 0 {
            return None;
        }
        let share_of = |capacity: u64| (total_used * u128::from(capacity) / total_capacity) as u64;
        let threshold = |share: u64| min_bytes.max(share / 100 * REBALANCE_SLACK_PERCENT);
        // (server, used, share) of each.
        let shares: Vec<(ServerId, u64, u64)> = usage
            .iter()
            .map(|(server, used, capacity)| (*server, *used, share_of(*capacity)))
            .collect();
        let uneven = shares
            .iter()
            .any(|(_, used, share)| used.abs_diff(*share) > threshold(*share));
        if !uneven {
            return None;
        }
        // Every server over its share gives its excess (at least a MiB of it: smaller
        // moves are not worth a record); the servers furthest under take it.
        let givers: Vec<(ServerId, u32)> = shares
            .iter()
            .filter(|(_, used, share)| used.saturating_sub(*share) >= 1 << 20)
            .map(|(server, used, share)| {
                let over = used - share;
                let ppm = u128::from(over) * u128::from(SHARE_ALL) / u128::from((*used).max(1));
                (*server, (ppm as u32).clamp(1, SHARE_ALL))
            })
            .collect();
        let far_under: Vec<ServerId> = shares
            .iter()
            .filter(|(_, used, share)| share.saturating_sub(*used) > threshold(*share) / 2)
            .map(|(server, _, _)| *server)
            .collect();
        let takers = if far_under.is_empty() {
            shares
                .iter()
                .filter(|(_, used, share)| used < share)
                .map(|(server, _, _)| *server)
                .collect()
        } else {
            far_under
        };
        (!givers.is_empty() && !takers.is_empty()).then_some((givers, takers))
    }

    /// The records of a rebalance `rebalance_plan` gave, for the inodes below
    /// `inodes_below`.
    pub fn propose_rebalance(
        &self,
        givers: &[(ServerId, u32)],
        takers: &[ServerId],
        inodes_below: InodeId,
    ) -> Vec<ReplacementChange> {
        self.replacements
            .propose_shares(givers, inodes_below, takers, unix_ms())
    }

    /// (stand-ins still copying, stand-ins in all) over every replacement.
    pub fn replacement_progress(&self) -> (usize, usize) {
        self.replacements.progress()
    }

    /// Move a server to `to` in memory (its entry must already be persisted that way when
    /// `to` is `Out`, see [`Registry::silent`]).
    fn set_state(&mut self, server: ServerId, to: MemberState) -> Option<StateChange> {
        let state = self.servers.get_mut(&server)?;
        if state.entry.state == to {
            return None;
        }
        tracing::info!(server, from = ?state.entry.state, ?to, "I/O server changes state in its chains");
        match to {
            MemberState::InService => {
                state.entry.unsynced_since_ms = 0;
                state.entry.copy_everything = false;
            }
            MemberState::Removed => {}
            MemberState::Out | MemberState::Syncing => {
                if state.entry.unsynced_since_ms == 0 {
                    // From in service: it may lack what was written since it was last heard.
                    let last_heard_ago = state
                        .last_seen
                        .map_or(Duration::ZERO, |seen| seen.elapsed())
                        .as_millis() as u64;
                    state.entry.unsynced_since_ms = unix_ms().saturating_sub(last_heard_ago).max(1);
                }
            }
        }
        state.entry.state = to;
        self.map_version += 1;
        if to == MemberState::Syncing {
            state.syncing_since_version = self.map_version;
        }
        Some((server, state.entry.clone()))
    }

    /// The servers in service or syncing not heard from within `server_down_after_ms` (a
    /// syncing one must not hold up writes either), each with its entry as it must be
    /// persisted before [`Registry::put_out`] applies it: a server is never out in a map
    /// that a restart of the meta server could forget.
    pub fn silent(&self, now: Instant) -> Vec<StateChange> {
        self.servers
            .iter()
            .filter(|(_, state)| {
                !matches!(state.entry.state, MemberState::Out | MemberState::Removed)
                    && now.saturating_duration_since(state.last_seen.unwrap_or(self.started))
                        > self.down_after
            })
            .map(|(id, state)| {
                let mut entry = state.entry.clone();
                entry.state = MemberState::Out;
                if entry.unsynced_since_ms == 0 {
                    let last_heard_ago = now
                        .saturating_duration_since(state.last_seen.unwrap_or(self.started))
                        .as_millis() as u64;
                    entry.unsynced_since_ms = unix_ms().saturating_sub(last_heard_ago).max(1);
                }
                (*id, entry)
            })
            .collect()
    }

    /// Put a server out, as [`Registry::silent`] proposed and the store now says, unless it
    /// was heard from meanwhile.
    pub fn put_out(&mut self, server: ServerId, persisted: &ServerEntry, now: Instant) {
        let Some(state) = self.servers.get(&server) else {
            return;
        };
        let still_silent = now.saturating_duration_since(state.last_seen.unwrap_or(self.started))
            > self.down_after;
        if still_silent && state.entry.state != MemberState::Out {
            let unsynced_since_ms = persisted.unsynced_since_ms;
            self.set_state(server, MemberState::Out);
            if let Some(state) = self.servers.get_mut(&server) {
                state.entry.unsynced_since_ms = unsynced_since_ms;
            }
        }
    }

    /// What a registration says of the server beyond its heartbeat: which process it is,
    /// which map it holds, and whether its data directory is new. An out server becomes
    /// syncing; so does one in service whose process is a new one (it may have lost what
    /// was not synced) or whose data directory is new (it copies everything).
    pub fn note_registration(
        &mut self,
        server: ServerId,
        incarnation: u64,
        held_version: u64,
        fresh: bool,
        known_before: bool,
    ) -> Option<StateChange> {
        let state = self.servers.get_mut(&server)?;
        let restarted = state.incarnation != 0 && state.incarnation != incarnation;
        state.incarnation = incarnation;
        state.held_version = held_version;
        let lost_data = fresh && known_before;
        if lost_data && !state.entry.copy_everything {
            state.entry.copy_everything = true;
            // It holds nothing: every partner is fresher.
            state.entry.unsynced_since_ms = 1;
        }
        match state.entry.state {
            MemberState::Out => self.set_state(server, MemberState::Syncing),
            MemberState::InService if lost_data || restarted => {
                self.set_state(server, MemberState::Syncing)
            }
            // A new copy-everything while syncing: persisted with the next change.
            _ if lost_data => Some((server, state.entry.clone())),
            _ => None,
        }
    }

    /// The copy a syncing server may start: only once every server in service and up holds
    /// the map that names it syncing, so every write any of them takes from then on is
    /// passed on to it, and every write taken before is on them when it lists their objects.
    pub fn resync_order(&self, server: ServerId, now: Instant) -> Option<ResyncOrder> {
        let state = self.servers.get(&server)?;
        if state.entry.state != MemberState::Syncing {
            return None;
        }
        let all_hold = self.servers.values().all(|other| {
            other.entry.state != MemberState::InService
                || !self.is_up(other, now)
                || other.held_version >= state.syncing_since_version
        });
        let window_ms = if state.entry.copy_everything {
            u64::MAX
        } else {
            unix_ms()
                .saturating_sub(state.entry.unsynced_since_ms)
                .saturating_add(RESYNC_MARGIN_MS)
        };
        all_hold.then_some(ResyncOrder {
            window_ms,
            map_version: self.map_version,
        })
    }

    /// A syncing server copied what its order (given under `map_version`) asked for. Any
    /// order given since it last became syncing will do: every write since then was passed
    /// on to it, whatever else changed in the map.
    pub fn resync_done(
        &mut self,
        server: ServerId,
        map_version: u64,
    ) -> Result<Option<StateChange>, String> {
        let Some(state) = self.servers.get(&server) else {
            return Err(format!("server {server} is not registered"));
        };
        if state.entry.state != MemberState::Syncing {
            return Ok(None);
        }
        if map_version < state.syncing_since_version {
            return Err(format!(
                "the copy was ordered under map {map_version}, before the server last became syncing (map {}): copy again",
                state.syncing_since_version
            ));
        }
        Ok(self.set_state(server, MemberState::InService))
    }

    /// The persisted entry of `server` as it is now.
    pub fn entry(&self, server: ServerId) -> Option<ServerEntry> {
        self.servers.get(&server).map(|state| state.entry.clone())
    }

    /// True if registering `server` at `address` must be written to the store first.
    pub fn needs_persist(&self, server: ServerId, address: &str) -> bool {
        self.servers
            .get(&server)
            .is_none_or(|state| state.entry.address != address)
    }

    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Record a heartbeat (after any needed persist has committed). True if the server was
    /// not up before it (new, never seen since the start, or silent too long): work waiting
    /// for it (pending cuts, orphans) can be retried now.
    /// The entry's state is ignored: a heartbeat does not change a server's place in its
    /// chains (see [`Registry::note_registration`]). A new server or a new address gives the
    /// service map a new version.
    pub fn heartbeat(&mut self, server: ServerId, mut entry: ServerEntry, now: Instant) -> bool {
        let came_up = !self.server_is_up(server, now);
        match self.servers.get_mut(&server) {
            Some(state) => {
                entry.state = state.entry.state;
                entry.unsynced_since_ms = state.entry.unsynced_since_ms;
                entry.copy_everything = state.entry.copy_everything;
                if entry.address != state.entry.address {
                    // Partners must reach it at its new address.
                    self.map_version += 1;
                }
                state.entry = entry;
                state.last_seen = Some(now);
            }
            None => {
                // A new member: partners must learn its address.
                self.map_version += 1;
                entry.state = MemberState::InService;
                self.servers.insert(
                    server,
                    ServerState {
                        entry,
                        last_seen: Some(now),
                        metrics_address: None,
                        incarnation: 0,
                        held_version: 0,
                        syncing_since_version: 0,
                        cleaned_version: 0,
                    },
                );
            }
        }
        came_up
    }

    /// Record where a registered server serves its metrics (from its heartbeat).
    pub fn set_metrics_address(&mut self, server: ServerId, metrics_address: Option<String>) {
        if let Some(state) = self.servers.get_mut(&server) {
            state.metrics_address = metrics_address;
        }
    }

    /// Registered and heard from within `server_down_after_ms`.
    pub fn server_is_up(&self, server: ServerId, now: Instant) -> bool {
        self.servers
            .get(&server)
            .is_some_and(|state| self.is_up(state, now))
    }

    fn is_up(&self, state: &ServerState, now: Instant) -> bool {
        state
            .last_seen
            .is_some_and(|seen| now.saturating_duration_since(seen) <= self.down_after)
    }

    /// Servers new files are placed on: those up and not out of their chains (a syncing
    /// one takes every write already), or every registered one not out if none is (just
    /// after a meta server restart, before the first heartbeats); and the spares, those not
    /// out but silent of late (see `Placement::spares`). Never a drained or removed one.
    pub fn placement_servers(&self, now: Instant) -> (Vec<ServerId>, Vec<ServerId>) {
        let placeable = |id: &ServerId, state: &ServerState| {
            state.entry.state != MemberState::Removed && !self.replacements.drains(*id)
        };
        let (up, silent): (Vec<(&ServerId, &ServerState)>, Vec<_>) = self
            .servers
            .iter()
            .filter(|(id, state)| state.entry.state != MemberState::Out && placeable(id, state))
            .partition(|(_, state)| self.is_up(state, now));
        let spares = silent.into_iter().map(|(id, _)| *id).collect();
        if up.is_empty() {
            // Not those out (the state is persisted): one lost for good would leave its
            // files a copy short that no replacement covers (numbered past its bound).
            let registered = |out: bool| -> Vec<ServerId> {
                self.servers
                    .iter()
                    .filter(|(id, state)| {
                        placeable(id, state) && (out || state.entry.state != MemberState::Out)
                    })
                    .map(|(id, _)| *id)
                    .collect()
            };
            let not_out = registered(false);
            let all = if not_out.is_empty() {
                registered(true)
            } else {
                not_out
            };
            (all, Vec::new())
        } else {
            (up.into_iter().map(|(id, _)| *id).collect(), spares)
        }
    }

    pub fn address(&self, server: ServerId) -> Option<String> {
        self.servers
            .get(&server)
            .map(|state| state.entry.address.clone())
    }

    pub fn records(&self, now: Instant) -> Vec<ServerRecord> {
        self.servers
            .iter()
            .filter(|(_, state)| state.entry.state != MemberState::Removed)
            .map(|(id, state)| ServerRecord {
                server_id: *id,
                address: state.entry.address.clone(),
                up: self.is_up(state, now),
                capacity_bytes: state.entry.capacity_bytes,
                free_bytes: state.entry.free_bytes,
                object_count: state.entry.object_count,
                last_seen_ms: state
                    .last_seen
                    .map(|seen| now.saturating_duration_since(seen).as_millis() as u64),
                metrics_address: state.metrics_address.clone(),
                state: state.entry.state,
            })
            .collect()
    }

    pub fn totals(&self, now: Instant) -> RegistryTotals {
        let mut totals = RegistryTotals::default();
        for state in self.servers.values() {
            if state.entry.state == MemberState::Removed {
                continue;
            }
            totals.servers_total += 1;
            if self.is_up(state, now) {
                totals.servers_up += 1;
                totals.capacity_bytes += state.entry.capacity_bytes;
                totals.free_bytes += state.entry.free_bytes;
            }
        }
        totals
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OBJECT: freeflow_types::ObjectId = freeflow_types::ObjectId {
        inode: 5,
        stripe_index: 0,
    };

    fn entry(address: &str) -> ServerEntry {
        ServerEntry {
            address: address.into(),
            capacity_bytes: 100,
            free_bytes: 40,
            object_count: 1,
            state: MemberState::InService,
            unsynced_since_ms: 0,
            copy_everything: false,
        }
    }

    #[test]
    fn a_silent_server_goes_out_then_syncs_then_serves_again() {
        let start = Instant::now();
        let mut registry = Registry::new(vec![], vec![], Duration::from_millis(50));
        registry.heartbeat(1, entry("a:1"), start);
        registry.heartbeat(2, entry("b:1"), start);
        assert!(registry.note_registration(1, 7, 0, true, false).is_none());
        assert!(registry.note_registration(2, 8, 0, false, false).is_none());
        assert!(registry.silent(start).is_empty());
        let first = registry.map_version();
        // Server 2 falls silent; server 1 goes on. Proposed, then applied once persisted.
        let later = start + Duration::from_millis(100);
        registry.heartbeat(1, entry("a:1"), later);
        let silent = registry.silent(later);
        assert_eq!(silent.len(), 1);
        assert_eq!((silent[0].0, silent[0].1.state), (2, MemberState::Out));
        assert!(silent[0].1.unsynced_since_ms > 0);
        assert_eq!(
            registry.state(2),
            MemberState::InService,
            "not before persisted"
        );
        registry.put_out(2, &silent[0].1, later);
        assert!(registry.map_version() > first);
        let map = registry.service_map();
        assert_eq!(map.member(2).unwrap().state, MemberState::Out);
        assert_eq!(map.write_chain(OBJECT, &[2, 1]), vec![1]);
        assert_eq!(map.read_chain(OBJECT, &[1, 2]), vec![1]);
        assert!(!registry.placement_servers(later).0.contains(&2));
        // Back: syncing, but no copy before server 1 holds the new map.
        let back = later + Duration::from_millis(10);
        registry.heartbeat(2, entry("b:1"), back);
        let change = registry.note_registration(2, 9, 0, false, true).unwrap();
        assert_eq!(change.1.state, MemberState::Syncing);
        assert_eq!(
            registry.service_map().write_chain(OBJECT, &[2, 1]),
            vec![1, 2]
        );
        assert!(registry.resync_order(2, back).is_none());
        let version = registry.map_version();
        registry.note_registration(1, 7, version, false, true);
        let order = registry.resync_order(2, back).unwrap();
        assert_eq!(order.map_version, version);
        assert!(order.window_ms >= RESYNC_MARGIN_MS && order.window_ms < u64::MAX);
        // A copy ordered before it became syncing is refused; one since, whatever else
        // changed in the map, ends the sync.
        assert!(registry.resync_done(2, version - 1).is_err());
        registry.heartbeat(3, entry("c:1"), back);
        let done = registry.resync_done(2, version).unwrap().unwrap();
        assert_eq!(
            (done.1.state, done.1.unsynced_since_ms),
            (MemberState::InService, 0)
        );
        // A known server whose data directory is new copies everything, even after going
        // out again in the middle.
        registry.note_registration(1, 7, registry.map_version(), true, true);
        assert_eq!(registry.state(1), MemberState::Syncing);
        let silent = registry.silent(back + Duration::from_millis(200));
        for (server, entry) in &silent {
            registry.put_out(*server, entry, back + Duration::from_millis(200));
        }
        registry.heartbeat(1, entry("a:1"), back + Duration::from_millis(300));
        registry.heartbeat(2, entry("b:1"), back + Duration::from_millis(300));
        registry.note_registration(1, 10, 0, false, true);
        registry.note_registration(2, 9, registry.map_version(), false, true);
        let order = registry
            .resync_order(1, back + Duration::from_millis(300))
            .unwrap();
        assert_eq!(order.window_ms, u64::MAX);
        // A server in service whose process restarted syncs too.
        registry.resync_done(1, order.map_version).unwrap();
        registry.resync_done(2, registry.map_version()).unwrap();
        assert_eq!(registry.state(2), MemberState::InService);
        let change = registry.note_registration(2, 11, 0, false, true).unwrap();
        assert_eq!(change.1.state, MemberState::Syncing);
    }

    #[test]
    fn servers_go_down_after_silence_and_placement_falls_back() {
        let start = Instant::now();
        let mut registry =
            Registry::new(vec![(3, entry("a:1"))], vec![], Duration::from_millis(50));
        assert!(!registry.needs_persist(3, "a:1"));
        assert!(registry.needs_persist(3, "a:2"));
        assert!(registry.needs_persist(4, "b:1"));
        // Never seen: not up, but still placed on when nothing is up.
        assert_eq!(registry.placement_servers(start).0, vec![3]);
        assert!(registry.heartbeat(4, entry("b:1"), start));
        assert!(!registry.heartbeat(4, entry("b:1"), start));
        assert!(registry.server_is_up(4, start));
        assert!(!registry.server_is_up(3, start));
        assert_eq!(registry.placement_servers(start).0, vec![4]);
        let totals = registry.totals(start);
        assert_eq!(
            (totals.servers_up, totals.servers_total, totals.free_bytes),
            (1, 2, 40)
        );
        let later = start + Duration::from_millis(80);
        assert!(registry.records(later).iter().all(|record| !record.up));
        assert_eq!(registry.placement_servers(later).0, vec![3, 4]);
        assert!(
            registry.heartbeat(4, entry("b:1"), later),
            "back after silence"
        );
    }

    /// One step of the service map's life, as the meta server sees it.
    #[derive(Clone, Debug)]
    enum Step {
        /// Time passes (ms).
        Wait(u64),
        /// Server `s` heartbeats (if alive), saying which process it is and which map it
        /// holds (the current one or an older one), and whether its directory is new.
        Register {
            server: u32,
            new_process: bool,
            fresh: bool,
            holds_current: bool,
        },
        /// Server `s` dies or comes back.
        Toggle(u32),
        /// The periodic check puts silent servers out.
        PutOut,
        /// A syncing server finishes the copy of its current order.
        FinishResync(u32),
        /// A syncing server reports an order older than its last syncing.
        StaleResync(u32),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u64..3_000).prop_map(Step::Wait),
            (
                1u32..=3,
                proptest::bool::weighted(0.1),
                proptest::bool::weighted(0.05),
                proptest::bool::weighted(0.8)
            )
                .prop_map(|(server, new_process, fresh, holds_current)| {
                    Step::Register {
                        server,
                        new_process,
                        fresh,
                        holds_current,
                    }
                }),
            (1u32..=3).prop_map(Step::Toggle),
            Just(Step::PutOut),
            (1u32..=3).prop_map(Step::FinishResync),
            (1u32..=3).prop_map(Step::StaleResync),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Whatever the order of heartbeats, silences, restarts and copies: a server that
        /// may lack writes is never back in service without a copy ordered since it last
        /// became syncing; its entry says since when it may lack writes exactly while it is
        /// not in service; chains never include an out member; every change of a state
        /// gives a new, larger map version.
        #[test]
        fn the_service_map_never_trusts_a_copy_it_did_not_resync(steps in proptest::collection::vec(step(), 1..120)) {
            let start = Instant::now();
            let mut now = start;
            let mut registry = Registry::new(vec![], vec![], Duration::from_millis(1_000));
            let mut alive = [true; 4];
            let mut incarnation = [1u64; 4];
            // Servers that may lack writes: set when one goes out or syncing, cleared only
            // by a copy ordered since then.
            let mut must_copy = [false; 4];
            for server in 1..=3u32 {
                registry.heartbeat(server, entry("a:1"), now);
                registry.note_registration(server, 1, 0, false, false);
            }
            let mut version = registry.map_version();
            for step in steps {
                let before: Vec<MemberState> = (0..4).map(|s| registry.state(s)).collect();
                match step {
                    Step::Wait(ms) => now += Duration::from_millis(ms),
                    Step::Register { server, new_process, fresh, holds_current } => {
                        if alive[server as usize] {
                            if new_process {
                                incarnation[server as usize] += 1;
                            }
                            registry.heartbeat(server, entry("a:1"), now);
                            let held = if holds_current { registry.map_version() } else { 0 };
                            registry.note_registration(server, incarnation[server as usize], held, fresh, true);
                        }
                    }
                    Step::Toggle(server) => {
                        alive[server as usize] = !alive[server as usize];
                        if alive[server as usize] {
                            incarnation[server as usize] += 1;
                        }
                    }
                    Step::PutOut => {
                        for (server, persisted) in registry.silent(now) {
                            prop_assert_eq!(persisted.state, MemberState::Out);
                            prop_assert!(persisted.unsynced_since_ms > 0);
                            registry.put_out(server, &persisted, now);
                        }
                    }
                    Step::FinishResync(server) => {
                        if let Some(order) = registry.resync_order(server, now) {
                            prop_assert_eq!(registry.state(server), MemberState::Syncing);
                            if registry.resync_done(server, order.map_version).is_ok() {
                                must_copy[server as usize] = false;
                            }
                        }
                    }
                    Step::StaleResync(server) => {
                        let state = registry.state(server);
                        let outcome = registry.resync_done(server, 1);
                        if state == MemberState::Syncing {
                            prop_assert!(outcome.is_err(), "an order older than any map ended a sync");
                        }
                    }
                }
                for server in 1..=3u32 {
                    let state = registry.state(server);
                    if state != MemberState::InService {
                        must_copy[server as usize] = true;
                    }
                    // Exactly while not in service, the entry says since when.
                    let entry = registry.entry(server).unwrap();
                    prop_assert_eq!(entry.unsynced_since_ms == 0, state == MemberState::InService);
                    prop_assert!(!(entry.copy_everything && state == MemberState::InService));
                    if state == MemberState::InService {
                        prop_assert!(!must_copy[server as usize], "server {} back in service without a copy", server);
                    }
                    if before[server as usize] != state {
                        prop_assert!(registry.map_version() > version, "a state changed under the same map version");
                    }
                }
                prop_assert!(registry.map_version() >= version);
                version = registry.map_version();
                let map = registry.service_map();
                for chain in [[1u32, 2], [2, 3], [3, 1]] {
                    for member in map.write_chain(OBJECT, &chain).into_iter().chain(map.read_chain(OBJECT, &chain)) {
                        prop_assert_ne!(map.state(member), MemberState::Out);
                    }
                    for member in map.read_chain(OBJECT, &chain) {
                        prop_assert_eq!(map.state(member), MemberState::InService);
                    }
                }
            }
        }
    }
}
