//! The request handlers: one `fuser::Filesystem` method per kernel operation, each mapped
//! onto the client library's inode API.
//!
//! A handler never waits for the cluster on the thread that read the request: it takes what
//! it needs from the request (names, data, credentials), moves the reply object into a task
//! on the tokio runtime and returns to read the next request. So one slow request (a read
//! from a far server, an fsync) never holds up the others, and a sequential writer keeps
//! several writes in flight. [`REQUESTS_IN_FLIGHT_MAX`] bounds the tasks: past it, the
//! reading thread waits for one to finish.
//!
//! Inode numbers are Freeflow's inode ids (never reused, so the FUSE generation is 0; the
//! `generation` of an `Attr` counts changes of the inode and is not a FUSE generation).
//!
//! This file holds what the handlers share: [`MountState`], [`FreeflowFs`] with the running
//! of tasks (`spawn`, `answer_read`) and INIT (`init_kernel`), and the open flags' helpers.
//! The handlers, one per kernel operation with the operation's arguments as the kernel
//! gives them (hence their many parameters; `dev.rs` and `ring/dispatch.rs` call them),
//! are in an `impl FreeflowFs` per group: `names.rs`, `attributes.rs`, `data.rs`,
//! `directories.rs`, `locks.rs`, `xattrs.rs`. `kernel_cache.rs` holds the methods of
//! [`MountState`] for what the kernel caches (entry and attribute replies under leases,
//! evictions, this mount's listings, the growth of held-open files). Those files name
//! this one and never each other; this one names none of them.

mod attributes;
mod data;
mod directories;
mod kernel_cache;
mod locks;
mod names;
mod xattrs;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use freeflow_client::{Client, InodeId};
use freeflow_metrics::Counter;
use fuser::{Errno, FileHandle, FopenFlags, InitFlags, KernelConfig};
use tokio::sync::Semaphore;

use crate::cache::KernelCache;
use crate::caller::GroupsCache;
use crate::handles::{OpenDirectories, OpenFiles};
use crate::held::KernelInodes;
use crate::limits::{MAX_WRITE_BYTES, REQUESTS_IN_FLIGHT_MAX};
use crate::options::MountOptions;
use crate::reply::Caller;
use crate::shadow::Shadows;

/// Read-ahead asked of the kernel at init (it caps this at its own offer; the mount raises
/// the bdi's read-ahead after mounting).
pub const MAX_READAHEAD_BYTES: u32 = 1 << 20;

/// Background requests (read-ahead, async direct I/O) the kernel keeps in flight.
pub const MAX_BACKGROUND_REQUESTS: u16 = 64;

/// Longest read a session thread answers itself (`FreeflowFs::answer_read`): one piece.
pub const READ_HERE_BYTES_MAX: u32 = 128 << 10;

/// Everything the handlers share; the tasks hold it through an `Arc`.
pub(crate) struct MountState {
    /// Acting as root; per-request clients come from `with_caller`.
    pub client: Client,
    pub attr_ttl: Duration,
    pub entry_ttl: Duration,
    pub sync_on_close: bool,
    pub files: OpenFiles,
    pub directories: OpenDirectories,
    groups: GroupsCache,
    /// The inodes the kernel holds and the sizes it keeps of them (`held.rs`).
    pub held: KernelInodes,
    runtime: tokio::runtime::Handle,
    in_flight: Arc<Semaphore>,
    /// A lone read may be answered on the session thread that took it (`answer_read`):
    /// plain mounts with more than one session thread.
    reads_here: bool,
    /// A session thread is answering a read itself now (one at a time).
    reading_here: AtomicBool,
    /// The kernel lets opens answered past its page cache be mapped shared
    /// (`FUSE_DIRECT_IO_ALLOW_MMAP`, set at init).
    direct_mmap: AtomicBool,
    /// Set when the connection is aborted: a read answered on a session thread is given
    /// up, so the thread ends with the session.
    ending: tokio::sync::watch::Sender<bool>,
    /// What the kernel caches under leases, and how to take it back (`cache/`).
    pub cache: Arc<KernelCache>,
    /// The kernel's writeback cache is on (`MountOptions::writeback`).
    pub writeback: bool,
    /// INIT asks for FUSE over io_uring (`MountOptions::transport`, the kernel's
    /// parameter on and rings possible here: `session::mount` found out).
    ring_wanted: bool,
    /// The kernel granted it at INIT: the rings are to be registered.
    pub ring_granted: AtomicBool,
    /// The mount fails unless granted (`Transport::IoUring`).
    ring_required: bool,
    /// Writeback mounts: the pages of files open for writing as the kernel got them, so
    /// that a page written back carries only what changed here (`shadow.rs`).
    pub shadows: Shadows,
    /// Writeback mounts: files open for writing here that another client grew meanwhile
    /// (`follow_growth` leaves the kernel's size alone while a write open is here); their
    /// last write close here shows the kernel the new size.
    grown_elsewhere: Mutex<std::collections::HashSet<InodeId>>,
    /// `READDIRPLUS` entries given with their attributes, and as names alone (the kernel
    /// held the name and the attributes already: `KernelCache::kernel_holds`).
    listed_with_attributes: Counter,
    listed_names_alone: Counter,
}

const LISTED_ENTRIES_HELP: &str = "Entries of READDIRPLUS replies, by whether their \
     attributes went with them (given) or the kernel held the name and attributes already \
     and got the name alone (held).";

/// The size an entry reply gives the kernel, if it is a regular file's.
fn regular_size(attr: &fuser::FileAttr) -> Option<u64> {
    (attr.kind == fuser::FileType::RegularFile).then_some(attr.size)
}

/// The `fuser` file system: a thin shell that hands each request to a task.
pub(crate) struct FreeflowFs {
    state: Arc<MountState>,
}

/// Whether open flags give write access (the kernel has checked the caller's right to it).
fn writes(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY
}

/// Whether open flags give read access.
fn reads(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_WRONLY
}

/// Set in the file handle number of an open answered past the kernel's page cache (the
/// rest is the inode): a program may switch `O_DIRECT` on or off with `fcntl` later, and
/// the kernel sends the flags of that moment with each write and the release, but the
/// answer stays; writes and the release go by this bit.
const PAST_CACHE: u64 = 1 << 63;

/// The file handle number of an open of `inode` answered with `answer`.
fn open_handle(inode: InodeId, answer: FopenFlags) -> FileHandle {
    let past_cache = answer.contains(FopenFlags::FOPEN_DIRECT_IO);
    FileHandle(inode | if past_cache { PAST_CACHE } else { 0 })
}

/// Whether an open with `flags` answered with the handle `handle` reads through the
/// kernel's page cache (it may then keep pages of the file).
fn reads_pages(handle: FileHandle, flags: i32) -> bool {
    reads(flags) && handle.0 & PAST_CACHE == 0
}

/// What an open of a regular file with `flags` is answered with. Without the writeback
/// cache, an open for writing only goes past the kernel's page cache (`FOPEN_DIRECT_IO`):
/// its writes were sent through at once anyway (write-through), the copy into the page
/// cache bought nothing (every open drops the file's pages, and such an open can neither
/// read nor map the file), and the kernel then hands the writer's own pages to the mount.
/// So does an `O_DIRECT` open, which asked for no cache, where the kernel lets such opens
/// be mapped shared (`FUSE_DIRECT_IO_ALLOW_MMAP`, `direct_mmap`: it then caches the file
/// for the mapping; an older kernel refuses the mapping, so there `O_DIRECT` opens that
/// can read take the page cache's direct path as before). Their
/// writes may run at once (`FOPEN_PARALLEL_DIRECT_WRITES`): the kernel takes its lock of
/// the file shared for them, not exclusive (still exclusive for an append, a write past
/// its size, or while the file is mapped), as the mount takes writes of one file in any
/// order; without it, every writer of a file waited for the one before, whatever the
/// ranges. With the writeback cache the kernel's pages are what gathers small writes.
fn open_reply_flags(state: &MountState, flags: i32) -> FopenFlags {
    let write_only = flags & libc::O_ACCMODE == libc::O_WRONLY;
    let direct = flags & libc::O_DIRECT != 0 && state.direct_mmap.load(Ordering::Relaxed);
    if !state.writeback && (write_only || direct) {
        FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
    } else {
        FopenFlags::empty()
    }
}

/// An error for a file handle the mount does not know.
fn bad_handle() -> Errno {
    Errno::EBADF
}

impl MountState {
    pub fn new(
        client: Client,
        options: &MountOptions,
        runtime: tokio::runtime::Handle,
        ring_wanted: bool,
    ) -> MountState {
        let listed = |attributes: &'static str| {
            client.metrics().counter(
                "freeflow_mount_listed_entries_total",
                LISTED_ENTRIES_HELP,
                &[("attributes", attributes)],
            )
        };
        MountState {
            listed_with_attributes: listed("given"),
            listed_names_alone: listed("held"),
            client: client.with_caller(freeflow_client::Caller::root()),
            attr_ttl: Duration::from_millis(options.attr_timeout_ms),
            entry_ttl: Duration::from_millis(options.entry_timeout_ms),
            sync_on_close: options.sync_on_close,
            files: OpenFiles::new(),
            directories: OpenDirectories::new(),
            groups: GroupsCache::new(),
            held: KernelInodes::new(options.writeback),
            runtime,
            in_flight: Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_MAX)),
            reads_here: !options.writeback && options.threads > 1,
            reading_here: AtomicBool::new(false),
            direct_mmap: AtomicBool::new(false),
            ending: tokio::sync::watch::channel(false).0,
            cache: Arc::new(KernelCache::new(options.writeback)),
            writeback: options.writeback,
            ring_wanted,
            ring_granted: AtomicBool::new(false),
            ring_required: options.transport == crate::options::Transport::IoUring,
            shadows: Shadows::new(options.writeback),
            grown_elsewhere: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// The connection is being aborted: a read a session thread answers itself is given
    /// up (`FreeflowFs::answer_read`).
    pub fn aborting(&self) {
        self.ending.send_replace(true);
    }
}

impl FreeflowFs {
    pub fn new(state: Arc<MountState>) -> FreeflowFs {
        FreeflowFs { state }
    }

    /// Run `task` on the runtime, waiting here first if too many are in flight.
    fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let semaphore = self.state.in_flight.clone();
        let permit = match semaphore.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // This is a fuser thread, not a runtime thread: blocking here is the back pressure.
            Err(_) => self
                .state
                .runtime
                .block_on(semaphore.acquire_owned())
                .expect("the in-flight semaphore is never closed"),
        };
        self.state.runtime.spawn(async move {
            task.await;
            drop(permit);
        });
    }

    /// Answers a read: on this session thread when it is the mount's only request (a
    /// reader at queue depth 1), else as a task like every request. Here, the read's
    /// future is driven by this thread and a local read that misses the page cache waits
    /// for the disk here too (`freeflow_client::reads_in_place`): no hand-off to a runtime
    /// worker, then to the blocking pool and back, each the wake-up of an idle CPU. One
    /// session thread at a time does it, so the others keep taking the kernel's requests
    /// (a read that waits for another request's answer is answered by them); writeback
    /// mounts never do (their reads may wait on page locks the kernel holds for others).
    /// Only reads of at most [`READ_HERE_BYTES_MAX`]: a longer one may span several
    /// stripe units, whose reads from the disk should run at once on the blocking pool,
    /// not one after another here.
    fn answer_read<F>(&self, size: u32, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let state = &self.state;
        let alone = state.reads_here
            && size <= READ_HERE_BYTES_MAX
            && state.in_flight.available_permits() == REQUESTS_IN_FLIGHT_MAX
            && state
                .reading_here
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        if !alone {
            return self.spawn(task);
        }
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _done = Done(&state.reading_here);
        let mut ending = state.ending.subscribe();
        // A panic of the read is the read's alone, as in a task: unwinding drops its
        // reply (fuser answers it with an error), and this thread goes on taking requests.
        let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            freeflow_client::reads_in_place(|| {
                state.runtime.block_on(async move {
                    tokio::select! {
                        () = task => {}
                        // Dropped unanswered (fuser answers it with an error), as the tasks
                        // are when the runtime stops.
                        _ = ending.wait_for(|ending| *ending) => {}
                    }
                })
            })
        }));
        if answered.is_err() {
            tracing::error!("a read answered on a session thread panicked");
        }
    }

    /// The client acting for the process that made `request`.
    fn caller(&self, request: &Caller) -> Client {
        let caller = self
            .state
            .groups
            .caller(request.uid, request.gid, request.pid);
        self.state.client.with_caller(caller)
    }

    /// What the mount asks of the kernel at INIT (fuser answers it on `/dev/fuse`).
    pub(crate) fn init_kernel(&mut self, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(nearest) = config.set_max_write(MAX_WRITE_BYTES) {
            let _ = config.set_max_write(nearest);
        }
        if let Err(nearest) = config.set_max_readahead(MAX_READAHEAD_BYTES) {
            let _ = config.set_max_readahead(nearest);
        }
        let _ = config.set_max_background(MAX_BACKGROUND_REQUESTS);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND_REQUESTS * 3 / 4);
        // Each one alone, so a kernel without one still gets the others.
        for wanted in [
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_PARALLEL_DIROPS,
            InitFlags::FUSE_ATOMIC_O_TRUNC,
            InitFlags::FUSE_ASYNC_DIO,
            InitFlags::FUSE_MAX_PAGES,
            InitFlags::FUSE_BIG_WRITES,
            // We clear setuid/setgid ourselves (write flag below; the meta server on truncate
            // and chown). Without this the kernel asks for security.capability before every
            // write: one metadata round trip per write request.
            InitFlags::FUSE_HANDLE_KILLPRIV_V2,
            // Locks are the cluster's (held at the meta server), not this host's alone.
            InitFlags::FUSE_POSIX_LOCKS,
            InitFlags::FUSE_FLOCK_LOCKS,
        ] {
            if config.add_capabilities(wanted).is_err() {
                tracing::debug!(?wanted, "the kernel lacks a FUSE capability");
            }
        }
        // O_DIRECT opens go past the page cache only where they may still be mapped shared
        // (`open_reply_flags`).
        if self.state.ring_wanted {
            let granted = config
                .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
                .is_ok();
            if !granted && self.state.ring_required {
                return Err(std::io::Error::other(format!(
                    "the kernel does not offer FUSE over io_uring: it needs Linux 6.14 or \
                     later with {} set to 1 (mount without --io-uring otherwise)",
                    crate::limits::ENABLE_PARAMETER
                )));
            }
            self.state.ring_granted.store(granted, Ordering::Relaxed);
        }
        let direct_mmap = config
            .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_ok();
        self.state.direct_mmap.store(direct_mmap, Ordering::Relaxed);
        let data_cache = if self.state.writeback {
            // The kernel gathers writes in its page cache and owns sizes and times of the
            // files it holds; revocations write back and evict them (`cache/`). Not with
            // automatic invalidation: it compares the kernel's own modify time with the
            // meta server's and would write back and drop the pages at every attribute
            // fetch.
            InitFlags::FUSE_WRITEBACK_CACHE
        } else {
            // Pages are dropped when another client's change shows in the attributes.
            InitFlags::FUSE_AUTO_INVAL_DATA
        };
        if config.add_capabilities(data_cache).is_err() {
            if self.state.writeback {
                return Err(std::io::Error::other(
                    "the kernel does not offer FUSE's writeback cache: mount without --writeback",
                ));
            }
            tracing::debug!(wanted = ?data_cache, "the kernel lacks a FUSE capability");
        }
        Ok(())
    }
}
