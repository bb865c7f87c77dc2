//! What the server loop counts, into the registry of the server that runs it (meta or I/O):
//! requests, payload bytes and service time per opcode, what is in flight, connections,
//! refused handshakes, and how often the flow-control credit or the payload budget ran out.
//!
//! Given to [`crate::serve`] through [`crate::ServerOptions::metrics`]; a server without it
//! counts nothing. Every handle is registered once here, so the request path only does
//! relaxed atomic adds (and a binary search over the opcode table).

use std::sync::Arc;
use std::time::Instant;

use freeflow_metrics::{Counter, Gauge, Histogram, Registry, LATENCY_BUCKETS_US};

struct OpMetrics {
    requests: Counter,
    request_bytes: Counter,
    reply_bytes: Counter,
    service_time: Histogram,
}

impl OpMetrics {
    fn new(registry: &Registry, op: &'static str) -> OpMetrics {
        let labels = [("op", op)];
        OpMetrics {
            requests: registry.counter(
                "freeflow_rpc_requests_total",
                "Requests served, by operation.",
                &labels,
            ),
            request_bytes: registry.counter(
                "freeflow_rpc_request_payload_bytes_total",
                "Payload bytes received with requests, by operation.",
                &labels,
            ),
            reply_bytes: registry.counter(
                "freeflow_rpc_reply_payload_bytes_total",
                "Payload bytes sent with replies, by operation.",
                &labels,
            ),
            service_time: registry.histogram(
                "freeflow_rpc_service_time_microseconds",
                "Time from a request fully read to its reply ready, by operation.",
                &labels,
                LATENCY_BUCKETS_US,
            ),
        }
    }
}

struct Inner {
    /// Sorted by opcode.
    operations: Vec<(u16, OpMetrics)>,
    /// Opcodes not in the table (refused by the service, but counted).
    other: OpMetrics,
    requests_in_flight: Gauge,
    request_bytes_in_flight: Gauge,
    connections: Gauge,
    connections_accepted: Counter,
    connections_refused: Counter,
    handshake_failures: Counter,
    credit_waits: Counter,
    budget_waits: Counter,
    window_waits: Counter,
    windows_revoked: Counter,
    window_bytes_granted: Gauge,
    connections_without_window: Gauge,
    shared_payload_bytes: Counter,
}

/// The RPC server's metrics in one registry. Cheap to clone.
#[derive(Clone)]
pub struct ServerMetrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics")
            .field("operations", &self.inner.operations.len())
            .finish_non_exhaustive()
    }
}

impl ServerMetrics {
    /// Registers the metrics in `registry`, one label value per entry of `opcodes` (a
    /// service's `OPCODES` table from `freeflow_proto`).
    pub fn new(registry: &Registry, opcodes: &[(u16, &'static str)]) -> ServerMetrics {
        let mut operations: Vec<(u16, OpMetrics)> = opcodes
            .iter()
            .map(|(opcode, name)| (*opcode, OpMetrics::new(registry, name)))
            .collect();
        operations.sort_by_key(|(opcode, _)| *opcode);
        operations.dedup_by_key(|(opcode, _)| *opcode);
        let inner = Inner {
            operations,
            other: OpMetrics::new(registry, "other"),
            requests_in_flight: registry.gauge(
                "freeflow_rpc_requests_in_flight",
                "Requests being served now, over all connections.",
                &[],
            ),
            request_bytes_in_flight: registry.gauge(
                "freeflow_rpc_request_payload_bytes_in_flight",
                "Request payload bytes held now (the server-wide payload budget in use).",
                &[],
            ),
            connections: registry.gauge(
                "freeflow_rpc_connections",
                "Authenticated connections open now.",
                &[],
            ),
            connections_accepted: registry.counter(
                "freeflow_rpc_connections_accepted_total",
                "Connections that completed the handshake.",
                &[],
            ),
            connections_refused: registry.counter(
                "freeflow_rpc_connections_refused_total",
                "Connections closed at accept or before the handshake because a limit was reached.",
                &[],
            ),
            handshake_failures: registry.counter(
                "freeflow_rpc_handshake_failures_total",
                "Connections closed during the handshake (wrong key, timeout, malformed).",
                &[],
            ),
            credit_waits: registry.counter(
                "freeflow_rpc_credit_waits_total",
                "Times a connection had its requests_in_flight_max requests running and stopped reading (credits exhausted).",
                &[],
            ),
            budget_waits: registry.counter(
                "freeflow_rpc_budget_waits_total",
                "Times a request waited for room in the server-wide payload budget.",
                &[],
            ),
            window_waits: registry.counter(
                "freeflow_rpc_window_waits_total",
                "Times a request (or a read's reply) waited for its connection's window at the server.",
                &[],
            ),
            windows_revoked: registry.counter(
                "freeflow_rpc_windows_revoked_total",
                "Times the credit book took a connection's whole window back to give it to connections that waited.",
                &[],
            ),
            window_bytes_granted: registry.gauge(
                "freeflow_rpc_window_bytes_granted",
                "Payload bytes the connections' windows add up to now (the budget shared out).",
                &[],
            ),
            connections_without_window: registry.gauge(
                "freeflow_rpc_connections_without_window",
                "Connections whose window is 0 now (waiting for credit).",
                &[],
            ),
            shared_payload_bytes: registry.counter(
                "freeflow_rpc_shared_payload_bytes_total",
                "Request payload bytes taken from regions clients on this host shared (not sent through the socket).",
                &[],
            ),
        };
        ServerMetrics {
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

    /// Counts a request whose body has been read; the returned timer ends it when dropped
    /// (also when the request is cancelled with its connection).
    pub(crate) fn request_started(&self, opcode: u16, payload_bytes: u64) -> RequestTimer {
        let operation = self.operation(opcode);
        operation.requests.increment();
        operation.request_bytes.add(payload_bytes);
        self.inner.requests_in_flight.add(1);
        self.inner.request_bytes_in_flight.add(payload_bytes);
        RequestTimer {
            metrics: self.clone(),
            opcode,
            payload_bytes,
            reply_bytes: 0,
            started: Instant::now(),
        }
    }

    pub(crate) fn shared_payload(&self, bytes: u64) {
        self.inner.shared_payload_bytes.add(bytes);
    }

    pub(crate) fn connection_opened(&self) {
        self.inner.connections_accepted.increment();
        self.inner.connections.add(1);
    }

    pub(crate) fn connection_closed(&self) {
        self.inner.connections.subtract(1);
    }

    pub(crate) fn connection_refused(&self) {
        self.inner.connections_refused.increment();
    }

    pub(crate) fn handshake_failed(&self) {
        self.inner.handshake_failures.increment();
    }

    pub(crate) fn credit_wait(&self) {
        self.inner.credit_waits.increment();
    }

    pub(crate) fn budget_wait(&self) {
        self.inner.budget_waits.increment();
    }

    pub(crate) fn window_wait(&self) {
        self.inner.window_waits.increment();
    }

    pub(crate) fn windows_shared(&self, granted: u64, without: u64, revoked: u64) {
        self.inner.window_bytes_granted.set(granted);
        self.inner.connections_without_window.set(without);
        self.inner.windows_revoked.add(revoked);
    }
}

/// One request being served; see [`ServerMetrics::request_started`].
pub(crate) struct RequestTimer {
    metrics: ServerMetrics,
    opcode: u16,
    payload_bytes: u64,
    reply_bytes: u64,
    started: Instant,
}

impl RequestTimer {
    pub(crate) fn replied(&mut self, reply_payload_bytes: u64) {
        self.reply_bytes = reply_payload_bytes;
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        let metrics = &self.metrics;
        let operation = metrics.operation(self.opcode);
        operation.reply_bytes.add(self.reply_bytes);
        operation
            .service_time
            .observe_duration(self.started.elapsed());
        metrics.inner.requests_in_flight.subtract(1);
        metrics
            .inner
            .request_bytes_in_flight
            .subtract(self.payload_bytes);
    }
}
