//! Hostile and malformed input against a real meta server process and a real I/O server
//! process: raw TCP connections that send garbage, a wrong cluster key, an unknown opcode
//! after a correct handshake, oversized frame headers and truncated frames. Each must close
//! that one connection (promptly) with a warning naming the reason in the server's log, while
//! a real client keeps working. Bad arguments in well-formed requests must come back as
//! error replies with the right code, leaving the connection open.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw::{authenticate, authenticated_raw, connect_raw};
use common::{poll_until, Cluster};
use freeflow_client::{Client, ClusterKey, ErrorCode, OpenOptions};
use freeflow_proto::frame::FrameHeader;
use freeflow_rpc::{write_frame, ConnectOptions, Connection, RpcError};
use freeflow_types::limits::{FILE_SIZE_MAX, IO_REQUEST_BYTES_MAX};
use freeflow_types::ObjectId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a server may take to close a connection it refuses.
const CLOSE_WAIT_MS: u64 = 5_000;

/// The server closes the connection: reads reach EOF (or an error) within the bound.
async fn expect_closed(stream: &mut TcpStream, what: &str) {
    let deadline = Instant::now() + Duration::from_millis(CLOSE_WAIT_MS);
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining, stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(_)) => continue,
            Err(_) => {
                panic!("{what}: the server did not close the connection within {CLOSE_WAIT_MS} ms")
            }
        }
    }
}

/// The log gets a warning line naming this peer and containing `reason`.
async fn expect_warning(log: impl Fn() -> String, peer: &str, reason: &str, what: &str) {
    let found = poll_until(CLOSE_WAIT_MS, || {
        let text = log();
        async move {
            text.lines()
                .any(|line| line.contains("WARN") && line.contains(peer) && line.contains(reason))
                .then_some(())
        }
    })
    .await;
    if found.is_none() {
        panic!(
            "{what}: no warning naming peer {peer} with {reason:?} in the log:\n{}",
            log()
        );
    }
}

/// A real client still does real work.
async fn assert_client_works(client: &Client, round: usize) {
    let path = format!("/alive-{round}");
    let handle = client
        .open_path(
            &path,
            &OpenOptions::new().read(true).write(true).create(true),
        )
        .await
        .expect("the client can still create");
    let text = format!("still alive {round}");
    handle
        .write_at(0, Bytes::from(text.clone()))
        .await
        .expect("and write");
    handle.close().await.expect("and close");
    let handle = client
        .open_path(&path, &OpenOptions::new().read(true))
        .await
        .expect("and open");
    let data = handle.read_at(0, 100).await.expect("and read");
    assert_eq!(data, text.as_bytes());
    handle.close().await.expect("close");
}

/// The two servers under attack: (name, address, log reader index: None for meta).
fn targets(cluster: &Cluster) -> Vec<(&'static str, String, Option<usize>)> {
    vec![
        ("meta", cluster.meta_address.clone(), None),
        ("io", cluster.io_address(0).to_string(), Some(0)),
    ]
}

fn log_of(cluster: &Cluster, index: Option<usize>) -> String {
    match index {
        None => cluster.meta_log(),
        Some(index) => cluster.io_log(index),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_bytes_close_the_connection() {
    let cluster = Cluster::start(1).await;
    let client = cluster.client().await;
    for (round, (name, address, index)) in targets(&cluster).into_iter().enumerate() {
        let (mut stream, _hello) = connect_raw(&address).await;
        let peer = stream.local_addr().expect("local address").to_string();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: freeflow\r\n\r\n")
            .await
            .expect("send garbage");
        expect_closed(&mut stream, name).await;
        expect_warning(|| log_of(&cluster, index), &peer, "bad magic", name).await;
        assert_client_works(&client, round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cluster_key_is_refused() {
    let cluster = Cluster::start(1).await;
    let client = cluster.client().await;
    let wrong = ClusterKey::generate().expect("a key");
    assert_ne!(wrong, cluster.key);
    for (round, (name, address, index)) in targets(&cluster).into_iter().enumerate() {
        // Raw: the server answers PermissionDenied, then closes.
        let (mut stream, hello) = connect_raw(&address).await;
        let peer = stream.local_addr().expect("local address").to_string();
        let outcome = authenticate(&mut stream, &hello, &wrong, [1; 32]).await;
        let error = outcome.expect_err("a wrong key is refused");
        assert_eq!(error.code, ErrorCode::PermissionDenied, "{name}: {error}");
        expect_closed(&mut stream, name).await;
        expect_warning(|| log_of(&cluster, index), &peer, "wrong cluster key", name).await;

        // Through the RPC client: a Refused error naming the address.
        let result = Connection::connect(&address, &wrong, &ConnectOptions::default()).await;
        match result {
            Err(error @ RpcError::Refused { .. }) => {
                assert!(error.to_string().contains(&address), "{error}");
                assert_eq!(error.code(), ErrorCode::PermissionDenied);
            }
            other => panic!("{name}: expected a handshake error, got {other:?}"),
        }
        assert_client_works(&client, round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_opcode_after_the_handshake_closes_the_connection() {
    let cluster = Cluster::start(1).await;
    let client = cluster.client().await;
    for (round, (name, address, index)) in targets(&cluster).into_iter().enumerate() {
        let mut stream = authenticated_raw(&address, &cluster.key).await;
        let peer = stream.local_addr().expect("local address").to_string();
        write_frame(&mut stream, 0, 999, 1, b"\x00", &[])
            .await
            .expect("send an unknown opcode");
        expect_closed(&mut stream, name).await;
        expect_warning(|| log_of(&cluster, index), &peer, "opcode 999", name).await;
        assert_client_works(&client, round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_headers_close_the_connection() {
    let cluster = Cluster::start(1).await;
    let client = cluster.client().await;
    let mut round = 0;
    for (name, address, index) in targets(&cluster) {
        for (header_length, payload_length, reason) in [
            (0u32, u32::MAX, "exceeds the bound"),
            (u32::MAX, 0u32, "header section of"),
        ] {
            let mut stream = authenticated_raw(&address, &cluster.key).await;
            let peer = stream.local_addr().expect("local address").to_string();
            let header = FrameHeader {
                flags: 0,
                opcode: 111,
                request_id: 1,
                header_length,
                payload_length,
                checksum: 0,
                credit: 0,
            };
            stream
                .write_all(&header.encode())
                .await
                .expect("send the oversized header");
            // Nothing more is sent: the server must refuse on the header alone, not wait
            // for (or allocate) gigabytes.
            expect_closed(&mut stream, name).await;
            expect_warning(|| log_of(&cluster, index), &peer, reason, name).await;
            assert_client_works(&client, round).await;
            round += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_frame_then_close_is_logged() {
    let cluster = Cluster::start(1).await;
    let client = cluster.client().await;
    for (round, (name, address, index)) in targets(&cluster).into_iter().enumerate() {
        let mut stream = authenticated_raw(&address, &cluster.key).await;
        let peer = stream.local_addr().expect("local address").to_string();
        let header = FrameHeader {
            flags: 0,
            opcode: 111,
            request_id: 1,
            header_length: 100,
            payload_length: 0,
            checksum: 0,
            credit: 0,
        };
        stream
            .write_all(&header.encode())
            .await
            .expect("send header");
        stream
            .write_all(&[0u8; 10])
            .await
            .expect("send 10 of 100 bytes");
        stream.shutdown().await.expect("close our side");
        expect_closed(&mut stream, name).await;
        expect_warning(|| log_of(&cluster, index), &peer, "truncated frame", name).await;
        assert_client_works(&client, round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_get_error_codes_and_keep_the_connection() {
    use freeflow_proto::io::{ReadObject, ServerStats, TruncateObject, WriteObject};
    use freeflow_proto::meta::{Caller, GetAttr, Lookup, Mkdir};

    let cluster = Cluster::start(1).await;
    let options = ConnectOptions::default();

    #[track_caller]
    fn remote_code<T: std::fmt::Debug>(result: Result<T, RpcError>) -> ErrorCode {
        match result {
            Err(RpcError::Remote(error)) => error.code,
            other => panic!("expected an error reply, got {other:?}"),
        }
    }

    let meta = Connection::connect(&cluster.meta_address, &cluster.key, &options)
        .await
        .expect("connect to meta");
    assert_eq!(meta.identity(), "meta");
    assert_eq!(
        remote_code(
            meta.call(&GetAttr { inode: 987_654_321 }, Bytes::new())
                .await
        ),
        ErrorCode::NotFound
    );
    let long_name = "x".repeat(256);
    assert_eq!(
        remote_code(
            meta.call(
                &Lookup {
                    caller: Caller::root(),
                    parent: freeflow_client::ROOT_INODE,
                    name: long_name.clone()
                },
                Bytes::new()
            )
            .await
        ),
        ErrorCode::NameTooLong
    );
    assert_eq!(
        remote_code(
            meta.call(
                &Mkdir {
                    caller: Caller::root(),
                    parent: freeflow_client::ROOT_INODE,
                    name: long_name,
                    permissions: 0o755
                },
                Bytes::new()
            )
            .await
        ),
        ErrorCode::NameTooLong
    );
    assert_eq!(
        remote_code(
            meta.call(
                &Mkdir {
                    caller: Caller::root(),
                    parent: 987_654_321,
                    name: "x".to_string(),
                    permissions: 0o755
                },
                Bytes::new()
            )
            .await
        ),
        ErrorCode::NotFound,
        "mkdir in a missing directory"
    );
    assert!(!meta.is_closed(), "error replies leave the connection open");
    let (attr, _) = meta
        .call(
            &GetAttr {
                inode: freeflow_client::ROOT_INODE,
            },
            Bytes::new(),
        )
        .await
        .expect("the connection still serves");
    assert_eq!(attr.inode, freeflow_client::ROOT_INODE);

    let io = Connection::connect(cluster.io_address(0), &cluster.key, &options)
        .await
        .expect("connect to io");
    assert_eq!(io.identity(), "io:0");
    let object = ObjectId {
        inode: 4242,
        stripe_index: 0,
    };
    assert_eq!(
        remote_code(
            io.call(
                &WriteObject {
                    grant: 0,
                    charged: 0,
                    object,
                    offset: FILE_SIZE_MAX,
                    map_version: 0,
                    forward: Vec::new(),
                },
                Bytes::from_static(b"x")
            )
            .await
        ),
        ErrorCode::FileTooBig,
        "a write starting at the largest file size"
    );
    assert_eq!(
        remote_code(
            io.call(
                &WriteObject {
                    grant: 0,
                    charged: 0,
                    object,
                    offset: FILE_SIZE_MAX - 1,
                    map_version: 0,
                    forward: Vec::new(),
                },
                Bytes::from_static(b"xy")
            )
            .await
        ),
        ErrorCode::FileTooBig,
        "a write ending one byte past the largest file size"
    );
    assert_eq!(
        remote_code(
            io.call(
                &WriteObject {
                    grant: 0,
                    charged: 0,
                    object,
                    offset: u64::MAX - 1,
                    map_version: 0,
                    forward: Vec::new(),
                },
                Bytes::from_static(b"xyz")
            )
            .await
        ),
        ErrorCode::FileTooBig,
        "a write whose end overflows u64"
    );
    assert_eq!(
        remote_code(
            io.call(
                &ReadObject {
                    object,
                    offset: 0,
                    length: IO_REQUEST_BYTES_MAX + 1,
                    map_version: 0,
                },
                Bytes::new()
            )
            .await
        ),
        ErrorCode::InvalidArgument,
        "a read longer than one request may be"
    );
    assert_eq!(
        remote_code(
            io.call(
                &TruncateObject {
                    object,
                    length: FILE_SIZE_MAX + 1,
                    forward: Vec::new(),
                },
                Bytes::new()
            )
            .await
        ),
        ErrorCode::FileTooBig,
        "a truncate past the largest file size"
    );
    // None of the refused writes created the object.
    assert!(
        !cluster.object_path(0, 4242, 0).exists(),
        "a refused write leaves no object behind"
    );
    assert!(!io.is_closed(), "error replies leave the connection open");
    let (stats, _) = io
        .call(&ServerStats {}, Bytes::new())
        .await
        .expect("the connection still serves");
    assert_eq!(stats.server_id, 0);
    // A legal read of a missing object is an empty read, not an error.
    let (reply, payload) = io
        .call(
            &ReadObject {
                object,
                offset: 0,
                length: IO_REQUEST_BYTES_MAX,
                map_version: 0,
            },
            Bytes::new(),
        )
        .await
        .expect("a read of the largest allowed length");
    assert_eq!(reply.length, 0);
    assert!(payload.is_empty());
}
