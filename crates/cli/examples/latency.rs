//! Round-trip latency of metadata calls through the client library (no FUSE): the floor
//! under the mount's per-operation cost. `cargo run --release --example latency -- CLIENT_TOML N`
mod common;

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
    let config = common::client_config(&path).expect("the cluster's client.toml");
    let client = freeflow_client::Client::connect(config).await.unwrap();
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
