//! The cluster file (`client.toml`, written by `freeflow up` and `freeflow init`): where the
//! meta server is and which key proves membership. Every program that reaches a cluster
//! without a mount (the CLI, the Python package) reads it here, so they agree on its format,
//! on where it is looked for and on who the caller is.
//!
//! ```toml
//! meta_address = "127.0.0.1:7700"
//! key_file = "cluster.key"      # relative to this file's directory
//! call_timeout_ms = 30000       # optional
//! ```

use std::path::{Path, PathBuf};

use freeflow_proto::meta::Caller;
use freeflow_rpc::ClusterKey;
use serde::{Deserialize, Serialize};

use crate::{ClientConfig, ClientError, CALL_TIMEOUT_MS_DEFAULT};

/// The environment variable naming the cluster file when no path is given.
pub const CLUSTER_FILE_ENV: &str = "FREEFLOW_CLUSTER";
/// The cluster file used when neither a path nor the environment names one.
pub const CLUSTER_FILE_DEFAULT: &str = "./freeflow-data/client.toml";

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientFile {
    pub meta_address: String,
    pub key_file: PathBuf,
    /// Milliseconds a call may wait for its reply before failing.
    #[serde(default = "default_call_timeout_ms")]
    pub call_timeout_ms: u64,
}

fn default_call_timeout_ms() -> u64 {
    CALL_TIMEOUT_MS_DEFAULT
}

/// The cluster file to use: `given`, then `$FREEFLOW_CLUSTER`, then
/// `./freeflow-data/client.toml`.
pub fn cluster_file_path(given: Option<PathBuf>) -> PathBuf {
    given
        .or_else(|| std::env::var_os(CLUSTER_FILE_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(CLUSTER_FILE_DEFAULT))
}

/// `path` taken relative to the directory of `file` unless absolute.
pub fn relative_to(file: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_owned()
    } else {
        file.parent().unwrap_or(Path::new(".")).join(path)
    }
}

impl ClientFile {
    /// Read and parse a cluster file; every error names the file.
    pub fn read(path: &Path) -> Result<ClientFile, ClientError> {
        if !path.exists() {
            return Err(ClientError::Config(format!(
                "no cluster file at {}: start a cluster with `freeflow up`, or name its client.toml",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|error| {
            ClientError::Config(format!(
                "cannot read cluster file {}: {error}",
                path.display()
            ))
        })?;
        toml::from_str(&text).map_err(|error| {
            ClientError::Config(format!("cluster file {}: {error}", path.display()))
        })
    }

    /// The key this file names, read from beside the file unless its path is absolute.
    pub fn load_key(&self, file_path: &Path) -> Result<ClusterKey, ClientError> {
        ClusterKey::load(&relative_to(file_path, &self.key_file))
            .map_err(|error| ClientError::Config(error.to_string()))
    }

    /// A client configuration for this cluster with the documented defaults, acting as the
    /// calling process's user.
    pub fn client_config(
        &self,
        file_path: &Path,
        client_name: impl Into<String>,
    ) -> Result<ClientConfig, ClientError> {
        let key = self.load_key(file_path)?;
        let mut config = ClientConfig::new(self.meta_address.clone(), key);
        config.call_timeout_ms = self.call_timeout_ms;
        config.client_name = client_name.into();
        config.caller = current_caller();
        Ok(config)
    }
}

/// The calling process's user and groups, for permission checks at the meta server.
pub fn current_caller() -> Caller {
    // SAFETY: these calls have no preconditions and cannot fail.
    let (user_id, group_id) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut groups = vec![0 as libc::gid_t; 256];
    // SAFETY: the buffer holds 256 entries and we pass that length.
    let count = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    groups.truncate(count.max(0) as usize);
    Caller {
        user_id,
        group_id,
        groups,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_file_names_its_problem() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("client.toml");
        let error = ClientFile::read(&missing).unwrap_err().to_string();
        assert!(error.contains("no cluster file at"), "{error}");

        std::fs::write(&missing, "meta_address = 7\n").unwrap();
        let error = ClientFile::read(&missing).unwrap_err().to_string();
        assert!(error.contains("client.toml"), "{error}");

        std::fs::write(&missing, "meta_address = \"h:1\"\nkey_file = \"k\"\n").unwrap();
        let file = ClientFile::read(&missing).unwrap();
        assert_eq!(file.call_timeout_ms, CALL_TIMEOUT_MS_DEFAULT);
        let error = file.client_config(&missing, "t").unwrap_err().to_string();
        assert!(
            error.contains(&dir.path().join("k").display().to_string()),
            "{error}"
        );
    }
}
