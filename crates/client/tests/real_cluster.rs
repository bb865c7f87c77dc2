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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_truncate_and_names_through_real_servers() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::from_bytes([42; 32]);
    let meta_config = MetaConfig {
        listen_address: "127.0.0.1:0".into(),
        data_dir: directory.path().join("meta"),
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
            data_dir: directory.path().join(format!("io{server_id}")),
            meta_address: meta_address.clone(),
            engine: EngineKind::Threads,
            ..IoConfig::default()
        };
        io_servers.push(freeflow_ioserver::start(config, key.clone()).await.unwrap());
    }
    let mut config = ClientConfig::new(meta_address, key);
    config.call_timeout_ms = 10_000;
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
