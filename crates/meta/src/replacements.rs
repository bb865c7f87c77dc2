//! I/O servers lost for good and who takes their place in the chains (re-replication,
//! issue 42; docs/replication.md "A server lost for good").
//!
//! A server out of its chains past `server_dead_after_ms` is replaced: a record names it,
//! the inodes it is replaced for (every one that existed then: a server that comes back
//! later takes new files again), and the servers in service that take its place, each
//! stripe on one of them chosen by `ServiceMap::chain`. The record is persisted before
//! the map shows it. From the map that shows it, every replicated write of such a stripe
//! goes to the stand-in as well (at the end of the chain, "filling"); once every server in
//! service holds that map, each stand-in is ordered to copy its stripes from the
//! survivors (`ioserver/src/fill.rs`), and when it says it is done it serves their reads.
//!
//! Records are never removed: a client may hold a layout naming the lost server for as
//! long as it keeps the file open, and the map must keep telling it where the stripe is.
//! A record is small (a few dozen bytes and one id per candidate) and servers are lost
//! rarely.

use std::collections::BTreeMap;

use freeflow_proto::meta::{Replacement, SHARE_ALL};
use freeflow_types::{InodeId, ServerId};

/// One record and the map version it appeared in (a fill is ordered only once every
/// server in service holds that map or a later one).
#[derive(Clone, Debug)]
struct Entry {
    record: Replacement,
    version: u64,
    /// A drain: the map version in which its last stand-in was done (it completes once
    /// every server in service holds it).
    sealed_version: u64,
    /// A drain: the map version in which it completed (its server then removes what it
    /// gave up, and says so in its registration).
    completed_version: u64,
}

/// A replacement record changed: to persist under its sequence number.
pub type ReplacementChange = (u64, Replacement);

#[derive(Debug, Default)]
pub struct Replacements {
    /// By sequence number: the order they were made in, oldest first.
    entries: BTreeMap<u64, Entry>,
}

impl Replacements {
    /// The records read from the store, as of map `version` (the first of this leader).
    pub fn new(persisted: Vec<(u64, Replacement)>, version: u64) -> Replacements {
        Replacements {
            entries: persisted
                .into_iter()
                .map(|(sequence, record)| {
                    (
                        sequence,
                        Entry {
                            record,
                            version,
                            sealed_version: version,
                            completed_version: version,
                        },
                    )
                })
                .collect(),
        }
    }

    /// The sequence number the next record takes.
    fn next_sequence(&self) -> u64 {
        self.entries.keys().next_back().map_or(1, |last| last + 1)
    }

    /// Every record, oldest first, as the service map carries them.
    pub fn records(&self) -> Vec<Replacement> {
        self.entries
            .values()
            .map(|entry| entry.record.clone())
            .collect()
    }

    /// Whether `server` was replaced at or after `since_ms` (Unix ms).
    pub fn replaced_since(&self, server: ServerId, since_ms: u64) -> bool {
        self.entries
            .values()
            .any(|entry| entry.record.server == server && entry.record.made_ms >= since_ms)
    }

    /// The records that replacing `server` by `by` writes: a new one for the inodes
    /// below `inodes_below`, and the older ones `server` was still filling for (it takes
    /// nothing from them now: every stripe it would have taken is replaced with it, since
    /// the new record covers every inode they cover).
    pub fn propose(
        &self,
        server: ServerId,
        inodes_below: InodeId,
        by: Vec<ServerId>,
        made_ms: u64,
    ) -> Vec<ReplacementChange> {
        let sequence = self.next_sequence();
        let mut changes: Vec<ReplacementChange> = self
            .entries
            .iter()
            .filter(|(_, entry)| entry.record.filling.contains(&server))
            .map(|(sequence, entry)| {
                let mut record = entry.record.clone();
                record.filling.retain(|filling| *filling != server);
                (*sequence, record)
            })
            .collect();
        changes.push((
            sequence,
            Replacement {
                server,
                inodes_below,
                filling: by.clone(),
                by,
                made_ms,
                drain: false,
                complete: false,
                share_ppm: SHARE_ALL,
            },
        ));
        changes
    }

    /// The record that drains running `server` (by the servers in `by`) for the inodes
    /// below `inodes_below`: all its stripes, or a share of them (a rebalance), in
    /// millionths.
    pub fn propose_drain(
        &self,
        server: ServerId,
        inodes_below: InodeId,
        by: Vec<ServerId>,
        made_ms: u64,
        share_ppm: u32,
    ) -> ReplacementChange {
        let mut records = self.propose_shares(&[(server, share_ppm)], inodes_below, &by, made_ms);
        records.remove(0)
    }

    /// The records of a rebalance: each (server, share in millionths) drained by `by`, for
    /// the inodes below `inodes_below`.
    pub fn propose_shares(
        &self,
        shares: &[(ServerId, u32)],
        inodes_below: InodeId,
        by: &[ServerId],
        made_ms: u64,
    ) -> Vec<ReplacementChange> {
        let first = self.next_sequence();
        shares
            .iter()
            .zip(first..)
            .map(|((server, share_ppm), sequence)| {
                (
                    sequence,
                    Replacement {
                        server: *server,
                        inodes_below,
                        by: by.to_vec(),
                        filling: by.to_vec(),
                        made_ms,
                        drain: true,
                        complete: false,
                        share_ppm: *share_ppm,
                    },
                )
            })
            .collect()
    }

    /// Whether a drain of all of `server` was ever started (a rebalance's share does not
    /// count).
    pub fn drains(&self, server: ServerId) -> bool {
        self.entries
            .values()
            .any(|entry| entry.record.drains_all() && entry.record.server == server)
    }

    /// Whether every drain of all of `server` is complete (false when there is none).
    pub fn drained(&self, server: ServerId) -> bool {
        self.drains(server)
            && self.entries.values().all(|entry| {
                !(entry.record.drains_all() && entry.record.server == server)
                    || entry.record.complete
            })
    }

    /// Whether some record still moves copies: a stand-in filling, or a drain not
    /// complete.
    pub fn moving(&self) -> bool {
        self.entries.values().any(|entry| {
            !entry.record.filling.is_empty() || (entry.record.drain && !entry.record.complete)
        })
    }

    /// The complete drains, each with its server and the map version it completed in.
    pub fn completed_drains(&self) -> impl Iterator<Item = (ServerId, u64)> + '_ {
        self.entries
            .values()
            .filter(|entry| entry.record.drain && entry.record.complete)
            .map(|entry| (entry.record.server, entry.completed_version))
    }

    /// The drains sealed (every stand-in done) in a map version at or below `held`: they
    /// can complete, since no server in service serves reads under an older map.
    pub fn completable(&self, held: u64) -> Vec<ReplacementChange> {
        self.entries
            .iter()
            .filter(|(_, entry)| {
                entry.record.drain
                    && !entry.record.complete
                    && entry.record.filling.is_empty()
                    && entry.sealed_version <= held
            })
            .map(|(sequence, entry)| {
                let mut record = entry.record.clone();
                record.complete = true;
                (*sequence, record)
            })
            .collect()
    }

    /// Take records as persisted; those new to this map appear in map `version`.
    pub fn apply(&mut self, changes: Vec<ReplacementChange>, version: u64) {
        for (sequence, record) in changes {
            match self.entries.get_mut(&sequence) {
                Some(entry) => {
                    if !entry.record.filling.is_empty() && record.filling.is_empty() {
                        entry.sealed_version = version;
                    }
                    if !entry.record.complete && record.complete {
                        entry.completed_version = version;
                    }
                    entry.record = record;
                }
                None => {
                    self.entries.insert(
                        sequence,
                        Entry {
                            record,
                            version,
                            sealed_version: version,
                            completed_version: version,
                        },
                    );
                }
            }
        }
    }

    /// The newest map version among the records `server` is filling for: it may copy once
    /// every server in service holds it. None when it fills nothing.
    pub fn filling_since(&self, server: ServerId) -> Option<u64> {
        self.entries
            .values()
            .filter(|entry| entry.record.filling.contains(&server))
            .map(|entry| entry.version)
            .max()
    }

    /// How many (record, stand-in) pairs are still filling, and how many there are.
    pub fn progress(&self) -> (usize, usize) {
        self.entries.values().fold((0, 0), |(filling, all), entry| {
            (
                filling + entry.record.filling.len(),
                all + entry.record.by.len(),
            )
        })
    }

    /// `server` copied every stripe it takes for these records (each named by its server
    /// and `made_ms`): it fills them no more. The changed records, to persist. Any order
    /// counts, whichever leader gave it: an order is given only once every server in
    /// service holds the map naming every record the server fills in it.
    pub fn fill_done(
        &self,
        server: ServerId,
        records: &[(ServerId, u64)],
    ) -> Vec<ReplacementChange> {
        self.entries
            .iter()
            .filter(|(_, entry)| {
                entry.record.filling.contains(&server)
                    && records.contains(&(entry.record.server, entry.record.made_ms))
            })
            .map(|(sequence, entry)| {
                let mut record = entry.record.clone();
                record.filling.retain(|filling| *filling != server);
                (*sequence, record)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_is_filled_by_each_stand_in_then_done() {
        let mut replacements = Replacements::default();
        let first = replacements.propose(1, 100, vec![2, 3], 10);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].0, 1);
        assert_eq!(first[0].1.filling, vec![2, 3]);
        replacements.apply(first, 5);
        assert_eq!(replacements.filling_since(2), Some(5));
        assert!(replacements.replaced_since(1, 10) && !replacements.replaced_since(1, 11));
        // A fill of another record does not count.
        assert!(replacements.fill_done(2, &[(1, 9)]).is_empty());
        let done = replacements.fill_done(2, &[(1, 10)]);
        assert_eq!(done[0].1.filling, vec![3]);
        replacements.apply(done, 7);
        assert_eq!(replacements.filling_since(2), None);
        assert_eq!(replacements.progress(), (1, 2));
        // Server 3 is lost in turn before it filled: the older record no longer waits
        // for it, the new one takes its stripes.
        let second = replacements.propose(3, 200, vec![2, 4], 20);
        assert_eq!(second.len(), 2);
        replacements.apply(second, 8);
        assert_eq!(replacements.records()[0].filling, Vec::<ServerId>::new());
        assert_eq!(replacements.records()[1].filling, vec![2, 4]);
        assert_eq!(replacements.filling_since(4), Some(8));
        assert_eq!(replacements.progress(), (2, 4));
    }

    #[test]
    fn a_drain_completes_only_once_its_seal_is_held() {
        let mut replacements = Replacements::default();
        assert!(!replacements.drained(5));
        let drain = replacements.propose_drain(5, 50, vec![6], 1, SHARE_ALL);
        replacements.apply(vec![drain], 10);
        assert!(replacements.drains(5) && !replacements.drained(5));
        assert!(
            replacements.completable(u64::MAX).is_empty(),
            "still filling"
        );
        let done = replacements.fill_done(6, &[(5, 1)]);
        replacements.apply(done, 12);
        assert!(replacements.completable(11).is_empty(), "sealed in map 12");
        let complete = replacements.completable(12);
        assert!(complete[0].1.complete);
        assert!(replacements.moving());
        replacements.apply(complete, 13);
        assert!(replacements.drained(5) && !replacements.moving());
        assert_eq!(
            replacements.completed_drains().collect::<Vec<_>>(),
            vec![(5, 13)]
        );
        // A rebalance's share is no drain of the whole server.
        let share = replacements.propose_drain(6, 60, vec![7], 2, SHARE_ALL / 2);
        replacements.apply(vec![share], 14);
        assert!(!replacements.drains(6) && replacements.moving());
        assert!(replacements.completable(u64::MAX).is_empty());
    }
}
