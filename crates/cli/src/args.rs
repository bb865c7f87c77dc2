//! The command line, declared with clap. Every subcommand and flag has help text.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "freeflow",
    version,
    about = "Freeflow: a parallel cluster file system",
    propagate_version = true
)]
pub struct Cli {
    /// Log filter (e.g. `info`, `debug`, `freeflow_meta=debug`); overrides RUST_LOG.
    #[arg(long, global = true)]
    pub log: Option<String>,

    /// The cluster to talk to: a client.toml written by `freeflow up` or `freeflow init`
    /// (default: $FREEFLOW_CLUSTER, else ./freeflow-data/client.toml).
    #[arg(long, global = true, value_name = "FILE")]
    pub cluster: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start a metadata server and N I/O servers on loopback in this process, with data
    /// kept under DIR (reused on the next start). Stays in the foreground until Ctrl-C.
    Up {
        /// Where the cluster keeps its data, key and configs.
        #[arg(long, default_value = "./freeflow-data", value_name = "DIR")]
        data: PathBuf,
        /// How many I/O servers to start.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
        io_servers: u32,
        /// Port of the metadata server; I/O server i listens on PORT + 10 + i.
        #[arg(long, default_value_t = 7700)]
        port: u16,
        /// Disk engine of the I/O servers.
        #[arg(long, default_value = "uring", value_parser = ["uring", "threads"])]
        engine: String,
        /// Also mount the cluster's file system on this directory (FUSE), unmounted at Ctrl-C.
        #[arg(long, value_name = "MOUNTPOINT")]
        mount: Option<PathBuf>,
    },
    /// Mount the cluster's file system on a directory with FUSE. Stays in the foreground
    /// until Ctrl-C, SIGTERM or an external `umount`, then unmounts.
    Mount {
        /// The cluster file (client.toml) written by `freeflow up` or `freeflow init`.
        #[arg(value_name = "CLUSTER")]
        cluster_file: PathBuf,
        /// An existing directory to mount on.
        mountpoint: PathBuf,
        /// Let users other than the one mounting use the mount.
        #[arg(long)]
        allow_other: bool,
        /// Make every close durable (fsync at close).
        #[arg(long)]
        sync_on_close: bool,
        /// How long a request to a server may take before the mount answers with an error.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        call_timeout_ms: u64,
        /// Kernel channels (threads reading requests).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
        threads: u32,
    },
    /// Write the cluster key and one config file per server for a multi-host deployment.
    Init {
        /// Directory to write cluster.key, meta.toml, io-N.toml and client.toml into.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Host (name or address) of the metadata server.
        #[arg(long)]
        meta_host: String,
        /// Hosts of the I/O servers, comma separated, one server each (repeat a host for
        /// several servers on it).
        #[arg(long, value_delimiter = ',', required = true)]
        io_hosts: Vec<String>,
        /// Where the key file will be on every host.
        #[arg(long, default_value = "/etc/freeflow/cluster.key")]
        key_path: PathBuf,
        /// Where server data will live on every host (a subdirectory per server).
        #[arg(long, default_value = "/var/lib/freeflow")]
        data_root: PathBuf,
    },
    /// Run a metadata server from a config file.
    Meta {
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Run an I/O server from a config file.
    Io {
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Show the cluster's servers (up or down), capacity and file count.
    Status,
    /// List a directory (`ff:/path` or `/path`).
    Ls {
        /// Long listing: kind, mode, links, size, inode.
        #[arg(short, long)]
        long: bool,
        #[arg(default_value = "/")]
        path: String,
    },
    /// Show a file's attributes.
    Stat { path: String },
    /// Create a directory.
    Mkdir {
        /// Create missing parents; no error if it exists.
        #[arg(short, long)]
        parents: bool,
        path: String,
    },
    /// Remove a file or an empty directory.
    Rm {
        /// Remove directories and their contents.
        #[arg(short, long)]
        recursive: bool,
        path: String,
    },
    /// Rename or move a file or directory.
    Mv { source: String, target: String },
    /// Write a file's contents to standard output.
    Cat { path: String },
    /// Copy between local paths and `ff:/path` in either direction, with a progress bar.
    Cp {
        source: String,
        target: String,
        /// fsync the target before reporting success.
        #[arg(long)]
        sync: bool,
        /// No progress bar.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Show or change striping.
    #[command(subcommand)]
    Stripe(StripeCommand),
}

#[derive(Subcommand, Debug)]
pub enum StripeCommand {
    /// Show a file's layout and which servers hold which stripes (or a directory's policy).
    Get { path: String },
    /// Set the layout that new files in a directory inherit.
    Set {
        path: String,
        /// Stripe unit in bytes (a power of two, 4096 to 8 MiB); suffixes K and M allowed.
        #[arg(long)]
        unit: Option<String>,
        /// Number of I/O servers each new file is striped over.
        #[arg(long)]
        count: Option<u32>,
    },
}

impl Command {
    pub fn is_server(&self) -> bool {
        matches!(
            self,
            Command::Up { .. } | Command::Meta { .. } | Command::Io { .. } | Command::Mount { .. }
        )
    }
}
