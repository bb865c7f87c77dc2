//! What the examples share: a client configuration from a cluster's `client.toml` (as
//! `freeflow up` and `freeflow init` write it: `meta_address`, and `key_file` relative to
//! the file).

use std::path::Path;

use freeflow_client::{ClientConfig, ClusterKey};

pub fn client_config(client_file: &Path) -> Result<ClientConfig, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(client_file)?;
    let table: toml::Table = toml::from_str(&text)?;
    let meta_address = table["meta_address"]
        .as_str()
        .ok_or("meta_address missing")?
        .to_string();
    let key_file = client_file
        .parent()
        .unwrap_or(Path::new("."))
        .join(table["key_file"].as_str().ok_or("key_file missing")?);
    Ok(ClientConfig::new(
        meta_address,
        ClusterKey::load(&key_file)?,
    ))
}
