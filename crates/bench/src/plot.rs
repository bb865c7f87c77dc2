//! The report drawn as an SVG bar chart, written by hand (no plotting dependency): one
//! section per scenario, one group of horizontal bars per metric, one bar per subject. Bar
//! length is the subject's median relative to the first subject's (the ratio), scaled to
//! the largest ratio of the section, with a dashed line at 1x; each bar is labelled with
//! its median, unit and ratio, so the picture can be read without the table.

use std::fmt::Write as _;

use crate::model::Report;
use crate::table::format_number;

const WIDTH: f64 = 900.0;
const LABEL_WIDTH: f64 = 260.0;
const BAR_AREA: f64 = 420.0;
const ROW: f64 = 16.0;
const PALETTE: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The report as a standalone SVG document.
pub fn render(report: &Report) -> String {
    let mut body = String::new();
    let mut y = 30.0;
    let _ = writeln!(
        body,
        r#"<text x="10" y="20" font-size="15" font-weight="bold">freeflow bench · size {} · {} repeats · bars: median relative to the first subject</text>"#,
        escape(&report.size),
        report.repeat
    );
    for scenario in &report.scenarios {
        y += ROW;
        let title = match &scenario.skipped {
            Some(reason) => format!("{} (skipped: {reason})", scenario.name),
            None => scenario.name.clone(),
        };
        let _ = writeln!(
            body,
            r#"<text x="10" y="{y}" font-size="14" font-weight="bold">{}</text>"#,
            escape(&title)
        );
        y += 6.0;
        let largest = scenario
            .metrics
            .iter()
            .flat_map(|metric| metric.results.iter())
            .filter_map(|stats| stats.ratio_to_first)
            .fold(1.0f64, f64::max);
        let section_top = y;
        for metric in &scenario.metrics {
            y += ROW;
            let _ = writeln!(
                body,
                r#"<text x="20" y="{y}" font-size="12">{} ({}, {} is better)</text>"#,
                escape(&metric.spec.name),
                escape(metric.spec.unit),
                metric.spec.better.as_str()
            );
            for (index, stats) in metric.results.iter().enumerate() {
                y += ROW;
                let colour = PALETTE[index % PALETTE.len()];
                let _ = writeln!(
                    body,
                    r#"<text x="40" y="{}" font-size="11">{}</text>"#,
                    y - 3.0,
                    escape(&stats.subject)
                );
                let (length, label) = match stats.ratio_to_first {
                    Some(ratio) => (
                        ratio / largest * BAR_AREA,
                        format!(
                            "{} {} ({ratio:.2}x)",
                            format_number(stats.median),
                            metric.spec.unit
                        ),
                    ),
                    None => (0.0, "no result".to_string()),
                };
                let _ = writeln!(
                    body,
                    r#"<rect x="{LABEL_WIDTH}" y="{}" width="{length:.1}" height="{}" fill="{colour}"/>"#,
                    y - ROW + 3.0,
                    ROW - 4.0
                );
                let _ = writeln!(
                    body,
                    r#"<text x="{:.1}" y="{}" font-size="11">{}</text>"#,
                    LABEL_WIDTH + length + 5.0,
                    y - 3.0,
                    escape(&label)
                );
            }
        }
        if !scenario.metrics.is_empty() {
            let one = LABEL_WIDTH + BAR_AREA / largest;
            let _ = writeln!(
                body,
                r##"<line x1="{one:.1}" y1="{section_top}" x2="{one:.1}" y2="{}" stroke="#555" stroke-dasharray="4 3"/>"##,
                y + 2.0
            );
        }
        y += 6.0;
    }
    let height = y + 20.0;
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{body}</svg>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        summarise, Better, CacheReport, HostInfo, MetricReport, MetricSpec, ScenarioReport,
    };

    fn report() -> Report {
        let subjects = vec!["ff<1>".to_string(), "local".to_string()];
        Report {
            started_unix_s: 0,
            command: "freeflow bench".into(),
            size: "tiny".into(),
            repeat: 1,
            host: HostInfo {
                hostname: "h".into(),
                kernel: "k".into(),
                cpus: 2,
                memory_bytes: 0,
            },
            caches: CacheReport {
                dropped: true,
                drops: 1,
                reason: None,
            },
            targets: vec![],
            scenarios: vec![ScenarioReport {
                name: "seq".into(),
                parameters: vec![],
                metrics: vec![MetricReport {
                    spec: MetricSpec::new("write_1M", "MB/s", Better::Higher),
                    results: summarise(&subjects, &[vec![100.0], vec![200.0]]),
                }],
                subjects,
                skipped: None,
                notes: vec![],
                failures: vec![],
                elapsed_ms: 1,
            }],
        }
    }

    #[test]
    fn bars_are_proportional_to_the_ratio_and_text_is_escaped() {
        let svg = render(&report());
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("ff&lt;1&gt;") && !svg.contains("ff<1>"));
        let widths: Vec<f64> = svg
            .match_indices("width=\"")
            .skip(2) // the document's and the background's
            .map(|(at, _)| {
                let rest = &svg[at + 7..];
                rest[..rest.find('"').expect("closing quote")]
                    .parse()
                    .expect("a width")
            })
            .collect();
        assert_eq!(widths.len(), 2);
        assert!((widths[1] / widths[0] - 2.0).abs() < 1e-6, "{widths:?}");
        assert!(svg.contains("200 MB/s (2.00x)"));
    }

    #[test]
    fn the_table_shows_medians_ranges_and_ratios() {
        let text = crate::table::render(&report());
        assert!(text.contains("== seq"), "{text}");
        assert!(text.contains("200 [200..200] 2.00x"), "{text}");
    }
}
