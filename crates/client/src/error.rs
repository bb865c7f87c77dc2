//! The client library's one error type.
//!
//! Every error says what failed and where: the operation, the path or inode, and the server
//! (its id and address) when a server was involved, so that a message printed by the CLI is
//! enough to act on. [`ClientError::code`] is the single table the mount maps to errno: the
//! codes are Linux errno numbers already (see `freeflow_proto::ErrorCode`).

use freeflow_proto::ErrorCode;
use freeflow_rpc::RpcError;
use freeflow_types::{InodeId, ServerId};

#[derive(Clone, Debug, thiserror::Error)]
pub enum ClientError {
    /// A request to the metadata server failed (or the server refused it).
    #[error("{operation} {target}: {source} (meta server {address})")]
    Meta {
        operation: &'static str,
        /// What the request was about, e.g. `parent 1 name "a"` or `inode 7`.
        target: String,
        address: String,
        source: RpcError,
    },
    /// A request to an I/O server failed (or the server refused it).
    #[error("{operation} {target}: {source} (I/O server {server_id} at {address})")]
    Io {
        operation: &'static str,
        /// What the request was about, e.g. `inode 7 stripe 2`.
        target: String,
        server_id: ServerId,
        address: String,
        source: RpcError,
    },
    /// A layout names a server the meta server does not list.
    #[error("I/O server {server_id} holds data of inode {inode} but is not registered at the meta server")]
    ServerUnknown { server_id: ServerId, inode: InodeId },
    /// A check on the client side refused an operation on an inode.
    #[error("inode {inode}: {reason}")]
    Inode {
        inode: InodeId,
        code: ErrorCode,
        reason: String,
    },
    /// A check on the client side refused a path.
    #[error("{path}: {reason}")]
    Path {
        path: String,
        code: ErrorCode,
        reason: String,
    },
    /// An error of an operation on a path, with the path for context.
    #[error("{path}: {source}")]
    AtPath {
        path: String,
        source: Box<ClientError>,
    },
    /// A write sent earlier through this handle failed; the data it carried is not stored.
    #[error("an earlier write to inode {inode} failed: {source}")]
    EarlierWrite {
        inode: InodeId,
        source: Box<ClientError>,
    },
    /// The configuration is not usable.
    #[error("invalid client configuration: {0}")]
    Config(String),
}

impl ClientError {
    /// The POSIX error code for this error: what the mount returns as errno.
    pub fn code(&self) -> ErrorCode {
        match self {
            ClientError::Meta { source, .. } | ClientError::Io { source, .. } => source.code(),
            ClientError::ServerUnknown { .. } => ErrorCode::Unreachable,
            ClientError::Inode { code, .. } | ClientError::Path { code, .. } => *code,
            ClientError::AtPath { source, .. } | ClientError::EarlierWrite { source, .. } => {
                source.code()
            }
            ClientError::Config(_) => ErrorCode::InvalidArgument,
        }
    }

    /// The I/O server this error failed to reach (refused connection, broken connection,
    /// timeout, or not registered), if that is what it is: its data is unavailable for now.
    pub fn unreachable_io_server(&self) -> Option<ServerId> {
        match self {
            ClientError::Io {
                server_id,
                source:
                    RpcError::Connect { .. }
                    | RpcError::Disconnected { .. }
                    | RpcError::Handshake { .. }
                    | RpcError::TimedOut { .. },
                ..
            } => Some(*server_id),
            ClientError::ServerUnknown { server_id, .. } => Some(*server_id),
            ClientError::AtPath { source, .. } | ClientError::EarlierWrite { source, .. } => {
                source.unreachable_io_server()
            }
            _ => None,
        }
    }

    /// Wrap this error with the path it happened on, unless it already names one.
    pub fn at_path(self, path: &str) -> ClientError {
        match self {
            ClientError::Path { .. } | ClientError::AtPath { .. } => self,
            other => ClientError::AtPath {
                path: path.to_string(),
                source: Box::new(other),
            },
        }
    }

    pub(crate) fn inode(inode: InodeId, code: ErrorCode, reason: impl Into<String>) -> ClientError {
        ClientError::Inode {
            inode,
            code,
            reason: reason.into(),
        }
    }

    pub(crate) fn path(path: &str, code: ErrorCode, reason: impl Into<String>) -> ClientError {
        ClientError::Path {
            path: path.to_string(),
            code,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_proto::WireError;

    #[test]
    fn remote_errors_keep_the_server_code() {
        let error = ClientError::Meta {
            operation: "Lookup",
            target: "parent 1 name \"a\"".to_string(),
            address: "127.0.0.1:7000".to_string(),
            source: RpcError::Remote(WireError::new(ErrorCode::NotFound, "no entry a in 1")),
        };
        assert_eq!(error.code(), ErrorCode::NotFound);
        let wrapped = error.at_path("/a");
        assert_eq!(wrapped.code(), ErrorCode::NotFound);
        let message = wrapped.to_string();
        assert!(message.starts_with("/a: Lookup"), "{message}");
        assert!(message.contains("127.0.0.1:7000"), "{message}");
    }

    #[test]
    fn transport_errors_map_to_unreachable_and_timed_out() {
        let down = ClientError::Io {
            operation: "WriteObject",
            target: "inode 5 stripe 1".to_string(),
            server_id: 3,
            address: "10.0.0.3:7100".to_string(),
            source: RpcError::Connect {
                address: "10.0.0.3:7100".to_string(),
                reason: "connection refused".to_string(),
            },
        };
        assert_eq!(down.code(), ErrorCode::Unreachable);
        assert!(down.to_string().contains("I/O server 3 at 10.0.0.3:7100"));
        let slow = ClientError::Io {
            operation: "ReadObject",
            target: "inode 5 stripe 0".to_string(),
            server_id: 2,
            address: "10.0.0.2:7100".to_string(),
            source: RpcError::TimedOut {
                address: "10.0.0.2:7100".to_string(),
                request: "ReadObject",
                timeout_ms: 30000,
            },
        };
        assert_eq!(slow.code(), ErrorCode::TimedOut);
        let earlier = ClientError::EarlierWrite {
            inode: 5,
            source: Box::new(slow),
        };
        assert_eq!(earlier.code(), ErrorCode::TimedOut);
    }

    #[test]
    fn local_errors_carry_their_own_code() {
        assert_eq!(
            ClientError::path("/x", ErrorCode::Loop, "too many symlinks").code(),
            ErrorCode::Loop
        );
        assert_eq!(
            ClientError::inode(9, ErrorCode::IsDirectory, "open for write").code(),
            ErrorCode::IsDirectory
        );
        assert_eq!(
            ClientError::Config("x".into()).code(),
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            ClientError::ServerUnknown {
                server_id: 4,
                inode: 9
            }
            .code(),
            ErrorCode::Unreachable
        );
        // A path error is not wrapped twice.
        let error = ClientError::path("/x", ErrorCode::Loop, "loop").at_path("/y");
        assert_eq!(error.to_string(), "/x: loop");
    }
}
