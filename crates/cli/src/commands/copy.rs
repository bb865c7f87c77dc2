//! `freeflow cp`: copies between local files and the cluster in either direction.
//!
//! Both directions are pipelined. Into the cluster, a reader thread fills chunks from the
//! local file while earlier chunks are on the wire (the client's `write_at` returns once a
//! chunk is in flight, bounded by its dirty-bytes limit). Out of the cluster, several chunk
//! reads are in flight at once while a writer thread drains finished chunks to the local
//! file in order. A chunk is a whole number of stripe rows, so each one keeps every server
//! of the file busy.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use bytes::Bytes;
use freeflow_client::{Client, FileHandle, OpenOptions};
use freeflow_types::FileKind;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cluster_file;
use crate::paths::{endpoint, Endpoint};

/// Chunks in flight for reads out of the cluster, and chunks buffered ahead for writes.
const CHUNKS_IN_FLIGHT: usize = 4;
/// Bounds on one chunk; the chunk is a multiple of the file's stripe row within them.
const CHUNK_BYTES_MIN: u64 = 4 << 20;
const CHUNK_BYTES_MAX: u64 = 64 << 20;

pub async fn run(
    cluster: Option<PathBuf>,
    source: &str,
    target: &str,
    sync: bool,
    quiet: bool,
) -> anyhow::Result<()> {
    let (source, target) = (endpoint(source), endpoint(target));
    if let (Endpoint::Local(_), Endpoint::Local(_)) = (&source, &target) {
        anyhow::bail!("both paths are local; name a cluster path as ff:/path");
    }
    cluster_file::with_client(cluster, async |client| {
        let copied = match (&source, &target) {
            (Endpoint::Local(from), Endpoint::Cluster(to)) => {
                into_cluster(client, from, to, sync, quiet).await
            }
            (Endpoint::Cluster(from), Endpoint::Local(to)) => {
                out_of_cluster(client, from, to, sync, quiet).await
            }
            (Endpoint::Cluster(from), Endpoint::Cluster(to)) => {
                within_cluster(client, from, to, sync, quiet).await
            }
            (Endpoint::Local(_), Endpoint::Local(_)) => unreachable!("refused above"),
        };
        copied.map(|_| ())
    })
    .await
}

fn progress(total_bytes: u64, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total_bytes);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template"),
    );
    bar
}

fn chunk_bytes_for(client_layout: Option<&freeflow_types::Layout>) -> u64 {
    let row = client_layout
        .map(|layout| u64::from(layout.stripe_unit_bytes) * u64::from(layout.stripe_count()))
        .unwrap_or(CHUNK_BYTES_MIN);
    let rows = CHUNK_BYTES_MIN.div_ceil(row).max(1);
    (row * rows).clamp(row.min(CHUNK_BYTES_MAX), CHUNK_BYTES_MAX)
}

/// The cluster path to write: `to` itself, or `to/<name>` when `to` is a directory.
async fn cluster_target(
    client: &Client,
    to: &str,
    name: Option<&std::ffi::OsStr>,
) -> anyhow::Result<String> {
    match client.stat(to).await {
        Ok(attr) if attr.kind == FileKind::Directory => {
            let name = name.context("the source has no file name to copy into a directory")?;
            Ok(format!(
                "{}/{}",
                to.trim_end_matches('/'),
                name.to_string_lossy()
            ))
        }
        _ => Ok(to.to_string()),
    }
}

async fn into_cluster(
    client: &Client,
    from: &Path,
    to: &str,
    sync: bool,
    quiet: bool,
) -> anyhow::Result<u64> {
    let file =
        std::fs::File::open(from).with_context(|| format!("cannot open {}", from.display()))?;
    let metadata = file
        .metadata()
        .with_context(|| format!("cannot stat {}", from.display()))?;
    if metadata.is_dir() {
        anyhow::bail!("{} is a directory; cp copies files", from.display());
    }
    let to = cluster_target(client, to, from.file_name()).await?;
    let options = OpenOptions {
        write: true,
        create: true,
        truncate: true,
        permissions: 0o644,
        ..OpenOptions::default()
    };
    let handle = client
        .open_path(&to, &options)
        .await
        .with_context(|| format!("cannot create ff:{to}"))?;
    let chunk_bytes = chunk_bytes_for(handle.attr().layout.as_ref());
    let bar = progress(metadata.len(), quiet);

    // A reader thread keeps CHUNKS_IN_FLIGHT chunks ready ahead of the network.
    let (sender, mut receiver) =
        tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(CHUNKS_IN_FLIGHT);
    let source_name = from.display().to_string();
    let reader = std::thread::spawn(move || read_chunks(file, chunk_bytes as usize, sender));
    let mut offset = 0u64;
    while let Some(chunk) = receiver.recv().await {
        let chunk =
            chunk.with_context(|| format!("cannot read {source_name} at offset {offset}"))?;
        let length = chunk.len() as u64;
        handle
            .write_at(offset, chunk)
            .await
            .with_context(|| format!("cannot write ff:{to} at offset {offset}"))?;
        offset += length;
        bar.set_position(offset);
    }
    let _ = reader.join();
    finish_target(handle, &to, sync).await?;
    bar.finish();
    Ok(offset)
}

/// Make a copy's cluster target durable if asked (`--sync`), then close it: a failed
/// write-behind surfaces here and names the file.
async fn finish_target(handle: FileHandle, to: &str, sync: bool) -> anyhow::Result<()> {
    if sync {
        handle
            .fsync()
            .await
            .with_context(|| format!("cannot sync ff:{to}"))?;
    }
    handle
        .close()
        .await
        .with_context(|| format!("cannot close ff:{to}"))
}

fn read_chunks(
    mut file: std::fs::File,
    chunk_bytes: usize,
    sender: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) {
    loop {
        let mut buffer = vec![0u8; chunk_bytes];
        let mut filled = 0;
        while filled < chunk_bytes {
            match file.read(&mut buffer[filled..]) {
                Ok(0) => break,
                Ok(read) => filled += read,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    let _ = sender.blocking_send(Err(error));
                    return;
                }
            }
        }
        if filled == 0 {
            return;
        }
        buffer.truncate(filled);
        if sender.blocking_send(Ok(Bytes::from(buffer))).is_err() {
            return;
        }
    }
}

async fn out_of_cluster(
    client: &Client,
    from: &str,
    to: &Path,
    sync: bool,
    quiet: bool,
) -> anyhow::Result<u64> {
    let options = OpenOptions {
        read: true,
        ..OpenOptions::default()
    };
    let handle = client
        .open_path(from, &options)
        .await
        .with_context(|| format!("cannot open ff:{from}"))?;
    if handle.attr().kind == FileKind::Directory {
        anyhow::bail!("ff:{from} is a directory; cp copies files");
    }
    let to = if to.is_dir() {
        to.join(
            Path::new(from)
                .file_name()
                .context("the source has no file name")?,
        )
    } else {
        to.to_owned()
    };
    let size = handle.size();
    let chunk_bytes = chunk_bytes_for(handle.attr().layout.as_ref());
    let file =
        std::fs::File::create(&to).with_context(|| format!("cannot create {}", to.display()))?;
    let bar = progress(size, quiet);
    // A chunk goes as the servers' replies (no copy of it in one buffer first).
    let (sender, receiver) = std::sync::mpsc::sync_channel::<Vec<Bytes>>(CHUNKS_IN_FLIGHT);
    let target_name = to.display().to_string();
    let writer = std::thread::spawn(move || write_chunks(file, receiver, sync));

    let handle = std::sync::Arc::new(handle);
    let offsets = (0..size.div_ceil(chunk_bytes)).map(|index| index * chunk_bytes);
    let mut reads = futures::stream::iter(offsets.map(|offset| {
        let handle = handle.clone();
        async move { (offset, handle.read_parts_at(offset, chunk_bytes).await) }
    }))
    .buffered(CHUNKS_IN_FLIGHT);
    let mut copied = 0u64;
    while let Some((offset, data)) = reads.next().await {
        let data = data.with_context(|| format!("cannot read ff:{from} at offset {offset}"))?;
        copied += data.iter().map(|part| part.len() as u64).sum::<u64>();
        if sender.send(data).is_err() {
            break;
        }
        bar.set_position(copied);
    }
    drop(sender);
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer thread panicked"))?
        .with_context(|| format!("cannot write {target_name}"))?;
    drop(reads);
    if let Ok(handle) = std::sync::Arc::try_unwrap(handle) {
        handle
            .close()
            .await
            .with_context(|| format!("cannot close ff:{from}"))?;
    }
    bar.finish();
    Ok(copied)
}

fn write_chunks(
    mut file: std::fs::File,
    receiver: std::sync::mpsc::Receiver<Vec<Bytes>>,
    sync: bool,
) -> std::io::Result<()> {
    for chunk in receiver {
        for part in chunk {
            file.write_all(&part)?;
        }
    }
    if sync {
        file.sync_all()?;
    }
    Ok(())
}

async fn within_cluster(
    client: &Client,
    from: &str,
    to: &str,
    sync: bool,
    quiet: bool,
) -> anyhow::Result<u64> {
    let source = client
        .open_path(
            from,
            &OpenOptions {
                read: true,
                ..OpenOptions::default()
            },
        )
        .await
        .with_context(|| format!("cannot open ff:{from}"))?;
    let to = cluster_target(client, to, Path::new(from).file_name()).await?;
    let options = OpenOptions {
        write: true,
        create: true,
        truncate: true,
        permissions: 0o644,
        ..OpenOptions::default()
    };
    let target = client
        .open_path(&to, &options)
        .await
        .with_context(|| format!("cannot create ff:{to}"))?;
    let size = source.size();
    let chunk_bytes = chunk_bytes_for(target.attr().layout.as_ref());
    let bar = progress(size, quiet);
    let mut offset = 0u64;
    while offset < size {
        // The servers' replies go on as they are (no copy of the chunk in one buffer).
        let parts = source
            .read_parts_at(offset, chunk_bytes)
            .await
            .with_context(|| format!("cannot read ff:{from} at offset {offset}"))?;
        if parts.is_empty() {
            break;
        }
        for part in parts {
            let length = part.len() as u64;
            target
                .write_at(offset, part)
                .await
                .with_context(|| format!("cannot write ff:{to} at offset {offset}"))?;
            offset += length;
        }
        bar.set_position(offset);
    }
    finish_target(target, &to, sync).await?;
    source
        .close()
        .await
        .with_context(|| format!("cannot close ff:{from}"))?;
    bar.finish();
    Ok(offset)
}
