//! The client's connections: one to the meta server and one per I/O server.
//!
//! Each connection is pipelined (many requests in flight, replies in any order), so one per
//! server is enough. They are made lazily and made again when found closed; the addresses of
//! I/O servers come from the meta server's `ListServers` and are fetched again when a layout
//! names an unknown server or a server cannot be reached at its old address (it may have
//! restarted elsewhere). Every call ends within the connect timeout plus the call timeout:
//! a server that is down gives an error naming it, never a hang.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use freeflow_proto::io::{ReadObject, SyncObjects, WriteObject};
use freeflow_proto::meta::{ListServers, ServerRecord};
use freeflow_proto::Request;
use freeflow_rpc::{ClusterKey, ConnectOptions, Connection, RpcError};
use freeflow_types::{InodeId, ServerId};

use crate::metrics::ClientMetrics;
use crate::ClientError;

/// A connection slot for one server address, connected on first use.
struct Endpoint {
    address: String,
    /// The identity the server must announce in its hello ("meta", "io:<id>"): a server
    /// answering at a stale address must not receive another server's data.
    identity: String,
    current: Mutex<Option<Connection>>,
    /// Held while connecting, so that many callers finding the connection closed make one
    /// new connection between them.
    connecting: tokio::sync::Mutex<()>,
}

impl Endpoint {
    fn new(address: String, identity: String) -> Endpoint {
        Endpoint {
            address,
            identity,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn open_connection(&self) -> Option<Connection> {
        let current = self.current.lock().expect("not poisoned");
        current
            .as_ref()
            .filter(|connection| !connection.is_closed())
            .cloned()
    }

    async fn get(
        &self,
        key: &ClusterKey,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        if let Some(connection) = self.open_connection() {
            return Ok(connection);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(connection) = self.open_connection() {
            return Ok(connection);
        }
        let connection = Connection::connect(&self.address, key, options).await?;
        if connection.identity() != self.identity {
            return Err(RpcError::Protocol {
                address: self.address.clone(),
                reason: format!(
                    "the server answered as {:?}, expected {:?}",
                    connection.identity(),
                    self.identity
                ),
            });
        }
        *self.current.lock().expect("not poisoned") = Some(connection.clone());
        Ok(connection)
    }
}

pub(crate) struct Pool {
    key: ClusterKey,
    options: ConnectOptions,
    meta: Endpoint,
    /// I/O servers by id. Bounded by the number of servers in the cluster.
    io: Mutex<HashMap<ServerId, std::sync::Arc<Endpoint>>>,
    /// Serialises `ListServers` refreshes.
    refreshing: tokio::sync::Mutex<()>,
    pub(crate) metrics: ClientMetrics,
}

impl Pool {
    pub fn new(
        meta_address: String,
        key: ClusterKey,
        options: ConnectOptions,
        metrics: ClientMetrics,
    ) -> Pool {
        Pool {
            metrics,
            key,
            options,
            meta: Endpoint::new(meta_address, "meta".to_string()),
            io: Mutex::new(HashMap::new()),
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    /// One request to the meta server. `target` names what it is about, for the error.
    pub async fn meta_call<R: Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
    ) -> Result<R::Reply, ClientError> {
        let started = std::time::Instant::now();
        let result = match self.meta.get(&self.key, &self.options).await {
            Ok(connection) => connection.call(request, Bytes::new()).await,
            Err(error) => Err(error),
        };
        self.metrics
            .request_done(R::OPCODE, started, result.is_ok());
        result
            .map(|(reply, _payload)| reply)
            .map_err(|source| ClientError::Meta {
                operation: R::NAME,
                target: target(),
                address: self.meta.address.clone(),
                source,
            })
    }

    /// Fetch the server list from the meta server and update the addresses we know.
    pub async fn refresh_servers(&self) -> Result<Vec<ServerRecord>, ClientError> {
        let _refreshing = self.refreshing.lock().await;
        let servers = self
            .meta_call(&ListServers {}, || "of the cluster".to_string())
            .await?;
        let mut io = self.io.lock().expect("not poisoned");
        for server in &servers {
            let stale = io
                .get(&server.server_id)
                .is_none_or(|endpoint| endpoint.address != server.address);
            if stale {
                io.insert(
                    server.server_id,
                    std::sync::Arc::new(Endpoint::new(
                        server.address.clone(),
                        format!("io:{}", server.server_id),
                    )),
                );
            }
        }
        Ok(servers)
    }

    fn io_endpoint(&self, server_id: ServerId) -> Option<std::sync::Arc<Endpoint>> {
        self.io
            .lock()
            .expect("not poisoned")
            .get(&server_id)
            .cloned()
    }

    /// A connection to I/O server `server_id` (checked to be that server when made).
    async fn io_connection(
        &self,
        server_id: ServerId,
        inode: InodeId,
    ) -> Result<Connection, ClientError> {
        let endpoint = match self.io_endpoint(server_id) {
            Some(endpoint) => endpoint,
            None => {
                self.refresh_servers().await?;
                self.io_endpoint(server_id)
                    .ok_or(ClientError::ServerUnknown { server_id, inode })?
            }
        };
        let connection = match endpoint.get(&self.key, &self.options).await {
            Ok(connection) => connection,
            Err(first_error) => {
                // The server may have come back at another address.
                self.refresh_servers().await?;
                let refreshed = self
                    .io_endpoint(server_id)
                    .ok_or(ClientError::ServerUnknown { server_id, inode })?;
                if refreshed.address == endpoint.address {
                    return Err(ClientError::Io {
                        operation: "connect",
                        target: format!("for inode {inode}"),
                        server_id,
                        address: endpoint.address.clone(),
                        source: first_error,
                    });
                }
                refreshed
                    .get(&self.key, &self.options)
                    .await
                    .map_err(|source| ClientError::Io {
                        operation: "connect",
                        target: format!("for inode {inode}"),
                        server_id,
                        address: refreshed.address.clone(),
                        source,
                    })?
            }
        };
        Ok(connection)
    }

    /// One request to I/O server `server_id`. A read or a sync whose connection broke is
    /// sent once more on a new connection: it changes nothing, so a second copy is harmless.
    /// A write or a truncate is never sent again (see [`resend_is_safe`]): the server may
    /// still be running the first copy, which could land after a newer overlapping write.
    pub async fn io_call<R: Request>(
        &self,
        server_id: ServerId,
        inode: InodeId,
        request: &R,
        payload: Bytes,
        target: impl Fn() -> String,
    ) -> Result<(R::Reply, Bytes), ClientError> {
        let started = std::time::Instant::now();
        let payload_bytes = payload.len() as u64;
        let result = self
            .io_call_unmetered(server_id, inode, request, payload, target)
            .await;
        self.metrics
            .request_done(R::OPCODE, started, result.is_ok());
        if let Ok((_, reply_payload)) = &result {
            if R::OPCODE == WriteObject::OPCODE {
                self.metrics.written(payload_bytes);
            } else if R::OPCODE == ReadObject::OPCODE {
                self.metrics.read(reply_payload.len() as u64);
            }
        }
        result
    }

    async fn io_call_unmetered<R: Request>(
        &self,
        server_id: ServerId,
        inode: InodeId,
        request: &R,
        payload: Bytes,
        target: impl Fn() -> String,
    ) -> Result<(R::Reply, Bytes), ClientError> {
        let mut retried = false;
        loop {
            let connection = self.io_connection(server_id, inode).await?;
            match connection.call(request, payload.clone()).await {
                Ok(reply) => return Ok(reply),
                Err(RpcError::Disconnected { .. }) if !retried && resend_is_safe(R::OPCODE) => {
                    retried = true
                }
                Err(source) => {
                    let address = connection.address().to_string();
                    return Err(ClientError::Io {
                        operation: R::NAME,
                        target: target(),
                        server_id,
                        address,
                        source,
                    });
                }
            }
        }
    }
}

/// Whether an I/O request may be sent again after its connection broke (or it timed out)
/// with no reply. Only requests that change nothing: reads, and syncs (which only wait for
/// the disk). A write or truncate resent on a new connection can land after the server's
/// first copy, which may itself land after a newer overlapping write of the same client:
/// the older bytes would win. So those fail, and the failure sticks on the handle.
pub(crate) fn resend_is_safe(opcode: u16) -> bool {
    opcode == ReadObject::OPCODE || opcode == SyncObjects::OPCODE
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_proto::io::TruncateObject;

    #[test]
    fn only_reads_and_syncs_are_resent() {
        assert!(resend_is_safe(ReadObject::OPCODE));
        assert!(resend_is_safe(SyncObjects::OPCODE));
        assert!(!resend_is_safe(WriteObject::OPCODE));
        assert!(!resend_is_safe(TruncateObject::OPCODE));
    }
}
