//! Fuzzing real servers (issue 8: no bytes from outside can crash a server). A `freeflow
//! meta` and a `freeflow io` process get authenticated connections carrying frames of every
//! opcode of their service (and some of none), whose messages are random bytes or mutations
//! of valid requests, with random payloads. A server may answer with an error or close the
//! connection; it must never exit, and afterwards a real client must still work.
//!
//! Short in the test command; longer on demand with `FREEFLOW_FUZZ_FRAMES=200000`.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::authenticated_raw;
use common::{Cluster, Xorshift};
use freeflow_client::OpenOptions;
use freeflow_proto::encode;
use freeflow_proto::io::{
    self, AllocateMode, AllocateObject, CopyObjectRange, ReadObject, WriteObject,
};
use freeflow_proto::meta::{
    self, Caller, CommitSize, Create, Lookup, ReadDir, Rename, RenameMode, SetAttributes,
};
use freeflow_rpc::{read_frame, write_frame};
use freeflow_types::{FileKind, ObjectId, SetAttr, TimeSpec};
use tokio::net::TcpStream;

/// Frames sent to each server in the short run.
const FRAMES_DEFAULT: u64 = 3_000;

fn frame_count() -> u64 {
    std::env::var("FREEFLOW_FUZZ_FRAMES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(FRAMES_DEFAULT)
}

/// Valid requests of each service, the seeds of mutations.
fn meta_samples() -> Vec<(u16, Vec<u8>)> {
    use freeflow_proto::Request;
    let caller = Caller {
        user_id: 1000,
        group_id: 1000,
        groups: vec![],
    };
    vec![
        (
            Create::OPCODE,
            encode(&Create {
                caller: caller.clone(),
                parent: 1,
                name: "fuzzed".into(),
                kind: FileKind::Regular,
                permissions: 0o644,
                device: 0,
                exclusive: false,
                open: None,
                inode: None,
            }),
        ),
        (
            Lookup::OPCODE,
            encode(&Lookup {
                caller: caller.clone(),
                parent: 1,
                name: "fuzzed".into(),
            }),
        ),
        (
            Rename::OPCODE,
            encode(&Rename {
                caller: caller.clone(),
                source_parent: 1,
                source_name: "fuzzed".into(),
                target_parent: 1,
                target_name: "other".into(),
                mode: RenameMode::NoReplace,
            }),
        ),
        (
            SetAttributes::OPCODE,
            encode(&SetAttributes {
                caller: caller.clone(),
                inode: 1,
                changes: SetAttr {
                    modify_time: Some(TimeSpec::new(5, 6)),
                    ..SetAttr::default()
                },
                through_handle: None,
            }),
        ),
        (
            ReadDir::OPCODE,
            encode(&ReadDir {
                caller,
                inode: 1,
                after: None,
                limit: 10,
                with_attributes: true,
            }),
        ),
        (
            CommitSize::OPCODE,
            encode(&CommitSize {
                inode: 2,
                size_bytes: 10,
                modify_time: TimeSpec::new(1, 1),
                space: vec![],
                durable: true,
            }),
        ),
    ]
}

fn io_samples() -> Vec<(u16, Vec<u8>)> {
    use freeflow_proto::Request;
    let object = ObjectId {
        inode: 1 << 40,
        stripe_index: 0,
    };
    vec![
        (
            WriteObject::OPCODE,
            encode(&WriteObject {
                grant: 0,
                charged: 0,
                object,
                offset: 4096,
                map_version: 0,
                forward: Vec::new(),
            }),
        ),
        (
            // A replicated write: a map version no server holds, a chain of made-up ids.
            WriteObject::OPCODE,
            encode(&WriteObject {
                grant: 0,
                charged: 0,
                object,
                offset: 0,
                map_version: 3,
                forward: vec![1, 77, u32::MAX],
            }),
        ),
        (
            ReadObject::OPCODE,
            encode(&ReadObject {
                object,
                offset: 0,
                length: 8192,
                map_version: 0,
            }),
        ),
        (
            AllocateObject::OPCODE,
            encode(&AllocateObject {
                object,
                offset: 0,
                length: 1 << 20,
                mode: AllocateMode::Allocate,
                map_version: 0,
                forward: Vec::new(),
            }),
        ),
        (
            CopyObjectRange::OPCODE,
            encode(&CopyObjectRange {
                source: object,
                source_offset: 0,
                target: ObjectId {
                    inode: (1 << 40) + 1,
                    stripe_index: 1,
                },
                target_offset: 100,
                length: 5000,
            }),
        ),
    ]
}

/// One frame: an opcode of the service (or, rarely, any), and a message that is random or
/// a mutated sample.
fn next_frame(
    random: &mut Xorshift,
    opcodes: &[(u16, &str)],
    samples: &[(u16, Vec<u8>)],
) -> (u16, Vec<u8>, Vec<u8>) {
    let payload_length = random.below(256) as usize;
    let payload = random.bytes(payload_length);
    let message_length = random.below(96) as usize;
    match random.below(10) {
        0 => (
            random.next_u64() as u16,
            random.bytes(message_length),
            payload,
        ),
        1..=4 => {
            let opcode = opcodes[random.below(opcodes.len() as u64) as usize].0;
            (opcode, random.bytes(message_length), payload)
        }
        _ => {
            let (opcode, sample) = &samples[random.below(samples.len() as u64) as usize];
            let mut message = sample.clone();
            for _ in 0..1 + random.below(4) {
                let at = random.below(message.len() as u64) as usize;
                message[at] = random.next_u64() as u8;
            }
            if random.below(4) == 0 {
                message.truncate(random.below(message.len() as u64 + 1) as usize);
            }
            (*opcode, message, payload)
        }
    }
}

/// Send `frames` frames to the server at `address`; returns (answered, connections closed).
async fn fuzz_server(
    cluster: &Cluster,
    address: &str,
    seed: u64,
    frames: u64,
    opcodes: &[(u16, &str)],
    samples: &[(u16, Vec<u8>)],
) -> (u64, u64) {
    let mut random = Xorshift::new(seed);
    let mut stream: Option<TcpStream> = None;
    let (mut answered, mut closed) = (0, 0);
    for index in 0..frames {
        if stream.is_none() {
            stream = Some(authenticated_raw(address, &cluster.key).await);
        }
        let connection = stream.as_mut().expect("connected");
        let (opcode, message, payload) = next_frame(&mut random, opcodes, samples);
        let sent = write_frame(connection, 0, opcode, index + 1, &message, &payload).await;
        let reply = match sent {
            Ok(()) => {
                tokio::time::timeout(Duration::from_secs(10), read_frame(connection, 64 << 20))
                    .await
            }
            Err(_) => Ok(Err(freeflow_rpc::FrameReadError::Closed)),
        };
        match reply {
            Ok(Ok(_)) => answered += 1,
            // Refused: the connection is gone; the next frame goes on a new one.
            Ok(Err(_)) => {
                closed += 1;
                stream = None;
            }
            Err(_) => panic!(
                "{address} neither answered nor closed within 10 s (opcode {opcode}, frame {index}):\n{}",
                cluster.all_logs()
            ),
        }
    }
    (answered, closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_survive_random_and_mutated_requests() {
    let mut cluster = Cluster::start(1).await;
    let frames = frame_count();
    let meta_address = cluster.meta_address.clone();
    let io_address = cluster.io_address(0).to_string();
    let (meta_answered, meta_closed) = fuzz_server(
        &cluster,
        &meta_address,
        1,
        frames,
        meta::OPCODES,
        &meta_samples(),
    )
    .await;
    let (io_answered, io_closed) =
        fuzz_server(&cluster, &io_address, 2, frames, io::OPCODES, &io_samples()).await;
    eprintln!(
        "meta: {meta_answered} answered, {meta_closed} connections refused; \
         io: {io_answered} answered, {io_closed} refused"
    );
    // Both ends of the server were reached: handlers answering (often with an error) and
    // the connection refusing a message it cannot decode (by design it then closes).
    assert!(meta_answered > frames / 10 && io_answered > frames / 10);
    assert!(meta_closed > 0 && io_closed > 0);
    cluster.check_children_alive();

    // A real client still works against both. (Random registrations may have pointed the
    // meta server at addresses that serve nothing: a restarted I/O server registers its
    // own again, as after any failure.)
    cluster.kill_io(0);
    cluster.restart_io(0).await;
    let client = cluster.client().await;
    let file = client
        .open_path(
            "/after-the-fuzz",
            &OpenOptions::new().read(true).write(true).create(true),
        )
        .await
        .expect("create after the fuzz");
    file.write_at(0, Bytes::from_static(b"still serving"))
        .await
        .expect("write");
    file.fsync().await.expect("fsync");
    assert_eq!(
        &file.read_at(0, 100).await.expect("read")[..],
        b"still serving"
    );
    file.close().await.expect("close");
}
