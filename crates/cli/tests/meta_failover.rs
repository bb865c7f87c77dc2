//! Replicated metadata (issue 11), with real processes: three metadata servers run the
//! namespace under Raft and two I/O servers hold the data. While two clients create,
//! write, fsync and rename files, the leader is killed with SIGKILL; the other two elect a
//! new one and the clients go on without an error (a pause at most). Every operation the
//! clients were answered is there afterwards, byte for byte; the killed server comes back
//! as a follower and catches up; and all three replicas end identical (digests of their
//! replicated tables at the same applied entry).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::netswitch::NetSwitch;
use common::{free_port, poll_until, FREEFLOW};
use freeflow_client::{Client, ClientConfig, ClusterKey, OpenAccess, RenameMode, ROOT_INODE};

struct Node {
    id: u64,
    address: String,
    config: PathBuf,
    log: PathBuf,
    data: PathBuf,
    child: Option<Child>,
}

struct ReplicatedCluster {
    dir: tempfile::TempDir,
    key: ClusterKey,
    metas: Vec<Node>,
    io: Vec<Child>,
    /// With a switch, member i runs in its namespace (host i) and the I/O servers listen
    /// on this namespace's switch address; without, everything is on loopback.
    switch: Option<NetSwitch>,
}

fn spawn(role: &str, config: &Path, log: &Path) -> Child {
    spawn_as(Command::new(FREEFLOW), role, config, log)
}

/// Start `command` (the binary, perhaps behind `ip netns exec`) as server `role`.
fn spawn_as(mut command: Command, role: &str, config: &Path, log: &Path) -> Child {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("open a server log");
    let copy = file.try_clone().expect("clone the log handle");
    command
        .arg(role)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info,openraft=warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(copy))
        .spawn()
        .expect("start a server")
}

impl ReplicatedCluster {
    fn start(io_count: usize) -> ReplicatedCluster {
        ReplicatedCluster::start_on(io_count, None)
    }

    fn start_on(io_count: usize, switch: Option<NetSwitch>) -> ReplicatedCluster {
        ReplicatedCluster::start_configured(io_count, switch, "")
    }

    /// Members with `extra` lines in their `[meta]` section.
    fn start_configured(
        io_count: usize,
        switch: Option<NetSwitch>,
        extra: &str,
    ) -> ReplicatedCluster {
        let member_ip = |index: usize| {
            switch
                .as_ref()
                .map_or("127.0.0.1".to_string(), |switch| switch.ip(index))
        };
        let io_ip = switch
            .as_ref()
            .map_or("127.0.0.1".to_string(), NetSwitch::here_ip);
        let dir = tempfile::Builder::new()
            .prefix("freeflow-raft-")
            .tempdir()
            .expect("a temporary directory");
        let key = ClusterKey::generate().expect("a cluster key");
        key.write_new(&dir.path().join("cluster.key"))
            .expect("write the key");
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let mut peers = String::new();
        for (index, (client, raft)) in ports.iter().enumerate() {
            let ip = member_ip(index);
            peers.push_str(&format!(
                "\n[[meta.peers]]\nid = {}\naddress = \"{ip}:{client}\"\nraft_address = \"{ip}:{raft}\"\n",
                index + 1
            ));
        }
        let mut metas = Vec::new();
        for (index, (client, _)) in ports.iter().enumerate() {
            let id = index as u64 + 1;
            let config = dir.path().join(format!("meta-{id}.toml"));
            let ip = member_ip(index);
            let text = format!(
                "key_file = \"cluster.key\"\n\n[meta]\nlisten_address = \"{ip}:{client}\"\n\
                 data_dir = \"meta-{id}\"\nnode_id = {id}\nserver_down_after_ms = 3000\n\
                 heartbeat_interval_ms = 500\nrecovery_window_ms = 10000\ncache_lease_ms = 3000\n\
                 store_cache_bytes = 16777216\n{extra}{peers}"
            );
            std::fs::write(&config, text).expect("write a meta config");
            metas.push(Node {
                id,
                address: format!("{ip}:{client}"),
                log: dir.path().join(format!("meta-{id}.log")),
                data: dir.path().join(format!("meta-{id}")),
                config,
                child: None,
            });
        }
        let meta_addresses = metas
            .iter()
            .map(|node| node.address.clone())
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = ReplicatedCluster {
            dir,
            key,
            metas,
            io: Vec::new(),
            switch,
        };
        for index in 0..3 {
            cluster.start_meta(index);
        }
        for server in 0..io_count {
            let config = cluster.dir.path().join(format!("io-{server}.toml"));
            let text = format!(
                "key_file = \"cluster.key\"\n\n[io]\nserver_id = {server}\n\
                 listen_address = \"{io_ip}:{}\"\ndata_dir = \"io-{server}\"\n\
                 meta_address = \"{meta_addresses}\"\nbuffer_count = 16\nworker_threads = 4\n\
                 register_backoff_max_ms = 500\n",
                free_port()
            );
            std::fs::write(&config, text).expect("write an io config");
            let log = cluster.dir.path().join(format!("io-{server}.log"));
            cluster.io.push(spawn("io", &config, &log));
        }
        cluster
    }

    fn start_meta(&mut self, index: usize) {
        let command = match &self.switch {
            Some(switch) => switch.command(index, FREEFLOW),
            None => Command::new(FREEFLOW),
        };
        let node = &mut self.metas[index];
        assert!(node.child.is_none());
        node.child = Some(spawn_as(command, "meta", &node.config, &node.log));
    }

    fn kill_meta(&mut self, index: usize) {
        let mut child = self.metas[index].child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }

    /// Stop a metadata server cleanly (SIGTERM) and wait for it.
    fn stop_meta(&mut self, index: usize) {
        let mut child = self.metas[index].child.take().expect("running");
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.kill().expect("SIGKILL after SIGTERM did not stop it");
        child.wait().expect("reaped");
    }

    /// Send a signal (`STOP`, `CONT`) to a metadata server.
    fn signal_meta(&self, index: usize, signal: &str) {
        let child = self.metas[index].child.as_ref().expect("running");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}");
    }

    fn meta_addresses(&self) -> String {
        self.metas
            .iter()
            .map(|node| node.address.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn client_config(&self, name: &str) -> ClientConfig {
        let mut config = ClientConfig::new(self.meta_addresses(), self.key.clone());
        config.connect_timeout_ms = 1_000;
        config.call_timeout_ms = 30_000;
        config.client_name = name.to_string();
        config
    }

    /// The index of the server that leads now: the one whose hello carries an epoch.
    async fn leader(&self) -> Option<usize> {
        let running = self
            .metas
            .iter()
            .enumerate()
            .filter(|(_, node)| node.child.is_some())
            .map(|(index, node)| (index, node.address.clone()))
            .collect();
        common::leading_member(running, &self.key).await
    }

    fn io_logs(&self) -> String {
        let mut text = String::new();
        for server in 0..self.io.len() {
            let path = self.dir.path().join(format!("io-{server}.log"));
            let log = std::fs::read_to_string(path).unwrap_or_default();
            text.push_str(&format!("---- io {server} ----\n{log}\n"));
        }
        text
    }

    fn logs(&self) -> String {
        let mut text = String::new();
        for node in &self.metas {
            let log = std::fs::read_to_string(&node.log).unwrap_or_default();
            text.push_str(&format!("---- meta {} ----\n{log}\n", node.id));
        }
        text
    }
}

impl Drop for ReplicatedCluster {
    fn drop(&mut self) {
        for node in &mut self.metas {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        for child in &mut self.io {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn content(client: usize, index: usize) -> Bytes {
    let mut bytes = vec![0u8; 16 << 10];
    for (offset, byte) in bytes.iter_mut().enumerate() {
        *byte = (offset as u8) ^ (client as u8).wrapping_mul(31) ^ (index as u8).wrapping_mul(7);
    }
    Bytes::from(bytes)
}

/// One client's work: create, write, fsync, close, and rename every third file. Returns
/// the names it was answered for, with their contents' seeds.
async fn work(client: Arc<Client>, which: usize, files: usize) -> Vec<(String, usize)> {
    let directory = client
        .mkdir(ROOT_INODE, &format!("client-{which}"), 0o755)
        .await
        .expect("mkdir")
        .inode;
    let mut done = Vec::new();
    for index in 0..files {
        let name = format!("f{index}");
        let (file, _) = client
            .create_open(
                directory,
                &name,
                0o644,
                true,
                OpenAccess {
                    read: true,
                    write: true,
                },
            )
            .await
            .unwrap_or_else(|error| panic!("client {which} create {name}: {error}"));
        file.write_at(0, content(which, index))
            .await
            .unwrap_or_else(|error| panic!("client {which} write {name}: {error}"));
        file.fsync()
            .await
            .unwrap_or_else(|error| panic!("client {which} fsync {name}: {error}"));
        file.close()
            .await
            .unwrap_or_else(|error| panic!("client {which} close {name}: {error}"));
        let final_name = if index % 3 == 0 {
            let renamed = format!("r{index}");
            client
                .rename(directory, &name, directory, &renamed, RenameMode::NoReplace)
                .await
                .unwrap_or_else(|error| panic!("client {which} rename {name}: {error}"));
            renamed
        } else {
            name
        };
        done.push((format!("client-{which}/{final_name}"), index));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_meta_leader_under_two_writers_loses_nothing_and_replicas_agree() {
    let mut cluster = ReplicatedCluster::start(2);
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.kill_meta(first);
    let killed_at = Instant::now();
    let second = poll_until(20_000, || async { cluster.leader().await })
        .await
        .unwrap_or_else(|| panic!("no new leader\n{}", cluster.logs()));
    assert_ne!(second, first);
    let elected_after = killed_at.elapsed();
    writers_done_and_checked(&cluster, clients, writers).await;
    // The killed server comes back as a follower and catches up; then all three agree.
    cluster.start_meta(first);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("new leader elected {elected_after:?} after the kill; replicas {digests:?}");
}

const FILES: usize = 60;

/// Wait for a leader and both I/O servers, then start two clients writing (`work`).
/// Returns the leader's index, the clients and their tasks.
async fn start_writers(
    cluster: &ReplicatedCluster,
) -> (
    usize,
    Vec<Arc<Client>>,
    Vec<tokio::task::JoinHandle<Vec<(String, usize)>>>,
) {
    // The clients' own log (their replays, what they send again), with RUST_LOG set.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let first = poll_until(20_000, || async { cluster.leader().await })
        .await
        .unwrap_or_else(|| panic!("no leader\n{}", cluster.logs()));
    let mut clients = Vec::new();
    for which in 0..2 {
        let config = cluster.client_config(&format!("writer-{which}"));
        let client = poll_until(20_000, || async {
            Client::connect(config.clone()).await.ok()
        })
        .await
        .expect("a client connects");
        clients.push(Arc::new(client));
    }
    poll_until(20_000, || async {
        let servers = clients[0].servers().await.ok()?;
        (servers.iter().filter(|server| server.up).count() == 2).then_some(())
    })
    .await
    .expect("both I/O servers registered");
    let writers = clients
        .iter()
        .enumerate()
        .map(|(which, client)| tokio::spawn(work(client.clone(), which, FILES)))
        .collect();
    (first, clients, writers)
}

/// The writers finish without an error, everything they were answered reads back as a new
/// client sees it, and their clients shut down.
async fn writers_done_and_checked(
    cluster: &ReplicatedCluster,
    clients: Vec<Arc<Client>>,
    writers: Vec<tokio::task::JoinHandle<Vec<(String, usize)>>>,
) {
    let mut answered = Vec::new();
    for writer in writers {
        answered.extend(writer.await.expect("a writer finished without an error"));
    }
    assert_eq!(answered.len(), 2 * FILES);
    check_answered(cluster, &answered).await;
    for client in &clients {
        client.shutdown().await;
    }
}

/// Every answered file is there, byte for byte, as a fresh client sees it.
async fn check_answered(cluster: &ReplicatedCluster, answered: &[(String, usize)]) {
    let reader = Client::connect(cluster.client_config("checker"))
        .await
        .expect("checker connects");
    for (path, index) in answered {
        let (directory, name) = path.split_once('/').expect("dir/name");
        let which: usize = directory.trim_start_matches("client-").parse().unwrap();
        let parent = reader
            .lookup(ROOT_INODE, directory)
            .await
            .expect("directory");
        let attr = reader
            .lookup(parent.inode, name)
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "{path} was answered but is gone: {error}\n{}",
                    cluster.logs()
                )
            });
        let file = reader
            .open(
                attr.inode,
                OpenAccess {
                    read: true,
                    write: false,
                },
            )
            .await
            .expect("open");
        let bytes = file.read_at(0, 1 << 20).await.expect("read");
        if bytes != content(which, *index) {
            let zeros = bytes.iter().filter(|byte| **byte == 0).count();
            panic!(
                "{path}: {} bytes read, {zeros} zero, differ from what was written (inode {})\n{}",
                bytes.len(),
                attr.inode,
                cluster.logs()
            );
        }
        file.close().await.expect("close");
    }
    reader.shutdown().await;
}

/// Stop every member (followers first) and compare the replicas.
async fn stop_and_compare(
    cluster: &mut ReplicatedCluster,
) -> Vec<(u64, (Option<String>, u64, u64))> {
    // The I/O servers first: their registrations are replicated entries too (one back from
    // a silence changes its chains' state), and one landing while the members stop leaves
    // a follower an entry behind the leader (seen once after a network cut: the I/O
    // servers re-registered just as the first follower stopped).
    for child in &mut cluster.io {
        let _ = child.kill();
        let _ = child.wait();
    }
    let leader = cluster.leader().await.expect("a leader");
    // A follower learns that the last entries are committed (and applies them) from the
    // leader's next heartbeats (every 50 ms): the last answer (a `CloseSession`, which
    // waits for a majority) may leave one follower an entry behind for that long.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for index in (0..3).filter(|index| *index != leader) {
        cluster.stop_meta(index);
    }
    cluster.stop_meta(leader);
    let mut digests = Vec::new();
    for node in &cluster.metas {
        digests.push((node.id, common::replica_digest(&node.data)));
    }
    let (_, reference) = &digests[0];
    assert!(reference.1 > 0, "replicas hold nothing");
    for (id, replica) in &digests {
        assert_eq!(
            replica,
            reference,
            "replica {id} differs: {digests:?}\n{}",
            cluster.logs()
        );
    }
    digests
}

/// A leader that stops answering (SIGSTOP) for longer than an election while two clients
/// write is replaced; when it runs again it finds a newer term, stops leading, takes back
/// what it ran ahead of a commit and follows. The clients see no error, nothing answered
/// is lost, and the three replicas end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_paused_past_an_election_steps_down_and_replicas_agree() {
    let mut cluster = ReplicatedCluster::start(2);
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    cluster.signal_meta(first, "STOP");
    // The others elect a leader among themselves (the paused one cannot say it leads).
    leader_other_than(&cluster, first, "paused").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.signal_meta(first, "CONT");
    let log = answered_and_stepped_down(&cluster, first, clients, writers, "paused").await;
    for line in log.lines().filter(|line| {
        line.contains("stopped leading") || line.contains("took back") || line.contains("giving up")
    }) {
        eprintln!("paused leader: {line}");
    }
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("replicas after the pause: {digests:?}");
}

/// The writers finish without an error, everything they were answered reads back, and
/// the old leader `first` (`what`: paused, cut off) has stepped down and follows. Returns
/// its log.
async fn answered_and_stepped_down(
    cluster: &ReplicatedCluster,
    first: usize,
    clients: Vec<Arc<Client>>,
    writers: Vec<tokio::task::JoinHandle<Vec<(String, usize)>>>,
    what: &str,
) -> String {
    writers_done_and_checked(cluster, clients, writers).await;
    // The old leader follows now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = std::fs::read_to_string(&cluster.metas[first].log).unwrap_or_default();
    assert!(
        log.contains("stopped leading"),
        "the {what} leader did not step down\n{}",
        cluster.logs()
    );
    log
}

/// The member other than `first` that leads, once the other two have elected one.
async fn leader_other_than(cluster: &ReplicatedCluster, first: usize, what: &str) -> usize {
    poll_until(20_000, || async {
        let options = freeflow_rpc::ConnectOptions {
            connect_timeout_ms: 300,
            ..freeflow_rpc::ConnectOptions::default()
        };
        for (index, node) in cluster.metas.iter().enumerate() {
            if index == first {
                continue;
            }
            if let Ok(connection) =
                freeflow_rpc::Connection::connect(&node.address, &cluster.key, &options).await
            {
                if connection.epoch() != 0 {
                    return Some(index);
                }
            }
        }
        None
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "no new leader while the first is {what}\n{}",
            cluster.logs()
        )
    })
}

/// A leader cut off by the network (its switch port down: no reset, sockets stay open)
/// while two clients write: the other two elect a leader, the clients' calls stalled at
/// the cut one are found out by the connections' liveness check and go to the new leader,
/// and the writers see no error. The cut-off leader gives up the lead on its own (no
/// majority heard from); back on the network, it takes back what it ran ahead and
/// follows. The I/O servers follow the new leader before it would take them for down.
/// Nothing answered is lost; the replicas end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_cut_off_by_the_network_steps_down_and_replicas_agree() {
    if !NetSwitch::available() {
        return;
    }
    let switch = NetSwitch::create(3).expect("a switch of network namespaces");
    let mut cluster = ReplicatedCluster::start_on(2, Some(switch));
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let cut_at = Instant::now();
    cluster.switch.as_ref().expect("a switch").cut(first);
    let second = leader_other_than(&cluster, first, "cut off").await;
    eprintln!("new leader {second} after {:?}", cut_at.elapsed());
    // The writers go on with the new leader while the old one is away.
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster.switch.as_ref().expect("a switch").heal(first);
    answered_and_stepped_down(&cluster, first, clients, writers, "cut-off").await;
    // The I/O servers found the new leader well within its `server_down_after_ms`: a cut
    // of the metadata leader puts no I/O server out of its chains (before, their link to
    // the cut leader stayed up for 3 s and the new leader put them out).
    let logs = cluster.logs();
    assert!(
        !logs.contains("out of its chains"),
        "an I/O server was put out of its chains by the cut\n{logs}\n{}",
        cluster.io_logs()
    );
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("replicas after the cut: {digests:?}");
}

/// A follower that loses its disk (killed, its data directory removed, started again under
/// its id with the same config) while two clients write: the leader sends it the whole log
/// again, it catches up, and the three replicas end identical; the writers see nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_lost_its_disk_is_rebuilt_from_the_leader() {
    let mut cluster = ReplicatedCluster::start(2);
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let wiped = (first + 1) % 3;
    cluster.kill_meta(wiped);
    std::fs::remove_dir_all(&cluster.metas[wiped].data).expect("wipe the member's data");
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.start_meta(wiped);
    writers_done_and_checked(&cluster, clients, writers).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!(
        "replicas after member {} was rebuilt: {digests:?}",
        wiped + 1
    );
}

/// Issue 42: a member rebuilt from an empty disk while the cluster made more than one
/// message may carry is sent a snapshot (a file, in chunks) and then its entries in parts
/// under the message bound (256 KiB here; each `SetXattr` of 24 KiB is an entry of its own,
/// so the 64 entries openraft sends at once would be 1.5 MiB), and ends identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_rebuilt_from_empty_gets_a_snapshot_and_its_entries_in_bounded_messages() {
    let mut cluster = ReplicatedCluster::start_configured(
        1,
        None,
        "raft_message_bytes_max = 262144\nraft_snapshot_entries = 100\nraft_log_kept_entries = 10\n",
    );
    let leader = poll_until(20_000, || async { cluster.leader().await })
        .await
        .unwrap_or_else(|| panic!("no leader\n{}", cluster.logs()));
    let client = poll_until(20_000, || async {
        Client::connect(cluster.client_config("xattrs")).await.ok()
    })
    .await
    .expect("a client connects");
    poll_until(20_000, || async {
        let servers = client.servers().await.ok()?;
        servers.iter().any(|server| server.up).then_some(())
    })
    .await
    .expect("the I/O server registered");
    let wiped = (leader + 1) % 3;
    cluster.kill_meta(wiped);
    std::fs::remove_dir_all(&cluster.metas[wiped].data).expect("wipe the member's data");
    let value = |index: usize| -> Vec<u8> {
        (0..24 << 10)
            .map(|offset: usize| (offset ^ index.wrapping_mul(131)) as u8)
            .collect()
    };
    let directory = client
        .mkdir(ROOT_INODE, "big", 0o755)
        .await
        .expect("mkdir")
        .inode;
    let mut inodes = Vec::new();
    for index in 0..300 {
        let attr = client
            .create(
                directory,
                &format!("f{index}"),
                freeflow_client::FileKind::Regular,
                0o644,
                0,
                true,
            )
            .await
            .expect("create");
        client
            .set_xattr(
                attr.inode,
                "user.big",
                &value(index),
                freeflow_client::XattrSetMode::Any,
            )
            .await
            .expect("set_xattr");
        inodes.push(attr.inode);
    }
    cluster.start_meta(wiped);
    // Caught up: the leader sees it with no entry to send.
    let caught_up = poll_until(60_000, || async {
        let report = client.cluster_status().await.ok()?;
        let member = report
            .meta_members
            .iter()
            .find(|member| member.id == cluster.metas[wiped].id)?;
        (member.lag_entries == Some(0)).then_some(())
    })
    .await;
    let log = std::fs::read_to_string(&cluster.metas[wiped].log).unwrap_or_default();
    assert!(
        caught_up.is_some(),
        "the rebuilt member did not catch up\n{}",
        cluster.logs()
    );
    assert!(
        log.contains("installed a snapshot from the leader"),
        "the rebuilt member was not sent a snapshot\n{log}"
    );
    for (index, inode) in inodes.iter().enumerate() {
        let read = client
            .get_xattr(*inode, "user.big")
            .await
            .expect("get_xattr");
        assert_eq!(read, value(index), "inode {inode}");
    }
    client.shutdown().await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!(
        "replicas after member {} was rebuilt: {digests:?}",
        wiped + 1
    );
}
