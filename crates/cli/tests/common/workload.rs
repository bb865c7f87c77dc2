//! What the data-replication tests share: two writers that must never fail (files through
//! a mount, a stream through the library), and the checks that every acknowledged byte
//! reads back and every stripe's copies are identical on disk.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use freeflow_client::{Client, OpenOptions};
use freeflow_proto::meta::MemberState;

use super::mount::Mount;
use super::{assert_bytes_eq, object_path_in, poll_until, Xorshift};

/// Bytes of file `index` of the mount's writer: a pure function of the index.
pub fn file_bytes(index: u64) -> Vec<u8> {
    Xorshift::new(0x5EED ^ index).bytes(150_000 + (index as usize % 7) * 40_009)
}

/// Bytes of chunk `index` of the library's stream.
pub fn chunk_bytes(index: u64) -> Vec<u8> {
    Xorshift::new(0xBEEF ^ index).bytes(70_001)
}

pub async fn state_of(client: &Client, server: u32) -> Option<MemberState> {
    let report = client.cluster_status().await.ok()?;
    report
        .servers
        .iter()
        .find(|record| record.server_id == server)
        .map(|record| record.state)
}

pub async fn wait_for_state(client: &Client, server: u32, wanted: MemberState, what: &str) {
    let reached = poll_until(60_000, || async {
        (state_of(client, server).await == Some(wanted)).then_some(())
    })
    .await;
    assert!(
        reached.is_some(),
        "server {server} never became {wanted:?} ({what}); it is {:?}",
        state_of(client, server).await
    );
}

/// Two writers that must never fail: files written, fsynced and renamed into place through
/// the mount, and a stream appended and fsynced through the library.
pub struct Workload {
    pub stop: Arc<AtomicBool>,
    pub files_done: Arc<AtomicU64>,
    pub chunks_done: Arc<AtomicU64>,
    pub failures: Arc<Mutex<Vec<String>>>,
    /// The longest time one file of the mount's writer took (create, write, fsync,
    /// rename), in ms: the pause the failures caused.
    pub longest_ms: Arc<AtomicU64>,
    pub threads: Vec<std::thread::JoinHandle<()>>,
    pub stream: tokio::task::JoinHandle<()>,
    /// Logs shown when a writer failed.
    pub logs: Vec<std::path::PathBuf>,
}

impl Workload {
    pub fn start(mount: &Mount, client: Client) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let files_done = Arc::new(AtomicU64::new(0));
        let chunks_done = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let longest_ms = Arc::new(AtomicU64::new(0));
        let directory = mount.path("files");
        std::fs::create_dir_all(&directory).expect("mkdir through the mount");
        let writer = {
            let (stop, files_done, failures, longest_ms) = (
                stop.clone(),
                files_done.clone(),
                failures.clone(),
                longest_ms.clone(),
            );
            std::thread::spawn(move || {
                let mut index = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let started = std::time::Instant::now();
                    let temporary = directory.join(format!("f{index}.tmp"));
                    let done = (|| -> std::io::Result<()> {
                        let mut file = std::fs::File::create(&temporary)?;
                        file.write_all(&file_bytes(index))?;
                        file.sync_all()?;
                        drop(file);
                        std::fs::rename(&temporary, directory.join(format!("f{index}")))
                    })();
                    if let Err(error) = done {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("mount writer, file {index}: {error}"));
                        return;
                    }
                    longest_ms.fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
                    index += 1;
                    files_done.store(index, Ordering::Release);
                }
            })
        };
        let stream = {
            let (stop, chunks_done, failures) =
                (stop.clone(), chunks_done.clone(), failures.clone());
            tokio::spawn(async move {
                let handle = match client
                    .open_path("/stream", &OpenOptions::new().write(true).create(true))
                    .await
                {
                    Ok(handle) => handle,
                    Err(error) => {
                        failures
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!("stream open: {error}"));
                        return;
                    }
                };
                let mut offset = 0u64;
                let mut index = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let chunk = chunk_bytes(index);
                    let written = handle.write_at(offset, Bytes::from(chunk.clone())).await;
                    let synced = match written {
                        Ok(()) => handle.fsync().await,
                        Err(error) => Err(error),
                    };
                    if let Err(error) = synced {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("library stream, chunk {index}: {error}"));
                        return;
                    }
                    offset += chunk.len() as u64;
                    index += 1;
                    chunks_done.store(index, Ordering::Release);
                }
                let _ = handle.close().await;
            })
        };
        Workload {
            stop,
            files_done,
            chunks_done,
            failures,
            longest_ms,
            threads: vec![writer],
            stream,
            logs: vec![mount.log.clone()],
        }
    }

    pub fn check(&self, when: &str) {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if !failures.is_empty() {
            let logs: Vec<String> = self.logs.iter().map(|log| super::read_log(log)).collect();
            panic!("{when}: {failures:?}\n{}", logs.join("\n"));
        }
    }

    /// Wait until both writers made `more` steps past now.
    pub async fn advance(&self, more: u64, when: &str) {
        let (files, chunks) = (
            self.files_done.load(Ordering::Acquire),
            self.chunks_done.load(Ordering::Acquire),
        );
        let advanced = poll_until(60_000, || async {
            self.check(when);
            (self.files_done.load(Ordering::Acquire) >= files + more
                && self.chunks_done.load(Ordering::Acquire) >= chunks + more)
                .then_some(())
        })
        .await;
        self.check(when);
        assert!(advanced.is_some(), "{when}: the writers stalled");
    }

    pub async fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Release);
        for thread in std::mem::take(&mut self.threads) {
            thread.join().expect("writer thread");
        }
        (&mut self.stream).await.expect("stream task");
        self.check("at the end");
        eprintln!(
            "longest file (create, write, fsync, rename) through the mount: {} ms",
            self.longest_ms.load(Ordering::Relaxed)
        );
        (
            self.files_done.load(Ordering::Acquire),
            self.chunks_done.load(Ordering::Acquire),
        )
    }
}

pub fn read_object(data_dirs: &[PathBuf], server: u32, inode: u64, stripe: u32) -> Vec<u8> {
    let path = object_path_in(&data_dirs[server as usize], inode, stripe);
    let mut bytes = Vec::new();
    if let Ok(mut file) = std::fs::File::open(&path) {
        file.read_to_end(&mut bytes).expect("read an object file");
    }
    bytes
}

/// Every stripe of `path` (a path in the cluster) has identical copies on its chain.
pub async fn assert_copies_identical(data_dirs: &[PathBuf], client: &Client, path: &str) -> u64 {
    let attr = client.stat(path).await.expect("stat");
    let layout = attr.layout.expect("a regular file has a layout");
    assert_eq!(layout.replicas(), 2, "{path}: two copies of each stripe");
    // Chains as the service map makes them (a lost server's stand-in in its place).
    let map = client.service_map().await.expect("the service map");
    let mut compared = 0;
    for stripe in 0..layout.stripe_count() {
        let object = freeflow_client::ObjectId {
            inode: attr.inode,
            stripe_index: stripe,
        };
        // The members that serve reads: a stand-in still copying (a move under way, a
        // rebalance may start at any time) is not compared.
        let chain: Vec<u32> = map
            .chain(object, &layout.chain(stripe))
            .iter()
            .filter(|member| !member.filling)
            .map(|member| member.server)
            .collect();
        assert_eq!(
            chain.len(),
            2,
            "{path} stripe {stripe}: two copies serve reads in its chain {chain:?}"
        );
        let first = read_object(data_dirs, chain[0], attr.inode, stripe);
        for server in &chain[1..] {
            let other = read_object(data_dirs, *server, attr.inode, stripe);
            assert!(
                first == other,
                "{path} stripe {stripe}: the copy on server {} ({} bytes) differs from the one on server {server} ({} bytes)",
                chain[0],
                first.len(),
                other.len()
            );
            compared += first.len() as u64;
        }
    }
    compared
}

/// Stop the writers (each past `at_least` steps), then check every acknowledged byte and
/// the copies (`verify_everything`).
pub async fn stop_and_verify(
    workload: Workload,
    data_dirs: &[PathBuf],
    mount: &Mount,
    client: &Client,
    at_least: u64,
) {
    let (files, chunks) = workload.stop().await;
    assert!(
        files >= at_least && chunks >= at_least,
        "{files} files, {chunks} chunks"
    );
    let compared = verify_everything(data_dirs, mount, client, files, chunks).await;
    eprintln!(
        "{files} files and {chunks} stream chunks read back; {compared} bytes of copies compared"
    );
}

/// I/O server `server`'s log says it resynced.
pub fn assert_resynced(server: usize, log: &str) {
    let resynced = log.lines().find(|line| line.contains("resync done"));
    assert!(resynced.is_some(), "server {server} resynced:\n{log}");
    eprintln!("server {server}: {}", resynced.unwrap_or_default());
}

pub async fn verify_everything(
    data_dirs: &[PathBuf],
    mount: &Mount,
    client: &Client,
    files: u64,
    chunks: u64,
) -> u64 {
    let mut compared = 0;
    for index in 0..files {
        let path = mount.path(&format!("files/f{index}"));
        let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("read {path:?}: {error}"));
        assert_bytes_eq(&bytes, &file_bytes(index), &format!("file {index}"));
        assert_eq!(
            std::fs::metadata(&path).expect("stat").ino(),
            client
                .stat(&format!("/files/f{index}"))
                .await
                .expect("stat")
                .inode
        );
        compared += assert_copies_identical(data_dirs, client, &format!("/files/f{index}")).await;
    }
    let expected: Vec<u8> = (0..chunks).flat_map(chunk_bytes).collect();
    let stream = std::fs::read(mount.path("stream")).expect("read the stream");
    assert!(
        stream.len() >= expected.len(),
        "the stream lost acknowledged chunks: {} bytes, {} expected",
        stream.len(),
        expected.len()
    );
    assert_bytes_eq(&stream[..expected.len()], &expected, "the stream");
    compared + assert_copies_identical(data_dirs, client, "/stream").await
}
