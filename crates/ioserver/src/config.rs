//! The I/O server's configuration: a serde struct with documented defaults (the `[io]`
//! section of a config file), then [`IoConfig::validate`], which checks every field and the
//! rules between them before anything starts.

use std::path::PathBuf;

use freeflow_types::{limits, ServerId};
use serde::{Deserialize, Serialize};

use crate::error::IoServerError;

/// Which disk engine to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// io_uring with registered buffers (falls back to `Threads` if io_uring cannot start).
    #[default]
    Uring,
    /// A pool of threads doing `pread`/`pwrite`.
    Threads,
}

/// Which requests an I/O server does with O_DIRECT, past its page cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirectIo {
    /// Everything through the page cache.
    Off,
    /// Large aligned writes with O_DIRECT; reads through the page cache (and its read-ahead).
    #[default]
    Writes,
    /// Large aligned writes and reads (reads only with the io_uring engine).
    All,
}

/// Hard limit of open descriptors on the machines we target (MACHINE.md); the descriptor
/// cache must leave room below it for sockets and everything else.
const PROCESS_OPEN_FILES_LIMIT: usize = 20_000;

/// How long the connection to the metadata leader may stay silent with a call waiting
/// before it is taken for dead and a leader is searched for again (registration and map
/// fetches). The shortest the connection allows: a leader cut off by the network keeps its
/// sockets open, and this server must be registered with the new one (elected about a
/// second after the cut) well before `server_down_after_ms` from its election, or it puts
/// this server out of its chains (with the default of three seconds, a cut made both I/O
/// servers of a test silent for 3-4 s and the new leader put them out). A leader, however
/// loaded, answers a ping at once.
/// Chain peers' connections (`replication.rs`) use it too.
pub const META_LIVENESS_TIMEOUT_MS: u64 = freeflow_rpc::LIVENESS_TIMEOUT_MS_MIN;

/// Memory the I/O server's process holds besides its buffer pool, its connections and the
/// payloads: the binary's pages, the runtime, the descriptor cache's entries, the links to
/// the meta server and to replicas, metrics. Release builds hold 16-26 MiB of it idle
/// (docs/BENCHMARKS.md, "The I/O server's memory budget").
pub const BASELINE_MEMORY_BYTES: u64 = 32 << 20;

/// Memory one connection may hold besides the payloads counted in the payload budget: its
/// 64 KiB read and 64 KiB write buffers, the headers of its requests, its tasks.
pub const CONNECTION_MEMORY_BYTES: u64 = 160 << 10;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IoConfig {
    /// This server's id, fixed at `freeflow init`/`up`; stored in the data directory.
    pub server_id: ServerId,
    /// Where to listen, `host:port`; port 0 picks a free port. Default `127.0.0.1:7710`.
    pub listen_address: String,
    /// The address given to the meta server for clients; default: the bound listen address.
    /// `unix:/path` (with `unix_socket` = that path) when every client is on this host.
    pub advertise_address: Option<String>,
    /// Also listen on a Unix socket at this path, for peers on this host (`freeflow up`
    /// uses it: no TCP/IP stack on the data path). Default: none.
    pub unix_socket: Option<PathBuf>,
    /// The directory holding this server's objects (one per disk). Default `./freeflow-io`.
    pub data_dir: PathBuf,
    /// The meta server's address; for a replicated metadata cluster every member's,
    /// comma separated (the leader is found among them). Default `127.0.0.1:7700`.
    pub meta_address: String,
    /// Default `uring`.
    pub engine: EngineKind,
    /// Bound of the open-descriptor cache. Default 4096.
    pub open_files_max: usize,
    /// io_uring registered buffers. Default 64.
    pub buffer_count: usize,
    /// Size of each buffer; larger requests are done in buffer-sized pieces. Default 1 MiB.
    pub buffer_bytes: usize,
    /// Threads of the thread-pool engine. Default 8.
    pub worker_threads: usize,
    /// The largest window (payload bytes in flight) one connection is granted; windows are
    /// shared out of `payload_budget_bytes` while the server runs (credits). Default 64 MiB.
    pub window_bytes: u32,
    /// The most memory the server's process holds: the buffer pool (`buffer_count ×
    /// buffer_bytes`), `connections_max` connections at [`CONNECTION_MEMORY_BYTES`] each,
    /// [`BASELINE_MEMORY_BYTES`] for the rest of the process, and the payload budget, which
    /// is what these leave unless `payload_budget_bytes` says less. Checked at start.
    /// Default 768 MiB (a 512 MiB payload budget with the other defaults).
    pub memory_budget_bytes: u64,
    /// Connections served at once (clients, replicas, the meta server's); one more is closed
    /// at accept. Each is counted in `memory_budget_bytes`. Default 1024.
    pub connections_max: u32,
    /// Request and reply payload bytes this server holds at once, across every connection
    /// (what the data path may use for requests waiting for or in the disk, and for reads'
    /// replies not yet sent); connections' windows are shared out of it (credits). Default:
    /// what `memory_budget_bytes` leaves; when set, it must fit in that.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_budget_bytes: Option<u64>,
    /// io_uring submission queue size: the most disk operations in the ring at once (more
    /// wait their turn). Default 256.
    pub ring_entries: u32,
    /// Thread engine: disk operations waiting for a worker thread before requests wait.
    /// Default 1024.
    pub engine_queue_depth_max: usize,
    /// Requests served at once on one connection. Default 128.
    pub requests_in_flight_max: u32,
    /// Timeout connecting to the meta server. Default 2000 ms.
    pub meta_connect_timeout_ms: u64,
    /// Timeout of one registration call. Default 5000 ms.
    pub meta_call_timeout_ms: u64,
    /// Longest wait between registration attempts while the meta server is away. Default 5000 ms.
    pub register_backoff_max_ms: u64,
    /// Where to serve Prometheus metrics over HTTP (`GET /metrics`), `host:port`; port 0
    /// picks a free port. Default: none (no endpoint; the counters still run).
    pub metrics_address: Option<String>,
    /// Which large aligned requests go through O_DIRECT, past the page cache: `off`,
    /// `writes` or `all`. Default `writes` (docs/BENCHMARKS.md, "O_DIRECT on the I/O
    /// servers": large and fsynced writes 1.3-2x, small ones and reads unchanged).
    pub direct_io: DirectIo,
    /// Smallest request that goes through O_DIRECT (a multiple of 4096, at least 64 KiB:
    /// smaller payloads do not arrive page aligned). Default 1 MiB. With `direct_io` on, a
    /// quarter of `open_files_max` holds O_DIRECT descriptors.
    pub direct_io_min_bytes: u32,
    /// Answer reads of up to 128 KiB whose bytes are all in the page cache in the request's
    /// own task (`preadv2` with `RWF_NOWAIT`), without the disk engine's thread. Default
    /// true (docs/BENCHMARKS.md, "Small reads from the page cache").
    pub cached_reads: bool,
    /// With `unix_socket`: also hand clients on this host read-only descriptors of objects
    /// on a local-reads socket beside it (`<unix_socket>.reads`), so they read the bytes
    /// themselves (`local_reads.rs`), and take the memory regions they share for their
    /// write payloads on the same socket (shared writes, `freeflow_rpc::shared`). Default
    /// true (docs/BENCHMARKS.md, "Local reads" and "Writes from the servers' host").
    pub local_reads: bool,
}

impl Default for IoConfig {
    fn default() -> IoConfig {
        IoConfig {
            server_id: 1,
            listen_address: "127.0.0.1:7710".to_owned(),
            advertise_address: None,
            unix_socket: None,
            data_dir: PathBuf::from("freeflow-io"),
            meta_address: "127.0.0.1:7700".to_owned(),
            engine: EngineKind::Uring,
            open_files_max: 4096,
            buffer_count: 64,
            buffer_bytes: 1 << 20,
            worker_threads: 8,
            window_bytes: 64 << 20,
            memory_budget_bytes: 768 << 20,
            connections_max: 1024,
            payload_budget_bytes: None,
            ring_entries: 256,
            engine_queue_depth_max: 1024,
            requests_in_flight_max: 128,
            meta_connect_timeout_ms: 2000,
            meta_call_timeout_ms: 5000,
            register_backoff_max_ms: 5000,
            metrics_address: None,
            direct_io: DirectIo::Writes,
            direct_io_min_bytes: 1 << 20,
            cached_reads: true,
            local_reads: true,
        }
    }
}

impl IoConfig {
    /// Memory held whatever the load: the buffer pool, the connections, the baseline.
    pub fn fixed_memory_bytes(&self) -> u64 {
        (self.buffer_count as u64) * (self.buffer_bytes as u64)
            + u64::from(self.connections_max) * CONNECTION_MEMORY_BYTES
            + BASELINE_MEMORY_BYTES
    }

    /// The payload budget this configuration gives: `payload_budget_bytes` when set, else
    /// what the memory budget leaves after [`IoConfig::fixed_memory_bytes`].
    pub fn payload_budget(&self) -> u64 {
        self.payload_budget_bytes.unwrap_or_else(|| {
            self.memory_budget_bytes
                .saturating_sub(self.fixed_memory_bytes())
        })
    }

    /// Checks every field; the error names the field and the rule.
    pub fn validate(&self) -> Result<(), IoServerError> {
        let IoConfig {
            server_id: _,
            listen_address,
            advertise_address,
            unix_socket,
            data_dir,
            meta_address,
            engine: _,
            open_files_max,
            buffer_count,
            buffer_bytes,
            worker_threads,
            window_bytes,
            memory_budget_bytes,
            connections_max,
            payload_budget_bytes: _,
            ring_entries,
            engine_queue_depth_max,
            requests_in_flight_max,
            meta_connect_timeout_ms,
            meta_call_timeout_ms,
            register_backoff_max_ms,
            metrics_address,
            direct_io: _,
            direct_io_min_bytes,
            cached_reads: _,
            local_reads: _,
        } = self;
        check_address("listen_address", listen_address, true)?;
        if let Some(path) = unix_socket {
            if !path.is_absolute() {
                return invalid(format!(
                    "unix_socket {} is not an absolute path (clients on this host connect to what the server advertises)",
                    path.display()
                ));
            }
            // sun_path holds 108 bytes with the terminating zero.
            if path.as_os_str().len() > 107 {
                return invalid(format!(
                    "unix_socket {} must be 1..=107 bytes long (the kernel's bound on socket paths)",
                    path.display()
                ));
            }
        }
        if let Some(advertise_address) = advertise_address {
            match freeflow_rpc::unix_socket_path(advertise_address) {
                Some(path) => {
                    if unix_socket.as_deref() != Some(std::path::Path::new(path)) {
                        return invalid(format!(
                            "advertise_address {advertise_address:?} names a socket this server does not listen on (unix_socket is {:?})",
                            unix_socket
                        ));
                    }
                }
                None => check_address("advertise_address", advertise_address, false)?,
            }
        }
        // Several, comma separated, for a replicated metadata cluster.
        for address in meta_address.split(',') {
            check_address("meta_address", address.trim(), false)?;
        }
        if let Some(metrics_address) = metrics_address {
            check_address("metrics_address", metrics_address, true)?;
        }
        if data_dir.as_os_str().is_empty() {
            return invalid("data_dir is empty".to_owned());
        }
        check_range(
            "open_files_max",
            *open_files_max as u64,
            1,
            (PROCESS_OPEN_FILES_LIMIT - 4000) as u64,
        )?;
        check_range("buffer_count", *buffer_count as u64, 1, 4096)?;
        check_range(
            "buffer_bytes",
            *buffer_bytes as u64,
            4096,
            u64::from(limits::IO_REQUEST_BYTES_MAX),
        )?;
        if buffer_bytes % 4096 != 0 {
            return invalid(format!(
                "buffer_bytes {buffer_bytes} is not a multiple of 4096"
            ));
        }
        let pool_bytes = (*buffer_count as u64) * (*buffer_bytes as u64);
        if pool_bytes > 4 << 30 {
            return invalid(format!(
                "buffer_count × buffer_bytes = {pool_bytes} bytes exceeds the 4 GiB bound"
            ));
        }
        check_range("worker_threads", *worker_threads as u64, 1, 256)?;
        check_range(
            "window_bytes",
            u64::from(*window_bytes),
            u64::from(limits::IO_REQUEST_BYTES_MAX),
            u64::from(u32::MAX),
        )?;
        check_range("connections_max", u64::from(*connections_max), 1, 65_536)?;
        check_range(
            "memory_budget_bytes",
            *memory_budget_bytes,
            64 << 20,
            1 << 42,
        )?;
        let payload = self.payload_budget();
        let fixed = self.fixed_memory_bytes();
        if self.payload_budget_bytes.is_none() && payload < u64::from(limits::IO_REQUEST_BYTES_MAX)
        {
            return invalid(format!(
                "memory_budget_bytes = {memory_budget_bytes} leaves {payload} bytes for payloads, \
                 less than one largest request ({} bytes): the buffer pool (buffer_count × \
                 buffer_bytes), {connections_max} connections (connections_max × {} KiB) and \
                 {} MiB for the process take {fixed}",
                limits::IO_REQUEST_BYTES_MAX,
                CONNECTION_MEMORY_BYTES >> 10,
                BASELINE_MEMORY_BYTES >> 20,
            ));
        }
        check_range(
            "payload_budget_bytes",
            payload,
            u64::from(limits::IO_REQUEST_BYTES_MAX),
            1 << 40,
        )?;
        if fixed + payload > *memory_budget_bytes {
            return invalid(format!(
                "payload_budget_bytes = {payload} does not fit in memory_budget_bytes = \
                 {memory_budget_bytes}: the buffer pool, {connections_max} connections and the \
                 process itself take {fixed}"
            ));
        }
        check_range("ring_entries", u64::from(*ring_entries), 2, 4096)?;
        check_range(
            "engine_queue_depth_max",
            *engine_queue_depth_max as u64,
            1,
            1 << 20,
        )?;
        check_range(
            "requests_in_flight_max",
            u64::from(*requests_in_flight_max),
            1,
            1 << 16,
        )?;
        check_range(
            "meta_connect_timeout_ms",
            *meta_connect_timeout_ms,
            1,
            600_000,
        )?;
        check_range("meta_call_timeout_ms", *meta_call_timeout_ms, 1, 600_000)?;
        check_range(
            "register_backoff_max_ms",
            *register_backoff_max_ms,
            100,
            600_000,
        )?;
        check_range(
            "direct_io_min_bytes",
            u64::from(*direct_io_min_bytes),
            64 << 10,
            u64::from(limits::IO_REQUEST_BYTES_MAX),
        )?;
        if direct_io_min_bytes % 4096 != 0 {
            return invalid(format!(
                "direct_io_min_bytes {direct_io_min_bytes} is not a multiple of 4096"
            ));
        }
        Ok(())
    }
}

fn invalid(message: String) -> Result<(), IoServerError> {
    Err(IoServerError::InvalidConfig(message))
}

fn check_range(name: &str, value: u64, minimum: u64, maximum: u64) -> Result<(), IoServerError> {
    if value < minimum || value > maximum {
        return invalid(format!("{name} = {value} is outside {minimum}..={maximum}"));
    }
    Ok(())
}

/// `host:port` with a numeric port; port 0 only where `port_zero_allowed`.
fn check_address(name: &str, address: &str, port_zero_allowed: bool) -> Result<(), IoServerError> {
    let Some((host, port)) = address.rsplit_once(':') else {
        return invalid(format!("{name} {address:?} is not host:port"));
    };
    let Ok(port) = port.parse::<u16>() else {
        return invalid(format!("{name} {address:?} has no numeric port"));
    };
    if host.is_empty() {
        return invalid(format!("{name} {address:?} has no host"));
    }
    if port == 0 && !port_zero_allowed {
        return invalid(format!("{name} {address:?} has port 0"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `config` is refused with an error that says `needle`.
    fn refused(config: IoConfig, needle: &str) {
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains(needle), "{error}");
    }

    #[test]
    fn defaults_are_valid_and_parse_from_toml() {
        IoConfig::default().validate().unwrap();
        let config: IoConfig = toml::from_str("engine = \"threads\"\nserver_id = 3\n").unwrap();
        assert_eq!(config.engine, EngineKind::Threads);
        assert_eq!(config.server_id, 3);
        assert_eq!(config.open_files_max, 4096);
    }

    #[test]
    fn the_memory_budget_holds_the_pool_the_connections_and_the_payloads() {
        // The defaults: 768 MiB = 64 MiB of pool + 1024 × 160 KiB + 32 MiB + 512 MiB.
        let config = IoConfig::default();
        assert_eq!(config.fixed_memory_bytes(), 256 << 20);
        assert_eq!(config.payload_budget(), 512 << 20);
        // A smaller budget leaves a smaller payload budget.
        let small = IoConfig {
            memory_budget_bytes: 384 << 20,
            ..IoConfig::default()
        };
        small.validate().unwrap();
        assert_eq!(small.payload_budget(), 128 << 20);
        // Fewer connections leave more for payloads.
        let few = IoConfig {
            memory_budget_bytes: 384 << 20,
            connections_max: 64,
            ..IoConfig::default()
        };
        assert_eq!(
            few.payload_budget(),
            (288 << 20) - 64 * CONNECTION_MEMORY_BYTES
        );
        // A budget the fixed part eats is refused, naming what takes it.
        let eaten = IoConfig {
            memory_budget_bytes: 256 << 20,
            ..IoConfig::default()
        };
        refused(
            eaten.clone(),
            "memory_budget_bytes = 268435456 leaves 0 bytes",
        );
        refused(eaten, "1024 connections");
        // An explicit payload budget larger than what is left is refused.
        refused(
            IoConfig {
                memory_budget_bytes: 384 << 20,
                payload_budget_bytes: Some(256 << 20),
                ..IoConfig::default()
            },
            "does not fit in memory_budget_bytes",
        );
        // An explicit smaller one is kept.
        let explicit = IoConfig {
            payload_budget_bytes: Some(64 << 20),
            ..IoConfig::default()
        };
        explicit.validate().unwrap();
        assert_eq!(explicit.payload_budget(), 64 << 20);
        refused(
            IoConfig {
                connections_max: 0,
                ..IoConfig::default()
            },
            "connections_max = 0",
        );
    }

    #[test]
    fn direct_io_and_unix_socket_settings_are_checked() {
        let config: IoConfig = toml::from_str("direct_io = \"all\"\n").unwrap();
        assert_eq!(config.direct_io, DirectIo::All);
        assert_eq!(IoConfig::default().direct_io, DirectIo::Writes);
        refused(
            IoConfig {
                direct_io_min_bytes: 4096,
                ..IoConfig::default()
            },
            "direct_io_min_bytes",
        );
        refused(
            IoConfig {
                direct_io_min_bytes: (1 << 20) + 512,
                ..IoConfig::default()
            },
            "multiple of 4096",
        );
        refused(
            IoConfig {
                payload_budget_bytes: Some(1 << 20),
                ..IoConfig::default()
            },
            "payload_budget_bytes",
        );
        let config: IoConfig = toml::from_str(
            "payload_budget_bytes = 268435456
",
        )
        .unwrap();
        assert_eq!(config.payload_budget(), 256 << 20);
        config.validate().unwrap();
        refused(
            IoConfig {
                unix_socket: Some(PathBuf::from("io.sock")),
                ..IoConfig::default()
            },
            "not an absolute path",
        );
        refused(
            IoConfig {
                unix_socket: Some(PathBuf::from(format!("/{}", "s".repeat(120)))),
                ..IoConfig::default()
            },
            "1..=107 bytes",
        );
        refused(
            IoConfig {
                unix_socket: Some(PathBuf::from("/run/a.sock")),
                advertise_address: Some("unix:/run/b.sock".into()),
                ..IoConfig::default()
            },
            "does not listen on",
        );
        IoConfig {
            unix_socket: Some(PathBuf::from("/run/a.sock")),
            advertise_address: Some("unix:/run/a.sock".into()),
            ..IoConfig::default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn unknown_fields_and_engines_are_refused() {
        assert!(toml::from_str::<IoConfig>("engine = \"aio\"\n").is_err());
        assert!(toml::from_str::<IoConfig>("buffers = 3\n").is_err());
    }

    #[test]
    fn bad_fields_are_named() {
        let config = IoConfig {
            buffer_bytes: 1000,
            ..IoConfig::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("buffer_bytes"));
        let config = IoConfig {
            meta_address: "nowhere".to_owned(),
            ..IoConfig::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("meta_address"));
        let config = IoConfig {
            listen_address: "127.0.0.1:0".to_owned(),
            ..IoConfig::default()
        };
        config.validate().unwrap();
        let config = IoConfig {
            open_files_max: 50_000,
            ..IoConfig::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("open_files_max"));
    }
}
