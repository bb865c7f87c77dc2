//! Coherent caches across mounts (issue 9): several `freeflow mount` processes of one
//! cluster, each with a warm kernel cache (the name stat'ed, the file read, the directory
//! listed just before), and a change made on one of them. The very next call on the others
//! must see it: no old name, inode, size or byte, and no missing name that now exists. The
//! mounts cache under leases of 10 s, so a revocation that did not reach a kernel would
//! show here as a stale answer, not as a slow one.
//!
//! Then what leases cost and save: a stopped or killed mount holds up others' changes one
//! lease at most, creates ask one lookup per name, and a warm stat asks nothing.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use common::mount::{errno_of, fuse_available, Mount};
use common::{assert_bytes_eq, Cluster, ClusterOptions, Xorshift};
use freeflow_metrics::text::Snapshot;

/// Lease of the clusters here whose test does not depend on it: long, so that a missed
/// revocation is seen as a stale answer.
const LONG_LEASE_MS: u32 = 10_000;

fn read_all(path: &Path) -> Vec<u8> {
    let mut bytes = Vec::new();
    File::open(path)
        .unwrap_or_else(|error| panic!("open {}: {error}", path.display()))
        .read_to_end(&mut bytes)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    bytes
}

fn names_of(directory: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(directory)
        .unwrap_or_else(|error| panic!("list {}: {error}", directory.display()))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Warm a mount's kernel cache for `relative`: its name and attributes, its bytes if it
/// is a file, its entries if a directory, and its parent's listing.
fn warm(mount: &Mount, relative: &str) {
    let path = mount.path(relative);
    let metadata =
        fs::metadata(&path).unwrap_or_else(|error| panic!("warm {}: {error}", path.display()));
    fs::metadata(&path).unwrap();
    if metadata.is_file() {
        read_all(&path);
    } else if metadata.is_dir() {
        names_of(&path);
    }
    names_of(path.parent().unwrap());
}

fn gone(path: &Path) -> bool {
    errno_of(fs::metadata(path)) == Some(libc::ENOENT)
        && errno_of(File::open(path)) == Some(libc::ENOENT)
}

async fn coherence_cluster(lease_ms: u32) -> Cluster {
    Cluster::start_with(ClusterOptions {
        metrics: true,
        cache_lease_ms: lease_ms,
        ..ClusterOptions::new(2)
    })
    .await
}

async fn scrape_meta(cluster: &Cluster) -> Snapshot {
    let address = cluster.meta_metrics_address().expect("metrics are on");
    let text = freeflow_metrics::scrape(address, Duration::from_secs(10))
        .await
        .unwrap_or_else(|error| panic!("scrape {address}: {error}"));
    Snapshot::parse(&text)
}

/// Requests the meta server served, by operation, between two scrapes.
fn meta_requests(before: &Snapshot, after: &Snapshot, operations: &[&str]) -> f64 {
    operations
        .iter()
        .map(|op| {
            after.sum("freeflow_rpc_requests_total", &[("op", op)])
                - before.sum("freeflow_rpc_requests_total", &[("op", op)])
        })
        .sum()
}

/// Every operation but those clients send on their own clock: revocation polls and
/// session renewals.
fn all_but_periodic(snapshot: &Snapshot) -> Vec<String> {
    snapshot
        .label_values("freeflow_rpc_requests_total", "op")
        .into_iter()
        .filter(|op| op != "WaitRevocations" && op != "RenewSession")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_caches_on_other_mounts_see_every_change_at_once() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let writer = Mount::start(&cluster, "a", &[]);
    let readers = [
        Mount::start(&cluster, "b", &[]),
        Mount::start(&cluster, "c", &[]),
    ];
    let mut random = Xorshift::new(9);

    // unlink
    fs::write(writer.path("unlinked"), b"soon gone").unwrap();
    readers.iter().for_each(|mount| warm(mount, "unlinked"));
    fs::remove_file(writer.path("unlinked")).unwrap();
    for mount in &readers {
        assert!(gone(&mount.path("unlinked")), "an unlinked name is gone");
        assert!(!names_of(&mount.mountpoint).contains(&"unlinked".to_string()));
    }

    // rename over an existing name
    fs::write(writer.path("target"), b"the old target").unwrap();
    fs::write(writer.path("source"), b"the source, renamed over it").unwrap();
    let source_inode = fs::metadata(writer.path("source")).unwrap().ino();
    for mount in &readers {
        warm(mount, "target");
        warm(mount, "source");
    }
    fs::rename(writer.path("source"), writer.path("target")).unwrap();
    for mount in &readers {
        assert!(
            gone(&mount.path("source")),
            "the old name of a rename is gone"
        );
        let target = mount.path("target");
        assert_eq!(fs::metadata(&target).unwrap().ino(), source_inode);
        assert_eq!(read_all(&target), b"the source, renamed over it");
    }

    // rename of a directory: its old path is gone, its children are under the new one
    fs::create_dir(writer.path("moving")).unwrap();
    fs::write(writer.path("moving/child"), b"child").unwrap();
    for mount in &readers {
        warm(mount, "moving");
        warm(mount, "moving/child");
    }
    fs::rename(writer.path("moving"), writer.path("moved")).unwrap();
    for mount in &readers {
        assert!(gone(&mount.path("moving/child")));
        assert!(gone(&mount.path("moving")));
        assert_eq!(read_all(&mount.path("moved/child")), b"child");
    }

    // rmdir, and a new directory of the same name
    fs::create_dir(writer.path("dir")).unwrap();
    readers.iter().for_each(|mount| warm(mount, "dir"));
    fs::remove_dir(writer.path("dir")).unwrap();
    for mount in &readers {
        assert!(gone(&mount.path("dir")), "a removed directory is gone");
        assert_eq!(
            errno_of(File::create(mount.path("dir/file"))),
            Some(libc::ENOENT),
            "nothing can be created in a removed directory"
        );
    }
    fs::create_dir(writer.path("dir")).unwrap();
    let new_inode = fs::metadata(writer.path("dir")).unwrap().ino();
    for mount in &readers {
        assert_eq!(fs::metadata(mount.path("dir")).unwrap().ino(), new_inode);
    }

    // chmod, chown
    fs::write(writer.path("owned"), b"x").unwrap();
    readers.iter().for_each(|mount| warm(mount, "owned"));
    fs::set_permissions(writer.path("owned"), fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(writer.path("owned"), Some(1234), Some(5678)).unwrap();
    for mount in &readers {
        let metadata = fs::metadata(mount.path("owned")).unwrap();
        assert_eq!(metadata.mode() & 0o7777, 0o640, "the new mode is seen");
        assert_eq!((metadata.uid(), metadata.gid()), (1234, 5678));
    }

    // truncate down, then up: no byte past the cut comes back
    let bytes = random.bytes(100_000);
    fs::write(writer.path("cut"), &bytes).unwrap();
    readers.iter().for_each(|mount| warm(mount, "cut"));
    let file = OpenOptions::new()
        .write(true)
        .open(writer.path("cut"))
        .unwrap();
    file.set_len(1_000).unwrap();
    for mount in &readers {
        assert_eq!(fs::metadata(mount.path("cut")).unwrap().len(), 1_000);
        assert_bytes_eq(
            &read_all(&mount.path("cut")),
            &bytes[..1_000],
            "after a cut",
        );
    }
    file.set_len(5_000).unwrap();
    drop(file);
    let mut expected = bytes[..1_000].to_vec();
    expected.resize(5_000, 0);
    for mount in &readers {
        assert_eq!(fs::metadata(mount.path("cut")).unwrap().len(), 5_000);
        assert_bytes_eq(&read_all(&mount.path("cut")), &expected, "after growing");
    }

    // write + close: the next open elsewhere sees the bytes and the size
    fs::write(writer.path("data"), random.bytes(3_000)).unwrap();
    readers.iter().for_each(|mount| warm(mount, "data"));
    let rewritten = random.bytes(3_000);
    fs::write(writer.path("data"), &rewritten).unwrap();
    for mount in &readers {
        assert_bytes_eq(&read_all(&mount.path("data")), &rewritten, "same size");
    }
    let longer = random.bytes(70_000);
    let mut file = OpenOptions::new()
        .append(true)
        .open(writer.path("data"))
        .unwrap();
    file.write_all(&longer).unwrap();
    drop(file);
    let mut expected = rewritten.clone();
    expected.extend_from_slice(&longer);
    for mount in &readers {
        assert_eq!(fs::metadata(mount.path("data")).unwrap().len(), 73_000);
        assert_bytes_eq(&read_all(&mount.path("data")), &expected, "appended");
    }

    // a name whose absence was cached is found once created
    for mount in &readers {
        assert!(gone(&mount.path("late")));
        assert!(gone(&mount.path("late")));
    }
    fs::write(writer.path("late"), b"here now").unwrap();
    for mount in &readers {
        assert_eq!(read_all(&mount.path("late")), b"here now");
    }
    fs::create_dir(writer.path("dir/deeper")).unwrap();
    for mount in &readers {
        assert!(gone(&mount.path("dir/deeper/link")));
    }
    std::os::unix::fs::symlink("../../late", writer.path("dir/deeper/link")).unwrap();
    for mount in &readers {
        assert_eq!(read_all(&mount.path("dir/deeper/link")), b"here now");
    }

    // a hard link: the link count and the new name
    readers.iter().for_each(|mount| warm(mount, "late"));
    fs::hard_link(writer.path("late"), writer.path("late-link")).unwrap();
    for mount in &readers {
        assert_eq!(fs::metadata(mount.path("late")).unwrap().nlink(), 2);
        assert_eq!(read_all(&mount.path("late-link")), b"here now");
    }

    // and back the other way: a change on a reader is seen by the writer's warm cache
    warm(&writer, "late");
    fs::remove_file(readers[0].path("late")).unwrap();
    assert!(gone(&writer.path("late")));
    assert_eq!(fs::metadata(writer.path("late-link")).unwrap().nlink(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_or_killed_mount_holds_up_changes_one_lease_at_most() {
    if !fuse_available() {
        return;
    }
    const LEASE_MS: u32 = 2_000;
    // What may come on top of the lease on a loaded machine: the mutation itself, the
    // server's margin, the scheduling of two loaded cores.
    const SLACK_MS: u64 = 3_000;
    let cluster = coherence_cluster(LEASE_MS).await;
    let writer = Mount::start(&cluster, "a", &[]);
    let mut holder = Mount::start(&cluster, "b", &[]);
    fs::write(writer.path("held"), b"cached elsewhere").unwrap();
    fs::write(writer.path("killed"), b"cached by a mount about to die").unwrap();
    warm(&holder, "held");
    warm(&holder, "killed");

    // A mount that stops answering (alive, connected, silent): waited for until its lease
    // runs out, then the change goes on.
    holder.signal(libc::SIGSTOP);
    let started = Instant::now();
    fs::remove_file(writer.path("held")).unwrap();
    let waited = started.elapsed();
    holder.signal(libc::SIGCONT);
    assert!(
        waited >= Duration::from_millis(u64::from(LEASE_MS) / 2),
        "the unlink waited for the silent holder's lease ({waited:?})"
    );
    assert!(
        waited <= Duration::from_millis(u64::from(LEASE_MS) + SLACK_MS),
        "the unlink waited {waited:?}, more than one lease"
    );
    assert!(gone(&holder.path("held")), "the holder's kernel dropped it");

    // A mount killed outright: the same bound.
    warm(&holder, "killed");
    holder.kill9();
    let started = Instant::now();
    fs::remove_file(writer.path("killed")).unwrap();
    let waited = started.elapsed();
    assert!(
        waited <= Duration::from_millis(u64::from(LEASE_MS) + SLACK_MS),
        "the unlink waited {waited:?}, more than one lease"
    );
    assert!(gone(&writer.path("killed")));
    let after = scrape_meta(&cluster).await;
    assert!(
        after.sum("freeflow_meta_revocation_expiries_total", &[]) >= 1.0,
        "the silent holder's revocation ran out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_ask_one_lookup_per_name_and_a_warm_stat_asks_nothing() {
    if !fuse_available() {
        return;
    }
    const FILES: usize = 1_000;
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let mount = Mount::start(&cluster, "a", &[]);
    let other = Mount::start(&cluster, "b", &[]);
    fs::create_dir(mount.path("d")).unwrap();
    let lookups = ["Lookup", "LookupEntry"];

    let before = scrape_meta(&cluster).await;
    for index in 0..FILES {
        File::create(mount.path(&format!("d/file-{index}"))).unwrap();
    }
    let after = scrape_meta(&cluster).await;
    let asked = meta_requests(&before, &after, &lookups);
    assert!(
        asked <= FILES as f64,
        "{asked} lookups for {FILES} creates (at most one per name)"
    );
    assert!(
        meta_requests(&before, &after, &["Create"]) >= FILES as f64,
        "the creates reached the server"
    );

    // A warm name: its second stat asks the meta server nothing, on either mount.
    for mount in [&mount, &other] {
        let path = mount.path("d/file-7");
        fs::metadata(&path).unwrap();
        let before = scrape_meta(&cluster).await;
        for _ in 0..100 {
            fs::metadata(&path).unwrap();
        }
        let after = scrape_meta(&cluster).await;
        let operations = all_but_periodic(&after);
        let asked: Vec<(&str, f64)> = operations
            .iter()
            .map(|op| (op.as_str(), meta_requests(&before, &after, &[op])))
            .filter(|(_, count)| *count > 0.0)
            .collect();
        assert!(asked.is_empty(), "100 warm stats asked {asked:?}");
    }
    let after = scrape_meta(&cluster).await;
    assert!(
        after.sum("freeflow_meta_leases_held", &[]) > 0.0,
        "the leases are counted"
    );
}
