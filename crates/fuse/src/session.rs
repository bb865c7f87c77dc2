//! Mounting and unmounting: the fuser session on several kernel channels, the bdi's
//! read-ahead, and a clean end.
//!
//! The mount is made with fuser's pure-Rust path (the `mount` system call; no libfuse, and
//! `fusermount3` only as fuser's own fallback for unprivileged users). After mounting, the
//! bdi read-ahead is raised (the kernel caps what FUSE_INIT may ask at its 128 KiB default).
//! [`MountHandle::unmount`] unmounts through fuser's own handle of the mount (so fuser never
//! tries a second unmount of its own, which would fail and warn), falls back to a lazy
//! detach when the mount is busy, waits a bounded time for the kernel to end the
//! connection, aborts the connection if requests are still held (e.g. by processes with
//! files open), then closes what the mount still had open at the meta server.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use freeflow_client::Client;
use fuser::{Config, MountOption, SessionACL, SessionUnmounter};

use crate::filesystem::{FreeflowFs, MountState};
use crate::options::{FuseError, MountOptions, Transport};
use crate::ring::Rings;

/// Read-ahead set on the mount's bdi after mounting.
pub const BDI_READAHEAD_KIB: u32 = 4096;
/// How long [`MountHandle::unmount`] waits for the kernel to end the connection before it
/// aborts it.
pub const UNMOUNT_WAIT_MS: u64 = 5_000;

/// A live mount. Dropping it detaches the mount (best effort, without waiting).
pub struct MountHandle {
    /// The thread running the session's loop (it starts the kernel channels' threads).
    session: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    /// fuser's handle of the mount: unmounting through it leaves fuser nothing to unmount.
    unmounter: Option<SessionUnmounter>,
    state: Arc<MountState>,
    /// The io_uring queues' threads, when requests come that way.
    rings: Option<Rings>,
    mountpoint: PathBuf,
    /// The mount's device (`major:minor`), naming its bdi and its FUSE connection.
    device: Option<(u32, u32)>,
}

impl std::fmt::Debug for MountHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountHandle")
            .field("mountpoint", &self.mountpoint)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// Mount `client`'s file system on `mountpoint` (an existing directory). Must be called
/// inside a tokio runtime: the requests run as tasks on it. Returns once the kernel has
/// initialised the connection; requests are served until [`MountHandle::unmount`].
pub fn mount(
    client: Client,
    mountpoint: &Path,
    options: MountOptions,
) -> Result<MountHandle, FuseError> {
    options.validate()?;
    if !Path::new("/dev/fuse").exists() {
        return Err(FuseError::NoFuseDevice);
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| FuseError::NoRuntime)?;
    // INIT offers the rings only while the kernel's parameter is on.
    let ring_wanted = match options.transport {
        Transport::DevFuse => false,
        Transport::IoUring => {
            crate::ring::enable_in_kernel().map_err(FuseError::IoUring)?;
            true
        }
        Transport::Auto => {
            let usable = crate::ring::enable_in_kernel().and_then(|()| {
                crate::ring::probe()
                    .map_err(|error| format!("this process cannot make io_uring rings: {error}"))
            });
            match usable {
                Ok(()) => true,
                Err(reason) => {
                    tracing::info!(%reason, "requests through /dev/fuse");
                    false
                }
            }
        }
    };
    let mount_error = |source: std::io::Error| FuseError::Mount {
        mountpoint: mountpoint.to_owned(),
        source,
    };
    let mountpoint = mountpoint.canonicalize().map_err(mount_error)?;
    let state = Arc::new(MountState::new(
        client,
        &options,
        runtime.clone(),
        ring_wanted,
    ));
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(options.source_name.clone()),
        MountOption::Subtype("freeflow".to_string()),
        MountOption::DefaultPermissions,
        MountOption::RW,
        MountOption::Dev,
        MountOption::Suid,
        MountOption::Exec,
    ];
    config.acl = if options.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(options.threads);
    config.clone_fd = options.threads > 1;
    let mut session = fuser::Session::new(FreeflowFs::new(state.clone()), &mountpoint, &config)
        .map_err(mount_error)?;
    let unmounter = session.unmount_callable();
    if options.cache_leases {
        // Revocations become the kernel's invalidations (cache.rs); from the first poll on,
        // the meta server leases what this mount reads.
        state.cache.set_notifier(session.notifier());
        let cache = state.cache.clone();
        let mount = Arc::downgrade(&state);
        state.client.watch_revocations(Arc::new(move |revocations| {
            // Open listings fetch again what another client changed (`handles.rs`).
            if let Some(mount) = mount.upgrade() {
                let changed: Vec<_> = revocations
                    .iter()
                    .filter(|revocation| {
                        revocation.inode == 0
                            || revocation.whole_directory
                            || !revocation.names.is_empty()
                    })
                    .map(|revocation| revocation.inode)
                    .collect();
                mount.directories.changed(&changed);
            }
            cache.revoke(revocations)
        }));
        if options.writeback {
            // Another client's change recalls this mount's writes to a file: the kernel's
            // dirty pages of it go out through the client before the acknowledgement.
            let cache = state.cache.clone();
            state
                .client
                .watch_recalls(Arc::new(move |inodes| cache.write_back(inodes)));
            runtime.spawn(evict_lapsing_files(Arc::downgrade(&state)));
        }
    }
    let device = mount_device(&mountpoint);
    match device {
        Some((major, minor)) => raise_readahead(major, minor),
        None => {
            tracing::warn!(mountpoint = %mountpoint.display(), "mount not found in /proc/self/mountinfo; read-ahead left as is")
        }
    }
    // The rings, once the cache is wired to the kernel's notifier, before the session's
    // threads start. Once INIT granted them the kernel holds every request until every
    // queue is registered, so a failure here fails the mount (the session's drop unmounts).
    let rings = if state.ring_granted.load(Ordering::Relaxed) {
        let started = session
            .as_fd()
            .try_clone_to_owned()
            .and_then(|fuse| Rings::start(FreeflowFs::new(state.clone()), &fuse, &mountpoint));
        match started {
            Ok(rings) => Some(rings),
            Err(error) => {
                return Err(FuseError::IoUring(format!(
                    "registering the rings: {error} (mount with --no-io-uring to read \
                     /dev/fuse instead)"
                )));
            }
        }
    } else {
        None
    };
    let session = std::thread::Builder::new()
        .name("fuse-session".to_string())
        .spawn(move || session.run())
        .map_err(mount_error)?;
    tracing::info!(mountpoint = %mountpoint.display(), threads = options.threads, "mounted");
    Ok(MountHandle {
        session: Some(session),
        unmounter: Some(unmounter),
        state,
        rings,
        mountpoint,
        device,
    })
}

impl MountHandle {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// True while the kernel connection is being served (false after an external
    /// `umount` or an abort).
    pub fn is_serving(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|session| !session.is_finished())
    }

    /// Wait until the mount ends by other means (`umount`, `fusermount -u`).
    pub async fn serving_ended(&self) {
        while self.is_serving() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Unmount: detach, wait for the connection to end (abort it after
    /// [`UNMOUNT_WAIT_MS`]), then close the files the mount still had open.
    pub async fn unmount(mut self) -> Result<(), FuseError> {
        let result = self.finish().await;
        // The session thread is joined; its Mount's drop finds nothing mounted.
        drop(self.session.take());
        result
    }

    async fn finish(&mut self) -> Result<(), FuseError> {
        if let Some(mut unmounter) = self.unmounter.take() {
            // A plain unmount; busy (files open), it fails and the mount is detached
            // lazily instead. Either way fuser's handle of it is used up.
            let unmounted = tokio::task::spawn_blocking(move || unmounter.unmount()).await;
            if !matches!(unmounted, Ok(Ok(()))) {
                tracing::debug!(mountpoint = %self.mountpoint.display(), "the mount is busy; detaching it");
                detach(&self.mountpoint);
            }
        } else {
            detach(&self.mountpoint);
        }
        let deadline = Instant::now() + Duration::from_millis(UNMOUNT_WAIT_MS);
        let mut aborted = false;
        while self.is_serving() {
            if Instant::now() >= deadline && !aborted {
                tracing::warn!(mountpoint = %self.mountpoint.display(), "files still open on the mount; aborting its connection");
                self.abort_connection();
                aborted = true;
            }
            if Instant::now() >= deadline + Duration::from_millis(UNMOUNT_WAIT_MS) {
                return Err(FuseError::Unmount {
                    mountpoint: self.mountpoint.clone(),
                    reason: "the kernel connection did not end".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(session) = self.session.take() {
            if let Err(error) = session
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a FUSE session thread panicked")))
            {
                tracing::warn!(%error, "the FUSE session ended with an error");
            }
        }
        if let Some(mut rings) = self.rings.take() {
            // The connection ended, so the queue threads have (or are about to).
            let _ = tokio::task::spawn_blocking(move || rings.stop()).await;
        }
        for handle in self.state.files.drain() {
            if let Err(error) = handle.close_shared().await {
                tracing::warn!(inode = handle.inode(), %error, "closing a file at unmount failed");
            }
        }
        tracing::info!(mountpoint = %self.mountpoint.display(), "unmounted");
        Ok(())
    }

    fn abort_connection(&self) {
        self.state.aborting();
        let Some((_, minor)) = self.device else {
            return;
        };
        let path = format!("/sys/fs/fuse/connections/{minor}/abort");
        let mut written = std::fs::write(&path, "1");
        if matches!(&written, Err(error) if error.kind() == std::io::ErrorKind::NotFound)
            && mount_fusectl()
        {
            // The FUSE control file system was not mounted (a fresh container): it is now.
            written = std::fs::write(&path, "1");
        }
        if let Err(error) = written {
            tracing::warn!(%path, %error, "cannot abort the FUSE connection");
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if self.session.is_some() {
            detach(&self.mountpoint);
        }
    }
}

/// Mounts the FUSE control file system on `/sys/fs/fuse/connections` (root only), where
/// a connection is aborted; whether it was mounted by this call. Left mounted, as a
/// distribution's boot would have it (it holds only the connections' control files).
fn mount_fusectl() -> bool {
    const TARGET: &std::ffi::CStr = c"/sys/fs/fuse/connections";
    // SAFETY: C strings that live across the call; no data argument.
    let mounted = unsafe {
        libc::mount(
            c"fusectl".as_ptr(),
            TARGET.as_ptr(),
            c"fusectl".as_ptr(),
            0,
            std::ptr::null(),
        )
    } == 0;
    if mounted {
        tracing::info!("mounted the FUSE control file system on /sys/fs/fuse/connections");
    } else {
        let error = std::io::Error::last_os_error();
        tracing::debug!(%error, "cannot mount the FUSE control file system");
    }
    mounted
}

/// Lazy unmount: the name goes now, the file system when nothing uses it.
fn detach(mountpoint: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: a valid NUL-terminated path; umount2 has no other preconditions.
    let result = unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    if result != 0 {
        let error = std::io::Error::last_os_error();
        tracing::debug!(mountpoint = %mountpoint.display(), %error, "detaching the mount");
    }
}

/// The device of the FUSE mount at `mountpoint`, from /proc/self/mountinfo (without
/// touching the mount itself, which may not be served yet).
fn mount_device(mountpoint: &Path) -> Option<(u32, u32)> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let wanted = mountpoint.to_str()?;
    // The last matching line is the topmost mount.
    mountinfo.lines().rev().find_map(|line| {
        let mut fields = line.split(' ');
        let device = fields.nth(2)?;
        let point = fields.nth(1)?;
        let fs_type = line.split(" - ").nth(1)?.split(' ').next()?;
        if unescape_mountinfo(point) != wanted || !fs_type.starts_with("fuse") {
            return None;
        }
        let (major, minor) = device.split_once(':')?;
        Some((major.parse().ok()?, minor.parse().ok()?))
    })
}

/// Mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'\\' && index + 4 <= bytes.len() {
            if let Ok(value) = u8::from_str_radix(&field[index + 1..index + 4], 8) {
                out.push(value);
                index += 4;
                continue;
            }
        }
        out.push(bytes[index]);
        index += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How often a writeback mount looks for files whose attribute lease is about to run out.
const LAPSE_SWEEP_INTERVAL: Duration = Duration::from_millis(250);
/// How long before its lease runs out such a file is evicted from the kernel.
const LAPSE_MARGIN: Duration = Duration::from_millis(1_000);
/// Longest a writeback mount spends following one held-open file at a sweep.
const FOLLOW_TIMEOUT: Duration = Duration::from_millis(2_000);

/// Marks the follow-up task as running until it ends (or panics).
struct Following(Arc<AtomicBool>);

impl Drop for Following {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A writeback mount's kernel keeps a file's size after the lease on its attributes ran
/// out, and no revocation tells of a change after that: every file not open here leaves
/// the kernel (its names invalidated) before its lease does (`KernelCache::lapsing`). A
/// file held open here cannot leave: it is followed instead (`MountState::follow_growth`:
/// a new lease, and its size raised in the kernel if it grew elsewhere), on a task of its
/// own so that a slow meta server never holds up the evictions. A revocation of such a
/// file wakes the sweep at once. Ends with the mount.
async fn evict_lapsing_files(state: std::sync::Weak<MountState>) {
    let Some(revoked) = state.upgrade().map(|state| state.cache.clone()) else {
        return;
    };
    let mut ticks = tokio::time::interval(LAPSE_SWEEP_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether a follow-up task is running.
    let following = Arc::new(AtomicBool::new(false));
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = revoked.revoked_held.notified() => {}
        }
        let Some(state) = state.upgrade() else {
            return;
        };
        let lapsing = state.cache.lapsing(Instant::now() + LAPSE_MARGIN);
        let (open, closed): (Vec<_>, Vec<_>) = lapsing
            .into_iter()
            .partition(|(inode, _)| state.files.get(*inode).is_some());
        if !open.is_empty() && !following.swap(true, Ordering::AcqRel) {
            let (state, following) = (state.clone(), Following(following.clone()));
            tokio::spawn(async move {
                let _following = following;
                for (inode, _) in open {
                    // Bounded, so that one file whose servers do not answer does not
                    // hold up the others (it is tried again at the next sweep).
                    let _ = tokio::time::timeout(FOLLOW_TIMEOUT, state.follow_growth(inode)).await;
                }
            });
        }
        let names: Vec<(u64, String)> = closed.into_iter().flat_map(|(_, names)| names).collect();
        if names.is_empty() {
            continue;
        }
        let cache = state.cache.clone();
        drop(state);
        // The kernel may hold a directory's lock for a request of this mount: off the
        // runtime, and not waited for by anything else.
        let _ = tokio::task::spawn_blocking(move || cache.evict_names(&names)).await;
    }
}

fn raise_readahead(major: u32, minor: u32) {
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    match std::fs::write(&path, BDI_READAHEAD_KIB.to_string()) {
        Ok(()) => tracing::debug!(%path, kib = BDI_READAHEAD_KIB, "read-ahead raised"),
        Err(error) => tracing::warn!(%path, %error, "cannot raise the mount's read-ahead"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo("/tmp/a\\040b"), "/tmp/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/end\\"), "/end\\");
    }
}
