//! The frame: a fixed 32-byte header, then `header_length` bytes of postcard-encoded
//! message, then `payload_length` bytes of raw payload. All integers little-endian.
//!
//! | offset | size | field          | meaning                                              |
//! |--------|------|----------------|------------------------------------------------------|
//! | 0      | 4    | magic          | `FFLW` (0x574C4646 read as little-endian u32)        |
//! | 4      | 1    | version        | [`crate::PROTOCOL_VERSION`]                          |
//! | 5      | 1    | flags          | [`FLAG_REPLY`]                                       |
//! | 6      | 2    | opcode         | request type (replies repeat the request's opcode)  |
//! | 8      | 8    | request_id     | chosen by the client, echoed in the reply           |
//! | 16     | 4    | header_length  | ≤ [`HEADER_LENGTH_MAX`]                              |
//! | 20     | 4    | payload_length | ≤ the receiver's payload bound                      |
//! | 24     | 4    | checksum       | CRC-32C of bytes 0..24 and 28..32, the header section, the payload (not on Unix sockets: `freeflow_rpc::payload_checksum_for`) |
//! | 28     | 4    | credit         | with [`FLAG_CREDIT`] (replies only): the window this connection has now; else zero |

/// The frame magic, the bytes `FFLW`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FFLW");

/// Size of the fixed frame header.
pub const FIXED_HEADER_BYTES: usize = 32;

/// Largest header section (the encoded message). Readdir replies and xattr values are the
/// largest messages; 1 MiB holds 4096 readdir-plus entries with room to spare.
pub const HEADER_LENGTH_MAX: u32 = 1 << 20;

/// Default largest payload: one 8 MiB I/O request plus nothing else.
pub const PAYLOAD_LENGTH_MAX_DEFAULT: u32 = 8 << 20;

/// Set on every reply frame.
pub const FLAG_REPLY: u8 = 0x01;
/// On a request: the same request (same request id, same client) was sent before on a
/// connection that was lost; a server that applied it answers as it did then.
pub const FLAG_RESEND: u8 = 0x02;
/// On a request: a mutation the client had answered but not yet durable when the server
/// restarted, sent again during the recovery window; the payload is the original reply.
pub const FLAG_REPLAY: u8 = 0x04;

/// On a reply: the `credit` word holds the payload bytes this connection may now have in
/// flight (its window, which the server grows, shrinks and takes back while it runs; 0:
/// send no payload until a later reply gives some). Every reply of a server carries it;
/// an unasked ping reply carries a change between replies (docs/protocol.md, "Credits").
pub const FLAG_CREDIT: u8 = 0x08;

/// On a request over a Unix socket: the payload is not on the wire but in a region of
/// memory the client shared with the server (`freeflow_proto::io::ShareRegion`).
/// `payload_length` still gives the payload's length (credits and budgets count it as any
/// payload); the wire carries, in its place, [`SHARED_PAYLOAD_REF_BYTES`]: the region's
/// name and the payload's offset in it, two little-endian u64s.
pub const FLAG_SHARED_PAYLOAD: u8 = 0x10;

/// Bytes on the wire in place of a shared payload.
pub const SHARED_PAYLOAD_REF_BYTES: usize = 16;

/// Opcodes of the connection handshake, handled by the RPC layer itself.
pub const OPCODE_HELLO: u16 = 1;
pub const OPCODE_AUTHENTICATE: u16 = 2;
/// "Are you there?": a client that waits for replies and has heard nothing for a while
/// sends it (request id 0, empty sections); the server's connection answers it with an
/// empty reply without taking a request slot, and sends such replies unasked while its
/// reading waits for room (docs/protocol.md, "Liveness").
pub const OPCODE_PING: u16 = 3;

/// The fixed header of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub flags: u8,
    pub opcode: u16,
    pub request_id: u64,
    pub header_length: u32,
    pub payload_length: u32,
    pub checksum: u32,
    /// The connection's window, with [`FLAG_CREDIT`]; zero otherwise.
    pub credit: u32,
}

/// Why a fixed header was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:#010x} (not a Freeflow peer)")]
    BadMagic(u32),
    #[error("protocol version {0} (this side speaks {PROTOCOL_VERSION})", PROTOCOL_VERSION = crate::PROTOCOL_VERSION)]
    BadVersion(u8),
    #[error("header section of {0} bytes exceeds the bound of {HEADER_LENGTH_MAX}")]
    HeaderTooLong(u32),
    #[error("payload of {length} bytes exceeds the bound of {bound}")]
    PayloadTooLong { length: u32, bound: u32 },
    #[error("checksum mismatch: frame says {expected:#010x}, contents give {actual:#010x}")]
    BadChecksum { expected: u32, actual: u32 },
    #[error("credit word is {0:#x} on a frame without the credit flag")]
    CreditWithoutFlag(u32),
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FIXED_HEADER_BYTES] {
        let mut bytes = [0u8; FIXED_HEADER_BYTES];
        bytes[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        bytes[4] = crate::PROTOCOL_VERSION;
        bytes[5] = self.flags;
        bytes[6..8].copy_from_slice(&self.opcode.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.header_length.to_le_bytes());
        bytes[20..24].copy_from_slice(&self.payload_length.to_le_bytes());
        bytes[24..28].copy_from_slice(&self.checksum.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.credit.to_le_bytes());
        bytes
    }

    /// Parse and bound-check a fixed header. `payload_length_max` is the receiver's bound.
    pub fn decode(
        bytes: &[u8; FIXED_HEADER_BYTES],
        payload_length_max: u32,
    ) -> Result<FrameHeader, FrameError> {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if bytes[4] != crate::PROTOCOL_VERSION {
            return Err(FrameError::BadVersion(bytes[4]));
        }
        let header = FrameHeader {
            flags: bytes[5],
            opcode: u16::from_le_bytes([bytes[6], bytes[7]]),
            request_id: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            header_length: u32_at(16),
            payload_length: u32_at(20),
            checksum: u32_at(24),
            credit: u32_at(28),
        };
        if header.flags & FLAG_CREDIT == 0 && header.credit != 0 {
            return Err(FrameError::CreditWithoutFlag(header.credit));
        }
        if header.header_length > HEADER_LENGTH_MAX {
            return Err(FrameError::HeaderTooLong(header.header_length));
        }
        if header.payload_length > payload_length_max {
            return Err(FrameError::PayloadTooLong {
                length: header.payload_length,
                bound: payload_length_max,
            });
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let header = FrameHeader {
            flags: FLAG_REPLY,
            opcode: 201,
            request_id: 77,
            header_length: 12,
            payload_length: 4096,
            checksum: 0xdead_beef,
            credit: 0,
        };
        assert_eq!(FrameHeader::decode(&header.encode(), 1 << 20), Ok(header));
        let credited = FrameHeader {
            flags: FLAG_REPLY | FLAG_CREDIT,
            credit: 16 << 20,
            ..header
        };
        assert_eq!(
            FrameHeader::decode(&credited.encode(), 1 << 20),
            Ok(credited)
        );
        assert_eq!(FrameHeader::decode(&header.encode(), 1 << 20), Ok(header));
    }

    #[test]
    fn bounds_and_magic_are_checked() {
        let header = FrameHeader {
            flags: 0,
            opcode: 1,
            request_id: 1,
            header_length: 0,
            payload_length: 5000,
            checksum: 0,
            credit: 0,
        };
        let bytes = header.encode();
        assert_eq!(
            FrameHeader::decode(&bytes, 4096),
            Err(FrameError::PayloadTooLong {
                length: 5000,
                bound: 4096
            })
        );
        let mut bad = bytes;
        bad[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&bad, 1 << 20),
            Err(FrameError::BadMagic(_))
        ));
        let mut bad = bytes;
        bad[4] = 99;
        assert_eq!(
            FrameHeader::decode(&bad, 1 << 20),
            Err(FrameError::BadVersion(99))
        );
        let mut bad = bytes;
        bad[16..20].copy_from_slice(&(HEADER_LENGTH_MAX + 1).to_le_bytes());
        assert_eq!(
            FrameHeader::decode(&bad, 1 << 20),
            Err(FrameError::HeaderTooLong(HEADER_LENGTH_MAX + 1))
        );
        let mut bad = bytes;
        bad[28] = 1;
        assert_eq!(
            FrameHeader::decode(&bad, 1 << 20),
            Err(FrameError::CreditWithoutFlag(1))
        );
    }
}
