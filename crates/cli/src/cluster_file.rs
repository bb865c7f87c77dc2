//! Config files of the binary. Each server file holds the path of the cluster key and the
//! server crate's own config section; the client file says where the metadata server is.
//! Relative paths in a file are taken from the file's own directory, so a data directory
//! made by `freeflow up` or `freeflow init` can be moved as a whole.
//!
//! ```toml
//! # meta.toml                      # io-0.toml                       # client.toml
//! key_file = "cluster.key"         key_file = "cluster.key"          meta_address = "127.0.0.1:7700"
//! [meta]                           [io]                              key_file = "cluster.key"
//! listen_address = "0.0.0.0:7700"  server_id = 0
//! data_dir = "meta"                listen_address = "0.0.0.0:7710"
//!                                  data_dir = "io-0"
//!                                  meta_address = "meta-host:7700"
//! ```

use std::path::{Path, PathBuf};

use anyhow::Context;
use freeflow_ioserver::IoConfig;
use freeflow_meta::MetaConfig;
use freeflow_rpc::ClusterKey;
use serde::{Deserialize, Serialize};

use crate::failure::ConfigError;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaFile {
    pub key_file: PathBuf,
    pub meta: MetaConfig,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoFile {
    pub key_file: PathBuf,
    pub io: IoConfig,
}

pub use freeflow_client::cluster_file::{relative_to, ClientFile};

/// Read and parse a TOML file, naming the file in every error.
pub fn read<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text)
        .map_err(|error| ConfigError(format!("config file {}: {error}", path.display())).into())
}

/// Write a TOML file (refusing to overwrite unless `replace`).
pub fn write<T: Serialize>(path: &Path, value: &T, replace: bool) -> anyhow::Result<()> {
    if !replace && path.exists() {
        return Err(ConfigError(format!(
            "{} exists already; not overwriting it",
            path.display()
        ))
        .into());
    }
    let text = toml::to_string_pretty(value).context("config does not encode as TOML")?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

pub fn load_key(config_file: &Path, key_file: &Path) -> anyhow::Result<ClusterKey> {
    let path = relative_to(config_file, key_file);
    ClusterKey::load(&path).map_err(|error| ConfigError(error.to_string()).into())
}

/// The client file to use: `--cluster`, then $FREEFLOW_CLUSTER, then ./freeflow-data/client.toml.
pub fn client_file_path(flag: Option<PathBuf>) -> PathBuf {
    freeflow_client::cluster_file::cluster_file_path(flag)
}

/// Connect a client to the cluster the client file names.
pub async fn connect(flag: Option<PathBuf>) -> anyhow::Result<freeflow_client::Client> {
    let path = client_file_path(flag);
    if !path.exists() {
        return Err(ConfigError(format!(
            "no cluster file at {}: start a cluster with `freeflow up`, or name one with --cluster FILE",
            path.display()
        ))
        .into());
    }
    let not_usable = |error: freeflow_client::ClientError| ConfigError(error.to_string());
    let file = ClientFile::read(&path).map_err(not_usable)?;
    let config = file
        .client_config(&path, format!("freeflow-cli-{}", std::process::id()))
        .map_err(not_usable)?;
    freeflow_client::Client::connect(config)
        .await
        .with_context(|| {
            format!(
                "cannot reach the cluster of {} (metadata server {})",
                path.display(),
                file.meta_address
            )
        })
}

/// Connect as [`connect`] does, run `work` with the client, then shut the client down
/// however the work ended. A client that just exits keeps its session and cache leases at
/// the meta server until they run out, and every other client's change they cover waits
/// that long (10 s by default): every command that connects goes through here.
pub async fn with_client<T>(
    flag: Option<PathBuf>,
    work: impl AsyncFnOnce(&freeflow_client::Client) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let client = connect(flag).await?;
    let result = work(&client).await;
    client.shutdown().await;
    result
}
