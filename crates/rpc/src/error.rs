//! Errors of a call, each naming the server address it concerns.

use freeflow_proto::{ErrorCode, WireError};

#[derive(Clone, Debug, thiserror::Error)]
pub enum RpcError {
    #[error("cannot connect to {address}: {reason}")]
    Connect { address: String, reason: String },
    /// The connection failed during the handshake (closed, reset, timed out, malformed).
    #[error("handshake with {address} failed: {reason}")]
    Handshake { address: String, reason: String },
    /// The cluster keys differ: the server refused ours, or it could not prove it holds it.
    #[error("{address} refused the connection: {reason}")]
    Refused { address: String, reason: String },
    #[error("connection to {address} was lost")]
    Disconnected { address: String },
    #[error("{request} to {address} got no reply within {timeout_ms} ms")]
    TimedOut {
        address: String,
        request: &'static str,
        timeout_ms: u64,
    },
    #[error("protocol error from {address}: {reason}")]
    Protocol { address: String, reason: String },
    #[error("{0}")]
    Remote(WireError),
}

impl RpcError {
    /// The error code a caller reports for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            RpcError::Remote(error) => error.code,
            RpcError::TimedOut { .. } => ErrorCode::TimedOut,
            RpcError::Connect { .. } | RpcError::Disconnected { .. } => ErrorCode::Unreachable,
            RpcError::Refused { .. } => ErrorCode::PermissionDenied,
            RpcError::Handshake { .. } => ErrorCode::Unreachable,
            RpcError::Protocol { .. } => ErrorCode::Protocol,
        }
    }

    /// True when the connection is unusable and a retry needs a new one.
    pub fn is_connection_failure(&self) -> bool {
        matches!(
            self,
            RpcError::Connect { .. } | RpcError::Disconnected { .. } | RpcError::Protocol { .. }
        )
    }
}
