//! The I/O server registry: which servers exist, where they listen, how full they are and
//! whether they are up (seen within `server_down_after_ms`).
//!
//! Ids and addresses are persisted (the reaper and new layouts need them after a restart);
//! capacity figures from heartbeats are kept in memory and written only with an address
//! change, so a heartbeat costs no fsync.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use freeflow_proto::meta::ServerRecord;
use freeflow_types::ServerId;

use crate::records::ServerEntry;

#[derive(Clone, Debug)]
struct ServerState {
    entry: ServerEntry,
    last_seen: Option<Instant>,
    /// From the last heartbeat; in memory only.
    metrics_address: Option<String>,
}

#[derive(Debug)]
pub struct Registry {
    servers: BTreeMap<ServerId, ServerState>,
    down_after: Duration,
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
    pub fn new(persisted: Vec<(ServerId, ServerEntry)>, down_after: Duration) -> Registry {
        let servers = persisted
            .into_iter()
            .map(|(id, entry)| {
                (
                    id,
                    ServerState {
                        entry,
                        last_seen: None,
                        metrics_address: None,
                    },
                )
            })
            .collect();
        Registry {
            servers,
            down_after,
        }
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
    pub fn heartbeat(&mut self, server: ServerId, entry: ServerEntry, now: Instant) -> bool {
        let came_up = !self.server_is_up(server, now);
        let metrics_address = self
            .servers
            .get(&server)
            .and_then(|state| state.metrics_address.clone());
        self.servers.insert(
            server,
            ServerState {
                entry,
                last_seen: Some(now),
                metrics_address,
            },
        );
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

    /// Servers new files are placed on: those up, or every registered one if none is up yet
    /// (just after a meta server restart, before the first heartbeats).
    pub fn placement_servers(&self, now: Instant) -> Vec<ServerId> {
        let up: Vec<ServerId> = self
            .servers
            .iter()
            .filter(|(_, state)| self.is_up(state, now))
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
        }
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
