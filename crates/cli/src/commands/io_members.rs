//! `freeflow server drain|remove`: an I/O server leaving the cluster, by the metadata
//! leader (`meta/src/rereplication.rs`). A drain moves every stripe off the server while
//! clients go on; once complete and the server has removed what it gave up, it can be
//! removed and stopped.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use freeflow_client::{Client, IoServerChange};

use crate::args::ServerCommand;
use crate::cluster_file;

/// How often a waiting drain asks how far it is.
const POLL: Duration = Duration::from_millis(500);

pub async fn run(cluster: Option<PathBuf>, command: ServerCommand) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        match command {
            ServerCommand::Drain { id, wait } => {
                client.change_io_server(id, IoServerChange::Drain).await?;
                println!("server {id}: drain started; new files go to the other servers");
                if wait {
                    wait_drained(client, id).await?;
                } else {
                    println!("`freeflow status` shows its progress");
                }
            }
            ServerCommand::Remove { id, force } => {
                let servers = client
                    .change_io_server(id, IoServerChange::Remove { force })
                    .await?;
                println!(
                    "server {id} removed from the cluster ({} I/O servers left); it can be stopped",
                    servers.len()
                );
            }
        }
        Ok(())
    })
    .await
}

/// Wait until the drain of `id` is complete and the server holds no object, saying how
/// many of its stand-ins still copy.
async fn wait_drained(client: &Client, id: u32) -> anyhow::Result<()> {
    let mut said = String::new();
    loop {
        let report = client.cluster_status().await?;
        let Some(drain) = report
            .replacements
            .iter()
            .rev()
            .find(|replacement| replacement.drain && replacement.server == id)
        else {
            bail!("the meta server has no drain of server {id}");
        };
        let objects = report
            .servers
            .iter()
            .find(|server| server.server_id == id)
            .map_or(0, |server| server.object_count);
        let now = if !drain.filling.is_empty() {
            format!(
                "server {id}: servers {:?} still copying its stripes",
                drain.filling
            )
        } else if !drain.complete {
            format!("server {id}: every stripe copied; switching its chains")
        } else if objects > 0 {
            format!("server {id}: drained; it removes the {objects} copies it gave up")
        } else {
            println!("server {id}: drained and empty; `freeflow server remove {id}` takes it out");
            return Ok(());
        };
        if now != said {
            println!("{now}");
            said = now;
        }
        tokio::time::sleep(POLL).await;
    }
}
