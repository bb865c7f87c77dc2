//! Errors at the I/O server's two boundaries: [`StoreError`] for one object request
//! (mapped to a wire error code for the reply) and [`IoServerError`] for starting and
//! running the server (reported to whoever started it).

use std::io;
use std::path::PathBuf;

use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::{limits, ObjectId, ServerId};

/// Why one object operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "object {}: range at offset {offset} of {length_bytes} bytes passes the largest file size {}",
        object_name(*object),
        limits::FILE_SIZE_MAX
    )]
    FileTooBig {
        object: ObjectId,
        offset: u64,
        length_bytes: u64,
    },
    #[error(
        "request of {length_bytes} bytes exceeds the bound of {} bytes per request",
        limits::IO_REQUEST_BYTES_MAX
    )]
    RequestTooLong { length_bytes: u64 },
    #[error(
        "an allocation of {length_bytes} bytes exceeds the bound of {} bytes per request",
        limits::ALLOCATE_BYTES_MAX
    )]
    AllocationTooLong { length_bytes: u64 },
    #[error("{count} objects in one request exceed the bound of {max}")]
    TooManyObjects { count: usize, max: usize },
    #[error("object {}: its file was deleted; the write is refused", object_name(*object))]
    Removed { object: ObjectId },
    #[error("I/O server {server_id}: no space left on device for {}", path.display())]
    NoSpace { server_id: ServerId, path: PathBuf },
    #[error("I/O server {server_id}: {operation} {}: {source}", path.display())]
    Io {
        server_id: ServerId,
        operation: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl StoreError {
    /// Classifies an I/O error on `path`: disk full (or quota) becomes `NoSpace`.
    pub fn from_io(
        server_id: ServerId,
        operation: &'static str,
        path: PathBuf,
        source: io::Error,
    ) -> StoreError {
        match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => StoreError::NoSpace { server_id, path },
            _ => StoreError::Io {
                server_id,
                operation,
                path,
                source,
            },
        }
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            StoreError::FileTooBig { .. } => ErrorCode::FileTooBig,
            StoreError::RequestTooLong { .. }
            | StoreError::AllocationTooLong { .. }
            | StoreError::TooManyObjects { .. } => ErrorCode::InvalidArgument,
            StoreError::Removed { .. } => ErrorCode::Stale,
            StoreError::NoSpace { .. } => ErrorCode::NoSpace,
            StoreError::Io { source, .. } => source
                .raw_os_error()
                .map(ErrorCode::from_errno)
                .unwrap_or(ErrorCode::Io),
        }
    }
}

impl From<StoreError> for WireError {
    fn from(error: StoreError) -> WireError {
        WireError::new(error.code(), error.to_string())
    }
}

/// `<inode as 16 hex>.<stripe>`, the object's file name and its name in messages.
pub fn object_name(object: ObjectId) -> String {
    format!("{:016x}.{}", object.inode, object.stripe_index)
}

/// Why the I/O server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum IoServerError {
    #[error("invalid I/O server config: {0}")]
    InvalidConfig(String),
    #[error(
        "data directory {} belongs to I/O server {stored}, but this server is configured as {configured}",
        data_dir.display()
    )]
    ServerIdMismatch {
        data_dir: PathBuf,
        stored: ServerId,
        configured: ServerId,
    },
    #[error("server id file {}: {reason}", path.display())]
    ServerIdFile { path: PathBuf, reason: String },
    #[error("data directory {}: {source}", path.display())]
    DataDir { path: PathBuf, source: io::Error },
    #[error("cannot listen on {address}: {source}")]
    Bind { address: String, source: io::Error },
    #[error("cannot start the disk engine: {0}")]
    Engine(io::Error),
    #[error("server stopped: {0}")]
    Serve(io::Error),
}
