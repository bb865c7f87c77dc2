//! The model every scenario and every output shares: what is measured (`Target`,
//! `MetricSpec`, `Measurement`) and what is reported (`Report`, `ScenarioReport`,
//! `MetricReport`, `SubjectStats`). Scenarios only produce measurements; the runner turns
//! them into statistics, and the table, the JSON file and the plot all read the same
//! `Report`, so they cannot disagree.

use std::path::PathBuf;

use crate::json::{self, Value};

/// The schema name written into every report; bump the number when a field changes meaning.
pub const SCHEMA: &str = "freeflow-bench/1";

/// A directory a scenario runs in: the Freeflow mount, a local directory, a peer's mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub name: String,
    pub path: PathBuf,
}

impl Target {
    /// Parse `NAME:PATH` (the name may not be empty or contain ':').
    pub fn parse(text: &str) -> Result<Target, String> {
        let (name, path) = text
            .split_once(':')
            .ok_or_else(|| format!("target {text:?} is not NAME:PATH"))?;
        if name.is_empty() || path.is_empty() {
            return Err(format!("target {text:?}: NAME and PATH must not be empty"));
        }
        Ok(Target {
            name: name.to_string(),
            path: PathBuf::from(path),
        })
    }
}

/// Whether a larger value of a metric is better (throughput) or worse (latency, memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
}

impl Better {
    pub fn as_str(self) -> &'static str {
        match self {
            Better::Higher => "higher",
            Better::Lower => "lower",
        }
    }
}

/// One quantity a scenario measures on every subject, every run.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricSpec {
    pub name: String,
    /// `MB/s` (10^6 bytes per second), `ops/s`, `IOPS`, `ms`, `MiB`, `x` (a ratio), `index`.
    pub unit: &'static str,
    pub better: Better,
}

impl MetricSpec {
    pub fn new(name: impl Into<String>, unit: &'static str, better: Better) -> MetricSpec {
        MetricSpec {
            name: name.into(),
            unit,
            better,
        }
    }
}

/// One value of one metric from one run on one subject.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub metric: String,
    pub value: f64,
}

impl Measurement {
    pub fn new(metric: impl Into<String>, value: f64) -> Measurement {
        Measurement {
            metric: metric.into(),
            value,
        }
    }
}

/// Statistics of one metric on one subject over the repeats.
#[derive(Clone, Debug, PartialEq)]
pub struct SubjectStats {
    pub subject: String,
    /// In run order.
    pub samples: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// This subject's median over the first subject's median; None when either has no
    /// samples or the first median is 0.
    pub ratio_to_first: Option<f64>,
}

/// Median of the values (mean of the middle two for an even count); NaN when empty.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

/// Jain's fairness index of per-client throughputs: 1 when all are equal, 1/n when one
/// client gets everything. NaN for no values or all zero.
pub fn jain_index(values: &[f64]) -> f64 {
    let sum: f64 = values.iter().sum();
    let squares: f64 = values.iter().map(|value| value * value).sum();
    if values.is_empty() || squares == 0.0 {
        return f64::NAN;
    }
    sum * sum / (values.len() as f64 * squares)
}

/// Statistics of every subject for one metric; ratios are to the first subject's median.
pub fn summarise(subjects: &[String], samples: &[Vec<f64>]) -> Vec<SubjectStats> {
    let medians: Vec<f64> = samples.iter().map(|values| median(values)).collect();
    let first = medians.first().copied().unwrap_or(f64::NAN);
    subjects
        .iter()
        .zip(samples)
        .zip(&medians)
        .map(|((subject, values), &median)| {
            let ratio = median / first;
            SubjectStats {
                subject: subject.clone(),
                samples: values.clone(),
                median,
                min: values.iter().copied().fold(f64::NAN, f64::min),
                max: values.iter().copied().fold(f64::NAN, f64::max),
                ratio_to_first: ratio.is_finite().then_some(ratio),
            }
        })
        .collect()
}

#[derive(Clone, Debug, PartialEq)]
pub struct MetricReport {
    pub spec: MetricSpec,
    /// One entry per subject, in the scenario's subject order.
    pub results: Vec<SubjectStats>,
}

/// A run that failed: which subject, which repeat, which step, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct RunFailure {
    pub subject: String,
    /// 1-based; 0 for a failure while setting up the subjects.
    pub repeat: u32,
    pub step: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ScenarioReport {
    pub name: String,
    /// The sizes and counts it ran with.
    pub parameters: Vec<(String, Value)>,
    /// The user's targets, or the scenario's own variants (cluster scenarios).
    pub subjects: Vec<String>,
    /// Why the scenario did not run at all (not root, no `ip netns`, ...).
    pub skipped: Option<String>,
    /// Conditions a reader must know (buffered I/O instead of O_DIRECT, threads for processes).
    pub notes: Vec<String>,
    pub metrics: Vec<MetricReport>,
    pub failures: Vec<RunFailure>,
    pub elapsed_ms: u64,
}

/// Whether the page cache could be dropped between write and read phases.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheReport {
    /// Every drop that was wanted was made.
    pub dropped: bool,
    pub drops: u64,
    /// Why not, when `dropped` is false.
    pub reason: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct HostInfo {
    pub hostname: String,
    pub kernel: String,
    pub cpus: u64,
    pub memory_bytes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TargetInfo {
    pub target: Target,
    /// The file system type under the path (statfs), e.g. `ext4`, `fuse`, `tmpfs`.
    pub fs_type: String,
}

/// The whole run.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub started_unix_s: u64,
    pub command: String,
    pub size: String,
    pub repeat: u32,
    pub host: HostInfo,
    pub caches: CacheReport,
    pub targets: Vec<TargetInfo>,
    pub scenarios: Vec<ScenarioReport>,
}

impl Report {
    /// Every failure of every scenario, with the scenario's name.
    pub fn failures(&self) -> Vec<(&str, &RunFailure)> {
        self.scenarios
            .iter()
            .flat_map(|scenario| {
                scenario
                    .failures
                    .iter()
                    .map(move |failure| (scenario.name.as_str(), failure))
            })
            .collect()
    }

    /// The report as JSON (the schema is in docs/BENCHMARKS.md).
    pub fn to_json(&self) -> Value {
        let object = |members: Vec<(&str, Value)>| json::object(members);
        let optional = |text: &Option<String>| match text {
            Some(text) => json::string(text.clone()),
            None => Value::Null,
        };
        let scenarios = self
            .scenarios
            .iter()
            .map(|scenario| {
                let metrics = scenario
                    .metrics
                    .iter()
                    .map(|metric| {
                        let results = metric
                            .results
                            .iter()
                            .map(|stats| {
                                object(vec![
                                    ("subject", json::string(stats.subject.clone())),
                                    (
                                        "samples",
                                        Value::Array(
                                            stats
                                                .samples
                                                .iter()
                                                .map(|v| json::number(*v))
                                                .collect(),
                                        ),
                                    ),
                                    ("median", json::number(stats.median)),
                                    ("min", json::number(stats.min)),
                                    ("max", json::number(stats.max)),
                                    (
                                        "ratio_to_first",
                                        stats.ratio_to_first.map_or(Value::Null, json::number),
                                    ),
                                ])
                            })
                            .collect();
                        object(vec![
                            ("name", json::string(metric.spec.name.clone())),
                            ("unit", json::string(metric.spec.unit)),
                            ("better", json::string(metric.spec.better.as_str())),
                            ("results", Value::Array(results)),
                        ])
                    })
                    .collect();
                let failures = scenario
                    .failures
                    .iter()
                    .map(|failure| {
                        object(vec![
                            ("subject", json::string(failure.subject.clone())),
                            ("repeat", json::number(f64::from(failure.repeat))),
                            ("step", json::string(failure.step.clone())),
                            ("message", json::string(failure.message.clone())),
                        ])
                    })
                    .collect();
                object(vec![
                    ("name", json::string(scenario.name.clone())),
                    ("parameters", json::object(scenario.parameters.clone())),
                    (
                        "subjects",
                        Value::Array(
                            scenario
                                .subjects
                                .iter()
                                .map(|s| json::string(s.clone()))
                                .collect(),
                        ),
                    ),
                    ("skipped", optional(&scenario.skipped)),
                    (
                        "notes",
                        Value::Array(
                            scenario
                                .notes
                                .iter()
                                .map(|n| json::string(n.clone()))
                                .collect(),
                        ),
                    ),
                    ("elapsed_ms", json::number(scenario.elapsed_ms as f64)),
                    ("metrics", Value::Array(metrics)),
                    ("failures", Value::Array(failures)),
                ])
            })
            .collect();
        let targets = self
            .targets
            .iter()
            .map(|info| {
                object(vec![
                    ("name", json::string(info.target.name.clone())),
                    ("path", json::string(info.target.path.display().to_string())),
                    ("fs_type", json::string(info.fs_type.clone())),
                ])
            })
            .collect();
        object(vec![
            ("schema", json::string(SCHEMA)),
            ("started_unix_s", json::number(self.started_unix_s as f64)),
            ("command", json::string(self.command.clone())),
            ("size", json::string(self.size.clone())),
            ("repeat", json::number(f64::from(self.repeat))),
            (
                "host",
                object(vec![
                    ("hostname", json::string(self.host.hostname.clone())),
                    ("kernel", json::string(self.host.kernel.clone())),
                    ("cpus", json::number(self.host.cpus as f64)),
                    ("memory_bytes", json::number(self.host.memory_bytes as f64)),
                ]),
            ),
            (
                "caches",
                object(vec![
                    ("dropped", Value::Bool(self.caches.dropped)),
                    ("drops", json::number(self.caches.drops as f64)),
                    ("reason", optional(&self.caches.reason)),
                ]),
            ),
            ("targets", Value::Array(targets)),
            ("scenarios", Value::Array(scenarios)),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn jain_index_is_one_when_fair_and_one_over_n_when_not() {
        assert!((jain_index(&[5.0, 5.0, 5.0, 5.0]) - 1.0).abs() < 1e-12);
        assert!((jain_index(&[8.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert!(jain_index(&[0.0, 0.0]).is_nan());
    }

    #[test]
    fn ratios_are_to_the_first_subjects_median() {
        let subjects = vec!["a".to_string(), "b".to_string(), "c".to_string()];
        let stats = summarise(&subjects, &[vec![2.0, 4.0, 3.0], vec![6.0, 9.0], vec![]]);
        assert_eq!(stats[0].ratio_to_first, Some(1.0));
        assert_eq!(stats[1].median, 7.5);
        assert_eq!(stats[1].ratio_to_first, Some(2.5));
        assert_eq!((stats[1].min, stats[1].max), (6.0, 9.0));
        assert_eq!(stats[2].ratio_to_first, None);
    }

    #[test]
    fn targets_parse_as_name_colon_path() {
        let target = Target::parse("ff:/mnt/ff:x").expect("parses");
        assert_eq!(target.name, "ff");
        assert_eq!(target.path, PathBuf::from("/mnt/ff:x"));
        assert!(Target::parse("/mnt").is_err());
        assert!(Target::parse(":/mnt").is_err());
        assert!(Target::parse("x:").is_err());
    }
}
