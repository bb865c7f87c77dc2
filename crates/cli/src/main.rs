//! The `freeflow` binary: a thin composition root. Parse the command line, load and check
//! the configuration it names, build the parts, run. Each role is a subcommand.

mod args;
mod cluster_file;
mod commands;
mod failure;
mod paths;

use clap::Parser;

/// Every server runs in this binary for weeks, allocating and freeing from many threads
/// (the store's page cache is filled from Tokio's blocking pool, whose threads come and
/// go). glibc's malloc gives threads arenas of their own and keeps what is freed in each:
/// a metadata member whose live heap stayed near 315 MB (heaptrack) was 1.0 GB resident at
/// 2.4 million files and 2.2 GB at 10 million (issue 42). jemalloc hands freed pages back
/// to the kernel from a background thread.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its first allocation (`_RJEM_MALLOC_CONF` in the
/// environment overrides them): pages freed for a second go back to the kernel.
#[cfg(feature = "jemalloc")]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static _rjem_malloc_conf: &[u8; 37] = b"dirty_decay_ms:1000,muzzy_decay_ms:0\0";

fn main() -> std::process::ExitCode {
    let arguments = args::Cli::parse();
    failure::init_logging(&arguments);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("freeflow: cannot start the async runtime: {error}");
            return std::process::ExitCode::from(failure::EXIT_SOFTWARE);
        }
    };
    let outcome = runtime.block_on(commands::run(arguments));
    // Do not wait for detached tasks (server loops, heartbeats) at exit.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("freeflow: {}", failure::describe(&error));
            std::process::ExitCode::from(failure::exit_status(&error))
        }
    }
}
