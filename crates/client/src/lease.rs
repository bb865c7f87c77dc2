//! A lease as the meta server grants it with a reply, and the timings the connections and
//! the revocation poll (`leases.rs`) share: below both, so neither names the other.

use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::{ReplyStamp, LEASE_RENEWAL_SPAN_MS};

/// How long a revocation handler may take before its revocations are acknowledged anyway
/// (and how long a new epoch's drop of what was cached is waited for).
pub const HANDLER_WAIT_MS: u64 = 100;

/// A lease the meta server granted on what a reply read (issue 9): the client may trust
/// it until `until` (measured from when the request was sent, less a margin, so the client
/// always stops before the server forgets it), unless a revocation of one of its inodes
/// with an id of at least `seq` arrived (see `Client::lease_remaining`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    /// None: no lease (the reply may not be cached).
    pub until: Option<Instant>,
    pub seq: u64,
    /// The server epoch of the grant: leases die with a restart.
    pub epoch: u64,
    /// The reply delegated a directory to this client (a mkdir: the new directory), see
    /// `delegation.rs`.
    pub delegated: bool,
    /// The latest time renewals can keep it to (`LEASE_RENEWAL_SPAN_MS` after it was
    /// sent; see `leases::Renewed`).
    pub span_until: Option<Instant>,
}

/// Part of a lease the client gives up to allow for clock rates and scheduling.
pub(crate) const LEASE_MARGIN_PERCENT: u64 = 10;

impl Lease {
    /// Whether nothing can keep this lease good any more at `now`, renewals included: past
    /// its span (or its own end, without one), or no lease at all.
    pub fn ended_for_good(&self, now: Instant) -> bool {
        self.span_until
            .or(self.until)
            .is_none_or(|until| until <= now)
    }

    pub(crate) fn from_stamp(stamp: &ReplyStamp, sent_at: Instant) -> Lease {
        if stamp.lease_ms == 0 {
            return Lease::default();
        }
        let trusted_ms = u64::from(stamp.lease_ms) * (100 - LEASE_MARGIN_PERCENT) / 100;
        Lease {
            until: Some(sent_at + Duration::from_millis(trusted_ms)),
            seq: stamp.lease_seq,
            epoch: stamp.epoch,
            delegated: !stamp.delegated.is_empty(),
            span_until: Some(sent_at + Duration::from_millis(LEASE_RENEWAL_SPAN_MS)),
        }
    }
}
