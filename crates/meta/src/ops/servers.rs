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
