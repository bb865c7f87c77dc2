//! The client's configuration: where the cluster is, who is asking, and the bounds of the
//! data path. Built by the caller (the CLI or the mount from their own config files), checked
//! once by [`ClientConfig::validate`] when the client connects.

use freeflow_proto::meta::Caller;
use freeflow_rpc::ClusterKey;
use freeflow_types::limits::IO_REQUEST_BYTES_MAX;

use crate::ClientError;

/// Default bound on write data sent but not yet acknowledged: 256 MiB.
pub const DIRTY_BYTES_MAX_DEFAULT: u64 = 256 << 20;
/// Default time after which a writer commits its size even without flush: 3 s.
pub const SIZE_COMMIT_INTERVAL_MS_DEFAULT: u64 = 3000;
/// Default time a request may take before it fails with `TimedOut`: 30 s.
pub const CALL_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Default time a connection attempt may take: 5 s.
pub const CONNECT_TIMEOUT_MS_DEFAULT: u64 = 5_000;
/// Default sequential read-ahead per handle: 16 MiB (see `readahead.rs`; 0 turns it off).
pub const READAHEAD_BYTES_DEFAULT: u64 = 16 << 20;
pub const GATHER_WAIT_MS_DEFAULT: u64 = 2;
/// Gathered bytes are not acknowledged by anyone: they must not wait long.
pub const GATHER_WAIT_MS_MAX: u64 = 1_000;

#[derive(Clone)]
pub struct ClientConfig {
    /// `host:port` of the metadata server; for a replicated metadata cluster every
    /// member's, comma separated (the client finds the leader among them).
    pub meta_address: String,
    pub key: ClusterKey,
    /// How this client names itself to servers (logs, session lists).
    pub client_name: String,
    /// The identity permission checks use; [`crate::Client::with_caller`] changes it per call site.
    pub caller: Caller,
    pub call_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// Bound on write data sent but not yet acknowledged, over all handles: a writer past it
    /// waits (throttling).
    pub dirty_bytes_max: u64,
    /// A writing handle commits its size at least this often (checked on each write).
    pub size_commit_interval_ms: u64,
    /// Sequential read-ahead per handle in bytes (`readahead.rs`); 0 turns it off.
    pub readahead_bytes: u64,
    /// Longest time small adjacent writes are gathered, and partial stripe units of large
    /// writes parked, at the client before they are sent (`file.rs`, `GATHER_WRITE_MAX`,
    /// `write_in_units`); 0 sends every write at once.
    pub gather_wait_ms: u64,
    /// Read objects of I/O servers on this host through descriptors they hand out
    /// (`local.rs`) instead of requests. Default true.
    pub local_reads: bool,
    /// Place large write payloads for I/O servers on this host in memory shared with them
    /// instead of sending them through the socket (`freeflow_rpc::shared`). Default true.
    pub shared_writes: bool,
}

impl ClientConfig {
    /// A configuration with the documented defaults, acting as root.
    pub fn new(meta_address: impl Into<String>, key: ClusterKey) -> ClientConfig {
        ClientConfig {
            meta_address: meta_address.into(),
            key,
            client_name: format!("client-{}", std::process::id()),
            caller: Caller::root(),
            call_timeout_ms: CALL_TIMEOUT_MS_DEFAULT,
            connect_timeout_ms: CONNECT_TIMEOUT_MS_DEFAULT,
            dirty_bytes_max: DIRTY_BYTES_MAX_DEFAULT,
            size_commit_interval_ms: SIZE_COMMIT_INTERVAL_MS_DEFAULT,
            readahead_bytes: READAHEAD_BYTES_DEFAULT,
            gather_wait_ms: GATHER_WAIT_MS_DEFAULT,
            local_reads: true,
            shared_writes: true,
        }
    }

    /// Check the cross-field rules; every field is looked at.
    pub fn validate(&self) -> Result<(), ClientError> {
        let ClientConfig {
            meta_address,
            key: _,
            client_name,
            caller: _,
            call_timeout_ms,
            connect_timeout_ms,
            dirty_bytes_max,
            size_commit_interval_ms: _,
            readahead_bytes: _,
            gather_wait_ms,
            local_reads: _,
            shared_writes: _,
        } = self;
        if *gather_wait_ms > GATHER_WAIT_MS_MAX {
            return Err(ClientError::Config(format!(
                "gather_wait_ms is {gather_wait_ms}, above the largest {GATHER_WAIT_MS_MAX}"
            )));
        }
        if meta_address.is_empty() {
            return Err(ClientError::Config("meta_address is empty".into()));
        }
        if client_name.is_empty() {
            return Err(ClientError::Config("client_name is empty".into()));
        }
        if *call_timeout_ms == 0 || *connect_timeout_ms == 0 {
            return Err(ClientError::Config(
                "call_timeout_ms and connect_timeout_ms must be above 0".into(),
            ));
        }
        if *dirty_bytes_max < u64::from(IO_REQUEST_BYTES_MAX) {
            return Err(ClientError::Config(format!(
                "dirty_bytes_max {dirty_bytes_max} is below one I/O request ({IO_REQUEST_BYTES_MAX} bytes)"
            )));
        }
        if *dirty_bytes_max > 1 << 40 {
            return Err(ClientError::Config(format!(
                "dirty_bytes_max {dirty_bytes_max} is above 1 TiB"
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for ClientConfig {
    /// Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("meta_address", &self.meta_address)
            .field("client_name", &self.client_name)
            .field("caller", &self.caller)
            .field("call_timeout_ms", &self.call_timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("dirty_bytes_max", &self.dirty_bytes_max)
            .field("size_commit_interval_ms", &self.size_commit_interval_ms)
            .field("gather_wait_ms", &self.gather_wait_ms)
            .field("readahead_bytes", &self.readahead_bytes)
            .field("local_reads", &self.local_reads)
            .field("shared_writes", &self.shared_writes)
            .finish_non_exhaustive()
    }
}
