//! The report as a text table for the terminal: per scenario, one row per metric and one
//! column per subject with median [min..max] and the ratio to the first subject.

use std::fmt::Write as _;

use crate::json::Value;
use crate::model::{Report, SubjectStats};

/// A number with about three significant digits.
pub fn format_number(value: f64) -> String {
    if !value.is_finite() {
        return "-".into();
    }
    let magnitude = value.abs();
    if magnitude >= 100.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

fn cell(stats: &SubjectStats, first: bool) -> String {
    if stats.samples.is_empty() {
        return "(no runs)".into();
    }
    let mut text = format!(
        "{} [{}..{}]",
        format_number(stats.median),
        format_number(stats.min),
        format_number(stats.max)
    );
    if !first {
        match stats.ratio_to_first {
            Some(ratio) => {
                let _ = write!(text, " {ratio:.2}x");
            }
            None => text.push_str(" -"),
        }
    }
    text
}

fn parameter_text(value: &Value) -> String {
    match value {
        Value::Number(number) => match number.as_f64() {
            Some(number) if number.fract() == 0.0 => format!("{number:.0}"),
            Some(number) => format_number(number),
            None => number.to_string(),
        },
        Value::String(text) => text.clone(),
        Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(parameter_text)
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}

/// The whole report as text.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "freeflow bench: size {}, {} repeats interleaved, {} ({} CPUs, kernel {}); caches {}",
        report.size,
        report.repeat,
        report.host.hostname,
        report.host.cpus,
        report.host.kernel,
        if report.caches.dropped {
            "dropped between write and read".to_string()
        } else {
            format!(
                "NOT dropped ({})",
                report.caches.reason.as_deref().unwrap_or("unknown")
            )
        }
    );
    for info in &report.targets {
        let _ = writeln!(
            out,
            "target {} = {} ({})",
            info.target.name,
            info.target.path.display(),
            info.fs_type
        );
    }
    for scenario in &report.scenarios {
        let parameters: Vec<String> = scenario
            .parameters
            .iter()
            .map(|(name, value)| format!("{name}={}", parameter_text(value)))
            .collect();
        let _ = writeln!(
            out,
            "\n== {}  ({})  {:.1} s",
            scenario.name,
            parameters.join(" "),
            scenario.elapsed_ms as f64 / 1000.0
        );
        if let Some(reason) = &scenario.skipped {
            let _ = writeln!(out, "   skipped: {reason}");
            continue;
        }
        if !scenario.metrics.is_empty() && !scenario.subjects.is_empty() {
            let mut rows: Vec<Vec<String>> = vec![{
                let mut header = vec!["metric".to_string(), "unit".to_string()];
                header.extend(scenario.subjects.iter().cloned());
                header
            }];
            for metric in &scenario.metrics {
                let mut row = vec![metric.spec.name.clone(), metric.spec.unit.to_string()];
                row.extend(
                    metric
                        .results
                        .iter()
                        .enumerate()
                        .map(|(index, stats)| cell(stats, index == 0)),
                );
                rows.push(row);
            }
            let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
            let widths: Vec<usize> = (0..columns)
                .map(|column| {
                    rows.iter()
                        .filter_map(|row| row.get(column))
                        .map(|text| text.chars().count())
                        .max()
                        .unwrap_or(0)
                })
                .collect();
            for row in rows {
                let mut line = String::from("   ");
                for (column, text) in row.iter().enumerate() {
                    let _ = write!(line, "{text:<width$}  ", width = widths[column]);
                }
                let _ = writeln!(out, "{}", line.trim_end());
            }
        }
        for note in &scenario.notes {
            let _ = writeln!(out, "   note: {note}");
        }
        for failure in &scenario.failures {
            let _ = writeln!(
                out,
                "   FAILED {} run {}: {}: {}",
                failure.subject, failure.repeat, failure.step, failure.message
            );
        }
    }
    out
}
