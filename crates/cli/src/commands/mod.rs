//! One module per group of subcommands; `run` dispatches.

mod bench;
mod copy;
mod exercise;
mod exercise_names;
mod fsck;
mod init;
mod io_members;
mod members;
mod mount;
mod namespace;
mod servers;
mod status;
mod stripe;
mod top;
mod up;

use crate::args::{Cli, Command, StripeCommand};

pub async fn run(arguments: Cli) -> anyhow::Result<()> {
    let cluster = arguments.cluster;
    match arguments.command {
        Command::Up {
            data,
            io_servers,
            replicas,
            meta_servers,
            port,
            engine,
            direct_io,
            transport,
            mount,
            no_metrics,
            mount_flags,
        } => {
            let options = up::Options {
                data,
                io_server_count: io_servers,
                replicas,
                meta_server_count: meta_servers.parse().unwrap_or(1),
                port,
                engine,
                direct_io,
                unix_sockets: transport == "unix",
                mountpoint: mount,
                mount_options: mount::Options::from_flags(&mount_flags, None),
                metrics: !no_metrics,
            };
            up::run(options).await
        }
        Command::Mount {
            cluster_file,
            mountpoint,
            mount_flags,
            metrics_address,
        } => {
            let options = mount::Options::from_flags(&mount_flags, metrics_address);
            mount::run(&cluster_file, &mountpoint, options).await
        }
        Command::Init {
            out,
            meta_host,
            io_hosts,
            key_path,
            data_root,
            replicas,
        } => init::run(&out, &meta_host, &io_hosts, &key_path, &data_root, replicas),
        Command::Meta {
            config: Some(config),
            change: None,
        } => servers::run_meta(&config).await,
        Command::Meta {
            change: Some(change),
            ..
        } => members::run(cluster, change).await,
        Command::Meta {
            config: None,
            change: None,
        } => Err(crate::failure::ConfigError(
            "freeflow meta: give --config FILE to run a metadata server, or a change \
             (add, promote, remove, replace)"
                .to_string(),
        )
        .into()),
        Command::Io { config } => servers::run_io(&config).await,
        Command::Server { change } => io_members::run(cluster, change).await,
        Command::Status => status::run(cluster).await,
        Command::Fsck {
            repair,
            grace_ms,
            quiet,
        } => {
            let options = fsck::Options {
                repair,
                grace_ms,
                quiet,
            };
            fsck::run(cluster, options).await
        }
        Command::Ls { long, path } => namespace::ls(cluster, &path, long).await,
        Command::Stat { path } => namespace::stat(cluster, &path).await,
        Command::Mkdir { parents, path } => namespace::mkdir(cluster, &path, parents).await,
        Command::Rm { recursive, path } => namespace::rm(cluster, &path, recursive).await,
        Command::Mv { source, target } => namespace::mv(cluster, &source, &target).await,
        Command::Cat { path } => namespace::cat(cluster, &path).await,
        Command::Cp {
            source,
            target,
            sync,
            quiet,
        } => copy::run(cluster, &source, &target, sync, quiet).await,
        Command::Bench(arguments) => bench::run(*arguments).await,
        Command::Exercise {
            paths,
            ops,
            seed,
            size_max,
            length_max,
            no_mmap,
            no_fallocate,
            no_copy_range,
            progress,
            trace,
        } => {
            let options = exercise::Arguments {
                trace,
                paths,
                operations: ops,
                seed,
                size_max,
                length_max,
                mmap: !no_mmap,
                fallocate: !no_fallocate,
                copy_range: !no_copy_range,
                progress_every: progress,
            };
            exercise::run(cluster, options).await
        }
        Command::Stripe(StripeCommand::Get { path }) => stripe::get(cluster, &path).await,
        Command::Stripe(StripeCommand::Set {
            path,
            unit,
            count,
            replicas,
        }) => stripe::set(cluster, &path, unit, count, replicas).await,
        Command::ExerciseNames {
            paths,
            ops,
            seed,
            batch,
            concurrent,
            shrink,
            keep,
            trace,
        } => {
            let arguments = exercise_names::Arguments {
                paths,
                operations: ops,
                seed,
                batch_operations: batch,
                concurrent,
                shrink_replays_max: shrink,
                keep,
                trace,
            };
            exercise_names::run(cluster, arguments).await
        }
        Command::Top {
            once,
            json,
            interval_ms,
        } => {
            let options = top::Options {
                once,
                json,
                interval_ms,
            };
            top::run(cluster, options).await
        }
    }
}

/// Wait for Ctrl-C or SIGTERM.
pub async fn shutdown_signal() -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = terminate.recv() => {}
    }
    Ok(())
}
