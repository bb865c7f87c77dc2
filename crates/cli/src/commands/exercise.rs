//! `freeflow exercise PATH...`: the random-operation exerciser (`freeflow-exercise`) on a
//! file of a mount, of any local file system, or of the cluster through the library.

use std::path::PathBuf;

use anyhow::Context;
use freeflow_exercise::library::LibraryTarget;
use freeflow_exercise::posix::PosixTarget;
use freeflow_exercise::{Options, Target};

use crate::failure::ConfigError;
use crate::failure::ExerciseFailed;
use crate::paths::{endpoint, parse_size, Endpoint};

pub struct Arguments {
    pub paths: Vec<String>,
    pub operations: u64,
    pub seed: u64,
    pub size_max: String,
    pub length_max: String,
    pub mmap: bool,
    pub fallocate: bool,
    pub copy_range: bool,
    pub progress_every: u64,
    pub trace: bool,
}

fn size_flag(flag: &str, text: &str) -> anyhow::Result<u64> {
    match parse_size(text) {
        Some(bytes) if bytes > 0 => Ok(bytes),
        _ => Err(ConfigError(format!(
            "{flag} {text:?} is not a size like 65536, 64K or 1M"
        ))
        .into()),
    }
}

pub async fn run(cluster: Option<PathBuf>, arguments: Arguments) -> anyhow::Result<()> {
    let options = Options {
        operations: arguments.operations,
        seed: arguments.seed,
        size_max: size_flag("--size-max", &arguments.size_max)?,
        length_max: size_flag("--length-max", &arguments.length_max)?,
        mmap: arguments.mmap,
        fallocate: arguments.fallocate,
        copy_range: arguments.copy_range,
        trace: arguments.trace,
        ..Options::default()
    };
    if options.length_max > options.size_max {
        return Err(ConfigError("--length-max must not exceed --size-max".into()).into());
    }
    let endpoints: Vec<Endpoint> = arguments.paths.iter().map(|path| endpoint(path)).collect();
    // The library's clients, shut down at the end: a client that just exits leaves its
    // session and leases at the meta server until they run out, and every other client's
    // change in the same directory waits for them (10 s by default).
    let mut library_clients = Vec::new();
    let mut target: Box<dyn Target + Send> = match endpoints.as_slice() {
        [Endpoint::Cluster(first), rest @ ..] => {
            let mut clients = Vec::new();
            for other in rest {
                match other {
                    Endpoint::Cluster(path) if path == first => {}
                    _ => {
                        return Err(ConfigError(
                            "with ff:/path, every path must be the same ff:/path (one client each)"
                                .into(),
                        )
                        .into())
                    }
                }
            }
            for _ in 0..endpoints.len() {
                clients.push(crate::cluster_file::connect(cluster.clone()).await?);
            }
            library_clients.clone_from(&clients);
            let runtime = tokio::runtime::Handle::current();
            let path = first.clone();
            Box::new(
                tokio::task::spawn_blocking(move || LibraryTarget::open(clients, &path, runtime))
                    .await
                    .context("the open task failed")?
                    .with_context(|| format!("cannot open ff:{first}"))?,
            )
        }
        _ => {
            let mut paths = Vec::new();
            for endpoint in endpoints {
                match endpoint {
                    Endpoint::Local(path) => paths.push(path),
                    Endpoint::Cluster(_) => {
                        return Err(ConfigError(
                            "paths must be all ff:/path or all local (mounted) paths".into(),
                        )
                        .into())
                    }
                }
            }
            let first = paths[0].display().to_string();
            Box::new(PosixTarget::open(paths).with_context(|| format!("cannot open {first}"))?)
        }
    };
    let described = target.describe();
    println!(
        "exercising {described}: {} operations, seed {}, sizes up to {} bytes, lengths up to {}",
        options.operations, options.seed, options.size_max, options.length_max
    );
    let every = arguments.progress_every;
    let total = options.operations;
    let result = tokio::task::spawn_blocking(move || {
        let result = freeflow_exercise::run(target.as_mut(), &options, every, |done| {
            eprintln!("  {done} / {total} operations");
        });
        if let Err(error) = target.close() {
            eprintln!("closing the exercised file: {error}");
        }
        result
    })
    .await
    .context("the exerciser task failed")?;
    // The file was closed by the task.
    for client in library_clients {
        client.shutdown().await;
    }
    match result {
        Ok(report) => {
            println!("{report}");
            Ok(())
        }
        Err(failure) => Err(ExerciseFailed(failure.to_string()).into()),
    }
}
