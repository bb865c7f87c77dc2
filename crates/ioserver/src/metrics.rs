//! What the I/O server counts (docs/metrics.md lists every name): bytes and operations
//! through the disk engine, disk and fsync time, operations in the engine (queue depth),
//! and, copied at each scrape, the engine's own counters (submissions, completions, out of
//! order completions, buffer waits), open descriptors and the object count.
//!
//! The disk side is measured by [`MeteredEngine`], a [`DiskEngine`] that wraps the real one,
//! so the store and the engines stay unaware of metrics. RPC requests per opcode are counted
//! by the RPC layer into the same registry.

use std::fs::File;
use std::sync::{Arc, Weak};
use std::time::Instant;

use bytes::Bytes;
use freeflow_metrics::{Counter, Gauge, Histogram, Registry, LATENCY_BUCKETS_US};

use crate::engine::{DiskEngine, EngineFuture, EngineStats};
use crate::store::ObjectStore;

/// Handles of the disk-side metrics.
#[derive(Clone)]
pub struct DiskMetrics {
    read_bytes: Counter,
    written_bytes: Counter,
    reads: Counter,
    writes: Counter,
    syncs: Counter,
    errors: Counter,
    read_time: Histogram,
    write_time: Histogram,
    fsync_time: Histogram,
    in_flight: Gauge,
}

impl DiskMetrics {
    pub fn new(registry: &Registry) -> DiskMetrics {
        let operations = |op| {
            registry.counter(
                "freeflow_io_disk_operations_total",
                "Reads, writes and syncs of objects, by kind (reads answered from the page cache included).",
                &[("op", op)],
            )
        };
        let time = |op| {
            registry.histogram(
                "freeflow_io_disk_time_microseconds",
                "Time of one read or write request in the disk engine (all its pieces, buffer waits included).",
                &[("op", op)],
                LATENCY_BUCKETS_US,
            )
        };
        DiskMetrics {
            read_bytes: registry.counter(
                "freeflow_io_read_bytes_total",
                "Bytes read from objects.",
                &[],
            ),
            written_bytes: registry.counter(
                "freeflow_io_written_bytes_total",
                "Bytes written to objects.",
                &[],
            ),
            reads: operations("read"),
            writes: operations("write"),
            syncs: operations("sync"),
            errors: registry.counter(
                "freeflow_io_disk_errors_total",
                "Disk engine operations that failed.",
                &[],
            ),
            read_time: time("read"),
            write_time: time("write"),
            fsync_time: registry.histogram(
                "freeflow_io_fsync_time_microseconds",
                "Time of one object fdatasync in the disk engine.",
                &[],
                LATENCY_BUCKETS_US,
            ),
            in_flight: registry.gauge(
                "freeflow_io_disk_operations_in_flight",
                "Operations in the disk engine now (waiting for a buffer, queued or in the kernel): the queue depth.",
                &[],
            ),
        }
    }
}

/// Counts every operation of the engine it wraps.
pub struct MeteredEngine {
    inner: Arc<dyn DiskEngine>,
    metrics: DiskMetrics,
}

impl MeteredEngine {
    pub fn new(inner: Arc<dyn DiskEngine>, metrics: DiskMetrics) -> MeteredEngine {
        MeteredEngine { inner, metrics }
    }
}

/// Keeps an operation in the in-flight gauge until dropped (also when cancelled).
struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    fn new(gauge: &'a Gauge) -> InFlight<'a> {
        gauge.add(1);
        InFlight(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.subtract(1);
    }
}

impl DiskEngine for MeteredEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn write_at(&self, file: Arc<File>, offset: u64, data: Bytes) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let metrics = &self.metrics;
            let _in_flight = InFlight::new(&metrics.in_flight);
            let length_bytes = data.len() as u64;
            let started = Instant::now();
            let result = self.inner.write_at(file, offset, data).await;
            metrics.write_time.observe_duration(started.elapsed());
            metrics.writes.increment();
            match &result {
                Ok(()) => metrics.written_bytes.add(length_bytes),
                Err(_) => metrics.errors.increment(),
            }
            result
        })
    }

    fn read_at(
        &self,
        file: Arc<File>,
        offset: u64,
        length_bytes: usize,
    ) -> EngineFuture<'_, Bytes> {
        Box::pin(async move {
            let metrics = &self.metrics;
            let _in_flight = InFlight::new(&metrics.in_flight);
            let started = Instant::now();
            let result = self.inner.read_at(file, offset, length_bytes).await;
            metrics.read_time.observe_duration(started.elapsed());
            metrics.reads.increment();
            match &result {
                Ok(data) => metrics.read_bytes.add(data.len() as u64),
                Err(_) => metrics.errors.increment(),
            }
            result
        })
    }

    fn sync_data(&self, file: Arc<File>) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let metrics = &self.metrics;
            let _in_flight = InFlight::new(&metrics.in_flight);
            let started = Instant::now();
            let result = self.inner.sync_data(file).await;
            metrics.fsync_time.observe_duration(started.elapsed());
            metrics.syncs.increment();
            if result.is_err() {
                metrics.errors.increment();
            }
            result
        })
    }

    fn note_cached_read(&self, length_bytes: u64) {
        // Bytes and operations, not time: the disk time is the engine's.
        self.metrics.reads.increment();
        self.metrics.read_bytes.add(length_bytes);
    }

    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }
}

/// Registers the metrics read from the store and engine at each scrape: engine counters,
/// open descriptors, objects. Holds the store weakly, so a stopped server is freed.
pub fn register_store_gauges(registry: &Registry, store: &Arc<ObjectStore>, ready_ms: u64) {
    let submissions = registry.counter(
        "freeflow_io_engine_submissions_total",
        "Disk operations handed to the kernel (io_uring entries, resubmissions included) or to a worker thread.",
        &[],
    );
    let completions = registry.counter(
        "freeflow_io_engine_completions_total",
        "Disk operations completed by the engine.",
        &[],
    );
    let out_of_order = registry.counter(
        "freeflow_io_engine_out_of_order_completions_total",
        "Completions that arrived while an operation submitted earlier was still in flight (io_uring).",
        &[],
    );
    let buffer_waits = registry.counter(
        "freeflow_io_buffer_waits_total",
        "Requests that found no free I/O buffer and queued for one.",
        &[],
    );
    let buffer_wait_time = registry.counter(
        "freeflow_io_buffer_wait_time_microseconds_total",
        "Total time requests waited for an I/O buffer.",
        &[],
    );
    let buffer_waiters = registry.gauge(
        "freeflow_io_buffer_waiters",
        "Requests waiting for an I/O buffer now.",
        &[],
    );
    let open_files = registry.gauge(
        "freeflow_io_open_files",
        "Object descriptors held open by the descriptor cache.",
        &[],
    );
    let open_files_max = registry.gauge(
        "freeflow_io_open_files_max",
        "Bound of the descriptor cache (open_files_max).",
        &[],
    );
    let objects = registry.gauge(
        "freeflow_io_objects",
        "Objects stored (exact once the background count at start-up is complete).",
        &[],
    );
    let direct_reads = registry.counter(
        "freeflow_io_direct_operations_total",
        "Requests done with O_DIRECT, past the page cache (direct_io).",
        &[("op", "read")],
    );
    let direct_writes = registry.counter(
        "freeflow_io_direct_operations_total",
        "Requests done with O_DIRECT, past the page cache (direct_io).",
        &[("op", "write")],
    );
    let cached_reads = registry.counter(
        "freeflow_io_cached_reads_total",
        "Reads answered from the page cache in the request's task, without the disk engine.",
        &[],
    );
    registry
        .gauge(
            "freeflow_io_ready_milliseconds",
            "Time the server took from start to serving.",
            &[],
        )
        .set(ready_ms);
    let store: Weak<ObjectStore> = Arc::downgrade(store);
    registry.on_render(move || {
        let Some(store) = store.upgrade() else { return };
        let stats = store.engine().stats();
        submissions.set_from_source(stats.submissions);
        completions.set_from_source(stats.completions);
        out_of_order.set_from_source(stats.out_of_order_completions);
        buffer_waits.set_from_source(stats.buffer_waits);
        buffer_wait_time.set_from_source(stats.buffer_wait_time_us);
        buffer_waiters.set(stats.buffer_waiters);
        open_files.set(store.fd_cache().len() as u64);
        open_files_max.set(store.fd_cache().open_files_max() as u64);
        objects.set(store.object_count().objects);
        let direct = store.direct_counts();
        direct_reads.set_from_source(direct.reads);
        direct_writes.set_from_source(direct.writes);
        cached_reads.set_from_source(store.cached_reads());
    });
}

/// The memory budget (`memory_budget_bytes`, the whole process) and the payload budget it
/// leaves, set once at start.
pub fn register_memory_gauges(registry: &Registry, config: &crate::IoConfig) {
    registry
        .gauge(
            "freeflow_io_memory_budget_bytes",
            "The most memory the server's process holds (memory_budget_bytes): buffer pool, connections, payloads and the process itself.",
            &[],
        )
        .set(config.memory_budget_bytes);
    registry
        .gauge(
            "freeflow_io_payload_budget_bytes",
            "Request and reply payload bytes the server holds at once at most (what memory_budget_bytes leaves, or payload_budget_bytes).",
            &[],
        )
        .set(config.payload_budget());
}

/// Chain replication (see `replication.rs`): what was passed on to the next member of a
/// chain, the map version held, and the resync's progress (`resync.rs`).
pub fn register_replication_gauges(
    registry: &Registry,
    replication: &Arc<crate::replication::Replication>,
) {
    use std::sync::atomic::Ordering;
    let passed = registry.counter(
        "freeflow_io_passed_on_total",
        "Replicated writes, allocations and cuts passed on to the next member of their chain.",
        &[],
    );
    let passed_bytes = registry.counter(
        "freeflow_io_passed_on_bytes_total",
        "Payload bytes passed on to the next member of a chain.",
        &[],
    );
    let failures = registry.counter(
        "freeflow_io_pass_on_failures_total",
        "Requests the next member of a chain did not take (unreachable, refused, timed out).",
        &[],
    );
    let version = registry.gauge(
        "freeflow_io_service_map_version",
        "The service map version this server holds (0: none yet).",
        &[],
    );
    let replication = Arc::downgrade(replication);
    registry.on_render(move || {
        let Some(replication) = replication.upgrade() else {
            return;
        };
        passed.set_from_source(replication.passed_on.load(Ordering::Relaxed));
        passed_bytes.set_from_source(replication.passed_on_bytes.load(Ordering::Relaxed));
        failures.set_from_source(replication.pass_on_failures.load(Ordering::Relaxed));
        version.set(replication.version());
    });
}

/// Which copy [`register_copy_gauges`] reports on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// A server back in its chains copies what changed while it was out (`resync.rs`).
    Resync,
    /// A server taking a lost one's place copies its stripes (`fill.rs`).
    Fill,
}

/// A copy's progress: objects to copy, copied, and bytes copied.
pub fn register_copy_gauges(
    registry: &Registry,
    progress: &Arc<crate::copy::CopyProgress>,
    kind: CopyKind,
) {
    use std::sync::atomic::Ordering;
    let names = match kind {
        CopyKind::Resync => [
            (
                "freeflow_io_resync_running",
                "1 while this server copies what changed while it was out of its chains.",
            ),
            (
                "freeflow_io_resync_objects",
                "Objects the current (or last) resync has to copy.",
            ),
            (
                "freeflow_io_resync_objects_done",
                "Objects the current (or last) resync has copied.",
            ),
            (
                "freeflow_io_resync_bytes_total",
                "Bytes copied from chain partners by resyncs since the start.",
            ),
        ],
        CopyKind::Fill => [
            (
                "freeflow_io_fill_running",
                "1 while this server copies the stripes it takes from lost servers.",
            ),
            (
                "freeflow_io_fill_objects",
                "Objects the current (or last) fill has to copy.",
            ),
            (
                "freeflow_io_fill_objects_done",
                "Objects the current (or last) fill has copied.",
            ),
            (
                "freeflow_io_fill_bytes_total",
                "Bytes copied from survivors by fills since the start (re-replication).",
            ),
        ],
    };
    let running = registry.gauge(names[0].0, names[0].1, &[]);
    let total = registry.gauge(names[1].0, names[1].1, &[]);
    let done = registry.gauge(names[2].0, names[2].1, &[]);
    let bytes = registry.counter(names[3].0, names[3].1, &[]);
    let progress = Arc::downgrade(progress);
    registry.on_render(move || {
        let Some(progress) = progress.upgrade() else {
            return;
        };
        running.set(u64::from(progress.running.load(Ordering::Relaxed)));
        total.set(progress.objects_total.load(Ordering::Relaxed));
        done.set(progress.objects_done.load(Ordering::Relaxed));
        bytes.set_from_source(progress.bytes_copied.load(Ordering::Relaxed));
    });
}
