//! The command line, declared with clap. Every subcommand and flag has help text.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// How a mount behaves: the same flags for `freeflow mount` and `freeflow up --mount`.
#[derive(Args, Clone, Debug)]
pub struct MountFlags {
    /// Let every user of this host use the mount (FUSE `allow_other`; the kernel still
    /// checks each user's permissions). The default when mounting as root; a user other
    /// than root needs `user_allow_other` in /etc/fuse.conf.
    #[arg(long, conflicts_with = "private")]
    pub allow_other: bool,
    /// Only the user who mounts may use the mount (the default for users other than root).
    #[arg(long)]
    pub private: bool,
    /// Make every close durable (fsync at close).
    #[arg(long)]
    pub sync_on_close: bool,
    /// How long a request to a server may take before the mount answers with an error.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub call_timeout_ms: u64,
    /// Let the kernel cache no name and attributes for 1 s only, instead of caching under
    /// the meta server's leases (revoked before another client's change returns).
    #[arg(long)]
    pub no_cache: bool,
    /// Let the kernel gather small writes in its page cache (FUSE writeback cache): much
    /// faster small writes, but the kernel owns the size of a file it holds open, so a
    /// descriptor kept open here while another client shortens the file keeps the old size
    /// until it is closed (docs/consistency.md, "Writeback mounts"). Not with --no-cache.
    #[arg(long, conflicts_with = "no_cache")]
    pub writeback: bool,
    /// Take the kernel's requests over io_uring rings, one per CPU (FUSE over io_uring,
    /// Linux 6.14+), or fail saying why. By default they are used where the kernel offers
    /// them (the mount turns the kernel's `fuse.enable_uring` on when run as root), and
    /// /dev/fuse is read otherwise.
    #[arg(long, conflicts_with = "no_io_uring")]
    pub io_uring: bool,
    /// Read the kernel's requests from /dev/fuse only, never over io_uring rings.
    #[arg(long)]
    pub no_io_uring: bool,
    /// Read every byte through the I/O servers' replies, never through descriptors of
    /// objects that servers on this host hand out (local reads; the default where the
    /// servers are on this host, as `freeflow up` runs them).
    #[arg(long)]
    pub no_local_reads: bool,
    /// Send every written byte through the I/O servers' sockets, never through memory
    /// shared with servers on this host (shared writes; the default where the servers are
    /// on this host).
    #[arg(long)]
    pub no_shared_writes: bool,
    /// Have the mount's client also read ahead of a sequential reader of a file, this many
    /// MiB from every I/O server at once, beyond the kernel's own read-ahead window (0, the
    /// default: the kernel's alone; with the servers on this host, whose disks read ahead
    /// of each object by themselves, it measured no faster and took more CPU).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=256))]
    pub readahead_mib: u64,
    /// Kernel channels (threads reading requests).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
}

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
        /// Copies of each stripe of new files (chain replication, 1 to 4, at most
        /// --io-servers); directories may set their own with `freeflow stripe set`.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4))]
        replicas: u32,
        /// Metadata servers: 1, or 3 or 5 running the namespace under Raft (a cluster of 3
        /// survives the loss of any one). The first listens on PORT, the others on PORT +
        /// 3, PORT + 4, ...; their Raft services on PORT + 74, PORT + 75, ...
        #[arg(long, default_value = "1", value_parser = ["1", "3", "5"])]
        meta_servers: String,
        /// Port of the metadata server; I/O server i listens on PORT + 10 + i. Metrics
        /// endpoints: the metadata server on PORT + 1 (others of a replicated cluster on
        /// PORT + 80 + i), the mount on PORT + 2, I/O server i on PORT + 100 + i.
        #[arg(long, default_value_t = 7700)]
        port: u16,
        /// Disk engine of the I/O servers.
        #[arg(long, default_value = "uring", value_parser = ["uring", "threads"])]
        engine: String,
        /// Which large aligned requests the I/O servers do with O_DIRECT, past their page
        /// cache: off, writes, or all (reads too) (`direct_io` in an I/O server's config).
        #[arg(long, default_value = "writes", value_parser = ["off", "writes", "all"])]
        direct_io: String,
        /// How clients and servers of this host reach the I/O servers: unix (a Unix socket
        /// in each I/O server's data directory, no TCP/IP on the data path) or tcp.
        #[arg(long, default_value = "unix", value_parser = ["unix", "tcp"])]
        transport: String,
        /// Also mount the cluster's file system on this directory (FUSE), unmounted at Ctrl-C.
        #[arg(long, value_name = "MOUNTPOINT")]
        mount: Option<PathBuf>,
        /// Serve no metrics endpoints (the counters are kept all the same).
        #[arg(long)]
        no_metrics: bool,
        #[command(flatten)]
        mount_flags: MountFlags,
    },
    /// Mount the cluster's file system on a directory with FUSE. Stays in the foreground
    /// until Ctrl-C, SIGTERM or an external `umount`, then unmounts.
    Mount {
        /// The cluster file (client.toml) written by `freeflow up` or `freeflow init`.
        #[arg(value_name = "CLUSTER")]
        cluster_file: PathBuf,
        /// An existing directory to mount on.
        mountpoint: PathBuf,
        #[command(flatten)]
        mount_flags: MountFlags,
        /// Serve the mount's metrics (Prometheus text, `GET /metrics`) on this `host:port`.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_address: Option<String>,
    },
    /// Write the cluster key and one config file per server for a multi-host deployment.
    Init {
        /// Directory to write cluster.key, meta.toml, io-N.toml and client.toml into.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Host (name or address) of the metadata server; three or five, comma separated,
        /// for a replicated metadata cluster under Raft (`meta-1.toml`...; members sharing
        /// a host get consecutive ports).
        #[arg(long, alias = "meta-hosts", value_delimiter = ',', required = true)]
        meta_host: Vec<String>,
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
        /// Copies of each stripe of new files (chain replication, 1 to 4; at most the
        /// number of I/O servers).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4))]
        replicas: u32,
    },
    /// Run a metadata server from a config file (`--config FILE`), or change the members of
    /// a replicated metadata cluster (`add`, `promote`, `remove`, `replace`).
    #[command(args_conflicts_with_subcommands = true)]
    Meta {
        /// The metadata server's config file (meta.toml, meta-N.toml).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(subcommand)]
        change: Option<MetaCommand>,
    },
    /// Change an I/O server's place in the cluster: move every stripe off it (`drain`),
    /// then take it out (`remove`).
    Server {
        #[command(subcommand)]
        change: ServerCommand,
    },
    /// Run an I/O server from a config file.
    Io {
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Show the cluster's servers (up or down), capacity and file count.
    Status,
    /// Check that the I/O servers' objects agree with the namespace: objects with no
    /// inode, outside their file's layout, or longer than the file's size. Exit status 65
    /// when problems are left (or a server could not be checked).
    Fsck {
        /// Fix what is safe: remove objects no file owns, cut objects to their file's size.
        #[arg(long)]
        repair: bool,
        /// Leave alone objects written this recently (a create answered ahead may still be
        /// on its way to the meta server).
        #[arg(long, default_value_t = 60_000)]
        grace_ms: u64,
        /// No progress bar.
        #[arg(short, long)]
        quiet: bool,
    },
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
    /// Run the seeds' workloads side by side on several directories (the Freeflow mount,
    /// the local disk, peer file systems), interleaved; print a table, save JSON and SVG.
    Bench(Box<BenchArgs>),
    /// Change one file by a seeded random mix of reads, writes, mapped I/O, truncations,
    /// fallocate, copy_file_range, fsync and reopens, checking every read against a model
    /// (an fsx-style exerciser). PATH is a file on any mounted file system, or `ff:/path`
    /// to go through the client library; give two paths of one cluster (two mounts, or
    /// `ff:` twice for two clients) to alternate between them with a close and an open.
    Exercise {
        /// The file (created if missing, truncated at the start); a second path is the same
        /// file seen elsewhere.
        #[arg(required = true, num_args = 1..=4, value_name = "PATH")]
        paths: Vec<String>,
        /// Operations to run.
        #[arg(long, default_value_t = 10_000)]
        ops: u64,
        /// Seed of the run: the same seed runs the same operations.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Largest file size aimed at, in bytes (suffixes K and M allowed).
        #[arg(long, default_value = "1M")]
        size_max: String,
        /// Longest read, write or copy, in bytes (suffixes K and M allowed).
        #[arg(long, default_value = "128K")]
        length_max: String,
        /// No mapped reads and writes.
        #[arg(long)]
        no_mmap: bool,
        /// No fallocate.
        #[arg(long)]
        no_fallocate: bool,
        /// No copy_file_range.
        #[arg(long)]
        no_copy_range: bool,
        /// Print progress every N operations (0: never).
        #[arg(long, default_value_t = 10_000)]
        progress: u64,
        /// Print every operation as it is run.
        #[arg(long)]
        trace: bool,
    },
    /// Change a directory tree by a seeded random mix of every namespace call (create,
    /// mkdir, rmdir, unlink, link, symlink, mknod, rename and renameat2 with
    /// RENAME_NOREPLACE, RENAME_EXCHANGE and RENAME_WHITEOUT, chmod, chown, utimensat, xattrs,
    /// truncate, small writes), one worker per PATH, checking every call's result against a
    /// model of the tree and walking the whole tree on every PATH after each batch. Each PATH
    /// is a directory showing the same tree: mounts of one cluster, the same local directory
    /// given again, or `ff:/dir` through the client library (a client each). The tree under
    /// PATH is removed first.
    ExerciseNames {
        /// The directories, one worker each.
        #[arg(required = true, num_args = 1..=16, value_name = "PATH")]
        paths: Vec<String>,
        /// Operations of all workers together.
        #[arg(long, default_value_t = 10_000)]
        ops: u64,
        /// Seed of the run: the same seed with one worker runs the same operations.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Operations of all workers together between two walks of the whole tree.
        #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
        /// Workers run at once without the model's lock: each call is checked only for an
        /// errno it can give, and the walks of all paths must agree after each batch.
        #[arg(long)]
        concurrent: bool,
        /// On a failure in serial mode, replay the operations on the first PATH with parts
        /// left out, at most this many times, and print the shortest list that still fails.
        #[arg(long, default_value_t = 0)]
        shrink: usize,
        /// Leave the tree in place at the end instead of removing it.
        #[arg(long)]
        keep: bool,
        /// Print every operation and its result as it is run.
        #[arg(long)]
        trace: bool,
    },
    /// A live panel of the cluster's servers from their metrics endpoints: MB/s, IOPS,
    /// queue depth and latency per I/O server, the meta server's ops/s. `q` quits.
    Top {
        /// Print one snapshot (two scrapes one interval apart) and exit.
        #[arg(long)]
        once: bool,
        /// Print JSON (one object per interval) instead of the panel.
        #[arg(long)]
        json: bool,
        /// Time between scrapes.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
        interval_ms: u64,
    },
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
        /// Copies of each stripe of new files (chain replication; at most the number of
        /// I/O servers).
        #[arg(long)]
        replicas: Option<u32>,
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

/// `freeflow bench` options (docs/BENCHMARKS.md).
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// A directory to run on, as NAME:PATH; repeat for several. The first is the reference
    /// of every ratio. Default: local:<a fresh directory under --scratch>.
    #[arg(long = "target", value_name = "NAME:PATH")]
    pub targets: Vec<String>,
    /// A scenario to run; repeat for several (default: all). One of seq, chunk,
    /// concurrent-writers, random, metadata, startup, incast, striping.
    #[arg(long = "scenario", value_name = "S")]
    pub scenarios: Vec<String>,
    /// Runs of each scenario on each target, interleaved (A B A B ...).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Save the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Draw the report as an SVG bar chart to this file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Preset of every size below; `tiny` is the smoke test, `default` takes minutes.
    #[arg(long, default_value = "default", value_parser = ["tiny", "small", "default", "large"])]
    pub size: String,
    /// Where scratch data (clusters the bench starts, the default target) goes; must be
    /// on the local disk.
    #[arg(long, default_value = "/var/tmp", value_name = "DIR")]
    pub scratch: PathBuf,
    /// No progress display.
    #[arg(short, long)]
    pub quiet: bool,
    /// seq: MiB of the file written and read at each block size.
    #[arg(long, value_name = "MIB")]
    pub seq_mib: Option<u64>,
    /// chunk: MiB of the one large file.
    #[arg(long, value_name = "MIB")]
    pub chunk_mib: Option<u64>,
    /// concurrent-writers: MiB of the shared file.
    #[arg(long, value_name = "MIB")]
    pub concurrent_mib: Option<u64>,
    /// concurrent-writers: number of writers (at least 2).
    #[arg(long, value_name = "N")]
    pub writers: Option<u32>,
    /// random: MiB of the file.
    #[arg(long, value_name = "MIB")]
    pub random_mib: Option<u64>,
    /// random: milliseconds of each phase.
    #[arg(long, value_name = "MS")]
    pub random_ms: Option<u64>,
    /// random: thread counts, comma separated.
    #[arg(long, value_delimiter = ',', value_name = "N,N")]
    pub random_threads: Option<Vec<u32>>,
    /// metadata: files per phase.
    #[arg(long, value_name = "N")]
    pub metadata_files: Option<u64>,
    /// metadata: worker counts, comma separated.
    #[arg(long, value_delimiter = ',', value_name = "N,N")]
    pub metadata_workers: Option<Vec<u32>>,
    /// startup: file counts, comma separated.
    #[arg(long, value_delimiter = ',', value_name = "N,N")]
    pub startup_files: Option<Vec<u64>>,
    /// incast: clients writing at once.
    #[arg(long, value_name = "N")]
    pub incast_clients: Option<u32>,
    /// incast: MiB each client writes.
    #[arg(long, value_name = "MIB")]
    pub incast_mib: Option<u64>,
    /// incast: the I/O server's memory budget in MiB, the whole process (default: its own, 768).
    #[arg(long, value_name = "MIB")]
    pub incast_budget_mib: Option<u64>,
    /// striping: I/O server counts, comma separated.
    #[arg(long, value_delimiter = ',', value_name = "N,N")]
    pub striping_servers: Option<Vec<u32>>,
    /// striping: MiB of the file.
    #[arg(long, value_name = "MIB")]
    pub striping_mib: Option<u64>,
    /// striping: rate of each server's link in Mbit/s.
    #[arg(long, value_name = "MBIT")]
    pub striping_rate_mbit: Option<u32>,
}

/// `freeflow server ...`: an I/O server leaving the cluster. A new server needs no command:
/// started with a new `server_id`, it registers and new files are placed on it at once.
#[derive(Subcommand, Debug)]
pub enum ServerCommand {
    /// Move every stripe off the server while clients go on (new files go elsewhere);
    /// `freeflow status` shows the progress.
    Drain {
        id: u32,
        /// Wait until the drain is complete, showing its progress.
        #[arg(long)]
        wait: bool,
    },
    /// Take a drained server out of the cluster for good (it can be stopped then; its id
    /// is never used again).
    Remove {
        id: u32,
        /// Remove a server lost for good that was never drained: its stripes with one
        /// copy are lost with it.
        #[arg(long)]
        force: bool,
    },
}

/// `freeflow meta ...`: changes of a replicated metadata cluster's members, made by its leader
/// through Raft membership changes. A new member is started first (its config with `join =
/// true` and a node_id never used), then added: it catches up as a learner, then votes.
#[derive(Subcommand, Debug)]
pub enum MetaCommand {
    /// Add a member: as a learner, then, once it caught up, as a voter.
    Add {
        /// Its node id (never used before in this cluster).
        id: u64,
        /// Where clients reach it (its `listen_address`).
        #[arg(long, value_name = "HOST:PORT")]
        address: String,
        /// Where the other members reach its Raft service.
        #[arg(long, value_name = "HOST:PORT")]
        raft_address: String,
        /// Leave it a learner (no vote): `freeflow meta promote ID` later.
        #[arg(long)]
        learner: bool,
        /// How long to wait for it to catch up before it votes.
        #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
        wait: u64,
    },
    /// Make a learner a voter, once it caught up.
    Promote {
        id: u64,
        #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
        wait: u64,
    },
    /// Take a member out of the cluster (it can be stopped then).
    Remove { id: u64 },
    /// Give the vote of member OLD (lost, or to be retired) to member NEW in one change:
    /// NEW is added as a learner if it is not a member yet (give its addresses), catches
    /// up, then takes OLD's place.
    Replace {
        old: u64,
        new: u64,
        #[arg(long, value_name = "HOST:PORT", requires = "raft_address")]
        address: Option<String>,
        #[arg(long, value_name = "HOST:PORT", requires = "address")]
        raft_address: Option<String>,
        #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
        wait: u64,
    },
}
