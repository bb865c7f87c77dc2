//! Fuzzing every decoder of the wire contract with arbitrary bytes and with mutations of
//! valid messages (issue 8: no bytes from outside can crash a server). Each decoder must
//! return a value or an error, never panic; what decodes must encode back to bytes that
//! decode to the same value.
//!
//! Short by default (proptest's 256 cases per property); a long run on demand:
//! `PROPTEST_CASES=200000 cargo test -p freeflow-proto --test fuzz --release`.

use freeflow_proto::frame::{FrameHeader, FIXED_HEADER_BYTES};
use freeflow_proto::handshake::{Authenticate, Hello, ServerProof};
use freeflow_proto::io::{self, *};
use freeflow_proto::meta::{self, *};
use freeflow_proto::{decode, encode, Request, WireError};
use freeflow_types::{Attr, FileKind, ObjectId, SetAttr, TimeSpec};
use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Decode `bytes` as `T`; if it decodes, the value must survive a round trip.
fn check<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
    if let Ok(value) = decode::<T>(bytes) {
        let again: T = decode(&encode(&value)).expect("a decoded value encodes and decodes");
        assert_eq!(again, value);
    }
}

/// Every request of a service, as the request and as its reply (`Result<Reply, WireError>`).
macro_rules! every_message {
    ($bytes:expr, $opcodes:expr, $($request:ty),* $(,)?) => {{
        let mut listed = Vec::new();
        $(
            check::<$request>($bytes);
            check::<Result<<$request as Request>::Reply, WireError>>($bytes);
            listed.push(<$request as Request>::OPCODE);
        )*
        // A message added to the service but not to this list would go unfuzzed.
        let known: Vec<u16> = $opcodes.iter().map(|(opcode, _)| *opcode).collect();
        assert_eq!(listed, known, "the fuzz list must name every request");
    }};
}

fn every_meta_message(bytes: &[u8]) {
    every_message!(
        bytes,
        meta::OPCODES,
        OpenSession,
        RenewSession,
        CloseSession,
        Lookup,
        GetAttr,
        SetAttributes,
        Create,
        Mkdir,
        Unlink,
        Rmdir,
        Rename,
        Link,
        Symlink,
        ReadLink,
        ReadDir,
        StatFs,
        SetXattr,
        GetXattr,
        ListXattr,
        RemoveXattr,
        Open,
        Close,
        CommitSize,
        SetDirLayout,
        ListServers,
        RegisterServer,
        ClusterStatus,
        Sync,
        ReplayDone,
        WaitRevocations,
        LookupEntry,
        SetLock,
        GetLock,
        CloseHandles,
        ReserveInodes,
        InspectInodes,
        GetServiceMap,
        ResyncDone,
        ReclaimSession,
        RenewLeases,
        ChangeMetaMembers,
        FillDone,
        ChangeIoServer,
    );
}

fn every_io_message(bytes: &[u8]) {
    every_message!(
        bytes,
        io::OPCODES,
        WriteObject,
        ReadObject,
        TruncateObject,
        SyncObjects,
        RemoveObjects,
        ServerStats,
        AllocateObject,
        CopyObjectRange,
        ListObjects,
        RemoveObject,
        ReserveSpace,
    );
}

fn every_handshake_message(bytes: &[u8]) {
    check::<ReplyStamp>(bytes);
    check::<ReplayOf>(bytes);
    check::<Revocation>(bytes);
    check::<LockConflict>(bytes);
    check::<Hello>(bytes);
    check::<Authenticate>(bytes);
    check::<Result<ServerProof, WireError>>(bytes);
}

/// Valid encodings of messages with every kind of field (strings, vectors, options,
/// enums, nested structs): the seeds that mutations start from.
fn samples() -> Vec<Vec<u8>> {
    let caller = Caller {
        user_id: 1000,
        group_id: 100,
        groups: vec![4, 27],
    };
    let object = ObjectId {
        inode: 77,
        stripe_index: 3,
    };
    vec![
        encode(&ChangeMetaMembers {
            change: meta::MetaMemberChange::AddLearner {
                id: 4,
                address: "10.0.0.4:7700".into(),
                raft_address: "10.0.0.4:7774".into(),
                replaces: Some(2),
            },
        }),
        encode(&Create {
            caller: caller.clone(),
            parent: 1,
            name: "a file name".into(),
            kind: FileKind::Regular,
            permissions: 0o644,
            device: 0,
            exclusive: true,
            open: Some((
                9,
                OpenAccess {
                    read: true,
                    write: true,
                },
            )),
            inode: Some(4096),
        }),
        encode(&Rename {
            caller: caller.clone(),
            source_parent: 1,
            source_name: "x".into(),
            target_parent: 2,
            target_name: "y".into(),
            mode: RenameMode::Exchange,
        }),
        encode(&SetAttributes {
            caller: caller.clone(),
            inode: 5,
            changes: SetAttr {
                size_bytes: Some(10),
                modify_time: Some(TimeSpec::new(1, 2)),
                ..SetAttr::default()
            },
            through_handle: Some(HandleRef {
                session_id: 1,
                handle_id: 2,
            }),
        }),
        encode(&CommitSize {
            inode: 5,
            size_bytes: 1 << 40,
            modify_time: TimeSpec::new(3, 4),
            space: vec![StripeSpace {
                stripe_index: 0,
                allocated_bytes: 4096,
                stamp: 99,
            }],
            durable: false,
        }),
        encode(&SetXattr {
            caller,
            inode: 5,
            name: "user.x".into(),
            value: vec![1, 2, 3],
            mode: XattrSetMode::CreateOnly,
        }),
        encode(&CopyObjectRange {
            source: object,
            source_offset: 10,
            target: object,
            target_offset: 20,
            length: 30,
        }),
        encode(&AllocateObject {
            object,
            offset: 1,
            length: 2,
            mode: AllocateMode::ZeroRange,
            map_version: 0,
            forward: Vec::new(),
        }),
        encode(&SyncObjects {
            objects: vec![object, object],
        }),
        encode(&Ok::<DirPage, WireError>(DirPage {
            entries: vec![DirEntry {
                name: "n".into(),
                inode: 3,
                kind: FileKind::Directory,
                attr: None,
            }],
            end: false,
        })),
        encode(&Err::<(), WireError>(WireError::new(
            freeflow_proto::ErrorCode::NotFound,
            "no such entry",
        ))),
        encode(&Hello {
            nonce: [7; 32],
            identity: "io:3".into(),
            window_bytes: 1 << 20,
            payload_length_max: 8 << 20,
            epoch: 3,
        }),
        encode(&Ok::<Vec<Revocation>, WireError>(vec![Revocation {
            id: 12,
            inode: 1,
            names: vec!["gone".into(), "new".into()],
            attributes: true,
            whole_directory: false,
        }])),
        encode(&SetLock {
            session_id: 3,
            inode: 9,
            owner: u64::MAX - 1,
            pid: 4242,
            kind: Some(freeflow_types::LockKind::Write),
            start: 10,
            end: u64::MAX,
            wait_ms: 5_000,
            reclaim: true,
        }),
        encode(&ReplyStamp {
            epoch: 2,
            txn: 9,
            durable_txn: 8,
            lease_ms: 10_000,
            lease_seq: 4,
            changed: vec![Attr {
                inode: 12,
                kind: FileKind::Directory,
                permissions: 0o755,
                link_count: 3,
                user_id: 0,
                group_id: 0,
                size_bytes: 4096,
                access_time: TimeSpec::new(1, 2),
                modify_time: TimeSpec::new(3, 4),
                change_time: TimeSpec::new(5, 6),
                birth_time: TimeSpec::new(7, 8),
                device: 0,
                layout: None,
                generation: 9,
                allocated_bytes: 0,
            }],
            changed_complete: true,
            delegated: vec![12],
        }),
        encode(&ReserveInodes { count: 1024 }),
        encode(&InspectInodes {
            inodes: vec![1, 77, u64::MAX],
        }),
        encode(&Ok::<ServiceMap, WireError>(ServiceMap {
            version: 17,
            members: vec![Member {
                server_id: 2,
                address: "127.0.0.1:7712".into(),
                state: MemberState::Syncing,
                incarnation: 99,
                unsynced_since_ms: 1_700_000_000_000,
            }],
            replacements: vec![Replacement {
                server: 3,
                inodes_below: 1 << 40,
                by: vec![1, 2, 4],
                filling: vec![4],
                made_ms: 1_700_000_000_000,
                drain: true,
                complete: false,
                share_ppm: SHARE_ALL,
            }],
        })),
        encode(&ResyncDone {
            server_id: 2,
            map_version: 17,
        }),
        encode(&FillDone {
            server_id: 4,
            map_version: 18,
            replacements: vec![(3, 1_700_000_000_000)],
        }),
        encode(&ChangeIoServer {
            server_id: 3,
            change: IoServerChange::Remove { force: true },
        }),
        encode(&RenewLeases {}),
        encode(&Ok::<LeasesRenewed, WireError>(LeasesRenewed {
            epoch: 3,
            renewed: true,
            lease_ms: 10_000,
            revocations_through: 41,
        })),
        encode(&ReclaimSession {
            session_id: 459_709_137_134_548_995,
            client_name: "mount-a".into(),
            handles: vec![ReclaimedHandle {
                handle_id: 459_709_137_134_549_001,
                inode: 77,
                access: OpenAccess {
                    read: true,
                    write: true,
                },
            }],
        }),
        encode(&Ok::<RegisterReply, WireError>(RegisterReply {
            heartbeat_interval_ms: 1000,
            cuts_owed: 0,
            map_version: 17,
            resync: Some(ResyncOrder {
                window_ms: u64::MAX,
                map_version: 17,
            }),
            fill: Some(FillOrder {
                map_version: 18,
                bytes_per_second: 100 << 20,
            }),
            lease_ms: 2500,
        })),
        encode(&Ok::<Vec<InodeFacts>, WireError>(vec![InodeFacts {
            inode: 77,
            kind: Some(FileKind::Regular),
            size_bytes: 1 << 20,
            layout: Some(freeflow_types::Layout::new(4096, vec![0, 1]).unwrap()),
            orphan: None,
            pending_cuts: vec![(1, 4096)],
            open_for_writing: true,
            not_yet_allocated: false,
        }])),
        encode(&ListObjects {
            shard: 255,
            after: Some(object),
            limit: 1024,
        }),
        encode(&Ok::<ObjectListing, WireError>(ObjectListing {
            objects: vec![ListedObject {
                object,
                length: 5,
                age_ms: 60_000,
            }],
            more: true,
        })),
        encode(&RemoveObject { object }),
        encode(&ReserveSpace {
            grant: u64::MAX,
            give_back: 1 << 20,
            need: 4096,
            want: 64 << 20,
        }),
        encode(&Ok::<SpaceGrant, WireError>(SpaceGrant {
            added: 4096,
            held: 1 << 30,
        })),
        encode(&InodeRange {
            first: 4096,
            count: 1024,
        }),
        encode(&ReplayOf {
            epoch: 2,
            txn: 77,
            reply: vec![0, 5, 6],
        }),
    ]
}

/// A mutation of a sample: bytes overwritten, cut off, or added.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let samples = samples();
    (
        0..samples.len(),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        any::<prop::sample::Index>(),
        prop::collection::vec(any::<u8>(), 0..8),
    )
        .prop_map(move |(which, writes, cut, tail)| {
            let mut bytes = samples[which].clone();
            for (at, value) in writes {
                let at = at.index(bytes.len().max(1));
                if let Some(byte) = bytes.get_mut(at) {
                    *byte = value;
                }
            }
            let keep = cut.index(bytes.len() + 1);
            if keep < bytes.len() && tail.len() % 2 == 0 {
                bytes.truncate(keep);
            }
            bytes.extend(tail);
            bytes
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_a_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        every_meta_message(&bytes);
        every_io_message(&bytes);
        every_handshake_message(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic_a_decoder(bytes in mutated()) {
        every_meta_message(&bytes);
        every_io_message(&bytes);
        every_handshake_message(&bytes);
    }

    #[test]
    fn fixed_headers_decode_or_are_refused(
        bytes in prop::array::uniform32(any::<u8>()),
        valid_prefix in any::<bool>(),
        payload_length_max in any::<u32>(),
    ) {
        let mut bytes: [u8; FIXED_HEADER_BYTES] = bytes;
        if valid_prefix {
            bytes[0..4].copy_from_slice(&freeflow_proto::frame::MAGIC.to_le_bytes());
            bytes[4] = freeflow_proto::PROTOCOL_VERSION;
            bytes[28..32].fill(0);
        }
        if let Ok(header) = FrameHeader::decode(&bytes, payload_length_max) {
            prop_assert!(header.payload_length <= payload_length_max);
            prop_assert!(header.header_length <= freeflow_proto::frame::HEADER_LENGTH_MAX);
            prop_assert_eq!(header.encode(), bytes);
        }
    }
}

/// What the fuzzing found is kept here as fixed cases.
#[test]
fn regressions() {
    // A length prefix claiming far more elements than bytes follow (must fail, not
    // allocate the claimed size).
    let huge_vector = [0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2, 3];
    every_meta_message(&huge_vector);
    every_io_message(&huge_vector);
    assert!(decode::<SyncObjects>(&huge_vector).is_err());
    every_meta_message(&[]);
    every_io_message(&[]);
}
