//! Connections from the metadata server to I/O servers, for the requests only it sends:
//! removing an orphan's objects (the reaper) and cutting objects after a shrink (the
//! cutter). One connection per server, shared by both, reopened when closed or when the
//! server re-registered at another address. Bounded by the registry (`SERVERS_MAX`).

use std::collections::HashMap;
use std::sync::Mutex;

use freeflow_rpc::{ClusterKey, ConnectOptions, Connection};
use freeflow_types::ServerId;

/// Longest wait for one request to an I/O server.
pub const IO_CALL_TIMEOUT_MS: u64 = 10_000;
/// Longest wait to connect to an I/O server.
pub const IO_CONNECT_TIMEOUT_MS: u64 = 2_000;

pub struct IoConnections {
    key: ClusterKey,
    options: ConnectOptions,
    cache: Mutex<HashMap<ServerId, Connection>>,
}

impl IoConnections {
    pub fn new(key: ClusterKey) -> IoConnections {
        IoConnections {
            key,
            options: ConnectOptions {
                client_name: "meta".into(),
                call_timeout_ms: IO_CALL_TIMEOUT_MS,
                connect_timeout_ms: IO_CONNECT_TIMEOUT_MS,
                ..ConnectOptions::default()
            },
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The open connection to `server` at `address`, connecting if needed.
    pub async fn get(&self, server: ServerId, address: &str) -> Result<Connection, String> {
        {
            let cache = self
                .cache
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(connection) = cache.get(&server) {
                if !connection.is_closed() && connection.address() == address {
                    return Ok(connection.clone());
                }
            }
        }
        let connection = Connection::connect(address, &self.key, &self.options)
            .await
            .map_err(|error| error.to_string())?;
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        cache.insert(server, connection.clone());
        Ok(connection)
    }
}
