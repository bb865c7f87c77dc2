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

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use freeflow_proto::meta::{Member, MemberState, ResyncOrder, ServerRecord, ServiceMap};
use freeflow_types::ServerId;

use crate::records::ServerEntry;

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
    /// When it was put out (in memory: after a restart of ours, our start).
    out_since: Option<Instant>,
    /// While syncing: how far back its copy must reach, in ms (`u64::MAX`: everything).
    resync_window_ms: u64,
}

#[derive(Debug)]
pub struct Registry {
    servers: BTreeMap<ServerId, ServerState>,
    down_after: Duration,
    map_version: u64,
    started: Instant,
}

/// A server's state changed: its entry must be persisted.
pub type StateChange = (ServerId, ServerEntry);

/// Sums over the registry for statfs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryTotals {
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub servers_up: u32,
    pub servers_total: u32,
}

impl Registry {
    pub fn new(persisted: Vec<(ServerId, ServerEntry)>, down_after: Duration) -> Registry {
        let started = Instant::now();
        let servers = persisted
            .into_iter()
            .map(|(id, entry)| {
                let out_since = (entry.state != MemberState::InService).then_some(started);
                (
                    id,
                    ServerState {
                        entry,
                        last_seen: None,
                        metrics_address: None,
                        incarnation: 0,
                        held_version: 0,
                        out_since,
                        resync_window_ms: u64::MAX,
                    },
                )
            })
            .collect();
        // Versions from an earlier run of the meta server were smaller: it counted up from
        // its own start time, and never gives more than one version per microsecond.
        let map_version = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |since| since.as_micros() as u64);
        Registry {
            servers,
            down_after,
            map_version,
            started,
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
                .map(|(id, state)| Member {
                    server_id: *id,
                    address: state.entry.address.clone(),
                    state: state.entry.state,
                    incarnation: state.incarnation,
                })
                .collect(),
        }
    }

    fn set_state(
        &mut self,
        server: ServerId,
        to: MemberState,
        now: Instant,
    ) -> Option<StateChange> {
        let state = self.servers.get_mut(&server)?;
        if state.entry.state == to {
            return None;
        }
        tracing::info!(server, from = ?state.entry.state, ?to, "I/O server changes state in its chains");
        if to == MemberState::Out {
            state.out_since = Some(state.last_seen.unwrap_or(self.started).min(now));
        }
        state.entry.state = to;
        self.map_version += 1;
        Some((server, state.entry.clone()))
    }

    /// Put out every server in service or syncing not heard from within
    /// `server_down_after_ms` (a syncing one must not hold up writes either).
    pub fn put_out_silent(&mut self, now: Instant) -> Vec<StateChange> {
        let silent: Vec<ServerId> = self
            .servers
            .iter()
            .filter(|(_, state)| {
                state.entry.state != MemberState::Out
                    && now.saturating_duration_since(state.last_seen.unwrap_or(self.started))
                        > self.down_after
            })
            .map(|(id, _)| *id)
            .collect();
        silent
            .into_iter()
            .filter_map(|server| self.set_state(server, MemberState::Out, now))
            .collect()
    }

    /// What a registration says of the server beyond its heartbeat: which process it is,
    /// which map it holds, and whether its data directory is new. An out server becomes
    /// syncing; a known server that lost its data directory copies everything.
    pub fn note_registration(
        &mut self,
        server: ServerId,
        incarnation: u64,
        held_version: u64,
        fresh: bool,
        known_before: bool,
        now: Instant,
    ) -> Option<StateChange> {
        let state = self.servers.get_mut(&server)?;
        state.incarnation = incarnation;
        state.held_version = held_version;
        let lost_data = fresh && known_before;
        match state.entry.state {
            MemberState::Out => {
                let away = now.saturating_duration_since(state.out_since.unwrap_or(self.started));
                state.resync_window_ms = if lost_data {
                    u64::MAX
                } else {
                    (away.as_millis() as u64).saturating_add(RESYNC_MARGIN_MS)
                };
                self.set_state(server, MemberState::Syncing, now)
            }
            MemberState::InService if lost_data => {
                state.resync_window_ms = u64::MAX;
                self.set_state(server, MemberState::Syncing, now)
            }
            MemberState::Syncing if lost_data => {
                state.resync_window_ms = u64::MAX;
                None
            }
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
                || other.held_version == self.map_version
        });
        all_hold.then_some(ResyncOrder {
            window_ms: state.resync_window_ms,
            map_version: self.map_version,
        })
    }

    /// A syncing server copied what its order (given under `map_version`) asked for.
    pub fn resync_done(
        &mut self,
        server: ServerId,
        map_version: u64,
        now: Instant,
    ) -> Result<Option<StateChange>, String> {
        let Some(state) = self.servers.get(&server) else {
            return Err(format!("server {server} is not registered"));
        };
        if state.entry.state != MemberState::Syncing {
            return Ok(None);
        }
        if map_version != self.map_version {
            return Err(format!(
                "the service map changed during the copy (version {map_version}, now {}): copy again",
                self.map_version
            ));
        }
        Ok(self.set_state(server, MemberState::InService, now))
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
                        out_since: None,
                        resync_window_ms: u64::MAX,
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
    /// one takes every write already), or every registered one if none is (just after a
    /// meta server restart, before the first heartbeats).
    pub fn placement_servers(&self, now: Instant) -> Vec<ServerId> {
        let up: Vec<ServerId> = self
            .servers
            .iter()
            .filter(|(_, state)| self.is_up(state, now) && state.entry.state != MemberState::Out)
            .map(|(id, _)| *id)
            .collect();
        if up.is_empty() {
            self.servers.keys().copied().collect()
        } else {
            up
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

    fn entry(address: &str) -> ServerEntry {
        ServerEntry {
            address: address.into(),
            capacity_bytes: 100,
            free_bytes: 40,
            object_count: 1,
            state: MemberState::InService,
        }
    }

    #[test]
    fn a_silent_server_goes_out_then_syncs_then_serves_again() {
        let start = Instant::now();
        let mut registry = Registry::new(vec![], Duration::from_millis(50));
        registry.heartbeat(1, entry("a:1"), start);
        registry.heartbeat(2, entry("b:1"), start);
        assert!(registry
            .note_registration(1, 7, 0, true, false, start)
            .is_none());
        assert!(registry.put_out_silent(start).is_empty());
        let first = registry.map_version();
        // Server 2 falls silent; server 1 goes on.
        let later = start + Duration::from_millis(100);
        registry.heartbeat(1, entry("a:1"), later);
        let changes = registry.put_out_silent(later);
        assert_eq!(changes.len(), 1);
        assert_eq!((changes[0].0, changes[0].1.state), (2, MemberState::Out));
        assert!(registry.map_version() > first);
        assert_eq!(
            registry.service_map().member(2).unwrap().state,
            MemberState::Out
        );
        assert!(!registry.placement_servers(later).contains(&2));
        // Back: syncing, but no copy before server 1 holds the new map.
        let back = later + Duration::from_millis(10);
        registry.heartbeat(2, entry("b:1"), back);
        let change = registry
            .note_registration(2, 8, 0, false, true, back)
            .unwrap();
        assert_eq!(change.1.state, MemberState::Syncing);
        assert!(registry.resync_order(2, back).is_none());
        let version = registry.map_version();
        registry.note_registration(1, 7, version, false, true, back);
        let order = registry.resync_order(2, back).unwrap();
        assert_eq!(order.map_version, version);
        assert!(order.window_ms >= RESYNC_MARGIN_MS && order.window_ms < u64::MAX);
        // A copy made under an older map is refused; under the current one it ends the sync.
        assert!(registry.resync_done(2, version - 1, back).is_err());
        let done = registry.resync_done(2, version, back).unwrap().unwrap();
        assert_eq!(done.1.state, MemberState::InService);
        // A known server whose data directory is new copies everything.
        registry.note_registration(1, 9, registry.map_version(), true, true, back);
        assert_eq!(
            registry.service_map().member(1).unwrap().state,
            MemberState::Syncing
        );
        registry.note_registration(2, 8, registry.map_version(), false, true, back);
        assert_eq!(registry.resync_order(1, back).unwrap().window_ms, u64::MAX);
    }

    #[test]
    fn servers_go_down_after_silence_and_placement_falls_back() {
        let start = Instant::now();
        let mut registry = Registry::new(vec![(3, entry("a:1"))], Duration::from_millis(50));
        assert!(!registry.needs_persist(3, "a:1"));
        assert!(registry.needs_persist(3, "a:2"));
        assert!(registry.needs_persist(4, "b:1"));
        // Never seen: not up, but still placed on when nothing is up.
        assert_eq!(registry.placement_servers(start), vec![3]);
        assert!(registry.heartbeat(4, entry("b:1"), start));
        assert!(!registry.heartbeat(4, entry("b:1"), start));
        assert!(registry.server_is_up(4, start));
        assert!(!registry.server_is_up(3, start));
        assert_eq!(registry.placement_servers(start), vec![4]);
        let totals = registry.totals(start);
        assert_eq!(
            (totals.servers_up, totals.servers_total, totals.free_bytes),
            (1, 2, 40)
        );
        let later = start + Duration::from_millis(80);
        assert!(registry.records(later).iter().all(|record| !record.up));
        assert_eq!(registry.placement_servers(later), vec![3, 4]);
        assert!(
            registry.heartbeat(4, entry("b:1"), later),
            "back after silence"
        );
    }
}
