//! The wire contract of Freeflow, defined once.
//!
//! Every message is a frame (see [`frame`]) whose opcode names a request type below. The
//! frame's header section is the postcard encoding of the request struct (client → server)
//! or of `Result<Reply, WireError>` (server → client); bulk data travels in the frame's
//! payload section, never inside the header. Opcode and error numbers are stable: they are
//! never renumbered or reused (see docs/protocol.md).

pub mod error;
pub mod frame;
pub mod handshake;
pub mod io;
pub mod meta;
pub mod raft;

pub use error::{ErrorCode, WireError};

use serde::{de::DeserializeOwned, Serialize};

/// Protocol version carried in every frame; a peer with another version is refused.
pub const PROTOCOL_VERSION: u8 = 10;

/// A request message: its stable opcode and the type of its reply.
pub trait Request: Serialize + DeserializeOwned + Send + 'static {
    const OPCODE: u16;
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned + Send + 'static;
}

/// Encode a message for the header section of a frame.
pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    // Encoding into a Vec only fails for types serde cannot express; ours are all plain
    // structs, so a failure is a programmer error.
    postcard::to_stdvec(message).expect("protocol messages always encode")
}

/// Decode a message from the header section of a frame. Bytes from the network: never panics.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    postcard::from_bytes(bytes)
        .map_err(|error| WireError::new(ErrorCode::Protocol, format!("malformed message: {error}")))
}

/// Defines request structs with their opcodes and reply types.
macro_rules! requests {
    ($( $(#[$meta:meta])* $name:ident = $opcode:literal => $reply:ty { $( $(#[$fmeta:meta])* $field:ident : $ty:ty ),* $(,)? } )*) => {
        $(
            $(#[$meta])*
            #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
            pub struct $name { $( $(#[$fmeta])* pub $field: $ty ),* }

            impl $crate::Request for $name {
                const OPCODE: u16 = $opcode;
                const NAME: &'static str = stringify!($name);
                type Reply = $reply;
            }
        )*

        /// Every opcode of this service with its request name, for logs and docs.
        pub const OPCODES: &[(u16, &str)] = &[ $( ($opcode, stringify!($name)) ),* ];
    };
}
pub(crate) use requests;
