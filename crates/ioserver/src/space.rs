//! Space grants (issue 12, seed 000's fastwrite): the bytes of this server's free space
//! that writing clients hold, so that a client tells a writer "no space" at the write it
//! cannot cover, before acknowledging it, never afterwards at a flush or close.
//!
//! A client asks with `ReserveSpace` under a grant id of its own and sends that id with
//! every `WriteObject`. The ledger here is the truth: a write takes what it adds past the
//! object's end from its grant as it lands ([`SpaceLedger::admit`], then
//! [`Admitted::landed`]); a write that needs more than its grant holds may use only the
//! space no grant holds, less a floor kept for the file system's own blocks. The free space
//! is the file system's (`statvfs`), read when grants are involved, so files removed, or
//! written by anyone, count at once.
//!
//! Grants lapse after `GRANT_IDLE_MS` without a request that used them (a client that died
//! gives its space back that way), and are taken back after `GRANT_RECLAIM_MS` idle when
//! another writer's need does not fit otherwise. A client counts on a grant only for
//! `GRANT_TRUST_MS` after the last request that used it, less than either, so it never acts
//! on a grant this server has let go.
//!
//! Not covered: a write into a hole inside an object adds blocks without moving its end;
//! it is admitted against the unreserved space like a write without a grant. Bounded: at
//! most [`GRANT_HOLDERS_MAX`] grants at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use freeflow_proto::io::{SpaceGrant, GRANT_IDLE_MS, GRANT_RECLAIM_MS};
use freeflow_types::ObjectId;

/// Most grants held at once on one server; a new one past it is refused (`NoSpace`).
pub const GRANT_HOLDERS_MAX: usize = 65_536;
/// Most objects whose admitted end is remembered (past it all are forgotten, and their
/// length on disk is used again).
pub const ADMITTED_ENDS_MAX: usize = 65_536;

/// Space never granted: a hundredth of the file system, at least 1 MiB (its own blocks:
/// directories, inodes, extent trees).
pub fn floor_bytes(capacity_bytes: u64) -> u64 {
    (capacity_bytes / 100).max(1 << 20)
}

/// Why a reservation or a write does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoom {
    /// Bytes that were needed beyond the grant.
    pub needed: u64,
    /// Bytes nobody holds that could have been used.
    pub unreserved: u64,
}

#[derive(Debug)]
struct Held {
    bytes: u64,
    last_used: Instant,
}

#[derive(Debug, Default)]
struct Ledger {
    grants: HashMap<u64, Held>,
    /// Sum of `grants`' bytes.
    total: u64,
    last_sweep: Option<Instant>,
    /// The furthest end of each object's writes admitted so far: writes to one object are
    /// admitted and land concurrently, in any order, so the object's length on disk alone
    /// would count the bytes of one write as growth of several.
    ends: BTreeMap<ObjectId, u64>,
}

impl Ledger {
    /// Drop grants unused for `idle` (all of them when `idle` is the lapse time; only those
    /// idle past the reclaim time when space is short).
    fn drop_idle(&mut self, now: Instant, idle: Duration, except: u64) {
        let total = &mut self.total;
        self.grants.retain(|id, held| {
            let keep = *id == except || now.duration_since(held.last_used) < idle;
            if !keep {
                *total -= held.bytes;
            }
            keep
        });
    }

    fn sweep(&mut self, now: Instant) {
        if self
            .last_sweep
            .is_some_and(|last| now.duration_since(last) < Duration::from_secs(1))
        {
            return;
        }
        self.last_sweep = Some(now);
        self.drop_idle(now, Duration::from_millis(GRANT_IDLE_MS), 0);
    }

    fn held(&self, grant: u64) -> u64 {
        self.grants.get(&grant).map_or(0, |held| held.bytes)
    }

    /// Free space nobody holds, given the file system's free bytes.
    fn unreserved(&self, free_bytes: u64, floor: u64) -> u64 {
        free_bytes.saturating_sub(self.total.saturating_add(floor))
    }
}

/// The grants of one I/O server.
#[derive(Debug, Default)]
pub struct SpaceLedger {
    ledger: Mutex<Ledger>,
}

/// A write let in: call [`Admitted::landed`] once it is written.
#[must_use]
pub struct Admitted<'a> {
    ledger: &'a SpaceLedger,
    grant: u64,
    growth: u64,
}

impl Admitted<'_> {
    /// The write landed: what it added comes off its grant.
    pub fn landed(self) {
        if self.grant == 0 || self.growth == 0 {
            return;
        }
        let mut ledger = self.ledger.lock();
        if let Some(held) = ledger.grants.get_mut(&self.grant) {
            let taken = held.bytes.min(self.growth);
            held.bytes -= taken;
            held.last_used = Instant::now();
            ledger.total -= taken;
        }
    }
}

impl SpaceLedger {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().expect("space ledger lock not poisoned")
    }

    /// Whether any grant is held (writes then need the object's length to be admitted).
    pub fn any_held(&self) -> bool {
        !self.lock().grants.is_empty()
    }

    /// `ReserveSpace`: give back, then add `need` (or fail, adding nothing) and up to
    /// `want` where there is room. Some of the room is left for others: a grant gets at
    /// most a quarter of the unreserved space beyond its need.
    pub fn reserve(
        &self,
        grant: u64,
        give_back: u64,
        need: u64,
        want: u64,
        free_bytes: u64,
        capacity_bytes: u64,
    ) -> Result<SpaceGrant, NoRoom> {
        let now = Instant::now();
        let floor = floor_bytes(capacity_bytes);
        let mut ledger = self.lock();
        ledger.sweep(now);
        if let Some(held) = ledger.grants.get_mut(&grant) {
            let returned = held.bytes.min(give_back);
            held.bytes -= returned;
            held.last_used = now;
            ledger.total -= returned;
        }
        let want = want.max(need);
        if need > ledger.unreserved(free_bytes, floor) {
            // Space is short: grants idle past the reclaim time go back first.
            ledger.drop_idle(now, Duration::from_millis(GRANT_RECLAIM_MS), grant);
        }
        let unreserved = ledger.unreserved(free_bytes, floor);
        if need > unreserved {
            return Err(NoRoom {
                needed: need,
                unreserved,
            });
        }
        if want == 0 {
            // Only a give-back: an emptied grant is forgotten.
            if ledger.held(grant) == 0 {
                ledger.grants.remove(&grant);
            }
            return Ok(SpaceGrant {
                added: 0,
                held: ledger.held(grant),
            });
        }
        if !ledger.grants.contains_key(&grant) && ledger.grants.len() >= GRANT_HOLDERS_MAX {
            return Err(NoRoom {
                needed: need,
                unreserved: 0,
            });
        }
        let added = need + (want - need).min((unreserved - need) / 4);
        let held = ledger.grants.entry(grant).or_insert(Held {
            bytes: 0,
            last_used: now,
        });
        held.bytes += added;
        held.last_used = now;
        let held = held.bytes;
        ledger.total += added;
        Ok(SpaceGrant { added, held })
    }

    /// Let in a write of `object` ending at `end` (its length on disk `length`) under
    /// `grant` (0: none): what it adds past the furthest end admitted may come from its
    /// grant and the space nobody holds. None for `object`: nothing to count (no grant is
    /// held anywhere).
    pub fn admit(
        &self,
        grant: u64,
        object: Option<(ObjectId, u64, u64)>,
        free_bytes: u64,
        capacity_bytes: u64,
    ) -> Result<Admitted<'_>, NoRoom> {
        let now = Instant::now();
        let mut ledger = self.lock();
        ledger.sweep(now);
        let growth = match object {
            Some((object, end, length)) => {
                let known = ledger.ends.get(&object).copied().unwrap_or(0).max(length);
                end.saturating_sub(known)
            }
            None => 0,
        };
        let held = ledger.held(grant);
        if let Some(entry) = ledger.grants.get_mut(&grant) {
            entry.last_used = now;
        }
        if growth > held {
            let unreserved = ledger.unreserved(free_bytes, floor_bytes(capacity_bytes));
            let needed = growth - held;
            if needed > unreserved {
                return Err(NoRoom { needed, unreserved });
            }
        }
        if let Some((object, end, _)) = object {
            if ledger.ends.len() >= ADMITTED_ENDS_MAX && !ledger.ends.contains_key(&object) {
                ledger.ends.clear();
            }
            let known = ledger.ends.entry(object).or_insert(0);
            *known = (*known).max(end);
        }
        Ok(Admitted {
            ledger: self,
            grant,
            growth,
        })
    }

    /// The object was cut or removed: its length on disk counts again.
    pub fn forget(&self, object: ObjectId) {
        self.lock().ends.remove(&object);
    }

    /// Forget every object of `inode` (its objects were removed).
    pub fn forget_inode(&self, inode: freeflow_types::InodeId) {
        let mut ledger = self.lock();
        let objects: Vec<ObjectId> = ledger
            .ends
            .range(
                ObjectId {
                    inode,
                    stripe_index: 0,
                }..=ObjectId {
                    inode,
                    stripe_index: u32::MAX,
                },
            )
            .map(|(object, _)| *object)
            .collect();
        for object in objects {
            ledger.ends.remove(&object);
        }
    }

    /// Space nobody holds (for an allocation, which comes without a grant).
    pub fn unreserved(&self, free_bytes: u64, capacity_bytes: u64) -> u64 {
        self.lock()
            .unreserved(free_bytes, floor_bytes(capacity_bytes))
    }

    /// Bytes held by all grants (a metric).
    pub fn held_total(&self) -> u64 {
        self.lock().total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    /// A 200 MiB file system: a floor of 2 MiB.
    const CAPACITY: u64 = 200 * MIB;

    #[test]
    fn grants_take_free_space_and_writes_take_from_their_grant() {
        let ledger = SpaceLedger::default();
        // 10 MiB free: 8 MiB above the floor.
        let free = 10 * MIB;
        let first = ledger.reserve(1, 0, MIB, 64 * MIB, free, CAPACITY).unwrap();
        // Its need, and a quarter of the rest.
        assert_eq!(first.added, MIB + 7 * MIB / 4);
        assert_eq!(ledger.held_total(), first.held);
        // Another writer's need beyond what is left fails, adding nothing.
        let left = free - 2 * MIB - first.held;
        let refused = ledger.reserve(2, 0, left + 1, left + 1, free, CAPACITY);
        assert_eq!(
            refused,
            Err(NoRoom {
                needed: left + 1,
                unreserved: left
            })
        );
        assert_eq!(ledger.held_total(), first.held);
        // A write under the grant may use it all even with nothing unreserved.
        let object = ObjectId {
            inode: 5,
            stripe_index: 0,
        };
        ledger
            .admit(
                1,
                Some((object, first.held, 0)),
                2 * MIB + first.held,
                CAPACITY,
            )
            .expect("within the grant")
            .landed();
        assert_eq!(ledger.held_total(), 0);
        // Without a grant, only what nobody holds.
        assert!(ledger
            .admit(
                0,
                Some((object, first.held + 1, first.held)),
                2 * MIB,
                CAPACITY
            )
            .is_err());
        assert!(
            ledger
                .admit(0, Some((object, 4096, first.held)), 2 * MIB, CAPACITY)
                .is_ok(),
            "an overwrite"
        );
    }

    #[test]
    fn writes_landing_out_of_order_take_each_byte_once() {
        let ledger = SpaceLedger::default();
        let free = 100 * MIB;
        ledger
            .reserve(1, 0, 2 * MIB, 2 * MIB, free, CAPACITY)
            .unwrap();
        let object = ObjectId {
            inode: 5,
            stripe_index: 0,
        };
        // Two writes of 1 MiB admitted before either landed (length on disk still 0).
        let first = ledger
            .admit(1, Some((object, MIB, 0)), free, CAPACITY)
            .unwrap();
        let second = ledger
            .admit(1, Some((object, 2 * MIB, 0)), free, CAPACITY)
            .unwrap();
        second.landed();
        first.landed();
        assert_eq!(ledger.held_total(), 0, "2 MiB taken, not 3");
        ledger.forget(object);
        let again = ledger
            .admit(1, Some((object, MIB, 0)), free, CAPACITY)
            .unwrap();
        assert_eq!(
            again.growth, MIB,
            "a cut object counts from its length again"
        );
    }

    #[test]
    fn a_grant_given_back_frees_its_space_and_an_idle_one_is_reclaimed_when_short() {
        let ledger = SpaceLedger::default();
        let free = 10 * MIB;
        let held = ledger
            .reserve(1, 0, 6 * MIB, 6 * MIB, free, CAPACITY)
            .unwrap()
            .held;
        assert_eq!(held, 6 * MIB);
        assert!(ledger
            .reserve(2, 0, 4 * MIB, 4 * MIB, free, CAPACITY)
            .is_err());
        let back = ledger.reserve(1, 6 * MIB, 0, 0, free, CAPACITY).unwrap();
        assert_eq!(back, SpaceGrant { added: 0, held: 0 });
        assert!(ledger
            .reserve(2, 0, 4 * MIB, 4 * MIB, free, CAPACITY)
            .is_ok());
        // Grant 2 (4 MiB) goes idle; 3 needs 6 MiB: only reclaiming it makes room.
        {
            let mut inner = ledger.lock();
            let idle = Instant::now() - Duration::from_millis(GRANT_RECLAIM_MS + 10);
            inner.grants.get_mut(&2).unwrap().last_used = idle;
        }
        let third = ledger
            .reserve(3, 0, 6 * MIB, 6 * MIB, free, CAPACITY)
            .unwrap();
        assert_eq!(third.held, 6 * MIB);
        assert_eq!(ledger.held_total(), 6 * MIB, "grant 2 was taken back");
    }

    #[test]
    fn grants_lapse_when_unused() {
        let ledger = SpaceLedger::default();
        ledger.reserve(1, 0, MIB, MIB, 100 * MIB, CAPACITY).unwrap();
        {
            let mut inner = ledger.lock();
            let idle = Instant::now() - Duration::from_millis(GRANT_IDLE_MS + 10);
            inner.grants.get_mut(&1).unwrap().last_used = idle;
            inner.last_sweep = None;
        }
        ledger.admit(0, None, 100 * MIB, CAPACITY).unwrap().landed();
        assert_eq!(ledger.held_total(), 0);
        assert!(!ledger.any_held());
    }
}
