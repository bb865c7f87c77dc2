//! A replicated metadata cluster of real processes (three `freeflow meta` members under
//! Raft, I/O servers, all from config files), with writers that check every byte: what the
//! failover and membership tests share.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_client::{Client, ClientConfig, ClusterKey, OpenAccess, RenameMode, ROOT_INODE};

use super::netswitch::NetSwitch;
use super::{free_port, poll_until, FREEFLOW};

pub struct Node {
    pub id: u64,
    pub address: String,
    pub config: PathBuf,
    pub log: PathBuf,
    pub data: PathBuf,
    pub child: Option<Child>,
}

pub struct ReplicatedCluster {
    pub dir: tempfile::TempDir,
    pub key: ClusterKey,
    pub metas: Vec<Node>,
    pub io: Vec<Child>,
    /// With a switch, member i runs in its namespace (host i) and the I/O servers listen
    /// on this namespace's switch address; without, everything is on loopback.
    pub switch: Option<NetSwitch>,
    /// The `[[meta.peers]]` of the first members, and the extra `[meta]` lines, for the
    /// configs of members added later.
    pub peers: String,
    pub extra: String,
}

pub fn spawn(role: &str, config: &Path, log: &Path) -> Child {
    spawn_as(Command::new(FREEFLOW), role, config, log)
}

/// Start `command` (the binary, perhaps behind `ip netns exec`) as server `role`.
pub fn spawn_as(mut command: Command, role: &str, config: &Path, log: &Path) -> Child {
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
    pub fn start(io_count: usize) -> ReplicatedCluster {
        ReplicatedCluster::start_on(io_count, None)
    }

    pub fn start_on(io_count: usize, switch: Option<NetSwitch>) -> ReplicatedCluster {
        ReplicatedCluster::start_configured(io_count, switch, "")
    }

    /// Members with `extra` lines in their `[meta]` section.
    pub fn start_configured(
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
            peers,
            extra: extra.to_string(),
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

    /// Write the config of a new member `id` on loopback (`join = true`: it waits to be
    /// added) and start it; its index in `metas` is returned. `replacing`: it takes that
    /// index (a member whose disk was lost, removed from the list), else it is appended.
    pub fn new_member(&mut self, id: u64, replacing: Option<usize>) -> usize {
        self.new_member_at(id, replacing, (free_port(), free_port()))
    }

    /// [`ReplicatedCluster::new_member`] on the lost member's own ports (the same host and
    /// config, a new id and an empty disk).
    pub fn new_member_in_place(&mut self, id: u64, replacing: usize) -> usize {
        let port = |address: &str| -> u16 {
            address
                .rsplit(':')
                .next()
                .and_then(|port| port.parse().ok())
                .expect("a port")
        };
        let ports = (
            port(&self.metas[replacing].address),
            port(&self.raft_address(replacing)),
        );
        self.new_member_at(id, Some(replacing), ports)
    }

    fn new_member_at(&mut self, id: u64, replacing: Option<usize>, ports: (u16, u16)) -> usize {
        let (client, raft) = ports;
        let config = self.dir.path().join(format!("meta-{id}.toml"));
        let text = format!(
            "key_file = \"cluster.key\"\n\n[meta]\nlisten_address = \"127.0.0.1:{client}\"\n\
             data_dir = \"meta-{id}\"\nnode_id = {id}\njoin = true\nserver_down_after_ms = 3000\n\
             heartbeat_interval_ms = 500\nrecovery_window_ms = 10000\ncache_lease_ms = 3000\n\
             store_cache_bytes = 16777216\n{}{}\n[[meta.peers]]\nid = {id}\n\
             address = \"127.0.0.1:{client}\"\nraft_address = \"127.0.0.1:{raft}\"\n",
            self.extra, self.peers
        );
        std::fs::write(&config, text).expect("write a meta config");
        let node = Node {
            id,
            address: format!("127.0.0.1:{client}"),
            log: self.dir.path().join(format!("meta-{id}.log")),
            data: self.dir.path().join(format!("meta-{id}")),
            config,
            child: None,
        };
        let index = match replacing {
            Some(index) => {
                assert!(self.metas[index].child.is_none(), "replaced while running");
                self.metas[index] = node;
                index
            }
            None => {
                self.metas.push(node);
                self.metas.len() - 1
            }
        };
        self.start_meta(index);
        index
    }

    /// The raft address member `index` was given (its config's own peer entry).
    pub fn raft_address(&self, index: usize) -> String {
        let node = &self.metas[index];
        let text = std::fs::read_to_string(&node.config).expect("read a meta config");
        let own = text
            .split("[[meta.peers]]")
            .skip(1)
            .find(|peer| {
                peer.trim_start()
                    .starts_with(&format!("id = {}\n", node.id))
            })
            .expect("its own peer entry");
        own.lines()
            .find_map(|line| line.strip_prefix("raft_address = "))
            .expect("a raft address")
            .trim_matches('"')
            .to_string()
    }

    /// Run `freeflow --cluster client.toml ARGS` (the client file names the members
    /// running now) and return its output.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let file = self.dir.path().join("client.toml");
        let addresses = self
            .metas
            .iter()
            .filter(|node| node.child.is_some())
            .map(|node| node.address.clone())
            .collect::<Vec<_>>()
            .join(",");
        std::fs::write(
            &file,
            format!("meta_address = \"{addresses}\"\nkey_file = \"cluster.key\"\n"),
        )
        .expect("write the cluster file");
        Command::new(FREEFLOW)
            .arg("--cluster")
            .arg(&file)
            .args(args)
            .output()
            .expect("run freeflow")
    }

    /// `freeflow meta ARGS` through the cluster's client file: its output (stdout, then
    /// stderr), or a panic with the servers' logs.
    pub fn meta(&self, args: &[&str]) -> String {
        let mut all = vec!["meta"];
        all.extend_from_slice(args);
        let output = self.cli(&all);
        let said = String::from_utf8_lossy(&output.stdout).to_string()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "freeflow meta {args:?} failed: {said}\n{}",
            self.logs()
        );
        said
    }

    pub fn start_meta(&mut self, index: usize) {
        let command = match &self.switch {
            Some(switch) => switch.command(index, FREEFLOW),
            None => Command::new(FREEFLOW),
        };
        let node = &mut self.metas[index];
        assert!(node.child.is_none());
        node.child = Some(spawn_as(command, "meta", &node.config, &node.log));
    }

    pub fn kill_meta(&mut self, index: usize) {
        let mut child = self.metas[index].child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }

    /// Stop a metadata server cleanly (SIGTERM) and wait for it.
    pub fn stop_meta(&mut self, index: usize) {
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
    pub fn signal_meta(&self, index: usize, signal: &str) {
        let child = self.metas[index].child.as_ref().expect("running");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}");
    }

    pub fn meta_addresses(&self) -> String {
        self.metas
            .iter()
            .map(|node| node.address.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn client_config(&self, name: &str) -> ClientConfig {
        let mut config = ClientConfig::new(self.meta_addresses(), self.key.clone());
        config.connect_timeout_ms = 1_000;
        config.call_timeout_ms = 30_000;
        config.client_name = name.to_string();
        config
    }

    /// The index of the server that leads now: the one whose hello carries an epoch.
    pub async fn leader(&self) -> Option<usize> {
        let running = self
            .metas
            .iter()
            .enumerate()
            .filter(|(_, node)| node.child.is_some())
            .map(|(index, node)| (index, node.address.clone()))
            .collect();
        super::leading_member(running, &self.key).await
    }

    pub fn io_logs(&self) -> String {
        let mut text = String::new();
        for server in 0..self.io.len() {
            let path = self.dir.path().join(format!("io-{server}.log"));
            let log = std::fs::read_to_string(path).unwrap_or_default();
            text.push_str(&format!("---- io {server} ----\n{log}\n"));
        }
        text
    }

    pub fn logs(&self) -> String {
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

pub fn content(client: usize, index: usize) -> Bytes {
    let mut bytes = vec![0u8; 16 << 10];
    for (offset, byte) in bytes.iter_mut().enumerate() {
        *byte = (offset as u8) ^ (client as u8).wrapping_mul(31) ^ (index as u8).wrapping_mul(7);
    }
    Bytes::from(bytes)
}

/// One client's work: create, write, fsync, close, and rename every third file. Returns
/// the names it was answered for, with their contents' seeds.
pub async fn work(client: Arc<Client>, which: usize, files: usize) -> Vec<(String, usize)> {
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

pub const FILES: usize = 60;

/// Wait for a leader and both I/O servers, then start two clients writing (`work`).
/// Returns the leader's index, the clients and their tasks.
pub async fn start_writers(
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
pub async fn writers_done_and_checked(
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
pub async fn check_answered(cluster: &ReplicatedCluster, answered: &[(String, usize)]) {
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
pub async fn stop_and_compare(
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
    // The members running now (those removed or lost were stopped by the test).
    let running: Vec<usize> = (0..cluster.metas.len())
        .filter(|index| cluster.metas[*index].child.is_some())
        .collect();
    for index in running.iter().copied().filter(|index| *index != leader) {
        cluster.stop_meta(index);
    }
    cluster.stop_meta(leader);
    let mut digests = Vec::new();
    for index in running {
        let node = &cluster.metas[index];
        digests.push((node.id, super::replica_digest(&node.data)));
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
