//! What a client keeps of its mutations until they are durable (issue 10).
//!
//! The metadata server answers a mutation before it is durable; every reply's
//! `ReplyStamp` says which transaction applied it and the last durable one. A mutation
//! answered with `txn > durable_txn` is kept here, as sent (opcode, request id, encoded
//! request) with the reply received, and dropped once a later reply shows it durable. If
//! the server restarts (its hello carries a new epoch) before that, the kept mutations are
//! replayed in transaction order (`FLAG_REPLAY`, the original reply as payload), then
//! `ReplayDone` tells the server this client is done. The log is bounded by count and bytes:
//! a mutation that finds it full first asks the server for a durable commit (`Sync`).

use std::collections::BTreeMap;

/// Most mutations kept at once.
pub const KEPT_MUTATIONS_MAX: usize = 16_384;
/// Most bytes (requests and replies) kept at once.
pub const KEPT_BYTES_MAX: usize = 64 << 20;

/// One mutation answered but not known durable.
#[derive(Clone, Debug)]
pub struct Kept {
    pub opcode: u16,
    pub name: &'static str,
    pub request_id: u64,
    pub request: Vec<u8>,
    pub reply: Vec<u8>,
}

impl Kept {
    fn bytes(&self) -> usize {
        self.request.len() + self.reply.len()
    }
}

/// The log, with what the client knows of the server.
#[derive(Debug, Default)]
pub struct KeptLog {
    /// The server epoch the kept mutations were answered in (0: none seen yet).
    pub epoch: u64,
    /// The last durable transaction the server reported in that epoch.
    pub durable_txn: u64,
    /// By transaction, then request id: one transaction (a batch of the server's group
    /// commit) may answer several mutations of this client sent at once.
    entries: BTreeMap<(u64, u64), Kept>,
    bytes: usize,
    /// A recovery took a copy of the entries to replay them: a reply of this epoch that
    /// comes in now would be kept too late to be replayed (see [`KeptLog::answered`]).
    sealed: bool,
}

impl KeptLog {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether one more mutation fits.
    pub fn has_room(&self) -> bool {
        self.entries.len() < KEPT_MUTATIONS_MAX && self.bytes < KEPT_BYTES_MAX
    }

    /// A reply from the server of `epoch` saying `durable_txn` is durable: forget what it
    /// covers. Ignored for another epoch than the log's (the restart is handled first).
    pub fn durable(&mut self, epoch: u64, durable_txn: u64) {
        if epoch != self.epoch {
            return;
        }
        self.durable_txn = self.durable_txn.max(durable_txn);
        let durable = self.durable_txn;
        while let Some(entry) = self.entries.first_entry() {
            if entry.key().0 > durable {
                break;
            }
            self.bytes -= entry.get().bytes();
            entry.remove();
        }
    }

    /// A mutation answered in `epoch` by transaction `txn`: kept unless already durable.
    ///
    /// False when the answer cannot be trusted: it is not durable and it comes from an
    /// epoch this client has left, or is leaving (a recovery already copied the entries it
    /// replays), so it would be neither kept nor replayed. A reply of a leader deposed
    /// while the request was on its way back, read after another call found the new one.
    /// The caller sends the request again to the server of the new epoch, which answers
    /// from its record if the change was committed after all, and applies it otherwise.
    #[must_use]
    pub fn answered(&mut self, epoch: u64, txn: u64, kept: Kept) -> bool {
        if epoch != self.epoch {
            return false;
        }
        if self.sealed {
            return txn == 0 || txn <= self.durable_txn;
        }
        if txn == 0 || txn <= self.durable_txn {
            return true;
        }
        self.bytes += kept.bytes();
        if let Some(replaced) = self.entries.insert((txn, kept.request_id), kept) {
            self.bytes -= replaced.bytes();
        }
        true
    }

    /// A copy of everything kept, oldest first, to replay it: from here until
    /// [`KeptLog::start_epoch`] nothing more is kept.
    pub fn seal(&mut self) -> Vec<(u64, Kept)> {
        self.sealed = true;
        self.entries()
    }

    /// A recovery that took [`KeptLog::seal`]'s copy failed before the new epoch started:
    /// keep answers of this epoch again (everything kept is replayed to the next server).
    pub fn unseal(&mut self) {
        self.sealed = false;
    }

    /// A copy of everything kept, oldest first.
    pub fn entries(&self) -> Vec<(u64, Kept)> {
        self.entries
            .iter()
            .map(|((txn, _), kept)| (*txn, kept.clone()))
            .collect()
    }

    /// Drop everything kept (replayed already: `entries`) and start over in `epoch`.
    pub fn start_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.sealed = false;
        self.durable_txn = 0;
        self.bytes = 0;
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(request_id: u64) -> Kept {
        Kept {
            opcode: 113,
            name: "Create",
            request_id,
            request: vec![1; 10],
            reply: vec![2; 5],
        }
    }

    #[test]
    fn mutations_are_kept_until_durable_and_replayed_in_order() {
        let mut log = KeptLog::default();
        log.start_epoch(7);
        assert!(log.answered(7, 12, kept(2)));
        assert!(log.answered(7, 10, kept(1)));
        assert!(log.answered(7, 15, kept(3)));
        // Another epoch's reply (the restart is handled first) changes nothing, and is
        // not to be trusted.
        assert!(!log.answered(8, 20, kept(4)));
        log.durable(8, 100);
        assert_eq!(log.len(), 3);
        log.durable(7, 11);
        assert_eq!(log.len(), 2);
        // Already durable when answered: nothing to keep.
        assert!(log.answered(7, 11, kept(5)));
        assert_eq!(log.len(), 2);
        let order: Vec<u64> = log
            .entries()
            .iter()
            .map(|(_, kept)| kept.request_id)
            .collect();
        assert_eq!(order, vec![2, 3]);
        log.start_epoch(8);
        assert!(log.len() == 0 && log.has_room());
        assert_eq!(log.epoch, 8);
    }

    /// One batch of the server's group commit answers several mutations this client sent
    /// at once (the mount's creates answered ahead): every one is kept, none replaces
    /// another.
    #[test]
    fn mutations_answered_by_one_transaction_are_all_kept() {
        let mut log = KeptLog::default();
        log.start_epoch(3);
        assert!(log.answered(3, 40, kept(9)));
        assert!(log.answered(3, 40, kept(7)));
        assert!(log.answered(3, 41, kept(8)));
        assert_eq!(log.len(), 3);
        let order: Vec<(u64, u64)> = log
            .entries()
            .iter()
            .map(|(txn, kept)| (*txn, kept.request_id))
            .collect();
        assert_eq!(order, vec![(40, 7), (40, 9), (41, 8)]);
        log.durable(3, 40);
        assert_eq!(log.len(), 1);
    }

    /// Once a recovery copied the entries to replay them, a reply of the old epoch that
    /// comes in late is refused (it would be neither kept nor replayed) unless it is
    /// durable already; after the new epoch starts, every old reply is.
    #[test]
    fn a_reply_of_an_epoch_being_left_is_not_trusted() {
        let mut log = KeptLog::default();
        log.start_epoch(5);
        assert!(log.answered(5, 10, kept(1)));
        log.durable(5, 8);
        let replayed = log.seal();
        assert_eq!(replayed.len(), 1);
        assert!(!log.answered(5, 11, kept(2)));
        assert!(log.answered(5, 7, kept(3)));
        assert_eq!(log.len(), 1);
        log.start_epoch(6);
        assert!(!log.answered(5, 12, kept(4)));
        assert!(log.answered(6, 1, kept(5)));
        assert_eq!(log.len(), 1);
    }
}
