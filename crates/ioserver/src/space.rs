//! Space grants (issue 12, seed 000's fastwrite): the bytes of this server's free space
//! that writing clients hold, so that a client tells a writer "no space" at the write it
//! cannot cover, before acknowledging it, never afterwards at a flush or close.
//!
//! A client asks with `ReserveSpace` under a grant id of its own; every `WriteObject` names
//! the grant and the bytes of it the write uses (`charged`: what the write adds to the file
//! as the client counted when it acknowledged it). The server takes exactly those bytes from
//! the grant as the write is let in ([`SpaceLedger::admit`]) and counts them as landing until
//! the write is done ([`Admitted`]; given back to the grant if it fails), so client and
//! server subtract the same numbers and concurrent writes never pass against the same bytes.
//! The space nobody holds is the file system's free space (`statvfs`) less the grants, the
//! bytes landing and a floor kept for the file system's own blocks.
//!
//! A write without a grant (0) may use only the space nobody holds (what it may add: at most
//! its length, past the object's length on disk). A write with a grant whose grant no
//! longer holds what it charges (lapsed, or reclaimed while its bytes waited at the client)
//! takes the rest from the unreserved space, and is refused only when the file system
//! itself has no room: it was acknowledged already, so refusing it for anything less would
//! be the late error grants exist to prevent.
//!
//! Grants lapse after `GRANT_IDLE_MS` without a request that used them (a client that died
//! gives its space back that way), and are taken back after `GRANT_RECLAIM_MS` idle when
//! another writer's need does not fit otherwise. A client counts on a grant only for
//! `GRANT_TRUST_MS` after the last request that used it, less than either.
//!
//! Not counted: what a write adds beyond its charge (a write into a hole, or past the
//! client's known size by another client's growth) comes out of the floor. Bounded: at most
//! [`GRANT_HOLDERS_MAX`] grants at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::io::{SpaceGrant, GRANT_IDLE_MS, GRANT_RECLAIM_MS};

/// Most grants held at once on one server; a new one past it is refused (`NoSpace`).
pub const GRANT_HOLDERS_MAX: usize = 65_536;

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
    /// Bytes of writes let in and not done yet: not in the file system's free count yet.
    landing: u64,
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
        free_bytes.saturating_sub(
            self.total
                .saturating_add(self.landing)
                .saturating_add(floor),
        )
    }
}

/// The grants of one I/O server.
#[derive(Debug, Default)]
pub struct SpaceLedger {
    ledger: Mutex<Ledger>,
}

/// A write let in: its bytes count as landing until it is dropped; a write that failed
/// ([`Admitted::failed`]) gives what it took back to its grant.
#[must_use]
pub struct Admitted<'a> {
    ledger: &'a SpaceLedger,
    grant: u64,
    /// Taken from the grant.
    taken: u64,
    /// Counted as landing (what was taken, and what came from the unreserved space).
    landing: u64,
    failed: bool,
}

impl Admitted<'_> {
    /// The write was not made: what it took goes back to its grant.
    pub fn failed(mut self) {
        self.failed = true;
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if self.landing == 0 && self.taken == 0 {
            return;
        }
        let mut ledger = self.ledger.lock();
        ledger.landing -= self.landing.min(ledger.landing);
        if self.failed && self.taken > 0 {
            if let Some(held) = ledger.grants.get_mut(&self.grant) {
                held.bytes += self.taken;
                ledger.total += self.taken;
            }
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
        let added = need + (want - need).min((unreserved - need) / 4);
        if added == 0 {
            return Ok(SpaceGrant {
                added: 0,
                held: ledger.held(grant),
            });
        }
        if !ledger.grants.contains_key(&grant) && ledger.grants.len() >= GRANT_HOLDERS_MAX {
            ledger.drop_idle(now, Duration::from_millis(GRANT_RECLAIM_MS), grant);
            if ledger.grants.len() >= GRANT_HOLDERS_MAX {
                return Err(NoRoom {
                    needed: need,
                    unreserved: 0,
                });
            }
        }
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

    /// Let in a write under `grant` that charges `charged` bytes to it (see the module
    /// doc). `growth` is what the write may add past its object's length on disk (at most
    /// its length), asked for only when it is needed: a write without a grant while grants
    /// are held, or one whose grant no longer covers its charge. `space` gives the file
    /// system's (free, capacity) bytes, asked for only then too.
    pub fn admit<E>(
        &self,
        grant: u64,
        charged: u64,
        growth: impl FnOnce() -> Result<u64, E>,
        space: impl FnOnce() -> Result<(u64, u64), E>,
    ) -> Result<Result<Admitted<'_>, NoRoom>, E> {
        let now = Instant::now();
        let mut ledger = self.lock();
        ledger.sweep(now);
        let admitted = |taken: u64, landing: u64| Admitted {
            ledger: self,
            grant,
            taken,
            landing,
            failed: false,
        };
        if grant == 0 {
            if ledger.grants.is_empty() {
                return Ok(Ok(admitted(0, 0)));
            }
            drop(ledger);
            let growth = growth()?;
            let (free, capacity) = space()?;
            let mut ledger = self.lock();
            let unreserved = ledger.unreserved(free, floor_bytes(capacity));
            if growth > unreserved {
                return Ok(Err(NoRoom {
                    needed: growth,
                    unreserved,
                }));
            }
            ledger.landing += growth;
            return Ok(Ok(admitted(0, growth)));
        }
        let taken = match ledger.grants.get_mut(&grant) {
            Some(held) => {
                held.last_used = now;
                let taken = held.bytes.min(charged);
                held.bytes -= taken;
                taken
            }
            None => 0,
        };
        ledger.total -= taken;
        ledger.landing += taken;
        let short = charged - taken;
        if short == 0 {
            return Ok(Ok(admitted(taken, taken)));
        }
        // The grant no longer covers the charge: the rest may come from the file system's
        // free space (even space others hold: this write was acknowledged already).
        let mut holding = admitted(taken, taken);
        drop(ledger);
        let (free, capacity) = match space() {
            Ok(space) => space,
            Err(error) => {
                holding.failed();
                return Err(error);
            }
        };
        let room = free.saturating_sub(floor_bytes(capacity) / 2);
        let mut ledger = self.lock();
        let room = room.saturating_sub(ledger.landing);
        if short > room {
            drop(ledger);
            holding.failed();
            return Ok(Err(NoRoom {
                needed: short,
                unreserved: room,
            }));
        }
        ledger.landing += short;
        holding.landing += short;
        Ok(Ok(holding))
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

    type Never = std::convert::Infallible;

    fn admit(
        ledger: &SpaceLedger,
        grant: u64,
        charged: u64,
        growth: u64,
        free: u64,
    ) -> Result<Admitted<'_>, NoRoom> {
        ledger
            .admit::<Never>(grant, charged, || Ok(growth), || Ok((free, CAPACITY)))
            .unwrap()
    }

    #[test]
    fn grants_take_free_space_and_writes_take_their_charge() {
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
        // A write takes its charge from the grant at once; while it lands the bytes count
        // as landing, so nobody else is granted them.
        let landing = admit(&ledger, 1, first.held, 0, free).expect("within the grant");
        assert_eq!(ledger.held_total(), 0);
        assert!(ledger
            .reserve(2, 0, left + 1, left + 1, free, CAPACITY)
            .is_err());
        drop(landing);
        // Landed: the file system's free count shows the bytes now.
        let free = free - first.held;
        assert!(ledger.reserve(2, 0, left, left, free, CAPACITY).is_ok());
    }

    #[test]
    fn a_write_without_a_grant_uses_only_unreserved_space() {
        let ledger = SpaceLedger::default();
        let free = 10 * MIB;
        // No grant anywhere: nothing is counted.
        assert!(admit(&ledger, 0, 0, 100 * MIB, free).is_ok());
        ledger
            .reserve(1, 0, 6 * MIB, 6 * MIB, free, CAPACITY)
            .unwrap();
        assert_eq!(
            admit(&ledger, 0, 0, 3 * MIB, free).err(),
            Some(NoRoom {
                needed: 3 * MIB,
                unreserved: 2 * MIB
            })
        );
        assert!(admit(&ledger, 0, 0, 0, free).is_ok(), "an overwrite");
    }

    #[test]
    fn a_failed_write_gives_its_charge_back_and_a_short_grant_uses_free_space() {
        let ledger = SpaceLedger::default();
        let free = 10 * MIB;
        ledger
            .reserve(1, 0, 4 * MIB, 4 * MIB, free, CAPACITY)
            .unwrap();
        admit(&ledger, 1, 3 * MIB, 0, free).unwrap().failed();
        assert_eq!(ledger.held_total(), 4 * MIB, "given back");
        // Charged beyond the grant (it lapsed or was reclaimed meanwhile): let in while the
        // file system has room, even room another grant holds.
        ledger
            .reserve(2, 0, 4 * MIB, 4 * MIB, free, CAPACITY)
            .unwrap();
        let admitted = admit(&ledger, 1, 5 * MIB, 0, free).expect("8 MiB free past the floor");
        assert_eq!(ledger.held_total(), 4 * MIB, "grant 1 spent");
        drop(admitted);
        // Not when the file system has no room for it.
        assert!(admit(&ledger, 1, 5 * MIB, 0, 3 * MIB).is_err());
        assert_eq!(ledger.held_total(), 4 * MIB);
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
        assert!(!ledger.any_held(), "an emptied grant is forgotten");
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
        // Nothing to add: no empty grant is kept.
        let none = ledger.reserve(4, 0, 0, 1, 2 * MIB, CAPACITY).unwrap();
        assert_eq!(none, SpaceGrant { added: 0, held: 0 });
        assert!(!ledger.lock().grants.contains_key(&4));
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
        drop(admit(&ledger, 0, 0, 0, 100 * MIB).unwrap());
        assert_eq!(ledger.held_total(), 0);
        assert!(!ledger.any_held());
    }
}
