//! The metadata servers' Raft service (issue 11): openraft's three peer calls and a membership probe, on each
//! meta server's `raft_address`.
//!
//! Each request's payload is openraft's request encoded with postcard, and each reply's
//! payload is openraft's `Result` of its response and its error, encoded the same way;
//! the headers are empty. The messages are openraft's own types, so this crate names only
//! the opcodes (400-409).

use crate::requests;

requests! {
    /// Payload: `AppendEntriesRequest`; reply payload: `Result<AppendEntriesResponse,
    /// RaftError>`. `target`: the node id the sender means (openraft's messages name none):
    /// a member answering at an address another member had refuses it.
    RaftAppend = 400 => () { target: u64 }
    /// Payload: `VoteRequest`; reply payload: `Result<VoteResponse, RaftError>`.
    RaftVote = 401 => () { target: u64 }
    /// Payload: `InstallSnapshotRequest` (one chunk); reply payload:
    /// `Result<InstallSnapshotResponse, RaftError<InstallSnapshotError>>`.
    RaftSnapshot = 402 => () { target: u64 }
    /// The membership as this member knows it (a starting member asks its peers before
    /// it proposes one). Reply payload: the meta crate's `MembersSeen`.
    RaftMembers = 403 => () {}
}
