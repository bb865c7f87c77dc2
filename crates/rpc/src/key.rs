//! The cluster key: 32 random bytes shared by every server and client of one cluster,
//! kept in a file of 64 hex digits readable only by its owner.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKey([u8; 32]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(<secret>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read cluster key file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cluster key file {path} is not 64 hex digits")]
    Malformed { path: PathBuf },
    #[error("cluster key file {path} is readable by others (mode {mode:o}); run chmod 600 on it")]
    TooOpen { path: PathBuf, mode: u32 },
}

impl ClusterKey {
    pub fn from_bytes(bytes: [u8; 32]) -> ClusterKey {
        ClusterKey(bytes)
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A new random key.
    pub fn generate() -> std::io::Result<ClusterKey> {
        Ok(ClusterKey(crate::random_nonce()?))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<ClusterKey> {
        let text = text.trim();
        if text.len() != 64 || !text.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; 32];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16).ok()?;
        }
        Some(ClusterKey(bytes))
    }

    /// Load a key file, refusing one that group or others can read.
    pub fn load(path: &Path) -> Result<ClusterKey, KeyError> {
        let read_error = |source| KeyError::Read {
            path: path.to_owned(),
            source,
        };
        let metadata = std::fs::metadata(path).map_err(read_error)?;
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(KeyError::TooOpen {
                path: path.to_owned(),
                mode,
            });
        }
        let text = std::fs::read_to_string(path).map_err(read_error)?;
        ClusterKey::from_hex(&text).ok_or_else(|| KeyError::Malformed {
            path: path.to_owned(),
        })
    }

    /// Write the key to a new file with mode 0600; fails if the file exists.
    pub fn write_new(&self, path: &Path) -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        writeln!(file, "{}", self.to_hex())?;
        file.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_file_round_trip_and_checks() {
        let directory = std::env::temp_dir().join(format!("ff-key-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("cluster.key");
        let _ = std::fs::remove_file(&path);
        let key = ClusterKey::generate().unwrap();
        key.write_new(&path).unwrap();
        assert_eq!(ClusterKey::load(&path).unwrap(), key);
        assert!(
            key.write_new(&path).is_err(),
            "an existing key file is never overwritten"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            ClusterKey::load(&path),
            Err(KeyError::TooOpen { .. })
        ));
        std::fs::write(&path, "not hex\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            ClusterKey::load(&path),
            Err(KeyError::Malformed { .. })
        ));
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
