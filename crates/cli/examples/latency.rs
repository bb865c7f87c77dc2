//! Round-trip latency of metadata calls through the client library (no FUSE): the floor
//! under the mount's per-operation cost. `cargo run --release --example latency -- CLIENT_TOML N`
use std::time::Instant;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // On a worker, as the mount's calls run (the main thread would add a wake per call).
    tokio::spawn(measure()).await.unwrap();
}

async fn measure() {
    let arguments: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(&arguments[1]);
    let count: usize = arguments[2].parse().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let table: toml::Table = text.parse().unwrap();
    let meta = table["meta_address"].as_str().unwrap().to_string();
    let key_file = path
        .parent()
        .unwrap()
        .join(table["key_file"].as_str().unwrap());
    let key = freeflow_client::ClusterKey::load(&key_file).unwrap();
    let client = freeflow_client::Client::connect(freeflow_client::ClientConfig::new(meta, key))
        .await
        .unwrap();
    let started = Instant::now();
    for _ in 0..count {
        client.getattr(freeflow_client::ROOT_INODE).await.unwrap();
    }
    println!(
        "getattr: {:.1} us",
        started.elapsed().as_secs_f64() * 1e6 / count as f64
    );
    let directory = client
        .mkdir(
            freeflow_client::ROOT_INODE,
            &format!("lat-{}", std::process::id()),
            0o755,
        )
        .await
        .unwrap();
    let started = Instant::now();
    for index in 0..count {
        client
            .create(
                directory.inode,
                &format!("f{index}"),
                freeflow_client::FileKind::Regular,
                0o644,
                0,
                true,
            )
            .await
            .unwrap();
    }
    println!(
        "create: {:.1} us",
        started.elapsed().as_secs_f64() * 1e6 / count as f64
    );
    let started = Instant::now();
    for index in 0..count {
        client
            .unlink(directory.inode, &format!("f{index}"))
            .await
            .unwrap();
    }
    println!(
        "unlink: {:.1} us",
        started.elapsed().as_secs_f64() * 1e6 / count as f64
    );
}
