//! The data directory's owner: a `server-id` file written on first start, so a directory can
//! never be served under another server's id (which would make the meta server's layouts
//! point at the wrong objects).
//!
//! Format: the id in decimal followed by `\n`. Written once, atomically (temporary file,
//! fsync, rename, fsync of the directory), so a crash leaves either no file or a whole one.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

use freeflow_types::ServerId;

use crate::error::IoServerError;

pub const SERVER_ID_FILE: &str = "server-id";
/// Present from the start that made the data directory until the meta server acknowledged
/// that the directory is new (a server that lost its data copies everything, and must say
/// so again if it restarts before it was heard).
pub const FRESH_FILE: &str = "fresh";

/// Whether the data directory is new and the meta server has not been told yet.
pub fn is_fresh(data_dir: &Path) -> bool {
    data_dir.join(FRESH_FILE).exists()
}

/// The meta server knows the data directory is new.
pub fn fresh_told(data_dir: &Path) -> io::Result<()> {
    match fs::remove_file(data_dir.join(FRESH_FILE)) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// Makes `data_dir` if needed and checks (or, on first start, writes) its server id.
/// True when the directory had no identity yet: this start made it (it holds no object).
pub fn claim_data_dir(data_dir: &Path, server_id: ServerId) -> Result<bool, IoServerError> {
    let data_dir_error = |source: io::Error| IoServerError::DataDir {
        path: data_dir.to_path_buf(),
        source,
    };
    fs::create_dir_all(data_dir).map_err(data_dir_error)?;
    let path = data_dir.join(SERVER_ID_FILE);
    match fs::read_to_string(&path) {
        Ok(text) => {
            let stored: ServerId =
                text.trim_end_matches('\n')
                    .parse()
                    .map_err(|_| IoServerError::ServerIdFile {
                        path: path.clone(),
                        reason: format!("expected a decimal server id, found {text:?}"),
                    })?;
            if stored != server_id {
                return Err(IoServerError::ServerIdMismatch {
                    data_dir: data_dir.to_path_buf(),
                    stored,
                    configured: server_id,
                });
            }
            Ok(false)
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            write_server_id(data_dir, server_id)
                .map(|()| true)
                .map_err(|source| IoServerError::ServerIdFile {
                    path,
                    reason: format!("cannot write: {source}"),
                })
        }
        Err(error) => Err(IoServerError::ServerIdFile {
            path,
            reason: format!("cannot read: {error}"),
        }),
    }
}

fn write_server_id(data_dir: &Path, server_id: ServerId) -> io::Result<()> {
    File::create(data_dir.join(FRESH_FILE))?.sync_all()?;
    let temporary = data_dir.join(format!("{SERVER_ID_FILE}.tmp"));
    let mut file = File::create(&temporary)?;
    file.write_all(format!("{server_id}\n").as_bytes())?;
    file.sync_all()?;
    fs::rename(&temporary, data_dir.join(SERVER_ID_FILE))?;
    File::open(data_dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_start_writes_the_id_and_later_starts_check_it() {
        let directory = tempfile::tempdir().unwrap();
        let data_dir = directory.path().join("data");
        claim_data_dir(&data_dir, 7).unwrap();
        assert_eq!(
            fs::read_to_string(data_dir.join(SERVER_ID_FILE)).unwrap(),
            "7\n"
        );
        claim_data_dir(&data_dir, 7).unwrap();
        let error = claim_data_dir(&data_dir, 8).unwrap_err();
        assert!(matches!(
            error,
            IoServerError::ServerIdMismatch {
                stored: 7,
                configured: 8,
                ..
            }
        ));
        let message = error.to_string();
        assert!(
            message.contains("server 7") && message.contains("configured as 8"),
            "{message}"
        );
    }

    #[test]
    fn a_garbled_id_file_is_refused() {
        let directory = tempfile::tempdir().unwrap();
        fs::write(directory.path().join(SERVER_ID_FILE), "seven\n").unwrap();
        let error = claim_data_dir(directory.path(), 7).unwrap_err();
        assert!(
            matches!(error, IoServerError::ServerIdFile { .. }),
            "{error}"
        );
    }

    /// Issue 8: whatever a `server-id` file holds, starting on it gives a clear error or
    /// goes on, never a panic, and never serves a directory claimed by another id.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
            #[test]
            fn any_server_id_file_is_read_or_refused(contents in prop::collection::vec(any::<u8>(), 0..24)) {
                let directory = tempfile::tempdir().unwrap();
                fs::write(directory.path().join(SERVER_ID_FILE), &contents).unwrap();
                if claim_data_dir(directory.path(), 12).is_ok() {
                    let text = std::str::from_utf8(&contents).expect("accepted text is UTF-8");
                    prop_assert_eq!(text.trim_end_matches('\n').parse::<u32>(), Ok(12));
                }
                // The id as written is always accepted.
                fs::write(directory.path().join(SERVER_ID_FILE), b"12\n").unwrap();
                prop_assert!(claim_data_dir(directory.path(), 12).is_ok());
            }
        }
    }
}
