//! `freeflow mount CLUSTER MOUNTPOINT` (and `freeflow up --mount`): the FUSE mount of a
//! cluster, served in this process until Ctrl-C, SIGTERM or an external unmount.
//!
//! The mount's client uses a shorter call timeout than the tools (10 s by default): a mount
//! whose servers are gone answers system calls with an error in that time instead of
//! hanging them, and works again when the servers return.

use std::path::Path;

use anyhow::Context;
use freeflow_fuse::{MountHandle, MountOptions, Transport};

use crate::cluster_file::{self, ClientFile};

/// The mount command's options.
#[derive(Clone, Debug)]
pub struct Options {
    pub allow_other: bool,
    pub sync_on_close: bool,
    pub call_timeout_ms: u64,
    pub threads: u32,
    /// Cache under leases (false: `--no-cache`).
    pub cache_leases: bool,
    /// The kernel's writeback cache (`--writeback`).
    pub writeback: bool,
    /// How requests reach the mount (`--io-uring`, `--no-io-uring`).
    pub transport: Transport,
    /// Local reads from I/O servers on this host (false: `--no-local-reads`).
    pub local_reads: bool,
    /// Shared writes to I/O servers on this host (false: `--no-shared-writes`).
    pub shared_writes: bool,
    /// The library's read-ahead per handle, in bytes (`--readahead-mib`).
    pub readahead_bytes: u64,
    /// Serve the client's metrics on this `host:port` (None: no endpoint).
    pub metrics_address: Option<String>,
}

impl Options {
    /// The options the command-line flags ask for. `allow_other` is on when mounting as
    /// root unless `--private` (a cluster file system is for every user of a host; the
    /// kernel's `default_permissions` still checks each one).
    pub fn from_flags(flags: &crate::args::MountFlags, metrics_address: Option<String>) -> Options {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        Options {
            allow_other: flags.allow_other || (root && !flags.private),
            sync_on_close: flags.sync_on_close,
            call_timeout_ms: flags.call_timeout_ms,
            threads: flags.threads,
            cache_leases: !flags.no_cache,
            writeback: flags.writeback,
            transport: if flags.io_uring {
                Transport::IoUring
            } else if flags.no_io_uring {
                Transport::DevFuse
            } else {
                Transport::Auto
            },
            local_reads: !flags.no_local_reads,
            shared_writes: !flags.no_shared_writes,
            readahead_bytes: flags.readahead_mib << 20,
            metrics_address,
        }
    }
}

impl Default for Options {
    fn default() -> Options {
        Options {
            allow_other: false,
            sync_on_close: false,
            call_timeout_ms: 10_000,
            threads: 4,
            cache_leases: true,
            writeback: false,
            transport: Transport::Auto,
            local_reads: true,
            shared_writes: true,
            readahead_bytes: 0,
            metrics_address: None,
        }
    }
}

/// A mount and the client it serves from.
pub struct Mounted {
    handle: MountHandle,
    client: freeflow_client::Client,
    metrics_task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    metrics_address: Option<std::net::SocketAddr>,
}

impl Mounted {
    /// Where the mount's metrics are served, if they are.
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.metrics_address
    }

    /// Unmount, then close the client's session.
    pub async fn unmount(self) -> anyhow::Result<()> {
        if let Some(task) = &self.metrics_task {
            task.abort();
        }
        let mountpoint = self.handle.mountpoint().to_owned();
        let result = self
            .handle
            .unmount()
            .await
            .with_context(|| format!("unmounting {}", mountpoint.display()));
        self.client.shutdown().await;
        result
    }
}

pub async fn run(cluster_file: &Path, mountpoint: &Path, options: Options) -> anyhow::Result<()> {
    let mounted = mount_cluster(cluster_file, mountpoint, options).await?;
    println!(
        "mounted {} on {}; Ctrl-C to unmount",
        cluster_file.display(),
        mounted.handle.mountpoint().display()
    );
    if let Some(address) = mounted.metrics_address() {
        println!("mount metrics at http://{address}/metrics");
    }
    tokio::select! {
        result = super::shutdown_signal() => result?,
        () = mounted.handle.serving_ended() => println!("unmounted from outside"),
    }
    mounted.unmount().await
}

/// Connect to the cluster of `cluster_file` and mount it on `mountpoint`.
pub async fn mount_cluster(
    cluster_file: &Path,
    mountpoint: &Path,
    options: Options,
) -> anyhow::Result<Mounted> {
    let client = connect(cluster_file, &options).await?;
    let metrics_listener = match &options.metrics_address {
        Some(address) => match tokio::net::TcpListener::bind(address).await {
            Ok(listener) => Some(listener),
            Err(error) => {
                client.shutdown().await;
                return Err(error)
                    .with_context(|| format!("cannot serve mount metrics on {address}"));
            }
        },
        None => None,
    };
    let mount_options = MountOptions {
        allow_other: options.allow_other,
        sync_on_close: options.sync_on_close,
        threads: options.threads as usize,
        cache_leases: options.cache_leases,
        writeback: options.writeback,
        transport: options.transport,
        // Without leases, attributes are kept a second (with them, a reply without a
        // lease is not kept at all).
        attr_timeout_ms: if options.cache_leases { 0 } else { 1_000 },
        ..MountOptions::default()
    };
    let mount_client = client.clone();
    let mountpoint_owned = mountpoint.to_owned();
    // Mounting blocks (the mount call, then the kernel's INIT): off the async threads.
    let handle = tokio::task::spawn_blocking(move || {
        freeflow_fuse::mount(mount_client, &mountpoint_owned, mount_options)
    })
    .await
    .context("the mount task failed")?;
    match handle {
        Ok(handle) => {
            let metrics_address = metrics_listener
                .as_ref()
                .and_then(|listener| listener.local_addr().ok());
            let metrics_task = metrics_listener.map(|listener| {
                tokio::spawn(freeflow_metrics::serve_http(
                    listener,
                    std::sync::Arc::clone(client.metrics()),
                ))
            });
            Ok(Mounted {
                handle,
                client,
                metrics_task,
                metrics_address,
            })
        }
        Err(error) => {
            client.shutdown().await;
            Err(error).with_context(|| format!("cannot mount {}", mountpoint.display()))
        }
    }
}

/// Like `cluster_file::connect`, with the mount's own call timeout (the shorter of the
/// file's and `call_timeout_ms`).
async fn connect(
    cluster_file: &Path,
    options: &Options,
) -> anyhow::Result<freeflow_client::Client> {
    let file: ClientFile = cluster_file::read(cluster_file)?;
    let key = cluster_file::load_key(cluster_file, &file.key_file)?;
    let mut config = freeflow_client::ClientConfig::new(file.meta_address.clone(), key);
    config.call_timeout_ms = file.call_timeout_ms.min(options.call_timeout_ms);
    config.client_name = format!("freeflow-mount-{}", std::process::id());
    // The kernel reads ahead for the mount (a window's reads at once, in any order); the
    // library's read-ahead beyond it only with `--readahead-mib`.
    config.readahead_bytes = options.readahead_bytes;
    config.local_reads = options.local_reads;
    config.shared_writes = options.shared_writes;
    freeflow_client::Client::connect(config)
        .await
        .with_context(|| {
            format!(
                "cannot reach the cluster of {} (metadata server {})",
                cluster_file.display(),
                file.meta_address
            )
        })
}
