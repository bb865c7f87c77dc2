//! The `freeflow` binary: a thin composition root. Parse the command line, load and check
//! the configuration it names, build the parts, run. Each role is a subcommand.

mod args;
mod cluster_file;
mod commands;
mod failure;
mod paths;

use clap::Parser;

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
