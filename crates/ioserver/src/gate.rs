//! Whether this server may serve data yet. A file shrunk while this server could not be
//! reached leaves a cut pending here (the meta server keeps it in its `truncations` table).
//! Until that cut is made, a client write to the object could land first and then be
//! destroyed by the cut, and a read past the new size could return bytes the truncate
//! removed once the file grows again. So reads, writes, allocations and copies are refused
//! with `Busy` until the meta server, answering a registration, says this server owes no
//! cut (it makes them before answering). A later heartbeat that reports cuts owed closes
//! the gate again. Clients send a refused request again after a short wait (it changed
//! nothing); the meta server's own requests (cuts, removals, statistics) always pass.
//!
//! The gate also knows which objects are leaving this server: while a drain names it
//! (`freeflow server drain`, docs/replication.md), the stripes of inodes below the drain's
//! bound go down their chains as the service map makes them, so a request for one of
//! them without a map version (a client that has not seen the drain) is refused with
//! `Stale` (the client fetches the map and sends it down the chain), local reads of them
//! stop, and the map that starts a drain is held only once no such request is still being
//! served: from then on every write of theirs is passed on to their stand-ins.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::RwLock;

use freeflow_proto::meta::Replacement;
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{ObjectId, ServerId};

/// `owed` before any registration reply: nothing is known yet.
const UNCONFIRMED: u32 = u32::MAX;

pub struct DataGate {
    server_id: ServerId,
    /// Cuts owed as the last registration reply said; `UNCONFIRMED` before the first.
    owed: AtomicU32,
    /// Counts the closings of the open gate: whoever handed out an object's descriptor
    /// (`local_reads.rs`) takes it back then.
    closings: tokio::sync::watch::Sender<u64>,
    /// The drains that name this server (whole, or a rebalance's share): the objects they
    /// take are leaving. Drains are never taken back, so the list only grows.
    leaving: RwLock<Vec<Replacement>>,
    /// Requests without a map version being served now (see [`DataGate::admit_unversioned`]).
    unversioned: AtomicU64,
}

/// An admitted request without a map version, counted until it ends.
pub struct Unversioned<'a>(&'a AtomicU64);

impl Drop for Unversioned<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl DataGate {
    /// Closed: no registration has been answered yet.
    pub fn new(server_id: ServerId) -> DataGate {
        DataGate {
            server_id,
            owed: AtomicU32::new(UNCONFIRMED),
            closings: tokio::sync::watch::Sender::new(0),
            leaving: RwLock::new(Vec::new()),
            unversioned: AtomicU64::new(0),
        }
    }

    /// Admit a request for `objects` that carries no map version (a stripe with one copy
    /// sent straight to its server): refused with `Stale` when one of them is leaving this
    /// server; counted while it is served otherwise.
    pub fn admit_unversioned(&self, objects: &[ObjectId]) -> Result<Unversioned<'_>, WireError> {
        self.unversioned.fetch_add(1, Ordering::SeqCst);
        let admitted = Unversioned(&self.unversioned);
        if let Some(object) = objects.iter().find(|object| self.leaving(**object)) {
            return Err(WireError::new(
                ErrorCode::Stale,
                format!(
                    "I/O server {} is being drained: inode {} stripe {} goes down its chain as the service map makes it (fetch the map)",
                    self.server_id, object.inode, object.stripe_index
                ),
            ));
        }
        Ok(admitted)
    }

    /// Whether `object` is leaving this server (a drain takes it).
    pub fn leaving(&self, object: ObjectId) -> bool {
        self.leaving
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .any(|drain| drain.takes(object))
    }

    /// The drains that name this server, as a new map has them: from now on requests for
    /// the objects they take without a map version are refused and their local reads
    /// stop; returns once no such request admitted before is still being served (the
    /// caller holds the new map only then).
    pub async fn set_leaving(&self, drains: Vec<Replacement>) {
        {
            let mut leaving = self
                .leaving
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // Only a new drain changes what leaves (one completing does not).
            let new = drains.iter().any(|drain| {
                !leaving.iter().any(|known| {
                    known.inodes_below == drain.inodes_below
                        && known.share_ppm == drain.share_ppm
                        && known.made_ms == drain.made_ms
                })
            });
            if !new {
                return;
            }
            *leaving = drains;
        }
        // An admission that read the old list has counted itself by now (SeqCst both
        // ways): wait for it to end.
        std::sync::atomic::fence(Ordering::SeqCst);
        // Descriptors handed out before let clients read objects now leaving.
        self.closings.send_modify(|count| *count += 1);
        while self.unversioned.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// What a registration reply said.
    pub fn set_owed(&self, cuts_owed: u32) {
        let before = self
            .owed
            .swap(cuts_owed.min(UNCONFIRMED - 1), Ordering::AcqRel);
        if before == 0 && cuts_owed != 0 {
            self.closings.send_modify(|count| *count += 1);
        }
    }

    /// Changes each time the gate closes after it was open (a registration reply said
    /// cuts are owed), and when a drain starts.
    pub fn closings(&self) -> tokio::sync::watch::Receiver<u64> {
        self.closings.subscribe()
    }

    pub fn is_open(&self) -> bool {
        self.owed.load(Ordering::Acquire) == 0
    }

    /// Ok when data may be served; the `Busy` refusal otherwise.
    pub fn check(&self) -> Result<(), WireError> {
        match self.owed.load(Ordering::Acquire) {
            0 => Ok(()),
            UNCONFIRMED => Err(WireError::new(
                ErrorCode::Busy,
                format!(
                    "I/O server {} serves no data yet: the meta server has not answered its \
                     registration (it must first make any truncation cut this server owes)",
                    self.server_id
                ),
            )),
            owed => Err(WireError::new(
                ErrorCode::Busy,
                format!(
                    "I/O server {} serves no data until the meta server has made the {owed} \
                     truncation cut(s) it still owes",
                    self.server_id
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_opens_only_when_a_reply_says_nothing_is_owed() {
        let gate = DataGate::new(3);
        assert!(!gate.is_open());
        let refused = gate.check().unwrap_err();
        assert_eq!(refused.code, ErrorCode::Busy);
        assert!(refused.message.contains("has not answered"), "{refused}");
        gate.set_owed(2);
        assert!(gate.check().unwrap_err().message.contains("2 truncation"));
        gate.set_owed(0);
        assert!(gate.is_open());
        gate.check().unwrap();
        gate.set_owed(u32::MAX);
        assert!(!gate.is_open());
        let object = |inode| ObjectId {
            inode,
            stripe_index: 0,
        };
        let admitted = gate.admit_unversioned(&[object(5)]).unwrap();
        drop(admitted);
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(gate.set_leaving(vec![Replacement {
                server: 3,
                inodes_below: 6,
                by: vec![4],
                filling: vec![4],
                made_ms: 1,
                drain: true,
                complete: false,
                share_ppm: freeflow_proto::meta::SHARE_ALL,
            }]));
        assert!(gate.leaving(object(5)) && !gate.leaving(object(6)));
        let refused = gate
            .admit_unversioned(&[object(6), object(5)])
            .err()
            .unwrap();
        assert_eq!(refused.code, ErrorCode::Stale);
        assert!(refused.message.contains("inode 5"), "{refused}");
        assert!(gate.admit_unversioned(&[object(6)]).is_ok());
        assert!(gate
            .check()
            .unwrap_err()
            .message
            .contains("truncation cut(s)"));
    }
}
