//! No name lost, none invented (issue 41): what a mount lists under concurrent renames.
//!
//! A namespace stress from a standard test suite (creates, links, renames with
//! `RENAME_EXCHANGE` and `RENAME_NOREPLACE`, from 4 processes on one mount) left
//! directories that `rm -rf` could not remove because their listing showed none of their
//! entries, and names listed that every open answered ENOENT. Both came from the mount
//! handing the kernel, in a `READDIRPLUS` reply, a name with the inode it stood for before
//! one of the mount's own renames: the kernel then links the name to that inode (for as long
//! as the lease runs), so a path walk through it reaches the wrong directory. The tests here
//! pin the two ways it happened, on both of the mount's request paths (/dev/fuse and
//! io_uring), each checked to fail without its fix.
//!
//! Every test skips with a message when /dev/fuse is missing.

mod common;

use std::ffi::CString;
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::mount::{fuse_available, io_uring_available, Mount};
use common::{Cluster, ClusterOptions};

/// Lease of the clusters here: long, so that a name linked to the wrong inode stays so
/// for the rest of the test instead of being looked up again.
const LONG_LEASE_MS: u32 = 10_000;

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("no NUL in paths")
}

fn exchange(source: &Path, target: &Path) {
    let (source_c, target_c) = (c_path(source), c_path(target));
    // SAFETY: valid NUL-terminated paths; AT_FDCWD with absolute paths.
    let result = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            source_c.as_ptr(),
            libc::AT_FDCWD,
            target_c.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    assert_eq!(
        result,
        0,
        "exchange {} with {}: {}",
        source.display(),
        target.display(),
        std::io::Error::last_os_error()
    );
}

/// One entry as `getdents64` gives it.
#[derive(Debug)]
struct Dirent {
    name: String,
    inode: u64,
    kind: u8,
}

/// Reads entries of the open directory `file` with `getdents64` into a buffer of
/// `buffer_bytes` (a small one reads a few entries per call); empty at the end.
fn read_entries(file: &File, buffer_bytes: usize) -> Vec<Dirent> {
    let mut buffer = vec![0u8; buffer_bytes];
    // SAFETY: the buffer is valid for its length; the descriptor is an open directory.
    let read = unsafe {
        libc::syscall(
            libc::SYS_getdents64,
            file.as_raw_fd(),
            buffer.as_mut_ptr(),
            buffer.len(),
        )
    };
    assert!(read >= 0, "getdents64: {}", std::io::Error::last_os_error());
    let mut entries = Vec::new();
    let mut at = 0;
    while at < read as usize {
        // struct linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name.
        let inode = u64::from_ne_bytes(buffer[at..at + 8].try_into().unwrap());
        let record = u16::from_ne_bytes(buffer[at + 16..at + 18].try_into().unwrap()) as usize;
        let kind = buffer[at + 18];
        let name_bytes = &buffer[at + 19..at + record];
        let end = name_bytes
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(name_bytes.len());
        let name = String::from_utf8_lossy(&name_bytes[..end]).into_owned();
        if name != "." && name != ".." {
            entries.push(Dirent { name, inode, kind });
        }
        at += record;
    }
    entries
}

/// Every entry of `directory`, read with a large buffer.
fn list(directory: &Path) -> Vec<Dirent> {
    let file =
        File::open(directory).unwrap_or_else(|e| panic!("open {}: {e}", directory.display()));
    let mut all = Vec::new();
    loop {
        let entries = read_entries(&file, 64 << 10);
        if entries.is_empty() {
            return all;
        }
        all.extend(entries);
    }
}

fn names(directory: &Path) -> Vec<String> {
    let mut names: Vec<String> = list(directory)
        .into_iter()
        .map(|entry| entry.name)
        .collect();
    names.sort();
    names
}

/// `d_ino` and `d_type` of `entry` of `directory` agree with `lstat` of its path.
fn assert_entry_matches(directory: &Path, entry: &Dirent, what: &str) {
    let path = directory.join(&entry.name);
    let metadata = fs::symlink_metadata(&path)
        .unwrap_or_else(|e| panic!("{what}: {} is listed but lstat fails: {e}", path.display()));
    assert_eq!(
        entry.inode,
        metadata.ino(),
        "{what}: d_ino of {} is not the inode lstat gives",
        path.display()
    );
    let kind = if metadata.is_dir() {
        libc::DT_DIR
    } else if metadata.is_symlink() {
        libc::DT_LNK
    } else {
        libc::DT_REG
    };
    assert_eq!(
        entry.kind,
        kind,
        "{what}: d_type of {} is not its kind",
        path.display()
    );
}

/// The request paths a mount can take here: /dev/fuse always, io_uring where the kernel
/// offers it.
fn mount_flags() -> Vec<&'static str> {
    let mut flags = vec!["--no-io-uring"];
    if io_uring_available() {
        flags.push("--io-uring");
    } else {
        eprintln!("no FUSE over io_uring here: the /dev/fuse path alone");
    }
    flags
}

async fn long_lease_cluster() -> Cluster {
    Cluster::start_with(ClusterOptions {
        cache_lease_ms: LONG_LEASE_MS,
        ..ClusterOptions::new(1)
    })
    .await
}

/// Seed 1 of the stress exchanged two directories the mount had made, then listed the
/// parent of one: the listing the mount keeps of a directory it made still had the name
/// standing for the directory it held before the exchange, the `READDIRPLUS` answer
/// linked the name to it, and the path then listed the other directory's entries (and its
/// names opened ENOENT once the kernel looked them up again). The same with a file
/// exchanged for a directory: the listing gave the old kind, and `rm -rf`, which trusts
/// `d_type`, unlinked a directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_swaps_what_both_names_stand_for_in_the_mounts_listings() {
    if !fuse_available() {
        eprintln!("skipped: /dev/fuse is missing");
        return;
    }
    let cluster = long_lease_cluster().await;
    for flag in mount_flags() {
        let mount = Mount::start(&cluster, &format!("mnt{flag}"), &[flag]);
        let what = format!("mount {flag}");
        let (p, q) = (mount.path("p"), mount.path("q"));
        for directory in [&p, &q, &p.join("a"), &q.join("b"), &q.join("d")] {
            fs::create_dir(directory).unwrap();
        }
        File::create(p.join("a/x")).unwrap();
        File::create(q.join("b/y")).unwrap();
        File::create(q.join("d/z")).unwrap();
        File::create(p.join("f")).unwrap();
        // Both listings warm in the kernel and known to the mount.
        assert_eq!(names(&p), ["a", "f"], "{what}");
        assert_eq!(names(&q), ["b", "d"], "{what}");

        exchange(&p.join("a"), &q.join("b"));
        exchange(&p.join("f"), &q.join("d"));

        for directory in [&p, &q] {
            for entry in list(directory) {
                assert_entry_matches(directory, &entry, &what);
            }
        }
        assert_eq!(names(&p.join("a")), ["y"], "{what}: p/a is the old q/b");
        assert_eq!(names(&q.join("b")), ["x"], "{what}: q/b is the old p/a");
        assert_eq!(names(&p.join("f")), ["z"], "{what}: p/f is the old q/d");
        assert!(
            q.join("d").metadata().unwrap().is_file(),
            "{what}: q/d is the old p/f"
        );
        fs::remove_dir_all(&p).unwrap_or_else(|e| panic!("{what}: rm -rf p: {e}"));
        fs::remove_dir_all(&q).unwrap_or_else(|e| panic!("{what}: rm -rf q: {e}"));
    }
}

/// A listing read in several calls while the same mount renames in the directory between
/// two of them: the entries the mount fetched before the rename named files the rename
/// moved, and answering them after it linked names to the wrong files. An open listing
/// now fetches again what it has not answered when the directory's names changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_read_across_a_rename_links_no_name_to_the_file_it_had_before() {
    if !fuse_available() {
        eprintln!("skipped: /dev/fuse is missing");
        return;
    }
    let cluster = long_lease_cluster().await;
    const FILES: usize = 300;
    for flag in mount_flags() {
        let mount = Mount::start(&cluster, &format!("mnt{flag}"), &[flag]);
        let what = format!("mount {flag}");
        let (p, q) = (mount.path("p"), mount.path("q"));
        fs::create_dir(&p).unwrap();
        fs::create_dir(&q).unwrap();
        for index in 0..FILES {
            File::create(p.join(format!("e{index:03}"))).unwrap();
        }
        fs::create_dir(q.join("d")).unwrap();
        File::create(q.join("d/inside")).unwrap();
        // The kernel holds every name of p with its file.
        for index in 0..FILES {
            fs::symlink_metadata(p.join(format!("e{index:03}"))).unwrap();
        }

        let directory = File::open(&p).unwrap();
        let first = read_entries(&directory, 512);
        assert!(
            !first.is_empty() && first.len() < FILES / 2,
            "{what}: a small buffer reads a few entries, not {}",
            first.len()
        );
        // Names past the first read: exchanged for a directory, and renamed away.
        exchange(&p.join("e250"), &q.join("d"));
        fs::rename(p.join("e260"), q.join("moved")).unwrap();
        let mut rest = Vec::new();
        loop {
            let entries = read_entries(&directory, 512);
            if entries.is_empty() {
                break;
            }
            rest.extend(entries);
        }
        for entry in first.iter().chain(&rest) {
            if entry.name == "e260" {
                continue; // POSIX: a name removed during the listing may be listed.
            }
            assert_entry_matches(&p, entry, &what);
        }
        assert_eq!(
            names(&p.join("e250")),
            ["inside"],
            "{what}: p/e250 is the directory it was exchanged with"
        );
        assert!(
            fs::symlink_metadata(p.join("e260")).is_err(),
            "{what}: p/e260 was renamed away"
        );
        fs::remove_dir_all(&p).unwrap_or_else(|e| panic!("{what}: rm -rf p: {e}"));
        fs::remove_dir_all(&q).unwrap_or_else(|e| panic!("{what}: rm -rf q: {e}"));
    }
}
