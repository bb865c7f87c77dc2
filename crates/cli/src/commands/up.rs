//! `freeflow up`: a whole cluster in one process on loopback, the embedded default.
//! Data, key and configs live under one directory and are reused on the next start; the
//! configs written there also run the same cluster as separate processes
//! (`freeflow meta --config DIR/meta.toml`, `freeflow io --config DIR/io-0.toml`, ...).
//!
//! Every server gets a metrics endpoint (docs/metrics.md), printed at start: the meta
//! server on PORT + [`META_METRICS_PORT_OFFSET`], the mount on PORT +
//! [`MOUNT_METRICS_PORT_OFFSET`], I/O server i on PORT + [`IO_METRICS_PORT_OFFSET`] + i
//! (I/O servers themselves listen on PORT + 10 + i, up to 64 of them).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use freeflow_ioserver::{DirectIo, EngineKind, IoConfig};
use freeflow_meta::raft::supervisor::{start_replicated, ReplicatedMeta, Role};
use freeflow_meta::{MetaConfig, MetaPeer};
use freeflow_rpc::ClusterKey;

use crate::cluster_file::{self, ClientFile, IoFile, MetaFile};

/// `up` is a cluster on one host for trying things: a server silent for two minutes is
/// taken as lost and its copies made again (`init` keeps the longer default).
const UP_SERVER_DEAD_AFTER_MS: u64 = 120_000;

/// How long `up` waits for every I/O server to register before reporting ready anyway.
const REGISTRATION_WAIT_MS: u64 = 10_000;

/// Metrics ports, as offsets from `--port`.
pub const META_METRICS_PORT_OFFSET: u32 = 1;
pub const MOUNT_METRICS_PORT_OFFSET: u32 = 2;
pub const IO_METRICS_PORT_OFFSET: u32 = 100;
/// Raft services of a replicated metadata cluster (member i on PORT + 74 + i), and the
/// metrics of its members past the first (PORT + 80 + i).
pub const RAFT_PORT_OFFSET: u32 = 74;
pub const REPLICA_METRICS_PORT_OFFSET: u32 = 80;

/// `127.0.0.1:(port + offset)`, refusing ports past 65535.
fn loopback_port(port: u16, offset: u32) -> anyhow::Result<String> {
    let chosen = u32::from(port) + offset;
    anyhow::ensure!(
        chosen <= u32::from(u16::MAX),
        "--port {port} is too high: port {chosen} (PORT + {offset}) does not exist"
    );
    Ok(format!("127.0.0.1:{chosen}"))
}

/// What `freeflow up` was asked for.
pub struct Options {
    pub data: PathBuf,
    pub io_server_count: u32,
    /// Copies of each stripe of new files.
    pub replicas: u32,
    /// Metadata servers: 1, or an odd number run under Raft.
    pub meta_server_count: u32,
    pub port: u16,
    pub engine: String,
    /// O_DIRECT for large aligned requests on the I/O servers: "off", "writes" or "all".
    pub direct_io: String,
    /// The I/O servers listen on Unix sockets too and advertise them.
    pub unix_sockets: bool,
    pub mountpoint: Option<PathBuf>,
    /// How the mount behaves (its metrics address is set here from the port).
    pub mount_options: super::mount::Options,
    /// Serve a metrics endpoint for every server and the mount.
    pub metrics: bool,
}

pub async fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        data,
        io_server_count,
        replicas,
        meta_server_count,
        port,
        engine,
        direct_io,
        unix_sockets,
        mountpoint,
        mount_options,
        metrics,
    } = options;
    anyhow::ensure!(
        replicas <= io_server_count,
        "--replicas {replicas} needs at least {replicas} I/O servers (--io-servers is {io_server_count}): each copy of a stripe is on another server"
    );
    let engine = engine.as_str();
    // The address of a metrics endpoint at `port + offset`, or none with --no-metrics.
    let metrics_at = |offset: u32| -> anyhow::Result<Option<String>> {
        if metrics {
            Ok(Some(loopback_port(port, offset)?))
        } else {
            Ok(None)
        }
    };
    std::fs::create_dir_all(&data)
        .with_context(|| format!("cannot create data directory {}", data.display()))?;
    let data = data
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", data.display()))?;
    let key = load_or_create_key(&data.join("cluster.key"))?;
    // A replicated cluster: member i (0-based) for clients on PORT (i = 0) or PORT + 2 + i,
    // its Raft service on PORT + 74 + i, its metrics on PORT + 1 (i = 0) or PORT + 80 + i.
    let member_port = |i: u32| if i == 0 { 0 } else { 2 + i };
    let peers = if meta_server_count > 1 {
        (0..meta_server_count)
            .map(|i| {
                Ok(MetaPeer {
                    id: u64::from(i) + 1,
                    address: loopback_port(port, member_port(i))?,
                    raft_address: loopback_port(port, RAFT_PORT_OFFSET + i)?,
                })
            })
            .collect::<anyhow::Result<Vec<MetaPeer>>>()?
    } else {
        Vec::new()
    };
    let meta_address = if peers.is_empty() {
        format!("127.0.0.1:{port}")
    } else {
        peers
            .iter()
            .map(|peer| peer.address.clone())
            .collect::<Vec<_>>()
            .join(",")
    };
    let engine = match engine {
        "threads" => EngineKind::Threads,
        _ => EngineKind::Uring,
    };
    let direct_io = match direct_io.as_str() {
        "off" => DirectIo::Off,
        "all" => DirectIo::All,
        _ => DirectIo::Writes,
    };

    let meta_configs = if peers.is_empty() {
        vec![MetaConfig {
            listen_address: meta_address.clone(),
            data_dir: data.join("meta"),
            metrics_address: metrics_at(META_METRICS_PORT_OFFSET)?,
            replicas,
            server_dead_after_ms: UP_SERVER_DEAD_AFTER_MS,
            ..MetaConfig::default()
        }]
    } else {
        peers
            .iter()
            .map(|peer| {
                let index = (peer.id - 1) as u32;
                let metrics_offset = if index == 0 {
                    META_METRICS_PORT_OFFSET
                } else {
                    REPLICA_METRICS_PORT_OFFSET + index
                };
                Ok(MetaConfig {
                    listen_address: peer.address.clone(),
                    data_dir: data.join(format!("meta-{}", peer.id)),
                    metrics_address: metrics_at(metrics_offset)?,
                    replicas,
                    node_id: peer.id,
                    peers: peers.clone(),
                    server_dead_after_ms: UP_SERVER_DEAD_AFTER_MS,
                    ..MetaConfig::default()
                })
            })
            .collect::<anyhow::Result<Vec<MetaConfig>>>()?
    };
    let io_configs = (0..io_server_count)
        .map(|server_id| {
            let data_dir = data.join(format!("io-{server_id}"));
            // Every client of `up` is on this host: the data path needs no TCP/IP. A data
            // directory too deep for a socket path keeps TCP.
            let socket = data_dir.join("io.sock");
            let unix_socket = (unix_sockets && socket.as_os_str().len() <= 107).then_some(socket);
            Ok(IoConfig {
                server_id,
                listen_address: loopback_port(port, 10 + server_id)?,
                advertise_address: unix_socket
                    .as_ref()
                    .map(|path| format!("unix:{}", path.display())),
                unix_socket,
                data_dir,
                meta_address: meta_address.clone(),
                engine,
                metrics_address: metrics_at(IO_METRICS_PORT_OFFSET + server_id)?,
                direct_io,
                ..IoConfig::default()
            })
        })
        .collect::<anyhow::Result<Vec<IoConfig>>>()?;
    write_configs(&data, &meta_configs, &io_configs, &meta_address)?;

    let meta = MetaServers::start(meta_configs, &key).await?;
    let mut io_servers = Vec::new();
    for config in io_configs {
        let (server_id, listen, directory, socket) = (
            config.server_id,
            config.listen_address.clone(),
            config.data_dir.clone(),
            config.unix_socket.clone(),
        );
        let server = match freeflow_ioserver::start(config, key.clone()).await {
            Ok(server) => server,
            Err(error) => {
                for server in io_servers {
                    freeflow_ioserver::RunningIo::shutdown(server).await;
                }
                meta.shutdown().await;
                return Err(error).with_context(|| {
                    format!("I/O server {server_id} failed to start on {listen}")
                });
            }
        };
        println!(
            "I/O server {server_id:<4}    {}  engine {}  (data {})",
            server.listen_address(),
            server.engine_name(),
            directory.display()
        );
        if let Some(socket) = socket {
            println!("  clients use    unix:{}", socket.display());
        }
        if let Some(address) = server.metrics_address() {
            println!("  metrics        http://{address}/metrics");
        }
        io_servers.push(server);
    }
    let client_file = data.join("client.toml");
    wait_for_registration(&client_file, io_server_count).await;
    println!("cluster file     {}", client_file.display());
    println!("try: freeflow --cluster {} status", client_file.display());
    println!("     freeflow --cluster {} top", client_file.display());
    let mounted = match &mountpoint {
        Some(mountpoint) => match super::mount::mount_cluster(
            &client_file,
            mountpoint,
            super::mount::Options {
                metrics_address: metrics_at(MOUNT_METRICS_PORT_OFFSET)?,
                ..mount_options
            },
        )
        .await
        {
            Ok(mounted) => {
                println!("mounted on       {}", mountpoint.display());
                if let Some(address) = mounted.metrics_address() {
                    println!("  metrics        http://{address}/metrics");
                }
                Some(mounted)
            }
            Err(error) => {
                for server in io_servers {
                    server.shutdown().await;
                }
                meta.shutdown().await;
                return Err(error);
            }
        },
        None => None,
    };
    println!("Freeflow is up. Press Ctrl-C to stop.");

    super::shutdown_signal().await?;
    println!("stopping");
    if let Some(mounted) = mounted {
        if let Err(error) = mounted.unmount().await {
            eprintln!("freeflow: {error:#}");
        }
    }
    for server in io_servers {
        server.shutdown().await;
    }
    meta.shutdown().await;
    println!("stopped");
    Ok(())
}

fn load_or_create_key(path: &Path) -> anyhow::Result<ClusterKey> {
    if path.exists() {
        return cluster_file::load_key(path, path);
    }
    let key = ClusterKey::generate().context("no randomness for a cluster key")?;
    key.write_new(path)
        .with_context(|| format!("cannot write cluster key {}", path.display()))?;
    Ok(key)
}

/// The metadata service `up` runs: one server, or the members of a replicated cluster.
enum MetaServers {
    Single(freeflow_meta::RunningMeta),
    Replicated(Vec<ReplicatedMeta>),
}

/// How long `up` waits for a replicated cluster to elect its first leader.
const ELECTION_WAIT_MS: u64 = 20_000;

impl MetaServers {
    async fn start(configs: Vec<MetaConfig>, key: &ClusterKey) -> anyhow::Result<MetaServers> {
        if configs.len() == 1 && configs[0].node_id == 0 {
            let config = configs.into_iter().next().expect("one config");
            let (address, directory) = (config.listen_address.clone(), config.data_dir.clone());
            let meta = freeflow_meta::start(config, key.clone())
                .await
                .with_context(|| format!("metadata server failed to start on {address}"))?;
            println!(
                "metadata server  {}  ready in {} ms, {} inodes  (data {})",
                meta.listen_address(),
                meta.ready_ms(),
                meta.inode_count(),
                directory.display()
            );
            if let Some(address) = meta.metrics_address() {
                println!("  metrics        http://{address}/metrics");
            }
            return Ok(MetaServers::Single(meta));
        }
        // All members at once: one started alone asks the others for votes before they
        // listen, and its Raft logs every refused connection as an error.
        let described: Vec<(u64, String, PathBuf, Option<String>)> = configs
            .iter()
            .map(|config| {
                (
                    config.node_id,
                    config.listen_address.clone(),
                    config.data_dir.clone(),
                    config.metrics_address.clone(),
                )
            })
            .collect();
        let started = futures::future::join_all(
            configs
                .into_iter()
                .map(|config| start_replicated(config, key.clone())),
        )
        .await;
        let mut members = Vec::new();
        let mut failure = None;
        for ((id, address, _, _), outcome) in described.iter().zip(started) {
            match outcome {
                Ok(member) => members.push(member),
                Err(error) if failure.is_none() => {
                    failure = Some(Err(error).with_context(|| {
                        format!("metadata server {id} failed to start on {address}")
                    }))
                }
                Err(_) => {}
            }
        }
        if let Some(failure) = failure {
            for member in members {
                member.shutdown().await;
            }
            return failure;
        }
        for (id, address, directory, metrics) in &described {
            println!(
                "metadata server {id}  {address}  (data {})",
                directory.display()
            );
            if let Some(address) = metrics {
                println!("  metrics        http://{address}/metrics (while it leads)");
            }
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(ELECTION_WAIT_MS) {
            if let Some(Role::Leading { term }) = members
                .iter()
                .map(ReplicatedMeta::role)
                .find(|role| matches!(role, Role::Leading { .. }))
            {
                println!(
                    "metadata leader  elected in {} ms (term {term})",
                    started.elapsed().as_millis()
                );
                return Ok(MetaServers::Replicated(members));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!("freeflow: no metadata leader elected yet; going on");
        Ok(MetaServers::Replicated(members))
    }

    async fn shutdown(self) {
        match self {
            MetaServers::Single(meta) => meta.shutdown().await,
            MetaServers::Replicated(mut members) => {
                // The leader first, so that it does not replicate to members already gone
                // (its Raft logs each failed attempt as an error); the followers then stop
                // well within an election timeout, before any asks for votes.
                if let Some(leading) = members
                    .iter()
                    .position(|member| matches!(member.role(), Role::Leading { .. }))
                {
                    members.swap(0, leading);
                }
                for member in members {
                    member.shutdown().await;
                }
            }
        }
    }
}

/// Configs for the same cluster as separate processes, and the client file for tools:
/// `meta.toml`, or `meta-1.toml`... for the members of a replicated cluster.
fn write_configs(
    data: &Path,
    metas: &[MetaConfig],
    io: &[IoConfig],
    meta_address: &str,
) -> anyhow::Result<()> {
    let key_file = PathBuf::from("cluster.key");
    let relative = |path: &Path| {
        path.strip_prefix(data)
            .map(Path::to_owned)
            .unwrap_or_else(|_| path.to_owned())
    };
    for meta in metas {
        let mut meta = meta.clone();
        meta.data_dir = relative(&meta.data_dir);
        let name = if meta.node_id == 0 {
            "meta.toml".to_string()
        } else {
            format!("meta-{}.toml", meta.node_id)
        };
        cluster_file::write(
            &data.join(name),
            &MetaFile {
                key_file: key_file.clone(),
                meta,
            },
            true,
        )?;
    }
    for config in io {
        let mut config = config.clone();
        config.data_dir = relative(&config.data_dir);
        let path = data.join(format!("io-{}.toml", config.server_id));
        cluster_file::write(
            &path,
            &IoFile {
                key_file: key_file.clone(),
                io: config,
            },
            true,
        )?;
    }
    let client = ClientFile {
        meta_address: meta_address.to_owned(),
        key_file,
        call_timeout_ms: 30_000,
    };
    cluster_file::write(&data.join("client.toml"), &client, true)
}

/// Wait until the metadata server lists every I/O server as up, so that a `freeflow cp`
/// started right after `up` prints its banner finds them.
async fn wait_for_registration(client_file: &Path, expected: u32) {
    let started = Instant::now();
    let client = match cluster_file::connect(Some(client_file.to_owned())).await {
        Ok(client) => client,
        Err(error) => {
            tracing::warn!("cannot check registration: {error:#}");
            return;
        }
    };
    while started.elapsed() < Duration::from_millis(REGISTRATION_WAIT_MS) {
        if let Ok(servers) = client.servers().await {
            if servers.iter().filter(|server| server.up).count() as u32 >= expected {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    client.shutdown().await;
}
