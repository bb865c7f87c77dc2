//! The io_uring engine (DESIGN.md §6.5, FLAIM's lesson): one ring per data directory, driven
//! by one dedicated thread, with a pool of registered buffers.
//!
//! ## How a request reaches the disk
//! 1. The async task takes a buffer from the [`BufferPool`] (queuing FIFO if none is free)
//!    and sends a [`Submission`] on a bounded channel
//!    (`queue_depth_max`) to the ring thread. A request larger than one buffer is done as
//!    consecutive buffer-sized pieces, each holding one buffer, so no task ever holds one
//!    buffer while waiting for another (no deadlock however small the pool).
//! 2. The task then wakes the ring thread through an eventfd. The ring thread keeps a read of
//!    that eventfd posted *in the ring itself*, so its single blocking call,
//!    `submit_and_wait(1)`, returns on whichever comes first: a disk completion or new work.
//!    A flag (`Wake::pending`) makes senders write the eventfd only when no wake-up is already
//!    on its way, so a burst costs one `write(2)`, not one per request.
//! 3. The ring thread moves submissions into the ring while fewer than `ring_entries - 1`
//!    operations are in flight (the last slot is the eventfd read), tagging each with its
//!    slot number as `user_data`. Beyond that bound, work waits in the channel: that is the
//!    back-pressure.
//! 4. Each completion is matched by `user_data` to its slot. A short transfer is resubmitted
//!    for the rest (a read that returns 0 is end of file); `-EINTR`/`-EAGAIN` are retried; any
//!    other negative result becomes `io::Error::from_raw_os_error`. When the operation is done
//!    its buffer goes back to the pool at once (handing it to the oldest waiter) and its task
//!    is answered. Nothing waits on the oldest I/O: completions arriving while an older
//!    operation is still in flight are counted as `out_of_order_completions`.
//!
//! Writes are `Write` straight from the request's payload, which the slot keeps alive until
//! the completion: for buffered I/O the kernel copies the bytes into the page cache anyway,
//! so copying them first into a registered buffer cost a memcpy of every byte written
//! (~0.3 ms per MiB here) for nothing. The write still holds a pool buffer as its credit, so
//! the pool bounds writes in flight and its completion wakes the next waiter. Reads land in
//! a pool buffer (`ReadFixed`); the ring thread hands the buffer back to the task, which
//! passes the buffer itself on as the reply's payload (`Bytes::from_owner`): no copy, and
//! the buffer returns to the pool once the reply is on the socket, so the pool also bounds
//! the memory of replies waiting to be sent. A read longer than one buffer is done in
//! buffer-sized pieces copied into one reply. Syncs are `Fsync` with
//! `DATASYNC`. With `direct_io` the store hands large aligned writes (and, with `all`, reads)
//! a descriptor opened with O_DIRECT (`store.rs`, `DirectIo`): a write's payload is already
//! page aligned, as the RPC layer reads large payloads to a page boundary, and the
//! registered buffers reads land in are page aligned.
//!
//! If `register_buffers` fails (for instance `RLIMIT_MEMLOCK` too small for the pool and no
//! `CAP_IPC_LOCK`), the engine logs a warning and uses plain `Read`/`Write` on the same pool.
//!
//! ## Shutdown
//! Dropping the engine closes the channel and wakes the thread; the thread finishes every
//! operation already in flight (the kernel may still be using those buffers), completes its
//! own eventfd read, and exits; then the ring is closed and the pool freed.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::{Bytes, BytesMut};
use io_uring::{opcode, squeue, types, IoUring};
use tokio::sync::{mpsc, oneshot};

use super::{DiskEngine, EngineFuture, EngineStats};
use crate::buffer_pool::{BufferLease, BufferPool};

/// `user_data` of the ring thread's own eventfd read.
const WAKE_USER_DATA: u64 = u64::MAX;

/// Bounds of the io_uring engine, from the config.
#[derive(Clone, Copy, Debug)]
pub struct UringOptions {
    /// Submission queue size; operations in flight are at most `ring_entries - 1`.
    pub ring_entries: u32,
    pub buffer_count: usize,
    pub buffer_bytes: usize,
    /// Bound of the channel from async tasks to the ring thread.
    pub queue_depth_max: usize,
}

/// What an async task asks the ring thread to do.
struct Submission {
    file: Arc<File>,
    operation: Operation,
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

/// The eventfd that wakes the ring thread, shared with the senders.
struct Wake {
    eventfd: OwnedFd,
    /// True while a wake-up has been written and not yet consumed by the ring thread.
    pending: AtomicBool,
}

impl Wake {
    fn new() -> io::Result<Wake> {
        // Blocking eventfd: io_uring polls it internally; a non-blocking one would make the
        // ring's read complete at once with -EAGAIN.
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Wake {
            eventfd,
            pending: AtomicBool::new(false),
        })
    }

    /// Wakes the ring thread unless a wake-up is already on its way.
    fn wake(&self) {
        if !self.pending.swap(true, Ordering::SeqCst) {
            self.signal();
        }
    }

    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to a descriptor we own. An eventfd write
        // only fails if the counter would overflow, which one write per wake cannot reach.
        unsafe {
            libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }
}

struct Counters {
    completions: AtomicU64,
    out_of_order_completions: AtomicU64,
    submissions: AtomicU64,
}

pub struct UringEngine {
    /// `None` only during drop.
    submissions: Option<mpsc::Sender<Submission>>,
    wake: Arc<Wake>,
    pool: Arc<BufferPool>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
    registered: bool,
}

impl UringEngine {
    /// Sets up the ring and registers the pool; an error here means io_uring is unusable
    /// (the caller falls back to the thread engine).
    pub fn new(options: UringOptions) -> io::Result<UringEngine> {
        let UringOptions {
            ring_entries,
            buffer_count,
            buffer_bytes,
            queue_depth_max,
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
        // thread holds an Arc of the pool and drops the ring first.
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
        let wake = Arc::new(Wake::new()?);
        let counters = Arc::new(Counters {
            completions: AtomicU64::new(0),
            out_of_order_completions: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
        });
        let (submissions, receiver) = mpsc::channel(queue_depth_max);
        let ring_thread = RingThread {
            ring,
            receiver,
            wake: Arc::clone(&wake),
            _pool: Arc::clone(&pool),
            counters: Arc::clone(&counters),
            registered,
            slots: Vec::new(),
            free_slots: Vec::new(),
            in_flight_max: ring_entries as usize - 1,
            sequences_in_flight: BTreeSet::new(),
            next_sequence: 0,
            wake_buffer: Box::new(0),
            wake_posted: false,
            closed: false,
        };
        let thread = std::thread::Builder::new()
            .name("freeflow-io-uring".to_owned())
            .spawn(move || ring_thread.run())?;
        Ok(UringEngine {
            submissions: Some(submissions),
            wake,
            pool,
            counters,
            thread: Some(thread),
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

    async fn submit(&self, submission: Submission) -> io::Result<()> {
        let sender = self.submissions.as_ref().ok_or_else(engine_stopped)?;
        sender
            .send(submission)
            .await
            .map_err(|_| engine_stopped())?;
        self.wake.wake();
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
        self.submit(Submission {
            file: Arc::clone(file),
            operation,
        })
        .await?;
        receiver.await.unwrap_or_else(|_| Err(engine_stopped()))
    }

    /// Reads one piece into `output`; returns the bytes read (fewer at end of file).
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
        self.submit(Submission {
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
            self.submit(Submission {
                file,
                operation: Operation::Sync { reply },
            })
            .await?;
            receiver.await.unwrap_or_else(|_| Err(engine_stopped()))
        })
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            completions: self.counters.completions.load(Ordering::Relaxed),
            out_of_order_completions: self
                .counters
                .out_of_order_completions
                .load(Ordering::Relaxed),
            buffer_waits: self.pool.wait_count(),
            submissions: self.counters.submissions.load(Ordering::Relaxed),
            buffer_wait_time_us: self.pool.wait_time_us(),
            buffer_waiters: self.pool.waiter_count() as u64,
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        drop(self.submissions.take());
        self.wake.signal();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("io_uring thread panicked");
            }
        }
    }
}

/// One operation in the ring.
struct InFlight {
    submission: Submission,
    /// Bytes transferred so far (reads and writes continue after short transfers).
    done_bytes: usize,
    sequence: u64,
}

/// State owned by the ring thread.
struct RingThread {
    ring: IoUring,
    receiver: mpsc::Receiver<Submission>,
    wake: Arc<Wake>,
    /// Keeps the registered memory alive until the ring is gone (fields drop in order:
    /// `ring` first).
    _pool: Arc<BufferPool>,
    counters: Arc<Counters>,
    registered: bool,
    /// In-flight operations by slot (= `user_data`); at most `in_flight_max`.
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    in_flight_max: usize,
    /// Submission order of what is in flight, to spot out-of-order completions.
    sequences_in_flight: BTreeSet<u64>,
    next_sequence: u64,
    /// Target of the eventfd read; boxed so its address is stable while the kernel has it.
    wake_buffer: Box<u64>,
    wake_posted: bool,
    closed: bool,
}

impl RingThread {
    fn run(mut self) {
        let mut completed: Vec<(u64, i32)> = Vec::with_capacity(self.in_flight_max + 1);
        loop {
            if !self.closed && !self.wake_posted {
                self.post_wake_read();
            }
            self.take_submissions();
            let in_flight = self.slots.len() - self.free_slots.len();
            if self.closed && in_flight == 0 {
                if !self.wake_posted {
                    return;
                }
                // Complete our own eventfd read before the ring (and its buffer) go away.
                self.wake.signal();
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(error)
                    if matches!(
                        error.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) => {}
                Err(error) => {
                    tracing::error!(%error, "io_uring submit failed; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            completed.clear();
            completed.extend(
                self.ring
                    .completion()
                    .map(|entry| (entry.user_data(), entry.result())),
            );
            for &(user_data, result) in &completed {
                if user_data == WAKE_USER_DATA {
                    self.wake_posted = false;
                    // Consumed: the next sender must signal again. Cleared before draining
                    // the channel (next loop turn), so no submission is left unseen.
                    self.wake.pending.store(false, Ordering::SeqCst);
                } else {
                    self.complete(user_data as usize, result);
                }
            }
        }
    }

    fn post_wake_read(&mut self) {
        let entry = opcode::Read::new(
            types::Fd(self.wake.eventfd.as_raw_fd()),
            (&mut *self.wake_buffer as *mut u64).cast(),
            8,
        )
        .build()
        .user_data(WAKE_USER_DATA);
        self.push(&entry);
        self.wake_posted = true;
    }

    /// Moves submissions from the channel into the ring while there is room.
    fn take_submissions(&mut self) {
        while !self.closed && self.slots.len() - self.free_slots.len() < self.in_flight_max {
            match self.receiver.try_recv() {
                Ok(submission) => {
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
                    });
                    self.submit_slot(slot);
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => self.closed = true,
            }
        }
    }

    /// Pushes the (remaining part of the) operation in `slot` to the submission queue.
    fn submit_slot(&mut self, slot: usize) {
        let in_flight = self.slots[slot].as_mut().expect("submitting a live slot");
        let fd = types::Fd(in_flight.submission.file.as_raw_fd());
        let done = in_flight.done_bytes;
        let registered = self.registered;
        let entry = match &mut in_flight.submission.operation {
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
                opcode::Write::new(fd, pointer, length)
                    .offset(offset)
                    .build()
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
                if registered {
                    opcode::ReadFixed::new(fd, pointer, length, index)
                        .offset(offset)
                        .build()
                } else {
                    opcode::Read::new(fd, pointer, length)
                        .offset(offset)
                        .build()
                }
            }
            Operation::Sync { .. } => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        self.push(&entry.user_data(slot as u64));
        self.counters.submissions.fetch_add(1, Ordering::Relaxed);
    }

    fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: every buffer an entry points at is owned by its in-flight slot (or is
            // `wake_buffer`), which lives until the entry's completion has been reaped.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            // Cannot happen with at most `ring_entries` entries pushed per turn, but if the
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
            // Short transfer or retryable error: the rest goes back into the ring.
            self.submit_slot(slot);
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
