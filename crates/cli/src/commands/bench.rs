//! `freeflow bench`: the command line into `freeflow_bench::RunOptions`, the run on a
//! blocking thread (the scenarios block on the runtime for the cluster scenarios), then the
//! table on stdout and the JSON and SVG files. A run with failed steps still writes its
//! report, then exits with an error naming how many failed.

use anyhow::Context;
use freeflow_bench::{table, RunOptions, SizePreset, Sizes, Target};

use crate::args::BenchArgs;

const MIB: u64 = 1 << 20;

/// The preset named by `--size`, with every knob given on the command line applied.
fn sizes(arguments: &BenchArgs) -> anyhow::Result<Sizes> {
    let mut sizes = Sizes::preset(SizePreset::parse(&arguments.size)?);
    let mib = |value: Option<u64>, field: &mut u64| {
        if let Some(value) = value {
            *field = value * MIB;
        }
    };
    mib(arguments.seq_mib, &mut sizes.seq_file_bytes);
    mib(arguments.chunk_mib, &mut sizes.chunk_file_bytes);
    mib(arguments.concurrent_mib, &mut sizes.concurrent_file_bytes);
    mib(arguments.random_mib, &mut sizes.random_file_bytes);
    mib(arguments.incast_mib, &mut sizes.incast_client_bytes);
    if let Some(budget) = arguments.incast_budget_mib {
        sizes.incast_budget_bytes = Some(budget * MIB);
    }
    mib(arguments.striping_mib, &mut sizes.striping_file_bytes);
    if let Some(writers) = arguments.writers {
        sizes.concurrent_writers = writers;
    }
    if let Some(duration_ms) = arguments.random_ms {
        sizes.random_duration_ms = duration_ms;
    }
    if let Some(threads) = &arguments.random_threads {
        sizes.random_threads = threads.clone();
    }
    if let Some(files) = arguments.metadata_files {
        sizes.metadata_files = files;
    }
    if let Some(workers) = &arguments.metadata_workers {
        sizes.metadata_workers = workers.clone();
    }
    if let Some(files) = &arguments.startup_files {
        sizes.startup_files = files.clone();
    }
    if let Some(clients) = arguments.incast_clients {
        sizes.incast_clients = clients;
    }
    if let Some(servers) = &arguments.striping_servers {
        sizes.striping_servers = servers.clone();
    }
    if let Some(rate) = arguments.striping_rate_mbit {
        sizes.striping_rate_mbit = rate;
    }
    Ok(sizes)
}

pub async fn run(arguments: BenchArgs) -> anyhow::Result<()> {
    let targets = arguments
        .targets
        .iter()
        .map(|text| Target::parse(text).map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<Vec<Target>>>()?;
    let options = RunOptions {
        targets,
        scenarios: arguments.scenarios.clone(),
        repeat: arguments.repeat,
        size_name: arguments.size.clone(),
        sizes: sizes(&arguments)?,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        freeflow_exe: std::env::current_exe().context("cannot find the freeflow binary")?,
        scratch_parent: arguments.scratch.clone(),
        progress: !arguments.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    let runtime = tokio::runtime::Handle::current();
    let report = tokio::task::spawn_blocking(move || freeflow_bench::run(options, runtime))
        .await
        .context("the bench thread failed")??;
    print!("{}", table::render(&report));
    if let Some(path) = &arguments.json {
        std::fs::write(path, freeflow_bench::json::to_pretty(&report.to_json()))
            .with_context(|| format!("cannot write the JSON report {}", path.display()))?;
        println!("\nreport saved to {}", path.display());
    }
    if let Some(path) = &arguments.plot {
        std::fs::write(path, freeflow_bench::plot::render(&report))
            .with_context(|| format!("cannot write the plot {}", path.display()))?;
        println!("plot saved to {}", path.display());
    }
    let failures = report.failures();
    if !failures.is_empty() {
        anyhow::bail!(
            "{} run(s) failed; the first: {} on {}: {}: {}",
            failures.len(),
            failures[0].0,
            failures[0].1.subject,
            failures[0].1.step,
            failures[0].1.message
        );
    }
    Ok(())
}
