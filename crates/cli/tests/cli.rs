//! The `freeflow` binary end to end: `freeflow up` as a child process, then the user tools
//! (`cp` both ways, `stripe get`, `status`, `ls`, `mkdir -p`, `mv`, `rm -r`, `cat`, `stat`)
//! against it, their failures (exit status and message), a clean stop on SIGINT, and a
//! restart of `up` on the same data directory that keeps the files.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{free_port, free_port_range, Xorshift, FREEFLOW};

/// Bound on one tool command (a 24 MiB copy in a debug build on a loaded machine included).
const COMMAND_WAIT_MS: u64 = 120_000;
/// Bound on `up` becoming ready or stopping.
const UP_WAIT_MS: u64 = 60_000;

/// What a finished command printed.
struct Outcome {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Run `freeflow ARGS` to completion within the bound (killed and failed past it).
fn freeflow(args: &[&str]) -> Outcome {
    let child = Command::new(FREEFLOW)
        .args(args)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot run {FREEFLOW}: {error}"));
    let pid = child.id();
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(Duration::from_millis(COMMAND_WAIT_MS)) {
        Ok(output) => {
            let output = output.expect("wait for freeflow");
            Outcome {
                status: output.status,
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            }
        }
        Err(_) => {
            // SAFETY: kill(2) on the pid of our own child, which has not been reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("freeflow {args:?} did not finish within {COMMAND_WAIT_MS} ms");
        }
    }
}

/// Run a command that must succeed.
#[track_caller]
fn ok(args: &[&str]) -> Outcome {
    let outcome = freeflow(args);
    assert!(
        outcome.status.success(),
        "freeflow {args:?} failed: {outcome:?}"
    );
    outcome
}

/// Run a command that must fail with a message containing every one of `causes`.
#[track_caller]
fn fails(args: &[&str], causes: &[&str]) -> Outcome {
    let outcome = freeflow(args);
    assert!(
        !outcome.status.success(),
        "freeflow {args:?} should fail: {outcome:?}"
    );
    assert_ne!(
        outcome.status.code(),
        None,
        "exits with a status, not a signal: {outcome:?}"
    );
    let lower = outcome.stderr.to_lowercase();
    for cause in causes {
        assert!(
            lower.contains(&cause.to_lowercase()),
            "freeflow {args:?}: stderr does not name {cause:?}: {outcome:?}"
        );
    }
    outcome
}

/// `freeflow up` running as a child, its stdout collected by a thread.
struct Up {
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr_path: PathBuf,
}

impl Up {
    /// Start `up` and wait for its ready line; None if it exited because a port it wanted
    /// was taken meanwhile (the caller picks other ports).
    fn try_start(data: &Path, port: u16, stderr_path: &Path) -> Option<Up> {
        Up::try_start_with(data, port, stderr_path, &[])
    }

    /// [`Up::try_start`] with more arguments for `up`.
    fn try_start_with(data: &Path, port: u16, stderr_path: &Path, extra: &[&str]) -> Option<Up> {
        let log_offset = std::fs::metadata(stderr_path).map(|m| m.len()).unwrap_or(0);
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(stderr_path)
            .expect("open the up log");
        let mut child = Command::new(FREEFLOW)
            .arg("up")
            .arg("--data")
            .arg(data)
            .args(["--io-servers", "4", "--port", &port.to_string()])
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("start freeflow up");
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let pipe = child.stdout.take().expect("piped stdout");
        let lines = stdout.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                lines.lock().expect("not poisoned").push(line);
            }
        });
        let mut up = Up {
            child,
            stdout,
            stderr_path: stderr_path.to_owned(),
        };
        if up.wait_for_line_or_exit("Freeflow is up") {
            return Some(up);
        }
        let log = std::fs::read(stderr_path).unwrap_or_default();
        let new_log = String::from_utf8_lossy(&log[(log_offset as usize).min(log.len())..]);
        if new_log.contains("in use") {
            return None;
        }
        panic!("freeflow up exited before it was up\n{}", up.output());
    }

    /// Start `up`, which must come up on this port.
    fn start(data: &Path, port: u16, stderr_path: &Path) -> Up {
        match Up::try_start(data, port, stderr_path) {
            Some(up) => up,
            None => panic!("freeflow up: port {port} or one after it is in use"),
        }
    }

    fn output(&self) -> String {
        let stdout = self.stdout.lock().expect("not poisoned").join("\n");
        let stderr = common::read_log(&self.stderr_path);
        format!("--- up stdout ---\n{stdout}\n--- up stderr ---\n{stderr}")
    }

    /// Wait for a stdout line containing `text`: true when seen, false if `up` exited first.
    fn wait_for_line_or_exit(&mut self, text: &str) -> bool {
        let deadline = Instant::now() + Duration::from_millis(UP_WAIT_MS);
        while Instant::now() < deadline {
            if self
                .stdout
                .lock()
                .expect("not poisoned")
                .iter()
                .any(|line| line.contains(text))
            {
                return true;
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "no {text:?} from freeflow up within {UP_WAIT_MS} ms\n{}",
            self.output()
        );
    }

    /// SIGINT, then wait (bounded) for the exit status.
    fn interrupt(mut self) -> (ExitStatus, String) {
        // SAFETY: kill(2) on the pid of our own running child.
        let result = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGINT) };
        assert_eq!(result, 0, "send SIGINT");
        let deadline = Instant::now() + Duration::from_millis(UP_WAIT_MS);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // Let the reader thread take the last lines.
                let _ = common::poll_sync(2_000, || {
                    self.stdout
                        .lock()
                        .expect("not poisoned")
                        .iter()
                        .any(|line| line.contains("stopped"))
                });
                let output = self.output();
                return (status, output);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "freeflow up did not stop within {UP_WAIT_MS} ms of SIGINT\n{}",
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn lines_with<'a>(text: &'a str, needle: &str) -> Vec<&'a str> {
    text.lines().filter(|line| line.contains(needle)).collect()
}

#[test]
fn up_then_the_tools_then_sigint_then_up_again() {
    let scratch = tempfile::Builder::new()
        .prefix("freeflow-cli-test-")
        .tempdir()
        .expect("temporary directory");
    let data = scratch.path().join("data");
    let up_log = scratch.path().join("up.log");
    let (port, up) = (0..5)
        .find_map(|_| {
            let port = free_port_range(&[0, 10, 11, 12, 13]);
            Up::try_start(&data, port, &up_log).map(|up| (port, up))
        })
        .expect("freeflow up found free ports within 5 tries");
    let cluster_file = data.join("client.toml");
    assert!(cluster_file.exists(), "up writes the client file");
    let cluster = cluster_file.to_str().expect("utf-8 path");

    // status: four servers up.
    let status = ok(&["--cluster", cluster, "status"]);
    assert!(
        status.stdout.contains("4 of 4 I/O servers up"),
        "status: {status:?}"
    );
    // `up` reaches its I/O servers over Unix sockets in their data directories.
    let canonical = data.canonicalize().expect("the data directory");
    for server in 0..4u16 {
        let address = format!(
            "unix:{}",
            canonical.join(format!("io-{server}/io.sock")).display()
        );
        let rows = lines_with(&status.stdout, &address);
        assert_eq!(rows.len(), 1, "status lists {address} once: {status:?}");
        assert!(rows[0].contains(" up "), "{address} is up: {status:?}");
        // TCP is still served beside the socket, for clients on other hosts.
        let tcp = format!("127.0.0.1:{}", port + 10 + server);
        assert!(
            std::net::TcpStream::connect(&tcp).is_ok(),
            "I/O server {server} listens on {tcp} too"
        );
    }

    // cp in and out of 24 MiB (+ an unaligned tail) of random data.
    let original = Xorshift::new(21).bytes((24 << 20) + 4321);
    let local = scratch.path().join("local.bin");
    std::fs::write(&local, &original).expect("write the local file");
    ok(&[
        "--cluster",
        cluster,
        "cp",
        "-q",
        local.to_str().unwrap(),
        "ff:/f",
    ]);
    let copied = scratch.path().join("copied.bin");
    ok(&[
        "--cluster",
        cluster,
        "cp",
        "-q",
        "ff:/f",
        copied.to_str().unwrap(),
    ]);
    let back = std::fs::read(&copied).expect("read the copy");
    common::assert_bytes_eq(&back, &original, "cp into the cluster and back");
    // And within the cluster (each chunk's replies written on as they are).
    ok(&["--cluster", cluster, "cp", "-q", "ff:/f", "ff:/f-copy"]);
    let copied_within = scratch.path().join("copied-within.bin");
    ok(&[
        "--cluster",
        cluster,
        "cp",
        "-q",
        "ff:/f-copy",
        copied_within.to_str().unwrap(),
    ]);
    let back = std::fs::read(&copied_within).expect("read the copy made within the cluster");
    common::assert_bytes_eq(&back, &original, "cp within the cluster");
    ok(&["--cluster", cluster, "rm", "ff:/f-copy"]);

    // stripe get: every one of the 4 servers holds a stripe.
    let stripes = ok(&["--cluster", cluster, "stripe", "get", "ff:/f"]);
    assert!(
        stripes
            .stdout
            .contains(&format!("{} bytes", original.len())),
        "stripe get shows the size: {stripes:?}"
    );
    let mut servers: Vec<u32> = stripes
        .stdout
        .lines()
        .skip_while(|line| !line.starts_with("STRIPE"))
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(1)?.parse().ok())
        .collect();
    servers.sort();
    assert_eq!(servers, [0, 1, 2, 3], "stripe get: {stripes:?}");

    // stat of the file.
    let stat = ok(&["--cluster", cluster, "stat", "ff:/f"]);
    assert!(
        stat.stdout
            .contains(&format!("Size: {} bytes", original.len())),
        "{stat:?}"
    );

    // Namespace tools.
    ok(&["--cluster", cluster, "mkdir", "-p", "ff:/x/y/z"]);
    ok(&["--cluster", cluster, "mkdir", "-p", "ff:/x/y/z"]); // exists: still fine with -p
    fails(
        &["--cluster", cluster, "mkdir", "ff:/x/y/z"],
        &["/x/y/z", "exists"],
    );
    let listing = ok(&["--cluster", cluster, "ls", "ff:/x/y"]);
    assert_eq!(listing.stdout.trim(), "z", "{listing:?}");
    ok(&["--cluster", cluster, "mv", "ff:/f", "ff:/x/g"]);
    let small = scratch.path().join("small.txt");
    std::fs::write(&small, "hello, freeflow\n").expect("write small");
    ok(&[
        "--cluster",
        cluster,
        "cp",
        "-q",
        small.to_str().unwrap(),
        "ff:/x/small",
    ]);
    let cat = ok(&["--cluster", cluster, "cat", "ff:/x/small"]);
    assert_eq!(cat.stdout, "hello, freeflow\n");
    let listing = ok(&["--cluster", cluster, "ls", "ff:/x"]);
    let names: Vec<&str> = listing.stdout.lines().collect();
    assert_eq!(names, ["g", "small", "y"], "{listing:?}");
    let root = ok(&["--cluster", cluster, "ls", "/"]);
    assert_eq!(root.stdout.trim(), "x", "mv took /f away: {root:?}");
    let long = ok(&["--cluster", cluster, "ls", "-l", "ff:/x"]);
    assert!(
        lines_with(&long.stdout, " g ")
            .iter()
            .any(|line| line.contains(&original.len().to_string())),
        "ls -l shows g's size: {long:?}"
    );
    fails(&["--cluster", cluster, "rm", "ff:/x/y"], &["/x/y"]);
    ok(&["--cluster", cluster, "rm", "-r", "ff:/x/y"]);
    ok(&["--cluster", cluster, "rm", "ff:/x/small"]);
    let listing = ok(&["--cluster", cluster, "ls", "ff:/x"]);
    assert_eq!(listing.stdout.trim(), "g", "{listing:?}");

    // Failures name their cause and exit non-zero.
    let missing_local = scratch.path().join("no-such-file");
    let outcome = fails(
        &[
            "--cluster",
            cluster,
            "cp",
            "-q",
            missing_local.to_str().unwrap(),
            "ff:/z",
        ],
        &[missing_local.to_str().unwrap()],
    );
    assert!(
        outcome.stderr.to_lowercase().contains("no such file"),
        "{outcome:?}"
    );
    fails(
        &["--cluster", cluster, "stat", "ff:/x/nope"],
        &["/x/nope", "no such file"],
    );
    fails(&["--cluster", cluster, "cat", "ff:/x"], &["/x"]);
    // A cluster that is down: a client file naming a port where nobody listens.
    let dead_port = free_port();
    let dead_cluster = scratch.path().join("dead.toml");
    std::fs::write(
        &dead_cluster,
        format!(
            "meta_address = \"127.0.0.1:{dead_port}\"\nkey_file = \"{}\"\ncall_timeout_ms = 5000\n",
            data.join("cluster.key").display()
        ),
    )
    .expect("write the dead client file");
    let outcome = fails(
        &["--cluster", dead_cluster.to_str().unwrap(), "ls", "/"],
        &[&format!("127.0.0.1:{dead_port}")],
    );
    assert_eq!(
        outcome.status.code(),
        Some(69),
        "an unreachable cluster exits EX_UNAVAILABLE: {outcome:?}"
    );
    fails(
        &[
            "--cluster",
            scratch.path().join("absent.toml").to_str().unwrap(),
            "status",
        ],
        &["absent.toml"],
    );

    // SIGINT stops up cleanly.
    let (status, output) = up.interrupt();
    assert!(
        status.success(),
        "up exits 0 on SIGINT: {status:?}\n{output}"
    );
    assert!(output.contains("stopped"), "up says it stopped:\n{output}");
    fails(
        &["--cluster", cluster, "ls", "/"],
        &[&format!("127.0.0.1:{port}")],
    );

    // up again on the same directory keeps the file.
    let up = Up::start(&data, port, &up_log);
    let again = scratch.path().join("again.bin");
    ok(&[
        "--cluster",
        cluster,
        "cp",
        "-q",
        "ff:/x/g",
        again.to_str().unwrap(),
    ]);
    let back = std::fs::read(&again).expect("read the second copy");
    common::assert_bytes_eq(&back, &original, "the file after restarting up");
    let status = ok(&["--cluster", cluster, "status"]);
    assert!(
        status.stdout.contains("4 of 4 I/O servers up"),
        "status after restart: {status:?}"
    );
    let (status, output) = up.interrupt();
    assert!(
        status.success(),
        "second up exits 0 on SIGINT: {status:?}\n{output}"
    );
}

/// The CLI against separately started server processes (the harness's configs): `status`
/// reports a killed I/O server as down within the meta server's down-after bound, and a
/// restarted one as up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_a_killed_io_server_as_down() {
    let mut cluster = common::Cluster::start(2).await;
    let client_toml = cluster.client_toml();
    let cluster_file = client_toml.to_str().expect("utf-8 path").to_string();
    let status_of = |cluster_file: String| async move {
        tokio::task::spawn_blocking(move || ok(&["--cluster", &cluster_file, "status"]))
            .await
            .expect("status task")
    };
    let status = status_of(cluster_file.clone()).await;
    assert!(
        status.stdout.contains("2 of 2 I/O servers up"),
        "{status:?}"
    );

    cluster.kill_io(1);
    let victim = cluster.io_address(1).to_string();
    let down = common::poll_until(20_000, || {
        let (cluster_file, victim) = (cluster_file.clone(), victim.clone());
        async move {
            let status = status_of(cluster_file).await;
            let row_down = lines_with(&status.stdout, &victim)
                .iter()
                .any(|row| row.contains("DOWN"));
            (row_down && status.stdout.contains("1 of 2 I/O servers up")).then_some(status)
        }
    })
    .await;
    assert!(
        down.is_some(),
        "status never showed {victim} DOWN\n{}",
        cluster.all_logs()
    );

    cluster.restart_io(1).await;
    let status = status_of(cluster_file).await;
    assert!(
        status.stdout.contains("2 of 2 I/O servers up"),
        "after restart: {status:?}"
    );
}

/// A scratch directory for `up --mount`: the directory, its `data`, an empty `mnt` and the
/// path of `up.log`.
fn scratch_with_mount_point() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let scratch = tempfile::Builder::new()
        .prefix("freeflow-cli-test-")
        .tempdir()
        .expect("temporary directory");
    let data = scratch.path().join("data");
    let mountpoint = scratch.path().join("mnt");
    std::fs::create_dir(&mountpoint).expect("make the mount point");
    let up_log = scratch.path().join("up.log");
    (scratch, data, mountpoint, up_log)
}

/// `freeflow up --mount DIR`, exactly as the README gives it, run as root: every user of
/// the host can use the mount (allow_other), with the kernel checking their permissions;
/// and Ctrl-C unmounts without a warning. (Issue 8: a POSIX suite run by users other than
/// root got EACCES on every step.)
#[test]
fn up_with_a_mount_serves_every_user_of_the_host() {
    // SAFETY: geteuid has no preconditions.
    if !Path::new("/dev/fuse").exists() || unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: needs /dev/fuse and root");
        return;
    }
    let (scratch, data, mountpoint, up_log) = scratch_with_mount_point();
    // Every user must be able to reach the mount point itself.
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod the scratch directory");
    let mount_argument = mountpoint.to_str().expect("utf-8 path").to_string();
    let up = (0..5)
        .find_map(|_| {
            let port = free_port_range(&[0, 1, 2, 10, 11, 12, 13, 100, 101, 102, 103]);
            Up::try_start_with(&data, port, &up_log, &["--mount", &mount_argument])
        })
        .expect("freeflow up found free ports within 5 tries");
    let shared = mountpoint.join("shared");
    std::fs::create_dir(&shared).expect("mkdir as root");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod 1777");
    let script = format!(
        "ls {mnt} >/dev/null && echo hello > {dir}/mine && cat {dir}/mine && ! touch {mnt}/not-mine",
        mnt = mountpoint.display(),
        dir = shared.display()
    );
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &script,
        ])
        .output()
        .expect("run setpriv");
    assert!(
        output.status.success(),
        "as user 65534: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        up.output()
    );
    assert_eq!(String::from_utf8_lossy(&output.stdout), "hello\n");
    assert_eq!(
        std::fs::metadata(shared.join("mine")).expect("stat").uid(),
        65534,
        "the file belongs to the user who made it"
    );
    let (status, output) = up.interrupt();
    assert!(status.success(), "{output}");
    assert!(!output.contains("WARN"), "{output}");
}

/// `freeflow up --meta-servers 3 --replicas 2 --mount DIR`, the one-command replicated
/// cluster (issue 11): three metadata members elect a leader, `status` lists them with their
/// roles and every I/O server in service, a file written through the mount keeps two copies
/// of each stripe (`stripe get`) and reads back, and Ctrl-C stops it all cleanly, with no
/// error logged on the way (members start together, so none asks for votes before the
/// others listen).
#[test]
fn up_with_three_metadata_members_and_two_copies_serves_a_mount() {
    if !Path::new("/dev/fuse").exists() {
        eprintln!("skipping: /dev/fuse is missing");
        return;
    }
    let (_scratch, data, mountpoint, up_log) = scratch_with_mount_point();
    let mount_argument = mountpoint.to_str().expect("utf-8 path").to_string();
    let offsets = [
        0, 1, 2, 3, 4, 10, 11, 12, 13, 74, 75, 76, 81, 82, 100, 101, 102, 103,
    ];
    let up = (0..5)
        .find_map(|_| {
            let port = free_port_range(&offsets);
            Up::try_start_with(
                &data,
                port,
                &up_log,
                &[
                    "--meta-servers",
                    "3",
                    "--replicas",
                    "2",
                    "--mount",
                    &mount_argument,
                ],
            )
        })
        .expect("freeflow up found free ports within 5 tries");
    let cluster = data.join("client.toml");
    let cluster = cluster.to_str().expect("utf-8 path");

    let bytes = Xorshift::new(33).bytes((3 << 20) + 777);
    std::fs::write(mountpoint.join("replicated.bin"), &bytes).expect("write through the mount");
    let file = std::fs::File::open(mountpoint.join("replicated.bin")).expect("open");
    file.sync_all().expect("fsync");
    drop(file);
    assert!(
        std::fs::read(mountpoint.join("replicated.bin")).expect("read back") == bytes,
        "the file reads back as written"
    );

    let status = ok(&["--cluster", cluster, "status"]);
    assert!(
        status.stdout.contains("4 of 4 I/O servers up"),
        "status: {status:?}"
    );
    assert_eq!(
        lines_with(&status.stdout, "in service").len(),
        4,
        "every I/O server in its chains: {status:?}"
    );
    // The META table: id, address, role, term, lag.
    let mut roles: Vec<&str> = status
        .stdout
        .lines()
        .skip_while(|line| !line.starts_with("META "))
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(2))
        .collect();
    roles.sort_unstable();
    assert_eq!(
        roles,
        ["follower", "follower", "leader"],
        "one leader, two followers: {status:?}"
    );
    let stripes = ok(&["--cluster", cluster, "stripe", "get", "ff:/replicated.bin"]);
    assert!(
        stripes.stdout.contains("2 copies of each"),
        "stripe get: {stripes:?}"
    );

    let (status, output) = up.interrupt();
    assert!(status.success(), "{output}");
    assert!(!output.contains("ERROR"), "{output}");
}
