//! The client against the real meta server and I/O servers, started in this process on
//! temporary directories: the end-to-end walk of a write and a read through every crate.

use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_client::{Client, ClientConfig, ClusterKey, ErrorCode, FileKind, OpenOptions};
use freeflow_ioserver::{EngineKind, IoConfig};
use freeflow_meta::MetaConfig;

fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// A meta server and three I/O servers (64 KiB stripe units) in this process, and a client
/// of them once every I/O server has registered.
async fn start_cluster(
    directory: &std::path::Path,
    tune: impl FnOnce(&mut ClientConfig),
) -> (
    freeflow_meta::RunningMeta,
    Vec<freeflow_ioserver::RunningIo>,
    Client,
) {
    let key = ClusterKey::from_bytes([42; 32]);
    let meta_config = MetaConfig {
        listen_address: "127.0.0.1:0".into(),
        data_dir: directory.join("meta"),
        stripe_unit_bytes: 64 << 10,
        ..MetaConfig::default()
    };
    let meta = freeflow_meta::start(meta_config, key.clone())
        .await
        .unwrap();
    let meta_address = meta.listen_address().to_string();
    let mut io_servers = Vec::new();
    for server_id in 1..=3 {
        let config = IoConfig {
            server_id,
            listen_address: "127.0.0.1:0".into(),
            data_dir: directory.join(format!("io{server_id}")),
            meta_address: meta_address.clone(),
            engine: EngineKind::Threads,
            ..IoConfig::default()
        };
        io_servers.push(freeflow_ioserver::start(config, key.clone()).await.unwrap());
    }
    let mut config = ClientConfig::new(meta_address, key);
    config.call_timeout_ms = 10_000;
    tune(&mut config);
    let client = Client::connect(config).await.unwrap();
    // Wait until every I/O server has registered.
    let deadline = Instant::now() + Duration::from_secs(10);
    while client
        .servers()
        .await
        .unwrap()
        .iter()
        .filter(|server| server.up)
        .count()
        < 3
    {
        assert!(Instant::now() < deadline, "I/O servers did not register");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (meta, io_servers, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_truncate_and_names_through_real_servers() {
    let directory = tempfile::tempdir().unwrap();
    let (meta, io_servers, client) = start_cluster(directory.path(), |_| {}).await;

    client.mkdir_all("/data/deep").await.unwrap();
    let options = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .exclusive(true);
    let file = client.open_path("/data/deep/file", &options).await.unwrap();
    let layout = file.attr().layout.unwrap();
    assert_eq!(layout.stripe_count(), 3);
    let data = pattern(1_500_000, 5);
    file.write_at(0, Bytes::from(data.clone())).await.unwrap();
    assert_eq!(
        file.read_at(123_456, 200_000).await.unwrap(),
        Bytes::copy_from_slice(&data[123_456..323_456])
    );
    file.fsync().await.unwrap();
    file.close().await.unwrap();

    let attr = client.stat("/data/deep/file").await.unwrap();
    assert_eq!(attr.size_bytes, 1_500_000);
    let (_, _, stripes) = client.stripe_map("/data/deep/file").await.unwrap();
    let total: u64 = stripes.iter().map(|(_, _, length)| length).sum();
    assert_eq!(total, 1_500_000);

    let reader = client
        .open_path("/data/deep/file", &OpenOptions::new().read(true))
        .await
        .unwrap();
    assert_eq!(
        reader.read_at(0, 2_000_000).await.unwrap(),
        Bytes::from(data.clone())
    );
    reader.close().await.unwrap();

    // Shrink then extend: the cut bytes read as zeros.
    client.truncate_path("/data/deep/file", 100).await.unwrap();
    client
        .truncate_path("/data/deep/file", 300_000)
        .await
        .unwrap();
    let reader = client
        .open_path("/data/deep/file", &OpenOptions::new().read(true))
        .await
        .unwrap();
    let read = reader.read_at(0, 300_000).await.unwrap();
    assert_eq!(&read[..100], &data[..100]);
    assert!(
        read[100..].iter().all(|&byte| byte == 0),
        "stale bytes after truncate"
    );
    reader.close().await.unwrap();

    client
        .symlink_path("/data/deep", "/shortcut")
        .await
        .unwrap();
    assert_eq!(
        client.stat("/shortcut/file").await.unwrap().inode,
        attr.inode
    );
    client
        .rename_path("/data/deep/file", "/data/moved")
        .await
        .unwrap();
    let names: Vec<String> = client
        .read_dir_all("/data")
        .await
        .unwrap()
        .into_iter()
        .map(|entry| entry.name)
        .collect();
    assert_eq!(names, vec!["deep", "moved"]);
    assert_eq!(
        client
            .open_path("/data", &OpenOptions::new().write(true))
            .await
            .unwrap_err()
            .code(),
        ErrorCode::IsDirectory
    );
    client.remove_all("/data").await.unwrap();
    assert_eq!(
        client.lstat("/shortcut").await.unwrap().kind,
        FileKind::Symlink
    );
    assert_eq!(
        client.stat("/shortcut").await.unwrap_err().code(),
        ErrorCode::NotFound
    );

    client.shutdown().await;
    for server in io_servers {
        server.shutdown().await;
    }
    meta.shutdown().await;
}

/// A small write is gathered on its handle and sent by a timer `gather_wait_ms` later. Between
/// the timer taking the gathered bytes and the write starting, the bytes were neither held
/// on the handle nor counted as started, and `flush_is_empty` (the mount's way to answer a
/// close without a task) said there was nothing to flush: the close was answered before
/// the write's size reached the meta server, and an open right after saw the file shorter
/// (the exerciser's `Reopen` after a write past the end, found on a mount). Polled across
/// the timer many times here: until a flush commits the size, there is always something
/// to flush, and after it the meta server has the size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gathered_write_on_its_way_out_always_leaves_something_to_flush() {
    let directory = tempfile::tempdir().unwrap();
    let (meta, io_servers, client) = start_cluster(directory.path(), |config| {
        config.gather_wait_ms = 1;
        // No size commit in the background during the test: only the flush commits.
        config.size_commit_interval_ms = 3_600_000;
    })
    .await;
    let options = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .exclusive(true);
    let file = client.open_path("/gathered", &options).await.unwrap();
    let inode = file.attr().inode;
    let mut end = 0u64;
    for round in 0..300u64 {
        let data = pattern(3_000 + (round as usize % 7) * 1_000, round as u8);
        end += data.len() as u64 + 4_096;
        file.write_at(end - data.len() as u64, Bytes::from(data))
            .await
            .unwrap();
        // Across the timer's send: spin for a few of its periods.
        let until = Instant::now() + Duration::from_millis(3);
        while Instant::now() < until {
            assert!(
                !file.flush_is_empty(),
                "round {round}: a written size not yet committed, and nothing to flush"
            );
            tokio::task::yield_now().await;
        }
        file.flush().await.unwrap();
        assert!(file.flush_is_empty(), "round {round}: flushed, still work");
        assert_eq!(client.getattr(inode).await.unwrap().size_bytes, end);
    }
    file.close().await.unwrap();
    for server in io_servers {
        server.shutdown().await;
    }
    meta.shutdown().await;
}
