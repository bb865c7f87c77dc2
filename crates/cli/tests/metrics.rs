//! Metrics end to end (issue 5): the endpoints of a real cluster of `freeflow meta` and
//! `freeflow io` processes are scraped during a workload, and their counters must move with
//! the work done: the bytes the client wrote and read are the bytes the I/O servers report,
//! requests counted by the client are requests counted by the servers, and the meta
//! server's commits and inode count follow the creates. Then `freeflow top --once` against a
//! running `freeflow up` while a client writes through it.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{free_port_range, Cluster, ClusterOptions, Xorshift, FREEFLOW};
use freeflow_client::{Client, ClientConfig, ClusterKey, OpenOptions};
use freeflow_metrics::text::Snapshot;

const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

async fn scrape(address: &str) -> Snapshot {
    let text = freeflow_metrics::scrape(address, SCRAPE_TIMEOUT)
        .await
        .unwrap_or_else(|error| panic!("scrape {address}: {error}"));
    let snapshot = Snapshot::parse(&text);
    assert_eq!(
        snapshot.skipped_lines, 0,
        "{address} serves well-formed text"
    );
    snapshot
}

/// Every endpoint: the meta server's first, then the I/O servers' in order.
async fn scrape_cluster(cluster: &Cluster) -> Vec<Snapshot> {
    let mut snapshots = vec![scrape(cluster.meta_metrics_address().unwrap()).await];
    for index in 0..cluster.io_count() {
        snapshots.push(scrape(cluster.io_metrics_address(index).unwrap()).await);
    }
    snapshots
}

fn delta(before: &Snapshot, after: &Snapshot, name: &str, filter: &[(&str, &str)]) -> f64 {
    after.sum(name, filter) - before.sum(name, filter)
}

fn io_delta(before: &[Snapshot], after: &[Snapshot], name: &str, filter: &[(&str, &str)]) -> f64 {
    before[1..]
        .iter()
        .zip(&after[1..])
        .map(|(before, after)| delta(before, after, name, filter))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_move_with_the_work_done() {
    let options = ClusterOptions {
        metrics: true,
        ..ClusterOptions::new(3)
    };
    let cluster = Cluster::start_with(options).await;
    let before = scrape_cluster(&cluster).await;
    let client = cluster.client().await;
    let client_before = Snapshot::parse(&client.metrics().render());

    // Scrape every endpoint over and over while the workload runs: each answers, and no
    // counter goes backwards.
    let stop = Arc::new(AtomicBool::new(false));
    let addresses: Vec<String> = std::iter::once(cluster.meta_metrics_address().unwrap())
        .chain((0..cluster.io_count()).map(|index| cluster.io_metrics_address(index).unwrap()))
        .map(str::to_owned)
        .collect();
    let scraper = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            let mut rounds = 0u32;
            let mut last_written: BTreeMap<String, f64> = BTreeMap::new();
            while !stop.load(Ordering::Relaxed) {
                for address in &addresses {
                    let snapshot = scrape(address).await;
                    let written = snapshot.sum("freeflow_io_written_bytes_total", &[]);
                    let previous = last_written.insert(address.clone(), written).unwrap_or(0.0);
                    assert!(written >= previous, "{address}: written bytes went down");
                }
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            rounds
        }
    });

    const FILES: usize = 12;
    let mut random = Xorshift::new(5);
    let mut written_bytes = 0u64;
    let create = OpenOptions::new().read(true).write(true).create(true);
    for file in 0..FILES {
        let handle = client
            .open_path(&format!("/f{file}"), &create)
            .await
            .expect("create");
        // Unaligned sizes over several stripe units (64 KiB) of three servers.
        let length = (1 << 20) + random.below(200_000) as usize;
        let data = Bytes::from(random.bytes(length));
        handle.write_at(0, data.clone()).await.expect("write");
        if file % 4 == 0 {
            handle.fsync().await.expect("fsync");
        }
        handle.close().await.expect("close");
        written_bytes += length as u64;
    }
    let mut read_bytes = 0u64;
    for file in 0..FILES {
        let handle = client
            .open_path(&format!("/f{file}"), &OpenOptions::new().read(true))
            .await
            .expect("open");
        read_bytes += handle.read_at(0, handle.size()).await.expect("read").len() as u64;
        handle.close().await.expect("close");
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = scraper.await.expect("the scraper saw consistent counters");
    assert!(
        rounds >= 1,
        "the endpoints were scraped during the workload"
    );

    let after = scrape_cluster(&cluster).await;
    let client_after = Snapshot::parse(&client.metrics().render());
    let client_delta =
        |name: &str, filter: &[(&str, &str)]| delta(&client_before, &client_after, name, filter);

    // Bytes: what the workload wrote = what the client counted = what the servers wrote.
    // Writes are never resent, so the sums agree exactly.
    assert_eq!(read_bytes, written_bytes);
    assert_eq!(
        client_delta("freeflow_client_written_bytes_total", &[]),
        written_bytes as f64
    );
    assert_eq!(
        io_delta(&before, &after, "freeflow_io_written_bytes_total", &[]),
        written_bytes as f64,
        "bytes written by the client = sum of bytes written by the I/O servers"
    );
    assert_eq!(
        io_delta(
            &before,
            &after,
            "freeflow_rpc_request_payload_bytes_total",
            &[("op", "WriteObject")]
        ),
        written_bytes as f64
    );
    assert_eq!(
        client_delta("freeflow_client_read_bytes_total", &[]),
        read_bytes as f64
    );
    // Counted whichever way the server read them: the files were just written, so reads
    // of up to 128 KiB come from the page cache without the engine, and count the same.
    assert_eq!(
        io_delta(&before, &after, "freeflow_io_read_bytes_total", &[]),
        read_bytes as f64
    );
    let cached_reads = io_delta(&before, &after, "freeflow_io_cached_reads_total", &[]);
    assert!(cached_reads > 0.0, "no read came from the page cache");
    assert!(
        io_delta(
            &before,
            &after,
            "freeflow_io_disk_operations_total",
            &[("op", "read")]
        ) >= cached_reads,
        "reads answered from the cache are counted as reads"
    );
    // Every server took part (1 MiB files in 64 KiB units over three servers).
    for index in 1..after.len() {
        assert!(
            delta(
                &before[index],
                &after[index],
                "freeflow_io_written_bytes_total",
                &[]
            ) > 0.0,
            "I/O server {} wrote nothing",
            index - 1
        );
    }

    // Operations: the client's write requests are the servers' write requests, and each
    // reached the disk engine.
    let client_writes = client_delta("freeflow_client_requests_total", &[("op", "WriteObject")]);
    assert!(client_writes >= FILES as f64);
    assert_eq!(
        io_delta(
            &before,
            &after,
            "freeflow_rpc_requests_total",
            &[("op", "WriteObject")]
        ),
        client_writes
    );
    assert_eq!(
        io_delta(
            &before,
            &after,
            "freeflow_io_disk_operations_total",
            &[("op", "write")]
        ),
        client_writes
    );
    let fsyncs = io_delta(
        &before,
        &after,
        "freeflow_io_fsync_time_microseconds_count",
        &[],
    );
    assert!(fsyncs >= 3.0, "three fsyncs reached the disk: {fsyncs}");
    let write_times = io_delta(
        &before,
        &after,
        "freeflow_io_disk_time_microseconds_count",
        &[("op", "write")],
    );
    assert_eq!(write_times, client_writes);
    assert!(
        io_delta(&before, &after, "freeflow_io_engine_completions_total", &[]) >= client_writes
    );
    assert!(
        io_delta(&before, &after, "freeflow_io_engine_submissions_total", &[]) >= client_writes
    );

    // The meta server: creates counted, commits rising with them, the inode gauge moved.
    let (meta_before, meta_after) = (&before[0], &after[0]);
    let creates = delta(
        meta_before,
        meta_after,
        "freeflow_rpc_requests_total",
        &[("op", "Create")],
    );
    assert_eq!(
        creates,
        client_delta("freeflow_client_requests_total", &[("op", "Create")])
    );
    assert!(creates >= FILES as f64, "creates counted: {creates}");
    let commits = delta(meta_before, meta_after, "freeflow_meta_commits_total", &[]);
    let batched = delta(
        meta_before,
        meta_after,
        "freeflow_meta_commit_batch_operations_sum",
        &[],
    );
    assert!(commits >= 1.0, "commits rose with the creates");
    assert!(
        batched >= creates,
        "every create was in a batch: {batched} < {creates}"
    );
    assert!(commits <= batched, "a commit holds at least one mutation");
    assert_eq!(
        delta(meta_before, meta_after, "freeflow_meta_inodes", &[]),
        FILES as f64
    );
    assert_eq!(meta_after.sum("freeflow_meta_open_handles", &[]), 0.0);
    assert!(meta_after.sum("freeflow_meta_sessions", &[]) >= 1.0);
    assert!(meta_after
        .value("freeflow_meta_ready_milliseconds", &[])
        .is_some());
    client.shutdown().await;
}

/// `freeflow up` as a child on ports from `port`; its stdout lines are collected.
struct Up {
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
}

impl Up {
    /// Start `up` and wait until it is up; None if it exited first (a port was taken).
    fn try_start(data: &Path, port: u16, log: &Path) -> Option<Up> {
        let stderr = std::fs::File::create(log).expect("create the up log");
        let mut child = Command::new(FREEFLOW)
            .arg("up")
            .arg("--data")
            .arg(data)
            .args(["--io-servers", "2", "--port", &port.to_string()])
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("start freeflow up");
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let pipe = child.stdout.take().expect("piped stdout");
        let lines = Arc::clone(&stdout);
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().expect("not poisoned").push(line);
            }
        });
        let up = Up { child, stdout };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut up = up;
        while Instant::now() < deadline {
            if up
                .lines()
                .iter()
                .any(|line| line.contains("Freeflow is up"))
            {
                return Some(up);
            }
            if let Ok(Some(_)) = up.child.try_wait() {
                let log = common::read_log(log);
                assert!(log.contains("in use"), "freeflow up failed:\n{log}");
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("freeflow up not up within 60 s: {:?}", up.lines());
    }

    fn lines(&self) -> Vec<String> {
        self.stdout.lock().expect("not poisoned").clone()
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_once_shows_the_flow_through_a_running_up() {
    let scratch = tempfile::Builder::new()
        .prefix("freeflow-top-test-")
        .tempdir()
        .expect("temporary directory");
    let data = scratch.path().join("data");
    let log = scratch.path().join("up.log");
    let (port, up) = (0..5)
        .find_map(|_| {
            let port = free_port_range(&[0, 1, 10, 11, 100, 101]);
            Up::try_start(&data, port, &log).map(|up| (port, up))
        })
        .expect("freeflow up found free ports within 5 tries");
    // `up` prints every metrics URL: the meta server's and each I/O server's.
    let urls: Vec<String> = up
        .lines()
        .into_iter()
        .filter(|line| line.contains("/metrics"))
        .collect();
    for offset in [1, 100, 101] {
        let url = format!("http://127.0.0.1:{}/metrics", port + offset);
        assert!(
            urls.iter().any(|line| line.contains(&url)),
            "up prints {url}: {urls:?}"
        );
    }

    // A writer keeps data flowing while top takes its two scrapes.
    let key = ClusterKey::load(&data.join("cluster.key")).expect("the cluster key");
    let client = Client::connect(ClientConfig::new(format!("127.0.0.1:{port}"), key))
        .await
        .expect("connect");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn({
        let (client, stop) = (client.clone(), Arc::clone(&stop));
        async move {
            let create = OpenOptions::new().write(true).create(true);
            let handle = client.open_path("/flow", &create).await.expect("create");
            let chunk = Bytes::from(vec![7u8; 1 << 20]);
            let mut offset = 0u64;
            while !stop.load(Ordering::Relaxed) {
                handle.write_at(offset, chunk.clone()).await.expect("write");
                offset = (offset + chunk.len() as u64) % (64 << 20);
            }
            handle.close().await.expect("close");
        }
    });
    let cluster_file = data.join("client.toml");
    let run_top = |json: bool| {
        let cluster_file = cluster_file.clone();
        tokio::task::spawn_blocking(move || {
            let mut command = Command::new(FREEFLOW);
            command.arg("--cluster").arg(&cluster_file).args([
                "top",
                "--once",
                "--interval-ms",
                "1500",
            ]);
            if json {
                command.arg("--json");
            }
            command.output().expect("run freeflow top")
        })
    };
    let text = run_top(false).await.unwrap();
    let json = run_top(true).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    writer.await.expect("the writer ran");
    client.shutdown().await;

    let stdout = String::from_utf8_lossy(&text.stdout);
    println!("{stdout}");
    assert!(text.status.success(), "top --once failed: {text:?}");
    for needle in ["SERVER", "io 0", "io 1", "TOTAL", "meta", "ops/s"] {
        assert!(stdout.contains(needle), "top shows {needle:?}:\n{stdout}");
    }
    let total_line = stdout
        .lines()
        .find(|line| line.starts_with("TOTAL"))
        .expect("a total line");
    let total_write: f64 = total_line
        .split_whitespace()
        .nth(5)
        .and_then(|field| field.parse().ok())
        .unwrap_or_else(|| panic!("a write rate in {total_line:?}"));
    assert!(total_write > 0.0, "data was flowing:\n{stdout}");

    let json_text = String::from_utf8_lossy(&json.stdout);
    assert!(json.status.success(), "top --once --json failed: {json:?}");
    assert!(json_text.trim_start().starts_with('{') && json_text.trim_end().ends_with('}'));
    assert_eq!(
        json_text.matches("\"name\":\"io ").count(),
        2,
        "{json_text}"
    );
    let total_write: f64 = json_text
        .split("\"total\":{")
        .nth(1)
        .and_then(|total| total.split("\"write_mb_per_s\":").nth(1))
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("a total write rate in {json_text}"));
    assert!(total_write > 0.0, "data was flowing: {json_text}");
    drop(up);
}

/// Every PromQL expression of the Grafana dashboard (`dashboards/freeflow.json`), as
/// Grafana sends it with the dashboard's default variables.
fn dashboard_queries() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dashboards/freeflow.json");
    let text = std::fs::read_to_string(&path).expect("dashboards/freeflow.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    let queries: Vec<String> = panels
        .iter()
        .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
        .map(|target| {
            target["expr"]
                .as_str()
                .expect("every target has an expr")
                .to_owned()
        })
        .collect();
    assert!(
        queries.len() >= 20,
        "the dashboard has its panels: {}",
        queries.len()
    );
    queries
}

/// The metric names an expression reads.
fn metric_names(query: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = query;
    while let Some(start) = rest.find("freeflow_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_asks_only_for_metrics_the_cluster_serves() {
    let queries = dashboard_queries();
    let options = ClusterOptions {
        metrics: true,
        ..ClusterOptions::new(2)
    };
    let cluster = Cluster::start_with(options).await;
    let client = cluster.client().await;
    // A little of everything the panels show: writes, an fsync, reads, a failed lookup.
    let create = OpenOptions::new().read(true).write(true).create(true);
    let handle = client.open_path("/f", &create).await.expect("create");
    handle
        .write_at(0, Bytes::from(vec![3u8; 300_000]))
        .await
        .expect("write");
    handle.fsync().await.expect("fsync");
    assert_eq!(handle.read_at(0, 10).await.expect("read").len(), 10);
    handle.close().await.expect("close");
    assert!(client.stat("/missing").await.is_err());

    let mut served: Vec<(&str, Snapshot)> = vec![(
        "$meta_job",
        scrape(cluster.meta_metrics_address().unwrap()).await,
    )];
    for index in 0..cluster.io_count() {
        let address = cluster.io_metrics_address(index).unwrap();
        served.push(("$io_job", scrape(address).await));
    }
    served.push(("$client_job", Snapshot::parse(&client.metrics().render())));
    client.shutdown().await;

    let mut checked = 0;
    for query in &queries {
        let names = metric_names(query);
        assert!(!names.is_empty(), "{query} reads a Freeflow metric");
        for name in names {
            // The job the query selects must be an endpoint that serves the metric.
            let servers: Vec<&str> = served
                .iter()
                .filter(|(_, snapshot)| snapshot.samples.iter().any(|s| s.name == name))
                .map(|(job, _)| *job)
                .collect();
            assert!(
                !servers.is_empty(),
                "no endpoint serves {name} (in {query})"
            );
            assert!(
                servers.iter().any(|job| query.contains(job)),
                "{query} reads {name}, served under {servers:?}, from another job"
            );
            checked += 1;
        }
    }
    println!(
        "{checked} metric uses in {} dashboard queries checked",
        queries.len()
    );
}
