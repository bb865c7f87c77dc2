//! The client library against a real cluster of `freeflow meta` / `freeflow io` processes:
//! striped data round trips, holes, concurrent writers, close-to-open, truncate, the
//! namespace operations and their error codes, unlink of an open file, restarts, and the
//! thread-pool disk engine. Everything the servers store is checked through a second path
//! (a fresh open, a fresh client, or the I/O servers' data directories).

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use common::{assert_bytes_eq, poll_until, Cluster, ClusterOptions, Xorshift};
use freeflow_client::{
    Client, ErrorCode, FileKind, OpenAccess, OpenOptions, RenameMode, XattrSetMode, ROOT_INODE,
};
use freeflow_ioserver::EngineKind;

fn read_write_create() -> OpenOptions {
    OpenOptions::new().read(true).write(true).create(true)
}

fn read_only() -> OpenOptions {
    OpenOptions::new().read(true)
}

/// The code of a result that must be an error.
#[track_caller]
fn error_code<T: std::fmt::Debug>(result: Result<T, freeflow_client::ClientError>) -> ErrorCode {
    match result {
        Ok(value) => panic!("expected an error, got Ok({value:?})"),
        Err(error) => error.code(),
    }
}

/// Read a whole file through a fresh open of `path`.
async fn read_whole(client: &Client, path: &str) -> Vec<u8> {
    let handle = client
        .open_path(path, &read_only())
        .await
        .expect("open to read");
    let size = handle.size();
    let data = handle.read_at(0, size).await.expect("read the whole file");
    handle.close().await.expect("close the reader");
    data.to_vec()
}

/// Write a model of `file_size_bytes` with random writes at unaligned offsets and sizes,
/// spanning several stripe units, leaving holes; returns the model.
async fn random_writes(client: &Client, path: &str, seed: u64, file_size_bytes: usize) -> Vec<u8> {
    let mut random = Xorshift::new(seed);
    let mut model = vec![0u8; file_size_bytes];
    let handle = client
        .open_path(path, &read_write_create())
        .await
        .expect("create the file");
    // Writes cover the first half densely and leave holes in the second half.
    let mut writes = Vec::new();
    for _ in 0..12 {
        let length = 1 + random.below(300_000) as usize;
        let offset = random.below((file_size_bytes / 2) as u64) as usize;
        writes.push((offset, length));
    }
    // Two islands with a hole between them and a hole before the last byte.
    writes.push((file_size_bytes * 5 / 8 + 17, 70_001));
    writes.push((file_size_bytes - 3, 3));
    for (offset, length) in writes {
        let length = length.min(file_size_bytes - offset);
        let data = random.bytes(length);
        model[offset..offset + length].copy_from_slice(&data);
        handle
            .write_at(offset as u64, Bytes::from(data))
            .await
            .expect("write_at");
    }
    // Read back through the same handle before closing: it sees its own writes.
    let early = handle
        .read_at(0, file_size_bytes as u64)
        .await
        .expect("read through the writing handle");
    assert_bytes_eq(&early, &model, "read through the writing handle");
    handle.fsync().await.expect("fsync");
    handle.close().await.expect("close");
    model
}

async fn check_round_trip(cluster: &Cluster, seed: u64) {
    let client = cluster.client().await;
    let file_size_bytes = 3 * 1024 * 1024 + 12_345;
    let path = format!("/round-trip-{seed}");
    let model = random_writes(&client, &path, seed, file_size_bytes).await;

    // A different client sees the same bytes.
    let reader = cluster.client().await;
    let attr = reader.stat(&path).await.expect("stat");
    assert_eq!(attr.size_bytes, file_size_bytes as u64, "size after close");
    let layout = attr.layout.clone().expect("a regular file has a layout");
    let servers: BTreeSet<u32> = layout.servers.iter().copied().collect();
    assert_eq!(
        servers.len(),
        cluster.io_count(),
        "the file is striped over every server: {layout:?}"
    );
    let whole = read_whole(&reader, &path).await;
    assert_bytes_eq(&whole, &model, "whole file read by another client");

    // Random unaligned ranges, some past the end (short reads).
    let handle = reader.open_path(&path, &read_only()).await.expect("open");
    let mut random = Xorshift::new(seed ^ 0xABCD);
    for _ in 0..20 {
        let offset = random.below(file_size_bytes as u64 + 100) as usize;
        let length = 1 + random.below(400_000) as usize;
        let got = handle
            .read_at(offset as u64, length as u64)
            .await
            .expect("read_at");
        let start = offset.min(file_size_bytes);
        let end = (offset + length).min(file_size_bytes);
        assert_bytes_eq(
            &got,
            &model[start..end],
            &format!("range {offset}+{length}"),
        );
    }
    // The hole between the two islands of the second half reads as zeros.
    let hole = handle
        .read_at((file_size_bytes * 3 / 4) as u64, 65_536)
        .await
        .expect("read the hole");
    assert_eq!(hole.len(), 65_536);
    assert!(hole.iter().all(|&byte| byte == 0), "a hole reads as zeros");
    handle.close().await.expect("close");

    // Every server holds at least one object of the file.
    for index in 0..cluster.io_count() {
        let stripe_index = layout
            .servers
            .iter()
            .position(|&server| server == index as u32)
            .expect("server in layout") as u32;
        let object = cluster.object_path(index, attr.inode, stripe_index);
        assert!(
            object.exists(),
            "object {} of stripe {stripe_index} is on server {index}",
            object.display()
        );
    }
    client.shutdown().await;
    reader.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn striped_round_trip_at_unaligned_offsets_with_holes() {
    let cluster = Cluster::start(3).await;
    check_round_trip(&cluster, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thread_engine_round_trip() {
    let options = ClusterOptions {
        engine: EngineKind::Threads,
        ..ClusterOptions::new(2)
    };
    let cluster = Cluster::start_with(options).await;
    // The servers really run the thread engine.
    for index in 0..cluster.io_count() {
        let connection = freeflow_rpc::Connection::connect(
            cluster.io_address(index),
            &cluster.key,
            &freeflow_rpc::ConnectOptions::default(),
        )
        .await
        .expect("connect to the I/O server");
        let (stats, _) = connection
            .call(&freeflow_proto::io::ServerStats {}, Bytes::new())
            .await
            .expect("ServerStats");
        assert_eq!(stats.engine, "threads", "engine of server {index}");
        assert_eq!(stats.server_id, index as u32);
    }
    check_round_trip(&cluster, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_disjoint_writers_match_one_writer() {
    let cluster = Cluster::start(3).await;
    let client_a = cluster.client().await;
    let client_b = cluster.client().await;
    const PIECE_BYTES: usize = 41_017; // unaligned: pieces straddle stripe units
    const PIECES: usize = 48;
    let mut random = Xorshift::new(3);
    let model = random.bytes(PIECE_BYTES * PIECES);

    // Create, then open twice (from two clients) and write alternate pieces from many tasks.
    let creator = client_a
        .open_path("/shared", &read_write_create())
        .await
        .expect("create");
    creator.close().await.expect("close the creator");
    let options = OpenOptions::new().write(true);
    let handle_a = Arc::new(
        client_a
            .open_path("/shared", &options)
            .await
            .expect("open a"),
    );
    let handle_b = Arc::new(
        client_b
            .open_path("/shared", &options)
            .await
            .expect("open b"),
    );
    let model = Arc::new(model);
    let mut tasks = Vec::new();
    for piece in 0..PIECES {
        let handle = if piece % 2 == 0 {
            handle_a.clone()
        } else {
            handle_b.clone()
        };
        let model = model.clone();
        tasks.push(tokio::spawn(async move {
            let start = piece * PIECE_BYTES;
            let data = Bytes::copy_from_slice(&model[start..start + PIECE_BYTES]);
            handle.write_at(start as u64, data).await
        }));
    }
    for task in tasks {
        task.await.expect("task").expect("write_at");
    }
    for handle in [handle_a, handle_b] {
        let handle = Arc::try_unwrap(handle).expect("every task is done");
        handle.close().await.expect("close a writer");
    }

    // The same bytes through one writer, for comparison.
    let single = client_a
        .open_path("/single", &read_write_create())
        .await
        .expect("create single");
    single
        .write_at(0, Bytes::copy_from_slice(&model))
        .await
        .expect("one write");
    single.close().await.expect("close single");

    let reader = cluster.client().await;
    let shared = read_whole(&reader, "/shared").await;
    let single = read_whole(&reader, "/single").await;
    assert_bytes_eq(&shared, &model, "file written by two concurrent handles");
    assert_bytes_eq(&shared, &single, "two writers versus one writer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_to_open_size_and_data() {
    let cluster = Cluster::start(2).await;
    let writer = cluster.client().await;
    let reader = cluster.client().await;
    let data = Xorshift::new(4).bytes(777_777);
    let handle = writer
        .open_path("/c2o", &read_write_create())
        .await
        .expect("create");
    handle
        .write_at(0, Bytes::copy_from_slice(&data))
        .await
        .expect("write");
    // No fsync: close alone publishes size and data.
    handle.close().await.expect("close");
    let attr = reader.stat("/c2o").await.expect("stat by the other client");
    assert_eq!(attr.size_bytes, 777_777);
    let opened = reader.open_path("/c2o", &read_only()).await.expect("open");
    assert_eq!(opened.size(), 777_777, "size seen by a fresh open");
    let got = opened.read_at(0, 1 << 20).await.expect("read");
    assert_bytes_eq(&got, &data, "data seen by a fresh open");
    opened.close().await.expect("close the reader");

    // Appending through a second open extends it; a third open sees the new size.
    let appender = writer
        .open_path("/c2o", &OpenOptions::new().append(true))
        .await
        .expect("open to append");
    let offset = appender
        .append(Bytes::from_static(b"tail"))
        .await
        .expect("append");
    assert_eq!(offset, 777_777, "append writes at the end");
    appender.close().await.expect("close the appender");
    let got = read_whole(&reader, "/c2o").await;
    assert_eq!(got.len(), 777_781);
    assert_eq!(&got[777_777..], b"tail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_down_then_up_reads_zeros_past_the_cut() {
    let cluster = Cluster::start(3).await;
    let client = cluster.client().await;
    let data = Xorshift::new(5).bytes(1_000_000);
    let handle = client
        .open_path("/t", &read_write_create())
        .await
        .expect("create");
    handle
        .write_at(0, Bytes::copy_from_slice(&data))
        .await
        .expect("write");
    handle.close().await.expect("close");

    let cut = 100_001u64;
    let attr = client
        .truncate_path("/t", cut)
        .await
        .expect("truncate down");
    assert_eq!(attr.size_bytes, cut);
    let attr = client
        .truncate_path("/t", 600_000)
        .await
        .expect("truncate up");
    assert_eq!(attr.size_bytes, 600_000);
    let got = read_whole(&client, "/t").await;
    assert_eq!(got.len(), 600_000);
    assert_bytes_eq(
        &got[..cut as usize],
        &data[..cut as usize],
        "before the cut",
    );
    if let Some(at) = got[cut as usize..].iter().position(|&byte| byte != 0) {
        panic!(
            "old data reappeared past the cut at byte {}",
            cut as usize + at
        );
    }
    // O_TRUNC through open.
    let handle = client
        .open_path("/t", &OpenOptions::new().write(true).truncate(true))
        .await
        .expect("open with truncate");
    handle.close().await.expect("close");
    assert_eq!(client.stat("/t").await.expect("stat").size_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_operations_and_error_codes() {
    let cluster = Cluster::start(1).await;
    let client = cluster.client().await;

    let dir = client.mkdir(ROOT_INODE, "d", 0o755).await.expect("mkdir");
    assert_eq!(dir.kind, FileKind::Directory);
    assert_eq!(
        error_code(client.mkdir(ROOT_INODE, "d", 0o755).await),
        ErrorCode::Exists
    );
    let file = client
        .create(dir.inode, "f", FileKind::Regular, 0o644, 0, true)
        .await
        .expect("create");
    assert_eq!(
        error_code(
            client
                .create(dir.inode, "f", FileKind::Regular, 0o644, 0, true)
                .await
        ),
        ErrorCode::Exists,
        "exclusive create of an existing name"
    );
    assert_eq!(
        client.lookup(dir.inode, "f").await.expect("lookup").inode,
        file.inode
    );
    assert_eq!(
        error_code(client.lookup(dir.inode, "missing").await),
        ErrorCode::NotFound
    );
    assert_eq!(
        error_code(client.stat("/d/missing/deeper").await),
        ErrorCode::NotFound
    );
    assert_eq!(
        error_code(client.lookup(file.inode, "x").await),
        ErrorCode::NotDirectory,
        "lookup inside a regular file"
    );
    assert_eq!(
        error_code(client.stat("/d/f/x").await),
        ErrorCode::NotDirectory
    );
    assert_eq!(
        error_code(client.rmdir(ROOT_INODE, "d").await),
        ErrorCode::NotEmpty
    );
    assert_eq!(
        error_code(client.rmdir(dir.inode, "f").await),
        ErrorCode::NotDirectory
    );
    assert_eq!(
        error_code(client.unlink(ROOT_INODE, "d").await),
        ErrorCode::IsDirectory
    );
    assert_eq!(
        error_code(
            client
                .open(
                    dir.inode,
                    OpenAccess {
                        read: false,
                        write: true
                    }
                )
                .await
        ),
        ErrorCode::IsDirectory,
        "open a directory for writing"
    );
    let long_name = "n".repeat(256);
    assert_eq!(
        error_code(client.mkdir(ROOT_INODE, &long_name, 0o755).await),
        ErrorCode::NameTooLong
    );
    assert_eq!(
        error_code(
            client
                .create(ROOT_INODE, &long_name, FileKind::Regular, 0o644, 0, false)
                .await
        ),
        ErrorCode::NameTooLong
    );
    assert_eq!(
        error_code(client.lookup(ROOT_INODE, &long_name).await),
        ErrorCode::NameTooLong
    );
    // 255 bytes is still fine.
    client
        .mkdir(ROOT_INODE, &"n".repeat(255), 0o755)
        .await
        .expect("a 255-byte name is allowed");

    // Rename within and across directories, with NoReplace and Exchange.
    let other = client.mkdir(ROOT_INODE, "e", 0o755).await.expect("mkdir e");
    client
        .rename(dir.inode, "f", other.inode, "g", RenameMode::Replace)
        .await
        .expect("rename across directories");
    assert_eq!(
        error_code(client.lookup(dir.inode, "f").await),
        ErrorCode::NotFound,
        "the old name is gone"
    );
    assert_eq!(
        client
            .lookup(other.inode, "g")
            .await
            .expect("new name")
            .inode,
        file.inode
    );
    client
        .create(other.inode, "h", FileKind::Regular, 0o644, 0, true)
        .await
        .expect("create h");
    assert_eq!(
        error_code(
            client
                .rename(other.inode, "g", other.inode, "h", RenameMode::NoReplace)
                .await
        ),
        ErrorCode::Exists
    );
    let h_before = client.lookup(other.inode, "h").await.expect("h").inode;
    client
        .rename(other.inode, "g", other.inode, "h", RenameMode::Exchange)
        .await
        .expect("exchange");
    assert_eq!(
        client.lookup(other.inode, "h").await.unwrap().inode,
        file.inode
    );
    assert_eq!(
        client.lookup(other.inode, "g").await.unwrap().inode,
        h_before
    );
    assert_eq!(
        error_code(
            client
                .rename(
                    other.inode,
                    "missing",
                    other.inode,
                    "z",
                    RenameMode::Replace
                )
                .await
        ),
        ErrorCode::NotFound
    );
    assert_eq!(
        error_code(
            client
                .rename(ROOT_INODE, "e", other.inode, "inside", RenameMode::Replace)
                .await
        ),
        ErrorCode::InvalidArgument,
        "a directory moved into itself"
    );

    // Readdir in name order, paged.
    for name in ["c", "a", "b"] {
        client
            .create(dir.inode, name, FileKind::Regular, 0o644, 0, true)
            .await
            .expect("create");
    }
    let page = client
        .readdir(dir.inode, None, 2, true)
        .await
        .expect("readdir");
    let names: Vec<_> = page
        .entries
        .iter()
        .map(|entry| entry.name.as_str())
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert!(!page.end);
    assert!(page.entries.iter().all(|entry| entry.attr.is_some()));
    let page = client
        .readdir(dir.inode, Some("b"), 10, false)
        .await
        .expect("readdir rest");
    let names: Vec<_> = page
        .entries
        .iter()
        .map(|entry| entry.name.as_str())
        .collect();
    assert_eq!(names, ["c"]);
    assert!(page.end);
    let all = client.read_dir_all("/d").await.expect("read_dir_all");
    assert_eq!(all.len(), 3);

    // Unlink and rmdir.
    for name in ["a", "b", "c"] {
        client.unlink(dir.inode, name).await.expect("unlink");
    }
    assert_eq!(
        error_code(client.unlink(dir.inode, "a").await),
        ErrorCode::NotFound
    );
    client
        .rmdir(ROOT_INODE, "d")
        .await
        .expect("rmdir the emptied dir");
    assert_eq!(error_code(client.stat("/d").await), ErrorCode::NotFound);

    // Symlinks: readlink, followed by stat, not by lstat.
    let link = client
        .symlink(ROOT_INODE, "s", "/e/h")
        .await
        .expect("symlink");
    assert_eq!(link.kind, FileKind::Symlink);
    assert_eq!(client.readlink(link.inode).await.expect("readlink"), "/e/h");
    assert_eq!(client.stat("/s").await.expect("stat").inode, file.inode);
    assert_eq!(client.lstat("/s").await.expect("lstat").inode, link.inode);
    assert_eq!(
        error_code(client.symlink(ROOT_INODE, "s", "/x").await),
        ErrorCode::Exists
    );

    // Hard links.
    let linked = client
        .link(file.inode, ROOT_INODE, "hard")
        .await
        .expect("link");
    assert_eq!(linked.inode, file.inode);
    assert_eq!(linked.link_count, 2);
    assert_eq!(
        error_code(client.link(other.inode, ROOT_INODE, "dirlink").await),
        ErrorCode::NotPermitted,
        "a hard link to a directory"
    );
    client
        .unlink(other.inode, "h")
        .await
        .expect("unlink one name");
    let attr = client.lookup(ROOT_INODE, "hard").await.expect("other name");
    assert_eq!(attr.link_count, 1);

    // Extended attributes.
    client
        .set_xattr(file.inode, "user.a", b"one", XattrSetMode::CreateOnly)
        .await
        .expect("setxattr");
    assert_eq!(
        error_code(
            client
                .set_xattr(file.inode, "user.a", b"two", XattrSetMode::CreateOnly)
                .await
        ),
        ErrorCode::Exists
    );
    assert_eq!(
        error_code(
            client
                .set_xattr(file.inode, "user.b", b"two", XattrSetMode::ReplaceOnly)
                .await
        ),
        ErrorCode::NoData
    );
    client
        .set_xattr(file.inode, "user.a", b"two", XattrSetMode::ReplaceOnly)
        .await
        .expect("replace");
    client
        .set_xattr(file.inode, "user.b", b"", XattrSetMode::Any)
        .await
        .expect("empty value");
    assert_eq!(
        client.get_xattr(file.inode, "user.a").await.expect("get"),
        b"two"
    );
    let mut names = client.list_xattr(file.inode).await.expect("list");
    names.sort();
    assert_eq!(names, ["user.a", "user.b"]);
    client
        .remove_xattr(file.inode, "user.a")
        .await
        .expect("remove");
    assert_eq!(
        error_code(client.get_xattr(file.inode, "user.a").await),
        ErrorCode::NoData
    );
    assert_eq!(
        error_code(client.remove_xattr(file.inode, "user.a").await),
        ErrorCode::NoData
    );
    assert_eq!(
        error_code(client.getattr(987_654_321).await),
        ErrorCode::NotFound,
        "getattr of an inode that never existed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlinked_open_file_stays_readable_then_objects_are_removed() {
    let cluster = Cluster::start(2).await;
    let client = cluster.client().await;
    let data = Xorshift::new(6).bytes(400_000);
    let handle = client
        .open_path("/doomed", &read_write_create())
        .await
        .expect("create");
    handle
        .write_at(0, Bytes::copy_from_slice(&data))
        .await
        .expect("write");
    handle.fsync().await.expect("fsync");
    let inode = handle.inode();
    let objects = cluster.object_files(inode);
    assert_eq!(
        objects.len(),
        2,
        "one object per server before unlink: {objects:?}"
    );

    client.unlink(ROOT_INODE, "doomed").await.expect("unlink");
    assert_eq!(
        error_code(client.stat("/doomed").await),
        ErrorCode::NotFound,
        "the name is gone at once"
    );
    let other = cluster.client().await;
    assert_eq!(
        error_code(other.stat("/doomed").await),
        ErrorCode::NotFound,
        "the name is gone for other clients too"
    );
    let got = handle.read_at(0, 400_000).await.expect("read after unlink");
    assert_bytes_eq(&got, &data, "data through the open handle after unlink");
    // Still there while open (give the reaper a moment to do the wrong thing).
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(
        cluster.object_files(inode).len(),
        2,
        "objects stay while a handle is open"
    );

    handle.close().await.expect("close the last handle");
    let gone = poll_until(30_000, || async {
        cluster.object_files(inode).is_empty().then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "objects of the unlinked inode {inode} still on the servers after close: {:?}\n{}",
        cluster.object_files(inode),
        cluster.all_logs()
    );
    let forgotten = poll_until(10_000, || async {
        (client.getattr(inode).await.err()?.code() == ErrorCode::NotFound).then_some(())
    })
    .await;
    assert!(forgotten.is_some(), "the orphan inode {inode} is forgotten");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_every_process_keeps_data_and_names() {
    let mut cluster = Cluster::start(2).await;
    let client = cluster.client().await;
    client.mkdir_all("/a/b/c").await.expect("mkdir_all");
    let data = Xorshift::new(7).bytes(1_234_567);
    let handle = client
        .open_path("/a/b/c/file", &read_write_create())
        .await
        .expect("create");
    handle
        .write_at(0, Bytes::copy_from_slice(&data))
        .await
        .expect("write");
    handle.fsync().await.expect("fsync");
    handle.close().await.expect("close");
    client
        .rename_path("/a/b/c/file", "/a/renamed")
        .await
        .expect("rename");
    client
        .symlink_path("/a/renamed", "/link")
        .await
        .expect("symlink");
    let before = client.stat("/a/renamed").await.expect("stat");
    client.shutdown().await;
    drop(client);

    cluster.restart_all().await;
    let client = cluster.client().await;
    let after = client
        .stat("/link")
        .await
        .expect("stat through the symlink");
    assert_eq!(after.inode, before.inode);
    assert_eq!(after.size_bytes, 1_234_567);
    assert_eq!(after.layout, before.layout);
    assert_eq!(
        error_code(client.stat("/a/b/c/file").await),
        ErrorCode::NotFound,
        "the rename survived"
    );
    let got = read_whole(&client, "/link").await;
    assert_bytes_eq(&got, &data, "data after restarting every process");
    let status = client.cluster_status().await.expect("status");
    assert_eq!(status.servers.iter().filter(|server| server.up).count(), 2);
    // New files still work after the restart (inode ids do not collide).
    let handle = client
        .open_path("/a/new", &read_write_create())
        .await
        .expect("create after restart");
    assert_ne!(handle.inode(), before.inode);
    handle
        .write_at(0, Bytes::from_static(b"fresh"))
        .await
        .expect("write after restart");
    handle.close().await.expect("close");
    assert_eq!(read_whole(&client, "/a/new").await, b"fresh");
}
