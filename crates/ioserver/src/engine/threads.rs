//! The thread-pool engine: `worker_threads` threads doing blocking `pread`/`pwrite`/
//! `fdatasync`, fed through one bounded queue. It is the fallback where io_uring is not
//! available (old kernels, seccomp sandboxes) and the baseline the io_uring engine is
//! measured against.
//!
//! Workers read straight into the reply's buffer and write straight from the request's
//! `Bytes`, so this engine needs no buffer pool: its memory bound is the RPC layer's bound
//! on requests in flight. The queue bound (`queue_depth_max`) makes a burst of requests
//! wait in their async tasks instead of growing a list.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::{Bytes, BytesMut};
use tokio::sync::{mpsc, oneshot};

use super::{DiskEngine, EngineFuture, EngineStats};

enum Job {
    Write {
        file: Arc<File>,
        offset: u64,
        data: Bytes,
        reply: oneshot::Sender<io::Result<()>>,
    },
    Read {
        file: Arc<File>,
        offset: u64,
        length_bytes: usize,
        reply: oneshot::Sender<io::Result<Bytes>>,
    },
    Sync {
        file: Arc<File>,
        reply: oneshot::Sender<io::Result<()>>,
    },
}

pub struct ThreadEngine {
    queue: mpsc::Sender<Job>,
    completions: Arc<AtomicU64>,
    submissions: AtomicU64,
    workers: Vec<JoinHandle<()>>,
}

impl ThreadEngine {
    pub fn new(worker_threads: usize, queue_depth_max: usize) -> io::Result<ThreadEngine> {
        assert!(
            worker_threads > 0 && queue_depth_max > 0,
            "validated by the config"
        );
        let (queue, receiver) = mpsc::channel(queue_depth_max);
        let receiver = Arc::new(Mutex::new(receiver));
        let completions = Arc::new(AtomicU64::new(0));
        let mut workers = Vec::with_capacity(worker_threads);
        for worker in 0..worker_threads {
            let receiver = Arc::clone(&receiver);
            let completions = Arc::clone(&completions);
            let handle = std::thread::Builder::new()
                .name(format!("freeflow-io-disk-{worker}"))
                .spawn(move || worker_loop(&receiver, &completions))?;
            workers.push(handle);
        }
        Ok(ThreadEngine {
            queue,
            completions,
            submissions: AtomicU64::new(0),
            workers,
        })
    }

    async fn run<T>(&self, job: Job, reply: oneshot::Receiver<io::Result<T>>) -> io::Result<T> {
        if self.queue.send(job).await.is_err() {
            return Err(engine_stopped());
        }
        self.submissions.fetch_add(1, Ordering::Relaxed);
        reply.await.unwrap_or_else(|_| Err(engine_stopped()))
    }
}

fn engine_stopped() -> io::Error {
    io::Error::other("disk engine stopped")
}

fn worker_loop(receiver: &Mutex<mpsc::Receiver<Job>>, completions: &AtomicU64) {
    loop {
        // One worker at a time waits on the queue; the others wait on the lock, which is
        // released as soon as a job is taken.
        let job = {
            let mut receiver = receiver
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            receiver.blocking_recv()
        };
        let Some(job) = job else { return };
        // Counted before the answer goes: whoever has the answer sees the count.
        match job {
            Job::Write {
                file,
                offset,
                data,
                reply,
            } => {
                let written = file.write_all_at(&data, offset);
                completions.fetch_add(1, Ordering::Relaxed);
                let _ = reply.send(written);
            }
            Job::Read {
                file,
                offset,
                length_bytes,
                reply,
            } => {
                let read = read_up_to(&file, offset, length_bytes);
                completions.fetch_add(1, Ordering::Relaxed);
                let _ = reply.send(read);
            }
            Job::Sync { file, reply } => {
                let synced = file.sync_data();
                completions.fetch_add(1, Ordering::Relaxed);
                let _ = reply.send(synced);
            }
        }
    }
}

/// Reads until `length_bytes` or end of file, retrying short reads and EINTR.
fn read_up_to(file: &File, offset: u64, length_bytes: usize) -> io::Result<Bytes> {
    let mut buffer = BytesMut::zeroed(length_bytes);
    let mut filled = 0;
    while filled < length_bytes {
        match file.read_at(&mut buffer[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(read) => filled += read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    buffer.truncate(filled);
    Ok(buffer.freeze())
}

impl DiskEngine for ThreadEngine {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn write_at(&self, file: Arc<File>, offset: u64, data: Bytes) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let (reply, receiver) = oneshot::channel();
            self.run(
                Job::Write {
                    file,
                    offset,
                    data,
                    reply,
                },
                receiver,
            )
            .await
        })
    }

    fn read_at(
        &self,
        file: Arc<File>,
        offset: u64,
        length_bytes: usize,
    ) -> EngineFuture<'_, Bytes> {
        Box::pin(async move {
            let (reply, receiver) = oneshot::channel();
            self.run(
                Job::Read {
                    file,
                    offset,
                    length_bytes,
                    reply,
                },
                receiver,
            )
            .await
        })
    }

    fn sync_data(&self, file: Arc<File>) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let (reply, receiver) = oneshot::channel();
            self.run(Job::Sync { file, reply }, receiver).await
        })
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            completions: self.completions.load(Ordering::Relaxed),
            out_of_order_completions: 0,
            buffer_waits: 0,
            submissions: self.submissions.load(Ordering::Relaxed),
            buffer_wait_time_us: 0,
            buffer_waiters: 0,
        }
    }
}

impl Drop for ThreadEngine {
    fn drop(&mut self) {
        // Closing the queue ends every worker once the jobs already queued are done.
        let (closed, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut self.queue, closed));
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
