//! What a member's store says of itself in the `RaftState` table: the last applied log id
//! and the membership, written in the same transaction as what they describe.

use serde::Serialize;

use crate::raft::types::{LogId, StoredMembership};
use crate::store::{MetaStore, RedbStore, RedbWrite, StoreError, StoreRead, TableId};

pub const KEY_APPLIED: &[u8] = b"applied";
pub const KEY_MEMBERSHIP: &[u8] = b"membership";

fn read_record<T: serde::de::DeserializeOwned, R: StoreRead>(
    read: &R,
    key: &[u8],
) -> Result<Option<T>, StoreError> {
    let Some(bytes) = read.get(TableId::RaftState, key)? else {
        return Ok(None);
    };
    postcard::from_bytes(&bytes)
        .map(Some)
        .map_err(|error| StoreError::Corrupt {
            table: "raft_state",
            reason: error.to_string(),
        })
}

pub fn put_record<T: Serialize>(
    write: &mut RedbWrite,
    key: &[u8],
    value: &T,
) -> Result<(), StoreError> {
    let bytes = postcard::to_allocvec(value).map_err(StoreError::backend)?;
    write.apply_raw(TableId::RaftState, key, Some(&bytes))
}

pub fn put_membership(
    write: &mut RedbWrite,
    membership: &StoredMembership,
) -> Result<(), StoreError> {
    put_record(write, KEY_MEMBERSHIP, membership)
}

/// Record both (a snapshot installed).
pub fn put_applied(
    write: &mut RedbWrite,
    applied: &Option<LogId>,
    membership: &StoredMembership,
) -> Result<(), StoreError> {
    put_record(write, KEY_APPLIED, applied)?;
    put_membership(write, membership)
}

/// The last applied log id and membership, read in `read`.
pub fn applied_state_in<R: StoreRead>(
    read: &R,
) -> Result<(Option<LogId>, StoredMembership), StoreError> {
    let applied = read_record::<Option<LogId>, _>(read, KEY_APPLIED)?.flatten();
    let membership = read_record(read, KEY_MEMBERSHIP)?.unwrap_or_default();
    Ok((applied, membership))
}

/// The last applied log id and membership the store holds.
pub fn applied_state(store: &RedbStore) -> Result<(Option<LogId>, StoredMembership), StoreError> {
    applied_state_in(&store.begin_read()?)
}
