//! The one place that turns errors into exit statuses, and the logging set-up.

use freeflow_proto::ErrorCode;

/// Exit statuses (from sysexits.h, so scripts can tell kinds of failure apart).
pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_DATA: u8 = 65;
pub const EXIT_NO_INPUT: u8 = 66;
pub const EXIT_UNAVAILABLE: u8 = 69;
pub const EXIT_SOFTWARE: u8 = 70;
pub const EXIT_CANNOT_CREATE: u8 = 73;
pub const EXIT_IO: u8 = 74;
pub const EXIT_PERMISSION: u8 = 77;
pub const EXIT_CONFIG: u8 = 78;

/// An error about the configuration (a file, a flag, a key), as opposed to the cluster.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::error::Error for ConfigError {}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The error and its causes on one line. Libraries often repeat their cause in their own
/// message; a cause already spelled out is not printed again.
pub fn describe(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// A failed `freeflow exercise` or `exercise-names` run: the exerciser's report, with an exit status of its own (data error).
#[derive(Debug)]
pub struct ExerciseFailed(pub String);

impl std::error::Error for ExerciseFailed {}

impl std::fmt::Display for ExerciseFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `freeflow fsck` found problems it did not repair (exit status 65).
#[derive(Debug)]
pub struct FsckFound(pub String);

impl std::error::Error for FsckFound {}

impl std::fmt::Display for FsckFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The exit status for a failed command.
pub fn exit_status(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        if cause.downcast_ref::<ConfigError>().is_some() {
            return EXIT_CONFIG;
        }
        if cause.downcast_ref::<ExerciseFailed>().is_some()
            || cause.downcast_ref::<FsckFound>().is_some()
        {
            return EXIT_DATA;
        }
        if let Some(client) = cause.downcast_ref::<freeflow_client::ClientError>() {
            return status_for_code(client.code());
        }
        if let Some(rpc) = cause.downcast_ref::<freeflow_rpc::RpcError>() {
            return status_for_code(rpc.code());
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::NotFound => EXIT_NO_INPUT,
                std::io::ErrorKind::PermissionDenied => EXIT_PERMISSION,
                _ => EXIT_IO,
            };
        }
    }
    EXIT_FAILURE
}

fn status_for_code(code: ErrorCode) -> u8 {
    match code {
        ErrorCode::NotFound => EXIT_NO_INPUT,
        ErrorCode::Unreachable | ErrorCode::TimedOut => EXIT_UNAVAILABLE,
        ErrorCode::PermissionDenied | ErrorCode::NotPermitted => EXIT_PERMISSION,
        ErrorCode::Exists => EXIT_CANNOT_CREATE,
        ErrorCode::Io | ErrorCode::NoSpace => EXIT_IO,
        ErrorCode::Protocol => EXIT_DATA,
        _ => EXIT_FAILURE,
    }
}

/// Logs go to stderr; the level comes from `--log` or `RUST_LOG` (servers default to info,
/// tools to warn so that their output stays clean).
pub fn init_logging(arguments: &crate::args::Cli) {
    // openraft narrates every vote and replication step at info: its warnings are enough.
    let default = if arguments.command.is_server() {
        "info,openraft=warn"
    } else {
        "warn"
    };
    let filter = arguments
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| default.to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colours)
        .with_target(false)
        .init();
}
