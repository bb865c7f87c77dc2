//! Namespace operations of two clients with a crash of the metadata server at a random
//! point (issue 10), against a model. The meta server runs in this process; the crash is
//! its data file as it was on disk at that point (what a kill -9 leaves: durable commits
//! only), from which a new server starts at the same address. One client dies with the
//! server; the other comes back and replays what it kept.
//!
//! The contract checked:
//! - every mutation the surviving client was answered is there, applied once;
//! - every mutation the dead client was answered that the survivor built on (any later
//!   operation of the survivor: they share one directory) was durable at the crash
//!   (commit on share), and is there;
//! - the dead client's other mutations are there exactly when they were durable.
//!
//! Each case starts two servers: 24 cases by default, `PROPTEST_CASES` for more.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use freeflow_client::{Client, ClientConfig, ClusterKey, FileKind};
use freeflow_meta::{MetaConfig, RunningMeta};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Symlink(u8),
    Mkdir(u8),
    Remove(u8),
    Rename(u8, u8),
    Look(u8),
    Sync,
}

fn name(index: u8) -> String {
    format!("n{}", index % 4)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<u8>().prop_map(Op::Symlink),
        2 => any::<u8>().prop_map(Op::Mkdir),
        2 => any::<u8>().prop_map(Op::Remove),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(from, to)| Op::Rename(from, to)),
        2 => any::<u8>().prop_map(Op::Look),
        1 => Just(Op::Sync),
    ]
}

/// What a successful mutation did to the one shared directory.
#[derive(Clone, Debug)]
enum Change {
    Insert(String, FileKind),
    Remove(String),
    Move(String, String),
}

impl Change {
    fn apply(&self, namespace: &mut BTreeMap<String, FileKind>) {
        match self {
            Change::Insert(name, kind) => {
                namespace.insert(name.clone(), *kind);
            }
            Change::Remove(name) => {
                namespace.remove(name);
            }
            Change::Move(from, to) => {
                if let Some(kind) = namespace.remove(from) {
                    namespace.insert(to.clone(), kind);
                }
            }
        }
    }
}

/// One step as run: who, what it changed (if it was a mutation that succeeded), and the
/// transaction that applied it.
struct Done {
    client: usize,
    change: Option<(Change, u64)>,
}

fn meta_config(data_dir: &Path, port: u16) -> MetaConfig {
    MetaConfig {
        listen_address: format!("127.0.0.1:{port}"),
        data_dir: data_dir.to_path_buf(),
        lease_ms: 60_000,
        // Nothing durable on a timer: only what must be.
        commit_interval_ms: 60_000,
        recovery_window_ms: 1_000,
        cache_lease_ms: 1_000,
        store_cache_bytes: 4 << 20,
        ..MetaConfig::default()
    }
}

async fn client(address: &str, key: &ClusterKey) -> Client {
    let mut config = ClientConfig::new(address.to_string(), key.clone());
    config.call_timeout_ms = 30_000;
    Client::connect(config).await.expect("connect")
}

async fn run_one(a: usize, step: &Op, clients: &[Client; 2]) -> Done {
    let client = &clients[a];
    let path = |index: u8| format!("/shared/{}", name(index));
    let change = match step {
        Op::Symlink(index) => client
            .symlink_path("target", &path(*index))
            .await
            .ok()
            .map(|_| Change::Insert(name(*index), FileKind::Symlink)),
        Op::Mkdir(index) => client
            .mkdir_path(&path(*index), 0o755)
            .await
            .ok()
            .map(|_| Change::Insert(name(*index), FileKind::Directory)),
        Op::Remove(index) => client
            .remove_path(&path(*index))
            .await
            .ok()
            .map(|()| Change::Remove(name(*index))),
        Op::Rename(from, to) => client
            .rename_path(&path(*from), &path(*to))
            .await
            .ok()
            .filter(|()| name(*from) != name(*to))
            .map(|()| Change::Move(name(*from), name(*to))),
        Op::Look(index) => {
            let _ = client.stat(&path(*index)).await;
            None
        }
        Op::Sync => {
            client.sync().await.expect("sync");
            None
        }
    };
    Done {
        client: a,
        change: change.map(|change| (change, client.last_mutation_txn())),
    }
}

async fn crash_case(steps: Vec<(usize, Op)>, crash_after: usize) -> Result<(), TestCaseError> {
    let scratch = tempfile::tempdir().expect("temporary directory");
    let key = ClusterKey::generate().expect("key");
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        listener.local_addr().expect("address").port()
    };
    let first_dir = scratch.path().join("first");
    let meta: RunningMeta = freeflow_meta::start(meta_config(&first_dir, port), key.clone())
        .await
        .expect("start the meta server");
    let address = meta.listen_address().to_string();
    let clients = [client(&address, &key).await, client(&address, &key).await];
    // Each client's first poll for revocations writes its record: let both be written, so
    // that the server is idle between steps (the copy below must not catch a write).
    let polling = || {
        let snapshot = freeflow_metrics::text::Snapshot::parse(&meta.metrics().render());
        snapshot.sum("freeflow_meta_lease_clients", &[])
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while polling() < 2.0 {
        assert!(std::time::Instant::now() < deadline, "both clients poll");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    clients[0]
        .mkdir_path("/shared", 0o777)
        .await
        .expect("mkdir /shared");
    clients[0].sync().await.expect("sync");

    let crash_after = crash_after.min(steps.len());
    let mut done = Vec::new();
    for (a, step) in &steps[..crash_after] {
        done.push(run_one(*a, step, &clients).await);
    }
    // The crash: the data file as it is on disk now (the server is idle between steps).
    let durable_at_crash = meta.durable_txn();
    let crash_dir = scratch.path().join("crash");
    std::fs::create_dir_all(&crash_dir).expect("crash dir");
    std::fs::copy(
        first_dir.join(freeflow_meta::DATABASE_FILE_NAME),
        crash_dir.join(freeflow_meta::DATABASE_FILE_NAME),
    )
    .expect("copy the data file as it is on disk");
    meta.shutdown().await;
    let [survivor, dead] = clients;
    drop(dead);
    let restarted = freeflow_meta::start(meta_config(&crash_dir, port), key.clone())
        .await
        .expect("restart from the crash image");

    // The contract, case by case.
    let mut expected = BTreeMap::new();
    for (index, step) in done.iter().enumerate() {
        let Some((change, txn)) = &step.change else {
            continue;
        };
        let survives = if step.client == 0 {
            true
        } else {
            let built_on = done[index + 1..].iter().any(|later| later.client == 0);
            if built_on {
                prop_assert!(
                    *txn <= durable_at_crash,
                    "the survivor built on step {index} ({change:?}, txn {txn}), not durable at \
                     the crash (durable {durable_at_crash})"
                );
            }
            *txn <= durable_at_crash
        };
        if survives {
            change.apply(&mut expected);
        }
    }
    let listed: BTreeMap<String, FileKind> = tokio::time::timeout(
        Duration::from_secs(60),
        survivor.read_dir_all_plus("/shared"),
    )
    .await
    .expect("the survivor is served after its replay")
    .expect("list /shared")
    .into_iter()
    .map(|entry| (entry.name, entry.kind))
    .collect();
    prop_assert_eq!(listed, expected, "after the crash and the replay");
    survivor.shutdown().await;
    restarted.shutdown().await;
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(24)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn answered_changes_survive_a_crash_as_the_contract_says(
        steps in prop::collection::vec((0usize..2, op()), 1..30),
        crash_after in 0usize..30,
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(crash_case(steps, crash_after))?;
    }
}
