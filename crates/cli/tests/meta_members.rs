//! Issue 42: the metadata cluster's members change while clients write (two library
//! writers and a writer through a FUSE mount, each checking every byte), with real
//! processes from config files: two members join (`join = true`, then `freeflow meta
//! add`: learners that catch up, then vote), the leader is removed (`freeflow meta
//! remove`), and a client that knew only the first three members finds the leader among
//! the new ones. The writers see no error, everything answered reads back byte for byte,
//! and the members left end identical.

mod common;

use std::time::Duration;

use common::mount::{fuse_available, Mount};
use common::poll_until;
use common::replicated::ReplicatedCluster;
use common::replicated::{start_writers, stop_and_compare, writers_done_and_checked};
use freeflow_client::{Client, ClientConfig};

/// Files the mount writer makes: `m/f{index}`, each `MOUNT_FILE_BYTES` of its own pattern.
const MOUNT_FILES: usize = 100;
const MOUNT_FILE_BYTES: usize = 96 << 10;

fn mount_bytes(index: usize) -> Vec<u8> {
    (0..MOUNT_FILE_BYTES)
        .map(|offset| (offset as u8).wrapping_mul(13) ^ (index as u8).wrapping_mul(29))
        .collect()
}

/// Write, fsync and close every file through the mount, a little apart; any error is one an
/// application would have seen.
fn mount_writer(mount: &std::path::Path) {
    use std::io::Write;
    let directory = mount.join("m");
    std::fs::create_dir(&directory).expect("mkdir through the mount");
    for index in 0..MOUNT_FILES {
        let path = directory.join(format!("f{index}"));
        let mut file = std::fs::File::create(&path)
            .unwrap_or_else(|error| panic!("create {}: {error}", path.display()));
        file.write_all(&mount_bytes(index))
            .unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
        file.sync_all()
            .unwrap_or_else(|error| panic!("fsync {}: {error}", path.display()));
        drop(file);
        std::thread::sleep(Duration::from_millis(40));
    }
}

/// The term the leader leads in, as `status` tells it.
async fn leader_term(client: &Client) -> Option<u64> {
    let report = client.cluster_status().await.expect("status");
    report.meta_members.first().map(|member| member.term)
}

/// Start member `id` (`join = true`) and add it: it votes once caught up.
fn add(cluster: &mut ReplicatedCluster, id: u64) -> String {
    let index = cluster.new_member(id, None);
    let address = cluster.metas[index].address.clone();
    let raft_address = cluster.raft_address(index);
    cluster.meta(&[
        "add",
        &id.to_string(),
        "--address",
        &address,
        "--raft-address",
        &raft_address,
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_join_and_the_leader_leaves_under_writers_with_nothing_lost() {
    let mut cluster =
        ReplicatedCluster::start_configured(2, None, "metrics_address = \"127.0.0.1:0\"\n");
    let (first, clients, writers) = start_writers(&cluster).await;
    let first_addresses = cluster.meta_addresses();
    // A mount whose cluster file names only the first three members.
    let mount = fuse_available().then(|| {
        let file = cluster.dir.path().join("mount-client.toml");
        std::fs::write(
            &file,
            format!("meta_address = \"{first_addresses}\"\nkey_file = \"cluster.key\"\n"),
        )
        .expect("write the mount's cluster file");
        Mount::start_in(cluster.dir.path(), &file, "mnt", &[])
    });
    let mount_writing = mount.as_ref().map(|mount| {
        let root = mount.mountpoint.clone();
        std::thread::spawn(move || mount_writer(&root))
    });
    add(&mut cluster, 4);
    let said = add(&mut cluster, 5);
    for id in 1..=5 {
        assert!(
            said.lines().any(|line| line.starts_with(&format!("{id} "))
                && (line.contains("follower") || line.contains("leader"))),
            "member {id} does not vote after the adds: {said}"
        );
    }
    // The leader's metrics count the voters and give each other member's lag.
    let report = clients[0].cluster_status().await.expect("status");
    let address = report
        .meta_metrics_address
        .expect("the leader serves metrics");
    let text = freeflow_metrics::scrape(&address, Duration::from_secs(5))
        .await
        .expect("scrape the leader");
    let metrics = freeflow_metrics::text::Snapshot::parse(&text);
    assert_eq!(metrics.value("freeflow_meta_raft_voters", &[]), Some(5.0));
    assert_eq!(metrics.value("freeflow_meta_raft_learners", &[]), Some(0.0));
    for id in ["4", "5"] {
        assert!(
            metrics
                .value("freeflow_meta_raft_follower_lag_entries", &[("member", id)])
                .is_some(),
            "no lag for member {id}:\n{text}"
        );
    }
    // Bad changes are refused with the reason, and change nothing.
    let output = cluster.cli(&["meta", "remove", "9"]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("member 9 is not in the cluster"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let taken = cluster.metas[0].address.clone();
    let output = cluster.cli(&[
        "meta",
        "add",
        "6",
        "--learner",
        "--address",
        &taken,
        "--raft-address",
        "127.0.0.1:1",
    ]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("already uses address"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The leader leaves; the other four elect one among them.
    let leader_id = cluster.metas[first].id;
    cluster.meta(&["remove", &leader_id.to_string()]);
    let second = poll_until(30_000, || async {
        let leader = cluster.leader().await?;
        (leader != first).then_some(leader)
    })
    .await
    .unwrap_or_else(|| panic!("no leader after the removal\n{}", cluster.logs()));
    // The removed member knows it: it says so in its log (and to any client that asks it).
    let removed_log = cluster.metas[first].log.clone();
    poll_until(10_000, || async {
        std::fs::read_to_string(&removed_log)
            .ok()?
            .contains("this member was removed from the metadata cluster")
            .then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("the removed member does not know it\n{}", cluster.logs()));
    // The removed member is left running while the writers finish: it must disturb
    // nothing (no election of its own that deposes the new leader).
    let term_after_removal = leader_term(&clients[0]).await;
    writers_done_and_checked(&cluster, clients, writers).await;
    if let (Some(mount), Some(writing)) = (&mount, mount_writing) {
        if let Err(panic) = writing.join() {
            panic!(
                "the mount writer failed: {panic:?}\n{}\n{}",
                mount.log_text(),
                cluster.logs()
            );
        }
        for index in 0..MOUNT_FILES {
            let path = mount.path(&format!("m/f{index}"));
            let read = std::fs::read(&path)
                .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
            assert!(read == mount_bytes(index), "{} differs", path.display());
        }
        // The mount, whose cluster file names the removed leader and two others, works on
        // with the new leader.
        let after = mount.path("m/after-the-removal");
        std::fs::write(&after, b"written after the leader left").unwrap_or_else(|error| {
            panic!("write through the mount: {error}\n{}", mount.log_text())
        });
        assert_eq!(
            std::fs::read(&after).expect("read it back"),
            b"written after the leader left"
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = Client::connect(cluster.client_config("after"))
        .await
        .expect("connect");
    let term_now = leader_term(&status).await;
    status.shutdown().await;
    assert_eq!(
        term_now,
        term_after_removal,
        "the term changed after the removal: the removed member disturbed the others\n{}",
        cluster.logs()
    );
    cluster.stop_meta(first);
    // A client that knows only the first three members (one of them gone) finds the
    // leader, wherever it is now, through the members they name.
    let mut config = ClientConfig::new(first_addresses, cluster.key.clone());
    config.connect_timeout_ms = 1_000;
    let late = poll_until(20_000, || async {
        Client::connect(config.clone()).await.ok()
    })
    .await
    .expect("a client knowing only the first members connects");
    let report = late.cluster_status().await.expect("status");
    assert_eq!(
        report
            .meta_members
            .iter()
            .map(|member| member.id)
            .collect::<Vec<_>>(),
        (1..=5).filter(|id| *id != leader_id).collect::<Vec<_>>(),
        "members after the removal"
    );
    late.shutdown().await;
    if let Some(mut mount) = mount {
        assert!(
            mount.stop(),
            "the mount did not stop cleanly:\n{}",
            mount.log_text()
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!(
        "members after growing to five and removing leader {leader_id} (new leader: member {}): {digests:?}",
        cluster.metas[second].id
    );
}
