//! Early replies and what keeps them safe (issue 10), with real processes: the meta server
//! answers mutations before they are durable; a kill -9 of it loses the last ones; the
//! clients that were answered replay them after its restart, and nothing is applied twice.
//! A change another client has seen was made durable first (commit on share), so it
//! survives even if its own client dies with the meta server; a change only its dead
//! client saw is lost, and the recovery window ends on time without that client.
//!
//! The clusters here commit durably only when they must (`commit_interval_ms` of a minute),
//! so every kill finds answered mutations that were not durable.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{poll_until, Cluster, ClusterOptions};
use freeflow_client::{Client, ErrorCode, FileKind, RenameMode, SetAttr, ROOT_INODE};

/// A cluster whose meta server makes nothing durable on a timer within a test's time.
async fn lazy_cluster(recovery_window_ms: u64) -> Cluster {
    let options = ClusterOptions {
        meta_commit_interval_ms: 60_000,
        recovery_window_ms,
        // The window is at least one cache lease.
        cache_lease_ms: (recovery_window_ms as u32).clamp(100, 10_000),
        ..ClusterOptions::new(1)
    };
    Cluster::start_with(options).await
}

async fn patient_client(cluster: &Cluster) -> Client {
    cluster
        .client_with(|config| config.call_timeout_ms = 60_000)
        .await
}

/// The names and permission bits of a directory's files.
async fn listing(client: &Client, directory: &str) -> BTreeMap<String, u32> {
    client
        .read_dir_all_plus(directory)
        .await
        .unwrap_or_else(|error| panic!("list {directory}: {error}"))
        .into_iter()
        .map(|entry| {
            let attr = entry.attr.expect("readdirplus gives attributes");
            (entry.name, attr.permissions)
        })
        .collect()
}

/// One client's stream: create, chmod, rename, and now and then unlink, in its own
/// directory; every acknowledged step is applied to `model`. Returns at `steps`.
async fn stream(
    client: Client,
    directory: u64,
    steps: u64,
    progress: Arc<Mutex<u64>>,
    model: Arc<Mutex<BTreeMap<String, u32>>>,
) -> Result<(), String> {
    for step in 0..steps {
        let name = format!("f{step}");
        let created = client
            .create(directory, &name, FileKind::Regular, 0o644, 0, true)
            .await
            .map_err(|error| format!("create {name}: {error}"))?;
        model.lock().unwrap().insert(name.clone(), 0o644);
        let mode = 0o600 + (step as u32 % 8);
        let changes = SetAttr {
            permissions: Some(mode),
            ..SetAttr::default()
        };
        client
            .setattr(created.inode, changes)
            .await
            .map_err(|error| format!("chmod {name}: {error}"))?;
        model.lock().unwrap().insert(name.clone(), mode);
        let renamed = format!("r{step}");
        client
            .rename(directory, &name, directory, &renamed, RenameMode::NoReplace)
            .await
            .map_err(|error| format!("rename {name}: {error}"))?;
        {
            let mut model = model.lock().unwrap();
            model.remove(&name);
            model.insert(renamed.clone(), mode);
        }
        if step % 3 == 2 {
            let victim = format!("r{}", step - 1);
            client
                .unlink(directory, &victim)
                .await
                .map_err(|error| format!("unlink {victim}: {error}"))?;
            model.lock().unwrap().remove(&victim);
        }
        *progress.lock().unwrap() = step + 1;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_mutations_of_two_clients_survive_a_meta_kill_by_replay() {
    const STEPS: u64 = 240;
    let mut cluster = lazy_cluster(30_000).await;
    let clients = [
        patient_client(&cluster).await,
        patient_client(&cluster).await,
    ];
    let mut streams = Vec::new();
    let mut progress = Vec::new();
    let mut models = Vec::new();
    for (index, client) in clients.iter().enumerate() {
        let directory = client
            .mkdir(ROOT_INODE, &format!("client-{index}"), 0o755)
            .await
            .expect("mkdir");
        let done = Arc::new(Mutex::new(0u64));
        let model = Arc::new(Mutex::new(BTreeMap::new()));
        streams.push(tokio::spawn(stream(
            client.clone(),
            directory.inode,
            STEPS,
            done.clone(),
            model.clone(),
        )));
        progress.push(done);
        models.push(model);
    }
    let halfway = poll_until(60_000, || async {
        progress
            .iter()
            .all(|done| *done.lock().unwrap() >= STEPS / 2)
            .then_some(())
    })
    .await;
    assert!(halfway.is_some(), "the streams got halfway");
    let kept: Vec<usize> = clients.iter().map(Client::kept_mutations).collect();
    cluster.kill_meta();
    assert!(
        kept.iter().all(|kept| *kept > 10),
        "both clients held answered mutations that were not durable: {kept:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.restart_meta().await;
    for (index, stream) in streams.into_iter().enumerate() {
        let outcome = tokio::time::timeout(Duration::from_secs(120), stream)
            .await
            .expect("the stream ends")
            .expect("no panic");
        // No EEXIST for a replayed create, no ENOENT for a second rename: nothing twice.
        outcome.unwrap_or_else(|error| panic!("client {index}: {error}\n{}", cluster.meta_log()));
    }
    let reader = cluster.client().await;
    for (index, model) in models.iter().enumerate() {
        let expected = model.lock().unwrap().clone();
        assert_eq!(expected.len() as u64, STEPS - STEPS / 3);
        assert_eq!(
            listing(&reader, &format!("/client-{index}")).await,
            expected,
            "client {index}: every acknowledged step, once"
        );
    }
    let log = cluster.meta_log();
    assert!(log.contains("waiting for clients to replay"), "{log}");
    assert!(log.contains("every client has replayed"), "{log}");
    for client in &clients {
        let counters = freeflow_metrics::text::Snapshot::parse(&client.metrics().render());
        assert!(counters.sum("freeflow_client_replayed_mutations_total", &[]) > 10.0);
        assert_eq!(
            counters.sum("freeflow_client_replay_lost_mutations_total", &[]),
            0.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_seen_elsewhere_survives_its_client_dying_with_the_meta_server() {
    const WINDOW_MS: u64 = 3_000;
    let mut cluster = lazy_cluster(WINDOW_MS).await;
    let doomed = patient_client(&cluster).await;
    let witness = patient_client(&cluster).await;
    let shared = doomed
        .mkdir(ROOT_INODE, "shared", 0o777)
        .await
        .expect("mkdir");
    doomed
        .create(shared.inode, "synced", FileKind::Regular, 0o644, 0, true)
        .await
        .expect("create synced");
    doomed.sync().await.expect("sync");
    doomed
        .create(shared.inode, "seen", FileKind::Regular, 0o644, 0, true)
        .await
        .expect("create seen");
    // Another client looks: commit on share makes what it saw durable.
    witness
        .stat("/shared/seen")
        .await
        .expect("the witness sees it");
    doomed
        .create(shared.inode, "unseen", FileKind::Regular, 0o644, 0, true)
        .await
        .expect("create unseen");
    assert!(
        doomed.kept_mutations() >= 1,
        "the last create is not durable"
    );

    // The meta server and the doomed client die together (the client is dropped: it never
    // reconnects, so it replays nothing).
    cluster.kill_meta();
    drop(doomed);
    cluster.restart_meta().await;
    let restarted = Instant::now();
    let newcomer = cluster.client().await;
    let seen = newcomer.stat("/shared/seen").await;
    let waited = restarted.elapsed();
    assert!(seen.is_ok(), "what another client saw survives: {seen:?}");
    assert!(
        waited < Duration::from_millis(WINDOW_MS + 15_000),
        "the window ended on time: {waited:?}"
    );
    newcomer
        .stat("/shared/synced")
        .await
        .expect("what was synced survives");
    assert_eq!(
        newcomer
            .stat("/shared/unseen")
            .await
            .map_err(|error| error.code())
            .map(|attr| attr.inode),
        Err(ErrorCode::NotFound),
        "only its dead client saw it: lost, and nothing else"
    );
    let log = cluster.meta_log();
    assert!(
        log.contains("recovery window over: these clients did not replay"),
        "{log}"
    );
    // The witness was expected too and replayed (nothing) when it came back.
    witness.stat("/shared").await.expect("the witness goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_mutation_that_was_durable_is_not_applied_twice() {
    let mut cluster = lazy_cluster(30_000).await;
    let client = patient_client(&cluster).await;
    let other = patient_client(&cluster).await;
    let directory = client.mkdir(ROOT_INODE, "own", 0o755).await.expect("mkdir");
    let created = client
        .create(directory.inode, "first", FileKind::Regular, 0o644, 0, true)
        .await
        .expect("create");
    client
        .rename(
            directory.inode,
            "first",
            directory.inode,
            "second",
            RenameMode::NoReplace,
        )
        .await
        .expect("rename");
    client
        .create(directory.inode, "first", FileKind::Regular, 0o600, 0, true)
        .await
        .expect("create the first name again");
    assert_eq!(client.kept_mutations(), 3, "kept: create, rename, create");
    // Made durable by someone else: this client does not know it yet, so it will replay
    // all three after the restart. Applied again, the rename would fail (the second name
    // exists) or the creates would find their names taken.
    other.sync().await.expect("sync");
    cluster.kill_meta();
    cluster.restart_meta().await;
    let listed = listing(&client, "/own").await;
    assert_eq!(
        listed,
        BTreeMap::from([("first".to_string(), 0o600), ("second".to_string(), 0o644)])
    );
    assert_eq!(
        client.stat("/own/second").await.expect("stat").inode,
        created.inode,
        "the file keeps its inode"
    );
    assert_eq!(
        client.kept_mutations(),
        0,
        "the replies showed them durable"
    );
    let counters = freeflow_metrics::text::Snapshot::parse(&client.metrics().render());
    assert_eq!(
        counters.sum("freeflow_client_replayed_mutations_total", &[]),
        3.0,
        "all three were replayed"
    );
    assert_eq!(
        counters.sum("freeflow_client_replay_lost_mutations_total", &[]),
        0.0,
        "and each was found applied: none refused as a conflict"
    );
    let log = cluster.meta_log();
    assert!(log.contains("every client has replayed"), "{log}");
}

/// Creates and unlinks a mount answered ahead of the meta server (in a directory delegated
/// to it) survive a kill -9 of the meta server in the middle of them: after its restart,
/// every name whose create returned is there, none whose unlink returned is, on the mount
/// and for a new client, and nothing was applied twice (a replayed or resent create with
/// its reserved number finds no copy of itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_and_unlinks_answered_ahead_survive_a_meta_kill() {
    if !common::mount::fuse_available() {
        return;
    }
    const OPS: usize = 6_000;
    let mut cluster = lazy_cluster(2_000).await;
    let mount = common::mount::Mount::start(&cluster, "m", &["--call-timeout-ms", "60000"]);
    std::fs::create_dir(mount.path("d")).unwrap();
    let directory = mount.path("d");
    let progress = Arc::new(Mutex::new(0usize));
    let worker = {
        let progress = Arc::clone(&progress);
        std::thread::spawn(move || {
            let mut model = std::collections::BTreeSet::new();
            // A request the mount cannot send while the meta server is down fails at once
            // with ENOTCONN, having done nothing: the application tries again.
            let retried = |what: &str, step: &mut dyn FnMut() -> std::io::Result<()>| loop {
                match step() {
                    Ok(()) => return,
                    Err(error) if error.raw_os_error() == Some(libc::ENOTCONN) => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(error) => panic!("{what}: {error}"),
                }
            };
            for index in 0..OPS {
                let name = format!("f{index}");
                let path = directory.join(&name);
                retried(&format!("create {name}"), &mut || {
                    std::fs::File::create_new(&path).map(|_| ())
                });
                model.insert(name);
                if index % 3 == 2 {
                    let name = format!("f{}", index - 1);
                    let path = directory.join(&name);
                    retried(&format!("unlink {name}"), &mut || {
                        std::fs::remove_file(&path)
                    });
                    model.remove(&name);
                }
                *progress.lock().unwrap() = index;
            }
            model
        })
    };
    let started = poll_until(30_000, || {
        let progress = Arc::clone(&progress);
        async move { (*progress.lock().unwrap() >= 500).then_some(()) }
    })
    .await;
    assert!(started.is_some(), "the worker never got going");
    cluster.kill_meta();
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.restart_meta().await;
    let model = tokio::task::spawn_blocking(move || worker.join())
        .await
        .expect("join task")
        .expect("the worker saw an error");
    assert!(
        *progress.lock().unwrap() == OPS - 1,
        "the worker finished every step"
    );
    let mut seen: Vec<String> = std::fs::read_dir(mount.path("d"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    seen.sort();
    let expected: Vec<String> = model.iter().cloned().collect();
    assert_eq!(
        seen.len(),
        expected.len(),
        "the mount lists what returned\n{}\n{}",
        mount.log_text(),
        cluster.all_logs()
    );
    assert_eq!(seen, expected);
    let client = patient_client(&cluster).await;
    let mut listed: Vec<String> = client
        .read_dir_all("/d")
        .await
        .unwrap()
        .into_iter()
        .map(|entry| entry.name)
        .collect();
    listed.sort();
    assert_eq!(listed, expected, "a new client lists what returned");
}

/// A handle opened before a kill -9 and restart of the meta server is closed right after
/// the restart, before the client's session renewer noticed it: the close succeeds (the
/// handle is gone with the old server's memory; its data was fsynced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_closed_right_after_a_meta_restart_closes() {
    let mut cluster = Cluster::start(1).await;
    let client = cluster.client().await;
    let handle = client
        .open_path(
            "/kept",
            &freeflow_client::OpenOptions::new().write(true).create(true),
        )
        .await
        .expect("create");
    handle
        .write_at(0, bytes::Bytes::from_static(b"before the restart"))
        .await
        .expect("write");
    handle.fsync().await.expect("fsync");
    cluster.kill_meta();
    cluster.restart_meta().await;
    handle.close().await.expect("close right after the restart");
}

/// A file a client holds open across a kill -9 and restart of the meta server, unlinked by
/// another client after the restart: the holder's session and handle were taken again in
/// the recovery window (`ReclaimSession`), so the new server counts the file open and its
/// reaper leaves the data alone, past the lease in which orphans from before a restart are
/// spared anyway. The holder reads back every byte, and the data goes once it closes.
/// (Before handles were reclaimed the new server counted nothing open and reaped at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_held_open_across_a_meta_restart_keeps_its_data_when_unlinked_after() {
    let mut cluster = Cluster::start(2).await;
    let holder = cluster.client().await;
    let other = cluster.client().await;
    let handle = holder
        .open_path(
            "/held",
            &freeflow_client::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true),
        )
        .await
        .expect("create");
    let bytes: Vec<u8> = (0..512 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    handle
        .write_at(0, bytes::Bytes::from(bytes.clone()))
        .await
        .expect("write");
    handle.fsync().await.expect("fsync");
    let inode = handle.inode();
    assert!(!cluster.object_files(inode).is_empty(), "objects written");

    cluster.kill_meta();
    cluster.restart_meta().await;
    // The holder finds the new server (its revocation poll notices the restart) and takes its
    // session and handle again before the window ends; the unlink waits for that.
    holder
        .getattr(ROOT_INODE)
        .await
        .expect("the holder reaches the restarted server");
    other
        .unlink(ROOT_INODE, "held")
        .await
        .expect("unlink after the restart");
    // Past one lease after the restart plus reaper passes: an orphan nobody counted open
    // would be gone by now.
    tokio::time::sleep(Duration::from_millis(
        u64::from(common::TEST_LEASE_MS) + 2_000,
    ))
    .await;
    assert!(
        !cluster.object_files(inode).is_empty(),
        "the data of a file held open across the restart was reaped\n{}",
        cluster.all_logs()
    );
    let read = handle
        .read_at(0, bytes.len() as u64)
        .await
        .expect("read through the held handle");
    assert!(
        read.as_ref() == bytes.as_slice(),
        "the held handle read {} bytes, not those written",
        read.len()
    );
    handle.close().await.expect("close the reclaimed handle");
    let gone = poll_until(30_000, || async {
        cluster.object_files(inode).is_empty().then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "objects of the unlinked file {inode} still there after its last close: {:?}",
        cluster.object_files(inode)
    );
}
