//! Chain replication of data (issue 11, DESIGN.md §7) with real processes: a cluster of
//! three I/O servers keeping two copies of every stripe, written through a mount and the
//! library while an I/O server is killed with SIGKILL and brought back, another hangs
//! (SIGSTOP) long enough to be put out and then wakes, and a third is brought back with an
//! empty data directory. Writers see no error (a pause at most), every
//! acknowledged byte reads back, and in the end the copies of every stripe are identical
//! byte for byte. The last test runs the whole scenario on a cluster built from `freeflow
//! init` configs, three metadata members included, each server in a namespace of its own.

mod common;

use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::mount::{fuse_available, Mount};
use common::netswitch::NetSwitch;
use common::workload::{
    assert_copies_identical, assert_resynced, chunk_bytes, stop_and_verify, wait_for_state,
    Workload,
};
use common::{
    assert_bytes_eq, leading_member, poll_sync, poll_until, read_log, replica_digest,
    spawn_server_as, Cluster, ClusterOptions, Xorshift, FREEFLOW,
};
use freeflow_client::{Client, ClientConfig, ClusterKey, OpenOptions};
use freeflow_proto::meta::MemberState;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_ride_out_a_killed_io_server_and_its_copies_are_remade() {
    if !fuse_available() {
        return;
    }
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    let mut cluster = Cluster::start_with(options).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let observer = cluster.client().await;
    let mut workload = Workload::start(&mount, cluster.client().await);
    workload.logs.extend([
        cluster.dir.path().join("meta.log"),
        cluster.dir.path().join("io-0.log"),
    ]);
    workload.advance(5, "before any failure").await;

    // SIGKILL of I/O server 1 under load: a pause, then the writers go on without it.
    cluster.kill_io(1);
    workload.advance(5, "while server 1 is dead").await;
    wait_for_state(&observer, 1, MemberState::Out, "after its kill").await;
    workload.advance(5, "with server 1 out of its chains").await;

    // Back: it copies what it missed and serves again, while the writers go on.
    cluster.restart_io(1).await;
    wait_for_state(&observer, 1, MemberState::InService, "after its restart").await;
    workload.advance(5, "after server 1 came back").await;

    // Server 0 hangs (SIGSTOP) as if cut off: requests to it get no answer. It is put out
    // after server_down_after_ms and the writers go on; woken, the requests it held are
    // refused (its lease ran out, its map is old), and it syncs back.
    cluster.signal_io(0, libc::SIGSTOP);
    wait_for_state(&observer, 0, MemberState::Out, "while it hangs").await;
    workload.advance(3, "while server 0 hangs").await;
    cluster.signal_io(0, libc::SIGCONT);
    wait_for_state(&observer, 0, MemberState::InService, "after it woke").await;
    workload.advance(3, "after server 0 woke").await;

    // Server 2 loses its disk: killed, its data directory removed, started again. It is
    // rebuilt in full from its partners.
    cluster.kill_io(2);
    std::fs::remove_dir_all(cluster.io_data_dir(2)).expect("wipe server 2's data");
    workload.advance(3, "while server 2 is dead").await;
    cluster.restart_io(2).await;
    wait_for_state(&observer, 2, MemberState::InService, "after its rebuild").await;
    workload.advance(3, "after server 2 was rebuilt").await;

    stop_and_verify(workload, &cluster.io_data_dirs(), &mount, &observer, 26).await;
    for server in [0, 1, 2] {
        assert_resynced(server, &cluster.io_log(server));
    }
}

/// An I/O server cut off by the network (its switch port down: no reset, its sockets stay
/// open) while two writers work: the meta server puts it out of its chains once it has
/// been silent for `server_down_after_ms`, the writers' requests stalled on it are found
/// out by their connections' liveness check and go on without it, and back on the
/// network it copies what it missed before it serves again. No writer sees an error;
/// every acknowledged byte reads back; the copies end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_io_server_cut_off_by_the_network_is_put_out_then_synced_back() {
    if !fuse_available() || !NetSwitch::available() {
        return;
    }
    let switch = Arc::new(NetSwitch::create(1).expect("a switch of network namespaces"));
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    options.switch = Some(switch.clone());
    let cluster = Cluster::start_with(options).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let observer = cluster.client().await;
    let mut workload = Workload::start(&mount, cluster.client().await);
    workload.logs.extend([
        cluster.dir.path().join("meta.log"),
        cluster.dir.path().join("io-0.log"),
    ]);
    workload.advance(5, "before the cut").await;

    switch.cut(0);
    wait_for_state(&observer, 0, MemberState::Out, "while it is cut off").await;
    workload.advance(5, "while server 0 is cut off").await;
    switch.heal(0);
    wait_for_state(&observer, 0, MemberState::InService, "after the cut healed").await;
    workload.advance(3, "after server 0 came back").await;

    stop_and_verify(workload, &cluster.io_data_dirs(), &mount, &observer, 13).await;
    assert_resynced(0, &cluster.io_log(0));
}

/// A file cut again and again by one client (as `logrotate`'s copytruncate does) while
/// another writes into it and fsyncs: the cuts go down each chain like the writes, and the
/// copies end identical. (The meta server's recall already drains the writer's writes in
/// flight before each cut, so this run does not catch cuts sent to members out of order on
/// its own: undoing the chain order of cuts was tried and passed. It checks that cuts reach
/// every copy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuts_amid_writes_leave_identical_copies() {
    let mut options = ClusterOptions::new(2);
    options.replicas = 2;
    options.stripe_unit_bytes = 64 << 10;
    let cluster = Cluster::start_with(options).await;
    let writer = cluster.client().await;
    let cutter = cluster.client().await;
    let handle = writer
        .open_path("/log", &OpenOptions::new().write(true).create(true))
        .await
        .expect("create the log");
    let stop = Arc::new(AtomicBool::new(false));
    let cuts = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut count = 0u64;
            while !stop.load(Ordering::Acquire) {
                cutter
                    .truncate_path("/log", (count % 5) * 30_000)
                    .await
                    .expect("cut the log");
                count += 1;
                tokio::time::sleep(std::time::Duration::from_millis(3)).await;
            }
            count
        })
    };
    let mut offset = 0u64;
    for index in 0..400u64 {
        let chunk = Xorshift::new(index).bytes(20_000 + (index as usize % 3) * 7_001);
        // Writes at places the cuts keep moving over, some past the end.
        offset = (offset + chunk.len() as u64) % 250_000;
        handle
            .write_at(offset, Bytes::from(chunk))
            .await
            .expect("write into the log");
        if index % 8 == 0 {
            handle.fsync().await.expect("fsync the log");
        }
    }
    handle.fsync().await.expect("fsync the log");
    stop.store(true, Ordering::Release);
    let cut_count = cuts.await.expect("cutter task");
    // Whatever the last cut left, some bytes past it, on every stripe, to compare.
    handle
        .write_at(100_000, Bytes::from(Xorshift::new(999).bytes(200_000)))
        .await
        .expect("write after the cuts");
    handle.fsync().await.expect("fsync the log");
    handle.close().await.expect("close");
    let compared = assert_copies_identical(&cluster.io_data_dirs(), &writer, "/log").await;
    eprintln!("{cut_count} cuts amid 400 writes; {compared} bytes of copies compared");
    assert!(cut_count >= 10, "only {cut_count} cuts ran");
    assert!(compared >= 200_000, "{compared} bytes compared");
}

/// Writes from the servers' host on Unix sockets go through memory shared with the
/// servers (shared payloads), replicated stripes too: the head of a chain writes such a
/// payload and passes it on. A writer goes over one file three times with new bytes (its
/// places in the shared region reused hundreds of times while other writes are on their
/// way down the chains): the file reads back as last written, every stripe's copies end
/// identical, and the I/O servers counted the bytes as shared payloads. (Why the head
/// copies a shared payload first, a pass-on outliving a failed request, is not provoked
/// here: no member fails.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_payloads_on_replicated_stripes_leave_identical_copies() {
    const SIZE: usize = 24 << 20;
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    options.unix_sockets = true;
    options.metrics = true;
    options.stripe_unit_bytes = 1 << 20;
    let cluster = Cluster::start_with(options).await;
    let client = cluster.client().await;
    let handle = client
        .open_path(
            "/shared",
            &OpenOptions::new().read(true).write(true).create(true),
        )
        .await
        .expect("create");
    let mut expected = vec![0u8; SIZE];
    for pass in 0..3u64 {
        let (mut offset, mut index) = (0usize, 0u64);
        while offset < SIZE {
            // 256-512 KiB: all shared (the least is 32 KiB), most across unit boundaries.
            let length = ((256 << 10) + (index as usize % 5) * 65_536).min(SIZE - offset);
            let chunk = Xorshift::new(pass << 32 | index).bytes(length);
            expected[offset..offset + length].copy_from_slice(&chunk);
            handle
                .write_at(offset as u64, Bytes::from(chunk))
                .await
                .expect("write");
            offset += length;
            index += 1;
        }
    }
    handle.fsync().await.expect("fsync");
    let back = handle.read_at(0, SIZE as u64).await.expect("read back");
    assert_bytes_eq(&back, &expected, "the file after three passes");
    handle.close().await.expect("close");
    let compared = assert_copies_identical(&cluster.io_data_dirs(), &client, "/shared").await;
    assert!(
        compared >= SIZE as u64,
        "{compared} bytes of copies compared"
    );
    let mut shared = 0.0;
    for index in 0..cluster.io_count() {
        let address = cluster.io_metrics_address(index).expect("metrics are on");
        let text = freeflow_metrics::scrape(address, Duration::from_secs(10))
            .await
            .unwrap_or_else(|error| panic!("scrape {address}: {error}"));
        shared += freeflow_metrics::text::Snapshot::parse(&text)
            .sum("freeflow_rpc_shared_payload_bytes_total", &[]);
    }
    assert!(
        shared >= (2 * SIZE) as f64,
        "only {shared} bytes came as shared payloads (three passes of {SIZE})"
    );
}

/// The random-operation exerciser (writes, reads, truncations, fallocate, copy_file_range,
/// mapped I/O) on two mounts of a replicated cluster: every read matches the model, and
/// every stripe's copies end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exerciser_on_replicated_files_leaves_identical_copies() {
    if !fuse_available() {
        return;
    }
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    let cluster = Cluster::start_with(options).await;
    let left = Mount::start(&cluster, "left", &[]);
    let right = Mount::start(&cluster, "right", &[]);
    let operations = std::env::var("FREEFLOW_EXERCISE_OPS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(2_000u64);
    let mut target = freeflow_exercise::posix::PosixTarget::open(vec![
        left.path("exercised"),
        right.path("exercised"),
    ])
    .expect("open on both mounts");
    let run = freeflow_exercise::Options {
        operations,
        seed: 11,
        size_max: 1 << 20,
        length_max: 128 << 10,
        ..freeflow_exercise::Options::default()
    };
    let report =
        tokio::task::spawn_blocking(move || freeflow_exercise::run(&mut target, &run, 0, |_| {}))
            .await
            .expect("exerciser task")
            .unwrap_or_else(|failure| panic!("{failure}\n{}", left.log_text()));
    assert_eq!(report.operations, operations);
    let client = cluster.client().await;
    let compared = assert_copies_identical(&cluster.io_data_dirs(), &client, "/exercised").await;
    eprintln!("{report}; {compared} bytes of copies compared");
}

/// The meta server killed and started again while a writer appends to a replicated file:
/// the I/O servers' leases run out meanwhile (replicated stripes are not served), the
/// writer waits instead of failing, and everything it fsynced reads back afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meta_server_restart_pauses_replicated_writes_without_an_error() {
    let mut options = ClusterOptions::new(2);
    options.replicas = 2;
    let mut cluster = Cluster::start_with(options).await;
    let client = cluster.client().await;
    let handle = client
        .open_path("/appended", &OpenOptions::new().write(true).create(true))
        .await
        .expect("create");
    let mut expected = Vec::new();
    for index in 0..20u64 {
        if index == 5 {
            cluster.kill_meta();
            // Past the I/O servers' leases (server_down_after_ms / 2 = 1.5 s in tests): they
            // refuse replicated requests, and the map cannot be fetched either.
            tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
            let chunk = chunk_bytes(index);
            let restart = async {
                tokio::time::sleep(std::time::Duration::from_millis(1_000)).await;
                cluster.restart_meta().await;
            };
            let (written, ()) = tokio::join!(
                handle.write_at(expected.len() as u64, Bytes::from(chunk.clone())),
                restart
            );
            written.expect("a write while the meta server is down");
            handle.fsync().await.expect("fsync after the restart");
            expected.extend_from_slice(&chunk);
            continue;
        }
        let chunk = chunk_bytes(index);
        handle
            .write_at(expected.len() as u64, Bytes::from(chunk.clone()))
            .await
            .expect("write");
        handle.fsync().await.expect("fsync");
        expected.extend_from_slice(&chunk);
    }
    handle.close().await.expect("close");
    let reader = cluster.client().await;
    let read = reader
        .open_path("/appended", &OpenOptions::new().read(true))
        .await
        .expect("open to read");
    let bytes = read
        .read_at(0, expected.len() as u64 + 1)
        .await
        .expect("read back");
    assert_bytes_eq(&bytes, &expected, "the appended file");
    assert_copies_identical(&cluster.io_data_dirs(), &reader, "/appended").await;
}

/// A cluster as an operator builds one for many hosts: `freeflow init` writes the key and a
/// config per server (three metadata members under Raft, three I/O servers keeping two
/// copies), and each server runs its own process in a network namespace of its own, at the
/// host address init was given, with init's ports and timeouts unchanged. Clients and the
/// mount run here, on the switch.
struct InitCluster {
    dir: tempfile::TempDir,
    switch: NetSwitch,
    key: ClusterKey,
    metas: Vec<Option<Child>>,
    io: Vec<Option<Child>>,
}

/// Hosts of the init cluster: metadata members on switch hosts 0-2, I/O servers on 3-5.
const INIT_METAS: usize = 3;
const INIT_IOS: usize = 3;

impl InitCluster {
    fn start() -> InitCluster {
        let switch =
            NetSwitch::create(INIT_METAS + INIT_IOS).expect("a switch of network namespaces");
        let dir = tempfile::Builder::new()
            .prefix("freeflow-init-")
            .tempdir()
            .expect("a temporary directory");
        let hosts = |range: std::ops::Range<usize>| {
            range
                .map(|host| switch.ip(host))
                .collect::<Vec<_>>()
                .join(",")
        };
        let output = std::process::Command::new(FREEFLOW)
            .arg("init")
            .arg("--out")
            .arg(dir.path())
            .args(["--meta-host", &hosts(0..INIT_METAS)])
            .args(["--io-hosts", &hosts(INIT_METAS..INIT_METAS + INIT_IOS)])
            .arg("--key-path")
            .arg(dir.path().join("cluster.key"))
            .arg("--data-root")
            .arg(dir.path().join("data"))
            .args(["--replicas", "2"])
            .output()
            .expect("run freeflow init");
        assert!(
            output.status.success(),
            "freeflow init failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let key = ClusterKey::load(&dir.path().join("cluster.key")).expect("init wrote a key");
        let mut cluster = InitCluster {
            dir,
            switch,
            key,
            metas: (0..INIT_METAS).map(|_| None).collect(),
            io: (0..INIT_IOS).map(|_| None).collect(),
        };
        for member in 0..INIT_METAS {
            cluster.start_meta(member);
        }
        for server in 0..INIT_IOS {
            cluster.start_io(server);
        }
        cluster
    }

    fn start_meta(&mut self, member: usize) {
        let path = self.dir.path();
        let config = path.join(format!("meta-{}.toml", member + 1));
        let log = path.join(format!("meta-{}.log", member + 1));
        let command = self.switch.command(member, FREEFLOW);
        self.metas[member] = Some(spawn_server_as(command, "meta", &config, &log));
    }

    fn start_io(&mut self, server: usize) {
        let path = self.dir.path();
        let config = path.join(format!("io-{server}.toml"));
        let log = path.join(format!("io-{server}.log"));
        let command = self.switch.command(INIT_METAS + server, FREEFLOW);
        self.io[server] = Some(spawn_server_as(command, "io", &config, &log));
    }

    fn kill(child: &mut Option<Child>) {
        let mut child = child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }

    fn io_data_dirs(&self) -> Vec<PathBuf> {
        (0..INIT_IOS)
            .map(|server| self.dir.path().join("data").join(format!("io-{server}")))
            .collect()
    }

    fn meta_addresses(&self) -> Vec<String> {
        (0..INIT_METAS)
            .map(|member| format!("{}:7700", self.switch.ip(member)))
            .collect()
    }

    async fn leader(&self) -> Option<usize> {
        let running = self
            .meta_addresses()
            .into_iter()
            .enumerate()
            .filter(|(member, _)| self.metas[*member].is_some())
            .collect();
        leading_member(running, &self.key).await
    }

    async fn client(&self, name: &str) -> Client {
        let mut config = ClientConfig::new(self.meta_addresses().join(","), self.key.clone());
        config.client_name = name.to_string();
        poll_until(30_000, || async {
            Client::connect(config.clone()).await.ok()
        })
        .await
        .expect("a client connects to the init cluster")
    }

    fn logs(&self) -> Vec<PathBuf> {
        let path = self.dir.path();
        (1..=INIT_METAS)
            .map(|member| path.join(format!("meta-{member}.log")))
            .chain((0..INIT_IOS).map(|server| path.join(format!("io-{server}.log"))))
            .collect()
    }
}

impl Drop for InitCluster {
    fn drop(&mut self) {
        for child in self.metas.iter_mut().chain(self.io.iter_mut()) {
            if let Some(mut child) = child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The whole scenario as an operator would meet it: a cluster from `freeflow init`
/// configs (every server its own process and host, init's default timeouts), a mount and a
/// library client writing and fsyncing (files written, fsynced and renamed into place; a
/// stream appended and fsynced), and each kind of server loss in turn: kill -9 of the
/// metadata leader (restarted, it follows), kill -9 of an I/O server, an I/O server cut off
/// by the network, and an I/O server whose data directory is wiped. The writers never see
/// an error; every acknowledged byte reads back; the copies of every stripe end identical,
/// and so do the three metadata replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_from_init_configs_rides_out_each_kind_of_server_loss_in_turn() {
    if !fuse_available() || !NetSwitch::available() {
        return;
    }
    let mut cluster = InitCluster::start();
    let observer = cluster.client("observer").await;
    for server in 0..INIT_IOS as u32 {
        wait_for_state(&observer, server, MemberState::InService, "at the start").await;
    }
    let mount = Mount::start_in(
        cluster.dir.path(),
        &cluster.dir.path().join("client.toml"),
        "mnt",
        &[],
    );
    let mut workload = Workload::start(&mount, cluster.client("stream").await);
    workload.logs.extend(cluster.logs());
    workload.advance(5, "before any failure").await;

    // The metadata leader killed; the other two elect one and the writers go on. The killed
    // member comes back as a follower.
    let first = poll_until(20_000, || async { cluster.leader().await })
        .await
        .expect("a metadata leader");
    InitCluster::kill(&mut cluster.metas[first]);
    workload
        .advance(5, "after the metadata leader was killed")
        .await;
    let second = cluster.leader().await;
    assert!(
        second.is_some_and(|second| second != first),
        "no new leader: {second:?}"
    );
    cluster.start_meta(first);

    // An I/O server killed, put out, started again: it copies what it missed.
    InitCluster::kill(&mut cluster.io[0]);
    wait_for_state(&observer, 0, MemberState::Out, "after its kill").await;
    workload.advance(3, "with server 0 out").await;
    cluster.start_io(0);
    wait_for_state(&observer, 0, MemberState::InService, "after its restart").await;
    workload.advance(3, "after server 0 came back").await;

    // An I/O server cut off by the network (its port down, sockets left open).
    cluster.switch.cut(INIT_METAS + 1);
    wait_for_state(&observer, 1, MemberState::Out, "while it is cut off").await;
    workload.advance(3, "while server 1 is cut off").await;
    cluster.switch.heal(INIT_METAS + 1);
    wait_for_state(&observer, 1, MemberState::InService, "after the cut healed").await;
    workload.advance(3, "after server 1 came back").await;

    // An I/O server that loses its disk: rebuilt in full from its partners.
    InitCluster::kill(&mut cluster.io[2]);
    std::fs::remove_dir_all(&cluster.io_data_dirs()[2]).expect("wipe server 2's data");
    wait_for_state(&observer, 2, MemberState::Out, "after its kill").await;
    workload.advance(3, "with server 2 out").await;
    cluster.start_io(2);
    wait_for_state(&observer, 2, MemberState::InService, "after its rebuild").await;
    workload.advance(3, "after server 2 was rebuilt").await;

    // Each writer made the 5 + 5 + 3 × 6 steps the phases waited for.
    stop_and_verify(workload, &cluster.io_data_dirs(), &mount, &observer, 28).await;
    for server in 0..INIT_IOS {
        assert_resynced(
            server,
            &read_log(&cluster.dir.path().join(format!("io-{server}.log"))),
        );
    }
    observer.shutdown().await;

    // The metadata replicas, stopped (followers first), hold the same tables.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leader = cluster
        .leader()
        .await
        .expect("a metadata leader at the end");
    for member in (0..INIT_METAS)
        .filter(|member| *member != leader)
        .chain([leader])
    {
        let child = cluster.metas[member].as_mut().expect("running");
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let stopped = poll_sync(20_000, || matches!(child.try_wait(), Ok(Some(_))));
        assert!(stopped, "metadata member {member} did not stop");
        cluster.metas[member] = None;
    }
    let digests: Vec<_> = (1..=INIT_METAS)
        .map(|member| {
            replica_digest(
                &cluster
                    .dir
                    .path()
                    .join("data")
                    .join(format!("meta-{member}")),
            )
        })
        .collect();
    // Servers started after the mount hold a copy of it in their namespaces' mount tables
    // (`ip netns exec` makes a mount namespace), which keeps its FUSE connection alive past
    // an unmount: they go first.
    for child in &mut cluster.io {
        InitCluster::kill(child);
    }
    drop(mount);
    assert!(digests[0].1 > 0, "the replicas hold nothing");
    assert!(
        digests.iter().all(|digest| *digest == digests[0]),
        "the metadata replicas differ: {digests:?}"
    );
    eprintln!("metadata replicas identical: {:?}", digests[0]);
}
