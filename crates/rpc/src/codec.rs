//! Reading and writing frames (layout in `freeflow_proto::frame`). A frame is read into one
//! buffer of exactly its size and split into header and payload `Bytes` without copying.
//! A large payload ([`ALIGNED_PAYLOAD_MIN`] bytes or more) starts on a page boundary of its
//! buffer, so an I/O server can hand it to the disk with O_DIRECT as it came off the wire.

use bytes::{Bytes, BytesMut};
use freeflow_proto::frame::{
    FrameError, FrameHeader, FIXED_HEADER_BYTES, FLAG_SHARED_PAYLOAD, SHARED_PAYLOAD_REF_BYTES,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Payloads of at least this many bytes are read so that they start on a page boundary.
pub const ALIGNED_PAYLOAD_MIN: usize = 64 << 10;
/// The boundary such payloads start on (what O_DIRECT asks of memory on Linux file systems).
pub const PAYLOAD_ALIGNMENT: usize = 4096;

/// A frame as read off the wire.
#[derive(Debug)]
pub struct RawFrame {
    pub fixed: FrameHeader,
    pub header: Bytes,
    pub payload: Bytes,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameReadError {
    /// The peer closed the stream between frames: the normal end of a connection.
    #[error("peer closed the connection")]
    Closed,
    #[error("truncated frame: the stream ended inside a frame")]
    Truncated,
    #[error("malformed frame: {0}")]
    Invalid(#[from] FrameError),
    #[error("read failed: {0}")]
    Io(std::io::Error),
    #[error("frame not completed in time")]
    Stalled,
}

fn read_error(error: std::io::Error) -> FrameReadError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameReadError::Truncated
    } else {
        FrameReadError::Io(error)
    }
}

/// Read one frame, checking its bounds before allocating and its checksum (payload
/// included) after reading.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    payload_length_max: u32,
) -> Result<RawFrame, FrameReadError> {
    read_frame_covering(reader, payload_length_max, true).await
}

/// [`read_frame`], with the checksum covering the payload or not (a Unix-socket
/// connection's frames: see [`FrameLimits::payload_checksum`]).
pub async fn read_frame_covering<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    payload_length_max: u32,
    payload_checksum: bool,
) -> Result<RawFrame, FrameReadError> {
    let limits = FrameLimits {
        header_length_max: freeflow_proto::frame::HEADER_LENGTH_MAX,
        payload_length_max,
        header_timeout: None,
        payload_checksum,
    };
    let fixed = read_fixed_header(reader, &limits).await?;
    read_frame_body(reader, fixed).await
}

/// Whether frames sent on a connection over `address` carry a checksum of their payload:
/// not over a Unix socket (`unix:` addresses, and the Unix listener of a server). The
/// checksum is there for bytes that cross a network, where TCP's 16-bit sum lets some
/// corruption through; a Unix socket's bytes go from one process's memory to another's by
/// the kernel's copy, which a checksum computed just before it cannot protect any better
/// than the memory itself, and the two passes over every payload byte were 14% of the
/// `freeflow up` process's CPU on large reads (docs/protocol.md, "Checksum coverage"). A
/// server leaves it out on connections its Unix listener accepted.
pub fn payload_checksum_for(address: &str) -> bool {
    crate::transport::unix_socket_path(address).is_none()
}

/// Bounds a receiver puts on one frame.
#[derive(Clone, Copy, Debug)]
pub struct FrameLimits {
    pub header_length_max: u32,
    pub payload_length_max: u32,
    /// Time the rest of the fixed header may take once its first byte is here.
    pub header_timeout: Option<std::time::Duration>,
    /// Whether the checksum covers the payload (every connection but a Unix socket's:
    /// [`payload_checksum_for`]). Both ends of a connection must agree; a frame from a peer
    /// that does not fails its checksum.
    pub payload_checksum: bool,
}

/// Read and check the fixed header of the next frame. Waits as long as the peer is idle;
/// `limits.header_timeout` bounds the time from its first byte on.
pub async fn read_fixed_header<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    limits: &FrameLimits,
) -> Result<FixedHeader, FrameReadError> {
    let mut bytes = [0u8; FIXED_HEADER_BYTES];
    let first = reader.read(&mut bytes).await.map_err(FrameReadError::Io)?;
    if first == 0 {
        return Err(FrameReadError::Closed);
    }
    let rest = async {
        // Check the magic as soon as it is here, so a stray protocol (an HTTP probe, a port
        // scanner) is turned away at once rather than after waiting for a full header.
        let mut filled = first;
        while filled < 4 {
            let more = reader
                .read(&mut bytes[filled..])
                .await
                .map_err(FrameReadError::Io)?;
            if more == 0 {
                return Err(FrameReadError::Truncated);
            }
            filled += more;
        }
        let magic = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        if magic != freeflow_proto::frame::MAGIC {
            return Err(FrameError::BadMagic(magic).into());
        }
        reader
            .read_exact(&mut bytes[filled..])
            .await
            .map_err(read_error)?;
        Ok::<(), FrameReadError>(())
    };
    match limits.header_timeout {
        Some(timeout) => tokio::time::timeout(timeout, rest)
            .await
            .map_err(|_| FrameReadError::Stalled)??,
        None => rest.await?,
    }
    let header = FrameHeader::decode(&bytes, limits.payload_length_max)?;
    if header.header_length > limits.header_length_max {
        return Err(FrameError::HeaderTooLong(header.header_length).into());
    }
    Ok(FixedHeader {
        header,
        bytes,
        payload_checksum: limits.payload_checksum,
    })
}

/// A checked fixed header and its raw bytes (the checksum covers them).
#[derive(Clone, Copy, Debug)]
pub struct FixedHeader {
    pub header: FrameHeader,
    bytes: [u8; FIXED_HEADER_BYTES],
    /// Whether the checksum covers the payload, from the reader's [`FrameLimits`].
    payload_checksum: bool,
}

/// Read the sections announced by a fixed header into one exact-size buffer and verify
/// the checksum.
pub async fn read_frame_body<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    fixed: FixedHeader,
) -> Result<RawFrame, FrameReadError> {
    let header_length = fixed.header.header_length as usize;
    let payload_length = fixed.header.payload_length as usize;
    let total = header_length + payload_length;
    if payload_length >= ALIGNED_PAYLOAD_MIN {
        return read_aligned_body(reader, fixed, header_length, total).await;
    }
    // Read into spare capacity (no zero-filling of a buffer about to be overwritten);
    // `take` bounds each read so nothing of the next frame is consumed.
    let mut body = BytesMut::with_capacity(total);
    read_exactly(reader, &mut body, total).await?;
    verify(&fixed, &body[..header_length], &body[header_length..])?;
    let header = body.split_to(header_length).freeze();
    Ok(RawFrame {
        fixed: fixed.header,
        header,
        payload: body.freeze(),
    })
}

/// As [`read_frame_body`] for a large payload: the buffer has room for a lead of up to one
/// page, chosen once it is allocated so that the payload starts on a page boundary.
async fn read_aligned_body<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    fixed: FixedHeader,
    header_length: usize,
    total: usize,
) -> Result<RawFrame, FrameReadError> {
    let mut buffer: Vec<u8> = Vec::with_capacity(total + PAYLOAD_ALIGNMENT - 1);
    let misalignment = (buffer.as_ptr() as usize + header_length) % PAYLOAD_ALIGNMENT;
    let lead = (PAYLOAD_ALIGNMENT - misalignment) % PAYLOAD_ALIGNMENT;
    buffer.resize(lead, 0);
    // The capacity covers lead + total, so the reads below never move the buffer.
    read_exactly(reader, &mut buffer, lead + total).await?;
    let payload_start = lead + header_length;
    verify(
        &fixed,
        &buffer[lead..payload_start],
        &buffer[payload_start..],
    )?;
    let body = Bytes::from(buffer);
    Ok(RawFrame {
        fixed: fixed.header,
        header: body.slice(lead..payload_start),
        payload: body.slice(payload_start..),
    })
}

/// Read until `buffer` holds `length` bytes, never past them.
async fn read_exactly<R, B>(
    reader: &mut R,
    buffer: &mut B,
    length: usize,
) -> Result<(), FrameReadError>
where
    R: AsyncRead + Unpin + ?Sized,
    B: bytes::BufMut + AsRef<[u8]>,
{
    while buffer.as_ref().len() < length {
        let remaining = (length - buffer.as_ref().len()) as u64;
        let read = (&mut *reader)
            .take(remaining)
            .read_buf(buffer)
            .await
            .map_err(FrameReadError::Io)?;
        if read == 0 {
            return Err(FrameReadError::Truncated);
        }
    }
    Ok(())
}

fn verify(fixed: &FixedHeader, header: &[u8], payload: &[u8]) -> Result<(), FrameReadError> {
    let actual = checksum(
        &fixed.bytes,
        header,
        fixed.payload_checksum.then_some(payload),
    );
    if actual != fixed.header.checksum {
        return Err(FrameError::BadChecksum {
            expected: fixed.header.checksum,
            actual,
        }
        .into());
    }
    Ok(())
}

/// CRC-32C over the fixed header but its checksum (bytes 0..24, then the credit word),
/// then the header section, then the payload unless it is not covered.
fn checksum(fixed: &[u8; FIXED_HEADER_BYTES], header: &[u8], payload: Option<&[u8]>) -> u32 {
    let crc = crc32c::crc32c_append(crc32c::crc32c(&fixed[..24]), &fixed[28..32]);
    let crc = crc32c::crc32c_append(crc, header);
    match payload {
        Some(payload) => crc32c::crc32c_append(crc, payload),
        None => crc,
    }
}

/// What a sender adds to a frame beyond its own fields.
#[derive(Clone, Copy, Debug)]
pub struct FrameExtras {
    /// The connection's window, told in a reply (`FLAG_CREDIT`).
    pub credit: Option<u32>,
    /// Whether the checksum covers the payload ([`payload_checksum_for`]).
    pub payload_checksum: bool,
}

/// Write one frame. The payload is written straight from its buffer.
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    flags: u8,
    opcode: u16,
    request_id: u64,
    header: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let extras = FrameExtras {
        credit: None,
        payload_checksum: true,
    };
    write_frame_with(writer, extras, flags, opcode, request_id, header, payload).await
}

/// [`write_frame`] with a reply's window (`FLAG_CREDIT`) and the connection's checksum
/// coverage.
pub async fn write_frame_with<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    extras: FrameExtras,
    flags: u8,
    opcode: u16,
    request_id: u64,
    header: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let FrameExtras {
        credit,
        payload_checksum,
    } = extras;
    let flags = match credit {
        Some(_) => flags | freeflow_proto::frame::FLAG_CREDIT,
        None => flags & !freeflow_proto::frame::FLAG_CREDIT,
    };
    let header_length = u32::try_from(header.len())
        .map_err(|_| std::io::Error::other("frame header section too long"))?;
    let payload_length = u32::try_from(payload.len())
        .map_err(|_| std::io::Error::other("frame payload too long"))?;
    let mut fixed = FrameHeader {
        flags,
        opcode,
        request_id,
        header_length,
        payload_length,
        checksum: 0,
        credit: credit.unwrap_or(0),
    };
    fixed.checksum = checksum(&fixed.encode(), header, payload_checksum.then_some(payload));
    writer.write_all(&fixed.encode()).await?;
    writer.write_all(header).await?;
    writer.write_all(payload).await
}

/// Where a shared payload is (`FLAG_SHARED_PAYLOAD`, `crate::shared`): the region's name
/// and the payload's offset in it. The payload's length is the frame's `payload_length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedRef {
    pub region: u64,
    pub offset: u64,
}

impl SharedRef {
    fn encode(&self) -> [u8; SHARED_PAYLOAD_REF_BYTES] {
        let mut bytes = [0u8; SHARED_PAYLOAD_REF_BYTES];
        bytes[..8].copy_from_slice(&self.region.to_le_bytes());
        bytes[8..].copy_from_slice(&self.offset.to_le_bytes());
        bytes
    }
}

/// Write a request whose payload of `length` bytes is in a shared region: the reference
/// goes where the payload would, and the checksum covers it (never the payload).
#[allow(clippy::too_many_arguments)]
pub async fn write_shared_frame<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    flags: u8,
    opcode: u16,
    request_id: u64,
    header: &[u8],
    length: u32,
    at: SharedRef,
) -> std::io::Result<()> {
    let header_length = u32::try_from(header.len())
        .map_err(|_| std::io::Error::other("frame header section too long"))?;
    let reference = at.encode();
    let mut fixed = FrameHeader {
        flags: (flags | FLAG_SHARED_PAYLOAD) & !freeflow_proto::frame::FLAG_CREDIT,
        opcode,
        request_id,
        header_length,
        payload_length: length,
        checksum: 0,
        credit: 0,
    };
    fixed.checksum = checksum(&fixed.encode(), header, Some(&reference));
    writer.write_all(&fixed.encode()).await?;
    writer.write_all(header).await?;
    writer.write_all(&reference).await
}

/// Read the rest of a frame whose fixed header has `FLAG_SHARED_PAYLOAD`: its header
/// section (returned with an empty payload) and where its payload is.
pub async fn read_shared_frame_body<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    fixed: FixedHeader,
) -> Result<(RawFrame, SharedRef), FrameReadError> {
    let header_length = fixed.header.header_length as usize;
    let total = header_length + SHARED_PAYLOAD_REF_BYTES;
    let mut body = BytesMut::with_capacity(total);
    read_exactly(reader, &mut body, total).await?;
    let actual = checksum(
        &fixed.bytes,
        &body[..header_length],
        Some(&body[header_length..]),
    );
    if actual != fixed.header.checksum {
        return Err(FrameError::BadChecksum {
            expected: fixed.header.checksum,
            actual,
        }
        .into());
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let at = SharedRef {
        region: u64_at(header_length),
        offset: u64_at(header_length + 8),
    };
    let header = body.split_to(header_length).freeze();
    Ok((
        RawFrame {
            fixed: fixed.header,
            header,
            payload: Bytes::new(),
        },
        at,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Unix-socket connection's frames leave the payload out of the checksum, and a TCP
    /// connection's do not: each side reads the other's frames only with the same rule
    /// (payloads of both sizes: the aligned read of large ones checks too), and the header
    /// is checked either way.
    #[tokio::test]
    async fn unix_socket_frames_leave_the_payload_out_of_the_checksum() {
        assert!(!payload_checksum_for("unix:/run/freeflow/io-0.sock"));
        assert!(payload_checksum_for("127.0.0.1:7000"));
        for payload in [vec![7u8; 100], vec![7u8; ALIGNED_PAYLOAD_MIN + 10]] {
            let limit = payload.len() as u32;
            for covered in [true, false] {
                let extras = FrameExtras {
                    credit: None,
                    payload_checksum: covered,
                };
                let mut wire = Vec::new();
                write_frame_with(&mut wire, extras, 0, 200, 3, b"head", &payload)
                    .await
                    .unwrap();
                let frame = read_frame_covering(&mut wire.as_slice(), limit, covered)
                    .await
                    .unwrap();
                assert_eq!(&frame.payload[..], &payload[..]);
                // Read with the other rule, a frame with a payload fails its checksum.
                assert!(matches!(
                    read_frame_covering(&mut wire.as_slice(), limit, !covered).await,
                    Err(FrameReadError::Invalid(FrameError::BadChecksum { .. }))
                ));
                // A flipped payload byte is caught only where the payload is covered.
                let mut flipped_payload = wire.clone();
                *flipped_payload.last_mut().unwrap() ^= 1;
                let read =
                    read_frame_covering(&mut flipped_payload.as_slice(), limit, covered).await;
                assert_eq!(read.is_err(), covered, "payload covered: {covered}");
                // A flipped header byte is caught either way.
                let mut flipped_header = wire.clone();
                flipped_header[FIXED_HEADER_BYTES] ^= 1;
                assert!(matches!(
                    read_frame_covering(&mut flipped_header.as_slice(), limit, covered).await,
                    Err(FrameReadError::Invalid(FrameError::BadChecksum { .. }))
                ));
            }
        }
    }

    #[tokio::test]
    async fn frames_round_trip_and_corruption_is_caught() {
        let mut wire = Vec::new();
        write_frame(&mut wire, 0, 200, 9, b"head", b"payload bytes")
            .await
            .unwrap();
        let frame = read_frame(&mut wire.as_slice(), 1024).await.unwrap();
        assert_eq!((frame.fixed.opcode, frame.fixed.request_id), (200, 9));
        assert_eq!(&frame.header[..], b"head");
        assert_eq!(&frame.payload[..], b"payload bytes");

        let mut flipped_opcode = wire.clone();
        flipped_opcode[6] ^= 1;
        assert!(matches!(
            read_frame(&mut flipped_opcode.as_slice(), 1024).await,
            Err(FrameReadError::Invalid(FrameError::BadChecksum { .. }))
        ));
        let mut corrupt = wire.clone();
        let last = corrupt.len() - 1;
        corrupt[last] ^= 0xff;
        assert!(matches!(
            read_frame(&mut corrupt.as_slice(), 1024).await,
            Err(FrameReadError::Invalid(FrameError::BadChecksum { .. }))
        ));
        let truncated = &wire[..wire.len() - 3];
        assert!(matches!(
            read_frame(&mut &truncated[..], 1024).await,
            Err(FrameReadError::Truncated)
        ));
        assert!(matches!(
            read_frame(&mut &wire[..0], 1024).await,
            Err(FrameReadError::Closed)
        ));
        assert!(matches!(
            read_frame(&mut wire.as_slice(), 4).await,
            Err(FrameReadError::Invalid(FrameError::PayloadTooLong { .. }))
        ));
    }

    #[tokio::test]
    async fn large_payloads_start_on_a_page_and_are_checked() {
        for header_length in [0usize, 1, 7, 4095, 4096, 5000] {
            let header: Vec<u8> = (0..header_length).map(|i| (i * 7) as u8).collect();
            let payload: Vec<u8> = (0..ALIGNED_PAYLOAD_MIN + 3)
                .map(|i| (i * 13) as u8)
                .collect();
            let mut wire = Vec::new();
            write_frame(&mut wire, 0, 200, 1, &header, &payload)
                .await
                .unwrap();
            let frame = read_frame(&mut wire.as_slice(), 1 << 20).await.unwrap();
            assert_eq!(frame.payload.as_ptr() as usize % PAYLOAD_ALIGNMENT, 0);
            assert_eq!(&frame.header[..], &header[..]);
            assert_eq!(&frame.payload[..], &payload[..]);

            let mut corrupt = wire.clone();
            let middle = corrupt.len() - payload.len() / 2;
            corrupt[middle] ^= 1;
            assert!(matches!(
                read_frame(&mut corrupt.as_slice(), 1 << 20).await,
                Err(FrameReadError::Invalid(FrameError::BadChecksum { .. }))
            ));
            let truncated = &wire[..wire.len() - 1];
            assert!(matches!(
                read_frame(&mut &truncated[..], 1 << 20).await,
                Err(FrameReadError::Truncated)
            ));
        }
    }

    /// A shared frame carries its reference where the payload would be, the length in
    /// its fixed header, and a checksum that catches a changed reference.
    #[tokio::test]
    async fn a_shared_frame_carries_its_reference_and_the_checksum_covers_it() {
        let at = SharedRef {
            region: 0x1234_5678_9abc_def0,
            offset: 3 << 20,
        };
        let mut wire = Vec::new();
        write_shared_frame(&mut wire, 0, 200, 9, b"head", 1 << 20, at)
            .await
            .unwrap();
        assert_eq!(
            wire.len(),
            FIXED_HEADER_BYTES + 4 + SHARED_PAYLOAD_REF_BYTES
        );
        let limits = FrameLimits {
            header_length_max: 1 << 10,
            payload_length_max: 8 << 20,
            header_timeout: None,
            payload_checksum: false,
        };
        let mut reader = wire.as_slice();
        let fixed = read_fixed_header(&mut reader, &limits).await.unwrap();
        assert_ne!(fixed.header.flags & FLAG_SHARED_PAYLOAD, 0);
        assert_eq!(fixed.header.payload_length, 1 << 20);
        let (frame, read_at) = read_shared_frame_body(&mut reader, fixed).await.unwrap();
        assert_eq!(read_at, at);
        assert_eq!(&frame.header[..], b"head");
        assert!(frame.payload.is_empty());
        assert!(reader.is_empty());
        let mut flipped = wire.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let mut reader = flipped.as_slice();
        let fixed = read_fixed_header(&mut reader, &limits).await.unwrap();
        assert!(matches!(
            read_shared_frame_body(&mut reader, fixed).await,
            Err(FrameReadError::Invalid(FrameError::BadChecksum { .. }))
        ));
    }
}
