//! `freeflow top`: a live panel of where the data flows, like a switch's front panel
//! (DESIGN.md §9): per I/O server MB/s read and written, IOPS, queue depth and latency
//! p50/p99; the meta server's operations per second by type; totals at the bottom.
//!
//! It asks the meta server (`ClusterStatus`) where every server serves its metrics, scrapes
//! each endpoint once per interval, and computes rates from the difference of two scrapes
//! (latency quantiles from the difference of histogram buckets), so it works against a
//! remote cluster from its cluster file. `q` quits (the terminal is put in non-canonical,
//! no-echo mode and restored on every exit path); `--once` takes two scrapes one interval
//! apart and prints one panel; `--json` prints the same as JSON (one object per line).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use freeflow_metrics::text::{HistogramData, Snapshot};
use serde_json::{json, Value};

use crate::cluster_file::{self, ClientFile};
use crate::failure::ConfigError;

/// How often the list of servers is asked again (in intervals), to follow servers that
/// join or move.
const DISCOVERY_INTERVALS: u32 = 10;

/// `top`'s options.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub once: bool,
    pub json: bool,
    pub interval_ms: u64,
}

#[derive(Clone, Debug, PartialEq)]
enum Role {
    Meta,
    Io(u32),
}

#[derive(Clone, Debug, PartialEq)]
struct Endpoint {
    role: Role,
    address: String,
}

pub async fn run(cluster: Option<PathBuf>, options: Options) -> anyhow::Result<()> {
    let interval = Duration::from_millis(options.interval_ms);
    let mut endpoints = discover(cluster.clone()).await?;
    let mut before = scrape_all(&endpoints, interval).await;
    let mut taken = Instant::now();
    if options.once {
        tokio::time::sleep(interval.saturating_sub(taken.elapsed())).await;
        let after = scrape_all(&endpoints, interval).await;
        let panel = compute(&endpoints, &before, &after, taken.elapsed());
        let text = if options.json {
            render_json(&panel)
        } else {
            render_text(&panel)
        };
        println!("{text}");
        return Ok(());
    }
    let interactive = !options.json && is_terminal(libc::STDIN_FILENO);
    let _terminal = if interactive {
        RawTerminal::enter()
    } else {
        None
    };
    let (key_sender, mut keys) = tokio::sync::mpsc::channel::<u8>(16);
    if interactive {
        // A blocking reader of stdin; it ends with the process.
        std::thread::Builder::new()
            .name("top-keys".into())
            .spawn(move || read_keys(key_sender))
            .context("cannot start the key reader")?;
    }
    let mut rounds = 0u32;
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval.saturating_sub(taken.elapsed())) => {}
            key = keys.recv(), if interactive => match key {
                Some(b'q' | b'Q') | None => return Ok(()),
                Some(_) => continue,
            },
            result = tokio::signal::ctrl_c() => {
                result?;
                return Ok(());
            }
        }
        let after = scrape_all(&endpoints, interval).await;
        let panel = compute(&endpoints, &before, &after, taken.elapsed());
        taken = Instant::now();
        if options.json {
            println!("{}", render_json(&panel));
        } else {
            // Home, clear; lines end in \r\n because the terminal is not in canonical mode.
            let text = render_text(&panel).replace('\n', "\r\n");
            print!("\x1b[H\x1b[2J{text}\r\n(q quits)\r\n");
        }
        let _ = std::io::stdout().flush();
        before = after;
        rounds += 1;
        if rounds == DISCOVERY_INTERVALS {
            rounds = 0;
            if let Ok(found) = discover(cluster.clone()).await {
                if found != endpoints {
                    endpoints = found;
                    before = scrape_all(&endpoints, interval).await;
                    taken = Instant::now();
                }
            }
        }
    }
}

/// The metrics endpoints of the cluster's meta server and I/O servers.
async fn discover(cluster: Option<PathBuf>) -> anyhow::Result<Vec<Endpoint>> {
    let path = cluster_file::client_file_path(cluster.clone());
    let report =
        cluster_file::with_client(cluster, async |client| Ok(client.cluster_status().await?))
            .await?;
    // Servers bound to all interfaces report 0.0.0.0: reach them at the meta server's host.
    let file: ClientFile = cluster_file::read(&path)?;
    let meta_host = file
        .meta_address
        .rsplit_once(':')
        .map(|(host, _)| host.to_string())
        .unwrap_or_default();
    let mut endpoints = Vec::new();
    if let Some(address) = report.meta_metrics_address {
        endpoints.push(Endpoint {
            role: Role::Meta,
            address: reachable(&address, &meta_host),
        });
    }
    for server in report.servers {
        if let Some(address) = server.metrics_address {
            endpoints.push(Endpoint {
                role: Role::Io(server.server_id),
                address: reachable(&address, &meta_host),
            });
        }
    }
    if endpoints.is_empty() {
        return Err(ConfigError(format!(
            "no server of the cluster of {} serves metrics: set metrics_address in the [meta] and [io] sections of the server configs (freeflow up sets them)",
            path.display()
        ))
        .into());
    }
    Ok(endpoints)
}

fn reachable(address: &str, fallback_host: &str) -> String {
    match address.rsplit_once(':') {
        Some(("0.0.0.0" | "[::]", port)) if !fallback_host.is_empty() => {
            format!("{fallback_host}:{port}")
        }
        _ => address.to_string(),
    }
}

async fn scrape_all(endpoints: &[Endpoint], timeout: Duration) -> Vec<Option<Snapshot>> {
    let timeout = timeout.max(Duration::from_millis(500));
    let scrapes = endpoints.iter().map(|endpoint| async move {
        freeflow_metrics::scrape(&endpoint.address, timeout)
            .await
            .ok()
            .map(|text| Snapshot::parse(&text))
    });
    futures::future::join_all(scrapes).await
}

/// One I/O server's row.
#[derive(Clone, Debug, Default, PartialEq)]
struct ServerRow {
    name: String,
    address: String,
    reachable: bool,
    read_mb_per_s: f64,
    write_mb_per_s: f64,
    iops: f64,
    queue_depth: f64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    buffer_waits_per_s: f64,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct MetaRow {
    address: String,
    reachable: bool,
    /// Operations per second by type, busiest first; only those that ran.
    operations: Vec<(String, f64)>,
    operations_per_s: f64,
    commits_per_s: f64,
    batch_average: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    inodes: f64,
    sessions: f64,
    /// Cache leases held by clients, revocations sent per second, and the 99th percentile
    /// of how long a mutation waited for them.
    leases: f64,
    revocations_per_s: f64,
    revocation_p99_ms: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct Panel {
    interval_s: f64,
    servers: Vec<ServerRow>,
    meta: Option<MetaRow>,
    total_read_mb_per_s: f64,
    total_write_mb_per_s: f64,
    total_iops: f64,
    total_queue_depth: f64,
}

const DATA_OPERATIONS: [&str; 2] = ["ReadObject", "WriteObject"];

fn rate(
    before: &Snapshot,
    after: &Snapshot,
    name: &str,
    filter: &[(&str, &str)],
    seconds: f64,
) -> f64 {
    let delta = after.sum(name, filter) - before.sum(name, filter);
    // A counter that went down belongs to a restarted server: count from zero.
    let delta = if delta < 0.0 {
        after.sum(name, filter)
    } else {
        delta
    };
    delta / seconds
}

/// The histogram `name` over every label set whose `op` is in `operations`, observed
/// between the two scrapes.
fn histogram_since(
    before: &Snapshot,
    after: &Snapshot,
    name: &str,
    operations: &[&str],
) -> Option<HistogramData> {
    let mut total: Option<HistogramData> = None;
    for operation in operations {
        let filter = [("op", *operation)];
        let Some(later) = after.histogram(name, &filter) else {
            continue;
        };
        let delta = match before.histogram(name, &filter) {
            Some(earlier) => later.since(&earlier),
            None => later,
        };
        total = Some(match total {
            None => delta,
            Some(mut sum) if sum.bounds == delta.bounds => {
                for (count, added) in sum.cumulative.iter_mut().zip(&delta.cumulative) {
                    *count += added;
                }
                sum.sum += delta.sum;
                sum
            }
            Some(sum) => sum,
        });
    }
    total
}

fn quantile_ms(histogram: &Option<HistogramData>, quantile: f64) -> Option<f64> {
    histogram
        .as_ref()
        .and_then(|histogram| histogram.quantile(quantile))
        .map(|microseconds| microseconds / 1000.0)
}

fn compute(
    endpoints: &[Endpoint],
    before: &[Option<Snapshot>],
    after: &[Option<Snapshot>],
    elapsed: Duration,
) -> Panel {
    let seconds = elapsed.as_secs_f64().max(0.001);
    let mut panel = Panel {
        interval_s: seconds,
        ..Panel::default()
    };
    let empty = Snapshot::default();
    for (index, endpoint) in endpoints.iter().enumerate() {
        let earlier = before.get(index).and_then(Option::as_ref);
        let later = after.get(index).and_then(Option::as_ref);
        let reachable = later.is_some();
        let (earlier, later) = (earlier.unwrap_or(&empty), later.unwrap_or(&empty));
        match endpoint.role {
            Role::Io(server_id) => {
                let service = histogram_since(
                    earlier,
                    later,
                    "freeflow_rpc_service_time_microseconds",
                    &DATA_OPERATIONS,
                );
                let row = ServerRow {
                    name: format!("io {server_id}"),
                    address: endpoint.address.clone(),
                    reachable,
                    read_mb_per_s: rate(
                        earlier,
                        later,
                        "freeflow_io_read_bytes_total",
                        &[],
                        seconds,
                    ) / 1e6,
                    write_mb_per_s: rate(
                        earlier,
                        later,
                        "freeflow_io_written_bytes_total",
                        &[],
                        seconds,
                    ) / 1e6,
                    iops: rate(
                        earlier,
                        later,
                        "freeflow_io_disk_operations_total",
                        &[],
                        seconds,
                    ),
                    queue_depth: later.sum("freeflow_rpc_requests_in_flight", &[]),
                    p50_ms: quantile_ms(&service, 0.5),
                    p99_ms: quantile_ms(&service, 0.99),
                    buffer_waits_per_s: rate(
                        earlier,
                        later,
                        "freeflow_io_buffer_waits_total",
                        &[],
                        seconds,
                    ),
                };
                panel.total_read_mb_per_s += row.read_mb_per_s;
                panel.total_write_mb_per_s += row.write_mb_per_s;
                panel.total_iops += row.iops;
                panel.total_queue_depth += row.queue_depth;
                panel.servers.push(row);
            }
            Role::Meta => {
                let names = later.label_values("freeflow_rpc_requests_total", "op");
                let mut operations: Vec<(String, f64)> = names
                    .into_iter()
                    .map(|name| {
                        let per_s = rate(
                            earlier,
                            later,
                            "freeflow_rpc_requests_total",
                            &[("op", &name)],
                            seconds,
                        );
                        (name, per_s)
                    })
                    .filter(|(_, per_s)| *per_s > 0.0)
                    .collect();
                operations.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                let all: Vec<&str> = operations.iter().map(|(name, _)| name.as_str()).collect();
                let service = histogram_since(
                    earlier,
                    later,
                    "freeflow_rpc_service_time_microseconds",
                    &all,
                );
                let batches = later
                    .histogram("freeflow_meta_commit_batch_operations", &[])
                    .map(|later_batches| {
                        match earlier.histogram("freeflow_meta_commit_batch_operations", &[]) {
                            Some(earlier_batches) => later_batches.since(&earlier_batches),
                            None => later_batches,
                        }
                    });
                let batch_average = batches
                    .filter(|batches| batches.count() > 0.0)
                    .map(|batches| batches.sum / batches.count());
                panel.meta = Some(MetaRow {
                    address: endpoint.address.clone(),
                    reachable,
                    operations_per_s: operations.iter().map(|(_, per_s)| per_s).sum(),
                    operations,
                    commits_per_s: rate(
                        earlier,
                        later,
                        "freeflow_meta_commits_total",
                        &[],
                        seconds,
                    ),
                    batch_average,
                    p50_ms: quantile_ms(&service, 0.5),
                    p99_ms: quantile_ms(&service, 0.99),
                    inodes: later.sum("freeflow_meta_inodes", &[]),
                    sessions: later.sum("freeflow_meta_sessions", &[]),
                    leases: later.sum("freeflow_meta_leases_held", &[]),
                    revocations_per_s: rate(
                        earlier,
                        later,
                        "freeflow_meta_revocations_total",
                        &[],
                        seconds,
                    ),
                    revocation_p99_ms: {
                        let name = "freeflow_meta_revocation_wait_microseconds";
                        let waits = later.histogram(name, &[]).map(|later_waits| {
                            match earlier.histogram(name, &[]) {
                                Some(earlier_waits) => later_waits.since(&earlier_waits),
                                None => later_waits,
                            }
                        });
                        quantile_ms(&waits.filter(|waits| waits.count() > 0.0), 0.99)
                    },
                });
            }
        }
    }
    panel
}

fn milliseconds(value: Option<f64>) -> String {
    match value {
        Some(value) if value < 10.0 => format!("{value:.2}"),
        Some(value) => format!("{value:.1}"),
        None => "-".to_string(),
    }
}

fn render_text(panel: &Panel) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<8} {:<22} {:>10} {:>10} {:>9} {:>6} {:>8} {:>8} {:>10}\n",
        "SERVER",
        "METRICS",
        "READ MB/s",
        "WRITE MB/s",
        "IOPS",
        "QUEUE",
        "p50 ms",
        "p99 ms",
        "BUFWAIT/s"
    ));
    for row in &panel.servers {
        if !row.reachable {
            out.push_str(&format!(
                "{:<8} {:<22} unreachable\n",
                row.name, row.address
            ));
            continue;
        }
        out.push_str(&format!(
            "{:<8} {:<22} {:>10.1} {:>10.1} {:>9.0} {:>6.0} {:>8} {:>8} {:>10.0}\n",
            row.name,
            row.address,
            row.read_mb_per_s,
            row.write_mb_per_s,
            row.iops,
            row.queue_depth,
            milliseconds(row.p50_ms),
            milliseconds(row.p99_ms),
            row.buffer_waits_per_s,
        ));
    }
    out.push_str(&format!(
        "{:<8} {:<22} {:>10.1} {:>10.1} {:>9.0} {:>6.0}\n",
        "TOTAL",
        format!("{} I/O servers", panel.servers.len()),
        panel.total_read_mb_per_s,
        panel.total_write_mb_per_s,
        panel.total_iops,
        panel.total_queue_depth,
    ));
    match &panel.meta {
        Some(meta) if meta.reachable => {
            out.push_str(&format!(
                "meta     {:<22} {:.0} ops/s, {:.1} commits/s (batch {}), p50 {} ms, p99 {} ms, {} inodes, {} sessions\n",
                meta.address,
                meta.operations_per_s,
                meta.commits_per_s,
                meta.batch_average
                    .map_or("-".to_string(), |average| format!("{average:.1}")),
                milliseconds(meta.p50_ms),
                milliseconds(meta.p99_ms),
                meta.inodes,
                meta.sessions,
            ));
            let operations: Vec<String> = meta
                .operations
                .iter()
                .map(|(name, per_s)| format!("{name} {per_s:.0}/s"))
                .collect();
            if !operations.is_empty() {
                out.push_str(&format!("  ops: {}\n", operations.join(", ")));
            }
            out.push_str(&format!(
                "  cache: {} leases held, {:.0} revocations/s, revocation wait p99 {} ms\n",
                meta.leases,
                meta.revocations_per_s,
                milliseconds(meta.revocation_p99_ms),
            ));
        }
        Some(meta) => out.push_str(&format!("meta     {:<22} unreachable\n", meta.address)),
        None => out.push_str("meta     (no metrics endpoint)\n"),
    }
    out.push_str(&format!("over {:.2} s", panel.interval_s));
    out
}

/// A figure rounded to thousandths as JSON: a whole one without a fraction, null if not
/// finite.
fn json_number(value: f64) -> Value {
    let rounded = (value * 1000.0).round() / 1000.0;
    if rounded.is_finite() && rounded.fract() == 0.0 && rounded.abs() < 1e15 {
        Value::from(rounded as i64)
    } else {
        Value::from(rounded)
    }
}

fn json_option(value: Option<f64>) -> Value {
    value.map_or(Value::Null, json_number)
}

fn render_json(panel: &Panel) -> String {
    let servers: Vec<Value> = panel
        .servers
        .iter()
        .map(|row| {
            json!({
                "name": row.name,
                "address": row.address,
                "reachable": row.reachable,
                "read_mb_per_s": json_number(row.read_mb_per_s),
                "write_mb_per_s": json_number(row.write_mb_per_s),
                "iops": json_number(row.iops),
                "queue_depth": json_number(row.queue_depth),
                "p50_ms": json_option(row.p50_ms),
                "p99_ms": json_option(row.p99_ms),
                "buffer_waits_per_s": json_number(row.buffer_waits_per_s),
            })
        })
        .collect();
    let meta = panel.meta.as_ref().map_or(Value::Null, |meta| {
        let operations: serde_json::Map<String, Value> = meta
            .operations
            .iter()
            .map(|(name, per_s)| (name.clone(), json_number(*per_s)))
            .collect();
        json!({
            "address": meta.address,
            "reachable": meta.reachable,
            "ops_per_s": json_number(meta.operations_per_s),
            "ops": operations,
            "commits_per_s": json_number(meta.commits_per_s),
            "batch_average": json_option(meta.batch_average),
            "p50_ms": json_option(meta.p50_ms),
            "p99_ms": json_option(meta.p99_ms),
            "inodes": json_number(meta.inodes),
            "sessions": json_number(meta.sessions),
            "leases": json_number(meta.leases),
            "revocations_per_s": json_number(meta.revocations_per_s),
            "revocation_p99_ms": json_option(meta.revocation_p99_ms),
        })
    });
    json!({
        "interval_s": json_number(panel.interval_s),
        "servers": servers,
        "meta": meta,
        "total": {
            "read_mb_per_s": json_number(panel.total_read_mb_per_s),
            "write_mb_per_s": json_number(panel.total_write_mb_per_s),
            "iops": json_number(panel.total_iops),
            "queue_depth": json_number(panel.total_queue_depth),
        },
    })
    .to_string()
}

fn is_terminal(descriptor: libc::c_int) -> bool {
    // SAFETY: isatty has no preconditions.
    unsafe { libc::isatty(descriptor) == 1 }
}

/// The terminal in non-canonical, no-echo mode (keys arrive one by one, unechoed) until
/// dropped, which restores the saved settings. Signals stay on, so Ctrl-C still works.
struct RawTerminal {
    saved: libc::termios,
}

impl RawTerminal {
    fn enter() -> Option<RawTerminal> {
        // SAFETY: termios is plain data; tcgetattr fills it or fails.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        if unsafe { libc::tcgetattr(libc::STDIN_FILENO, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        raw.c_lflag &= !(libc::ICANON | libc::ECHO);
        raw.c_cc[libc::VMIN] = 1;
        raw.c_cc[libc::VTIME] = 0;
        // SAFETY: raw is a valid termios derived from the current one.
        if unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(RawTerminal { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `enter`.
        unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &self.saved) };
        println!();
    }
}

fn read_keys(sender: tokio::sync::mpsc::Sender<u8>) {
    use std::io::Read as _;
    let mut stdin = std::io::stdin();
    let mut byte = [0u8; 1];
    while let Ok(1) = stdin.read(&mut byte) {
        if sender.blocking_send(byte[0]).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(text: &str) -> Option<Snapshot> {
        Some(Snapshot::parse(text))
    }

    fn io_page(
        written_bytes: u64,
        read_bytes: u64,
        operations: u64,
        fast: u64,
        slow: u64,
    ) -> String {
        let total = fast + slow;
        format!(
            "freeflow_io_written_bytes_total {written_bytes}\n\
             freeflow_io_read_bytes_total {read_bytes}\n\
             freeflow_io_disk_operations_total{{op=\"write\"}} {operations}\n\
             freeflow_rpc_requests_in_flight 3\n\
             freeflow_rpc_service_time_microseconds_bucket{{op=\"WriteObject\",le=\"1000\"}} {fast}\n\
             freeflow_rpc_service_time_microseconds_bucket{{op=\"WriteObject\",le=\"10000\"}} {total}\n\
             freeflow_rpc_service_time_microseconds_bucket{{op=\"WriteObject\",le=\"+Inf\"}} {total}\n\
             freeflow_rpc_service_time_microseconds_sum{{op=\"WriteObject\"}} 0\n"
        )
    }

    #[test]
    fn rates_quantiles_and_totals_come_from_the_difference_of_two_scrapes() {
        let endpoints = vec![
            Endpoint {
                role: Role::Meta,
                address: "m:1".into(),
            },
            Endpoint {
                role: Role::Io(0),
                address: "a:1".into(),
            },
            Endpoint {
                role: Role::Io(1),
                address: "b:1".into(),
            },
        ];
        let meta_before = "freeflow_rpc_requests_total{op=\"Create\"} 10\nfreeflow_rpc_requests_total{op=\"GetAttr\"} 5\nfreeflow_meta_commits_total 4\nfreeflow_meta_commit_batch_operations_bucket{le=\"4\"} 4\nfreeflow_meta_commit_batch_operations_bucket{le=\"+Inf\"} 4\nfreeflow_meta_commit_batch_operations_sum 10\n";
        let meta_after = "freeflow_rpc_requests_total{op=\"Create\"} 210\nfreeflow_rpc_requests_total{op=\"GetAttr\"} 5\nfreeflow_meta_commits_total 54\nfreeflow_meta_commit_batch_operations_bucket{le=\"4\"} 54\nfreeflow_meta_commit_batch_operations_bucket{le=\"+Inf\"} 54\nfreeflow_meta_commit_batch_operations_sum 210\nfreeflow_meta_inodes 300\n";
        let before = vec![
            snapshot(meta_before),
            snapshot(&io_page(0, 0, 0, 0, 0)),
            snapshot(&io_page(1_000_000, 0, 10, 5, 0)),
        ];
        let after = vec![
            snapshot(meta_after),
            // 200 MB written in 2 s, 100 fast writes and 100 slow ones.
            snapshot(&io_page(200_000_000, 50_000_000, 400, 100, 100)),
            None,
        ];
        let panel = compute(&endpoints, &before, &after, Duration::from_secs(2));
        let first = &panel.servers[0];
        assert_eq!(first.write_mb_per_s, 100.0);
        assert_eq!(first.read_mb_per_s, 25.0);
        assert_eq!(first.iops, 200.0);
        assert_eq!(first.queue_depth, 3.0);
        assert_eq!(first.p50_ms, Some(1.0));
        assert!((first.p99_ms.unwrap() - 9.82).abs() < 1e-9, "{first:?}");
        assert!(!panel.servers[1].reachable);
        assert_eq!(panel.total_write_mb_per_s, 100.0);
        let meta = panel.meta.as_ref().unwrap();
        assert_eq!(meta.operations, vec![("Create".to_string(), 100.0)]);
        assert_eq!(meta.commits_per_s, 25.0);
        assert_eq!(meta.batch_average, Some(4.0));
        assert_eq!(meta.inodes, 300.0);
        let text = render_text(&panel);
        assert!(text.contains("Create 100/s"), "{text}");
        assert!(text.contains("unreachable"), "{text}");
        let json = render_json(&panel);
        assert!(json.contains("\"write_mb_per_s\":100,"), "{json}");
        assert!(json.contains("\"ops\":{\"Create\":100}"), "{json}");
    }

    #[test]
    fn unspecified_hosts_are_replaced_by_the_meta_host() {
        assert_eq!(reachable("0.0.0.0:7701", "meta-host"), "meta-host:7701");
        assert_eq!(reachable("10.0.0.2:7801", "meta-host"), "10.0.0.2:7801");
    }
}
