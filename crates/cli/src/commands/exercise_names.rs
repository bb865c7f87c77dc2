//! `freeflow exercise-names PATH...`: the namespace exerciser (`freeflow_exercise::names`),
//! one worker per path: directories of mounts, of any local file system, or of the cluster
//! through the library (`ff:/dir`, a client each).

use std::path::PathBuf;

use anyhow::Context;
use freeflow_exercise::names::library::LibraryTarget;
use freeflow_exercise::names::posix::PosixTarget;
use freeflow_exercise::names::shrink::reproduction;
use freeflow_exercise::names::{self, NamesOptions, NamesTarget};

use crate::failure::ExerciseFailed;
use crate::paths::{endpoint, Endpoint};

pub struct Arguments {
    pub paths: Vec<String>,
    pub operations: u64,
    pub seed: u64,
    pub batch_operations: u64,
    pub concurrent: bool,
    /// Replays a shrink may make (0: no shrink).
    pub shrink_replays_max: usize,
    pub keep: bool,
    pub trace: bool,
}

/// The target of one path (blocking: call off the runtime's threads).
fn target_of(
    endpoint: &Endpoint,
    client: Option<freeflow_client::Client>,
    runtime: tokio::runtime::Handle,
) -> anyhow::Result<Box<dyn NamesTarget + Send>> {
    Ok(match (endpoint, client) {
        (Endpoint::Local(path), _) => Box::new(
            PosixTarget::new(path.clone())
                .with_context(|| format!("cannot use {}", path.display()))?,
        ),
        (Endpoint::Cluster(path), Some(client)) => Box::new(
            LibraryTarget::new(client, path, runtime)
                .with_context(|| format!("cannot use ff:{path}"))?,
        ),
        (Endpoint::Cluster(path), None) => anyhow::bail!("no client for ff:{path}"),
    })
}

pub async fn run(cluster: Option<PathBuf>, arguments: Arguments) -> anyhow::Result<()> {
    let options = NamesOptions {
        seed: arguments.seed,
        operations: arguments.operations,
        batch_operations: arguments.batch_operations,
        concurrent: arguments.concurrent,
        remove_at_end: !arguments.keep,
        trace: arguments.trace,
        ..NamesOptions::default()
    };
    let endpoints: Vec<Endpoint> = arguments.paths.iter().map(|path| endpoint(path)).collect();
    // One client per ff: path, shut down at the end (a client that just exits leaves its
    // session and leases at the meta server until they run out).
    let mut clients = Vec::new();
    for endpoint in &endpoints {
        clients.push(match endpoint {
            Endpoint::Cluster(_) => Some(crate::cluster_file::connect(cluster.clone()).await?),
            Endpoint::Local(_) => None,
        });
    }
    let library_clients: Vec<freeflow_client::Client> = clients.iter().flatten().cloned().collect();
    let runtime = tokio::runtime::Handle::current();
    println!(
        "exercising the namespace under {}: {} operations, seed {}, {} worker(s), batches of {}{}",
        arguments.paths.join(", "),
        options.operations,
        options.seed,
        endpoints.len(),
        options.batch_operations,
        if options.concurrent {
            ", concurrent"
        } else {
            ""
        }
    );
    let shrink_replays_max = arguments.shrink_replays_max;
    let first_client = clients.first().cloned().flatten();
    let result = tokio::task::spawn_blocking(move || -> anyhow::Result<Result<String, String>> {
        let mut targets = Vec::new();
        for (endpoint, client) in endpoints.iter().zip(clients) {
            targets.push(target_of(endpoint, client, runtime.clone())?);
        }
        let failure = match names::run(targets, &options) {
            Ok(report) => return Ok(Ok(report.to_string())),
            Err(failure) => failure,
        };
        let mut text = failure.to_string();
        if shrink_replays_max > 0 && !failure.recorded.is_empty() {
            let mut make_target = || {
                target_of(&endpoints[0], first_client.clone(), runtime.clone())
                    .map_err(std::io::Error::other)
            };
            match names::shrink(
                &mut make_target,
                &failure.recorded,
                &options,
                shrink_replays_max,
            ) {
                Some(short) => text.push_str(&format!(
                    "\nshrunk from {} to {} operations (one worker on {}):\n{}",
                    failure.recorded.len(),
                    short.len(),
                    arguments.paths[0],
                    reproduction(&short)
                )),
                None => text.push_str(&format!(
                    "\nthe {} operations run by one worker on {} do not fail: the failure needs \
                     several paths or their interleaving",
                    failure.recorded.len(),
                    arguments.paths[0]
                )),
            }
        }
        Ok(Err(text))
    })
    .await
    .context("the exerciser task failed")?;
    for client in library_clients {
        client.shutdown().await;
    }
    match result? {
        Ok(report) => {
            println!("{report}");
            Ok(())
        }
        Err(text) => Err(ExerciseFailed(text).into()),
    }
}
