//! The registry: metrics registered once (name, help, fixed labels), updated with relaxed
//! atomics, rendered on demand in the Prometheus text format.
//!
//! Handles ([`Counter`], [`Gauge`], [`Histogram`]) are cheap clones of an `Arc`; the
//! registry keeps a clone of each, so a handle keeps counting after its owner forgot the
//! registry and a render sees every update. Values that already live elsewhere (a cache's
//! length, a semaphore's free permits) are copied into gauges by hooks registered with
//! [`Registry::on_render`], run at the start of every render, so nothing on the data path
//! pays for them.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Fixed labels of one metric: `(name, value)` pairs of static strings chosen at
/// registration (opcode names, operation kinds), copied into the registry.
pub type Labels<'a> = &'a [(&'static str, &'static str)];

/// Bucket upper bounds for latencies in microseconds: 1-2-5 steps from 1 µs to 10 s.
pub const LATENCY_BUCKETS_US: &[u64] = &[
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000,
    200_000, 500_000, 1_000_000, 2_000_000, 5_000_000, 10_000_000,
];

/// Bucket upper bounds for counts (batch sizes, queue depths): powers of two to 4096.
pub const COUNT_BUCKETS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];

/// A monotonically increasing count.
#[derive(Clone, Debug)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn increment(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(&self, amount: u64) {
        self.0.fetch_add(amount, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Sets the count from a source that counts by itself (an engine's own counters),
    /// in a render hook. The source must only grow.
    pub fn set_from_source(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

/// A value that goes up and down. Unsigned: every `subtract` pairs with an earlier `add`.
#[derive(Clone, Debug)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    pub fn set(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }

    pub fn add(&self, amount: u64) {
        self.0.fetch_add(amount, Ordering::Relaxed);
    }

    /// Saturates at zero rather than wrapping, so a mismatched pair shows as 0, not 2^64.
    pub fn subtract(&self, amount: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |value| {
                Some(value.saturating_sub(amount))
            });
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct HistogramCore {
    /// Upper bounds, strictly increasing; one more bucket (`+Inf`) follows them.
    bounds: &'static [u64],
    /// Non-cumulative counts per bucket, `bounds.len() + 1` of them.
    buckets: Box<[AtomicU64]>,
    sum: AtomicU64,
    count: AtomicU64,
}

/// Observations counted into fixed buckets, with their sum and count.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<HistogramCore>);

impl Histogram {
    pub fn observe(&self, value: u64) {
        let core = &*self.0;
        let index = core.bounds.partition_point(|bound| *bound < value);
        core.buckets[index].fetch_add(1, Ordering::Relaxed);
        core.sum.fetch_add(value, Ordering::Relaxed);
        core.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observes a duration in microseconds (for histograms with [`LATENCY_BUCKETS_US`]).
    pub fn observe_duration(&self, duration: Duration) {
        self.observe(u64::try_from(duration.as_micros()).unwrap_or(u64::MAX));
    }

    pub fn count(&self) -> u64 {
        self.0.count.load(Ordering::Relaxed)
    }

    pub fn sum(&self) -> u64 {
        self.0.sum.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

#[derive(Debug)]
enum Value {
    Atomic(Arc<AtomicU64>),
    Histogram(Arc<HistogramCore>),
}

#[derive(Debug)]
struct Entry {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    labels: Vec<(&'static str, &'static str)>,
    value: Value,
}

type Hook = Box<dyn Fn() + Send + Sync>;

/// Every metric of one server (or one mount). Registration takes a lock and is meant for
/// start-up; updates through the handles never touch the registry.
#[derive(Default)]
pub struct Registry {
    /// In registration order; bounded by the metrics the code registers (fixed labels).
    entries: Mutex<Vec<Entry>>,
    hooks: Mutex<Vec<Hook>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("metrics", &lock(&self.entries).len())
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is one push: a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|first| first.is_ascii_alphabetic() || first == '_' || first == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Registers a counter. Registering the same name and labels again returns the same
    /// counter; the same name with another kind is a programmer error.
    pub fn counter(&self, name: &'static str, help: &'static str, labels: Labels<'_>) -> Counter {
        match self.register(name, help, Kind::Counter, labels, None) {
            Value::Atomic(value) => Counter(value),
            Value::Histogram(_) => unreachable!("kind checked by register"),
        }
    }

    /// Registers a gauge (see [`Registry::counter`] for repeated registrations).
    pub fn gauge(&self, name: &'static str, help: &'static str, labels: Labels<'_>) -> Gauge {
        match self.register(name, help, Kind::Gauge, labels, None) {
            Value::Atomic(value) => Gauge(value),
            Value::Histogram(_) => unreachable!("kind checked by register"),
        }
    }

    /// Registers a histogram with the given bucket upper bounds (strictly increasing).
    pub fn histogram(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels<'_>,
        bounds: &'static [u64],
    ) -> Histogram {
        assert!(
            !bounds.is_empty() && bounds.windows(2).all(|pair| pair[0] < pair[1]),
            "histogram {name}: bounds must be non-empty and strictly increasing"
        );
        match self.register(name, help, Kind::Histogram, labels, Some(bounds)) {
            Value::Histogram(core) => Histogram(core),
            Value::Atomic(_) => unreachable!("kind checked by register"),
        }
    }

    /// Runs `hook` at the start of every render, to copy values kept elsewhere into gauges.
    /// A hook must not hold a strong reference to whatever owns this registry (use a
    /// `Weak`), or neither is ever freed.
    pub fn on_render(&self, hook: impl Fn() + Send + Sync + 'static) {
        lock(&self.hooks).push(Box::new(hook));
    }

    fn register(
        &self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        labels: Labels<'_>,
        bounds: Option<&'static [u64]>,
    ) -> Value {
        assert!(valid_name(name), "invalid metric name {name:?}");
        for (label, _) in labels {
            assert!(
                valid_name(label) && *label != "le",
                "metric {name}: invalid label name {label:?}"
            );
        }
        let mut entries = lock(&self.entries);
        for entry in entries.iter().filter(|entry| entry.name == name) {
            assert_eq!(entry.kind, kind, "metric {name} registered with two kinds");
            if entry.labels == labels {
                return match &entry.value {
                    Value::Atomic(value) => Value::Atomic(Arc::clone(value)),
                    Value::Histogram(core) => {
                        assert_eq!(Some(core.bounds), bounds, "histogram {name}: two bounds");
                        Value::Histogram(Arc::clone(core))
                    }
                };
            }
        }
        let value = match bounds {
            None => Value::Atomic(Arc::new(AtomicU64::new(0))),
            Some(bounds) => Value::Histogram(Arc::new(HistogramCore {
                bounds,
                buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                sum: AtomicU64::new(0),
                count: AtomicU64::new(0),
            })),
        };
        let handle = match &value {
            Value::Atomic(value) => Value::Atomic(Arc::clone(value)),
            Value::Histogram(core) => Value::Histogram(Arc::clone(core)),
        };
        entries.push(Entry {
            name,
            help,
            kind,
            labels: labels.to_vec(),
            value,
        });
        handle
    }

    /// Every metric in the Prometheus text exposition format: per name one `# HELP` and one
    /// `# TYPE` line, then its samples (histograms as cumulative `_bucket{le=...}`, `_sum`
    /// and `_count`), names in the order they were first registered.
    pub fn render(&self) -> String {
        for hook in lock(&self.hooks).iter() {
            hook();
        }
        let entries = lock(&self.entries);
        let mut names: Vec<&'static str> = Vec::new();
        for entry in entries.iter() {
            if !names.contains(&entry.name) {
                names.push(entry.name);
            }
        }
        let mut out = String::with_capacity(entries.len() * 96);
        for name in names {
            let mut family = entries.iter().filter(|entry| entry.name == name).peekable();
            let Some(first) = family.peek() else { continue };
            let _ = writeln!(out, "# HELP {name} {}", escape_help(first.help));
            let _ = writeln!(out, "# TYPE {name} {}", first.kind.name());
            for entry in family {
                render_entry(&mut out, entry);
            }
        }
        out
    }
}

fn render_entry(out: &mut String, entry: &Entry) {
    match &entry.value {
        Value::Atomic(value) => {
            let labels = label_text(&entry.labels, None);
            let _ = writeln!(
                out,
                "{}{labels} {}",
                entry.name,
                value.load(Ordering::Relaxed)
            );
        }
        Value::Histogram(core) => {
            // Read the buckets once; count is their total, so the lines agree even while
            // observations land during the render.
            let counts: Vec<u64> = core
                .buckets
                .iter()
                .map(|bucket| bucket.load(Ordering::Relaxed))
                .collect();
            let mut cumulative = 0u64;
            for (index, count) in counts.iter().enumerate() {
                cumulative += count;
                let bound = match core.bounds.get(index) {
                    Some(bound) => bound.to_string(),
                    None => "+Inf".to_string(),
                };
                let labels = label_text(&entry.labels, Some(&bound));
                let _ = writeln!(out, "{}_bucket{labels} {cumulative}", entry.name);
            }
            let labels = label_text(&entry.labels, None);
            let sum = core.sum.load(Ordering::Relaxed);
            let _ = writeln!(out, "{}_sum{labels} {sum}", entry.name);
            let _ = writeln!(out, "{}_count{labels} {cumulative}", entry.name);
        }
    }
}

fn label_text(labels: Labels<'_>, le: Option<&str>) -> String {
    if labels.is_empty() && le.is_none() {
        return String::new();
    }
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(name, value)| format!("{name}=\"{}\"", escape_label(value)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    format!("{{{}}}", parts.join(","))
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms_in_the_text_format() {
        let registry = Registry::new();
        let reads = registry.counter(
            "ff_requests_total",
            "Requests served.",
            &[("op", "ReadObject")],
        );
        let writes = registry.counter(
            "ff_requests_total",
            "Requests served.",
            &[("op", "WriteObject")],
        );
        let depth = registry.gauge("ff_queue_depth", "Operations queued.", &[]);
        let latency = registry.histogram("ff_latency_microseconds", "Time.", &[], &[10, 100]);
        reads.add(3);
        writes.increment();
        depth.add(5);
        depth.subtract(2);
        depth.subtract(10);
        for value in [1, 10, 11, 100, 5000] {
            latency.observe(value);
        }
        let expected = "\
# HELP ff_requests_total Requests served.
# TYPE ff_requests_total counter
ff_requests_total{op=\"ReadObject\"} 3
ff_requests_total{op=\"WriteObject\"} 1
# HELP ff_queue_depth Operations queued.
# TYPE ff_queue_depth gauge
ff_queue_depth 0
# HELP ff_latency_microseconds Time.
# TYPE ff_latency_microseconds histogram
ff_latency_microseconds_bucket{le=\"10\"} 2
ff_latency_microseconds_bucket{le=\"100\"} 4
ff_latency_microseconds_bucket{le=\"+Inf\"} 5
ff_latency_microseconds_sum 5122
ff_latency_microseconds_count 5
";
        assert_eq!(registry.render(), expected);
        assert_eq!((latency.count(), latency.sum()), (5, 5122));
    }

    #[test]
    fn registering_again_returns_the_same_metric_and_hooks_run_before_render() {
        let registry = Arc::new(Registry::new());
        let first = registry.counter("ff_a_total", "A.", &[("k", "v")]);
        let second = registry.counter("ff_a_total", "A.", &[("k", "v")]);
        first.add(2);
        second.add(3);
        assert_eq!(first.get(), 5);
        let gauge = registry.gauge("ff_b", "B.", &[]);
        let source = Arc::new(AtomicU64::new(0));
        let hook_source = Arc::clone(&source);
        let hook_gauge = gauge.clone();
        registry.on_render(move || hook_gauge.set(hook_source.load(Ordering::Relaxed)));
        source.store(42, Ordering::Relaxed);
        let text = registry.render();
        assert!(text.contains("\nff_b 42\n"), "{text}");
        assert!(text.contains("ff_a_total{k=\"v\"} 5\n"), "{text}");
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let registry = Registry::new();
        registry
            .gauge("ff_c", "Line\none \\ two.", &[("path", "a\"b\\c\nd")])
            .set(1);
        let text = registry.render();
        assert!(
            text.contains("# HELP ff_c Line\\none \\\\ two.\n"),
            "{text}"
        );
        assert!(
            text.contains("ff_c{path=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    #[should_panic(expected = "two kinds")]
    fn one_name_with_two_kinds_is_refused() {
        let registry = Registry::new();
        registry.counter("ff_d", "D.", &[]);
        registry.gauge("ff_d", "D.", &[]);
    }

    #[test]
    fn durations_are_observed_in_microseconds_and_overflow_goes_to_infinity() {
        let registry = Registry::new();
        let latency = registry.histogram("ff_e", "E.", &[], LATENCY_BUCKETS_US);
        latency.observe_duration(Duration::from_micros(1500));
        latency.observe_duration(Duration::from_secs(60));
        let text = registry.render();
        assert!(text.contains("ff_e_bucket{le=\"1000\"} 0\n"), "{text}");
        assert!(text.contains("ff_e_bucket{le=\"2000\"} 1\n"), "{text}");
        assert!(text.contains("ff_e_bucket{le=\"10000000\"} 1\n"), "{text}");
        assert!(text.contains("ff_e_bucket{le=\"+Inf\"} 2\n"), "{text}");
        assert!(text.contains("ff_e_sum 60001500\n"), "{text}");
    }
}
