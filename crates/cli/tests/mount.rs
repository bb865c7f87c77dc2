//! The FUSE mount end to end: real servers (child processes from the common harness), real
//! `freeflow mount` processes, and ordinary system calls on the mount point, so what is
//! tested is what a program on a mounted cluster sees (issue 3: POSIX behaviour, two
//! clients, the seeds' dd patterns, servers going away).
//!
//! Every test skips with a message when /dev/fuse is missing (no FUSE in this kernel or
//! container); everything else is a real failure.

mod common;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::mount::{
    errno_of, fuse_available, io_uring_available, is_mounted, lazy_unmount, run_as, Mount,
};
use common::{assert_bytes_eq, Cluster, Xorshift};

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("no NUL in paths")
}

fn renameat2(source: &Path, target: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    let (source, target) = (c_path(source), c_path(target));
    // SAFETY: valid NUL-terminated paths; AT_FDCWD with absolute paths.
    let result = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            source.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            flags,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn check(result: libc::c_int) -> std::io::Result<libc::c_int> {
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

fn set_xattr(path: &Path, name: &str, value: &[u8], flags: libc::c_int) -> std::io::Result<()> {
    let (path, name) = (c_path(path), CString::new(name).expect("name"));
    // SAFETY: valid pointers and lengths.
    check(unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    })
    .map(|_| ())
}

/// getxattr with a buffer of `size` bytes (0: size probe); returns the length and bytes.
fn get_xattr(path: &Path, name: &str, size: usize) -> std::io::Result<(usize, Vec<u8>)> {
    let (path, name) = (c_path(path), CString::new(name).expect("name"));
    let mut buffer = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes.
    let length = unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buffer.as_mut_ptr().cast(),
            size,
        )
    };
    if length < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buffer.truncate(if size == 0 { 0 } else { length as usize });
    Ok((length as usize, buffer))
}

fn list_xattr(path: &Path) -> std::io::Result<Vec<String>> {
    let path = c_path(path);
    let mut buffer = vec![0u8; 4096];
    // SAFETY: the buffer holds 4096 bytes.
    let length = unsafe { libc::listxattr(path.as_ptr(), buffer.as_mut_ptr().cast(), 4096) };
    if length < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buffer.truncate(length as usize);
    Ok(buffer
        .split(|byte| *byte == 0)
        .filter(|name| !name.is_empty())
        .map(|name| String::from_utf8_lossy(name).into_owned())
        .collect())
}

fn remove_xattr(path: &Path, name: &str) -> std::io::Result<()> {
    let (path, name) = (c_path(path), CString::new(name).expect("name"));
    // SAFETY: valid NUL-terminated strings.
    check(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) }).map(|_| ())
}

fn sorted_names(directory: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(directory)
        .expect("read_dir")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

fn run_dd(arguments: &[String]) {
    let output = Command::new("dd").args(arguments).output().expect("run dd");
    assert!(
        output.status.success(),
        "dd {arguments:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_directories_and_links_behave_as_posix_says() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    // Requests read from /dev/fuse (the other tests' mounts take them over io_uring rings
    // where the kernel offers them).
    let mount = Mount::start(&cluster, "mnt", &["--no-io-uring"]);
    posix_behaviour(&mount);
}

/// The same calls through a mount that takes the kernel's requests over io_uring rings
/// (`--io-uring`), then the seeds' write patterns read back; the rings must have carried
/// the requests (each queue logs how many it served when it stops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_io_uring_behave_as_posix_says() {
    if !fuse_available() || !io_uring_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let mut mount = Mount::start(&cluster, "mnt", &["--io-uring"]);
    posix_behaviour(&mount);

    // Small writes gathered in place and large ones from the ring's payload buffers.
    let mut random = Xorshift::new(11);
    let data = random.bytes(8 << 20);
    for (name, piece) in [("small", 4096), ("large", 1 << 20), ("odd", 65_536 + 17)] {
        let path = mount.path(name);
        let mut writer = File::create(&path).expect("create");
        for chunk in data.chunks(piece) {
            writer.write_all(chunk).expect("write a piece");
        }
        writer.sync_all().expect("fsync");
        drop(writer);
        assert_bytes_eq(&fs::read(&path).expect("read back"), &data, name);
    }

    assert!(
        mount.stop(),
        "the mount exits cleanly:\n{}",
        mount.log_text()
    );
    let log = mount.log_text();
    let served: u64 = log
        .lines()
        .filter(|line| line.contains("FUSE ring stopped"))
        .filter_map(|line| line.split("requests=").nth(1))
        .filter_map(|count| count.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    // Thousands of creates, lookups and writes above; only FORGETs, INTERRUPTs and what
    // came before the rings were registered go through /dev/fuse.
    assert!(
        served > 5_000,
        "requests served over the rings: {served}\n{log}"
    );
}

/// Pins the calling thread to CPU 0 (the FUSE ring queue of CPU 0 takes its requests).
fn pin_to_cpu_zero() {
    // SAFETY: a zeroed cpu_set_t is empty; CPU 0 is set in it; the result is checked.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        let pinned = libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
        assert_eq!(
            pinned,
            0,
            "pin to CPU 0: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// 200 `flock path -c true` forked by one shell on CPU 0 as fast as it can: a burst that
/// outruns the ring queue's thread of CPU 0. A waiter that fails says so on stderr.
fn burst_of_waiters(path: &Path) -> std::process::Child {
    Command::new("taskset")
        .args(["-c", "0", "sh", "-c"])
        .arg(
            "for i in $(seq 200); do \
               (flock \"$0\" -c true || echo \"waiter $i: exit $?\" >&2) & \
             done; wait",
        )
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the waiters")
}

/// Waits (two minutes at most) for the waiters' shell; every waiter must have succeeded.
fn all_finish(mut waiters: std::process::Child, mount: &Mount, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = waiters.try_wait().expect("poll the waiters") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "waiters {when} still waiting after 2 minutes\n{}",
            mount.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut failures = String::new();
    if let Some(mut pipe) = waiters.stderr.take() {
        let _ = pipe.read_to_string(&mut failures);
    }
    assert!(
        status.success() && failures.is_empty(),
        "waiters {when}: {status}: {failures}"
    );
}

/// A thread on CPU 0 holding `flock(LOCK_EX)` on a file until told (returned once it holds it).
struct PinnedHolder {
    thread: std::thread::JoinHandle<()>,
    /// Unlock now.
    release: std::sync::mpsc::Sender<()>,
    /// The unlock's result and how long it took.
    released: std::sync::mpsc::Receiver<(libc::c_int, Duration)>,
}

fn pinned_holder(path: &Path) -> PinnedHolder {
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let (released_tx, released_rx) = std::sync::mpsc::channel();
    let path = path.to_owned();
    let holder = std::thread::spawn(move || {
        pin_to_cpu_zero();
        let file = File::open(&path).expect("open the lock file");
        // SAFETY: a valid descriptor and a flock operation.
        let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        held_tx.send(locked).expect("tell the test");
        let _ = release_rx.recv();
        let started = Instant::now();
        // SAFETY: as above.
        let unlocked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        let _ = released_tx.send((unlocked, started.elapsed()));
        drop(file);
    });
    assert_eq!(
        held_rx.recv().expect("the holder locks"),
        0,
        "the holder's flock"
    );
    PinnedHolder {
        thread: holder,
        release: release_tx,
        released: released_rx,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_waiters_past_a_rings_depth_on_one_cpu_hold_up_nobody() {
    if !fuse_available() || !io_uring_available() {
        return;
    }
    if !Path::new("/usr/bin/taskset").exists() || !Path::new("/usr/bin/flock").exists() {
        eprintln!("skipping: needs taskset and flock (util-linux)");
        return;
    }
    // A lock request is answered only once the lock is given, and it holds its ring
    // entry (and, at the meta server, a long-poll slot) as long as it waits. 200 waiters
    // on CPU 0 are more than a queue's first 64 entries: with a fixed depth the holder's
    // unlock from CPU 0 waited behind them for ever. (That 128 of them filled the meta
    // server's request slots, before lock waits had slots of their own, is the rpc
    // test `long_polls_do_not_take_the_slots_of_other_requests`.) The lock is held
    // through several rounds of the waits (1 s each through the mount).
    let cluster = Cluster::start(1).await;
    let mount = Mount::start(
        &cluster,
        "mnt",
        &["--io-uring", "--call-timeout-ms", "3000"],
    );
    let path = mount.path("lock");
    File::create(&path).expect("create the lock file");

    let PinnedHolder {
        thread: holder,
        release: release_tx,
        released: released_rx,
    } = pinned_holder(&path);

    let waiters = burst_of_waiters(&path);
    // Held three rounds of the waiters' requests, while they pile up.
    std::thread::sleep(Duration::from_secs(5));
    release_tx.send(()).expect("tell the holder");
    let released = released_rx.recv_timeout(Duration::from_secs(30));
    let Ok((unlocked, took)) = released else {
        panic!(
            "the holder's unlock on CPU 0 did not finish in 30 s behind 200 waiters\n{}",
            mount.log_text()
        );
    };
    assert_eq!(unlocked, 0, "the holder's unlock");
    eprintln!("the holder's unlock took {took:?}");
    holder.join().expect("the holder thread");

    all_finish(waiters, &mount, "after the unlock");

    // The queue of CPU 0 grew past its first entries to hold them.
    assert!(
        mount.log_text().contains("a FUSE ring queue grew"),
        "{}",
        mount.log_text()
    );

    // Requests that came while every entry was held wait in the kernel until an entry of
    // their CPU is committed (new entries take only later requests): made so at will on a
    // new mount (64 entries a queue). 100 shells on CPU 0 open the file; the mount is
    // stopped; they all ask for the lock (64 take the entries, 36 queue behind them), then
    // the holder's unlock queues last. Lock waiters never commit: only the queue's nudger
    // (its own requests, refused at once) brings the unlock in.
    let mount = Mount::start(
        &cluster,
        "mnt2",
        &["--io-uring", "--call-timeout-ms", "3000"],
    );
    let path = mount.path("lock");
    let PinnedHolder {
        thread: holder,
        release: release_tx,
        released: released_rx,
    } = pinned_holder(&path);
    let mut waiters: Vec<std::process::Child> = (0..100)
        .map(|_| {
            Command::new("taskset")
                .args(["-c", "0", "sh", "-c"])
                .arg("exec 9<\"$0\" && read go && flock 9")
                .arg(&path)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a waiter")
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    mount.signal(libc::SIGSTOP);
    for waiter in &mut waiters {
        let mut go = waiter.stdin.take().expect("a waiter's stdin");
        go.write_all(b"go\n").expect("tell a waiter");
    }
    std::thread::sleep(Duration::from_secs(2));
    release_tx.send(()).expect("tell the holder");
    std::thread::sleep(Duration::from_millis(500));
    mount.signal(libc::SIGCONT);
    let Ok((unlocked, _)) = released_rx.recv_timeout(Duration::from_secs(30)) else {
        panic!(
            "the holder's unlock queued behind held entries did not finish in 30 s\n{}",
            mount.log_text()
        );
    };
    assert_eq!(unlocked, 0, "the holder's unlock");
    holder.join().expect("the holder thread");
    let deadline = Instant::now() + Duration::from_secs(120);
    for mut waiter in waiters {
        let status = loop {
            if let Some(status) = waiter.try_wait().expect("poll a waiter") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "a waiter still waits after 2 minutes"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        if let Some(mut pipe) = waiter.stderr.take() {
            let _ = pipe.read_to_string(&mut stderr);
        }
        assert!(status.success(), "a waiter: {status}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_ends_a_lock_wait_as_on_a_local_file() {
    if !fuse_available() {
        return;
    }
    if !Path::new("/usr/bin/flock").exists() || Command::new("python3").arg("-V").output().is_err()
    {
        eprintln!("skipping: needs flock (util-linux) and python3");
        return;
    }
    let cluster = Cluster::start(1).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let path = mount.path("lock");
    let holder = File::create(&path).expect("create the lock file");
    // SAFETY: a valid descriptor and a flock operation.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);

    // SIGTERM to a waiting `flock` ends it, as it would a wait on a local file (the wait
    // used to last until the lock was given, whatever came).
    let mut waiter = Command::new("flock")
        .arg(&path)
        .args(["-c", "true"])
        .spawn()
        .expect("start flock");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        waiter.try_wait().expect("poll flock").is_none(),
        "flock waits"
    );
    // SAFETY: kill has no memory preconditions; the child is ours.
    unsafe { libc::kill(waiter.id() as libc::pid_t, libc::SIGTERM) };
    let sent = Instant::now();
    let status = loop {
        if let Some(status) = waiter.try_wait().expect("poll flock") {
            break status;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "flock still waits 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status}");

    // A handled signal (no SA_RESTART) makes the wait fail with EINTR, and the handler
    // runs: Python raises from it. An errno the program cannot know (the kernel's restart
    // code, 512) or a wait to the end would print something else.
    let script = "import fcntl, signal, sys\n\
                  def ring(*_):\n    raise TimeoutError\n\
                  signal.signal(signal.SIGALRM, ring)\n\
                  f = open(sys.argv[1], 'r+')\n\
                  signal.alarm(1)\n\
                  try:\n    fcntl.flock(f, fcntl.LOCK_EX)\n    print('locked')\n\
                  except TimeoutError:\n    print('interrupted')\n\
                  except OSError as error:\n    print('errno', error.errno)\n";
    let started = Instant::now();
    let mut python = Command::new("python3")
        .args(["-c", script])
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python3");
    let status = loop {
        if let Some(status) = python.try_wait().expect("poll python3") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(15) {
            let _ = python.kill();
            panic!("the interrupted flock still waits after 15 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut said = String::new();
    python
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut said)
        .expect("read python3's output");
    let mut complaint = String::new();
    let _ = python
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut complaint);
    assert!(
        status.success() && said == "interrupted\n",
        "{status}: {said}{complaint}"
    );

    // Neither waiter left a lock behind: once the holder lets go, it is free.
    drop(holder);
    let free = Command::new("flock")
        .args(["-n"])
        .arg(&path)
        .args(["-c", "true"])
        .status()
        .expect("run flock -n");
    assert!(
        free.success(),
        "the lock is free after the holder's close: {free}"
    );
}

/// Calls on `mount` as a program would make them, with what POSIX says they give.
fn posix_behaviour(mount: &Mount) {
    // Create, write, read, close.
    let file = mount.path("hello.txt");
    fs::write(&file, b"hello, freeflow\n").expect("write a file");
    assert_eq!(fs::read(&file).expect("read it back"), b"hello, freeflow\n");
    let metadata = fs::metadata(&file).expect("stat");
    assert_eq!(metadata.len(), 16);
    assert!(metadata.is_file());

    // Data spanning stripes, written in odd pieces, read back whole.
    let mut random = Xorshift::new(7);
    let data = random.bytes(3 * 65_536 + 12_345);
    {
        let mut writer = File::create(mount.path("striped")).expect("create");
        for piece in data.chunks(40_000) {
            writer.write_all(piece).expect("write a piece");
        }
    }
    assert_bytes_eq(
        &fs::read(mount.path("striped")).expect("read striped"),
        &data,
        "striped file",
    );

    // Directories: nested, listed in pages, not removable while not empty.
    fs::create_dir_all(mount.path("a/b/c")).expect("mkdir -p");
    for index in 0..1500 {
        File::create(mount.path(&format!("a/b/f{index:04}"))).expect("create in a/b");
    }
    let names = sorted_names(&mount.path("a/b"));
    assert_eq!(names.len(), 1501, "1500 files and c");
    assert_eq!(names[0], "c");
    assert_eq!(names[1], "f0000");
    assert_eq!(names[1500], "f1499");
    assert_eq!(
        errno_of(fs::remove_dir(mount.path("a/b"))),
        Some(libc::ENOTEMPTY)
    );
    assert_eq!(
        errno_of(fs::create_dir(mount.path("a"))),
        Some(libc::EEXIST)
    );
    assert_eq!(
        errno_of(fs::read(mount.path("missing"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(File::open(mount.path("hello.txt/x"))),
        Some(libc::ENOTDIR)
    );
    fs::remove_dir(mount.path("a/b/c")).expect("rmdir an empty directory");
    assert!(!mount.path("a/b/c").exists());

    // Rename: across directories, replacing, NOREPLACE and EXCHANGE.
    fs::write(mount.path("one"), b"1").expect("write one");
    fs::write(mount.path("two"), b"22").expect("write two");
    fs::rename(mount.path("one"), mount.path("a/one-moved")).expect("rename across dirs");
    assert!(!mount.path("one").exists());
    assert_eq!(fs::read(mount.path("a/one-moved")).expect("read"), b"1");
    fs::rename(mount.path("a/one-moved"), mount.path("two")).expect("rename over a file");
    assert_eq!(fs::read(mount.path("two")).expect("read"), b"1");
    fs::write(mount.path("three"), b"333").expect("write three");
    assert_eq!(
        errno_of(renameat2(
            &mount.path("three"),
            &mount.path("two"),
            libc::RENAME_NOREPLACE
        )),
        Some(libc::EEXIST)
    );
    renameat2(
        &mount.path("three"),
        &mount.path("two"),
        libc::RENAME_EXCHANGE,
    )
    .expect("exchange");
    assert_eq!(fs::read(mount.path("two")).expect("read"), b"333");
    assert_eq!(fs::read(mount.path("three")).expect("read"), b"1");
    renameat2(
        &mount.path("three"),
        &mount.path("four"),
        libc::RENAME_NOREPLACE,
    )
    .expect("noreplace to a free name");
    assert!(mount.path("four").exists() && !mount.path("three").exists());

    // Hard links and link counts.
    fs::hard_link(mount.path("four"), mount.path("a/four-link")).expect("link");
    assert_eq!(fs::metadata(mount.path("four")).expect("stat").nlink(), 2);
    assert_eq!(
        fs::metadata(mount.path("four")).expect("stat").ino(),
        fs::metadata(mount.path("a/four-link")).expect("stat").ino()
    );
    fs::remove_file(mount.path("four")).expect("unlink one name");
    assert_eq!(
        fs::metadata(mount.path("a/four-link"))
            .expect("stat")
            .nlink(),
        1
    );
    assert_eq!(fs::read(mount.path("a/four-link")).expect("read"), b"1");
    assert_eq!(fs::metadata(mount.path("a")).expect("stat dir").nlink(), 3);

    // Symlinks.
    std::os::unix::fs::symlink("a/four-link", mount.path("sym")).expect("symlink");
    assert_eq!(
        fs::read_link(mount.path("sym")).expect("readlink"),
        PathBuf::from("a/four-link")
    );
    assert_eq!(fs::read(mount.path("sym")).expect("read through"), b"1");
    assert!(fs::symlink_metadata(mount.path("sym"))
        .expect("lstat")
        .file_type()
        .is_symlink());
    std::os::unix::fs::symlink("nowhere", mount.path("dangling")).expect("symlink");
    assert_eq!(
        errno_of(fs::read(mount.path("dangling"))),
        Some(libc::ENOENT)
    );

    // chmod, chown, utimes.
    fs::set_permissions(&file, fs::Permissions::from_mode(0o640)).expect("chmod");
    assert_eq!(fs::metadata(&file).expect("stat").mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(&file, Some(1234), Some(5678)).expect("chown");
    let metadata = fs::metadata(&file).expect("stat");
    assert_eq!((metadata.uid(), metadata.gid()), (1234, 5678));
    let when = UNIX_EPOCH + Duration::new(1_000_000_000, 123_456_789);
    File::options()
        .write(true)
        .open(&file)
        .expect("open")
        .set_times(fs::FileTimes::new().set_accessed(when).set_modified(when))
        .expect("utimes");
    let metadata = fs::metadata(&file).expect("stat");
    assert_eq!(metadata.mtime(), 1_000_000_000);
    assert_eq!(metadata.mtime_nsec(), 123_456_789);
    assert_eq!(metadata.atime(), 1_000_000_000);
    // utimes(NULL): now.
    let path = c_path(&file);
    // SAFETY: valid path; NULL times means now.
    check(unsafe { libc::utimes(path.as_ptr(), std::ptr::null()) }).expect("touch");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    assert!((fs::metadata(&file).expect("stat").mtime() - now).abs() <= 5);

    // Truncate down and up (path and handle), with the bytes past a shrink gone for good.
    let truncated = mount.path("truncated");
    fs::write(&truncated, b"0123456789").expect("write");
    let handle = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&truncated)
        .expect("open rw");
    handle.set_len(4).expect("ftruncate down");
    assert_eq!(fs::read(&truncated).expect("read"), b"0123");
    handle.set_len(8).expect("ftruncate up");
    assert_eq!(fs::read(&truncated).expect("read"), b"0123\0\0\0\0");
    drop(handle);
    let path = c_path(&truncated);
    // SAFETY: valid path.
    check(unsafe { libc::truncate(path.as_ptr(), 2) }).expect("truncate by path");
    assert_eq!(fs::read(&truncated).expect("read"), b"01");
    // O_TRUNC on open.
    fs::write(&truncated, b"x").expect("write with O_TRUNC");
    assert_eq!(fs::read(&truncated).expect("read"), b"x");

    // O_APPEND and O_EXCL.
    let appended = mount.path("appended");
    fs::write(&appended, b"start").expect("write");
    for word in [&b"-one"[..], b"-two"] {
        let mut appender = OpenOptions::new()
            .append(true)
            .open(&appended)
            .expect("open O_APPEND");
        appender.write_all(word).expect("append");
    }
    assert_eq!(fs::read(&appended).expect("read"), b"start-one-two");
    assert_eq!(
        errno_of(
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&appended)
        ),
        Some(libc::EEXIST)
    );
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(mount.path("fresh"))
        .expect("O_EXCL on a new name");
    assert_eq!(
        fs::metadata(mount.path("fresh")).expect("stat").mode() & 0o777,
        0o600
    );

    // An unlinked open file stays readable and writable through its descriptor.
    let doomed = mount.path("doomed");
    fs::write(&doomed, b"still here").expect("write");
    let mut open = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&doomed)
        .expect("open");
    fs::remove_file(&doomed).expect("unlink while open");
    assert!(!doomed.exists());
    let mut contents = String::new();
    open.read_to_string(&mut contents)
        .expect("read after unlink");
    assert_eq!(contents, "still here");
    open.write_all_at(b"STILL", 0).expect("write after unlink");
    let mut buffer = [0u8; 10];
    open.read_exact_at(&mut buffer, 0).expect("read again");
    assert_eq!(&buffer, b"STILL here");
    drop(open);

    // A sparse file beyond 4 GiB: holes read as zeros.
    let sparse = mount.path("sparse");
    let offset = 5u64 << 30;
    {
        let writer = File::create(&sparse).expect("create sparse");
        writer
            .write_all_at(b"tail", offset)
            .expect("write past 4 GiB");
    }
    assert_eq!(fs::metadata(&sparse).expect("stat").len(), offset + 4);
    let reader = File::open(&sparse).expect("open sparse");
    let mut buffer = [7u8; 8];
    reader
        .read_exact_at(&mut buffer, offset - 4)
        .expect("read across the hole's end");
    assert_eq!(&buffer, b"\0\0\0\0tail");
    let mut hole = vec![7u8; 4096];
    reader
        .read_exact_at(&mut hole, 4u64 << 30)
        .expect("read in the hole");
    assert!(hole.iter().all(|byte| *byte == 0));

    // Extended attributes: set, size probe, too-small buffer, list, replace, remove.
    set_xattr(&file, "user.colour", b"blue", 0).expect("setxattr");
    assert_eq!(get_xattr(&file, "user.colour", 0).expect("probe").0, 4);
    assert_eq!(
        errno_of(get_xattr(&file, "user.colour", 2)),
        Some(libc::ERANGE)
    );
    assert_eq!(get_xattr(&file, "user.colour", 64).expect("get").1, b"blue");
    assert_eq!(
        errno_of(set_xattr(&file, "user.colour", b"red", libc::XATTR_CREATE)),
        Some(libc::EEXIST)
    );
    assert_eq!(
        errno_of(set_xattr(&file, "user.shape", b"x", libc::XATTR_REPLACE)),
        Some(libc::ENODATA)
    );
    set_xattr(&file, "user.shape", b"round", 0).expect("second attribute");
    let mut listed = list_xattr(&file).expect("listxattr");
    listed.sort();
    assert_eq!(listed, vec!["user.colour", "user.shape"]);
    remove_xattr(&file, "user.colour").expect("removexattr");
    assert_eq!(
        errno_of(get_xattr(&file, "user.colour", 64)),
        Some(libc::ENODATA)
    );

    // statfs reports the cluster's real capacity.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    let root = c_path(&mount.mountpoint);
    // SAFETY: valid path and a statvfs to fill.
    check(unsafe { libc::statvfs(root.as_ptr(), &mut stats) }).expect("statvfs");
    assert!(stats.f_blocks > 0, "capacity is reported");
    assert!(stats.f_bfree <= stats.f_blocks);
    assert_eq!(stats.f_namemax, 255);

    // Fifos and device nodes are metadata.
    let fifo = c_path(&mount.path("fifo"));
    // SAFETY: valid path.
    check(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }).expect("mkfifo");
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &fs::metadata(mount.path("fifo")).expect("stat").file_type()
    ));
    let device = c_path(&mount.path("null-device"));
    // SAFETY: valid path; a character device 1:3.
    check(unsafe { libc::mknod(device.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) })
        .expect("mknod");
    let metadata = fs::metadata(mount.path("null-device")).expect("stat");
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &metadata.file_type()
    ));
    assert_eq!(metadata.rdev(), libc::makedev(1, 3));

    // The names this test made are all listed at the root.
    let root_names = sorted_names(&mount.mountpoint);
    for name in [
        "a",
        "appended",
        "fifo",
        "fresh",
        "hello.txt",
        "sparse",
        "sym",
        "two",
    ] {
        assert!(
            root_names.iter().any(|n| n == name),
            "{name} in {root_names:?}"
        );
    }
    assert!(!root_names.iter().any(|n| n == "doomed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_mounts_see_each_other_at_once() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let left = Mount::start(&cluster, "left", &[]);
    let right = Mount::start(&cluster, "right", &[]);

    // Prime the right mount's caches, then change things on the left.
    fs::create_dir(left.path("shared")).expect("mkdir on left");
    assert!(right.path("shared").is_dir(), "mkdir seen on right");
    fs::write(left.path("shared/note"), b"version 1").expect("write on left");
    assert_eq!(
        fs::read(right.path("shared/note")).expect("read on right"),
        b"version 1"
    );
    let _ = fs::metadata(right.path("shared/note")).expect("stat on right");

    // Close-to-open: a longer version written and closed on the left is read whole.
    fs::write(left.path("shared/note"), b"version 2, longer").expect("rewrite on left");
    assert_eq!(
        fs::read(right.path("shared/note")).expect("read on right"),
        b"version 2, longer"
    );

    // Renames and unlinks are seen at once, and a removed name is never opened.
    fs::rename(left.path("shared/note"), left.path("shared/renamed")).expect("rename on left");
    assert_eq!(
        errno_of(File::open(right.path("shared/note"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        fs::read(right.path("shared/renamed")).expect("read renamed"),
        b"version 2, longer"
    );
    fs::write(left.path("shared/gone"), b"x").expect("write");
    assert!(right.path("shared/gone").exists());
    fs::remove_file(left.path("shared/gone")).expect("unlink on left");
    assert_eq!(
        errno_of(File::open(right.path("shared/gone"))),
        Some(libc::ENOENT)
    );
    assert_eq!(sorted_names(&right.path("shared")), vec!["renamed"]);

    // A file kept open on the right sees the left's closed writes at its next open.
    let reader = File::open(right.path("shared/renamed")).expect("keep open on right");
    fs::write(
        left.path("shared/renamed"),
        b"version 3 is the longest of all",
    )
    .expect("write");
    assert_eq!(
        fs::read(right.path("shared/renamed")).expect("reopen on right"),
        b"version 3 is the longest of all"
    );
    drop(reader);

    // Writes from the right are seen on the left after close.
    let mut random = Xorshift::new(99);
    let data = random.bytes(3 << 20);
    fs::write(right.path("shared/big"), &data).expect("write big on right");
    assert_bytes_eq(
        &fs::read(left.path("shared/big")).expect("read big on left"),
        &data,
        "3 MiB written on the other mount",
    );
}

/// A mount that reads ahead with the library too (`--readahead-mib`) serves a sequential
/// reader the file's bytes, and never what it fetched ahead in place of a change: its own
/// write through another descriptor, read next through the reader's, and another mount's
/// write and close, read after the reader's next open (close-to-open), are both seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_reading_ahead_never_serves_what_a_change_replaced() {
    if !fuse_available() {
        return;
    }
    const SIZE: usize = 24 << 20;
    let cluster = Cluster::start(3).await;
    let ahead = Mount::start(&cluster, "ahead", &["--readahead-mib", "16"]);
    let other = Mount::start(&cluster, "other", &[]);
    let mut random = Xorshift::new(23);
    let mut current = random.bytes(SIZE);
    fs::write(other.path("file"), &current).expect("write on the other mount");

    // Read sequentially to 4 MiB: what lies past it is fetched ahead by then.
    let reader = File::open(ahead.path("file")).expect("open to read");
    let mut head = vec![0u8; 4 << 20];
    reader.read_exact_at(&mut head, 0).expect("read the head");
    assert_bytes_eq(&head, &current[..4 << 20], "the first 4 MiB");
    // A write through another descriptor of this mount, into what was fetched ahead.
    let patch = random.bytes(100_000);
    let at = (9 << 20) + 5;
    let writer = OpenOptions::new()
        .write(true)
        .open(ahead.path("file"))
        .expect("open to write");
    writer.write_all_at(&patch, at as u64).expect("patch");
    drop(writer);
    current[at..at + patch.len()].copy_from_slice(&patch);
    let mut rest = vec![0u8; SIZE - (4 << 20)];
    reader
        .read_exact_at(&mut rest, 4 << 20)
        .expect("read the rest");
    assert_bytes_eq(
        &rest,
        &current[4 << 20..],
        "the rest, after this mount's patch",
    );
    drop(reader);

    // Read sequentially again (fetching ahead), while the other mount rewrites the middle
    // and closes: the next open here reads the new bytes.
    let reader = File::open(ahead.path("file")).expect("open again");
    reader
        .read_exact_at(&mut head, 0)
        .expect("read the head again");
    let rewrite = random.bytes(8 << 20);
    let other_writer = OpenOptions::new()
        .write(true)
        .open(other.path("file"))
        .expect("open on the other mount");
    other_writer
        .write_all_at(&rewrite, 6 << 20)
        .expect("rewrite on the other mount");
    drop(other_writer);
    current[6 << 20..14 << 20].copy_from_slice(&rewrite);
    drop(reader);
    assert_bytes_eq(
        &fs::read(ahead.path("file")).expect("read after the other mount's close"),
        &current,
        "the whole file after the other mount's rewrite",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dd_streams_and_concurrent_half_writers() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(3).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let size_mib = 256u64;
    let source = cluster.path().join("source.bin");
    {
        let mut random = Xorshift::new(2024);
        let mut writer = File::create(&source).expect("create the local source");
        for _ in 0..size_mib {
            writer
                .write_all(&random.bytes(1 << 20))
                .expect("write source");
        }
    }
    let source_bytes = fs::read(&source).expect("read the source");

    // One writer, bs=512K, then read back with dd.
    let single = mount.path("single.bin");
    run_dd(&[
        format!("if={}", source.display()),
        format!("of={}", single.display()),
        "bs=512K".into(),
        "conv=fsync".into(),
    ]);
    assert_eq!(fs::metadata(&single).expect("stat").len(), size_mib << 20);
    let copy = cluster.path().join("copy.bin");
    run_dd(&[
        format!("if={}", single.display()),
        format!("of={}", copy.display()),
        "bs=512K".into(),
    ]);
    assert_bytes_eq(
        &fs::read(&copy).expect("read copy"),
        &source_bytes,
        "dd copy",
    );

    // Two dd writers at once, each on one half of one file.
    let halves = mount.path("halves.bin");
    let half_blocks = (size_mib << 20) / (512 << 10) / 2;
    let spawn_half = |index: u64| {
        Command::new("dd")
            .arg(format!("if={}", source.display()))
            .arg(format!("of={}", halves.display()))
            .arg("bs=512K")
            .arg(format!("skip={}", index * half_blocks))
            .arg(format!("seek={}", index * half_blocks))
            .arg(format!("count={half_blocks}"))
            .arg("conv=notrunc")
            .stderr(Stdio::piped())
            .spawn()
            .expect("start dd")
    };
    let writers = [spawn_half(0), spawn_half(1)];
    for writer in writers {
        let output = writer.wait_with_output().expect("wait for dd");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert_bytes_eq(
        &fs::read(&halves).expect("read halves"),
        &fs::read(&single).expect("read single"),
        "two half writers against one writer",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_without_servers_fails_in_bounded_time_and_recovers() {
    if !fuse_available() {
        return;
    }
    let mut cluster = Cluster::start(1).await;
    let mut mount = Mount::start(&cluster, "mnt", &["--call-timeout-ms", "2000"]);
    fs::write(mount.path("before"), b"before").expect("write");

    cluster.kill_meta();
    cluster.kill_io(0);
    let started = Instant::now();
    // A name never looked up here (one cached under a lease would be answered by the
    // kernel until its lease runs out: nobody can change it while the server is down).
    let path = mount.path("never-seen");
    let outcome = tokio::task::spawn_blocking(move || fs::metadata(path))
        .await
        .expect("stat task");
    let error = outcome.expect_err("stat with the servers gone fails");
    assert!(
        matches!(
            error.raw_os_error(),
            Some(libc::ENOTCONN) | Some(libc::EIO) | Some(libc::ETIMEDOUT)
        ),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "answered in {:?}",
        started.elapsed()
    );

    cluster.restart_meta().await;
    cluster.restart_io(0).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if fs::read(mount.path("before")).ok().as_deref() == Some(&b"before"[..]) {
            break;
        }
        assert!(Instant::now() < deadline, "{}", mount.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    fs::write(mount.path("after"), b"after").expect("write after the restart");
    assert_eq!(fs::read(mount.path("after")).expect("read"), b"after");

    // SIGTERM unmounts cleanly and exits 0.
    assert!(mount.stop(), "clean exit:\n{}", mount.log_text());
    assert!(!is_mounted(&mount.mountpoint), "unmounted at SIGTERM");

    // kill -9 leaves a dead mount; after a lazy unmount, mounting again works.
    let mut killed = Mount::start(&cluster, "mnt2", &[]);
    killed.kill9();
    let dead = killed.path("after");
    let outcome = tokio::task::spawn_blocking(move || fs::metadata(dead))
        .await
        .expect("stat task");
    // ENOTCONN once the kernel ended the connection. A mount that took requests over
    // io_uring rings keeps the connection until the kernel has torn its rings down, which
    // it does after the process is gone: a request made in between waits on a ring and is
    // ended with the connection, ECONNABORTED (as a request in flight at an abort is), or
    // ECANCELED when it was handed to a ring command the kernel was cancelling with the
    // dead process (seen once in CI, stop 41). Any of the three is the dead connection's
    // answer; a hang or a success is not.
    let errno = errno_of(outcome);
    assert!(
        matches!(
            errno,
            Some(libc::ENOTCONN) | Some(libc::ECONNABORTED) | Some(libc::ECANCELED)
        ),
        "{errno:?}"
    );
    lazy_unmount(&killed.mountpoint);
    drop(killed);
    let mut again = Mount::start(&cluster, "mnt2", &[]);
    assert_eq!(fs::read(again.path("after")).expect("read"), b"after");

    // With its servers gone, SIGTERM still unmounts at once and the process ends within
    // the session close's bound (`SHUTDOWN_WAIT_MS`, 5 s), not the call time-out (this
    // harness's clusters, 10 s): it took 10-20 s. The bound leaves a slow machine 4 s
    // for the unmount and the exit, and still tells the two apart.
    cluster.kill_meta();
    cluster.kill_io(0);
    let started = Instant::now();
    assert!(again.stop(), "clean exit:\n{}", again.log_text());
    assert!(!is_mounted(&again.mountpoint), "unmounted at SIGTERM");
    eprintln!("the mount ended {:?} after SIGTERM", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "the mount took {:?} to end with its servers gone",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissions_owners_sticky_and_setgid_directories() {
    if !fuse_available() {
        return;
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipping: needs root and setpriv to act as other users");
        return;
    }
    let cluster = Cluster::start(1).await;
    let mount = Mount::start(&cluster, "mnt", &["--allow-other"]);
    let shared = mount.path("shared");
    fs::create_dir(&shared).expect("mkdir");
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).expect("chmod 1777");
    let mine = shared.join("mine");
    let mine_text = mine.display().to_string();

    // Files are created as the calling user, with the caller's umask.
    let (created, stderr) = run_as(1000, 1000, &format!("umask 077 && echo x > {mine_text}"));
    assert!(created, "{stderr}");
    let metadata = fs::metadata(&mine).expect("stat");
    assert_eq!((metadata.uid(), metadata.gid()), (1000, 1000));
    assert_eq!(metadata.mode() & 0o777, 0o600);
    fs::set_permissions(&mine, fs::Permissions::from_mode(0o644)).expect("chmod as root");

    // Another user may read but not write it, nor remove it from a sticky directory.
    let (read, stderr) = run_as(1001, 1001, &format!("cat {mine_text}"));
    assert!(read, "{stderr}");
    let (written, _) = run_as(1001, 1001, &format!("echo y >> {mine_text}"));
    assert!(!written, "a 0644 file of another user is not writable");
    let (removed, _) = run_as(1001, 1001, &format!("rm -f {mine_text}"));
    assert!(!removed, "the sticky bit protects another user's file");
    assert!(mine.exists());
    let (chmodded, _) = run_as(1001, 1001, &format!("chmod 777 {mine_text}"));
    assert!(!chmodded, "only the owner changes the mode");
    let (removed, stderr) = run_as(1000, 1000, &format!("rm {mine_text}"));
    assert!(removed, "the owner removes it: {stderr}");

    // A private directory is closed to others.
    let private = mount.path("private");
    fs::create_dir(&private).expect("mkdir");
    fs::set_permissions(&private, fs::Permissions::from_mode(0o700)).expect("chmod 700");
    let (listed, _) = run_as(1000, 1000, &format!("ls {}", private.display()));
    assert!(!listed, "a 0700 directory of root is not listable");
    let (made, _) = run_as(1000, 1000, &format!("touch {}/x", private.display()));
    assert!(!made);

    // A setgid directory hands its group (and for directories, the bit) down.
    let setgid = mount.path("setgid");
    fs::create_dir(&setgid).expect("mkdir");
    std::os::unix::fs::chown(&setgid, None, Some(4242)).expect("chgrp");
    fs::set_permissions(&setgid, fs::Permissions::from_mode(0o2777)).expect("chmod 2777");
    let (made, stderr) = run_as(
        1000,
        1000,
        &format!("touch {0}/file && mkdir {0}/sub", setgid.display()),
    );
    assert!(made, "{stderr}");
    assert_eq!(fs::metadata(setgid.join("file")).expect("stat").gid(), 4242);
    let sub = fs::metadata(setgid.join("sub")).expect("stat");
    assert_eq!(sub.gid(), 4242);
    assert_ne!(sub.mode() & 0o2000, 0, "subdirectory inherits setgid");

    // Writing or truncating a setuid file as another user drops the set-id bits, as on a
    // local file system; root's writes keep them. (The mount clears them itself: with
    // FUSE_HANDLE_KILLPRIV_V2 the kernel no longer asks for security.capability per write.)
    let set_id = mount.path("set-id");
    fs::write(&set_id, b"abc").expect("write");
    fs::set_permissions(&set_id, fs::Permissions::from_mode(0o4777)).expect("chmod 4777");
    let (written, stderr) = run_as(1000, 1000, &format!("echo more >> {}", set_id.display()));
    assert!(written, "{stderr}");
    assert_eq!(
        fs::metadata(&set_id).expect("stat").mode() & 0o7777,
        0o777,
        "a write drops setuid"
    );
    fs::set_permissions(&set_id, fs::Permissions::from_mode(0o6777)).expect("chmod 6777");
    let (cut, stderr) = run_as(1000, 1000, &format!("truncate -s 1 {}", set_id.display()));
    assert!(cut, "{stderr}");
    let metadata = fs::metadata(&set_id).expect("stat");
    assert_eq!(
        (metadata.mode() & 0o7777, metadata.len()),
        (0o777, 1),
        "a truncate drops both"
    );
    fs::set_permissions(&set_id, fs::Permissions::from_mode(0o4755)).expect("chmod 4755");
    fs::OpenOptions::new()
        .append(true)
        .open(&set_id)
        .expect("open")
        .write_all(b"root")
        .expect("append");
    assert_eq!(
        fs::metadata(&set_id).expect("stat").mode() & 0o7777,
        0o4755,
        "root keeps them"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_tar_rsync_sqlite_and_fio_direct_io_work_on_the_mount() {
    if !fuse_available() {
        return;
    }
    // CI installs every tool (.ci/run), so there a missing one is a failure, not a skip.
    let have = |tool: &str| {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .output()
            .map(|output| output.status.success())
            .unwrap_or(false);
        assert!(
            found || std::env::var_os("CI").is_none(),
            "{tool} is missing in CI"
        );
        found
    };
    let cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let shell = |script: &str| {
        let output = Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(&mount.mountpoint)
            .output()
            .expect("run sh");
        assert!(
            output.status.success(),
            "{script}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    if have("git") {
        shell(
            "git init -q repo && cd repo && for i in $(seq 1 40); do echo line $i > f$i; done \
             && git add . && git -c user.email=t@t -c user.name=t commit -qm one \
             && echo change >> f1 && git -c user.email=t@t -c user.name=t commit -qam two \
             && git fsck --strict",
        );
        shell("git clone -q repo clone");
        let log = shell("cd clone && git log --oneline | wc -l");
        assert_eq!(log.trim(), "2");
        assert_eq!(
            fs::read_to_string(mount.path("clone/f1")).expect("read"),
            "line 1\nchange\n"
        );
    } else {
        eprintln!("git missing: its part is skipped");
    }
    // A local tree of a thousand files for tar and rsync to carry onto the mount.
    let tree = cluster.path().join("tree");
    for directory in 0..10 {
        fs::create_dir_all(tree.join(format!("d{directory}"))).expect("mkdir");
        for file in 0..100 {
            fs::write(
                tree.join(format!("d{directory}/f{file}")),
                format!("{directory}/{file}\n").repeat(file + 1),
            )
            .expect("write tree file");
        }
    }
    if have("tar") {
        // Archived on the mount and extracted there again.
        shell(&format!(
            "tar -C {} -cf tree.tar . && mkdir out && tar -C out -xf tree.tar && diff -r {} out",
            tree.display(),
            tree.display()
        ));
    } else {
        eprintln!("tar missing: its part is skipped");
    }
    if have("rsync") {
        // rsync -a keeps modes and times: a second pass with a checksum comparison finds
        // nothing to transfer, and a plain pass (size and mtime) finds nothing either.
        shell(&format!(
            "rsync -a {}/ synced/ && diff -r {} synced",
            tree.display(),
            tree.display()
        ));
        let changes = shell(&format!(
            "rsync -a --dry-run --itemize-changes {}/ synced/",
            tree.display()
        ));
        assert_eq!(changes, "", "rsync found differences after a full copy");
        let changes = shell(&format!(
            "rsync -a --checksum --dry-run --itemize-changes {}/ synced/",
            tree.display()
        ));
        assert_eq!(
            changes, "",
            "rsync --checksum found differences after a full copy"
        );
    } else {
        eprintln!("rsync missing: its part is skipped");
    }
    if have("sqlite3") {
        let result = shell(
            "sqlite3 db.sqlite \"create table t(a integer primary key, b text); \
             with recursive c(x) as (select 1 union all select x+1 from c where x<20000) \
             insert into t(b) select hex(randomblob(60)) from c; \
             delete from t where a % 3 = 0; update t set b = b || 'x' where a % 5 = 0; \
             vacuum; pragma integrity_check; select count(*) from t;\"",
        );
        assert_eq!(result, "ok\n13334\n");
    } else {
        eprintln!("sqlite3 missing: its part is skipped");
    }
    if have("fio") {
        // O_DIRECT through the mount (the kernel's direct-I/O path: no page cache on this
        // host): random writes of 4-64 KiB with a checksum in each block, then every block
        // read back with O_DIRECT and checked; then whole 1 MiB blocks. fio fails on the
        // first block that does not match. What O_DIRECT wrote reads the same buffered.
        shell(
            "fio --name=direct --filename=direct.bin --size=16M --rw=randwrite \
             --bsrange=4k-64k --direct=1 --ioengine=psync --verify=crc32c --do_verify=1 \
             --verify_fatal=1 >/dev/null \
             && fio --name=sequential --filename=sequential.bin --size=32M --rw=write \
             --bs=1M --direct=1 --ioengine=psync --verify=md5 --do_verify=1 \
             --verify_fatal=1 >/dev/null \
             && dd if=direct.bin of=copy.bin bs=1M iflag=direct status=none \
             && cmp copy.bin direct.bin",
        );
    } else {
        eprintln!("fio missing: its part is skipped");
    }
}

/// A write-only open goes past the kernel's page cache (`FOPEN_DIRECT_IO`): a reader on
/// the same mount that holds the file's pages reads what it wrote at once, both in the
/// middle of the file and past its old end; an open for reading and writing reads its own
/// writes; and a program writing through a write-only open sees the size it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_here_see_writes_through_write_only_opens_at_once() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let path = mount.path("pages");
    fs::write(&path, vec![b'a'; 16 << 10]).expect("write version 1");
    let reader = File::open(&path).expect("open for reading");
    let mut held = vec![0u8; 16 << 10];
    reader
        .read_exact_at(&mut held, 0)
        .expect("read into the page cache");
    assert!(held.iter().all(|&byte| byte == b'a'));

    let writer = OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open write-only");
    writer
        .write_all_at(&[b'b'; 8 << 10], 4 << 10)
        .expect("write the middle pages");
    writer
        .write_all_at(&[b'c'; 4 << 10], 16 << 10)
        .expect("write past the end");
    assert_eq!(writer.metadata().expect("fstat").len(), 20 << 10);
    let mut seen = vec![0u8; 20 << 10];
    reader.read_exact_at(&mut seen, 0).expect("read again");
    let mut expected = vec![b'a'; 4 << 10];
    expected.extend_from_slice(&[b'b'; 8 << 10]);
    expected.extend_from_slice(&[b'a'; 4 << 10]);
    expected.extend_from_slice(&[b'c'; 4 << 10]);
    assert_bytes_eq(&seen, &expected, "a reader holding the pages");
    drop(writer);

    let both = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open for reading and writing");
    both.write_all_at(b"own", 100).expect("write");
    let mut own = [0u8; 3];
    both.read_exact_at(&mut own, 100).expect("read back");
    assert_eq!(&own, b"own");
    drop(both);
    expected[100..103].copy_from_slice(b"own");
    reader.read_exact_at(&mut seen, 0).expect("read after both");
    assert_bytes_eq(&seen, &expected, "after the read-write open");
}

/// `O_DIRECT` opens go past the page cache with their writes run at once
/// (`FOPEN_PARALLEL_DIRECT_WRITES`): four threads writing their own quarter of one file
/// through descriptors of their own all land; a reader here holding the old pages sees
/// the new bytes (the kernel no longer drops them itself for such a write: the mount
/// does); and an `O_DIRECT` descriptor can still be mapped shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_writers_of_one_file_at_once_all_land_and_readers_here_see_them() {
    const SIZE: usize = 4 << 20;
    const BLOCK: usize = 64 << 10;
    const WRITERS: usize = 4;
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let path = mount.path("direct");
    fs::write(&path, vec![b'a'; SIZE]).expect("write the file");
    let reader = File::open(&path).expect("open for reading");
    let mut seen = vec![0u8; SIZE];
    reader
        .read_exact_at(&mut seen, 0)
        .expect("read into the page cache");
    assert!(seen.iter().all(|&byte| byte == b'a'));

    let model = Xorshift::new(39).bytes(SIZE);
    std::thread::scope(|scope| {
        for writer in 0..WRITERS {
            let (path, model) = (&path, &model);
            scope.spawn(move || {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)
                    .expect("open with O_DIRECT");
                // A page-aligned buffer, as O_DIRECT wants on most file systems.
                let mut room = vec![0u8; BLOCK + 4096];
                let lead = (4096 - room.as_ptr() as usize % 4096) % 4096;
                let share = SIZE / WRITERS;
                // Blocks interleaved with the other writers' in time: each writer goes
                // through its quarter in its own order.
                let blocks = share / BLOCK;
                for step in 0..blocks {
                    let block = (step * 7 + writer) % blocks;
                    let at = writer * share + block * BLOCK;
                    let buffer = &mut room[lead..lead + BLOCK];
                    buffer.copy_from_slice(&model[at..at + BLOCK]);
                    file.write_all_at(buffer, at as u64).expect("direct write");
                }
            });
        }
    });
    reader.read_exact_at(&mut seen, 0).expect("read again");
    assert_bytes_eq(&seen, &model, "a reader holding the old pages");
    assert_bytes_eq(
        &fs::read(&path).expect("read through a new open"),
        &model,
        "a new open",
    );

    let direct = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .expect("open with O_DIRECT again");
    // SAFETY: a fresh shared read-only mapping of SIZE bytes of an open descriptor,
    // unmapped below before the descriptor is dropped.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ,
            libc::MAP_SHARED,
            direct.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        mapped,
        libc::MAP_FAILED,
        "a shared mapping of an O_DIRECT descriptor: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the mapping is SIZE bytes long and readable.
    let mapped_bytes = unsafe { std::slice::from_raw_parts(mapped.cast::<u8>(), SIZE) }.to_vec();
    // SAFETY: unmapping the mapping made above.
    unsafe { libc::munmap(mapped, SIZE) };
    assert_bytes_eq(&mapped_bytes, &model, "the mapping");
}

/// Streams of small writes longer than what one gathering holds (1 MiB): once full, the
/// gathered bytes go on their way on a task while the next write, answered at once on
/// the session thread, starts the next gathering. Two writers stream into their own half
/// of one file at once (write-only opens, whose writes the kernel runs in parallel), in
/// writes of 4 KiB to 98 KiB, some of odd lengths; after the closes every byte is there,
/// on this mount and on another one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_write_streams_past_a_gathering_all_land() {
    const HALF: usize = 5 << 20;
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let other = Mount::start(&cluster, "other", &[]);
    let path = mount.path("streams");
    File::create(&path).expect("create");
    let model = Xorshift::new(47).bytes(2 * HALF);
    std::thread::scope(|scope| {
        for (writer, lengths) in [(0usize, [65_536usize, 4096]), (1, [100_000, 7777])] {
            let (path, model) = (&path, &model);
            scope.spawn(move || {
                let mut file = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .expect("open write-only");
                let (start, end) = (writer * HALF, (writer + 1) * HALF);
                let mut at = start;
                for length in lengths.iter().cycle() {
                    if at == end {
                        break;
                    }
                    let length = (*length).min(end - at);
                    file.write_all_at(&model[at..at + length], at as u64)
                        .expect("write");
                    at += length;
                }
                file.flush().expect("flush");
            });
        }
    });
    assert_bytes_eq(
        &fs::read(&path).expect("read here"),
        &model,
        "the file on this mount",
    );
    assert_bytes_eq(
        &fs::read(other.path("streams")).expect("read on the other mount"),
        &model,
        "the file on another mount",
    );
}

/// Readers holding a file's pages while write-only opens write into them: each such write
/// has the kernel drop the pages it covers, and the kernel waits for every page under a
/// read to be answered first. The mount once did that wait on a thread of its runtime,
/// which the read's answer could be queued behind: the mount hung within seconds (a
/// `freeflow up` mount in two of two tries). The run must end, and the file then holds
/// exactly what was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_write_only_opens_under_busy_readers_never_hang_the_mount() {
    const SIZE: usize = 4 << 20;
    const RUN: Duration = Duration::from_secs(5);
    const DEADLINE: Duration = Duration::from_secs(90);
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let path = mount.path("busy");
    let model = Xorshift::new(21).bytes(SIZE);
    fs::write(&path, &model).expect("write the file");

    /// Reports a thread's end, however it ends.
    struct Finished(std::sync::mpsc::Sender<()>);
    impl Drop for Finished {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }
    let stop = Instant::now() + RUN;
    let (done, finished) = std::sync::mpsc::channel();
    let mut threads = Vec::new();
    for reader in 0..4u64 {
        let (path, done) = (path.clone(), done.clone());
        threads.push(std::thread::spawn(move || {
            let _done = Finished(done);
            let file = File::open(&path).expect("open for reading");
            let mut random = Xorshift::new(100 + reader);
            let mut buffer = vec![0u8; 64 << 10];
            let mut reads = 0u64;
            while Instant::now() < stop {
                let page = random.below((SIZE as u64 - (64 << 10)) / 4096);
                file.read_exact_at(&mut buffer, page * 4096).expect("read");
                reads += 1;
                if random.below(100) == 0 {
                    // Drop the pages now and then: the next reads fetch them again.
                    // SAFETY: a valid descriptor; the call touches no memory of ours.
                    unsafe {
                        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
                    };
                }
            }
            (reads, Vec::new())
        }));
    }
    for writer in 0..2u64 {
        let (path, done) = (path.clone(), done.clone());
        let mut half = model[writer as usize * SIZE / 2..(writer as usize + 1) * SIZE / 2].to_vec();
        threads.push(std::thread::spawn(move || {
            let _done = Finished(done);
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .expect("open write-only");
            let mut random = Xorshift::new(200 + writer);
            let base = writer * SIZE as u64 / 2;
            let mut writes = 0u64;
            while Instant::now() < stop {
                let length = 1 + random.below(8192) as usize;
                let at = random.below((half.len() - length) as u64) as usize;
                let bytes = random.bytes(length);
                file.write_all_at(&bytes, base + at as u64).expect("write");
                half[at..at + length].copy_from_slice(&bytes);
                writes += 1;
            }
            (writes, half)
        }));
    }
    drop(done);
    let deadline = Instant::now() + DEADLINE;
    for _ in 0..threads.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if finished.recv_timeout(left).is_err() {
            // Free the threads stuck in the kernel before failing (they get ENOTCONN).
            let device = fs::metadata(&mount.mountpoint)
                .expect("stat the mount")
                .dev();
            let connection = libc::minor(device);
            let _ = fs::write(format!("/sys/fs/fuse/connections/{connection}/abort"), "1");
            panic!("readers and write-only writers of one file did not finish in {DEADLINE:?}: the mount hung");
        }
    }
    let mut expected = Vec::with_capacity(SIZE);
    let mut counts = Vec::new();
    for thread in threads {
        let (count, half) = thread.join().expect("thread");
        counts.push(count);
        expected.extend_from_slice(&half);
    }
    assert!(
        counts.iter().all(|&count| count > 0),
        "every thread did some I/O: {counts:?}"
    );
    let seen = fs::read(&path).expect("read back");
    assert_bytes_eq(&seen, &expected, "the file after the run");
}
