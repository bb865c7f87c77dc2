//! The io_uring engine (DESIGN.md §6.5, FLAIM's lesson): one ring per data directory with a
//! pool of registered buffers, fed by the requests' own tasks and reaped on the tokio
//! runtime, so no thread of ours stands between a request and the disk.
//!
//! ## How a request reaches the disk
//! 1. The async task takes a buffer from the [`BufferPool`] (queuing FIFO if none is free)
//!    and a slot in the ring (a FIFO semaphore of `ring_entries` permits: that bound is the
//!    back-pressure). A request larger than one buffer is done as consecutive buffer-sized
//!    pieces, each holding one buffer, so no task ever holds one buffer while waiting for
//!    another (no deadlock however small the pool).
//! 2. Under the ring's lock it pushes the entry, tagged with its slot number as `user_data`,
//!    and submits it (`io_uring_enter`) itself. A read of cached pages completes inside that
//!    call; the task then reaps the completion before letting go of the lock, and its answer
//!    is ready when it first awaits it. An operation that must wait completes later: a read
//!    of pages not yet cached through the page's callback, run as task work on the
//!    submitting thread; syncs, buffered writes on ext4 (which has no async buffered
//!    writes; XFS does them inline) and transfers marked below on a kernel io-wq worker.
//!    If the kernel refuses the entry for now, the task submits again every
//!    [`SUBMIT_RETRY_MS`] until it is taken (never giving up: a write answered as failed
//!    whose entry ran later could land over newer bytes).
//! 3. The ring signals an eventfd with every completion (`register_eventfd`). A reaper task
//!    on the tokio runtime waits for that eventfd in the runtime's own epoll and reaps every
//!    completion under the lock. A cold read then costs the wake-up of the submitting worker
//!    for the task work (often the one parked in epoll, which the eventfd wakes anyway), not
//!    the four of the engine's former thread of its own (woken to submit, woken by the
//!    completion, waking the task's worker), each tens of microseconds on this machine
//!    (docs/BENCHMARKS.md). Completions inside a submission also signal the eventfd, so
//!    the reaper wakes once for nothing after them (cheap next to the hand-offs saved).
//! 4. Each completion is matched by `user_data` to its slot. A short transfer is resubmitted
//!    for the rest (a read that returns 0 is end of file); `-EINTR`/`-EAGAIN` are retried; any
//!    other negative result becomes `io::Error::from_raw_os_error`. When the operation is done
//!    its buffer goes back to the pool at once (handing it to the oldest waiter) and its task
//!    is answered. Nothing waits on the oldest I/O: completions arriving while an operation
//!    submitted earlier is still in flight are counted as `out_of_order_completions`.
//!
//! The reaper is spawned on the runtime of the first request (and again on a later request's
//! runtime if that runtime has ended); it holds the engine only weakly and is aborted when
//! the engine is dropped. The engine is meant for one runtime with I/O enabled, the
//! server's: requests of a second runtime are served, but their completions are reaped by
//! the first one's reaper while it lives.
//!
//! Writes are `Write` straight from the request's payload, which the slot keeps alive until
//! the completion: for buffered I/O the kernel copies the bytes into the page cache anyway,
//! so copying them first into a registered buffer cost a memcpy of every byte written
//! (~0.3 ms per MiB here) for nothing. The write still holds a pool buffer as its credit, so
//! the pool bounds writes in flight and its completion wakes the next waiter. Reads land in
//! a pool buffer (`ReadFixed`); the task passes the buffer itself on as the reply's payload
//! (`Bytes::from_owner`): no copy, and the buffer returns to the pool once the reply is on
//! the socket, so the pool also bounds the memory of replies waiting to be sent. A read
//! longer than one buffer is done in buffer-sized pieces copied into one reply. Syncs are
//! `Fsync` with `DATASYNC`. With `direct_io` the store hands large aligned writes (and, with
//! `all`, reads) a descriptor opened with O_DIRECT (`store/mod.rs`, `DirectIo`): a write's
//! payload is already page aligned, as the RPC layer reads large payloads to a page
//! boundary, and the registered buffers reads land in are page aligned.
//!
//! If `register_buffers` fails (for instance `RLIMIT_MEMLOCK` too small for the pool and no
//! `CAP_IPC_LOCK`), the engine logs a warning and uses plain `Read`/`Write` on the same pool.
//!
//! ## Shutdown
//! Dropping the engine aborts the reaper. Before the ring is closed, every operation still
//! in the kernel is waited for, since the kernel may still be using its buffers; if any is,
//! that wait happens on a thread of its own (`freeflow-io-uring-drain`), so a drop on a
//! runtime worker is not held up by, say, a long sync.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::{Bytes, BytesMut};
use io_uring::{opcode, squeue, types, IoUring};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::{DiskEngine, EngineFuture, EngineStats};
use crate::buffer_pool::{BufferLease, BufferPool};

/// Largest buffered transfer done inline, on the runtime worker that submits it (or that
/// its completion interrupts); larger ones go to a kernel worker (`IOSQE_ASYNC`). About
/// 40 µs of copying here, the price of the hand-off it saves.
pub const INLINE_TRANSFER_MAX: usize = 128 << 10;

/// Pause before a request whose entry the kernel would not take submits again.
pub const SUBMIT_RETRY_MS: u64 = 1;

/// Momentary refusals of one submission tried again at once (yielding the thread between
/// tries) before the request waits `SUBMIT_RETRY_MS`.
const ENTER_BUSY_TRIES_MAX: u32 = 100;

/// Bounds of the io_uring engine, from the config.
#[derive(Clone, Copy, Debug)]
pub struct UringOptions {
    /// Submission queue size, and the most operations in the ring at once (requests beyond
    /// it wait, first come first served).
    pub ring_entries: u32,
    pub buffer_count: usize,
    pub buffer_bytes: usize,
}

/// One operation on one file.
struct Submission {
    file: Arc<File>,
    operation: Operation,
}

impl Submission {
    /// Whether the file was opened with O_DIRECT (asked of the kernel: the store hands the
    /// engine either descriptor of an object).
    fn direct(&self) -> bool {
        // SAFETY: F_GETFL on a descriptor this submission keeps open.
        let flags = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_GETFL) };
        flags >= 0 && flags & libc::O_DIRECT != 0
    }
}

enum Operation {
    Write {
        /// The write's credit: it bounds writes in flight and wakes the next waiter when
        /// this write completes. Its memory is not used (see `payload`).
        lease: BufferLease,
        /// The bytes to write, straight from the request (no copy into the leased buffer:
        /// a buffered write is copied by the kernel anyway, so a registered buffer would
        /// only add a memcpy of every byte). Kept alive here until the completion.
        payload: Bytes,
        offset: u64,
        length_bytes: usize,
        reply: oneshot::Sender<io::Result<()>>,
    },
    Read {
        lease: BufferLease,
        offset: u64,
        length_bytes: usize,
        reply: oneshot::Sender<(io::Result<usize>, BufferLease)>,
    },
    Sync {
        reply: oneshot::Sender<io::Result<()>>,
    },
}

struct Counters {
    completions: AtomicU64,
    out_of_order_completions: AtomicU64,
    submissions: AtomicU64,
}

/// What the engine, the requests' tasks and the reaper share.
struct Shared {
    /// Dropped first (fields drop in order): it waits for the kernel to finish with every
    /// buffer it was given.
    ring: Mutex<Ring>,
    /// Written by the kernel with every completion (`register_eventfd`); the reaper waits on
    /// a duplicate of it.
    eventfd: OwnedFd,
    /// One permit per operation the ring may hold.
    slots: Arc<Semaphore>,
    counters: Arc<Counters>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        // A panic while holding the ring (a bug) must not leave every later request hanging.
        self.ring
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

pub struct UringEngine {
    /// `None` only during drop.
    shared: Option<Arc<Shared>>,
    pool: Arc<BufferPool>,
    /// The reaper task, on the runtime of the request that started it.
    reaper: Mutex<Option<JoinHandle<()>>>,
    registered: bool,
}

impl UringEngine {
    /// Sets up the ring and registers the pool; an error here means io_uring is unusable
    /// (the caller falls back to the thread engine). Needs no runtime: the reaper starts
    /// with the first request.
    pub fn new(options: UringOptions) -> io::Result<UringEngine> {
        let UringOptions {
            ring_entries,
            buffer_count,
            buffer_bytes,
        } = options;
        assert!(ring_entries >= 2, "validated by the config");
        assert!(
            buffer_count <= usize::from(u16::MAX),
            "validated by the config"
        );
        let ring: IoUring = IoUring::new(ring_entries)?;
        // The kernel may round the size up; use what it gave.
        let ring_entries = ring.params().sq_entries();
        let pool = BufferPool::new(buffer_count, buffer_bytes);
        let iovecs = pool.iovecs();
        // SAFETY: the iovecs describe the pool's memory, which outlives the ring: the ring
        // holds an Arc of the pool and drops the ring first.
        let registered = match unsafe { ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(
                    %error,
                    pool_bytes = buffer_count * buffer_bytes,
                    "io_uring register_buffers failed; using unregistered buffers"
                );
                false
            }
        };
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        let counters = Arc::new(Counters {
            completions: AtomicU64::new(0),
            out_of_order_completions: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
        });
        let in_flight_max = ring_entries as usize;
        let shared = Arc::new(Shared {
            ring: Mutex::new(Ring {
                ring,
                slots: Vec::with_capacity(in_flight_max),
                free_slots: Vec::new(),
                sequences_in_flight: BTreeSet::new(),
                next_sequence: 0,
                completed: Vec::with_capacity(2 * in_flight_max),
                counters: Arc::clone(&counters),
                registered,
                _pool: Arc::clone(&pool),
            }),
            eventfd,
            slots: Arc::new(Semaphore::new(in_flight_max)),
            counters,
        });
        Ok(UringEngine {
            shared: Some(shared),
            pool,
            reaper: Mutex::new(None),
            registered,
        })
    }

    /// True when the pool is registered with the ring (fixed-buffer I/O).
    pub fn buffers_registered(&self) -> bool {
        self.registered
    }

    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    fn shared(&self) -> &Arc<Shared> {
        self.shared.as_ref().expect("taken only in drop")
    }

    /// Starts the reaper on the current runtime unless one is running.
    fn ensure_reaper(&self) -> io::Result<()> {
        let mut reaper = self
            .reaper
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if reaper.as_ref().is_some_and(|task| !task.is_finished()) {
            return Ok(());
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| io::Error::other("the io_uring engine runs on a tokio runtime"))?;
        let eventfd = self.shared().eventfd.try_clone()?;
        // SAFETY: the AsyncFd owns this duplicate, which stays open (and the same file) until
        // the AsyncFd is dropped.
        let waiter = unsafe { AsyncFd::register_with_interest(eventfd, Interest::READABLE) }
            .map_err(|error| error.into_parts().1)?;
        *reaper = Some(runtime.spawn(reap_loop(waiter, Arc::downgrade(self.shared()))));
        Ok(())
    }

    /// Puts one operation into the ring (waiting for a slot first) and submits it; what
    /// completes at once is reaped before returning.
    async fn start(&self, submission: Submission) -> io::Result<()> {
        self.ensure_reaper()?;
        let permit = Arc::clone(&self.shared().slots)
            .acquire_owned()
            .await
            .map_err(|_| engine_stopped())?;
        let mut submitted = {
            let mut ring = self.shared().lock();
            ring.start(submission, permit);
            let submitted = ring.enter();
            ring.reap();
            submitted
        };
        // Only a submission or a completion submits what is queued: a request whose entry
        // the kernel would not take now must try again itself, or it could wait for ever.
        // It does not give up: its entry stays in the queue, and a write answered as failed
        // whose entry ran later could land over a newer write of the same bytes. Logged
        // once a second while it lasts.
        let mut retries: u64 = 0;
        while let Err(error) = submitted {
            if retries.is_multiple_of(1000 / SUBMIT_RETRY_MS) {
                tracing::warn!(%error, retries, "io_uring would not take an operation; trying again");
            }
            retries += 1;
            tokio::time::sleep(std::time::Duration::from_millis(SUBMIT_RETRY_MS)).await;
            let mut ring = self.shared().lock();
            submitted = ring.enter();
            ring.reap();
        }
        Ok(())
    }

    async fn write_piece(&self, file: &Arc<File>, offset: u64, piece: Bytes) -> io::Result<()> {
        let lease = self.pool.acquire().await;
        let (reply, receiver) = oneshot::channel();
        let operation = Operation::Write {
            lease,
            offset,
            length_bytes: piece.len(),
            payload: piece,
            reply,
        };
        self.start(Submission {
            file: Arc::clone(file),
            operation,
        })
        .await?;
        receiver.await.unwrap_or_else(|_| Err(engine_stopped()))
    }

    /// Reads one piece into a pool buffer with `ReadFixed`; returns the bytes read (fewer at
    /// end of file) and the buffer holding them.
    async fn read_into_lease(
        &self,
        file: &Arc<File>,
        offset: u64,
        length_bytes: usize,
    ) -> io::Result<(usize, BufferLease)> {
        let lease = self.pool.acquire().await;
        let (reply, receiver) = oneshot::channel();
        let operation = Operation::Read {
            lease,
            offset,
            length_bytes,
            reply,
        };
        self.start(Submission {
            file: Arc::clone(file),
            operation,
        })
        .await?;
        let (result, lease) = receiver.await.map_err(|_| engine_stopped())?;
        Ok((result?, lease))
    }

    /// Reads one piece and appends it to `output` (the path for reads longer than a buffer).
    async fn read_piece(
        &self,
        file: &Arc<File>,
        offset: u64,
        length_bytes: usize,
        output: &mut BytesMut,
    ) -> io::Result<usize> {
        let (read_bytes, lease) = self.read_into_lease(file, offset, length_bytes).await?;
        output.extend_from_slice(&lease.as_slice()[..read_bytes]);
        Ok(read_bytes)
    }
}

/// Waits for the kernel's completion signals in the runtime's epoll and reaps. Holds the
/// engine weakly: it ends when the engine is gone (and is aborted when it is dropped).
async fn reap_loop(waiter: AsyncFd<OwnedFd>, shared: Weak<Shared>) {
    // Completions may have come before this reaper existed (one on an ended runtime).
    match shared.upgrade() {
        Some(shared) => shared.lock().reap(),
        None => return,
    }
    loop {
        let Ok(mut guard) = waiter.readable().await else {
            tracing::error!(
                "io_uring completion eventfd failed; completions are reaped by new requests only"
            );
            return;
        };
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64. A failure is EAGAIN (nothing signalled
        // since the last read): the reap below is then merely early.
        unsafe {
            libc::read(
                waiter.get_ref().as_raw_fd(),
                (&mut count as *mut u64).cast(),
                8,
            );
        }
        let Some(engine) = shared.upgrade() else {
            return;
        };
        engine.lock().reap();
        drop(engine);
        // Every completion signalled before the reap was reaped; one signalled after it
        // sets the readiness again (the eventfd is edge-triggered in epoll, and tokio keeps
        // readiness newer than this guard's).
        guard.clear_ready();
    }
}

/// The bytes a read left in a pool buffer, handed on as a reply payload without a copy:
/// the buffer goes back to the pool when the last `Bytes` of it is dropped, which is after
/// the reply has been written to the socket.
struct LeasedBytes {
    lease: BufferLease,
    length_bytes: usize,
}

impl AsRef<[u8]> for LeasedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.lease.as_slice()[..self.length_bytes]
    }
}

fn engine_stopped() -> io::Error {
    io::Error::other("disk engine stopped")
}

impl DiskEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn write_at(&self, file: Arc<File>, offset: u64, data: Bytes) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let piece_bytes = self.pool.buffer_bytes();
            let mut written = 0;
            while written < data.len() {
                let end = (written + piece_bytes).min(data.len());
                self.write_piece(&file, offset + written as u64, data.slice(written..end))
                    .await?;
                written = end;
            }
            Ok(())
        })
    }

    fn read_at(
        &self,
        file: Arc<File>,
        offset: u64,
        length_bytes: usize,
    ) -> EngineFuture<'_, Bytes> {
        Box::pin(async move {
            // One buffer holds it: reply straight from the registered buffer, unless buffers
            // are scarce. A reply keeps its buffer until it is on the socket, so a peer that
            // stops reading its replies would hold them: a quarter of the pool is kept for
            // requests that copy and let go at once, so progress never depends on such a peer.
            let plentiful = self.pool.free_count() > self.pool.buffer_count() / 4;
            if length_bytes <= self.pool.buffer_bytes() && plentiful {
                let (read_bytes, lease) = self.read_into_lease(&file, offset, length_bytes).await?;
                return Ok(Bytes::from_owner(LeasedBytes {
                    lease,
                    length_bytes: read_bytes,
                }));
            }
            let mut output = BytesMut::with_capacity(length_bytes);
            while output.len() < length_bytes {
                let piece_bytes = (length_bytes - output.len()).min(self.pool.buffer_bytes());
                let piece_offset = offset + output.len() as u64;
                let read = self
                    .read_piece(&file, piece_offset, piece_bytes, &mut output)
                    .await?;
                if read < piece_bytes {
                    break;
                }
            }
            Ok(output.freeze())
        })
    }

    fn sync_data(&self, file: Arc<File>) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let (reply, receiver) = oneshot::channel();
            self.start(Submission {
                file,
                operation: Operation::Sync { reply },
            })
            .await?;
            receiver.await.unwrap_or_else(|_| Err(engine_stopped()))
        })
    }

    fn stats(&self) -> EngineStats {
        let counters = &self.shared().counters;
        EngineStats {
            completions: counters.completions.load(Ordering::Relaxed),
            out_of_order_completions: counters.out_of_order_completions.load(Ordering::Relaxed),
            buffer_waits: self.pool.wait_count(),
            submissions: counters.submissions.load(Ordering::Relaxed),
            buffer_wait_time_us: self.pool.wait_time_us(),
            buffer_waiters: self.pool.waiter_count() as u64,
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        let reaper = self
            .reaper
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(task) = reaper.take() {
            task.abort();
        }
        // The ring goes with the last `Shared`, once the kernel is done with every operation
        // in it (see `Ring`'s drop). That wait can be long (a sync of much dirty data), and
        // the engine may be dropped on a runtime worker: if anything is in flight, the wait
        // happens on a thread of its own.
        let Some(shared) = self.shared.take() else {
            return;
        };
        if shared.lock().in_flight() == 0 {
            return;
        }
        let waiting = std::thread::Builder::new()
            .name("freeflow-io-uring-drain".to_owned())
            .spawn(move || drop(shared));
        if let Err(error) = waiting {
            // The Arc went back with the failed spawn's closure and is dropped here: the
            // wait then happens on this thread.
            tracing::warn!(%error, "no thread to wait for the io_uring's last operations; waiting here");
        }
    }
}

/// One operation in the ring.
struct InFlight {
    submission: Submission,
    /// Bytes transferred so far (reads and writes continue after short transfers).
    done_bytes: usize,
    sequence: u64,
    /// Its place in the ring, given back when it is done.
    _permit: OwnedSemaphorePermit,
}

/// The ring and what is in it; used under `Shared::ring`'s lock only.
struct Ring {
    ring: IoUring,
    /// In-flight operations by slot (= `user_data`); at most `ring_entries`.
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    /// Submission order of what is in flight, to spot out-of-order completions.
    sequences_in_flight: BTreeSet<u64>,
    next_sequence: u64,
    /// Completions taken from the queue, reused between reaps.
    completed: Vec<(u64, i32)>,
    counters: Arc<Counters>,
    registered: bool,
    /// Keeps the registered memory alive until the ring is gone (fields drop in order:
    /// `ring` first).
    _pool: Arc<BufferPool>,
}

impl Ring {
    fn in_flight(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }

    /// Gives the operation a slot and pushes it to the submission queue.
    fn start(&mut self, submission: Submission, permit: OwnedSemaphorePermit) {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.sequences_in_flight.insert(sequence);
        self.slots[slot] = Some(InFlight {
            submission,
            done_bytes: 0,
            sequence,
            _permit: permit,
        });
        self.push_slot(slot);
    }

    /// Hands what is in the submission queue to the kernel: `Ok` once it took everything.
    /// A momentary refusal (EINTR, EAGAIN, EBUSY, or nothing taken) is tried again a
    /// bounded number of times; after that, or on any other error, the entries stay queued
    /// and the error is returned: the request that queued them tries again later
    /// (`UringEngine::start`), and any submission or reap meanwhile takes them.
    fn enter(&mut self) -> io::Result<()> {
        let mut busy_tries = 0;
        while !self.ring.submission().is_empty() {
            let refusal = match self.ring.submit() {
                Ok(taken) if taken > 0 => continue,
                Ok(_) => io::Error::from_raw_os_error(libc::EAGAIN),
                Err(error) => error,
            };
            let momentary = matches!(
                refusal.raw_os_error(),
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
            );
            if !momentary || busy_tries >= ENTER_BUSY_TRIES_MAX {
                return Err(refusal);
            }
            busy_tries += 1;
            if busy_tries > 1 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Takes every completion from the queue (submitting the rest of short transfers) until
    /// none is left.
    fn reap(&mut self) {
        loop {
            let mut completed = std::mem::take(&mut self.completed);
            completed.clear();
            completed.extend(
                self.ring
                    .completion()
                    .map(|entry| (entry.user_data(), entry.result())),
            );
            let done = completed.is_empty();
            for &(user_data, result) in &completed {
                self.complete(user_data as usize, result);
            }
            self.completed = completed;
            // Resubmitted short transfers, and anything a failed submission left queued.
            // An error leaves them queued for the request that owns them (`start`).
            let _ = self.enter();
            if done {
                return;
            }
        }
    }

    /// Pushes the (remaining part of the) operation in `slot` to the submission queue.
    fn push_slot(&mut self, slot: usize) {
        let in_flight = self.slots[slot].as_mut().expect("submitting a live slot");
        let fd = types::Fd(in_flight.submission.file.as_raw_fd());
        let done = in_flight.done_bytes;
        let registered = self.registered;
        let (entry, remaining_bytes) = match &mut in_flight.submission.operation {
            Operation::Write {
                payload,
                offset,
                length_bytes,
                ..
            } => {
                // SAFETY: `done < length_bytes == payload.len()`, inside the payload, which
                // this slot keeps alive (and unmoved: `Bytes` data is on the heap) until the
                // completion arrives.
                let pointer = unsafe { payload.as_ptr().add(done) };
                let length = (*length_bytes - done) as u32;
                let offset = *offset + done as u64;
                let entry = opcode::Write::new(fd, pointer, length)
                    .offset(offset)
                    .build();
                (entry, length as usize)
            }
            Operation::Read {
                lease,
                offset,
                length_bytes,
                ..
            } => {
                let index = lease.index() as u16;
                // SAFETY: as for writes.
                let pointer = unsafe { lease.as_mut_ptr().add(done) };
                let length = (*length_bytes - done) as u32;
                let offset = *offset + done as u64;
                let entry = if registered {
                    opcode::ReadFixed::new(fd, pointer, length, index)
                        .offset(offset)
                        .build()
                } else {
                    opcode::Read::new(fd, pointer, length)
                        .offset(offset)
                        .build()
                };
                (entry, length as usize)
            }
            Operation::Sync { .. } => {
                let entry = opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build();
                (entry, 0)
            }
        };
        // A large buffered transfer is a long memory copy in the kernel: left inline, it
        // would run on the submitting runtime worker (or, for a read that waited for the
        // disk, on the worker its completion interrupts) and hold up the requests behind
        // it; a kernel worker does it beside the runtime instead, as the engine's own
        // thread once did. Small transfers, and O_DIRECT ones (the device does the copy),
        // stay inline: that is where the saved hand-offs matter.
        let entry = if remaining_bytes > INLINE_TRANSFER_MAX && !in_flight.submission.direct() {
            entry.flags(squeue::Flags::ASYNC)
        } else {
            entry
        };
        self.push(&entry.user_data(slot as u64));
        self.counters.submissions.fetch_add(1, Ordering::Relaxed);
    }

    fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: every buffer an entry points at is owned by its in-flight slot, which
            // lives until the entry's completion has been reaped.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            // Cannot happen with at most `ring_entries` operations in flight, but if the
            // queue is full, hand what is there to the kernel and try again.
            if let Err(error) = self.ring.submit() {
                tracing::error!(%error, "io_uring submit failed while the queue was full");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn complete(&mut self, slot: usize, result: i32) {
        let Some(in_flight) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
            tracing::error!(slot, "io_uring completion for an empty slot");
            return;
        };
        self.counters.completions.fetch_add(1, Ordering::Relaxed);
        let outcome: Option<io::Result<usize>> = if result < 0 {
            match -result {
                libc::EINTR | libc::EAGAIN => None,
                errno => Some(Err(io::Error::from_raw_os_error(errno))),
            }
        } else {
            let transferred = result as usize;
            match &in_flight.submission.operation {
                Operation::Sync { .. } => Some(Ok(0)),
                Operation::Write { length_bytes, .. } => {
                    in_flight.done_bytes += transferred;
                    if transferred == 0 {
                        Some(Err(io::Error::new(
                            io::ErrorKind::WriteZero,
                            "write returned 0",
                        )))
                    } else if in_flight.done_bytes < *length_bytes {
                        None
                    } else {
                        Some(Ok(in_flight.done_bytes))
                    }
                }
                Operation::Read { length_bytes, .. } => {
                    in_flight.done_bytes += transferred;
                    if transferred == 0 || in_flight.done_bytes >= *length_bytes {
                        Some(Ok(in_flight.done_bytes))
                    } else {
                        None
                    }
                }
            }
        };
        let Some(outcome) = outcome else {
            // Short transfer or retryable error: the rest goes back into the ring (submitted
            // by the reap that found this completion).
            self.push_slot(slot);
            return;
        };
        let in_flight = self.slots[slot].take().expect("checked above");
        self.free_slots.push(slot);
        self.sequences_in_flight.remove(&in_flight.sequence);
        if self
            .sequences_in_flight
            .first()
            .is_some_and(|&oldest| oldest < in_flight.sequence)
        {
            self.counters
                .out_of_order_completions
                .fetch_add(1, Ordering::Relaxed);
        }
        match in_flight.submission.operation {
            Operation::Write { lease, reply, .. } => {
                // The buffer goes to the next waiter before the writer hears back.
                drop(lease);
                let _ = reply.send(outcome.map(drop));
            }
            Operation::Read { lease, reply, .. } => {
                let _ = reply.send((outcome, lease));
            }
            Operation::Sync { reply } => {
                let _ = reply.send(outcome.map(drop));
            }
        }
    }
}

impl Drop for Ring {
    /// The kernel may still be reading from or writing into the buffers of operations in
    /// flight: wait for each before the ring, the payloads and the pool go.
    fn drop(&mut self) {
        while self.in_flight() > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => {}
                Err(error) => {
                    // Never free memory the kernel may still write: leak it instead.
                    tracing::error!(%error, in_flight = self.in_flight(), "io_uring wait failed at shutdown; leaking its buffers");
                    std::mem::forget(std::mem::take(&mut self.slots));
                    std::mem::forget(Arc::clone(&self._pool));
                    return;
                }
            }
            self.reap();
        }
    }
}
