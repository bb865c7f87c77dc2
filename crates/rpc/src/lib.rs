//! Freeflow's RPC layer: frames over a [`Transport`], many requests in flight per connection
//! with replies matched by request id in any order, a flow-control window per connection,
//! and the cluster-key handshake on every connection (DESIGN.md §6.6, §8).
//!
//! Servers implement [`Service`] and run [`serve`]; clients hold a [`Connection`] and
//! `call` typed requests from `freeflow_proto`. Payloads are `bytes::Bytes` handed through
//! without copying. Anything malformed that a peer sends closes that one connection with a
//! logged reason; it never reaches a panic.

mod client;
mod codec;
pub mod credit;
mod error;
mod key;
pub mod local;
mod metrics;
pub mod net;
mod server;
pub mod shared;
mod transport;

pub use client::{
    ConnectOptions, Connection, LeaderSearch, LIVENESS_TIMEOUT_MS_DEFAULT, LIVENESS_TIMEOUT_MS_MIN,
};
pub use codec::{
    payload_checksum_for, read_fixed_header, read_frame, read_frame_body, read_frame_covering,
    read_shared_frame_body, write_frame, write_frame_with, write_shared_frame, FixedHeader,
    FrameExtras, FrameLimits, FrameReadError, RawFrame, SharedRef,
};
pub use error::RpcError;
pub use key::{ClusterKey, KeyError};
pub use metrics::ServerMetrics;
pub use net::Network;
pub use server::{
    handle, serve, serve_connection, serve_with_unix, Frame, MemberList, PeerInfo, Reply,
    ServerOptions, Service,
};
pub use transport::{
    unix_socket_path, ConnectFuture, ReadHalf, Tcp, Transport, Unix, WriteHalf, UNIX_ADDRESS_PREFIX,
};

/// Domain-separation strings for the handshake proofs.
const CLIENT_PROOF_DOMAIN: &[u8] = b"freeflow v1 client proof";
const SERVER_PROOF_DOMAIN: &[u8] = b"freeflow v1 server proof";

fn proof(key: &ClusterKey, domain: &[u8], nonce: &[u8; 32]) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_keyed(key.bytes());
    hasher.update(domain);
    hasher.update(nonce);
    *hasher.finalize().as_bytes()
}

/// Constant-time comparison of two proofs.
fn proofs_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    blake3::Hash::from(*a) == blake3::Hash::from(*b)
}

/// A random client id for `ConnectOptions::client_id` (never 0, which means none).
pub fn random_client_id() -> std::io::Result<u64> {
    let nonce = random_nonce()?;
    let id = u64::from_le_bytes(nonce[..8].try_into().expect("8 bytes"));
    Ok(id.max(1))
}

fn random_nonce() -> std::io::Result<[u8; 32]> {
    use std::io::Read;
    let mut nonce = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut nonce)?;
    Ok(nonce)
}
