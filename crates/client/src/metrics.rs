//! What a client counts (docs/metrics.md lists every name): requests and their latency per
//! operation as this client saw them (queueing, network and server together), data bytes
//! written and read, dirty bytes, and writers throttled by the `dirty_bytes_max` bound.
//!
//! Every client owns a [`Registry`] ([`crate::Client::metrics`]); the mount serves it over
//! HTTP when asked (`freeflow mount --metrics-address`). Counting costs a few relaxed
//! atomic adds per request.

use std::sync::Arc;
use tokio::time::Instant;

use freeflow_metrics::{Counter, Gauge, Histogram, Registry, LATENCY_BUCKETS_US};

struct OpMetrics {
    requests: Counter,
    errors: Counter,
    latency: Histogram,
}

const PAYLOAD_PLACES_HELP: &str =
    "Places of this client's payload area (memory shared with the I/O \
     servers on its host), by state: free, or given up (a request that ended without a reply \
     keeps its place until the connection is gone and its server released the region; with \
     none free, payloads go through the socket).";

/// Handles of the client's metrics. Cheap to clone.
#[derive(Clone)]
pub(crate) struct ClientMetrics {
    inner: Arc<Inner>,
}

struct Inner {
    /// Sorted by opcode.
    operations: Vec<(u16, OpMetrics)>,
    other: OpMetrics,
    written_bytes: Counter,
    read_bytes: Counter,
    local_read_bytes: Counter,
    throttled_writers: Gauge,
    throttle_waits: Counter,
    throttle_wait_time: Counter,
    dirty_bytes: Gauge,
    kept_mutations: Gauge,
    payload_places_free: Gauge,
    payload_places_given_up: Gauge,
    replayed: Counter,
    replay_lost: Counter,
}

impl ClientMetrics {
    pub(crate) fn new(registry: &Registry) -> ClientMetrics {
        let operation = |name: &'static str| {
            let labels = [("op", name)];
            OpMetrics {
                requests: registry.counter(
                    "freeflow_client_requests_total",
                    "Requests this client sent, by operation.",
                    &labels,
                ),
                errors: registry.counter(
                    "freeflow_client_request_errors_total",
                    "Requests that failed (server error, timeout, lost connection), by operation.",
                    &labels,
                ),
                latency: registry.histogram(
                    "freeflow_client_request_latency_microseconds",
                    "Time from sending a request to its reply, as this client saw it, by operation.",
                    &labels,
                    LATENCY_BUCKETS_US,
                ),
            }
        };
        let mut operations: Vec<(u16, OpMetrics)> = freeflow_proto::meta::OPCODES
            .iter()
            .chain(freeflow_proto::io::OPCODES)
            .map(|(opcode, name)| (*opcode, operation(name)))
            .collect();
        operations.sort_by_key(|(opcode, _)| *opcode);
        operations.dedup_by_key(|(opcode, _)| *opcode);
        let inner = Inner {
            operations,
            other: operation("other"),
            written_bytes: registry.counter(
                "freeflow_client_written_bytes_total",
                "Data bytes written to I/O servers and acknowledged.",
                &[],
            ),
            read_bytes: registry.counter(
                "freeflow_client_read_bytes_total",
                "Data bytes read from I/O servers.",
                &[],
            ),
            local_read_bytes: registry.counter(
                "freeflow_client_local_read_bytes_total",
                "Data bytes read from objects of I/O servers on this host through descriptors \
                 they handed out (local reads; also counted in freeflow_client_read_bytes_total).",
                &[],
            ),
            throttled_writers: registry.gauge(
                "freeflow_client_throttled_writers",
                "Writes waiting now for dirty bytes to be acknowledged (dirty_bytes_max reached).",
                &[],
            ),
            throttle_waits: registry.counter(
                "freeflow_client_throttle_waits_total",
                "Writes that had to wait for the dirty_bytes_max bound.",
                &[],
            ),
            throttle_wait_time: registry.counter(
                "freeflow_client_throttle_wait_time_microseconds_total",
                "Total time writes waited for the dirty_bytes_max bound.",
                &[],
            ),
            dirty_bytes: registry.gauge(
                "freeflow_client_dirty_bytes",
                "Write bytes sent but not yet acknowledged by their I/O server.",
                &[],
            ),
            kept_mutations: registry.gauge(
                "freeflow_client_kept_mutations",
                "Metadata mutations answered by the meta server but not durable yet: what this \
                 client would replay if the meta server restarted now.",
                &[],
            ),
            payload_places_free: registry.gauge(
                "freeflow_client_payload_places",
                PAYLOAD_PLACES_HELP,
                &[("state", "free")],
            ),
            payload_places_given_up: registry.gauge(
                "freeflow_client_payload_places",
                PAYLOAD_PLACES_HELP,
                &[("state", "given_up")],
            ),
            replayed: registry.counter(
                "freeflow_client_replayed_mutations_total",
                "Kept mutations replayed to a restarted meta server (applied again, or found \
                 applied).",
                &[],
            ),
            replay_lost: registry.counter(
                "freeflow_client_replay_lost_mutations_total",
                "Kept mutations a restarted meta server refused on replay: changes lost.",
                &[],
            ),
        };
        ClientMetrics {
            inner: Arc::new(inner),
        }
    }

    fn operation(&self, opcode: u16) -> &OpMetrics {
        let operations = &self.inner.operations;
        match operations.binary_search_by_key(&opcode, |(known, _)| *known) {
            Ok(index) => &operations[index].1,
            Err(_) => &self.inner.other,
        }
    }

    /// One request ended after `started`, successfully or not.
    pub(crate) fn request_done(&self, opcode: u16, started: Instant, succeeded: bool) {
        let operation = self.operation(opcode);
        operation.requests.increment();
        operation.latency.observe_duration(started.elapsed());
        if !succeeded {
            operation.errors.increment();
        }
    }

    pub(crate) fn written(&self, bytes: u64) {
        self.inner.written_bytes.add(bytes);
    }

    pub(crate) fn read(&self, bytes: u64) {
        self.inner.read_bytes.add(bytes);
    }

    pub(crate) fn read_locally(&self, bytes: u64) {
        self.inner.read_bytes.add(bytes);
        self.inner.local_read_bytes.add(bytes);
    }

    /// A write waits for dirty permits until the returned guard is dropped (also when the
    /// write is cancelled).
    pub(crate) fn throttled(&self) -> Throttled<'_> {
        self.inner.throttle_waits.increment();
        self.inner.throttled_writers.add(1);
        Throttled {
            metrics: self,
            since: Instant::now(),
        }
    }

    pub(crate) fn set_dirty_bytes(&self, bytes: u64) {
        self.inner.dirty_bytes.set(bytes);
    }

    pub(crate) fn set_kept_mutations(&self, count: u64) {
        self.inner.kept_mutations.set(count);
    }

    pub(crate) fn set_payload_places(&self, free: u64, given_up: u64) {
        self.inner.payload_places_free.set(free);
        self.inner.payload_places_given_up.set(given_up);
    }

    pub(crate) fn replayed(&self, lost: bool) {
        if lost {
            self.inner.replay_lost.increment();
        } else {
            self.inner.replayed.increment();
        }
    }
}

/// A write waiting for the dirty bound; see [`ClientMetrics::throttled`].
pub(crate) struct Throttled<'a> {
    metrics: &'a ClientMetrics,
    since: Instant,
}

impl Drop for Throttled<'_> {
    fn drop(&mut self) {
        let inner = &self.metrics.inner;
        inner.throttled_writers.subtract(1);
        let waited_us = u64::try_from(self.since.elapsed().as_micros()).unwrap_or(u64::MAX);
        inner.throttle_wait_time.add(waited_us);
    }
}
