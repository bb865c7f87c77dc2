//! A fixed pool of equal-sized I/O buffers, allocated once at start-up and (for the
//! io_uring engine) registered with the ring, so the data path never allocates and the
//! server's memory for in-flight disk I/O has a hard bound: `buffer_count × buffer_bytes`.
//!
//! A task takes a buffer with [`BufferPool::acquire`]; when none is free it waits in a FIFO
//! queue of waiters. A buffer goes back when its [`BufferLease`] is dropped, which hands it
//! straight to the oldest live waiter (FLAIM's lesson: the buffer of whichever I/O completes
//! first is reused at once; nobody waits on the oldest I/O).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// The pool. Shared by `Arc`; leases keep it (and so the memory) alive.
pub struct BufferPool {
    /// Start of `buffer_count × buffer_bytes` bytes from the global allocator with
    /// [`BufferPool::allocation`]'s layout; owned by the pool and freed in its `Drop`. A raw
    /// allocation (not a `Box` moved after taking its pointer) keeps every access through
    /// `base` valid under Rust's aliasing rules; page alignment suits O_DIRECT.
    base: *mut u8,
    buffer_bytes: usize,
    buffer_count: usize,
    state: Mutex<PoolState>,
    /// How many acquires had to wait for a buffer (a metric: the pool was the bottleneck).
    waits: AtomicU64,
    /// Microseconds those acquires spent waiting, in total (a metric).
    wait_time_us: AtomicU64,
}

struct PoolState {
    free: Vec<usize>,
    /// Bounded by the number of tasks that can call `acquire`, which the RPC layer bounds
    /// (requests in flight per connection × connections); each entry is one small sender.
    waiters: VecDeque<oneshot::Sender<usize>>,
}

// SAFETY: `base` is an allocation owned by the pool for its whole life. Each buffer index is
// owned by at most one `BufferLease` at a time (enforced by `state`), so no two threads touch
// the same bytes through the pool.
unsafe impl Send for BufferPool {}
unsafe impl Sync for BufferPool {}

impl BufferPool {
    /// Allocates `buffer_count` buffers of `buffer_bytes` each (zeroed, so the kernel only
    /// commits pages once they are used or registered).
    pub fn new(buffer_count: usize, buffer_bytes: usize) -> Arc<BufferPool> {
        assert!(
            buffer_count > 0 && buffer_bytes > 0,
            "validated by the config"
        );
        let total_bytes = buffer_count
            .checked_mul(buffer_bytes)
            .expect("buffer pool size validated by the config");
        let layout = Self::allocation(total_bytes);
        // SAFETY: the layout has a non-zero size (both factors are > 0).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Arc::new(BufferPool {
            base,
            buffer_bytes,
            buffer_count,
            state: Mutex::new(PoolState {
                free: (0..buffer_count).rev().collect(),
                waiters: VecDeque::new(),
            }),
            waits: AtomicU64::new(0),
            wait_time_us: AtomicU64::new(0),
        })
    }

    /// The layout of the pool's memory: page aligned.
    fn allocation(total_bytes: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(total_bytes, 4096)
            .expect("buffer pool size validated by the config")
    }

    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    pub fn buffer_count(&self) -> usize {
        self.buffer_count
    }

    /// How many acquires so far found no free buffer and had to queue.
    pub fn wait_count(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// Microseconds acquires have spent waiting for a buffer, in total.
    pub fn wait_time_us(&self) -> u64 {
        self.wait_time_us.load(Ordering::Relaxed)
    }

    /// Acquires queued for a buffer right now (including any cancelled but not yet skipped).
    pub fn waiter_count(&self) -> usize {
        self.lock().waiters.len()
    }

    /// Buffers free right now (for tests and metrics).
    pub fn free_count(&self) -> usize {
        self.lock().free.len()
    }

    /// One iovec per buffer, for `register_buffers`.
    pub fn iovecs(&self) -> Vec<libc::iovec> {
        (0..self.buffer_count)
            .map(|index| libc::iovec {
                iov_base: self.buffer_pointer(index).cast(),
                iov_len: self.buffer_bytes,
            })
            .collect()
    }

    /// Takes a free buffer, or waits (FIFO) for one to be released.
    pub async fn acquire(self: &Arc<Self>) -> BufferLease {
        let receiver = {
            let mut state = self.lock();
            if let Some(index) = state.free.pop() {
                return BufferLease {
                    pool: Arc::clone(self),
                    index,
                };
            }
            let (sender, receiver) = oneshot::channel();
            state.waiters.push_back(sender);
            receiver
        };
        self.waits.fetch_add(1, Ordering::Relaxed);
        let waiting_since = std::time::Instant::now();
        // Lease must exist before awaiting: if this future is dropped after a release
        // handed us an index, the index would be lost. `GrantGuard` returns it instead.
        let mut guard = GrantGuard {
            pool: self,
            receiver: Some(receiver),
        };
        let index = guard.wait().await;
        let waited_us = u64::try_from(waiting_since.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.wait_time_us.fetch_add(waited_us, Ordering::Relaxed);
        BufferLease {
            pool: Arc::clone(self),
            index,
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the state inconsistent (each update
        // is a single push or pop), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn buffer_pointer(&self, index: usize) -> *mut u8 {
        assert!(index < self.buffer_count);
        // SAFETY: index < buffer_count, so the offset is inside the allocation.
        unsafe { self.base.add(index * self.buffer_bytes) }
    }

    /// Gives `index` to the oldest waiter still waiting, or back to the free list.
    fn release(&self, index: usize) {
        let mut state = self.lock();
        let mut index = index;
        while let Some(waiter) = state.waiters.pop_front() {
            match waiter.send(index) {
                Ok(()) => return,
                // That waiter gave up (its request was cancelled): try the next one.
                Err(returned) => index = returned,
            }
        }
        state.free.push(index);
    }
}

/// Owns a granted index while `acquire` waits, so a cancelled acquire returns it.
struct GrantGuard<'a> {
    pool: &'a BufferPool,
    receiver: Option<oneshot::Receiver<usize>>,
}

impl GrantGuard<'_> {
    async fn wait(&mut self) -> usize {
        let receiver = self.receiver.as_mut().expect("waited once");
        // The sender lives in the pool's waiter queue, which is only drained by `release`
        // (which sends) or dropped with the pool (which this guard keeps alive through the
        // caller's Arc), so the channel cannot close unsent.
        let index = receiver.await.expect("the pool outlives its waiters");
        self.receiver = None;
        index
    }
}

impl Drop for GrantGuard<'_> {
    fn drop(&mut self) {
        if let Some(mut receiver) = self.receiver.take() {
            receiver.close();
            if let Ok(index) = receiver.try_recv() {
                self.pool.release(index);
            }
        }
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        let layout = Self::allocation(self.buffer_count * self.buffer_bytes);
        // SAFETY: `base` came from `alloc_zeroed` with this layout; leases hold an `Arc` of
        // the pool, so none is alive once the pool drops.
        unsafe { std::alloc::dealloc(self.base, layout) };
    }
}

/// Exclusive use of one buffer; returns it to the pool on drop.
pub struct BufferLease {
    pool: Arc<BufferPool>,
    index: usize,
}

impl BufferLease {
    /// The buffer's index in the pool (its registered-buffer index for io_uring).
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pool.buffer_pointer(self.index)
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: this lease is the only owner of buffer `index` (see BufferPool).
        unsafe {
            std::slice::from_raw_parts(self.pool.buffer_pointer(self.index), self.pool.buffer_bytes)
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this borrow unique.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.pool.buffer_pointer(self.index),
                self.pool.buffer_bytes,
            )
        }
    }
}

impl Drop for BufferLease {
    fn drop(&mut self) {
        self.pool.release(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waiters_are_served_in_fifo_order() {
        let pool = BufferPool::new(1, 16);
        let held = pool.acquire().await;
        let (order_sender, mut order_receiver) = tokio::sync::mpsc::channel(4);
        for waiter in 0..3u32 {
            let pool = Arc::clone(&pool);
            let order_sender = order_sender.clone();
            tokio::spawn(async move {
                let lease = pool.acquire().await;
                order_sender.send(waiter).await.unwrap();
                drop(lease);
            });
            // Let each waiter enqueue before the next one starts.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(pool.wait_count(), 3);
        drop(held);
        let mut order = Vec::new();
        for _ in 0..3 {
            order.push(order_receiver.recv().await.unwrap());
        }
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(pool.free_count(), 1);
    }

    #[tokio::test]
    async fn a_cancelled_waiter_does_not_lose_the_buffer() {
        let pool = BufferPool::new(1, 16);
        let held = pool.acquire().await;
        let cancelled = {
            let pool = Arc::clone(&pool);
            tokio::spawn(async move { pool.acquire().await.index() })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancelled.abort();
        let _ = cancelled.await;
        drop(held);
        assert_eq!(pool.free_count(), 1);
        let lease = tokio::time::timeout(Duration::from_secs(1), pool.acquire())
            .await
            .unwrap();
        assert_eq!(lease.index(), 0);
    }

    #[tokio::test]
    async fn leases_are_disjoint() {
        let pool = BufferPool::new(3, 8);
        let mut a = pool.acquire().await;
        let mut b = pool.acquire().await;
        a.as_mut_slice().fill(1);
        b.as_mut_slice().fill(2);
        assert!(a.as_slice().iter().all(|&byte| byte == 1));
        assert!(b.as_slice().iter().all(|&byte| byte == 2));
        assert_ne!(a.index(), b.index());
        assert_eq!(pool.free_count(), 1);
    }
}
