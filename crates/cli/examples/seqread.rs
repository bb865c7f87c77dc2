//! Sequential read of one cluster file through the library with reads of a fixed size, one
//! at a time (a naive reader, as most application code is):
//! `cargo run --release --example seqread -- CLIENT_TOML /path READ_BYTES [READAHEAD_BYTES]`
mod common;

use std::time::Instant;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let arguments: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(&arguments[1]);
    let file_path = arguments[2].clone();
    let read_bytes: u64 = arguments[3].parse().unwrap();
    let readahead: u64 = arguments.get(4).map_or(0, |text| text.parse().unwrap());
    let mut config = common::client_config(&path).expect("the cluster's client.toml");
    config.readahead_bytes = readahead;
    let client = freeflow_client::Client::connect(config).await.unwrap();
    tokio::spawn(async move {
        let file = client
            .open_path(&file_path, &freeflow_client::OpenOptions::new().read(true))
            .await
            .unwrap();
        let started = Instant::now();
        let mut offset = 0u64;
        loop {
            let data = file.read_at(offset, read_bytes).await.unwrap();
            if data.is_empty() {
                break;
            }
            offset += data.len() as u64;
        }
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "{} MiB in {:.2} s: {:.0} MB/s",
            offset >> 20,
            seconds,
            offset as f64 / seconds / 1e6
        );
    })
    .await
    .unwrap();
}
