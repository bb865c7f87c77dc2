//! Mounts for tests: `freeflow mount` child processes, and helpers for checking what a
//! program on the mount sees.

use std::ffi::CString;
use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Cluster, FREEFLOW};

/// How long a mount gets to appear in /proc/mounts.
const MOUNT_WAIT_MS: u64 = 30_000;

pub fn fuse_available() -> bool {
    if Path::new("/dev/fuse").exists() {
        return true;
    }
    eprintln!("skipping: /dev/fuse is missing, so nothing can be mounted here");
    false
}

/// Whether this kernel can carry FUSE requests over io_uring (the mount turns the
/// parameter on itself).
pub fn io_uring_available() -> bool {
    if Path::new("/sys/module/fuse/parameters/enable_uring").exists() {
        return true;
    }
    eprintln!("skipping: this kernel has no FUSE over io_uring (fuse.enable_uring)");
    false
}

pub fn is_mounted(mountpoint: &Path) -> bool {
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    let wanted = mountpoint.to_string_lossy();
    mounts
        .lines()
        .any(|line| line.split(' ').nth(1) == Some(&*wanted))
}

/// A `freeflow mount` child process. Dropping it stops the process and clears the mount.
pub struct Mount {
    pub child: Option<Child>,
    pub mountpoint: PathBuf,
    pub log: PathBuf,
}

impl Mount {
    pub fn start(cluster: &Cluster, name: &str, extra: &[&str]) -> Mount {
        Mount::start_in(cluster.path(), &cluster.client_toml(), name, extra)
    }

    /// A mount of the cluster `client_toml` names, at `dir/name` (its log beside it).
    pub fn start_in(dir: &Path, client_toml: &Path, name: &str, extra: &[&str]) -> Mount {
        let mountpoint = dir.join(name);
        fs::create_dir_all(&mountpoint).expect("make the mount point");
        let mountpoint = mountpoint.canonicalize().expect("canonical mount point");
        let log = dir.join(format!("{name}.log"));
        let log_file = File::create(&log).expect("create the mount log");
        let child = Command::new(FREEFLOW)
            .arg("mount")
            .arg(client_toml)
            .arg(&mountpoint)
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file.try_clone().expect("clone log")))
            .stderr(Stdio::from(log_file))
            .spawn()
            .expect("start freeflow mount");
        let mut mount = Mount {
            child: Some(child),
            mountpoint,
            log,
        };
        let deadline = Instant::now() + Duration::from_millis(MOUNT_WAIT_MS);
        while !is_mounted(&mount.mountpoint) {
            if let Some(status) = mount
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("freeflow mount exited with {status}:\n{}", mount.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "not mounted within {MOUNT_WAIT_MS} ms:\n{}",
                mount.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        mount
    }

    pub fn path(&self, relative: &str) -> PathBuf {
        self.mountpoint.join(relative)
    }

    pub fn log_text(&self) -> String {
        super::read_log(&self.log)
    }

    pub fn signal(&self, signal: libc::c_int) {
        if let Some(child) = &self.child {
            // SAFETY: sending a signal to our own child process.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        }
    }

    /// SIGTERM and wait for a clean exit; returns whether it exited 0 in time.
    pub fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        // SAFETY: as in `signal`.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.signal(libc::SIGTERM);
        if !self.stop() {
            eprintln!("mount did not stop cleanly:\n{}", self.log_text());
        }
        lazy_unmount(&self.mountpoint);
    }
}

pub fn lazy_unmount(mountpoint: &Path) {
    if is_mounted(mountpoint) {
        let path = CString::new(mountpoint.as_os_str().as_bytes()).expect("path");
        // SAFETY: valid path; MNT_DETACH has no other preconditions.
        unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Open (creating it if needed, mode 0644) for reading and writing.
pub fn open_rw(path: &Path) -> File {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(path)
        .unwrap_or_else(|error| panic!("open {}: {error}", path.display()))
}

pub fn errno_of<T>(result: std::io::Result<T>) -> Option<i32> {
    result.err().and_then(|error| error.raw_os_error())
}

/// Run a shell command as `uid:gid` (no supplementary groups) and return whether it
/// succeeded, with its stderr.
pub fn run_as(uid: u32, gid: u32, script: &str) -> (bool, String) {
    let output = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"))
        .arg("--clear-groups")
        .arg("sh")
        .arg("-c")
        .arg(script)
        .output()
        .expect("run setpriv");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
