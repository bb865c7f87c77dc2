//! What every handler answers with: the reply stamp, and the bound on a request's list.

use bytes::Bytes;
use freeflow_proto::meta::ReplyStamp;
use freeflow_proto::{encode, ErrorCode, WireError};

use crate::shared::{Answered, Shared};

/// The stamp of a reply: the transaction of a mutation (0 for anything else) and the
/// lease granted on what it read or changed.
pub(super) fn stamp(shared: &Shared, answered: Answered) -> Bytes {
    Bytes::from(encode(&ReplyStamp {
        epoch: shared.boot_epoch,
        txn: answered.txn,
        durable_txn: shared.durable_txn(),
        lease_ms: answered.grant.lease_ms,
        lease_seq: answered.grant.seq,
        changed: answered.changed,
        changed_complete: answered.changed_complete,
        delegated: answered.delegated,
    }))
}

pub(super) fn stamped<T>(
    shared: &Shared,
    result: Result<(T, Answered), WireError>,
) -> Result<(T, Bytes), WireError> {
    result.map(|(reply, answered)| (reply, stamp(shared, answered)))
}

pub(super) fn unstamped<T>(
    shared: &Shared,
    result: Result<T, WireError>,
) -> Result<(T, Bytes), WireError> {
    result.map(|reply| (reply, stamp(shared, Answered::default())))
}

/// `InvalidArgument` when a `request` lists more than `max` of `what`.
pub(super) fn at_most(
    request: &str,
    what: &str,
    listed: usize,
    max: usize,
) -> Result<(), WireError> {
    if listed > max {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!("{request} lists {listed} {what}, more than {max}"),
        ));
    }
    Ok(())
}
