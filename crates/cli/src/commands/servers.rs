//! `freeflow meta` and `freeflow io`: one server per process, from a config file.

use std::path::Path;

use anyhow::Context;

use crate::cluster_file::{self, IoFile, MetaFile};
use crate::failure::ConfigError;

pub async fn run_meta(config_path: &Path) -> anyhow::Result<()> {
    let file: MetaFile = cluster_file::read(config_path)?;
    let key = cluster_file::load_key(config_path, &file.key_file)?;
    let mut config = file.meta;
    config.data_dir = cluster_file::relative_to(config_path, &config.data_dir);
    config
        .validate()
        .map_err(|error| ConfigError(format!("{}: {error}", config_path.display())))?;
    if config.node_id != 0 {
        let server = freeflow_meta::raft::supervisor::start_replicated(config, key)
            .await
            .context("metadata server failed to start")?;
        super::shutdown_signal().await?;
        tracing::info!("shutting down");
        server.shutdown().await;
        return Ok(());
    }
    let server = freeflow_meta::start(config, key)
        .await
        .context("metadata server failed to start")?;
    super::shutdown_signal().await?;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}

pub async fn run_io(config_path: &Path) -> anyhow::Result<()> {
    let file: IoFile = cluster_file::read(config_path)?;
    let key = cluster_file::load_key(config_path, &file.key_file)?;
    let mut config = file.io;
    config.data_dir = cluster_file::relative_to(config_path, &config.data_dir);
    config
        .validate()
        .map_err(|error| ConfigError(format!("{}: {error}", config_path.display())))?;
    let server = freeflow_ioserver::start(config, key)
        .await
        .context("I/O server failed to start")?;
    super::shutdown_signal().await?;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}
