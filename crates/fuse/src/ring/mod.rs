//! FUSE over io_uring (Linux 6.14+, `fuse.enable_uring`): the kernel hands requests to
//! this mount through io_uring command rings instead of `/dev/fuse` reads, one queue per
//! CPU, each served by a thread pinned to its CPU.
//!
//! Why: on `/dev/fuse` every request is a wake-up of a reading thread, often on the other
//! CPU, and a `writev` back; a 4 KiB `write(2)` through the mount costs two FUSE hops more
//! than the write itself. On a ring the request lands in buffers this mount registered,
//! on the queue of the CPU the caller runs on, and the reply is committed together with
//! the fetch of the next request, in one `io_uring_enter` (docs/BENCHMARKS.md, "FUSE over
//! io_uring").
//!
//! How:
//! - fuser still mounts, negotiates INIT (asking `FUSE_OVER_IO_URING` on top of the
//!   mount's other capabilities, once [`probe`] showed this process can make rings), and
//!   serves `/dev/fuse`: FORGET and INTERRUPT never come over the ring, and notifications
//!   (the lease cache's invalidations) are written there. Once INIT granted the rings the
//!   kernel holds every other request until each possible CPU's queue is registered (or
//!   a registration is refused, when it falls back to `/dev/fuse`), so a mount whose rings
//!   cannot start fails rather than hang.
//! - Each queue starts with [`RING_DEPTH`] entries, each a header buffer
//!   (`abi::RingHeader`) and a payload buffer as large as the largest request
//!   (`MAX_WRITE_BYTES` and a page), registered with `FUSE_IO_URING_CMD_REGISTER`. A
//!   completion of an entry is a request: `dispatch.rs` decodes it and calls the handler,
//!   with a reply that writes the answer into the same entry ([`RingReply`]).
//! - A request keeps its entry until it is answered, and a request of a CPU whose entries
//!   are all held waits in the kernel. Some requests are held for as long as another
//!   process likes (an `F_SETLKW` or `flock` waiting for a lock): with a fixed depth, 32
//!   waiters on one CPU held every entry and the holder's unlock from that CPU waited
//!   behind them for ever. So a queue grows by [`GROW_STEP`] entries whenever fewer than
//!   [`GROW_RESERVE`] are free, up to [`RING_MAX_DEPTH`] (as many requests as the mount
//!   takes in all over `/dev/fuse`, `REQUESTS_IN_FLIGHT_MAX`). Entries are never taken
//!   back (the kernel has no command for it); their pages are touched only when used,
//!   the most recently freed entry first.
//! - The kernel gives a newly registered entry only requests that arrive after it; those
//!   that came while every entry was held stay queued until some entry of that CPU is
//!   committed, which never happens if every held request is a lock waiter. So after each
//!   growth, its nudger thread (pinned to the queue's CPU) makes
//!   requests of its own for a while ([`NUDGE_WINDOW`]): a `statfs` of the mount point
//!   that the queue thread refuses at once (EAGAIN), whose commit hands the entry the
//!   oldest queued request.
//! - A reply given on the queue thread (a write gathered in place, attributes under a
//!   lease, a lone read) is committed with its next wait, in the same system call. A
//!   reply given by a task elsewhere is handed to the queue thread (woken through an
//!   eventfd it polls) when it is small: the kernel hands the entry's next request to the
//!   task that submitted the entry's last command, and through runtime workers parallel
//!   small reads ran 35% slower (and a thread that exits leaves its entries' next
//!   requests stranded). A large one (a read's data, [`DIRECT_COMMIT_MIN`] and more) is
//!   handed to the queue's committer thread, not pinned, so that the kernel's copy of it
//!   into the page cache runs beside the reader, not on the reader's own CPU.
//! - A reply given while the handler still runs on the queue thread (it may hold slices
//!   of the request's payload) is kept aside and copied into the entry once the handler
//!   returned.
//!
//! The queue threads end when the kernel ends the connection (every entry completes with
//! an error) or when the mount stops them ([`Rings::stop`]).

pub(crate) mod abi;
mod dispatch;

use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use fuser::Errno;
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use zerocopy::{FromBytes, IntoBytes};

use crate::limits::{ENABLE_PARAMETER, MAX_WRITE_BYTES, REQUESTS_IN_FLIGHT_MAX};

/// Entries each queue starts with: requests of one CPU in the mount's hands at once (a
/// request keeps its entry until answered; more wait in the kernel).
pub const RING_DEPTH: usize = 64;
/// A queue grows when fewer than this many of its entries are free (see the module doc).
pub const GROW_RESERVE: usize = 16;
/// Entries a queue grows by at a time.
pub const GROW_STEP: usize = 64;
/// The most entries a queue grows to: the mount's bound on requests in its hands over
/// `/dev/fuse` (`REQUESTS_IN_FLIGHT_MAX`), per CPU.
pub const RING_MAX_DEPTH: usize = REQUESTS_IN_FLIGHT_MAX;
// Entries are named by u16 indices (the commands' user data, the replies' places).
const _: () = assert!(RING_DEPTH <= RING_MAX_DEPTH && RING_MAX_DEPTH <= u16::MAX as usize);
/// Payload buffer of an entry: the largest write or read, and a page for the rest.
const PAYLOAD_BYTES: usize = MAX_WRITE_BYTES as usize + 4096;
/// Replies at least this large given off the queue thread are committed by the queue's
/// committer thread (see `RingReply::finish`).
const DIRECT_COMMIT_MIN: usize = 64 << 10;
/// How long a queue's nudger keeps making requests after the queue last grew, and the
/// pause between two of them.
pub const NUDGE_WINDOW: std::time::Duration = std::time::Duration::from_millis(500);
const NUDGE_PAUSE: std::time::Duration = std::time::Duration::from_micros(200);
/// `user_data` of the eventfd poll's completions (entries use their index).
const WAKE: u64 = u64::MAX;

/// Turns on the kernel's offer of FUSE over io_uring if it is off (root only). An error
/// names what is missing.
pub fn enable_in_kernel() -> Result<(), String> {
    match std::fs::read_to_string(ENABLE_PARAMETER) {
        Ok(value) if value.trim() == "Y" || value.trim() == "1" => Ok(()),
        Ok(_) => std::fs::write(ENABLE_PARAMETER, "1").map_err(|error| {
            format!(
                "FUSE over io_uring is off in this kernel and cannot be turned on \
                 ({error}): as root, echo 1 > {ENABLE_PARAMETER}"
            )
        }),
        Err(error) => Err(format!(
            "this kernel has no FUSE over io_uring ({ENABLE_PARAMETER}: {error}); it needs \
             Linux 6.14 or later built with CONFIG_FUSE_IO_URING"
        )),
    }
}

/// An entry's buffers, parts of its chunk's mappings, for the life of its queue.
struct Buffers {
    header: *mut abi::RingHeader,
    payload: *mut u8,
    /// The two iovecs registered with the kernel (their address must stay put).
    iov: Box<[libc::iovec; 2]>,
}

/// What an entry is doing, as far as replies are concerned.
struct EntryState {
    /// The handler still runs on the queue thread and may hold slices of the request.
    dispatching: AtomicBool,
    /// A reply given meanwhile: (error, payload), copied in once the handler returned.
    parked: Mutex<Option<(i32, Vec<u8>)>>,
}

/// A queue: its ring, its entries' buffers, and what replies need from any thread.
pub(crate) struct QueueShared {
    id: u16,
    /// Submissions from any thread, one at a time (`submit_lock`); completions are read by
    /// the queue thread alone.
    /// Closed before the buffers are unmapped (`Drop`).
    ring: ManuallyDrop<IoUring<squeue::Entry128, cqueue::Entry>>,
    submit_lock: Mutex<()>,
    /// The connection's `/dev/fuse` descriptor the ring commands name.
    fuse: OwnedFd,
    /// [`RING_MAX_DEPTH`] places; the first `registered` have buffers.
    buffers: Box<[OnceLock<Buffers>]>,
    states: Box<[EntryState]>,
    /// The mappings the entries' buffers are parts of: (address, bytes).
    chunks: Mutex<Vec<(usize, usize)>>,
    /// Entries registered with the kernel (written by the queue thread only).
    registered: AtomicUsize,
    /// Entries holding a request whose commit is not queued yet.
    in_hand: AtomicUsize,
    /// What the queue's nudger thread shares with it (nothing that owns a descriptor).
    nudge: Arc<Nudge>,
    /// Entries answered and to be committed by the queue thread: (index, commit id).
    ready: Mutex<Vec<(u16, u64)>>,
    /// Entries with large replies, to be committed by the queue's committer thread.
    large: Mutex<Vec<(u16, u64)>>,
    large_ready: std::sync::Condvar,
    /// Every entry has had its last completion (the connection ended): the kernel holds
    /// no command naming the buffers, which may then be unmapped.
    entries_done: AtomicBool,
    /// Written to wake the queue thread for `ready`, or to stop (it polls it through the
    /// ring).
    wake: OwnedFd,
    stopping: AtomicBool,
}

// SAFETY: the raw pointers name mappings owned by this value for its whole life; an entry's
// buffers are written only by the one reply of the request it holds, or by the queue thread
// for a parked reply, never both (`EntryState::dispatching`), and read by the kernel only
// between a commit and the next completion of that entry. The ring's submission queue is
// pushed to under `submit_lock` only, its completion queue read by the queue thread only.
unsafe impl Send for QueueShared {}
unsafe impl Sync for QueueShared {}

impl Drop for QueueShared {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and not used after.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
        if !self.entries_done.load(Ordering::Acquire) {
            // Some entry may still be registered: the kernel tears a closed ring down
            // asynchronously and could still write a request into its buffers. Left
            // mapped (only when a mount ends without its connection ending).
            return;
        }
        let chunks = self.chunks.get_mut().unwrap_or_else(|e| e.into_inner());
        for &(address, bytes) in chunks.iter() {
            // SAFETY: mapped by `map` with this size, and no reply or thread is left (they
            // hold the Arc this is the last of).
            unsafe { libc::munmap(address as *mut libc::c_void, bytes) };
        }
    }
}

fn map(bytes: usize) -> std::io::Result<*mut u8> {
    // SAFETY: an anonymous private mapping; the result is checked.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(address.cast())
}

/// Bytes between two entries' headers in a chunk's header mapping.
const HEADER_STRIDE: usize = size_of::<abi::RingHeader>().next_multiple_of(64);

impl QueueShared {
    fn new(id: u16, fuse: OwnedFd) -> std::io::Result<QueueShared> {
        // Room for a command of every entry the queue may grow to, and the eventfd poll's.
        let ring = IoUring::builder()
            .setup_cqsize(2 * (RING_MAX_DEPTH as u32 + 1))
            .build(RING_MAX_DEPTH as u32 + 1)?;
        let states = (0..RING_MAX_DEPTH)
            .map(|_| EntryState {
                dispatching: AtomicBool::new(false),
                parked: Mutex::new(None),
            })
            .collect();
        // SAFETY: eventfd has no preconditions; the result is checked.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(QueueShared {
            id,
            ring: ManuallyDrop::new(ring),
            submit_lock: Mutex::new(()),
            fuse,
            buffers: (0..RING_MAX_DEPTH).map(|_| OnceLock::new()).collect(),
            states,
            chunks: Mutex::new(Vec::new()),
            registered: AtomicUsize::new(0),
            in_hand: AtomicUsize::new(0),
            nudge: Arc::new(Nudge {
                until: Mutex::new(None),
                wake: std::sync::Condvar::new(),
                stopping: AtomicBool::new(false),
                tid: std::sync::atomic::AtomicU32::new(0),
            }),
            ready: Mutex::new(Vec::with_capacity(RING_DEPTH)),
            large: Mutex::new(Vec::with_capacity(RING_DEPTH)),
            large_ready: std::sync::Condvar::new(),
            entries_done: AtomicBool::new(false),
            // SAFETY: a new descriptor owned by nothing else.
            wake: unsafe { OwnedFd::from_raw_fd(wake) },
            stopping: AtomicBool::new(false),
        })
    }

    /// Maps buffers for `count` more entries (two mappings for all of them) and returns
    /// their indices; the caller registers them. Queue thread only (it alone grows
    /// `registered`).
    fn add_entries(&self, count: usize) -> std::io::Result<std::ops::Range<usize>> {
        let first = self.registered.load(Ordering::Acquire);
        let count = count.min(RING_MAX_DEPTH - first);
        let header_bytes = (count * HEADER_STRIDE).next_multiple_of(4096);
        let payload_bytes = count * PAYLOAD_BYTES;
        let headers = map(header_bytes)?;
        let payloads = match map(payload_bytes) {
            Ok(payloads) => payloads,
            Err(error) => {
                // SAFETY: just mapped with this size, named by nothing else.
                unsafe { libc::munmap(headers.cast(), header_bytes) };
                return Err(error);
            }
        };
        {
            let mut chunks = self.chunks.lock().unwrap_or_else(|e| e.into_inner());
            chunks.push((headers as usize, header_bytes));
            chunks.push((payloads as usize, payload_bytes));
        }
        for offset in 0..count {
            // SAFETY: inside the two mappings just made (`count` strides of each).
            let (header, payload) = unsafe {
                (
                    headers
                        .add(offset * HEADER_STRIDE)
                        .cast::<abi::RingHeader>(),
                    payloads.add(offset * PAYLOAD_BYTES),
                )
            };
            let iov = Box::new([
                libc::iovec {
                    iov_base: header.cast(),
                    iov_len: size_of::<abi::RingHeader>(),
                },
                libc::iovec {
                    iov_base: payload.cast(),
                    iov_len: PAYLOAD_BYTES,
                },
            ]);
            let set = self.buffers[first + offset].set(Buffers {
                header,
                payload,
                iov,
            });
            debug_assert!(set.is_ok(), "an entry's buffers are set once");
        }
        self.registered.store(first + count, Ordering::Release);
        Ok(first..first + count)
    }

    /// The buffers of entry `index` (one the queue registered).
    fn entry(&self, index: usize) -> &Buffers {
        self.buffers[index]
            .get()
            .expect("a registered entry has buffers")
    }

    /// The register commands of entries `indices`.
    fn registrations(&self, indices: std::ops::Range<usize>) -> Vec<squeue::Entry128> {
        indices
            .map(|index| {
                command(
                    self.fuse.as_raw_fd(),
                    self.id,
                    index as u16,
                    abi::CMD_REGISTER,
                    0,
                    self.entry(index).iov.as_ptr(),
                )
            })
            .collect()
    }

    /// Queues `entries` on the ring (one command per entry in flight: there is always room).
    fn push(&self, entries: &[squeue::Entry128]) {
        let _one_at_a_time = self.submit_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: pushes are serialized by `submit_lock`; the buffers the commands name
        // outlive the ring (both are this value's).
        let mut submission = unsafe { self.ring.submission_shared() };
        for entry in entries {
            if unsafe { submission.push(entry) }.is_err() {
                tracing::error!("a FUSE ring's submission queue is full");
            }
        }
    }

    /// Queues the commands that commit entries' replies and fetch their next requests.
    fn push_commits(&self, commits: &[(u16, u64)]) {
        self.in_hand.fetch_sub(commits.len(), Ordering::AcqRel);
        let entries: Vec<squeue::Entry128> = commits
            .iter()
            .map(|&(index, commit_id)| {
                command(
                    self.fuse.as_raw_fd(),
                    self.id,
                    index,
                    abi::CMD_COMMIT_AND_FETCH,
                    commit_id,
                    std::ptr::null(),
                )
            })
            .collect();
        self.push(&entries);
    }

    /// Commits entries' replies and fetches their next requests, from this thread (the
    /// kernel then delivers those entries' next requests through it).
    fn commit(&self, commits: &[(u16, u64)]) {
        self.push_commits(commits);
        if let Err(error) = self.ring.submit() {
            // Left queued: the queue thread's next wait submits it.
            tracing::warn!(%error, "committing FUSE replies failed");
            self.wake();
        }
    }

    /// Opens (or extends) the nudger's window.
    fn nudge(&self) {
        let until = std::time::Instant::now() + NUDGE_WINDOW;
        let mut window = self.nudge.until.lock().unwrap_or_else(|e| e.into_inner());
        let was_open = window.is_some();
        *window = Some(until);
        if !was_open {
            self.nudge.wake.notify_one();
        }
    }

    /// Tells the nudger to end.
    fn stop_nudger(&self) {
        self.nudge.stopping.store(true, Ordering::Release);
        let _window = self.nudge.until.lock().unwrap_or_else(|e| e.into_inner());
        self.nudge.wake.notify_all();
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. A full counter (it never
        // is: the thread reads it) would only mean it is already awake.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                std::ptr::from_ref(&one).cast(),
                size_of::<u64>(),
            );
        }
    }

    /// Writes a reply into entry `index` (its out header and payload).
    ///
    /// # Safety
    /// The caller holds the entry's request: nothing else writes its buffers, and the
    /// handler no longer reads them.
    unsafe fn write_reply(&self, index: usize, unique: u64, error: i32, parts: &[&[u8]]) {
        let buffers = self.entry(index);
        let mut used = 0;
        for part in parts {
            // Never past the buffer: a reply larger than the request allowed is cut (the
            // kernel would refuse it anyway).
            let take = part.len().min(PAYLOAD_BYTES - used);
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), buffers.payload.add(used), take)
            };
            used += take;
        }
        unsafe { self.write_out_header(index, unique, error, used) };
    }

    /// Writes entry `index`'s out header for a reply of `used` payload bytes, which are in
    /// its payload buffer already.
    ///
    /// # Safety
    /// As [`QueueShared::write_reply`].
    unsafe fn write_out_header(&self, index: usize, unique: u64, error: i32, used: usize) {
        let buffers = self.entry(index);
        let used = used.min(PAYLOAD_BYTES);
        let out = abi::OutHeader {
            len: (size_of::<abi::OutHeader>() + used) as u32,
            error,
            unique,
        };
        let header = unsafe { &mut *buffers.header };
        header.in_out[..size_of::<abi::OutHeader>()].copy_from_slice(out.as_bytes());
        header.entry.payload_size = used as u32;
    }
}

/// A queue's nudger: its window and its thread's id.
struct Nudge {
    /// Until when the nudger makes requests (`None`: it sleeps).
    until: Mutex<Option<std::time::Instant>>,
    wake: std::sync::Condvar,
    stopping: AtomicBool,
    /// The nudger thread's id (the `pid` of its requests), 0 until it runs.
    tid: std::sync::atomic::AtomicU32,
}

/// What a reply answers with: parts to copy into the entry's payload, or bytes written
/// there already.
enum Answer<'a> {
    Parts(&'a [&'a [u8]]),
    InPlace(usize),
}

/// What a queue thread hands each request it takes: decodes it and calls its handler.
/// `dispatch.rs` implements it for the mount's handlers (`FreeflowFs`), so the rings name
/// no handler, and the handlers, whose replies write into the rings' entries
/// ([`RingReply`]), stay below them.
pub(crate) trait Dispatch: Send + Sync + 'static {
    /// Serve `request`, with its operation's record `op_in` and its data `payload`,
    /// answering through `reply`.
    fn dispatch(&self, request: &abi::InHeader, op_in: &[u8], payload: &[u8], reply: RingReply);
}

/// The answer to one request that came over a ring: written into the request's entry,
/// then committed by the queue thread (or, large, by its committer thread). Dropped
/// unanswered, it answers EIO.
pub(crate) struct RingReply {
    queue: Arc<QueueShared>,
    index: u16,
    unique: u64,
    commit_id: u64,
    sent: bool,
}

impl RingReply {
    /// Bytes a reply may carry.
    pub fn payload_capacity(&self) -> usize {
        PAYLOAD_BYTES
    }

    pub fn send(mut self, parts: &[&[u8]]) {
        self.finish(0, parts);
    }

    pub fn error(mut self, error: Errno) {
        self.finish(-error.code(), &[]);
    }

    /// The entry's payload buffer, for a reply built where the kernel reads it (a
    /// listing: no buffer of the size the kernel allowed to allocate, no copy), then sent
    /// with [`RingReply::send_in_place`].
    ///
    /// # Safety
    /// Only for a request whose handler was given no slice of the request's payload
    /// (`borrows_payload` is false for its opcode): nothing else reads or writes the
    /// buffer while this reply holds the entry.
    pub unsafe fn payload_mut(&mut self) -> &mut [u8] {
        let buffers = self.queue.entry(usize::from(self.index));
        // SAFETY: the buffer is PAYLOAD_BYTES long and lives as long as the queue, which
        // this reply keeps; the caller vouches that it is this reply's alone.
        unsafe { std::slice::from_raw_parts_mut(buffers.payload, PAYLOAD_BYTES) }
    }

    /// Answers with the first `len` bytes of the payload buffer, written in place
    /// ([`RingReply::payload_mut`]).
    pub fn send_in_place(mut self, len: usize) {
        self.answer(0, Answer::InPlace(len.min(PAYLOAD_BYTES)));
    }

    fn finish(&mut self, error: i32, parts: &[&[u8]]) {
        self.answer(error, Answer::Parts(parts));
    }

    fn answer(&mut self, error: i32, answer: Answer<'_>) {
        self.sent = true;
        let index = usize::from(self.index);
        let state = &self.queue.states[index];
        {
            let mut parked = state.parked.lock().unwrap_or_else(|e| e.into_inner());
            if state.dispatching.load(Ordering::Acquire) {
                // The handler may still read the request: the queue thread writes this
                // in once it returned. (Never an answer written in place: only handlers
                // given no slice of the payload write there, see `payload_mut`.)
                let bytes = match answer {
                    Answer::Parts(parts) => parts.concat(),
                    // SAFETY: as in `payload_mut`; only read here.
                    Answer::InPlace(len) => unsafe {
                        std::slice::from_raw_parts(self.queue.entry(index).payload, len).to_vec()
                    },
                };
                *parked = Some((error, bytes));
                return;
            }
        }
        // SAFETY: this reply holds the entry, and its handler returned; an answer in place
        // is written in the payload already.
        let bytes = match answer {
            Answer::Parts(parts) => {
                unsafe { self.queue.write_reply(index, self.unique, error, parts) };
                parts.iter().map(|part| part.len()).sum()
            }
            Answer::InPlace(len) => {
                unsafe { self.queue.write_out_header(index, self.unique, error, len) };
                len
            }
        };
        self.commit(bytes);
    }

    /// Has the entry, its reply written, committed (see `finish`).
    fn commit(&mut self, bytes: usize) {
        let here = on_queue_thread(&self.queue);
        if !here && bytes >= DIRECT_COMMIT_MIN {
            // Committed by the queue's committer thread (not pinned): the kernel copies a
            // large reply (a read's data into the page cache) on that thread's CPU, beside
            // the caller's, instead of on the queue thread's, which is the caller's own.
            // Not by this thread: the kernel delivers the entry's next request through
            // whoever committed it, so only threads that live as long as the rings may.
            self.queue
                .large
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((self.index, self.commit_id));
            self.queue.large_ready.notify_one();
            return;
        }
        // Committed by the queue thread at its next wait: the entry's next request is then
        // delivered through it (the kernel hands a request to the task that submitted the
        // entry's last command; through a runtime worker, parallel small reads ran 35%
        // slower).
        self.queue
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((self.index, self.commit_id));
        if !here {
            self.queue.wake();
        }
    }
}

impl Drop for RingReply {
    fn drop(&mut self) {
        if !self.sent {
            tracing::warn!(
                unique = self.unique,
                "a request was dropped unanswered: EIO"
            );
            self.finish(-libc::EIO, &[]);
        }
    }
}

thread_local! {
    /// The queue this thread serves, if it is a queue thread.
    static QUEUE_THREAD: std::cell::Cell<*const QueueShared> = const { std::cell::Cell::new(std::ptr::null()) };
}

fn on_queue_thread(queue: &Arc<QueueShared>) -> bool {
    QUEUE_THREAD.with(|current| std::ptr::eq(current.get(), Arc::as_ptr(queue)))
}

/// The mount's rings: one queue thread per CPU, and a committer thread per queue.
pub(crate) struct Rings {
    queues: Vec<Arc<QueueShared>>,
    threads: Vec<JoinHandle<()>>,
}

/// The kernel's possible CPUs (`/sys/devices/system/cpu/possible`, e.g. `0-3` or
/// `0,2-5`): it has a queue for each and waits for all of them to be registered.
pub fn possible_cpus() -> usize {
    let listed = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|text| cpu_count(text.trim()));
    // SAFETY: sysconf has no preconditions.
    listed.unwrap_or_else(|| unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as usize)
}

/// One more than the highest CPU of a kernel CPU list (queues are indexed by CPU number).
fn cpu_count(list: &str) -> Option<usize> {
    let mut highest = None;
    for part in list.split(',') {
        let last = part.rsplit('-').next()?.parse::<usize>().ok()?;
        highest = highest.max(Some(last));
    }
    highest.map(|cpu| cpu + 1)
}

/// Makes sure this process can create io_uring rings of the kind the queues use (the
/// kernel may refuse them: `kernel.io_uring_disabled`, seccomp). Asked before INIT: once
/// INIT granted the rings, the kernel holds every request until they are registered.
pub fn probe() -> std::io::Result<()> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .build(2)
        .map(drop)
}

impl Rings {
    /// Registers [`RING_DEPTH`] entries (to grow on demand) on a queue per possible CPU of the connection
    /// `fuse` (a `/dev/fuse` descriptor whose INIT granted `FUSE_OVER_IO_URING`) and starts
    /// their threads. Returns once every queue's entries are registered, so that requests
    /// go over the rings from then on. An error means the kernel refused a registration
    /// (it then keeps to `/dev/fuse`) or the rings could not be set up (the caller must not
    /// keep the mount: the kernel holds its requests until every queue is registered).
    ///
    /// `mountpoint` is where the connection is mounted: the nudgers' requests name it.
    pub fn start<F: Dispatch>(
        fs: F,
        fuse: &OwnedFd,
        mountpoint: &std::path::Path,
    ) -> std::io::Result<Rings> {
        let cpus = possible_cpus();
        let fs = Arc::new(fs);
        let mountpoint = Arc::new(
            std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(
                mountpoint.as_os_str(),
            ))
            .map_err(std::io::Error::other)?,
        );
        let mut rings = Rings {
            queues: Vec::with_capacity(cpus),
            threads: Vec::with_capacity(3 * cpus),
        };
        for cpu in 0..cpus {
            let queue = Arc::new(QueueShared::new(cpu as u16, fuse.try_clone()?)?);
            let (registered_tx, registered_rx) = std::sync::mpsc::channel();
            let thread = {
                let (queue, fs) = (queue.clone(), fs.clone());
                std::thread::Builder::new()
                    .name(format!("fuse-ring-{cpu}"))
                    .spawn(move || serve_queue(&queue, &*fs, cpu, registered_tx))?
            };
            rings.queues.push(queue.clone());
            rings.threads.push(thread);
            match registered_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    rings.stop();
                    return Err(error);
                }
                Err(_) => {
                    rings.stop();
                    return Err(std::io::Error::other("a FUSE ring thread ended at start"));
                }
            }
            let committer = {
                let queue = queue.clone();
                std::thread::Builder::new()
                    .name(format!("fuse-commit-{cpu}"))
                    .spawn(move || commit_large(&queue))?
            };
            rings.threads.push(committer);
            let (nudge, mountpoint) = (queue.nudge.clone(), mountpoint.clone());
            let nudger = std::thread::Builder::new()
                .name(format!("fuse-nudge-{cpu}"))
                .spawn(move || nudge_queue(&nudge, &mountpoint, cpu))?;
            rings.threads.push(nudger);
        }
        tracing::info!(
            queues = cpus,
            depth = RING_DEPTH,
            max_depth = RING_MAX_DEPTH,
            "FUSE requests over io_uring"
        );
        Ok(rings)
    }

    /// Stops the threads (after the connection ended, or at a failed start) and waits for
    /// them. Not on drop: a mount dropped without unmounting (detached lazily, files still
    /// open) keeps being served until its connection ends.
    pub fn stop(&mut self) {
        for queue in &self.queues {
            queue.stopping.store(true, Ordering::Release);
            queue.wake();
            queue.large_ready.notify_all();
            queue.stop_nudger();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A queue's committer thread: commits the large replies runtime tasks give (see
/// `RingReply::finish`). Not pinned, so the kernel's copy of each reply runs where the
/// scheduler finds room. Ends with the queue thread.
fn commit_large(queue: &Arc<QueueShared>) {
    let mut large = queue.large.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if !large.is_empty() {
            let commits = std::mem::take(&mut *large);
            drop(large);
            queue.commit(&commits);
            large = queue.large.lock().unwrap_or_else(|e| e.into_inner());
            continue;
        }
        if queue.stopping.load(Ordering::Acquire) {
            return;
        }
        large = queue
            .large_ready
            .wait(large)
            .unwrap_or_else(|e| e.into_inner());
    }
}

/// A queue's nudger thread: pinned to the queue's CPU, so that its requests go to that
/// queue, it makes them while the queue's window is open (see the module doc). Ends with
/// the queue thread.
///
/// A thread of this process waiting on a request to this mount could keep the process
/// from ever ending if it died with the request in the mount's hands: the thread would
/// wait for an answer that only the end of the connection gives, and the connection ends
/// only when the process's descriptors are closed, after its last thread. So the nudger
/// first takes a descriptor table of its own and closes everything in it: it keeps
/// neither `/dev/fuse` nor the rings open, and dies with them. Its requests name the
/// mount point by path (a descriptor held open on the mount would make it busy at
/// unmount). Without that table it makes no request.
fn nudge_queue(nudge: &Nudge, mountpoint: &std::ffi::CStr, cpu: usize) {
    // Unpinned (a cpuset without this CPU), its requests would go to another queue.
    if !pin_to_cpu(cpu) {
        tracing::warn!(
            cpu,
            "a FUSE ring queue's nudger cannot run on its CPU: none for this queue"
        );
        return;
    }
    // SAFETY: unshare(CLONE_FILES) gives this thread a copy of the descriptor table;
    // close_range then closes every descriptor in that copy only. No code of this thread
    // uses a descriptor afterwards (it neither logs nor owns any: `Nudge` holds none).
    let alone = unsafe {
        libc::unshare(libc::CLONE_FILES) == 0
            && libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) == 0
    };
    if !alone {
        tracing::warn!(
            cpu,
            error = %std::io::Error::last_os_error(),
            "a FUSE ring queue's nudger cannot have a descriptor table of its own: none for this queue"
        );
        return;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    nudge.tid.store(tid as u32, Ordering::Release);
    let mut window = nudge.until.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if nudge.stopping.load(Ordering::Acquire) {
            return;
        }
        match *window {
            Some(until) if std::time::Instant::now() < until => {
                drop(window);
                // SAFETY: a zeroed statfs is a valid out value and the path a C string.
                // The answer (EAGAIN from the queue thread) is of no interest.
                unsafe {
                    let mut stats: libc::statfs = std::mem::zeroed();
                    libc::statfs(mountpoint.as_ptr(), &mut stats);
                }
                std::thread::sleep(NUDGE_PAUSE);
                window = nudge.until.lock().unwrap_or_else(|e| e.into_inner());
            }
            Some(_) => *window = None,
            None => {
                window = nudge.wake.wait(window).unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

/// A ring command for entry `index`: register its buffers, or commit its reply and
/// fetch the next request.
fn command(
    fuse: RawFd,
    queue: u16,
    index: u16,
    op: u32,
    commit_id: u64,
    iov: *const libc::iovec,
) -> squeue::Entry128 {
    let request = abi::RingCommand {
        flags: 0,
        commit_id,
        queue,
        padding: [0; 6],
    };
    let mut cmd = [0u8; 80];
    cmd[..size_of::<abi::RingCommand>()].copy_from_slice(request.as_bytes());
    let mut builder = opcode::UringCmd80::new(types::Fd(fuse), op).cmd(cmd);
    if op == abi::CMD_REGISTER {
        builder = builder.addr(Some(iov as u64));
    }
    let entry = builder.build().user_data(u64::from(index));
    if op != abi::CMD_REGISTER {
        return entry;
    }
    // The register command names two iovecs (header, payload) in the SQE's `len`, which
    // the crate's builder does not set: the SQE is plain bytes (`repr(C)`), `len` the
    // 32-bit field at offset 24 of `io_uring_sqe`.
    // SAFETY: Entry128 is a repr(C) 128-byte SQE of integers and unions of integers; any
    // bytes are a valid value.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(entry) };
    raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// Pins the calling thread to `cpu`; whether it could.
fn pin_to_cpu(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET is bounds-checked by libc's macro port.
    let pinned = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if !pinned {
        tracing::debug!(cpu, "cannot pin a FUSE ring thread to its CPU");
    }
    pinned
}

/// Errors of an entry's command that mean the connection is gone.
fn connection_gone(result: i32) -> bool {
    [
        libc::ENOTCONN,
        libc::ENODEV,
        libc::ECONNABORTED,
        libc::EBADF,
    ]
    .contains(&-result)
}

fn serve_queue<F: Dispatch>(
    queue: &Arc<QueueShared>,
    fs: &F,
    cpu: usize,
    registered: std::sync::mpsc::Sender<std::io::Result<()>>,
) {
    // Pinned: a request is queued on the ring of the caller's CPU, and served there it
    // needs no wake-up of the other CPU (unpinned, 4 KiB writes ran at a quarter).
    let _ = pin_to_cpu(cpu);
    QUEUE_THREAD.with(|current| current.set(Arc::as_ptr(queue)));
    let poll = || {
        squeue::Entry128::from(
            opcode::PollAdd::new(types::Fd(queue.wake.as_raw_fd()), libc::POLLIN as u32)
                .multi(true)
                .build()
                .user_data(WAKE),
        )
    };
    let mut registrations = match queue.add_entries(RING_DEPTH) {
        Ok(indices) => queue.registrations(indices),
        Err(error) => {
            let _ = registered.send(Err(error));
            return;
        }
    };
    registrations.push(poll());
    queue.push(&registrations);
    if let Err(error) = queue.ring.submit() {
        let _ = registered.send(Err(error));
        return;
    }
    // A refused registration comes back as a completion with an error at once; none by
    // now means they are waiting for requests.
    let mut live = RING_DEPTH;
    // Growth stops at the first refused registration or failed mapping (the queue serves
    // with what it has, as before it grew).
    let mut may_grow = true;
    // Entries that have had a request: an error on one that has not is a refused
    // registration.
    let mut fetched = vec![false; RING_MAX_DEPTH];
    let mut first = true;
    // The queue grew and the nudger's window has not opened for it yet.
    let mut nudge_pending = false;
    let mut served: u64 = 0;
    loop {
        // Commits of replies given on this thread since the last turn.
        let ready = std::mem::take(&mut *queue.ready.lock().unwrap_or_else(|e| e.into_inner()));
        if !ready.is_empty() {
            // Submitted with the wait below.
            queue.push_commits(&ready);
        }
        // After the commits, so that requests answered on this thread are not counted as
        // held.
        // Free: live entries (failed ones are gone) not holding a request.
        let free = live.saturating_sub(queue.in_hand.load(Ordering::Acquire));
        if !first && free < GROW_RESERVE && may_grow {
            let before = live;
            may_grow = grow(queue, &mut live);
            nudge_pending |= live > before;
        }
        // Requests may be queued in the kernel behind held entries, and new entries get
        // only later ones (see the module doc): after a growth the nudger has commits
        // hand them over. The new entries go to the kernel first: a nudge that came before
        // them would queue behind the others (the nudger, woken, may run before this
        // thread's next wait submits them); if they cannot yet, the window opens once they
        // could. Without a growth there is nothing to nudge for (a queue at its most, or
        // that cannot grow, hands a queued request to the next entry that commits).
        if nudge_pending && queue.ring.submit().is_ok() {
            nudge_pending = false;
            queue.nudge();
        }
        if queue.stopping.load(Ordering::Acquire) {
            break;
        }
        let wait = if first {
            // Registration errors arrive at once; do not block on the first turn.
            queue.ring.submit()
        } else {
            queue.ring.submit_and_wait(1)
        };
        match wait {
            Ok(_) => {}
            Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
            Err(error) => {
                tracing::error!(%error, "a FUSE ring failed");
                break;
            }
        }
        // SAFETY: only this thread reads the completion queue.
        let completions: Vec<(u64, i32, u32)> = unsafe { queue.ring.completion_shared() }
            .map(|completion| {
                (
                    completion.user_data(),
                    completion.result(),
                    completion.flags(),
                )
            })
            .collect();
        if first {
            first = false;
            let refused: Vec<i32> = completions
                .iter()
                .filter(|(token, result, _)| *token != WAKE && *result < 0)
                .map(|(_, result, _)| -result)
                .collect();
            if refused.len() == RING_DEPTH {
                // The kernel fell back to /dev/fuse at the first refusal.
                queue.entries_done.store(true, Ordering::Release);
                let _ = registered.send(Err(std::io::Error::from_raw_os_error(refused[0])));
                return;
            }
            if let Some(error) = refused.first() {
                // Some entries are in service (the ring may be ready): serve with those.
                tracing::warn!(
                    refused = refused.len(),
                    error,
                    "the kernel refused some FUSE ring entries"
                );
            }
            let _ = registered.send(Ok(()));
        }
        for (token, result, flags) in completions {
            if token == WAKE {
                if !cqueue::more(flags) {
                    // The poll ended (it may, under memory pressure): armed again.
                    queue.push(&[poll()]);
                }
                let mut count = 0u64;
                // SAFETY: reads 8 bytes into a valid u64 from our nonblocking eventfd.
                unsafe {
                    libc::read(
                        queue.wake.as_raw_fd(),
                        std::ptr::from_mut(&mut count).cast(),
                        size_of::<u64>(),
                    )
                };
                continue;
            }
            let index = token as usize;
            if index >= queue.registered.load(Ordering::Acquire) {
                tracing::error!(token, "a FUSE ring completion names no entry");
                continue;
            }
            if result < 0 {
                if !connection_gone(result) {
                    tracing::warn!(error = -result, "a FUSE ring entry failed");
                    if !fetched[index] {
                        // The kernel refused its registration: it would refuse more.
                        may_grow = false;
                    }
                }
                live -= 1;
                continue;
            }
            fetched[index] = true;
            queue.in_hand.fetch_add(1, Ordering::AcqRel);
            // A handler that panics answers EIO (its reply is dropped) instead of taking the
            // queue, and every request of this CPU, down with it.
            let served_one = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve_entry(queue, fs, index)
            }));
            if served_one.is_err() {
                tracing::error!(queue = queue.id, "a FUSE request handler panicked: EIO");
            }
            served += 1;
        }
        if live == 0 {
            queue.entries_done.store(true, Ordering::Release);
            break;
        }
    }
    // The committer and the nudger end too.
    queue.stopping.store(true, Ordering::Release);
    queue.large_ready.notify_all();
    queue.stop_nudger();
    tracing::info!(
        queue = queue.id,
        requests = served,
        depth = queue.registered.load(Ordering::Acquire),
        "FUSE ring stopped"
    );
}

/// Registers [`GROW_STEP`] more entries on `queue` (their commands go with the queue
/// thread's next wait). Returns whether the queue may grow again.
fn grow(queue: &QueueShared, live: &mut usize) -> bool {
    let registered = queue.registered.load(Ordering::Acquire);
    let in_hand = queue.in_hand.load(Ordering::Acquire);
    if registered >= RING_MAX_DEPTH {
        return false;
    }
    match queue.add_entries(GROW_STEP) {
        Ok(indices) => {
            *live += indices.len();
            queue.push(&queue.registrations(indices));
            let depth = queue.registered.load(Ordering::Acquire);
            tracing::info!(queue = queue.id, depth, in_hand, "a FUSE ring queue grew");
            depth < RING_MAX_DEPTH
        }
        Err(error) => {
            tracing::warn!(queue = queue.id, %error, "a FUSE ring queue cannot grow");
            false
        }
    }
}

/// Opcodes whose handlers are given slices of the request's payload (names, data): a
/// reply given while such a handler runs waits to be written in until it returned.
fn borrows_payload(opcode: u32) -> bool {
    !matches!(
        opcode,
        abi::GETATTR
            | abi::SETATTR
            | abi::READLINK
            | abi::OPEN
            | abi::READ
            | abi::STATFS
            | abi::RELEASE
            | abi::FSYNC
            | abi::LISTXATTR
            | abi::FLUSH
            | abi::OPENDIR
            | abi::READDIR
            | abi::RELEASEDIR
            | abi::FSYNCDIR
            | abi::GETLK
            | abi::SETLK
            | abi::SETLKW
            | abi::ACCESS
            | abi::FALLOCATE
            | abi::READDIRPLUS
            | abi::COPY_FILE_RANGE
    )
}

/// Decodes the request in entry `index` and calls its handler, then writes in a reply
/// given while the handler ran.
fn serve_entry<F: Dispatch>(queue: &Arc<QueueShared>, fs: &F, index: usize) {
    let buffers = queue.entry(index);
    let state = &queue.states[index];
    // What the handler needs of the header is copied out: a reply may overwrite it.
    // SAFETY: the kernel filled the entry and gave it back; nothing else writes it until
    // the request's reply, which this thread has not created yet.
    let (request, op_in, commit_id, payload_size) = unsafe {
        let header = &*buffers.header;
        let Ok((request, _)) = abi::InHeader::read_from_prefix(&header.in_out) else {
            unreachable!("the header area is larger than fuse_in_header");
        };
        (
            request,
            header.op_in,
            header.entry.commit_id,
            (header.entry.payload_size as usize).min(PAYLOAD_BYTES),
        )
    };
    let reply = RingReply {
        queue: queue.clone(),
        index: index as u16,
        unique: request.unique,
        commit_id,
        sent: false,
    };
    let nudger = queue.nudge.tid.load(Ordering::Acquire);
    if request.opcode == abi::STATFS && nudger != 0 && request.pid == nudger {
        // The queue's own nudge: its commit is what it is for.
        return reply.error(Errno::EAGAIN);
    }
    let borrows = borrows_payload(request.opcode);
    let payload: &[u8] = if borrows {
        state.dispatching.store(true, Ordering::Release);
        // SAFETY: as above; a reply given while the handler runs is parked, not written.
        unsafe { std::slice::from_raw_parts(buffers.payload, payload_size) }
    } else {
        &[]
    };
    fs.dispatch(&request, &op_in, payload, reply);
    if !borrows {
        return;
    }
    let parked = {
        let mut parked = state.parked.lock().unwrap_or_else(|e| e.into_inner());
        state.dispatching.store(false, Ordering::Release);
        parked.take()
    };
    if let Some((error, bytes)) = parked {
        // SAFETY: the handler returned, and its reply was given (parked): the entry is
        // this thread's to write.
        unsafe { queue.write_reply(index, request.unique, error, &[&bytes]) };
        queue
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((index as u16, commit_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_give_one_more_than_the_highest_cpu() {
        assert_eq!(cpu_count("0"), Some(1));
        assert_eq!(cpu_count("0-1"), Some(2));
        assert_eq!(cpu_count("0,2-5"), Some(6));
        assert_eq!(cpu_count("0-3,8"), Some(9));
        assert_eq!(cpu_count("x"), None);
    }
}
