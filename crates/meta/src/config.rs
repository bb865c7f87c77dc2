//! The metadata server's configuration as read from TOML, its checks, and the errors a
//! start can end with.

use crate::store::StoreError;
use freeflow_types::limits::{REPLICAS_MAX, STRIPE_COUNT_MAX, STRIPE_UNIT_BYTES_DEFAULT};
use freeflow_types::Layout;
use std::path::PathBuf;

/// Name of the redb file inside the data directory.
pub const DATABASE_FILE_NAME: &str = "meta.redb";

/// Configuration of the metadata server, as read from TOML. Every field has a default.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetaConfig {
    /// Address to listen on; port 0 picks a free port (tests). Default "127.0.0.1:7700".
    pub listen_address: String,
    /// Directory holding `meta.redb`; created if missing.
    pub data_dir: PathBuf,
    /// Sessions not renewed within this time end, closing their handles. Default 30000.
    pub lease_ms: u32,
    /// Stripe unit of new files when their directory sets none. Default 1 MiB.
    pub stripe_unit_bytes: u32,
    /// Stripe count of new files when their directory sets none; 0: all servers. Default 0.
    pub stripe_count: u32,
    /// Copies of each stripe of new files when their directory sets none (chain
    /// replication, DESIGN.md §7); at most the number of I/O servers. Default 1.
    pub replicas: u32,
    /// An I/O server not heard from within this time is reported down. Default 5000.
    pub server_down_after_ms: u64,
    /// An I/O server out of its chains (silent) for this long is taken as lost for good:
    /// every replicated stripe it kept gets another server in its place, which copies it
    /// from the survivors (re-replication). 0: never. Default 600000 (10 minutes; `freeflow
    /// up` sets 120000): long enough for a reboot, short enough that a second failure is
    /// unlikely to come first. At least `server_down_after_ms` when not 0.
    pub server_dead_after_ms: u64,
    /// Most bytes per second each server taking a lost server's place reads from the
    /// survivors while it copies; 0: no limit. Default 104857600 (100 MiB/s).
    pub rereplicate_bytes_per_second: u64,
    /// Even out the I/O servers' used bytes (by capacity) by moving copies from the
    /// fullest to the emptiest, at `rereplicate_bytes_per_second` per receiving server, when
    /// one holds more than its share by 5% of it and by `rebalance_min_bytes`. Used bytes are
    /// each disk's (capacity less free): servers sharing a disk look even. Default true.
    pub rebalance: bool,
    /// See `rebalance`. Default 1073741824 (1 GiB).
    pub rebalance_min_bytes: u64,
    /// How often I/O servers are told to send their heartbeat. Default 1000.
    pub heartbeat_interval_ms: u32,
    /// Most mutations committed in one write transaction (one fsync). Default 256.
    pub commit_batch_max: usize,
    /// Mutations queued for the writer before callers wait. Default 4096.
    pub commit_queue_max: usize,
    /// Mutations are answered before they are durable; a durable commit (one fsync)
    /// follows within this time, sooner when a client asks (fsync, sync). Default 500.
    pub commit_interval_ms: u64,
    /// After a restart, how long new requests wait for clients to replay the mutations
    /// they were answered but that were not durable (and reclaim their locks). Default
    /// 10000; never shorter than `cache_lease_ms` in effect.
    pub recovery_window_ms: u64,
    /// How long a client that polls for revocations may cache what it read (names,
    /// attributes) without asking again; a mutation waits at most this long for a client
    /// that does not acknowledge a revocation. Default 10000.
    pub cache_lease_ms: u32,
    /// Payload bytes a client may have in flight per connection. Default 16 MiB.
    pub window_bytes: u32,
    /// Requests served at once per connection. Default 128.
    pub requests_in_flight_max: u32,
    /// Client sessions at once. Default 65536.
    pub sessions_max: usize,
    /// Open handles at once, over all sessions. Default 1048576.
    pub handles_max: usize,
    /// Orphans whose data is being removed at once. Default 32.
    pub reap_concurrency_max: usize,
    /// Memory redb may use to cache pages. Default 256 MiB.
    pub store_cache_bytes: usize,
    /// Where to serve Prometheus metrics over HTTP (`GET /metrics`), `host:port`; port 0
    /// picks a free port. Default: none (no endpoint; the counters still run).
    pub metrics_address: Option<String>,
    /// Replicated metadata (issue 11): this server's id among `peers`; 0 (the default):
    /// a single metadata server, no Raft.
    pub node_id: u64,
    /// Replicated metadata: every metadata server of the cluster, this one included (an
    /// odd number: 3 survive the loss of one). Empty for a single server.
    pub peers: Vec<MetaPeer>,
    /// Replicated metadata: the leader's heartbeat to its followers. Default 100.
    pub raft_heartbeat_ms: u64,
    /// Replicated metadata: the election timeout, between this and twice it at random. A
    /// follower that has not heard from its leader for twice this (the leader's lease)
    /// plus its timeout calls an election, so a failover takes about three to four times
    /// this. Default 300.
    pub raft_election_ms: u64,
    /// Replicated metadata: entries between two snapshots of the applied state (a
    /// follower further behind than the log keeps gets a snapshot). Default 20,000.
    pub raft_snapshot_entries: u64,
    /// Replicated metadata: entries the log keeps behind its last snapshot, for followers
    /// a little behind. Default 2,000.
    pub raft_log_kept_entries: u64,
    /// Replicated metadata: most bytes of entries one Raft append this member sends, and
    /// of a snapshot chunk (at most 4 MiB). A member far behind is sent its entries in
    /// parts of at most this; one entry larger than it goes alone (every member takes
    /// messages of up to 64 MiB). Between 256 KiB and 64 MiB; default 4 MiB: openraft
    /// gives an append one heartbeat interval (`raft_heartbeat_ms`) to be answered, and a
    /// follower catching up must decode, store and fsync what it is sent within it, or the
    /// leader backs off and sends it again.
    pub raft_message_bytes_max: u32,
    /// Replicated metadata: this member joins a cluster that runs already (`freeflow meta
    /// add`), so with an empty log it never proposes a membership; it waits for the leader
    /// to add it. `peers` must name it (its addresses); the others there are asked who
    /// leads. Default false: the members of `peers` form the cluster at its first start.
    pub join: bool,
}

/// One metadata server of a replicated cluster.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaPeer {
    /// Its Raft node id (at least 1, unique).
    pub id: u64,
    /// Where clients and I/O servers reach it (its `listen_address` as others see it).
    pub address: String,
    /// Where the other metadata servers reach its Raft service.
    pub raft_address: String,
}

impl Default for MetaConfig {
    fn default() -> MetaConfig {
        MetaConfig {
            listen_address: "127.0.0.1:7700".into(),
            data_dir: PathBuf::from("freeflow-meta"),
            lease_ms: 30_000,
            stripe_unit_bytes: STRIPE_UNIT_BYTES_DEFAULT,
            stripe_count: 0,
            replicas: 1,
            server_down_after_ms: 5000,
            server_dead_after_ms: 600_000,
            rereplicate_bytes_per_second: 100 << 20,
            rebalance: true,
            rebalance_min_bytes: 1 << 30,
            heartbeat_interval_ms: 1000,
            commit_batch_max: 256,
            commit_queue_max: 4096,
            commit_interval_ms: 500,
            recovery_window_ms: 10_000,
            cache_lease_ms: 10_000,
            window_bytes: 16 << 20,
            requests_in_flight_max: 128,
            sessions_max: 65_536,
            handles_max: 1 << 20,
            reap_concurrency_max: 32,
            store_cache_bytes: 256 << 20,
            metrics_address: None,
            node_id: 0,
            peers: Vec::new(),
            raft_heartbeat_ms: 100,
            raft_election_ms: 300,
            raft_snapshot_entries: 20_000,
            raft_log_kept_entries: 2_000,
            raft_message_bytes_max: 4 << 20,
            join: false,
        }
    }
}

/// Why the metadata server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("invalid meta config: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("cannot create data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open metadata store {path}: {source}")]
    Store { path: PathBuf, source: StoreError },
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("metadata server task failed: {0}")]
    Task(String),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> MetaError {
    MetaError::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

impl MetaConfig {
    /// Check every field and the rules between fields.
    pub fn validate(&self) -> Result<(), MetaError> {
        let MetaConfig {
            listen_address,
            data_dir,
            lease_ms,
            stripe_unit_bytes,
            stripe_count,
            replicas,
            server_down_after_ms,
            server_dead_after_ms,
            rereplicate_bytes_per_second: _,
            rebalance: _,
            rebalance_min_bytes: _,
            heartbeat_interval_ms,
            commit_batch_max,
            commit_queue_max,
            commit_interval_ms,
            recovery_window_ms,
            cache_lease_ms,
            window_bytes,
            requests_in_flight_max,
            sessions_max,
            handles_max,
            reap_concurrency_max,
            store_cache_bytes,
            metrics_address,
            node_id,
            peers,
            raft_heartbeat_ms,
            raft_election_ms,
            raft_snapshot_entries,
            raft_log_kept_entries: _,
            raft_message_bytes_max,
            join,
        } = self;
        if listen_address.is_empty() || !listen_address.contains(':') {
            return Err(invalid(
                "listen_address",
                format!("{listen_address:?} is not host:port"),
            ));
        }
        if data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if *lease_ms < 100 {
            return Err(invalid(
                "lease_ms",
                format!("{lease_ms} is below the minimum 100"),
            ));
        }
        if let Err(error) = Layout::new(*stripe_unit_bytes, vec![0]) {
            return Err(invalid("stripe_unit_bytes", error.to_string()));
        }
        if *stripe_count > STRIPE_COUNT_MAX {
            return Err(invalid(
                "stripe_count",
                format!("{stripe_count} is above the maximum {STRIPE_COUNT_MAX} (0: all servers)"),
            ));
        }
        if *replicas == 0 || *replicas > REPLICAS_MAX {
            return Err(invalid(
                "replicas",
                format!("{replicas} is outside 1..={REPLICAS_MAX}"),
            ));
        }
        if *heartbeat_interval_ms == 0 {
            return Err(invalid("heartbeat_interval_ms", "must be at least 1"));
        }
        if *server_down_after_ms <= u64::from(*heartbeat_interval_ms) {
            return Err(invalid(
                "server_down_after_ms",
                format!(
                    "{server_down_after_ms} must be longer than heartbeat_interval_ms {heartbeat_interval_ms}"
                ),
            ));
        }
        if *server_dead_after_ms != 0 && *server_dead_after_ms < *server_down_after_ms {
            return Err(invalid(
                "server_dead_after_ms",
                format!(
                    "{server_dead_after_ms} is shorter than server_down_after_ms {server_down_after_ms} (0: never)"
                ),
            ));
        }
        for (field, value) in [
            ("commit_batch_max", *commit_batch_max),
            ("commit_queue_max", *commit_queue_max),
            ("sessions_max", *sessions_max),
            ("handles_max", *handles_max),
            ("reap_concurrency_max", *reap_concurrency_max),
            ("requests_in_flight_max", *requests_in_flight_max as usize),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if *commit_interval_ms == 0 || *commit_interval_ms > 60_000 {
            return Err(invalid(
                "commit_interval_ms",
                format!("{commit_interval_ms} is not between 1 and 60000"),
            ));
        }
        if *cache_lease_ms < 100 || *cache_lease_ms > 600_000 {
            return Err(invalid(
                "cache_lease_ms",
                format!("{cache_lease_ms} is not between 100 and 600000"),
            ));
        }
        if *recovery_window_ms > 3_600_000 {
            return Err(invalid(
                "recovery_window_ms",
                format!("{recovery_window_ms} is above one hour"),
            ));
        }
        if *window_bytes < 64 << 10 {
            return Err(invalid(
                "window_bytes",
                format!("{window_bytes} is below 64 KiB"),
            ));
        }
        if let Some(metrics_address) = metrics_address {
            if metrics_address.is_empty() || !metrics_address.contains(':') {
                return Err(invalid(
                    "metrics_address",
                    format!("{metrics_address:?} is not host:port"),
                ));
            }
        }
        if *store_cache_bytes < 1 << 20 {
            return Err(invalid(
                "store_cache_bytes",
                format!("{store_cache_bytes} is below 1 MiB"),
            ));
        }
        if *node_id == 0 {
            if *join {
                return Err(invalid(
                    "join",
                    "a member joining a replicated cluster needs its node_id and peers",
                ));
            }
            if !peers.is_empty() {
                return Err(invalid(
                    "node_id",
                    "peers are set, so node_id must name this server among them",
                ));
            }
            return Ok(());
        }
        if !peers.iter().any(|peer| peer.id == *node_id) {
            return Err(invalid(
                "peers",
                format!("no peer has this server's node_id {node_id}"),
            ));
        }
        let mut ids = std::collections::BTreeSet::new();
        for peer in peers {
            if peer.id == 0 || !ids.insert(peer.id) {
                return Err(invalid(
                    "peers",
                    format!("peer id {} is 0 or given twice", peer.id),
                ));
            }
            for (what, address) in [
                ("address", &peer.address),
                ("raft_address", &peer.raft_address),
            ] {
                if !address.contains(':') {
                    return Err(invalid(
                        "peers",
                        format!("peer {}'s {what} {address:?} is not host:port", peer.id),
                    ));
                }
            }
        }
        if *raft_heartbeat_ms == 0 || *raft_election_ms < 3 * *raft_heartbeat_ms {
            return Err(invalid(
                "raft_election_ms",
                format!(
                    "{raft_election_ms} must be at least three heartbeats ({raft_heartbeat_ms} ms each, at least 1)"
                ),
            ));
        }
        if *recovery_window_ms < RECOVERY_WINDOW_REPLICATED_MIN_MS {
            return Err(invalid(
                "recovery_window_ms",
                format!(
                    "{recovery_window_ms} is below {RECOVERY_WINDOW_REPLICATED_MIN_MS}: with peers, \
                     a client finds a leader cut off only once it has been silent for the \
                     clients' liveness timeout ({} ms by default), and the changes it replays \
                     to the new leader after the window are lost",
                    freeflow_rpc::LIVENESS_TIMEOUT_MS_DEFAULT
                ),
            ));
        }
        if *raft_snapshot_entries == 0 {
            return Err(invalid(
                "raft_snapshot_entries",
                "must be at least 1 (entries between snapshots)",
            ));
        }
        if !(RAFT_MESSAGE_BYTES_MIN..=RAFT_MESSAGE_BYTES_MAX).contains(raft_message_bytes_max) {
            return Err(invalid(
                "raft_message_bytes_max",
                format!(
                    "{raft_message_bytes_max} is outside {RAFT_MESSAGE_BYTES_MIN}..={RAFT_MESSAGE_BYTES_MAX} bytes"
                ),
            ));
        }
        Ok(())
    }
}

/// Bounds of `raft_message_bytes_max`.
pub const RAFT_MESSAGE_BYTES_MIN: u32 = 256 << 10;
pub const RAFT_MESSAGE_BYTES_MAX: u32 = 64 << 20;

/// The shortest recovery window of a replicated metadata server. The window starts when
/// the new leader serves; a client whose calls wait on a leader cut off (not killed: its
/// sockets stay open) finds it gone only after the liveness timeout of its connection
/// (`freeflow_rpc::LIVENESS_TIMEOUT_MS_DEFAULT`, checked every quarter of it), then asks
/// every member at once. Twice the default liveness timeout leaves room for both.
pub const RECOVERY_WINDOW_REPLICATED_MIN_MS: u64 = 2 * freeflow_rpc::LIVENESS_TIMEOUT_MS_DEFAULT;

#[cfg(test)]
mod config_tests {
    use super::*;

    fn replicated(recovery_window_ms: u64) -> MetaConfig {
        let peers = (1..=3)
            .map(|id| MetaPeer {
                id,
                address: format!("10.0.0.{id}:7700"),
                raft_address: format!("10.0.0.{id}:7774"),
            })
            .collect();
        MetaConfig {
            node_id: 1,
            peers,
            recovery_window_ms,
            ..MetaConfig::default()
        }
    }

    /// A replicated server's recovery window must outlast a client's discovery that its
    /// leader went silent; a single server's may be as short as its owner likes.
    #[test]
    fn a_replicated_recovery_window_shorter_than_a_clients_liveness_is_refused() {
        assert!(replicated(MetaConfig::default().recovery_window_ms)
            .validate()
            .is_ok());
        assert!(replicated(RECOVERY_WINDOW_REPLICATED_MIN_MS)
            .validate()
            .is_ok());
        let error = replicated(3_000).validate().unwrap_err().to_string();
        assert!(
            error.contains("recovery_window_ms") && error.contains("liveness"),
            "{error}"
        );
        let single = MetaConfig {
            recovery_window_ms: 1_000,
            ..MetaConfig::default()
        };
        assert!(single.validate().is_ok());
    }
}
