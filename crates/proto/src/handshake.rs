//! The connection handshake (DESIGN.md §8). The server speaks first with a nonce; the client
//! proves it holds the cluster key and sends its own nonce; the server proves the same.
//! Proofs are BLAKE3 keyed hashes computed by the RPC layer; this module only defines the
//! messages.

use serde::{Deserialize, Serialize};

/// Sent by the server on accept (opcode [`crate::frame::OPCODE_HELLO`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub nonce: [u8; 32],
    /// Who the server is: "meta" or "io:<server id>".
    pub identity: String,
    /// Payload bytes this connection may have in flight (the flow-control window).
    pub window_bytes: u32,
    /// Largest payload the server accepts in one frame.
    pub payload_length_max: u32,
    /// The server's boot epoch (a metadata server's; 0 for servers without one): a client
    /// that sees it change knows the server restarted and replays what it kept.
    pub epoch: u64,
}

/// The client's answer (opcode [`crate::frame::OPCODE_AUTHENTICATE`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Authenticate {
    pub proof: [u8; 32],
    pub client_nonce: [u8; 32],
    pub client_name: String,
    /// Random per client process (0: a peer that keeps no state at the server, like an I/O
    /// server). Mutations are identified by (client id, request id) and applied once.
    pub client_id: u64,
}

/// The server's reply to `Authenticate` (as `Result<ServerProof, WireError>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerProof {
    pub proof: [u8; 32],
    /// Where clients reach every member of the service, when it has several (a replicated
    /// metadata cluster's members, as its membership has them now); empty otherwise. Sent
    /// after authentication only, so clients learn members added since they started.
    pub members: Vec<String>,
}
