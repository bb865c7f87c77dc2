//! Fuzzing the frame reader (issue 8): arbitrary byte streams and mutations of valid frame
//! sequences are read frame by frame until the stream ends or a frame is refused. The
//! reader must never panic, never hand out a frame beyond its bounds, and every frame it
//! returns must carry a checksum that matches what it read.
//!
//! Short by default; a long run on demand:
//! `PROPTEST_CASES=200000 cargo test -p freeflow-rpc --test fuzz --release`.

use freeflow_rpc::{read_frame, write_frame, FrameReadError};
use proptest::prelude::*;

/// Bound on payloads in these tests.
const PAYLOAD_LENGTH_MAX: u32 = 4096;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime")
}

type Frames = Vec<(u16, Vec<u8>, Vec<u8>)>;

/// Read frames from `bytes` until the end or a refusal; returns those read.
fn read_all(runtime: &tokio::runtime::Runtime, bytes: &[u8]) -> Frames {
    runtime.block_on(async {
        let mut reader = bytes;
        let mut frames = Vec::new();
        loop {
            match read_frame(&mut reader, PAYLOAD_LENGTH_MAX).await {
                Ok(frame) => {
                    assert!(frame.payload.len() <= PAYLOAD_LENGTH_MAX as usize);
                    assert_eq!(frame.payload.len(), frame.fixed.payload_length as usize);
                    assert_eq!(frame.header.len(), frame.fixed.header_length as usize);
                    frames.push((
                        frame.fixed.opcode,
                        frame.header.to_vec(),
                        frame.payload.to_vec(),
                    ));
                }
                Err(FrameReadError::Closed) => return frames,
                Err(
                    FrameReadError::Truncated
                    | FrameReadError::Invalid(_)
                    | FrameReadError::Io(_)
                    | FrameReadError::Stalled,
                ) => return frames,
            }
        }
    })
}

/// A stream of valid frames, and where each frame ends in it.
fn valid_stream(runtime: &tokio::runtime::Runtime, frames: &Frames) -> (Vec<u8>, Vec<usize>) {
    runtime.block_on(async {
        let mut bytes = Vec::new();
        let mut ends = Vec::new();
        for (index, (opcode, header, payload)) in frames.iter().enumerate() {
            write_frame(&mut bytes, 0, *opcode, index as u64, header, payload)
                .await
                .expect("write to a Vec");
            ends.push(bytes.len());
        }
        (bytes, ends)
    })
}

fn frames() -> impl Strategy<Value = Frames> {
    prop::collection::vec(
        (
            any::<u16>(),
            prop::collection::vec(any::<u8>(), 0..64),
            prop::collection::vec(any::<u8>(), 0..256),
        ),
        1..5,
    )
}

proptest! {
    #[test]
    fn arbitrary_streams_never_panic_the_reader(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        read_all(&runtime(), &bytes);
    }

    #[test]
    fn valid_streams_read_back_whole(frames in frames()) {
        let runtime = runtime();
        let (bytes, _) = valid_stream(&runtime, &frames);
        prop_assert_eq!(read_all(&runtime, &bytes), frames);
    }

    #[test]
    fn mutated_streams_are_read_or_refused(
        frames in frames(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let runtime = runtime();
        let (mut bytes, ends) = valid_stream(&runtime, &frames);
        let mut first_bad = bytes.len();
        for (at, xor) in flips {
            let at = at.index(bytes.len());
            bytes[at] ^= xor;
            first_bad = first_bad.min(at);
        }
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep);
        first_bad = first_bad.min(keep);
        // A changed or missing byte is caught by the checksum or the header checks
        // (CRC-32C misses a random change with odds of 2^-32): exactly the frames whole
        // before it come back, unchanged.
        let whole = ends.iter().filter(|&&end| end <= first_bad).count();
        prop_assert_eq!(read_all(&runtime, &bytes), frames[..whole].to_vec());
    }
}
