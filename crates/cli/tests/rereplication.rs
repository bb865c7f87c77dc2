//! Re-replication (issue 42) with real processes: three I/O servers keeping two copies of
//! every stripe, written through a mount and the library. One server is killed and stays
//! dead past `server_dead_after_ms`: it is replaced in every chain, its stripes are copied
//! again from the survivors while the writers go on, and every stripe ends with two
//! identical copies on the two others. Then it comes back with its old disk and empties
//! itself of what it gave up, and a second server is lost: every acknowledged byte still
//! reads back. `freeflow status` and `freeflow fsck` tell the operator what happened.
//!
//! And a server drained while it runs (`freeflow server drain --wait`): every stripe moves
//! off it under the writers, those with one copy included (read locally before, written
//! during), then it is removed (`freeflow server remove`) and stopped with nothing lost;
//! its registration is refused from then on.

mod common;

use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use common::mount::{fuse_available, Mount};
use common::workload::{chunk_bytes, file_bytes, verify_everything, wait_for_state, Workload};
use common::{assert_bytes_eq, poll_until, read_log, Cluster, ClusterOptions, Xorshift, FREEFLOW};
use freeflow_client::{Client, ObjectId, OpenOptions};
use freeflow_proto::meta::MemberState;

/// How long a server may be out before it is taken as lost (the test waits this long).
const DEAD_AFTER_MS: u64 = 6_000;

fn cli(cluster: &Cluster, args: &[&str]) -> String {
    run_cli(
        cluster.client_toml(),
        args.iter().map(|arg| arg.to_string()).collect(),
    )
}

/// `freeflow --cluster TOML ARGS`: its output and errors.
fn run_cli(toml: std::path::PathBuf, args: Vec<String>) -> String {
    let output = Command::new(FREEFLOW)
        .arg("--cluster")
        .arg(toml)
        .args(&args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run freeflow");
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Wait until server `lost` is replaced and every stand-in has copied its stripes.
async fn wait_until_made_again(client: &Client, lost: u32, cluster: &Cluster) {
    let done = poll_until(120_000, || async {
        let map = client.service_map().await.ok()?;
        let replacement = map
            .replacements
            .iter()
            .find(|replacement| replacement.server == lost)?;
        replacement.filling.is_empty().then_some(())
    })
    .await;
    assert!(
        done.is_some(),
        "server {lost} was not replaced and copied again: {:?}\n{}\n{}",
        client.service_map().await.map(|map| map.replacements),
        cluster.meta_log(),
        (0..cluster.io_count())
            .map(|index| cluster.io_log(index))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Every byte the writers were answered for, read through a fresh library client.
async fn read_back(client: &Client, files: u64, chunks: u64) {
    for index in 0..files {
        let handle = client
            .open_path(&format!("/files/f{index}"), &OpenOptions::new().read(true))
            .await
            .unwrap_or_else(|error| panic!("open file {index}: {error}"));
        let bytes = handle.read_at(0, 1 << 20).await.expect("read a file");
        assert_bytes_eq(&bytes, &file_bytes(index), &format!("file {index}"));
        handle.close().await.expect("close");
    }
    let expected: Vec<u8> = (0..chunks).flat_map(chunk_bytes).collect();
    let handle = client
        .open_path("/stream", &OpenOptions::new().read(true))
        .await
        .expect("open the stream");
    let stream = handle
        .read_at(0, expected.len() as u64)
        .await
        .expect("read the stream");
    assert_bytes_eq(&stream, &expected, "the stream");
    handle.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_lost_for_good_is_replaced_and_a_second_loss_loses_nothing() {
    if !fuse_available() {
        return;
    }
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    options.metrics = true;
    options.server_dead_after_ms = Some(DEAD_AFTER_MS);
    let mut cluster = Cluster::start_with(options).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let observer = cluster.client().await;
    let mut workload = Workload::start(&mount, cluster.client().await);
    workload.logs.extend([
        cluster.path().join("meta.log"),
        cluster.path().join("io-0.log"),
        cluster.path().join("io-2.log"),
    ]);
    workload.advance(5, "before any failure").await;

    // Server 1 dies and does not come back in time: out after server_down_after_ms,
    // then lost, replaced, and its stripes copied again, all under the writers.
    cluster.kill_io(1);
    workload.advance(3, "while server 1 is dead").await;
    wait_for_state(&observer, 1, MemberState::Out, "after its kill").await;
    let files_before_loss = workload
        .files_done
        .load(std::sync::atomic::Ordering::Acquire);
    wait_until_made_again(&observer, 1, &cluster).await;
    workload.advance(5, "after server 1 was replaced").await;
    let status = cli(&cluster, &["status"]);
    assert!(
        status.contains("server 1 lost for good") && status.contains("every copy made again"),
        "status tells of the replacement:\n{status}"
    );
    let fsck = cli(&cluster, &["fsck"]);
    assert!(
        fsck.contains("0 problems") && fsck.contains("servers [1] lost for good"),
        "fsck counts the copies made again and leaves the lost server out:\n{fsck}"
    );
    let metrics = freeflow_metrics::scrape(
        cluster.meta_metrics_address().expect("metrics on"),
        Duration::from_secs(5),
    )
    .await
    .expect("scrape the meta server");
    let snapshot = freeflow_metrics::text::Snapshot::parse(&metrics);
    assert_eq!(
        (
            snapshot.value("freeflow_meta_io_replacements", &[]),
            snapshot.value("freeflow_meta_io_stand_ins_filling", &[])
        ),
        (Some(1.0), Some(0.0)),
        "the meta server's gauges count the record, its copies done"
    );
    let filled = cluster.io_log(0) + &cluster.io_log(2);
    assert!(
        filled.contains("fill done"),
        "a stand-in copied stripes:\n{filled}"
    );

    // Every stripe has two identical copies, neither on server 1.
    let (files, chunks) = workload.stop().await;
    assert!(files > files_before_loss, "{files} files");
    let compared =
        verify_everything(&cluster.io_data_dirs(), &mount, &observer, files, chunks).await;
    eprintln!("{files} files and {chunks} chunks read back; {compared} bytes of copies compared");
    let map = observer.service_map().await.expect("the service map");
    let mut inodes = Vec::new();
    for path in (0..files)
        .map(|index| format!("/files/f{index}"))
        .chain(["/stream".to_string()])
    {
        let attr = observer.stat(&path).await.expect("stat");
        let layout = attr.layout.expect("a layout");
        for stripe in 0..layout.stripe_count() {
            let object = ObjectId {
                inode: attr.inode,
                stripe_index: stripe,
            };
            assert!(
                !map.keeps(object, &layout, 1),
                "{path} stripe {stripe} still counts on lost server 1"
            );
        }
        inodes.push((attr.inode, layout.stripe_count()));
    }

    // Server 1 comes back with its old disk: it takes no stripe it gave up and removes its
    // old copies of them.
    cluster.restart_io(1).await;
    wait_for_state(&observer, 1, MemberState::InService, "after it came back").await;
    let emptied = poll_until(30_000, || async {
        inodes
            .iter()
            .all(|(inode, stripes)| {
                (0..*stripes).all(|stripe| !cluster.object_path(1, *inode, stripe).exists())
            })
            .then_some(())
    })
    .await;
    assert!(
        emptied.is_some(),
        "server 1 kept copies it gave up\n{}",
        cluster.io_log(1)
    );

    // A second loss: server 0. Nothing acknowledged is lost.
    cluster.kill_io(0);
    wait_for_state(&observer, 0, MemberState::Out, "after its kill").await;
    let reader = cluster.client().await;
    read_back(&reader, files, chunks).await;
    reader.shutdown().await;
    observer.shutdown().await;
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// `freeflow ARGS` on a blocking thread: the writers' tasks go on meanwhile.
async fn cli_async(cluster: &Cluster, args: &[&str]) -> String {
    let toml = cluster.client_toml();
    let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
    tokio::task::spawn_blocking(move || run_cli(toml, args))
        .await
        .expect("the command's thread")
}

/// Bytes of single-copy file `index`, `generation` times rewritten in part.
fn single_bytes(index: u64) -> Vec<u8> {
    Xorshift::new(0x51 ^ index).bytes(300_000 + index as usize * 7_919)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_server_gives_every_stripe_away_under_the_writers_and_is_removed() {
    if !fuse_available() {
        return;
    }
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    options.metrics = true;
    // Clients on this host read stripes with one copy from the servers' files.
    options.unix_sockets = true;
    let mut cluster = Cluster::start_with(options).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let observer = cluster.client().await;
    // Files with one copy of each stripe: a drain moves them too.
    observer
        .mkdir(freeflow_client::ROOT_INODE, "single", 0o755)
        .await
        .expect("mkdir");
    observer
        .set_dir_layout_path("/single", None, None, Some(1))
        .await
        .expect("one copy");
    let mut singles = Vec::new();
    for index in 0..12u64 {
        let path = format!("/single/s{index}");
        let handle = observer
            .open_path(
                &path,
                &OpenOptions::new().read(true).write(true).create(true),
            )
            .await
            .expect("create");
        handle
            .write_at(0, Bytes::from(single_bytes(index)))
            .await
            .expect("write");
        handle.fsync().await.expect("fsync");
        // Read once: the stripes on this host are read from their files from now on.
        let back = handle.read_at(0, 1 << 20).await.expect("read");
        assert_bytes_eq(&back, &single_bytes(index), &path);
        singles.push(handle);
    }
    let mut workload = Workload::start(&mount, cluster.client().await);
    workload.logs.extend([
        cluster.path().join("meta.log"),
        cluster.path().join("io-0.log"),
    ]);
    workload.advance(5, "before the drain").await;

    // Drain server 0 and wait for it; meanwhile the single-copy files are rewritten in
    // part through handles opened (and read locally) before the drain.
    let drain = {
        let toml_cluster = &cluster;
        let drained = cli_async(toml_cluster, &["server", "drain", "0", "--wait"]);
        let rewrite = async {
            for pass in 0..3u64 {
                for (index, handle) in singles.iter().enumerate() {
                    let mut expected = single_bytes(index as u64);
                    let offset =
                        (pass as usize * 65_537 + index * 4_099) % (expected.len() - 5_000);
                    let patch = Xorshift::new(pass << 8 | index as u64).bytes(5_000);
                    expected[offset..offset + 5_000].copy_from_slice(&patch);
                    handle
                        .write_at(offset as u64, Bytes::from(patch))
                        .await
                        .unwrap_or_else(|error| {
                            panic!("rewrite of s{index} during the drain: {error}")
                        });
                    let back = handle
                        .read_at(0, 1 << 20)
                        .await
                        .expect("read during the drain");
                    // Only this pass's patch is known here; compare the patched range.
                    assert_bytes_eq(
                        &back[offset..offset + 5_000],
                        &expected[offset..offset + 5_000],
                        &format!("s{index} during the drain"),
                    );
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        let (drained, ()) = tokio::join!(drained, rewrite);
        drained
    };
    assert!(
        drain.contains("drained and empty"),
        "the drain ended:\n{drain}\n{}",
        cluster.meta_log()
    );
    eprintln!("{drain}");
    workload.advance(5, "after the drain").await;
    let status = cli(&cluster, &["status"]);
    assert!(
        status.contains("server 0 drained") && status.contains("drain complete"),
        "status tells of the drain:\n{status}"
    );
    // Every single-copy file: its bytes after the last pass, no stripe on server 0.
    let map = observer.service_map().await.expect("the service map");
    for (index, handle) in singles.into_iter().enumerate() {
        let back = handle
            .read_at(0, 1 << 20)
            .await
            .expect("read after the drain");
        let mut expected = single_bytes(index as u64);
        for pass in 0..3u64 {
            let offset = (pass as usize * 65_537 + index * 4_099) % (expected.len() - 5_000);
            let patch = Xorshift::new(pass << 8 | index as u64).bytes(5_000);
            expected[offset..offset + 5_000].copy_from_slice(&patch);
        }
        assert_bytes_eq(&back, &expected, &format!("s{index} after the drain"));
        handle.close().await.expect("close");
        let attr = observer
            .stat(&format!("/single/s{index}"))
            .await
            .expect("stat");
        let layout = attr.layout.expect("a layout");
        for stripe in 0..layout.stripe_count() {
            let object = ObjectId {
                inode: attr.inode,
                stripe_index: stripe,
            };
            assert!(
                !map.keeps(object, &layout, 0),
                "s{index} stripe {stripe} on server 0"
            );
        }
    }

    // Removed, then stopped: the writers do not notice.
    let removed = cli(&cluster, &["server", "remove", "0"]);
    assert!(removed.contains("removed from the cluster"), "{removed}");
    let servers = observer.servers().await.expect("servers");
    assert!(
        servers.iter().all(|server| server.server_id != 0),
        "{servers:?}"
    );
    cluster.kill_io(0);
    workload
        .advance(3, "after server 0 was removed and stopped")
        .await;
    let (files, chunks) = workload.stop().await;
    let compared =
        verify_everything(&cluster.io_data_dirs(), &mount, &observer, files, chunks).await;
    eprintln!("{files} files and {chunks} chunks read back; {compared} bytes of copies compared");
    let fsck = cli(&cluster, &["fsck"]);
    assert!(fsck.contains("0 problems"), "{fsck}");

    // Its id is not used again.
    cluster.respawn_io(0).await;
    let refused = poll_until(20_000, || async {
        read_log(&cluster.path().join("io-0.log"))
            .contains("was removed from the cluster")
            .then_some(())
    })
    .await;
    assert!(refused.is_some(), "{}", cluster.io_log(0));
    observer.shutdown().await;
}

/// Bytes of base file `index` of the growth test.
fn base_bytes(index: u64) -> Vec<u8> {
    Xorshift::new(0xBA5E ^ index).bytes(512 << 10)
}

/// Used bytes per server in service (each on a disk of its own), as the meta server has
/// them from the heartbeats.
async fn usage(client: &Client) -> Vec<(u32, u64)> {
    client
        .servers()
        .await
        .expect("servers")
        .iter()
        .map(|server| (server.server_id, server.capacity_bytes - server.free_bytes))
        .collect()
}

/// Whether every server's used bytes are within `percent` of its share (equal disks).
fn even(usage: &[(u32, u64)], percent: u64) -> bool {
    let total: u64 = usage.iter().map(|(_, used)| used).sum();
    let share = total / usage.len() as u64;
    usage
        .iter()
        .all(|(_, used)| used.abs_diff(share) <= share / 100 * percent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_added_to_three_take_their_share_under_the_writers() {
    if !fuse_available() || !common::small_file_systems_available() {
        return;
    }
    let mut options = ClusterOptions::new(3);
    options.replicas = 2;
    options.metrics = true;
    // Each server on a disk of its own, as in a deployment: the rebalancer reads usage
    // from the disks.
    options.io_tmpfs_bytes = Some(512 << 20);
    options.rebalance_min_bytes = Some(4 << 20);
    let mut cluster = Cluster::start_with(options).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let observer = cluster.client().await;
    for index in 0..200u64 {
        let handle = observer
            .open_path(
                &format!("/base-{index}"),
                &OpenOptions::new().write(true).create(true),
            )
            .await
            .expect("create");
        handle
            .write_at(0, Bytes::from(base_bytes(index)))
            .await
            .expect("write");
        handle.close().await.expect("close");
    }
    let before = usage(&observer).await;
    let mut workload = Workload::start(&mount, cluster.client().await);
    workload.logs.extend([cluster.path().join("meta.log")]);
    workload.advance(5, "before the new servers").await;

    // Two servers join: new files go to them at once, and the rebalancer moves copies
    // of the old ones to them under the writers.
    cluster.add_io().await;
    cluster.add_io().await;
    workload.advance(5, "after two servers joined").await;
    let moved = poll_until(120_000, || async {
        let map = observer.service_map().await.ok()?;
        map.replacements
            .iter()
            .any(|replacement| replacement.drain && !replacement.drains_all())
            .then_some(())
    })
    .await;
    assert!(
        moved.is_some(),
        "no rebalance started: {:?}\n{}",
        usage(&observer).await,
        cluster.meta_log()
    );
    workload.advance(5, "while copies move").await;
    let (files, chunks) = workload.stop().await;

    // Once nothing moves any more, every server holds its share within 10%, the copies
    // are identical, and every byte reads back.
    let settled = poll_until(180_000, || async {
        let map = observer.service_map().await.ok()?;
        let moving = map.replacements.iter().any(|replacement| {
            !replacement.filling.is_empty() || (replacement.drain && !replacement.complete)
        });
        let now = usage(&observer).await;
        (!moving && now.len() == 5 && even(&now, 10)).then_some(now)
    })
    .await;
    let status = cli(&cluster, &["status"]);
    let Some(after) = settled else {
        panic!(
            "the servers' usage did not even out: {:?} (before the new ones: {before:?})\n{status}\n{}",
            usage(&observer).await,
            cluster.meta_log()
        );
    };
    eprintln!("used bytes before {before:?}, after {after:?}\n{status}");
    assert!(status.contains("rebalanced"), "{status}");
    let compared =
        verify_everything(&cluster.io_data_dirs(), &mount, &observer, files, chunks).await;
    eprintln!("{files} files and {chunks} chunks read back; {compared} bytes of copies compared");
    for index in 0..200u64 {
        let handle = observer
            .open_path(&format!("/base-{index}"), &OpenOptions::new().read(true))
            .await
            .expect("open");
        let bytes = handle.read_at(0, 1 << 20).await.expect("read");
        assert_bytes_eq(&bytes, &base_bytes(index), &format!("base file {index}"));
        handle.close().await.expect("close");
    }
    let fsck = cli(&cluster, &["fsck"]);
    assert!(fsck.contains("0 problems"), "{fsck}");
    observer.shutdown().await;
}
