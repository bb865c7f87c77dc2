//! Whether this server may serve data yet. A file shrunk while this server could not be
//! reached leaves a cut pending here (the meta server keeps it in its `truncations` table).
//! Until that cut is made, a client write to the object could land first and then be
//! destroyed by the cut, and a read past the new size could return bytes the truncate
//! removed once the file grows again. So reads, writes, allocations and copies are refused
//! with `Busy` until the meta server, answering a registration, says this server owes no
//! cut (it makes them before answering). A later heartbeat that reports cuts owed closes
//! the gate again. Clients send a refused request again after a short wait (it changed
//! nothing); the meta server's own requests (cuts, removals, statistics) always pass.

use std::sync::atomic::{AtomicU32, Ordering};

use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::ServerId;

/// `owed` before any registration reply: nothing is known yet.
const UNCONFIRMED: u32 = u32::MAX;

pub struct DataGate {
    server_id: ServerId,
    /// Cuts owed as the last registration reply said; `UNCONFIRMED` before the first.
    owed: AtomicU32,
    /// Counts the closings of the open gate: whoever handed out an object's descriptor
    /// (`local_reads.rs`) takes it back then.
    closings: tokio::sync::watch::Sender<u64>,
}

impl DataGate {
    /// Closed: no registration has been answered yet.
    pub fn new(server_id: ServerId) -> DataGate {
        DataGate {
            server_id,
            owed: AtomicU32::new(UNCONFIRMED),
            closings: tokio::sync::watch::Sender::new(0),
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
    /// cuts are owed).
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
        assert!(gate
            .check()
            .unwrap_err()
            .message
            .contains("truncation cut(s)"));
    }
}
