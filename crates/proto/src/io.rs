//! Requests served by the I/O servers (opcodes 200-299). Data travels in the payload.

use freeflow_types::{InodeId, ObjectId, ServerId};
use serde::{Deserialize, Serialize};

use crate::requests;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadReply {
    /// Bytes in the payload; fewer than asked when the object ends first. The reader
    /// treats the rest as a hole (zeros) up to the file size it knows from the meta server.
    pub length: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoStats {
    pub server_id: ServerId,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub object_count: u64,
    /// "io_uring" or "threads".
    pub engine: String,
}

requests! {
    /// Write the payload at `offset` of the object, creating the object if needed.
    WriteObject = 200 => () { object: ObjectId, offset: u64 }
    /// Read up to `length` bytes at `offset`; the data comes back in the reply payload.
    ReadObject = 201 => ReadReply { object: ObjectId, offset: u64, length: u32 }
    /// Cut or extend the object to `length` bytes (creating it if it does not exist and
    /// `length` > 0).
    TruncateObject = 202 => () { object: ObjectId, length: u64 }
    /// Make every byte written to these objects durable (fdatasync).
    SyncObjects = 203 => () { objects: Vec<ObjectId> }
    /// Remove the objects of these stripes of an inode; missing objects are not an error.
    RemoveObjects = 204 => () { inode: InodeId, stripes: Vec<u32> }
    ServerStats = 205 => IoStats {}
}
