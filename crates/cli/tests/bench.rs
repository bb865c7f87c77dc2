//! `freeflow bench` end to end (issue 4): every scenario at `--size tiny`, twice, on a local
//! directory and on a Freeflow FUSE mount of a real cluster (the common harness), and the
//! JSON report checked to be complete and well formed: every scenario, subject and metric
//! present, medians finite and positive, ratios present. Nothing here asserts that any
//! number is fast; performance is reported, never asserted.
//!
//! The striping scenario may be skipped (it needs root and `ip netns`); the report must
//! then say why. Everything else must run. Without /dev/fuse the Freeflow target is left
//! out and the run is on the local directory alone.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::mount::Mount;
use common::{Cluster, FREEFLOW};
use freeflow_bench::json::{self, Value};

/// Runs of each scenario on each subject.
const REPEAT: usize = 2;

fn field<'a>(value: &'a Value, key: &str, context: &str) -> &'a Value {
    value
        .get(key)
        .unwrap_or_else(|| panic!("{context}: no field {key:?}"))
}

fn text<'a>(value: &'a Value, key: &str, context: &str) -> &'a str {
    field(value, key, context)
        .as_str()
        .unwrap_or_else(|| panic!("{context}: {key:?} is not a string"))
}

fn array<'a>(value: &'a Value, key: &str, context: &str) -> &'a [Value] {
    field(value, key, context)
        .as_array()
        .unwrap_or_else(|| panic!("{context}: {key:?} is not an array"))
}

fn number(value: &Value, key: &str, context: &str) -> f64 {
    field(value, key, context)
        .as_f64()
        .unwrap_or_else(|| panic!("{context}: {key:?} is not a number"))
}

/// Metric names each scenario must report (a sample of each, by the names the docs use).
fn required_metrics(scenario: &str) -> &'static [&'static str] {
    match scenario {
        "seq" => &[
            "write_4K",
            "write_64K",
            "write_1M",
            "write_4M",
            "read_4K",
            "read_64K",
            "read_1M",
            "read_4M",
        ],
        "chunk" => &["open_ms", "write_ms", "fsync_ms", "close_ms", "total"],
        "concurrent-writers" => &["writers_1", "writers_4", "speedup"],
        "random" => &["read_t1", "read_t8", "write_t1", "write_t8"],
        "metadata" => &[
            "create_one_dir_p1",
            "stat_one_dir_p4",
            "readdir_spread_p1",
            "unlink_spread_p4",
        ],
        "startup" => &["ready_ms", "first_connect_ms"],
        "incast" => &[
            "aggregate",
            "per_client_min",
            "per_client_median",
            "jain_index",
            "io_peak_rss",
        ],
        "striping" => &["write", "read"],
        other => panic!("unknown scenario {other} in the report"),
    }
}

/// Check one scenario's report; returns the number of bars the plot must draw for it.
fn check_scenario(scenario: &Value, target_names: &[&str]) -> usize {
    let name = text(scenario, "name", "scenario");
    let context = format!("scenario {name}");
    assert!(
        matches!(field(scenario, "parameters", &context), Value::Object(p) if !p.is_empty()),
        "{context}: parameters missing"
    );
    let failures = array(scenario, "failures", &context);
    assert!(failures.is_empty(), "{context}: failed runs: {failures:?}");
    if let Some(reason) = field(scenario, "skipped", &context).as_str() {
        assert_eq!(name, "striping", "{context} was skipped: {reason}");
        assert!(!reason.is_empty(), "{context}: skipped without a reason");
        eprintln!("note: {context} skipped: {reason}");
        return 0;
    }
    assert!(field(scenario, "skipped", &context).is_null());
    let subjects: Vec<&str> = array(scenario, "subjects", &context)
        .iter()
        .map(|s| s.as_str().expect("subject names are strings"))
        .collect();
    match name {
        "startup" | "incast" | "striping" => {
            assert!(subjects.len() >= 2, "{context}: subjects {subjects:?}")
        }
        _ => assert_eq!(subjects, target_names, "{context}: subjects"),
    }
    let metrics = array(scenario, "metrics", &context);
    let metric_names: Vec<&str> = metrics.iter().map(|m| text(m, "name", &context)).collect();
    for required in required_metrics(name) {
        assert!(
            metric_names.contains(required),
            "{context}: metric {required} missing from {metric_names:?}"
        );
    }
    let mut bars = 0;
    for metric in metrics {
        let metric_name = text(metric, "name", &context);
        let context = format!("{context} metric {metric_name}");
        assert!(
            !text(metric, "unit", &context).is_empty(),
            "{context}: unit"
        );
        assert!(
            ["higher", "lower"].contains(&text(metric, "better", &context)),
            "{context}: better"
        );
        let results = array(metric, "results", &context);
        assert_eq!(
            results.len(),
            subjects.len(),
            "{context}: one result per subject"
        );
        for (index, (result, subject)) in results.iter().zip(&subjects).enumerate() {
            let context = format!("{context} on {subject}");
            assert_eq!(text(result, "subject", &context), *subject);
            let samples = array(result, "samples", &context);
            assert_eq!(samples.len(), REPEAT, "{context}: one sample per repeat");
            let median = number(result, "median", &context);
            let (min, max) = (
                number(result, "min", &context),
                number(result, "max", &context),
            );
            assert!(
                median.is_finite() && median > 0.0,
                "{context}: median {median}"
            );
            assert!(
                min <= median && median <= max,
                "{context}: {min} <= {median} <= {max}"
            );
            for sample in samples {
                let sample = sample.as_f64().expect("samples are numbers");
                assert!(min <= sample && sample <= max, "{context}: sample {sample}");
            }
            let ratio = number(result, "ratio_to_first", &context);
            assert!(ratio.is_finite() && ratio > 0.0, "{context}: ratio {ratio}");
            if index == 0 {
                assert_eq!(ratio, 1.0, "{context}: the first subject's ratio");
            }
            bars += 1;
        }
    }
    bars
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_runs_at_tiny_size_on_a_local_directory_and_a_freeflow_mount() {
    let cluster = Cluster::start(2).await;
    let fuse = Path::new("/dev/fuse").exists();
    if !fuse {
        eprintln!("note: /dev/fuse is missing, so the Freeflow mount target is left out");
    }
    let mount = fuse.then(|| Mount::start(&cluster, "mnt", &[]));
    let local = cluster.path().join("local");
    fs::create_dir(&local).expect("make the local target");
    let report_path = cluster.path().join("report.json");
    let plot_path = cluster.path().join("report.svg");

    let mut command = Command::new(FREEFLOW);
    command
        .arg("bench")
        .args(["--size", "tiny", "--repeat", &REPEAT.to_string(), "--quiet"])
        .arg("--scratch")
        .arg(cluster.path())
        .arg("--json")
        .arg(&report_path)
        .arg("--plot")
        .arg(&plot_path)
        .arg("--target")
        .arg(format!("local:{}", local.display()));
    let mut target_names = vec!["local"];
    if let Some(mount) = &mount {
        command
            .arg("--target")
            .arg(format!("freeflow:{}", mount.mountpoint.display()));
        target_names.push("freeflow");
    }
    let started = Instant::now();
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("join")
        .expect("run freeflow bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!(
        "freeflow bench took {:.1} s:\n{stdout}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        output.status.success(),
        "freeflow bench failed: {}\n{stderr}\n{stdout}",
        output.status
    );

    let report = json::parse(&fs::read_to_string(&report_path).expect("the JSON report"))
        .expect("the report is valid JSON");
    assert_eq!(text(&report, "schema", "report"), freeflow_bench::SCHEMA);
    assert_eq!(number(&report, "repeat", "report"), REPEAT as f64);
    assert_eq!(text(&report, "size", "report"), "tiny");
    let caches = field(&report, "caches", "report");
    let dropped = field(caches, "dropped", "caches")
        .as_bool()
        .expect("caches.dropped is a boolean");
    assert!(
        dropped || field(caches, "reason", "caches").as_str().is_some(),
        "caches not dropped and no reason given"
    );
    let targets: Vec<&str> = array(&report, "targets", "report")
        .iter()
        .map(|t| text(t, "name", "target"))
        .collect();
    assert_eq!(targets, target_names);
    if mount.is_some() {
        let fs_type = text(&array(&report, "targets", "report")[1], "fs_type", "target");
        assert_eq!(fs_type, "fuse", "the mount target's file system");
    }

    let scenarios = array(&report, "scenarios", "report");
    let names: Vec<&str> = scenarios
        .iter()
        .map(|s| text(s, "name", "scenario"))
        .collect();
    assert_eq!(names, freeflow_bench::SCENARIOS, "every scenario, in order");
    let mut bars = 0;
    for scenario in scenarios {
        bars += check_scenario(scenario, &target_names);
        let name = text(scenario, "name", "scenario");
        assert!(
            stdout.contains(&format!("== {name}")),
            "the table has no section for {name}"
        );
    }

    let plot = fs::read_to_string(&plot_path).expect("the SVG plot");
    assert!(plot.starts_with("<svg") && plot.trim_end().ends_with("</svg>"));
    // One background rectangle plus one bar per result.
    assert_eq!(plot.matches("<rect").count(), bars + 1, "bars in the plot");
    drop(mount);
}

#[test]
fn an_unknown_scenario_or_a_missing_target_is_refused_with_its_name() {
    let output = Command::new(FREEFLOW)
        .args(["bench", "--scenario", "nonsense", "--quiet"])
        .output()
        .expect("run freeflow bench");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("nonsense"), "{stderr}");

    let output = Command::new(FREEFLOW)
        .args([
            "bench",
            "--scenario",
            "seq",
            "--quiet",
            "--target",
            "gone:/nonexistent/freeflow-bench",
        ])
        .output()
        .expect("run freeflow bench");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("gone") && stderr.contains("/nonexistent/freeflow-bench"),
        "{stderr}"
    );
}
