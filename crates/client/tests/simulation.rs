//! Replicated metadata and replicated data under a simulated network and clock (turmoil;
//! issue 11, DESIGN.md §10). Three real meta servers (`start_replicated`: Raft, the
//! writer, undo records, the supervisor's step-down), three real I/O servers keeping two
//! copies of every stripe (chains, the service map, the resync) and two real library
//! clients run as simulated hosts; a seed draws the faults: a meta member crashed and
//! restarted (the leader most often), the leader cut off from the other members, a client
//! cut off from the leader, messages between two members held back and then let through, a
//! member's disk lost (it comes back under a new id and an admin client replaces the old
//! one in the membership: remove, add as a learner, promote once caught up),
//! an I/O server crashed and restarted or cut off from every other host, and latency on
//! every message. Each seed also changes the I/O servers once (issue 42), as drawn: one is
//! lost for good (crashed, never back: after `server_dead_after_ms` it is replaced and its
//! stripes are copied again from the survivors), or drained and removed by an admin client
//! (`ChangeIoServer`), or a fourth one joins; the faults go on meanwhile.
//!
//! Checked after every step of the simulation: no two members lead the same term, and no
//! client call fails (a failover is at most a pause). At the end, with the faults healed
//! and every I/O server still in the cluster back in service and nothing moving: every
//! change a client was answered is there (each name created, renamed or removed as
//! answered, each file's bytes as written and the two copies of each stripe, in its chain
//! as the service map makes it, identical on disk), and once the members have applied the same entry their
//! replicated state is identical. A failure names its seed; `FREEFLOW_SIM_SEED=N` runs that
//! one alone, and `FREEFLOW_SIM_SEEDS=K` runs K seeds (a soak; the test suite runs a few),
//! from `FREEFLOW_SIM_FIRST` (1). `FREEFLOW_SIM_OVERLAP_IO=1` lets a second I/O server fail
//! before the first is back in service (beyond the one-failure promise; docs/replication.md).
//!
//! The seed fixes the faults, their timing and every message's latency. It does not fix
//! everything: openraft draws election timeouts from its own random source, and the meta
//! writer, the I/O engines and the stores' fsyncs run on threads of their own, so a failing
//! seed reproduces its faults but not always the exact interleaving.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use freeflow_client::{Client, ClientConfig, ClientError, OpenOptions};
use freeflow_ioserver::{EngineKind, IoConfig};
use freeflow_meta::raft::supervisor::{start_replicated, ReplicatedMeta, Role};
use freeflow_meta::{MetaConfig, MetaPeer};
use freeflow_proto::meta::{MemberState, RenameMode};
use freeflow_rpc::net::{Accept, AcceptFuture, BindFuture, Listener, SimulatedNetwork};
use freeflow_rpc::{ClusterKey, ConnectFuture, ReadHalf, Transport, WriteHalf};
use freeflow_types::ROOT_INODE;

const MEMBERS: usize = 3;
const CLIENT_PORT: u16 = 7000;
const RAFT_PORT: u16 = 7074;
/// I/O servers, keeping two copies of every stripe.
const IO_SERVERS: usize = 3;
/// The I/O server that may join during a seed (`IoChange::Join`), on host `i4`.
const IO_JOINING: usize = 3;
const IO_PORT: u16 = 7100;
/// Simulated time the clients make changes for (faults come and go meanwhile).
const WORK_FOR: Duration = Duration::from_secs(20);
/// A client's pause between two changes.
const THINK: Duration = Duration::from_millis(20);
/// Seeds the test suite runs.
const SEEDS_IN_SUITE: u64 = 8;

// ---- turmoil's network behind Freeflow's RPC layer ----

struct TurmoilListener(turmoil::net::TcpListener);

impl Accept for TurmoilListener {
    fn accept(&self) -> AcceptFuture<'_> {
        Box::pin(async move {
            let (stream, address) = self.0.accept().await?;
            let (read, write) = stream.into_split();
            Ok((
                Box::new(read) as ReadHalf,
                Box::new(write) as WriteHalf,
                address.to_string(),
            ))
        })
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

struct TurmoilNetwork;

impl Transport for TurmoilNetwork {
    fn connect<'a>(&'a self, address: &'a str) -> ConnectFuture<'a> {
        Box::pin(async move {
            let stream = turmoil::net::TcpStream::connect(address).await?;
            let (read, write) = stream.into_split();
            Ok((Box::new(read) as ReadHalf, Box::new(write) as WriteHalf))
        })
    }
}

impl SimulatedNetwork for TurmoilNetwork {
    fn bind<'a>(&'a self, address: &'a str) -> BindFuture<'a> {
        Box::pin(async move {
            // A host listens on all its addresses; the name before the port is its own.
            let port: u16 = address
                .rsplit_once(':')
                .and_then(|(_, port)| port.parse().ok())
                .ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("{address:?} is not host:port"),
                    )
                })?;
            let listener = turmoil::net::TcpListener::bind(("0.0.0.0", port)).await?;
            Ok(Box::new(TurmoilListener(listener)) as Listener)
        })
    }
}

// ---- the seed's choices ----

/// splitmix64: a small generator whose whole state is the seed.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low))
    }
}

fn io_host(index: usize) -> String {
    format!("i{}", index + 1)
}

fn member(index: usize) -> String {
    format!("m{}", index + 1)
}

/// A fault in force, and how to end it.
#[derive(Debug)]
enum Fault {
    Crashed(usize),
    /// Crashed with its data lost; it comes back under a new node id (`join`), and the
    /// admin client takes the old id out and the new one in (`replace_members`).
    Replaced(usize),
    LeaderCutOff(usize),
    ClientCutOff(usize),
    Held(usize, usize),
    IoCrashed(usize),
    IoCutOff(usize),
}

// ---- what the clients were answered ----

/// The state of one name as the last answered change left it.
#[derive(Clone, Debug, PartialEq)]
enum Expected {
    Directory,
    Symlink(String),
    /// A regular file of this many bytes, `file_bytes(name, length)`, fsynced and closed.
    File(usize),
    Absent,
}

/// The bytes of file `name`: a function of the name and the length.
fn file_bytes(name: &str, length: usize) -> Vec<u8> {
    let mut draw = Draw(name.bytes().fold(length as u64, |hash, byte| {
        hash.wrapping_mul(0x100_0000_01b3) ^ u64::from(byte)
    }));
    let mut bytes = Vec::with_capacity(length + 8);
    while bytes.len() < length {
        bytes.extend_from_slice(&draw.next().to_le_bytes());
    }
    bytes.truncate(length);
    bytes
}

/// Write `name` in the root whole, fsync it and close it.
async fn write_file(client: &Client, name: &str, length: usize) -> Result<(), ClientError> {
    let handle = client
        .open_path(
            &format!("/{name}"),
            &OpenOptions::new().write(true).create(true),
        )
        .await?;
    handle
        .write_at(0, bytes::Bytes::from(file_bytes(name, length)))
        .await?;
    handle.fsync().await?;
    handle.close().await
}

#[derive(Default)]
struct Answers {
    names: BTreeMap<String, Expected>,
    failures: Vec<String>,
    done: usize,
    verified: Option<Result<usize, String>>,
}

fn client_config(key: &ClusterKey, name: &str) -> ClientConfig {
    let addresses: Vec<String> = (0..MEMBERS)
        .map(|index| format!("{}:{CLIENT_PORT}", member(index)))
        .collect();
    let mut config = ClientConfig::new(addresses.join(","), key.clone());
    config.client_name = name.to_string();
    // Longer than any fault the schedule leaves in force: a call that fails is an error
    // the application would have seen.
    config.call_timeout_ms = 60_000;
    config.connect_timeout_ms = 500;
    config
}

/// One client's changes: directories made, some renamed, some removed, symlinks; each
/// answer recorded as the name's expected state.
async fn work(key: ClusterKey, prefix: char, answers: Rc<RefCell<Answers>>) {
    let client = match Client::connect(client_config(&key, &format!("client-{prefix}"))).await {
        Ok(client) => client,
        Err(error) => {
            let mut answers = answers.borrow_mut();
            answers
                .failures
                .push(format!("client {prefix}: connect: {error}"));
            answers.done += 1;
            return;
        }
    };
    let mut made: Vec<String> = Vec::new();
    let until = tokio::time::Instant::now() + WORK_FOR;
    let mut step = 0;
    while tokio::time::Instant::now() < until {
        step += 1;
        tokio::time::sleep(THINK).await;
        let (result, changes) = if step % 5 == 3 && !made.is_empty() {
            let from = made.remove(0);
            let to = format!("{prefix}-renamed-{step}");
            let result = client
                .rename(ROOT_INODE, &from, ROOT_INODE, &to, RenameMode::Replace)
                .await;
            made.push(to.clone());
            (
                result.map(|_| ()),
                vec![(from, Expected::Absent), (to, Expected::Directory)],
            )
        } else if step % 7 == 6 && !made.is_empty() {
            let gone = made.remove(made.len() / 2);
            let result = client.rmdir(ROOT_INODE, &gone).await;
            (result, vec![(gone, Expected::Absent)])
        } else if step % 3 == 2 {
            let name = format!("{prefix}-file-{step}");
            let length = 20_000 + (step * 7_919) % 180_000;
            let result = write_file(&client, &name, length).await;
            (result, vec![(name, Expected::File(length))])
        } else if step % 4 == 1 {
            let name = format!("{prefix}-link-{step}");
            let target = format!("target of {name}");
            let result = client.symlink(ROOT_INODE, &name, &target).await;
            (result.map(|_| ()), vec![(name, Expected::Symlink(target))])
        } else {
            let name = format!("{prefix}-dir-{step}");
            let result = client.mkdir(ROOT_INODE, &name, 0o755).await;
            made.push(name.clone());
            (result.map(|_| ()), vec![(name, Expected::Directory)])
        };
        let mut answers = answers.borrow_mut();
        match result {
            Ok(()) => answers.names.extend(changes),
            Err(error) => {
                answers.failures.push(format!(
                    "client {prefix}, change {step} ({changes:?}): {error}"
                ));
                break;
            }
        }
    }
    client.shutdown().await;
    answers.borrow_mut().done += 1;
}

/// Keep `IO_IN_SERVICE` current while the clients work (a client of its own).
async fn watch_io_servers(key: ClusterKey) {
    let Ok(client) = Client::connect(client_config(&key, "watcher")).await else {
        return;
    };
    loop {
        if let Ok(report) = client.cluster_status().await {
            let live = io_live_servers();
            let in_service = report
                .servers
                .iter()
                .filter(|server| {
                    server.state == MemberState::InService
                        && live.contains(&(server.server_id as usize))
                })
                .count();
            // Copies on their way count as a failure not over yet.
            let moving = report.replacements.iter().any(|replacement| {
                !replacement.filling.is_empty() || (replacement.drain && !replacement.complete)
            });
            IO_IN_SERVICE.with(|count| count.set(if moving { 0 } else { in_service }));
            if let Some(IoChange::Lost(index)) = IO_CHANGE.with(|change| change.get()) {
                let replaced = report
                    .replacements
                    .iter()
                    .any(|replacement| replacement.server == index as u32);
                LOST_REPLACED.with(|cell| cell.set(replaced));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// With the faults healed: every I/O server back in service, every answered change there
/// as a new client sees it, every file's bytes as written, and the two copies of each of
/// its stripes identical on disk.
async fn verify(
    key: ClusterKey,
    answers: Rc<RefCell<Answers>>,
    data: PathBuf,
) -> Result<usize, String> {
    let client = Client::connect(client_config(&key, "checker"))
        .await
        .map_err(|error| format!("checker: connect: {error}"))?;
    let until = tokio::time::Instant::now() + Duration::from_secs(120);
    let live = io_live();
    loop {
        let report = client.cluster_status().await.ok();
        let in_service = report.as_ref().map_or(0, |report| {
            report
                .servers
                .iter()
                .filter(|server| server.state == MemberState::InService)
                .count()
        });
        let moving = report.as_ref().is_none_or(|report| {
            report.replacements.iter().any(|replacement| {
                !replacement.filling.is_empty() || (replacement.drain && !replacement.complete)
            })
        });
        // A server lost for good must have been replaced too.
        let replaced = match IO_CHANGE.with(|change| change.get()) {
            Some(IoChange::Lost(index)) => report.as_ref().is_some_and(|report| {
                report
                    .replacements
                    .iter()
                    .any(|replacement| replacement.server == index as u32)
            }),
            _ => true,
        };
        if in_service == live && !moving && replaced {
            break;
        }
        if tokio::time::Instant::now() > until {
            return Err(format!(
                "the I/O servers are not all back in service ({live} expected) or copies still move: {:?}",
                report.map(|report| (
                    report
                        .servers
                        .iter()
                        .map(|server| (server.server_id, server.state))
                        .collect::<Vec<_>>(),
                    report.replacements
                ))
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let expected = answers.borrow().names.clone();
    for (name, state) in &expected {
        let found = client.lookup(ROOT_INODE, name).await;
        let seen = match found {
            Ok(attr) => match attr.kind {
                freeflow_types::FileKind::Directory => Expected::Directory,
                freeflow_types::FileKind::Symlink => Expected::Symlink(
                    client
                        .readlink(attr.inode)
                        .await
                        .map_err(|error| format!("readlink {name}: {error}"))?,
                ),
                freeflow_types::FileKind::Regular => {
                    check_file(&client, name, &data).await?;
                    Expected::File(attr.size_bytes as usize)
                }
                other => return Err(format!("{name} is a {other:?}")),
            },
            Err(error) if error.code() == freeflow_client::ErrorCode::NotFound => Expected::Absent,
            Err(error) => return Err(format!("lookup {name}: {error}")),
        };
        if &seen != state {
            return Err(format!(
                "{name}: answered {state:?}, found {seen:?} after the faults"
            ));
        }
    }
    client.shutdown().await;
    Ok(expected.len())
}

/// File `name` reads back as written, and its copies are identical on disk.
async fn check_file(client: &Client, name: &str, data: &Path) -> Result<(), String> {
    let path = format!("/{name}");
    let attr = client
        .stat(&path)
        .await
        .map_err(|error| format!("stat {name}: {error}"))?;
    let handle = client
        .open_path(&path, &OpenOptions::new().read(true))
        .await
        .map_err(|error| format!("open {name}: {error}"))?;
    let bytes = handle
        .read_at(0, attr.size_bytes + 1)
        .await
        .map_err(|error| format!("read {name}: {error}"))?;
    let _ = handle.close().await;
    if bytes[..] != file_bytes(name, attr.size_bytes as usize)[..] {
        return Err(format!(
            "{name}: {} bytes read back differ from those written",
            bytes.len()
        ));
    }
    let layout = attr.layout.ok_or_else(|| format!("{name} has no layout"))?;
    if layout.replicas() != 2 {
        return Err(format!("{name}: {} copies, not 2", layout.replicas()));
    }
    let map = client
        .service_map()
        .await
        .map_err(|error| format!("service map: {error}"))?;
    for stripe in 0..layout.stripe_count() {
        let object = freeflow_types::ObjectId {
            inode: attr.inode,
            stripe_index: stripe,
        };
        let chain: Vec<u32> = map
            .chain(object, &layout.chain(stripe))
            .iter()
            .map(|member| member.server)
            .collect();
        if chain.len() != 2 || chain.iter().any(|server| gone_io(*server as usize)) {
            return Err(format!(
                "{name} stripe {stripe}: its chain is {chain:?} (layout {:?})",
                layout.chain(stripe)
            ));
        }
        let copies: Vec<Vec<u8>> = chain
            .iter()
            .map(|server| {
                let object = data
                    .join(format!("io-{server}"))
                    .join("objects")
                    .join(format!("{:02x}", attr.inode % 256))
                    .join(format!("{:016x}.{stripe}", attr.inode));
                std::fs::read(object).unwrap_or_default()
            })
            .collect();
        if copies.iter().any(|copy| copy != &copies[0]) {
            return Err(format!(
                "{name} stripe {stripe}: copies on servers {chain:?} differ ({:?} bytes)",
                copies.iter().map(Vec::len).collect::<Vec<_>>()
            ));
        }
    }
    Ok(())
}

// ---- the simulation ----

fn io_config(index: usize, data: &Path) -> IoConfig {
    let meta: Vec<String> = (0..MEMBERS)
        .map(|member_index| format!("{}:{CLIENT_PORT}", member(member_index)))
        .collect();
    IoConfig {
        server_id: index as u32,
        listen_address: format!("{}:{IO_PORT}", io_host(index)),
        advertise_address: Some(format!("{}:{IO_PORT}", io_host(index))),
        data_dir: data.join(format!("io-{index}")),
        meta_address: meta.join(","),
        engine: EngineKind::Threads,
        buffer_count: 8,
        worker_threads: 2,
        register_backoff_max_ms: 500,
        ..IoConfig::default()
    }
}

/// Member `index`'s config; `ids` are the members' node ids by host now (a member whose
/// disk was lost comes back under a new id, `join`ing: `Fault::Replaced`).
fn meta_config(index: usize, data: &Path, ids: &[u64]) -> MetaConfig {
    let peers: Vec<MetaPeer> = (0..MEMBERS)
        .map(|peer| MetaPeer {
            id: ids[peer],
            address: format!("{}:{CLIENT_PORT}", member(peer)),
            raft_address: format!("{}:{RAFT_PORT}", member(peer)),
        })
        .collect();
    MetaConfig {
        listen_address: peers[index].address.clone(),
        data_dir: data.join(member(index)),
        metrics_address: None,
        node_id: ids[index],
        join: ids[index] > MEMBERS as u64,
        peers,
        raft_heartbeat_ms: 100,
        raft_election_ms: 300,
        // Snapshots often, and a short log behind them: a member back from a crash is
        // often further behind than the log reaches and must install a snapshot.
        raft_snapshot_entries: 64,
        raft_log_kept_entries: 16,
        // As short as a replicated server takes (a failover waits little for clients
        // that are gone): faults here come every few seconds.
        recovery_window_ms: freeflow_meta::RECOVERY_WINDOW_REPLICATED_MIN_MS,
        cache_lease_ms: 2_000,
        // Two copies of every stripe; a silent I/O server is put out soon.
        replicas: 2,
        stripe_unit_bytes: 64 << 10,
        server_down_after_ms: 2_000,
        // A server out this long is lost for good (`IoChange::Lost`): replaced.
        server_dead_after_ms: 5_000,
        heartbeat_interval_ms: 500,
        ..MetaConfig::default()
    }
}

type Members = Rc<RefCell<Vec<Option<ReplicatedMeta>>>>;

/// I/O server `index` as a simulated host (started again after a crash, on its data).
fn host_io(sim: &mut turmoil::Sim, index: usize, data: &Path, key: &ClusterKey) {
    let config = io_config(index, data);
    let key = key.clone();
    sim.host(io_host(index), move || {
        let (config, key) = (config.clone(), key.clone());
        async move {
            // A crashed instance's engine threads may hold the directory a moment.
            let mut tries = 0;
            let _server = loop {
                match freeflow_ioserver::start(config.clone(), key.clone()).await {
                    Ok(server) => break server,
                    Err(error) if tries < 100 => {
                        tries += 1;
                        tracing::debug!(%error, "I/O server start failed; again");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(error) => return Err(error.to_string().into()),
                }
            };
            std::future::pending::<()>().await;
            Ok(())
        }
    });
}

/// The change of the I/O servers a seed makes once (issue 42).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IoChange {
    /// Crashed and never back: replaced after `server_dead_after_ms`.
    Lost(usize),
    /// Drained, then removed and stopped, by the admin client.
    Drained(usize),
    /// A fourth server joins.
    Join,
}

/// The I/O servers in the cluster now (not lost, drained or removed), with the one that
/// joined.
fn io_live_servers() -> Vec<usize> {
    let change = IO_CHANGE.with(|change| change.get());
    let mut live: Vec<usize> = (0..IO_SERVERS).filter(|index| !gone_io(*index)).collect();
    if change == Some(IoChange::Join) {
        live.push(IO_JOINING);
    }
    live
}

fn io_live() -> usize {
    io_live_servers().len()
}

/// Whether I/O server `index` left the cluster (lost for good, or drained).
fn gone_io(index: usize) -> bool {
    matches!(
        IO_CHANGE.with(|change| change.get()),
        Some(IoChange::Lost(gone) | IoChange::Drained(gone)) if gone == index
    )
}

struct Outcome {
    names: usize,
    /// Of them, files whose bytes and copies were checked.
    files: usize,
    faults: usize,
    leaders: usize,
    simulated: Duration,
    io_change: Option<IoChange>,
}

fn run_seed(seed: u64) -> Result<Outcome, String> {
    let dir = tempfile::tempdir().map_err(|error| error.to_string())?;
    let key = ClusterKey::generate().map_err(|error| error.to_string())?;
    freeflow_rpc::net::simulate_on_this_thread(Some(Arc::new(TurmoilNetwork)));
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(600))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_micros(200))
        .max_message_latency(Duration::from_millis(15))
        .enable_random_order()
        .build();
    let members: Members = Rc::new(RefCell::new((0..MEMBERS).map(|_| None).collect()));
    let ids: Rc<RefCell<Vec<u64>>> = Rc::new(RefCell::new((1..=MEMBERS as u64).collect()));
    for index in 0..MEMBERS {
        let (key, members, ids) = (key.clone(), members.clone(), ids.clone());
        let data = dir.path().to_path_buf();
        sim.host(member(index), move || {
            let config = meta_config(index, &data, &ids.borrow());
            let (key, members) = (key.clone(), members.clone());
            async move {
                // A crashed instance's writer thread may hold the store a moment longer.
                let mut tries = 0;
                let meta = loop {
                    match start_replicated(config.clone(), key.clone()).await {
                        Ok(meta) => break meta,
                        Err(error) if tries < 100 => {
                            tries += 1;
                            tracing::debug!(%error, "member start failed; again");
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(error) => return Err(error.to_string().into()),
                    }
                };
                members.borrow_mut()[index] = Some(meta);
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    for index in 0..IO_SERVERS {
        host_io(&mut sim, index, dir.path(), &key);
    }
    let answers = Rc::new(RefCell::new(Answers::default()));
    {
        let (key, answers) = (key.clone(), answers.clone());
        let data = dir.path().to_path_buf();
        sim.client("client", async move {
            // Let the members elect a first leader.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let local = tokio::task::LocalSet::new();
            local
                .run_until(async {
                    let watcher = tokio::task::spawn_local(watch_io_servers(key.clone()));
                    let a = tokio::task::spawn_local(work(key.clone(), 'a', answers.clone()));
                    let b = tokio::task::spawn_local(work(key.clone(), 'b', answers.clone()));
                    let _ = a.await;
                    let _ = b.await;
                    watcher.abort();
                })
                .await;
            // Wait for the schedule to heal everything, then check.
            while healing_pending() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            tracing::info!("faults healed; checking every answer");
            let verified = verify(key.clone(), answers.clone(), data).await;
            tracing::info!(ok = verified.is_ok(), "checked");
            answers.borrow_mut().verified = Some(verified);
            Ok(())
        });
    }

    {
        let key = key.clone();
        sim.client("admin", async move {
            replace_members(key).await;
            Ok(())
        });
    }

    let mut draw = Draw(seed ^ 0x5eed);
    let mut fault: Option<Fault> = None;
    let mut faults = 0;
    let mut next_change = Duration::from_secs(3);
    let mut leaders_by_term: BTreeMap<u64, usize> = BTreeMap::new();
    loop {
        let finished = sim.step().map_err(|error| format!("simulation: {error}"))?;
        let now = sim.elapsed();
        // Election safety: one leader per term, ever.
        for (index, slot) in members.borrow().iter().enumerate() {
            if let Some(Role::Leading { term }) = slot.as_ref().map(ReplicatedMeta::role) {
                let first = *leaders_by_term.entry(term).or_insert(index);
                if first != index {
                    return Err(format!(
                        "members {} and {} both led term {term} (at {now:?})",
                        member(first),
                        member(index)
                    ));
                }
            }
        }
        // No client call fails: a failover is a pause.
        if let Some(failure) = answers.borrow().failures.first() {
            return Err(format!("a client call failed at {now:?}: {failure}"));
        }
        if finished {
            break;
        }
        if DRAIN_REMOVED.with(|removed| removed.replace(false)) {
            if let Some(IoChange::Drained(index)) = IO_CHANGE.with(|change| change.get()) {
                tracing::info!(index, "drained I/O server removed: stopped");
                sim.crash(io_host(index));
            }
        }
        let working = answers.borrow().done < 2;
        // A lost server's wait (`server_dead_after_ms`) runs on the leader's clock, which
        // a leader change starts again (the wall clock the meta server also counts by does
        // not move with simulated time): no new fault until it is replaced.
        let waiting_for_loss = matches!(
            IO_CHANGE.with(|change| change.get()),
            Some(IoChange::Lost(_))
        ) && !LOST_REPLACED.with(|replaced| replaced.get());
        let replacing =
            REPLACEMENT.with(|job| job.borrow().is_some()) || (waiting_for_loss && fault.is_none());
        if now >= next_change && !replacing {
            if let Some(ended) = fault.take() {
                heal(&mut sim, &members, &ids, dir.path(), ended);
                next_change = now + draw.millis(300, 1_500);
            } else if working {
                let leader = leader_of(&members);
                let (chosen, lasting) = if faults == 0 {
                    // First, a follower away long enough to fall behind the log's reach:
                    // it comes back by installing a snapshot.
                    let follower = leader.map_or(0, |leader| (leader + 1) % MEMBERS);
                    (Fault::Crashed(follower), Duration::from_secs(4))
                } else if faults == 1 {
                    // Then a member (the leader or not, as drawn) loses its disk and comes
                    // back under a new id: the admin client replaces it.
                    let lost = draw.below(MEMBERS as u64) as usize;
                    (Fault::Replaced(lost), draw.millis(300, 2_000))
                } else if faults == 2 {
                    // Then the I/O servers change once, as drawn.
                    let index = draw.below(IO_SERVERS as u64) as usize;
                    let change = match draw.below(3) {
                        0 => IoChange::Lost(index),
                        1 => IoChange::Drained(index),
                        _ => IoChange::Join,
                    };
                    tracing::info!(?change, "I/O servers change");
                    IO_CHANGE.with(|cell| cell.set(Some(change)));
                    match change {
                        IoChange::Lost(index) => sim.crash(io_host(index)),
                        IoChange::Drained(_) => {}
                        IoChange::Join => host_io(&mut sim, IO_JOINING, dir.path(), &key),
                    }
                    faults += 1;
                    next_change = now + draw.millis(500, 2_000);
                    continue;
                } else {
                    let mut chosen = choose(&mut draw, leader);
                    // One I/O server failure at a time, as the promise says: another only
                    // once every I/O server is back in service (resynced).
                    // `FREEFLOW_SIM_OVERLAP_IO=1` lifts that (a soak of double failures).
                    // With a server lost or drained, two are left for two copies: one
                    // more failure would give new files one copy (beyond the promise).
                    let shrunk = io_live() < IO_SERVERS;
                    if matches!(chosen, Fault::IoCrashed(_) | Fault::IoCutOff(_))
                        && (shrunk
                            || (!overlapping_io_faults()
                                && IO_IN_SERVICE.with(|count| count.get()) < io_live()))
                    {
                        // A metadata fault instead, as drawn (always the leader's crash
                        // here kept the leaders changing so fast, once I/O faults were
                        // barred for good, that a fill never finished).
                        chosen = choose_meta(&mut draw, leader);
                    }
                    (chosen, draw.millis(300, 3_000))
                };
                inflict(&mut sim, &members, &chosen);
                fault = Some(chosen);
                faults += 1;
                next_change = now + lasting;
            } else {
                set_healing_pending(false);
                ADMIN_DONE.with(|done| done.set(true));
            }
        }
        if now > Duration::from_secs(400) {
            return Err(format!("not finished after {now:?} of simulated time"));
        }
    }
    match answers.borrow_mut().verified.take() {
        Some(Ok(_)) => {}
        Some(Err(error)) => return Err(error),
        None => return Err("the check did not run".into()),
    }
    // The members converge: once all have applied the same entry, they hold the same.
    let mut agreed = false;
    for _ in 0..10_000 {
        sim.step().map_err(|error| format!("simulation: {error}"))?;
        let digests: Vec<_> = members
            .borrow()
            .iter()
            .map(|slot| slot.as_ref().map(ReplicatedMeta::digest))
            .collect();
        let digests: Vec<_> = match digests.into_iter().collect::<Option<Vec<_>>>() {
            Some(digests) => digests
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| format!("digest: {error}"))?,
            None => continue,
        };
        if digests.iter().all(|digest| digest.0 == digests[0].0) {
            if digests.iter().any(|digest| digest != &digests[0]) {
                return Err(format!("replicas at the same entry differ: {digests:?}"));
            }
            if digests[0].1 == 0 {
                return Err("replicas hold nothing".into());
            }
            agreed = true;
            break;
        }
    }
    if !agreed {
        return Err("the members never applied the same entry".into());
    }
    let names = answers.borrow().names.len();
    // Not vacuous: the clients changed things, and the schedule did its work (the second
    // fault replaces a member).
    let replaced = REPLACED.with(|count| count.get());
    let io_change = IO_CHANGE.with(|change| change.get());
    if names == 0 || faults < 4 || replaced != 1 || io_change.is_none() {
        return Err(format!(
            "a seed that tested little: {names} names, {faults} faults, {replaced} members replaced, I/O change {io_change:?}"
        ));
    }
    let files = answers
        .borrow()
        .names
        .values()
        .filter(|state| matches!(state, Expected::File(_)))
        .count();
    let simulated = sim.elapsed();
    for index in 0..MEMBERS {
        sim.crash(member(index));
    }
    freeflow_rpc::net::simulate_on_this_thread(None);
    Ok(Outcome {
        names,
        files,
        faults,
        leaders: leaders_by_term.len(),
        simulated,
        io_change,
    })
}

thread_local! {
    /// A member replaced: (old id, new id, host index), until the admin client has made
    /// the change (`replace_members`).
    static REPLACEMENT: RefCell<Option<(u64, u64, usize)>> = const { RefCell::new(None) };
    /// No fault is left to come: the admin client ends.
    static ADMIN_DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Members replaced in this seed (the admin client's changes all made).
    static REPLACED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// I/O servers in service as the meta leader last said (`watch_io_servers`).
    static IO_IN_SERVICE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static HEALING_PENDING: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    /// The change of the I/O servers made in this seed (`IoChange`).
    static IO_CHANGE: std::cell::Cell<Option<IoChange>> = const { std::cell::Cell::new(None) };
    /// The admin client removed the drained server: the schedule stops it.
    static DRAIN_REMOVED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The server lost in this seed is replaced (`watch_io_servers`).
    static LOST_REPLACED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The admin client's drain is over (removed), or none was asked.
    static DRAIN_DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The operator of `Fault::Replaced`: once the member is back under its new id (on the old
/// one's address), it is added as a learner and takes the old one's vote once caught up, as
/// `freeflow meta replace` does. Each step is sent again until it is done (a leader
/// change may lose it); a step found done already counts.
async fn replace_members(key: ClusterKey) {
    use freeflow_proto::meta::MetaMemberChange;
    let Ok(client) = Client::connect(client_config(&key, "admin")).await else {
        return;
    };
    let again = || tokio::time::sleep(Duration::from_millis(200));
    while !ADMIN_DONE.with(|done| done.get()) || !DRAIN_DONE.with(|done| done.get()) {
        if let Some(IoChange::Drained(index)) = IO_CHANGE.with(|change| change.get()) {
            if !DRAIN_DONE.with(|done| done.get()) {
                drain_and_remove(&client, index as u32).await;
                DRAIN_DONE.with(|done| done.set(true));
                DRAIN_REMOVED.with(|removed| removed.set(true));
            }
        } else if ADMIN_DONE.with(|done| done.get()) {
            DRAIN_DONE.with(|done| done.set(true));
        }
        let Some((old, new, index)) = REPLACEMENT.with(|job| *job.borrow()) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let steps = [
            MetaMemberChange::AddLearner {
                id: new,
                address: format!("{}:{CLIENT_PORT}", member(index)),
                raft_address: format!("{}:{RAFT_PORT}", member(index)),
                replaces: Some(old),
            },
            MetaMemberChange::Replace { old, new },
        ];
        for step in steps {
            loop {
                match client.change_meta_members(step.clone()).await {
                    Ok(_) => break,
                    Err(error) => {
                        let text = error.to_string();
                        // Done already (a change resent after a leader change).
                        let done = text
                            .contains(&format!("member {new} is already in the cluster"))
                            || text.contains(&format!("member {new} votes already"))
                            || text.contains(&format!("member {old} is not a voter"));
                        if done {
                            break;
                        }
                        tracing::info!(?step, %error, "membership change not made yet");
                        again().await;
                    }
                }
            }
            tracing::info!(?step, "membership changed");
        }
        REPLACEMENT.with(|job| *job.borrow_mut() = None);
        REPLACED.with(|count| count.set(count.get() + 1));
    }
    client.shutdown().await;
}

/// The operator of `IoChange::Drained`: drain the server, wait until the drain is complete
/// and the server holds nothing, then remove it, as `freeflow server drain --wait` and
/// `freeflow server remove` do; each step sent again until done.
async fn drain_and_remove(client: &Client, server: u32) {
    use freeflow_proto::meta::IoServerChange;
    loop {
        match client.change_io_server(server, IoServerChange::Drain).await {
            Ok(_) => break,
            Err(error) if error.to_string().contains("drained already") => break,
            Err(error) => {
                tracing::info!(server, %error, "drain not started yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    loop {
        match client
            .change_io_server(server, IoServerChange::Remove { force: false })
            .await
        {
            Ok(_) => break,
            Err(error) if error.to_string().contains("removed already") => break,
            Err(error) => {
                tracing::debug!(server, %error, "not removed yet");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
    tracing::info!(server, "I/O server drained and removed");
}

/// Whether I/O faults may come while another I/O server is not back in service yet.
fn overlapping_io_faults() -> bool {
    std::env::var("FREEFLOW_SIM_OVERLAP_IO").is_ok_and(|value| value == "1")
}

fn healing_pending() -> bool {
    HEALING_PENDING.with(|pending| pending.get())
}

fn set_healing_pending(pending: bool) {
    HEALING_PENDING.with(|cell| cell.set(pending));
}

fn leader_of(members: &Members) -> Option<usize> {
    members.borrow().iter().position(|slot| {
        matches!(
            slot.as_ref().map(ReplicatedMeta::role),
            Some(Role::Leading { .. })
        )
    })
}

fn choose(draw: &mut Draw, leader: Option<usize>) -> Fault {
    let any_io = |draw: &mut Draw| {
        let live = io_live_servers();
        live[draw.below(live.len() as u64) as usize]
    };
    match draw.below(8) {
        6 => Fault::IoCrashed(any_io(draw)),
        7 => Fault::IoCutOff(any_io(draw)),
        _ => choose_meta(draw, leader),
    }
}

/// A fault of the metadata members or the client's link to them.
fn choose_meta(draw: &mut Draw, leader: Option<usize>) -> Fault {
    let any = |draw: &mut Draw| draw.below(MEMBERS as u64) as usize;
    match draw.below(6) {
        0 | 1 => Fault::Crashed(leader.unwrap_or_else(|| any(draw))),
        2 => Fault::Crashed(any(draw)),
        3 => Fault::LeaderCutOff(leader.unwrap_or_else(|| any(draw))),
        4 => Fault::ClientCutOff(leader.unwrap_or_else(|| any(draw))),
        _ => {
            let a = any(draw);
            Fault::Held(
                a,
                (a + 1 + draw.below(MEMBERS as u64 - 1) as usize) % MEMBERS,
            )
        }
    }
}

fn others(index: usize) -> impl Iterator<Item = usize> {
    (0..MEMBERS).filter(move |other| *other != index)
}

fn inflict(sim: &mut turmoil::Sim, members: &Members, fault: &Fault) {
    tracing::info!(?fault, "fault");
    match *fault {
        Fault::Crashed(index) | Fault::Replaced(index) => {
            members.borrow_mut()[index] = None;
            sim.crash(member(index));
        }
        Fault::LeaderCutOff(index) => {
            for other in others(index) {
                sim.partition(member(index), member(other));
            }
        }
        // turmoil drops a cut link's TCP segments for good (a real stream would send them
        // again), so the client's connection stalls: it must find that out (liveness).
        Fault::ClientCutOff(index) => sim.partition("client", member(index)),
        Fault::Held(a, b) => sim.hold(member(a), member(b)),
        Fault::IoCrashed(index) => sim.crash(io_host(index)),
        Fault::IoCutOff(index) => {
            for other in io_peers(index) {
                sim.partition(io_host(index), other);
            }
        }
    }
}

/// Every host but I/O server `index`.
fn io_peers(index: usize) -> Vec<String> {
    let mut peers: Vec<String> = (0..MEMBERS).map(member).collect();
    peers.extend(
        io_live_servers()
            .into_iter()
            .filter(|other| *other != index)
            .map(io_host),
    );
    peers.push("client".to_string());
    peers
}

fn heal(
    sim: &mut turmoil::Sim,
    members: &Members,
    ids: &RefCell<Vec<u64>>,
    data: &Path,
    fault: Fault,
) {
    tracing::info!(?fault, "healed");
    match fault {
        Fault::Crashed(index) => {
            members.borrow_mut()[index] = None;
            sim.bounce(member(index));
        }
        Fault::Replaced(index) => {
            members.borrow_mut()[index] = None;
            // The disk is gone (a crashed instance's threads may still hold a file open:
            // removing it leaves them nothing the new one sees).
            let _ = std::fs::remove_dir_all(data.join(member(index)));
            let old = ids.borrow()[index];
            let new = ids.borrow().iter().max().copied().unwrap_or(0) + 1;
            ids.borrow_mut()[index] = new;
            sim.bounce(member(index));
            REPLACEMENT.with(|job| *job.borrow_mut() = Some((old, new, index)));
        }
        Fault::LeaderCutOff(index) => {
            for other in others(index) {
                sim.repair(member(index), member(other));
            }
        }
        Fault::ClientCutOff(index) => sim.repair("client", member(index)),
        Fault::Held(a, b) => sim.release(member(a), member(b)),
        Fault::IoCrashed(index) => sim.bounce(io_host(index)),
        Fault::IoCutOff(index) => {
            for other in io_peers(index) {
                sim.repair(io_host(index), other);
            }
        }
    }
}

/// Log lines carry the simulated time.
struct SimulatedTime;

impl tracing_subscriber::fmt::time::FormatTime for SimulatedTime {
    fn format_time(
        &self,
        writer: &mut tracing_subscriber::fmt::format::Writer<'_>,
    ) -> std::fmt::Result {
        match turmoil::sim_elapsed() {
            Some(elapsed) => write!(writer, "{:>9.3}s", elapsed.as_secs_f64()),
            None => write!(writer, "        -"),
        }
    }
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("FREEFLOW_SIM_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
    {
        return vec![seed];
    }
    let count = std::env::var("FREEFLOW_SIM_SEEDS")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(SEEDS_IN_SUITE);
    let first = std::env::var("FREEFLOW_SIM_FIRST")
        .ok()
        .and_then(|first| first.parse().ok())
        .unwrap_or(1);
    (first..first + count).collect()
}

#[test]
fn replicated_metadata_keeps_every_answer_under_simulated_faults() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    // RUST_LOG=info shows the faults, elections and failovers of a seed.
    let log = tracing_subscriber::fmt::layer()
        .with_timer(SimulatedTime)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .with_filter(tracing_subscriber::EnvFilter::from_default_env());
    let count = CountSnapshots.with_filter(
        tracing_subscriber::filter::Targets::new()
            .with_target("freeflow_meta::raft::state_machine", tracing::Level::INFO),
    );
    let _ = tracing_subscriber::registry()
        .with(log)
        .with(count)
        .try_init();
    // A panic anywhere (a member's Raft task, a server task) is a failure of its seed, even
    // where the task's owner carries on.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        previous(info);
    }));
    let mut snapshots = 0;
    let mut failed = Vec::new();
    for seed in seeds() {
        let panics_before = PANICS.load(Ordering::Relaxed);
        set_healing_pending(true);
        IO_IN_SERVICE.with(|count| count.set(0));
        ADMIN_DONE.with(|done| done.set(false));
        REPLACEMENT.with(|job| *job.borrow_mut() = None);
        REPLACED.with(|count| count.set(0));
        IO_CHANGE.with(|change| change.set(None));
        LOST_REPLACED.with(|replaced| replaced.set(false));
        DRAIN_REMOVED.with(|removed| removed.set(false));
        DRAIN_DONE.with(|done| done.set(false));
        let started = std::time::Instant::now();
        let installed_before = SNAPSHOTS_INSTALLED.load(Ordering::Relaxed);
        match run_seed(seed) {
            Ok(_) if PANICS.load(Ordering::Relaxed) > panics_before => {
                freeflow_rpc::net::simulate_on_this_thread(None);
                let panics = PANICS.load(Ordering::Relaxed) - panics_before;
                eprintln!("seed {seed} FAILED: {panics} panics");
                failed.push(format!("seed {seed}: {panics} panics (above)"));
            }
            Ok(outcome) => {
                let installed = SNAPSHOTS_INSTALLED.load(Ordering::Relaxed) - installed_before;
                snapshots += installed;
                eprintln!(
                    "seed {seed}: {} names checked ({} files), {} faults, I/O servers {:?}, {} terms with a leader, {installed} snapshots installed, {:?} simulated in {:?}",
                    outcome.names,
                    outcome.files,
                    outcome.faults,
                    outcome.io_change,
                    outcome.leaders,
                    outcome.simulated,
                    started.elapsed()
                )
            }
            Err(violation) => {
                freeflow_rpc::net::simulate_on_this_thread(None);
                eprintln!("seed {seed} FAILED: {violation}");
                failed.push(format!("seed {seed}: {violation}"));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} seeds failed (run one alone: FREEFLOW_SIM_SEED=N RUST_LOG=info):\n{}",
        failed.len(),
        seeds().len(),
        failed.join("\n")
    );
    if seeds().len() >= SEEDS_IN_SUITE as usize {
        assert!(
            snapshots > 0,
            "no member installed a snapshot in any seed: the snapshot path went untested"
        );
    }
}

/// Snapshots installed by members, counted from their log events.
/// Panics seen by the hook `replicated_metadata_keeps_every_answer_under_simulated_faults` sets.
static PANICS: AtomicU64 = AtomicU64::new(0);

static SNAPSHOTS_INSTALLED: AtomicU64 = AtomicU64::new(0);

struct CountSnapshots;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountSnapshots {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _context: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Message(bool);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 |= format!("{value:?}").contains("installed a snapshot");
                }
            }
        }
        let mut message = Message(false);
        event.record(&mut message);
        if message.0 {
            SNAPSHOTS_INSTALLED.fetch_add(1, Ordering::Relaxed);
        }
    }
}
