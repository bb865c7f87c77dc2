//! Fill a cluster's namespace with N empty files, many creates in flight at once, to
//! measure how start-up time depends on the number of files (it must not).
//!
//! ```sh
//! cargo run --release --example populate -- ./freeflow-data/client.toml 100000
//! ```

use std::sync::Arc;

mod common;

use freeflow_client::{Client, FileKind};

const DIRECTORIES: u64 = 100;
const CREATES_IN_FLIGHT: usize = 64;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut arguments = std::env::args().skip(1);
    let usage = "usage: populate CLIENT_TOML FILE_COUNT";
    let client_file = std::path::PathBuf::from(arguments.next().ok_or(usage)?);
    let count: u64 = arguments.next().ok_or(usage)?.parse()?;
    let client = Client::connect(common::client_config(&client_file)?).await?;

    let started = std::time::Instant::now();
    let top = format!("/populate-{}", std::process::id());
    let top = client.mkdir_path(&top, 0o755).await?.inode;
    let mut directories = Vec::new();
    for index in 0..DIRECTORIES {
        directories.push(
            client
                .mkdir(top, &format!("d{index:03}"), 0o755)
                .await?
                .inode,
        );
    }
    let directories = Arc::new(directories);
    let semaphore = Arc::new(tokio::sync::Semaphore::new(CREATES_IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..count {
        let permit = semaphore.clone().acquire_owned().await?;
        let (client, directories): (Client, _) = (client.clone(), directories.clone());
        tasks.spawn(async move {
            let parent = directories[(index % DIRECTORIES) as usize];
            let result = client
                .create(
                    parent,
                    &format!("f{index:08}"),
                    FileKind::Regular,
                    0o644,
                    0,
                    true,
                )
                .await;
            drop(permit);
            result.map(|_| ())
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "created {count} files in {seconds:.1} s ({:.0} creates/s)",
        count as f64 / seconds
    );
    client.shutdown().await;
    Ok(())
}
