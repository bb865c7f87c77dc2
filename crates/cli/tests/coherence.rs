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
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use common::mount::{errno_of, fuse_available, io_uring_available, open_rw, Mount};
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

/// Append `text` to `path` and close it (`echo text >> path`).
fn append(path: &Path, text: &str) {
    let mut file = OpenOptions::new().append(true).open(path).unwrap();
    file.write_all(text.as_bytes()).unwrap();
}

/// Wait (5 s at most) until `fstat` of the held `file` gives `expected` bytes.
fn wait_for_size(file: &File, expected: u64, what: &str) {
    wait_until_size(|| file.metadata().unwrap().len(), expected, what);
}

/// Wait (5 s at most) until `size()` gives `expected` bytes.
fn wait_until_size(size: impl Fn() -> u64, expected: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let size = size();
        if size == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the size stays at {size}, {expected} written"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Read what the held `reader` has past its position and check it is `line`, appended
/// elsewhere in `round`; it is then `seen` too.
fn read_appended(reader: &mut File, seen: &mut Vec<u8>, line: &str, round: usize) {
    let mut more = Vec::new();
    reader.read_to_end(&mut more).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&more),
        line,
        "round {round}: the appended bytes"
    );
    seen.extend_from_slice(&more);
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

/// Every operation but those sent on their own clock: clients' revocation polls, session
/// and lease renewals, and the I/O servers' heartbeats.
fn all_but_periodic(snapshot: &Snapshot) -> Vec<String> {
    snapshot
        .label_values("freeflow_rpc_requests_total", "op")
        .into_iter()
        .filter(|op| {
            !matches!(
                op.as_str(),
                "WaitRevocations" | "RenewSession" | "RenewLeases" | "RegisterServer"
            )
        })
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

/// What `count` stats of a warm name asked of the meta server, besides its periodic
/// requests and the gathered closes of earlier reads (they go out on their own time).
async fn stats_ask_nothing(cluster: &Cluster, path: &Path, count: usize) -> Vec<(String, f64)> {
    let before = scrape_meta(cluster).await;
    for _ in 0..count {
        fs::metadata(path).unwrap();
    }
    let after = scrape_meta(cluster).await;
    all_but_periodic(&after)
        .into_iter()
        .filter(|op| op != "CloseHandles")
        .map(|op| {
            let count = meta_requests(&before, &after, &[&op]);
            (op, count)
        })
        .filter(|(_, count)| *count > 0.0)
        .collect()
}

/// Leases are renewed while a mount lives: a name stat'ed several leases ago is still
/// answered by the kernel alone, and another mount's changes are seen at once all the same.
/// When the renewals stop succeeding (the meta server silent), the mount takes back what
/// it handed to its kernel before the leases end: its next stat asks the meta server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_names_outlive_their_lease_while_it_is_renewed_and_go_when_renewals_fail() {
    if !fuse_available() {
        return;
    }
    const LEASE_MS: u64 = 2_000;
    let cluster = coherence_cluster(LEASE_MS as u32).await;
    let holder = Mount::start(&cluster, "a", &[]);
    let changer = Mount::start(&cluster, "b", &[]);
    // The mounts' first renewals (soon after connect) start their runs.
    std::thread::sleep(Duration::from_millis(LEASE_MS / 2));
    fs::create_dir(changer.path("d")).unwrap();
    for name in ["kept", "unlinked", "grown", "stale"] {
        fs::write(changer.path(&format!("d/{name}")), b"0123456789").unwrap();
        warm(&holder, &format!("d/{name}"));
    }
    std::thread::sleep(Duration::from_millis(3 * LEASE_MS));
    let asked = stats_ask_nothing(&cluster, &holder.path("d/kept"), 100).await;
    assert!(
        asked.is_empty(),
        "100 stats three leases after the name was warmed asked {asked:?}"
    );

    // Changes elsewhere are still revoked from the renewed caches.
    fs::remove_file(changer.path("d/unlinked")).unwrap();
    assert!(gone(&holder.path("d/unlinked")), "an unlinked name is gone");
    append(&changer.path("d/grown"), "abc");
    assert_eq!(fs::metadata(holder.path("d/grown")).unwrap().len(), 13);
    assert_eq!(read_all(&holder.path("d/grown")), b"0123456789abc");

    // The meta server stops answering for longer than the renewals can bridge: the mount
    // drops what its kernel holds, so its next stat asks again.
    warm(&holder, "d/stale");
    let asked = stats_ask_nothing(&cluster, &holder.path("d/stale"), 10).await;
    assert!(asked.is_empty(), "warm before the silence: {asked:?}");
    cluster.signal_meta(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(LEASE_MS * 3 / 2));
    cluster.signal_meta(libc::SIGCONT);
    let before = scrape_meta(&cluster).await;
    fs::metadata(holder.path("d/stale")).unwrap();
    let after = scrape_meta(&cluster).await;
    let asked = meta_requests(&before, &after, &["Lookup", "LookupEntry", "GetAttr"]);
    assert!(
        asked >= 1.0,
        "after renewals failed for a lease, the stat asked the meta server ({asked} requests)"
    );
}

/// The kernel keeps a listing it read (its readdir cache) while the mount holds the leases
/// it was read under: a second listing of a warm directory asks the meta server nothing,
/// nor does the first one on the mount that made the directory and its names. Every change
/// another mount makes to it (a create, an unlink, renames within, into and out of it, a
/// directory made and removed, a hard link, a symlink) is in the next listing on each warm
/// mount, and so is a change the lister makes itself; the maker's own changes are in its
/// listings too. The directory spans several of the mount's pages of entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_the_kernel_keeps_show_every_change_at_once() {
    if !fuse_available() {
        return;
    }
    const FILES: usize = 2_100;
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let changer = Mount::start(&cluster, "a", &[]);
    let listers = [
        Mount::start(&cluster, "b", &[]),
        Mount::start(&cluster, "c", &[]),
    ];
    fs::create_dir(changer.path("d")).unwrap();
    fs::create_dir(changer.path("elsewhere")).unwrap();
    let mut expected: Vec<String> = (0..FILES).map(|index| format!("file-{index:05}")).collect();
    for name in &expected {
        File::create(changer.path(&format!("d/{name}"))).unwrap();
    }
    fs::write(changer.path("elsewhere/moved-in"), b"x").unwrap();

    // The mount that made the directory and every name in it lists it from what it knows.
    let before = scrape_meta(&cluster).await;
    assert_eq!(
        names_of(&changer.path("d")),
        expected,
        "the maker's listing"
    );
    let after = scrape_meta(&cluster).await;
    let asked = meta_requests(&before, &after, &["ReadDir"]);
    assert_eq!(asked, 0.0, "the maker's listing asked for {asked} pages");

    // Warm, then a second listing is the kernel's alone.
    for mount in &listers {
        assert_eq!(names_of(&mount.path("d")), expected, "the first listing");
        let before = scrape_meta(&cluster).await;
        assert_eq!(names_of(&mount.path("d")), expected, "the second listing");
        let after = scrape_meta(&cluster).await;
        let asked = meta_requests(&before, &after, &["ReadDir"]);
        assert_eq!(asked, 0.0, "a warm listing asked for {asked} pages");
    }

    let check = |change: &str, expected: &mut Vec<String>| {
        expected.sort();
        for mount in [&changer, &listers[0], &listers[1]] {
            for listing in ["the listing", "the listing again"] {
                let names = names_of(&mount.path("d"));
                let missing: Vec<&String> = expected
                    .iter()
                    .filter(|name| !names.contains(name))
                    .collect();
                let extra: Vec<&String> = names
                    .iter()
                    .filter(|name| !expected.contains(name))
                    .collect();
                assert!(
                    missing.is_empty() && extra.is_empty() && names.len() == expected.len(),
                    "{}: {listing} after {change} lacks {missing:?} and has {extra:?} too",
                    mount.mountpoint.display()
                );
            }
        }
    };
    File::create(changer.path("d/created")).unwrap();
    expected.push("created".to_string());
    check("a create", &mut expected);

    fs::remove_file(changer.path("d/file-00007")).unwrap();
    expected.retain(|name| name != "file-00007");
    check("an unlink", &mut expected);

    fs::rename(changer.path("d/file-00008"), changer.path("d/renamed")).unwrap();
    expected.retain(|name| name != "file-00008");
    expected.push("renamed".to_string());
    check("a rename within", &mut expected);

    fs::rename(changer.path("d/file-00009"), changer.path("d/file-00010")).unwrap();
    expected.retain(|name| name != "file-00009");
    check("a rename over a name", &mut expected);

    fs::rename(
        changer.path("elsewhere/moved-in"),
        changer.path("d/moved-in"),
    )
    .unwrap();
    expected.push("moved-in".to_string());
    check("a rename into it", &mut expected);

    fs::rename(
        changer.path("d/file-02099"),
        changer.path("elsewhere/moved-out"),
    )
    .unwrap();
    expected.retain(|name| name != "file-02099");
    check("a rename out of it", &mut expected);

    fs::create_dir(changer.path("d/sub")).unwrap();
    expected.push("sub".to_string());
    check("a mkdir", &mut expected);
    fs::remove_dir(changer.path("d/sub")).unwrap();
    expected.retain(|name| name != "sub");
    check("an rmdir", &mut expected);

    fs::hard_link(changer.path("d/created"), changer.path("d/linked")).unwrap();
    expected.push("linked".to_string());
    check("a hard link", &mut expected);

    std::os::unix::fs::symlink("created", changer.path("d/symlink")).unwrap();
    expected.push("symlink".to_string());
    check("a symlink", &mut expected);

    // A create whose directory then gets its old modify time back (as `tar` and
    // `rsync -a` do): the kernel cannot tell the listing changed from the time.
    let modified = fs::metadata(changer.path("d")).unwrap().modified().unwrap();
    File::create(changer.path("d/time-restored")).unwrap();
    File::open(changer.path("d"))
        .unwrap()
        .set_modified(modified)
        .unwrap();
    assert_eq!(
        fs::metadata(listers[0].path("d"))
            .unwrap()
            .modified()
            .unwrap(),
        modified,
        "the modify time is back"
    );
    expected.push("time-restored".to_string());
    check("a create behind a restored modify time", &mut expected);

    // A change made by a lister itself, seen by it and by the other.
    File::create(listers[0].path("d/by-a-lister")).unwrap();
    expected.push("by-a-lister".to_string());
    check("a lister's own create", &mut expected);
    fs::remove_file(listers[1].path("d/file-01500")).unwrap();
    expected.retain(|name| name != "file-01500");
    check("a lister's own unlink", &mut expected);
}

/// Name, type (from the listing's `d_type`) and inode (`d_ino`) of every entry of
/// `directory`, by name.
fn entries_of(directory: &Path) -> Vec<(String, fs::FileType, u64)> {
    use std::os::unix::fs::DirEntryExt;
    let mut entries: Vec<(String, fs::FileType, u64)> = fs::read_dir(directory)
        .unwrap_or_else(|error| panic!("list {}: {error}", directory.display()))
        .map(|entry| {
            let entry = entry.expect("an entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            (name, entry.file_type().expect("its type"), entry.ino())
        })
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    entries
}

/// The same from `lstat` of each name of `names` in `directory` (on a mount: a lookup of
/// each, which warms them).
fn entries_by_lstat(directory: &Path, names: &[String]) -> Vec<(String, fs::FileType, u64)> {
    let mut entries: Vec<(String, fs::FileType, u64)> = names
        .iter()
        .map(|name| {
            let metadata = fs::symlink_metadata(directory.join(name))
                .unwrap_or_else(|error| panic!("lstat {name}: {error}"));
            (name.clone(), metadata.file_type(), metadata.ino())
        })
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    entries
}

/// `READDIRPLUS` entries a mount gave, (with attributes, as names alone), from its metrics.
async fn listed_entries(address: &str) -> (f64, f64) {
    let text = freeflow_metrics::scrape(address, Duration::from_secs(10))
        .await
        .unwrap_or_else(|error| panic!("scrape {address}: {error}"));
    let snapshot = Snapshot::parse(&text);
    let listed = |attributes| {
        snapshot.sum(
            "freeflow_mount_listed_entries_total",
            &[("attributes", attributes)],
        )
    };
    (listed("given"), listed("held"))
}

/// Over the rings, a listing of names whose names and attributes the kernel holds already
/// (looked up just before) gives them as names alone, and a listing of names it does not
/// hold gives their attributes: what the program sees is the same either way (every name,
/// its type and its inode, as `lstat` has them), and a change another mount makes is in
/// the very next listing and `lstat` all the same (a replaced file's new inode, a removed
/// name gone, a new one there, a new mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_listings_give_held_names_alone_and_still_show_every_change() {
    if !fuse_available() || !io_uring_available() {
        return;
    }
    const FILES: usize = 300;
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let changer = Mount::start(&cluster, "a", &[]);
    let address = format!("127.0.0.1:{}", common::free_port());
    let lister = Mount::start(&cluster, "b", &["--metrics-address", &address]);
    let mut names: Vec<String> = (0..FILES).map(|index| format!("file-{index:03}")).collect();
    for directory in ["warm", "cold"] {
        fs::create_dir(changer.path(directory)).unwrap();
        for name in &names {
            File::create(changer.path(&format!("{directory}/{name}"))).unwrap();
        }
        fs::create_dir(changer.path(&format!("{directory}/sub"))).unwrap();
        std::os::unix::fs::symlink("file-000", changer.path(&format!("{directory}/link"))).unwrap();
        // The creates answered ahead have landed before the lister asks: landing later,
        // they would revoke the names it is being given (and the warm listing below would
        // rightly give some with attributes).
        File::open(changer.path(directory))
            .unwrap()
            .sync_all()
            .unwrap();
    }
    names.extend(["sub".to_string(), "link".to_string()]);

    // Not looked up on the lister: every entry of its first page goes with attributes.
    let (given, held) = listed_entries(&address).await;
    let cold = entries_of(&lister.path("cold"));
    let (given_after, held_after) = listed_entries(&address).await;
    assert_eq!(
        cold,
        entries_by_lstat(&changer.path("cold"), &names),
        "the cold listing"
    );
    assert!(
        given_after > given && held_after == held,
        "a cold listing gave {} entries with attributes and {} alone",
        given_after - given,
        held_after - held
    );

    // Looked up just before: names alone, and the same entries.
    let warm = entries_by_lstat(&lister.path("warm"), &names);
    let (given, held) = listed_entries(&address).await;
    assert_eq!(entries_of(&lister.path("warm")), warm, "the warm listing");
    let (given_after, held_after) = listed_entries(&address).await;
    assert!(
        held_after > held && given_after == given,
        "a warm listing gave {} entries alone and {} with attributes",
        held_after - held,
        given_after - given
    );
    assert_eq!(
        warm,
        entries_by_lstat(&changer.path("warm"), &names),
        "as the changer has them"
    );

    // Changes on the other mount, seen by the next listing and stat on the lister.
    fs::set_permissions(
        changer.path("warm/file-001"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    fs::remove_file(changer.path("warm/file-002")).unwrap();
    fs::write(changer.path("warm/file-002"), b"a new file").unwrap();
    fs::remove_file(changer.path("warm/file-003")).unwrap();
    File::create(changer.path("warm/file-new")).unwrap();
    names.retain(|name| name != "file-003");
    names.push("file-new".to_string());
    let truth = entries_by_lstat(&changer.path("warm"), &names);
    assert_eq!(
        entries_of(&lister.path("warm")),
        truth,
        "the lister's listing after the changes"
    );
    assert_eq!(
        entries_by_lstat(&lister.path("warm"), &names),
        truth,
        "the lister's lstat after the changes"
    );
    let mode = fs::metadata(lister.path("warm/file-001"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the new mode");
    assert_eq!(
        fs::read(lister.path("warm/file-002")).unwrap(),
        b"a new file",
        "the new file's bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_ask_no_lookup_where_the_mount_knows_every_name_and_a_warm_stat_asks_nothing() {
    if !fuse_available() {
        return;
    }
    const FILES: usize = 1_000;
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let mount = Mount::start(&cluster, "a", &[]);
    let other = Mount::start(&cluster, "b", &[]);
    fs::create_dir(mount.path("d")).unwrap();
    fs::create_dir(other.path("e")).unwrap();
    let lookups = ["Lookup", "LookupEntry"];

    // In a directory it made, the mount knows every name: a create's lookup of its new
    // name is answered without the meta server.
    let before = scrape_meta(&cluster).await;
    for index in 0..FILES {
        File::create(mount.path(&format!("d/file-{index}"))).unwrap();
    }
    let after = scrape_meta(&cluster).await;
    let asked = meta_requests(&before, &after, &lookups);
    assert_eq!(asked, 0.0, "{asked} lookups for {FILES} creates in d");
    // Creates answered ahead of the meta server (d is delegated to this mount) may still
    // be on their way when the loop ends.
    let arrived = common::poll_until(10_000, || {
        let (cluster, before) = (&cluster, &before);
        async move {
            let after = scrape_meta(cluster).await;
            (meta_requests(before, &after, &["Create"]) >= FILES as f64).then_some(after)
        }
    })
    .await;
    let after = arrived.expect("the creates reached the server");
    // The closes (the kernel's releases, after close(2) returned) go out gathered, and
    // all of them arrive.
    assert_eq!(
        meta_requests(&before, &after, &["Close"]),
        0.0,
        "no single Close"
    );
    let gathered = meta_requests(&before, &after, &["CloseHandles"]);
    assert!(
        gathered > 0.0 && gathered < FILES as f64,
        "{gathered} CloseHandles for {FILES} closes"
    );
    let still_open = common::poll_until(10_000, || async {
        let open = scrape_meta(&cluster)
            .await
            .sum("freeflow_meta_open_handles", &[]);
        (open == 0.0).then_some(())
    })
    .await;
    assert!(still_open.is_some(), "every gathered close arrived");

    // A name longer than a name may be is refused as such, not found missing in the
    // listing (pjdfstest's chmod/02.t failed on it when run in a directory the mount made).
    let long = "n".repeat(256);
    assert_eq!(
        errno_of(fs::metadata(mount.path(&format!("d/{long}")))),
        Some(libc::ENAMETOOLONG),
        "stat of a 256-byte name"
    );
    assert_eq!(
        errno_of(File::create(mount.path(&format!("d/{long}")))),
        Some(libc::ENAMETOOLONG),
        "create of a 256-byte name"
    );

    // In one another mount made, one lookup per name at most.
    let before = scrape_meta(&cluster).await;
    for index in 0..FILES {
        File::create(mount.path(&format!("e/file-{index}"))).unwrap();
    }
    let after = scrape_meta(&cluster).await;
    let asked = meta_requests(&before, &after, &lookups);
    assert!(
        asked > 0.0 && asked <= FILES as f64 + 1.0,
        "{asked} lookups for {FILES} creates in e (at most one per name, and e itself)"
    );

    // A name the mount answered as missing by itself, then made by the other mount: seen
    // at once (the other's create revoked the listing and the kernel's negative entry).
    assert!(gone(&mount.path("d/late")), "missing at first");
    File::create(other.path("d/late")).unwrap();
    assert!(
        mount.path("d/late").exists(),
        "the other mount's new name is seen"
    );
    let before = scrape_meta(&cluster).await;
    File::create(mount.path("d/after")).unwrap();
    let after = scrape_meta(&cluster).await;
    assert!(
        meta_requests(&before, &after, &lookups) >= 1.0,
        "the listing went with the other mount's change: lookups are asked again"
    );

    // A warm name: its second stat asks the meta server nothing, on either mount.
    for mount in [&mount, &other] {
        let path = mount.path("d/file-7");
        fs::metadata(&path).unwrap();
        // (The closes of the creates above may still be going out, gathered.)
        let asked = stats_ask_nothing(&cluster, &path, 100).await;
        assert!(asked.is_empty(), "100 warm stats asked {asked:?}");
    }
    let after = scrape_meta(&cluster).await;
    assert!(
        after.sum("freeflow_meta_leases_held", &[]) > 0.0,
        "the leases are counted"
    );
}

/// Creates and unlinks answered by the mount before the meta server has them (in a
/// directory the meta server delegated to it, issue 10) are seen by another mount at once:
/// by name, in a listing, with their data; and the mount's own later requests about them
/// (a write, an unlink, a create of a removed name, an rmdir of their directory) find them
/// there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_answered_ahead_are_seen_by_every_mount_at_once() {
    if !fuse_available() {
        return;
    }
    const FILES: usize = 600;
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let mount = Mount::start(&cluster, "a", &[]);
    let other = Mount::start(&cluster, "b", &[]);
    fs::create_dir(mount.path("d")).unwrap();
    let before = scrape_meta(&cluster).await;
    assert_eq!(
        before.sum("freeflow_meta_delegated_directories", &[]),
        1.0,
        "the new directory is delegated to the mount that made it"
    );
    for index in 0..FILES {
        let name = format!("d/file-{index}");
        File::create_new(mount.path(&name)).unwrap();
        if index % 25 == 0 {
            // The other mount asks at once: the meta server recalls the delegation, and
            // the mount answers the recall only once its creates are there.
            assert!(
                other.path(&name).exists(),
                "{name} unseen on the other mount"
            );
        }
    }
    let after = scrape_meta(&cluster).await;
    assert!(
        meta_requests(&before, &after, &["ReserveInodes"]) >= 1.0,
        "creates were answered ahead with reserved numbers"
    );
    assert_eq!(
        names_of(&other.path("d")).len(),
        FILES,
        "the other mount lists them all"
    );

    // Many at once, listed by the other mount right after the last is answered: those
    // still on their way are waited for by the recall, never missed.
    fs::create_dir(mount.path("y")).unwrap();
    for index in 0..FILES {
        File::create_new(mount.path(&format!("y/file-{index}"))).unwrap();
    }
    assert_eq!(
        names_of(&other.path("y")).len(),
        FILES,
        "a listing right after"
    );

    // Unlinks answered ahead as well: gone on the other mount at once, and a name
    // removed that way can be made again at once.
    fs::create_dir(mount.path("u")).unwrap();
    for index in 0..100 {
        File::create_new(mount.path(&format!("u/file-{index}"))).unwrap();
    }
    for index in 0..100 {
        fs::remove_file(mount.path(&format!("u/file-{index}"))).unwrap();
    }
    assert_eq!(
        names_of(&other.path("u")),
        Vec::<String>::new(),
        "unlinked at once"
    );
    fs::create_dir(mount.path("v")).unwrap();
    File::create_new(mount.path("v/again")).unwrap();
    assert!(other.path("v/again").exists());
    fs::create_dir(mount.path("v2")).unwrap();
    for round in 0..20 {
        let path = mount.path("v2/again");
        fs::write(&path, format!("round {round}")).unwrap();
        fs::remove_file(&path).unwrap();
        assert!(gone(&path), "round {round}: removed here");
    }
    fs::write(mount.path("v2/again"), b"last").unwrap();
    assert_eq!(read_all(&other.path("v2/again")), b"last");

    fs::create_dir(mount.path("w")).unwrap();
    // Written at once after its create, and read by the other mount after close.
    fs::write(mount.path("w/data"), b"written right after an early create").unwrap();
    assert_eq!(
        read_all(&other.path("w/data")),
        b"written right after an early create"
    );
    // Made and removed at once: gone everywhere, and its directory can go.
    for index in 0..20 {
        File::create_new(mount.path(&format!("w/tmp-{index}"))).unwrap();
        fs::remove_file(mount.path(&format!("w/tmp-{index}"))).unwrap();
    }
    fs::remove_file(mount.path("w/data")).unwrap();
    fs::remove_dir(mount.path("w")).unwrap();
    assert!(
        gone(&other.path("w")),
        "the removed directory is gone on the other mount"
    );

    // The other mount's create in a delegated directory: the first mount sees it, and its
    // own next create there is seen by the other.
    fs::create_dir(mount.path("x")).unwrap();
    File::create_new(mount.path("x/first")).unwrap();
    File::create_new(other.path("x/from-other")).unwrap();
    assert!(mount.path("x/from-other").exists());
    File::create_new(mount.path("x/again")).unwrap();
    assert!(other.path("x/again").exists());
    assert_eq!(names_of(&other.path("x")).len(), 3);
    assert_eq!(
        errno_of(File::create_new(mount.path("x/from-other"))),
        Some(libc::EEXIST)
    );
}

/// Write requests the I/O servers served so far.
async fn io_write_requests(cluster: &Cluster, io_count: usize) -> f64 {
    let mut total = 0.0;
    for index in 0..io_count {
        let address = cluster.io_metrics_address(index).expect("metrics are on");
        let text = freeflow_metrics::scrape(address, Duration::from_secs(10))
            .await
            .unwrap_or_else(|error| panic!("scrape {address}: {error}"));
        total +=
            Snapshot::parse(&text).sum("freeflow_rpc_requests_total", &[("op", "WriteObject")]);
    }
    total
}

/// A stream of small writes is gathered at the mount into few requests, and nothing of it
/// is lost or reordered: the writer reads back what it wrote mid-stream, and another mount
/// reads it all after the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_writes_are_gathered_and_every_mount_reads_them() {
    if !fuse_available() {
        return;
    }
    const RECORDS: usize = 4_000;
    const RECORD: usize = 100;
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let mount = Mount::start(&cluster, "a", &[]);
    let other = Mount::start(&cluster, "b", &[]);
    let expected: Vec<u8> = (0..RECORDS * RECORD).map(|i| (i % 251) as u8).collect();
    let before = io_write_requests(&cluster, 2).await;
    let mut file = open_rw(&mount.path("log"));
    for (index, record) in expected.chunks(RECORD).enumerate() {
        file.write_all(record).unwrap();
        if index == RECORDS / 2 {
            let mut back = vec![0u8; RECORD];
            file.read_exact_at(&mut back, (index * RECORD) as u64)
                .unwrap();
            assert_eq!(back, record, "the writer reads what it just wrote");
        }
    }
    drop(file);
    let writes = io_write_requests(&cluster, 2).await - before;
    assert!(
        writes > 0.0 && writes < (RECORDS / 10) as f64,
        "{writes} write requests for {RECORDS} writes of {RECORD} bytes"
    );
    assert_bytes_eq(
        &read_all(&other.path("log")),
        &expected,
        "close-to-open on another mount",
    );
}

/// A writeback mount's kernel keeps a file's size after the lease on it ran out, and no
/// revocation comes after that: the mount evicts such a file before its lease ends. A
/// change made elsewhere long after the file was read here is seen by the next calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writeback_mount_sees_changes_made_after_its_lease_ran_out() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(1_000).await;
    let writeback = Mount::start(&cluster, "a", &["--writeback"]);
    let plain = Mount::start(&cluster, "b", &[]);
    fs::write(plain.path("f"), b"0123456789").unwrap();
    for round in 0..2 {
        warm(&writeback, "f");
        std::thread::sleep(Duration::from_millis(2_500));
        append(&plain.path("f"), "abc");
        let expected = 10 + 3 * (round + 1);
        assert_eq!(
            fs::metadata(writeback.path("f")).unwrap().len(),
            expected as u64,
            "round {round}: the size after the lease ran out"
        );
        assert_eq!(
            read_all(&writeback.path("f")).len(),
            expected,
            "round {round}"
        );
    }
}

/// A reader that holds a file open on one mount sees another mount's appends once that
/// mount closed the file (`tail -f`): the size at its next `fstat`, the bytes at its next
/// read. Before, the handle answered short at the size it had at its open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_holding_a_file_open_sees_another_mounts_appends() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let reader_mount = Mount::start(&cluster, "a", &[]);
    let writer_mount = Mount::start(&cluster, "b", &[]);
    fs::write(writer_mount.path("log"), b"first line\n").unwrap();
    let mut reader = File::open(reader_mount.path("log")).unwrap();
    let mut seen = Vec::new();
    reader.read_to_end(&mut seen).unwrap();
    assert_eq!(seen, b"first line\n");
    for round in 0..3 {
        let line = format!("line {round} appended elsewhere\n");
        append(&writer_mount.path("log"), &line);
        let expected = seen.len() + line.len();
        assert_eq!(
            reader.metadata().unwrap().len(),
            expected as u64,
            "round {round}: fstat of the held file"
        );
        read_appended(&mut reader, &mut seen, &line, round);
    }
}

/// The same on a writeback mount, whose kernel keeps its own size of a file it holds open
/// (it ignores the meta server's): the mount raises it when another client's change to the
/// file is revoked or its lease runs out, so the reader sees the new size within a moment
/// (at `fstat` and by path) and reads the appended bytes, never zeros in their place. One
/// round appends at once (a revocation), one after the lease would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_holding_a_file_open_on_a_writeback_mount_sees_another_mounts_appends() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(1_000).await;
    let reader_mount = Mount::start(&cluster, "a", &["--writeback"]);
    let writer_mount = Mount::start(&cluster, "b", &[]);
    fs::write(writer_mount.path("log"), b"first line\n").unwrap();
    let mut reader = File::open(reader_mount.path("log")).unwrap();
    let mut seen = Vec::new();
    reader.read_to_end(&mut seen).unwrap();
    assert_eq!(seen, b"first line\n");
    for round in 0..4 {
        if round % 2 == 1 {
            std::thread::sleep(Duration::from_millis(2_500));
        }
        let line = format!(
            "line {round} appended elsewhere, {}\n",
            "x".repeat(round * 3000)
        );
        append(&writer_mount.path("log"), &line);
        let expected = (seen.len() + line.len()) as u64;
        wait_for_size(&reader, expected, &format!("round {round}"));
        assert_eq!(
            fs::metadata(reader_mount.path("log")).unwrap().len(),
            expected,
            "round {round}: stat by path"
        );
        read_appended(&mut reader, &mut seen, &line, round);
    }
    // The whole file again through the held descriptor: what was written, no zeros.
    reader.seek(SeekFrom::Start(0)).unwrap();
    let mut again = Vec::new();
    reader.read_to_end(&mut again).unwrap();
    assert_eq!(again, seen);
    // This host empties the file (`: > log`); the next append elsewhere, shorter than what
    // the file held before, shows all the same.
    drop(
        OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(reader_mount.path("log"))
            .unwrap(),
    );
    assert_eq!(reader.metadata().unwrap().len(), 0, "emptied here");
    let line = "after the cut\n";
    append(&writer_mount.path("log"), line);
    wait_for_size(&reader, line.len() as u64, "after emptying here");
    reader.seek(SeekFrom::Start(0)).unwrap();
    let mut after = Vec::new();
    reader.read_to_end(&mut after).unwrap();
    assert_eq!(String::from_utf8_lossy(&after), line);
}

/// A file held open for writing on a writeback mount while another mount appends to it and
/// closes: the kernel keeps this host's size while the write open is here, and shows the
/// other mount's growth once it closes (`after_last_write_close`): by path, to a reader
/// that still holds it, and to an open after the close. Without it the older size stayed
/// while the lease was renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writeback_mounts_last_write_close_shows_growth_made_elsewhere_meanwhile() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(1_000).await;
    let here = Mount::start(&cluster, "a", &["--writeback"]);
    let elsewhere = Mount::start(&cluster, "b", &["--writeback"]);
    for (round, keep_reader) in [(0, false), (1, true)] {
        let name = format!("grown{round}");
        let mut writer = File::create(here.path(&name)).unwrap();
        writer.write_all(&[b'h'; 1000]).unwrap();
        writer.sync_all().unwrap();
        let reader = keep_reader.then(|| File::open(here.path(&name)).unwrap());
        // The other mount appends and closes while this one holds the file open for
        // writing.
        append(&elsewhere.path(&name), &"e".repeat(5000));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            writer.metadata().unwrap().len(),
            1000,
            "round {round}: the kernel keeps this host's size while it writes here"
        );
        drop(writer);
        // Without the mend the older size stayed while the lease was renewed (60 s).
        wait_until_size(
            || fs::metadata(here.path(&name)).unwrap().len(),
            6000,
            &format!("round {round}: stat by path after the last write close"),
        );
        let mut expected = vec![b'h'; 1000];
        expected.extend_from_slice(&[b'e'; 5000]);
        assert_eq!(
            fs::read(here.path(&name)).unwrap(),
            expected,
            "round {round}"
        );
        if let Some(mut reader) = reader {
            let mut held = Vec::new();
            reader.read_to_end(&mut held).unwrap();
            assert_eq!(held, expected, "round {round}: through the descriptor held");
        }
    }
}

/// A writeback mount's kernel writes a file's change time inside each unlink of it; the
/// mount answers that from what it keeps while the unlink, answered ahead, is on its way
/// (`times_of_unlinked`). The link counts the kernel then holds are right, through a
/// descriptor and by the other name, here and on another mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlinks_on_a_writeback_mount_leave_the_link_counts_right() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let a = Mount::start(&cluster, "a", &["--writeback"]);
    let plain = Mount::start(&cluster, "b", &[]);
    fs::create_dir(a.path("d")).unwrap();
    for round in 0..20 {
        let (first, second) = (format!("d/f{round}"), format!("d/g{round}"));
        fs::write(a.path(&first), b"linked twice").unwrap();
        fs::hard_link(a.path(&first), a.path(&second)).unwrap();
        let held = File::open(a.path(&first)).unwrap();
        fs::remove_file(a.path(&first)).unwrap();
        assert_eq!(held.metadata().unwrap().nlink(), 1, "round {round}: fstat");
        assert_eq!(
            fs::metadata(a.path(&second)).unwrap().nlink(),
            1,
            "round {round}"
        );
        fs::remove_file(a.path(&second)).unwrap();
        assert_eq!(
            held.metadata().unwrap().nlink(),
            0,
            "round {round}: all gone"
        );
        assert!(gone(&plain.path(&first)) && gone(&plain.path(&second)));
    }
    // Files unlinked with their only name, many at once: all gone everywhere.
    for index in 0..200 {
        fs::write(a.path(&format!("d/n{index}")), b"x").unwrap();
    }
    for index in 0..200 {
        fs::remove_file(a.path(&format!("d/n{index}"))).unwrap();
    }
    assert!(fs::read_dir(a.path("d")).unwrap().next().is_none());
    assert!(fs::read_dir(plain.path("d")).unwrap().next().is_none());
}

/// Two writeback mounts writing different bytes of one page: the kernel writes back whole
/// pages, and a page one host read before the other wrote into it, or began past what it
/// knew as the end of the file (filling the rest with zeros), carried the old bytes or the
/// zeros over the other's. Only the bytes changed on each host go (`fuse/src/shadow.rs`),
/// and what a host knows the file holds starts from the size its kernel keeps, which can
/// be below the size at the open (`fuse/src/held.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writeback_mounts_writing_neighbouring_bytes_of_one_page_keep_both() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let a = Mount::start(&cluster, "a", &["--writeback"]);
    let b = Mount::start(&cluster, "b", &["--writeback"]);
    let plain = Mount::start(&cluster, "c", &[]);

    // An existing file: A reads its first page and changes a few bytes of it (a dirty
    // page in A's kernel); B writes elsewhere in that page and closes (its change recalls
    // A's page: A writes it back), then A closes.
    fs::write(plain.path("records"), vec![b'o'; 8192]).unwrap();
    let on_a = open_rw(&a.path("records"));
    let mut first = vec![0u8; 4096];
    on_a.read_exact_at(&mut first, 0).unwrap();
    assert_eq!(first, vec![b'o'; 4096]);
    on_a.write_all_at(b"AAAA", 0).unwrap();
    let on_b = open_rw(&b.path("records"));
    on_b.write_all_at(b"BBBB", 100).unwrap();
    drop(on_b);
    drop(on_a);
    let mut expected = vec![b'o'; 8192];
    expected[..4].copy_from_slice(b"AAAA");
    expected[100..104].copy_from_slice(b"BBBB");
    assert_bytes_eq(
        &read_all(&plain.path("records")),
        &expected,
        "a page read, then changed",
    );

    // A new file, two records meeting inside its first page, each written on one host:
    // A's kernel begins that page past the end it knows (0) and fills it with zeros.
    File::create(plain.path("n-to-1")).unwrap();
    let on_b = open_rw(&b.path("n-to-1"));
    let on_a = open_rw(&a.path("n-to-1"));
    on_b.write_all_at(&[b'B'; 1000], 0).unwrap();
    on_b.sync_all().unwrap();
    on_a.write_all_at(&[b'A'; 1000], 1000).unwrap();
    on_a.write_all_at(&[b'a'; 100], 3000).unwrap();
    drop(on_a);
    drop(on_b);
    let mut expected = vec![b'B'; 1000];
    expected.extend_from_slice(&[b'A'; 1000]);
    expected.extend_from_slice(&[0; 1000]);
    expected.extend_from_slice(&[b'a'; 100]);
    assert_bytes_eq(
        &read_all(&plain.path("n-to-1")),
        &expected,
        "records of two hosts",
    );

    // A's kernel holds the inode of an empty file (an `O_PATH` descriptor: no open at the
    // mount, so nothing raises its size) while B writes two pages; A opens it by path
    // again (the kernel keeps its size, 0, whatever the lookup says, and the meta server
    // gives the open 8,192 bytes) and writes a few bytes into the first page, which its
    // kernel begins past its own end, unread, filled with zeros. Once straight away, once
    // after an open that only allocates without changing the size (`FALLOC_FL_KEEP_SIZE`).
    let mut expected = vec![b'B'; 8192];
    expected[100..104].copy_from_slice(b"aaaa");
    for (name, allocate_first) in [("held", false), ("held-kept", true)] {
        File::create(plain.path(name)).unwrap();
        let held = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(a.path(name))
            .unwrap();
        fs::write(b.path(name), vec![b'B'; 8192]).unwrap();
        if allocate_first {
            let on_a = open_rw(&a.path(name));
            // SAFETY: a valid descriptor; fallocate reads no memory of ours.
            let allocated =
                unsafe { libc::fallocate(on_a.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 1) };
            let error = std::io::Error::last_os_error();
            assert_eq!(allocated, 0, "fallocate: {error}");
        }
        let on_a = open_rw(&a.path(name));
        on_a.write_all_at(b"aaaa", 100).unwrap();
        drop(on_a);
        drop(held);
        assert_bytes_eq(
            &read_all(&plain.path(name)),
            &expected,
            &format!(
                "{name}: a page begun past the end the kernel keeps, below the size at the open"
            ),
        );
    }

    // One host alone: zeros written over bytes, and over a page it read, still land.
    fs::write(plain.path("zeros"), vec![b'x'; 3 * 4096]).unwrap();
    let on_a = open_rw(&a.path("zeros"));
    let mut page = vec![0u8; 4096];
    on_a.read_exact_at(&mut page, 4096).unwrap();
    on_a.write_all_at(&[0; 4096], 0).unwrap();
    on_a.write_all_at(&[0; 10], 4096 + 50).unwrap();
    on_a.write_all_at(&[0; 4096], 3 * 4096).unwrap();
    drop(on_a);
    let mut expected = vec![0u8; 4 * 4096];
    expected[4096..3 * 4096].fill(b'x');
    expected[4096 + 50..4096 + 60].fill(0);
    assert_bytes_eq(
        &read_all(&plain.path("zeros")),
        &expected,
        "zeros from one host",
    );
}

/// A writeback mount (`--writeback`: the kernel gathers writes in its page cache and owns
/// the sizes of the files it holds) beside a plain one. Its writes reach the other mount at
/// close and survive its SIGKILL once fsynced; another mount's changes evict the files its
/// kernel holds (a stale size there would come back as old bytes or zeros); and another
/// mount's truncation recalls its dirty pages before the cut, so no byte written before the
/// truncate comes back after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writeback_mount_sees_other_mounts_changes_and_loses_no_write() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let mut writeback = Mount::start(&cluster, "a", &["--writeback"]);
    let plain = Mount::start(&cluster, "b", &[]);
    let mut random = Xorshift::new(31);

    // Small writes, read back mid-stream, then seen elsewhere after the close.
    let expected = random.bytes(4_000 * 100);
    let mut file = open_rw(&writeback.path("log"));
    for (index, record) in expected.chunks(100).enumerate() {
        file.write_all(record).unwrap();
        if index == 2_000 {
            let mut back = vec![0u8; 100];
            file.read_exact_at(&mut back, 200_000).unwrap();
            assert_eq!(back, record, "the writer reads what it just wrote");
        }
    }
    drop(file);
    assert_bytes_eq(&read_all(&plain.path("log")), &expected, "after the close");

    // Another mount shortens and extends a file this kernel holds (warm, closed): the next
    // calls here see its size and bytes, and an append here lands at its end.
    warm(&writeback, "log");
    let file = OpenOptions::new()
        .write(true)
        .open(plain.path("log"))
        .unwrap();
    file.set_len(1_000).unwrap();
    file.write_all_at(b"XYZ", 1_000).unwrap();
    drop(file);
    let mut now = expected[..1_000].to_vec();
    now.extend_from_slice(b"XYZ");
    assert_eq!(fs::metadata(writeback.path("log")).unwrap().len(), 1_003);
    assert_bytes_eq(
        &read_all(&writeback.path("log")),
        &now,
        "after a cut elsewhere",
    );
    let tail = random.bytes(100);
    let mut file = OpenOptions::new()
        .append(true)
        .open(writeback.path("log"))
        .unwrap();
    file.write_all(&tail).unwrap();
    drop(file);
    now.extend_from_slice(&tail);
    assert_bytes_eq(&read_all(&plain.path("log")), &now, "an append here");

    // Dirty pages of a file held open here, then a truncation elsewhere: they are written
    // back before the cut, so none of those bytes is read after it, before or after the
    // writer's close.
    let mut held = open_rw(&writeback.path("held"));
    held.write_all(&random.bytes(65_536)).unwrap();
    OpenOptions::new()
        .write(true)
        .open(plain.path("held"))
        .unwrap()
        .set_len(0)
        .unwrap();
    assert_eq!(fs::metadata(plain.path("held")).unwrap().len(), 0);
    drop(held);
    let after = read_all(&plain.path("held"));
    assert!(
        after.iter().all(|byte| *byte == 0),
        "{} of {} bytes written before the truncate came back after it",
        after.iter().filter(|byte| **byte != 0).count(),
        after.len()
    );

    // An fsync makes the kernel's pages durable: they survive the mount's SIGKILL.
    let durable = random.bytes(1 << 20);
    let mut file = open_rw(&writeback.path("durable"));
    file.write_all(&durable).unwrap();
    file.sync_all().unwrap();
    writeback.kill9();
    drop(file);
    assert_bytes_eq(
        &read_all(&plain.path("durable")),
        &durable,
        "after fsync and kill",
    );
}

fn flock(file: &File, operation: libc::c_int) -> Result<(), i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor and a flock operation.
    let done = unsafe { libc::flock(file.as_raw_fd(), operation) };
    if done == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

/// `fcntl(fd, command, struct flock)` with a range from `start` for `length` bytes (0: to
/// the end); returns the struct as the kernel left it (for `F_GETLK`).
fn record_lock(
    file: &File,
    command: libc::c_int,
    kind: libc::c_int,
    start: i64,
    length: i64,
) -> Result<libc::flock, i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: all-zero is a valid `struct flock`; the fields are set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = start;
    lock.l_len = length;
    // SAFETY: a valid descriptor and a pointer to a live `struct flock`.
    let done = unsafe { libc::fcntl(file.as_raw_fd(), command, &mut lock) };
    if done == 0 {
        Ok(lock)
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

/// Run `lock` on another thread and return whether it finished within `within`, and how
/// long it took.
fn finishes_within(within: Duration, lock: impl FnOnce() + Send + 'static) -> Option<Duration> {
    let (done, finished) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        lock();
        let _ = done.send(started.elapsed());
    });
    finished.recv_timeout(within).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_exclude_across_mounts_and_go_with_a_killed_mount() {
    if !fuse_available() {
        return;
    }
    let cluster = coherence_cluster(LONG_LEASE_MS).await;
    let left = Mount::start(&cluster, "a", &[]);
    let right = Mount::start(&cluster, "b", &[]);
    let wait = Duration::from_secs(20);

    // flock: exclusive on one mount, refused on the other, granted there once released.
    let holder = open_rw(&left.path("flocked"));
    flock(&holder, libc::LOCK_EX).unwrap();
    let other = open_rw(&right.path("flocked"));
    assert_eq!(
        flock(&other, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    assert_eq!(
        flock(&other, libc::LOCK_SH | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    let waiter = other.try_clone().unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(holder); // the last close releases a flock lock
    });
    finishes_within(wait, move || flock(&waiter, libc::LOCK_EX).unwrap())
        .expect("a blocking flock is granted once the other mount's lock goes");
    release.join().unwrap();
    // Shared locks share.
    flock(&other, libc::LOCK_UN).unwrap();
    let reader = open_rw(&left.path("flocked"));
    flock(&reader, libc::LOCK_SH).unwrap();
    flock(&other, libc::LOCK_SH | libc::LOCK_NB).unwrap();
    drop((reader, other));

    // fcntl record locks: ranges, F_GETLK, and a waiting F_SETLKW.
    let holder = open_rw(&left.path("records"));
    record_lock(&holder, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();
    let other = open_rw(&right.path("records"));
    assert_eq!(
        record_lock(&other, libc::F_SETLK, libc::F_RDLCK, 50, 10).err(),
        Some(libc::EAGAIN),
        "an overlapping lock is refused"
    );
    record_lock(&other, libc::F_SETLK, libc::F_WRLCK, 100, 50).expect("a disjoint range");
    let found = record_lock(&other, libc::F_GETLK, libc::F_WRLCK, 0, 0).unwrap();
    assert_eq!(i32::from(found.l_type), libc::F_WRLCK);
    assert_eq!(
        (found.l_start, found.l_len),
        (0, 100),
        "F_GETLK names the holder's range"
    );
    // Unlocking part of the range lets a lock on that part through.
    record_lock(&holder, libc::F_SETLK, libc::F_UNLCK, 0, 50).unwrap();
    record_lock(&other, libc::F_SETLK, libc::F_WRLCK, 0, 50).expect("the unlocked part");
    record_lock(&other, libc::F_SETLK, libc::F_UNLCK, 0, 0).unwrap();
    let waiter = other.try_clone().unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(holder); // closing releases the process's record locks on the file
    });
    finishes_within(wait, move || {
        record_lock(&waiter, libc::F_SETLKW, libc::F_WRLCK, 0, 0).unwrap();
    })
    .expect("F_SETLKW is granted once the other mount's process closes the file");
    release.join().unwrap();
    drop(other);

    // OFD locks belong to the open file: two opens on two mounts exclude each other.
    let first = open_rw(&left.path("ofd"));
    let second = open_rw(&right.path("ofd"));
    record_lock(&first, libc::F_OFD_SETLK, libc::F_WRLCK, 0, 0).unwrap();
    assert_eq!(
        record_lock(&second, libc::F_OFD_SETLK, libc::F_RDLCK, 10, 1).err(),
        Some(libc::EAGAIN)
    );
    // The kernel releases a file just after its last close returns: a waiting lock sees it.
    drop(first);
    finishes_within(wait, move || {
        record_lock(&second, libc::F_OFD_SETLKW, libc::F_RDLCK, 10, 1).unwrap();
    })
    .expect("an OFD lock goes with the last close of its file");

    // A lock held through a mount that is killed goes when its session ends (its lease:
    // `TEST_LEASE_MS`), and a waiter on another mount then gets it.
    let mut doomed = Mount::start(&cluster, "c", &[]);
    let held = open_rw(&doomed.path("orphaned"));
    flock(&held, libc::LOCK_EX).unwrap();
    let other = open_rw(&left.path("orphaned"));
    assert_eq!(
        flock(&other, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    doomed.kill9();
    assert_eq!(
        flock(&other, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK),
        "the lock outlives its mount until the session ends"
    );
    let bound = Duration::from_millis(u64::from(common::TEST_LEASE_MS) * 2 + 10_000);
    let took = finishes_within(bound, move || flock(&other, libc::LOCK_EX).unwrap())
        .expect("the killed mount's lock is released when its session ends");
    eprintln!("a killed mount's lock went after {took:?}");
    drop(held);
    // Every file is closed: no lock is left anywhere (none leaked by a close).
    let left_over = common::poll_until(10_000, || async {
        let after = scrape_meta(&cluster).await;
        let ranges = after.sum("freeflow_meta_lock_ranges", &[]);
        (ranges == 0.0).then_some(())
    })
    .await;
    assert!(
        left_over.is_some(),
        "locks are left after every file closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_are_reclaimed_after_a_meta_server_restart() {
    if !fuse_available() {
        return;
    }
    let mut cluster = coherence_cluster(LONG_LEASE_MS).await;
    let left = Mount::start(&cluster, "a", &[]);
    let right = Mount::start(&cluster, "b", &[]);
    let holder = open_rw(&left.path("kept"));
    flock(&holder, libc::LOCK_EX).unwrap();
    let records = open_rw(&left.path("kept-records"));
    record_lock(&records, libc::F_SETLK, libc::F_WRLCK, 10, 10).unwrap();

    cluster.kill_meta();
    cluster.restart_meta().await;

    // The holder's mount takes its locks again inside the recovery window; a lock asked
    // for on the other mount waits for the window and then finds them held.
    let other = open_rw(&right.path("kept"));
    assert_eq!(
        flock(&other, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK),
        "the flock lock survived the restart"
    );
    let other_records = open_rw(&right.path("kept-records"));
    assert_eq!(
        record_lock(&other_records, libc::F_SETLK, libc::F_RDLCK, 15, 1).err(),
        Some(libc::EAGAIN),
        "the record lock survived the restart"
    );
    record_lock(&other_records, libc::F_SETLK, libc::F_RDLCK, 0, 10).expect("around it");
    drop(holder);
    finishes_within(Duration::from_secs(20), move || {
        flock(&other, libc::LOCK_EX).unwrap();
    })
    .expect("released after the restart like any lock");
    assert!(
        left.log_text().contains("locks reclaimed"),
        "the mount says it reclaimed:\n{}",
        left.log_text()
    );
}

/// The command-line tools end their sessions however they end: a client that just exits
/// keeps its session and its leases at the meta server until they run out, and any other
/// client's change they cover waits that long (a mount's create after `freeflow exercise
/// ff:/...` waited 10 s, and the next exerciser run on the mount timed out). Counted at
/// the meta server after each command: its sessions and leases are back where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_line_tools_leave_no_session_or_lease_behind() {
    let cluster = coherence_cluster(60_000).await;
    let before = scrape_meta(&cluster).await;
    let run = |arguments: &[&str]| {
        std::process::Command::new(common::FREEFLOW)
            .arg("--cluster")
            .arg(cluster.client_toml())
            .args(arguments)
            .output()
            .expect("run freeflow")
    };
    let commands: [(&[&str], bool); 5] = [
        (&["mkdir", "ff:/tools"], true),
        (&["stat", "ff:/tools/missing"], false),
        (&["ls", "ff:/tools"], true),
        (&["rm", "ff:/tools/missing"], false),
        (
            &[
                "exercise",
                "--ops",
                "200",
                "--progress",
                "0",
                "ff:/tools/x",
                "ff:/tools/x",
            ],
            true,
        ),
    ];
    for (arguments, succeeds) in commands {
        let output = run(arguments);
        assert_eq!(
            output.status.success(),
            succeeds,
            "{arguments:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let after = scrape_meta(&cluster).await;
        for gauge in ["freeflow_meta_sessions", "freeflow_meta_leases_held"] {
            assert_eq!(
                after.sum(gauge, &[]),
                before.sum(gauge, &[]),
                "{gauge} after {arguments:?}"
            );
        }
    }
}
