//! Reading the text format back: [`Snapshot::parse`] turns a scraped page into samples, and
//! [`HistogramData`] gives quantiles from bucket counts, usually the difference of two
//! scrapes (what happened between them), as Prometheus' `histogram_quantile` does.
//!
//! The text comes from the network, so parsing never panics: a line that does not parse
//! is skipped and counted in [`Snapshot::skipped_lines`].

/// One sample line: `name{label="value",...} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, value)| value.as_str())
    }

    fn matches(&self, name: &str, filter: &[(&str, &str)]) -> bool {
        self.name == name
            && filter
                .iter()
                .all(|(label, value)| self.label(label) == Some(*value))
    }
}

/// Every sample of one scrape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub samples: Vec<Sample>,
    pub skipped_lines: usize,
}

impl Snapshot {
    pub fn parse(text: &str) -> Snapshot {
        let mut snapshot = Snapshot::default();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match parse_line(line) {
                Some(sample) => snapshot.samples.push(sample),
                None => snapshot.skipped_lines += 1,
            }
        }
        snapshot
    }

    /// The value of the first sample named `name` whose labels include `filter`.
    pub fn value(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|sample| sample.matches(name, filter))
            .map(|sample| sample.value)
    }

    /// The sum over every sample named `name` whose labels include `filter` (0 if none).
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|sample| sample.matches(name, filter))
            .map(|sample| sample.value)
            .sum()
    }

    /// The distinct values of `label` among samples named `name`, in first-seen order.
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut values: Vec<String> = Vec::new();
        for sample in self.samples.iter().filter(|sample| sample.name == name) {
            if let Some(value) = sample.label(label) {
                if !values.iter().any(|known| known == value) {
                    values.push(value.to_string());
                }
            }
        }
        values
    }

    /// The histogram `name` summed over every label set that includes `filter` (buckets
    /// with the same bound added up), or None if it has no buckets here.
    pub fn histogram(&self, name: &str, filter: &[(&str, &str)]) -> Option<HistogramData> {
        let bucket_name = format!("{name}_bucket");
        let mut bounds: Vec<(f64, f64)> = Vec::new();
        for sample in self
            .samples
            .iter()
            .filter(|sample| sample.matches(&bucket_name, filter))
        {
            let Some(bound) = sample.label("le").and_then(parse_value) else {
                continue;
            };
            match bounds.iter_mut().find(|(known, _)| *known == bound) {
                Some((_, count)) => *count += sample.value,
                None => bounds.push((bound, sample.value)),
            }
        }
        if bounds.is_empty() {
            return None;
        }
        bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(HistogramData {
            bounds: bounds.iter().map(|(bound, _)| *bound).collect(),
            cumulative: bounds.iter().map(|(_, count)| *count).collect(),
            sum: self.sum(&format!("{name}_sum"), filter),
        })
    }
}

/// A histogram as cumulative counts per upper bound (the last bound is `+Inf`).
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramData {
    pub bounds: Vec<f64>,
    pub cumulative: Vec<f64>,
    pub sum: f64,
}

impl HistogramData {
    pub fn count(&self) -> f64 {
        self.cumulative.last().copied().unwrap_or(0.0)
    }

    /// What was observed since `earlier` (same buckets; counts never go down, so a bucket
    /// that did, after a restart, counts from zero).
    pub fn since(&self, earlier: &HistogramData) -> HistogramData {
        let cumulative = self
            .bounds
            .iter()
            .zip(&self.cumulative)
            .map(|(bound, count)| {
                let before = earlier
                    .bounds
                    .iter()
                    .position(|known| known == bound)
                    .map_or(0.0, |index| earlier.cumulative[index]);
                if *count >= before {
                    count - before
                } else {
                    *count
                }
            })
            .collect();
        HistogramData {
            bounds: self.bounds.clone(),
            cumulative,
            sum: (self.sum - earlier.sum).max(0.0),
        }
    }

    /// The `quantile` (0..=1), interpolated linearly inside its bucket; None without
    /// observations. A quantile in the `+Inf` bucket is reported as the largest finite bound.
    pub fn quantile(&self, quantile: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 || !(0.0..=1.0).contains(&quantile) {
            return None;
        }
        let rank = quantile * total;
        let mut lower_bound = 0.0;
        let mut below = 0.0;
        for (bound, cumulative) in self.bounds.iter().zip(&self.cumulative) {
            if *cumulative >= rank && *cumulative > below {
                if bound.is_infinite() {
                    return Some(lower_bound);
                }
                let fraction = (rank - below) / (cumulative - below);
                return Some(lower_bound + (bound - lower_bound) * fraction.clamp(0.0, 1.0));
            }
            lower_bound = *bound;
            below = *cumulative;
        }
        Some(lower_bound)
    }
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => text.parse().ok(),
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, remaining) = parse_labels(after_brace)?;
        labels = parsed;
        rest = remaining;
    }
    let value = rest.split_whitespace().next().and_then(parse_value)?;
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows the brace.
fn parse_labels(mut text: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        text = text.trim_start_matches([' ', ',']);
        if let Some(rest) = text.strip_prefix('}') {
            return Some((labels, rest));
        }
        let equals = text.find('=')?;
        let label = text[..equals].trim().to_string();
        text = text[equals + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = text.char_indices();
        let end = loop {
            let (index, c) = chars.next()?;
            match c {
                '"' => break index,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                other => value.push(other),
            }
        };
        labels.push((label, value));
        text = &text[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Registry;

    #[test]
    fn a_rendered_registry_parses_back() {
        let registry = Registry::new();
        registry
            .counter("ff_bytes_total", "B.", &[("op", "Write\"x\\")])
            .add(7);
        registry
            .counter("ff_bytes_total", "B.", &[("op", "Read")])
            .add(5);
        let latency = registry.histogram("ff_latency", "L.", &[("op", "Read")], &[10, 100]);
        latency.observe(5);
        latency.observe(50);
        let snapshot = Snapshot::parse(&registry.render());
        assert_eq!(snapshot.skipped_lines, 0);
        assert_eq!(
            snapshot.value("ff_bytes_total", &[("op", "Write\"x\\")]),
            Some(7.0)
        );
        assert_eq!(snapshot.sum("ff_bytes_total", &[]), 12.0);
        assert_eq!(
            snapshot.label_values("ff_bytes_total", "op"),
            vec!["Write\"x\\".to_string(), "Read".to_string()]
        );
        let histogram = snapshot.histogram("ff_latency", &[]).unwrap();
        assert_eq!(histogram.bounds, vec![10.0, 100.0, f64::INFINITY]);
        assert_eq!(histogram.cumulative, vec![1.0, 2.0, 2.0]);
        assert_eq!(histogram.sum, 55.0);
        assert!(snapshot.histogram("ff_missing", &[]).is_none());
    }

    #[test]
    fn garbage_lines_are_skipped_not_fatal() {
        let snapshot = Snapshot::parse(
            "ok 1\n{broken 2\nname{a=\"unterminated 3\nx{a=\"1\"} nan?\nlast 2.5 123\n",
        );
        assert_eq!(snapshot.samples.len(), 2);
        assert_eq!(snapshot.skipped_lines, 3);
        assert_eq!(snapshot.value("last", &[]), Some(2.5));
    }

    #[test]
    fn quantiles_interpolate_within_buckets_of_the_difference() {
        let earlier = HistogramData {
            bounds: vec![10.0, 100.0, f64::INFINITY],
            cumulative: vec![100.0, 100.0, 100.0],
            sum: 500.0,
        };
        let later = HistogramData {
            bounds: vec![10.0, 100.0, f64::INFINITY],
            cumulative: vec![100.0, 200.0, 204.0],
            sum: 9500.0,
        };
        let delta = later.since(&earlier);
        assert_eq!(delta.cumulative, vec![0.0, 100.0, 104.0]);
        // Half of the new observations are at or below 10 + 90 × 0.52.
        let median = delta.quantile(0.5).unwrap();
        assert!((median - (10.0 + 90.0 * 0.52)).abs() < 1e-9, "{median}");
        // p99 falls in +Inf: reported as the largest finite bound.
        assert_eq!(delta.quantile(0.99), Some(100.0));
        assert_eq!(earlier.since(&earlier).quantile(0.5), None);
    }
}
