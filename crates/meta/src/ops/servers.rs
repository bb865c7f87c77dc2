//! The persisted part of the I/O server registry: id → address and last known capacity.
//! Heartbeats that change nothing but figures stay in memory; an address change is written.

use std::ops::Bound;

use freeflow_types::ServerId;

use super::OpResult;
use crate::records::{
    decode_server_key, decode_versioned, encode_versioned, server_key, ServerEntry,
};
use crate::store::{StoreRead, StoreWrite, TableId};

/// Most I/O servers one cluster registers.
pub const SERVERS_MAX: usize = 4096;

pub fn load_servers<R: StoreRead>(read: &R) -> OpResult<Vec<(ServerId, ServerEntry)>> {
    let pairs = read.range(
        TableId::Servers,
        Bound::Unbounded,
        Bound::Unbounded,
        SERVERS_MAX,
    )?;
    let mut servers = Vec::with_capacity(pairs.len());
    for (key, value) in pairs {
        servers.push((
            decode_server_key(&key)?,
            decode_versioned(TableId::Servers, &value)?,
        ));
    }
    Ok(servers)
}

pub fn put_server<W: StoreWrite>(
    write: &mut W,
    server: ServerId,
    entry: &ServerEntry,
) -> OpResult<()> {
    write.put(
        TableId::Servers,
        &server_key(server),
        &encode_versioned(entry),
    )?;
    Ok(())
}

/// Most replacement records one cluster keeps (one per I/O server lost for good).
pub const REPLACEMENTS_MAX: usize = 65_536;

/// The replacement records (re-replication, `replacements.rs`), oldest first.
pub fn load_replacements<R: StoreRead>(
    read: &R,
) -> OpResult<Vec<(u64, freeflow_proto::meta::Replacement)>> {
    let pairs = read.range(
        TableId::Replacements,
        Bound::Unbounded,
        Bound::Unbounded,
        REPLACEMENTS_MAX,
    )?;
    let mut records = Vec::with_capacity(pairs.len());
    for (key, value) in pairs {
        let sequence: [u8; 8] =
            key.as_slice()
                .try_into()
                .map_err(|_| crate::store::StoreError::Corrupt {
                    table: TableId::Replacements.name(),
                    reason: format!("a key of {} bytes, not 8", key.len()),
                })?;
        records.push((
            u64::from_be_bytes(sequence),
            decode_versioned(TableId::Replacements, &value)?,
        ));
    }
    Ok(records)
}

pub fn put_replacement<W: StoreWrite>(
    write: &mut W,
    sequence: u64,
    record: &freeflow_proto::meta::Replacement,
) -> OpResult<()> {
    write.put(
        TableId::Replacements,
        &sequence.to_be_bytes(),
        &encode_versioned(record),
    )?;
    Ok(())
}
