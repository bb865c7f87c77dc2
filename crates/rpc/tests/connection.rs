//! The RPC layer over real loopback TCP: pipelining with replies out of order, the window,
//! the handshake, and what a misbehaving peer gets (its connection closed, the server
//! still serving everyone else).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use freeflow_proto::io::{ReadObject, ReadReply, ServerStats, WriteObject};
use freeflow_proto::{ErrorCode, Request, WireError};
use freeflow_rpc::{
    handle, serve, serve_with_unix, ClusterKey, ConnectOptions, Connection, Frame, PeerInfo, Reply,
    RpcError, ServerOptions, Service,
};
use freeflow_types::ObjectId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Echoes WriteObject payloads back as ReadObject-shaped replies after a delay chosen by the
/// request, so replies finish in a different order than requests were sent.
struct Echo;

impl Service for Echo {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        match frame.opcode {
            WriteObject::OPCODE => {
                handle(frame, |request: WriteObject, payload: Bytes| async move {
                    tokio::time::sleep(Duration::from_millis(request.offset)).await;
                    if request.object.inode == 0 {
                        return Err(WireError::new(ErrorCode::NotFound, "inode 0"));
                    }
                    Ok((freeflow_proto::io::ObjectSpace::default(), payload))
                })
                .await
            }
            ReadObject::OPCODE => {
                handle(frame, |request: ReadObject, _| async move {
                    Ok((
                        ReadReply {
                            length: request.length,
                        },
                        Bytes::from(vec![7u8; request.length as usize]),
                    ))
                })
                .await
            }
            other => Err(format!("unknown opcode {other}")),
        }
    }
}

async fn start_server(key: &ClusterKey, options: ServerOptions) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve(listener, key.clone(), options, Arc::new(Echo)));
    address
}

fn write_request(inode: u64, delay_ms: u64) -> WriteObject {
    WriteObject {
        grant: 0,
        charged: 0,
        object: ObjectId {
            inode,
            stripe_index: 0,
        },
        offset: delay_ms,
        map_version: 0,
        forward: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_calls_complete_out_of_order_with_their_own_payloads() {
    let key = ClusterKey::generate().unwrap();
    let address = start_server(&key, ServerOptions::new("test")).await;
    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(connection.identity(), "test");
    let started = std::time::Instant::now();
    let mut calls = Vec::new();
    for index in 0..64u64 {
        let connection = connection.clone();
        calls.push(tokio::spawn(async move {
            // Early requests sleep longest, so their replies come last.
            let payload = Bytes::from(vec![index as u8; 1000 + index as usize]);
            let (_, echoed) = connection
                .call(&write_request(1, 200 - index * 3), payload.clone())
                .await
                .unwrap();
            assert_eq!(echoed, payload);
        }));
    }
    for call in calls {
        call.await.unwrap();
    }
    // All 64 ran concurrently: far less than the 64 × ~100 ms they would take one by one.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "calls were serialised: {:?}",
        started.elapsed()
    );

    let error = connection
        .call(&write_request(0, 0), Bytes::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, RpcError::Remote(wire) if wire.code == ErrorCode::NotFound),
        "{error}"
    );
    let (reply, data) = connection
        .call(
            &ReadObject {
                object: ObjectId {
                    inode: 1,
                    stripe_index: 0,
                },
                offset: 0,
                length: 4096,
                map_version: 0,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!((reply.length, data.len()), (4096, 4096));
}

#[tokio::test]
async fn a_small_window_still_carries_every_request() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("small-window");
    options.window_bytes = 10_000;
    let address = start_server(&key, options).await;
    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let connection = connection.clone();
            tokio::spawn(async move {
                connection
                    .call(&write_request(1, 1), Bytes::from(vec![1u8; 30_000]))
                    .await
                    .map(|(_, p)| p.len())
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 30_000);
    }
}

#[tokio::test]
async fn a_wrong_key_is_refused_and_named() {
    let key = ClusterKey::generate().unwrap();
    let address = start_server(&key, ServerOptions::new("test")).await;
    let wrong = ClusterKey::generate().unwrap();
    let error = Connection::connect(&address, &wrong, &ConnectOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, RpcError::Refused { reason, .. } if reason.contains("wrong cluster key")),
        "{error}"
    );
    assert_eq!(error.code(), ErrorCode::PermissionDenied);
}

#[tokio::test]
async fn a_refused_connection_names_the_address() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    drop(listener);
    let error = Connection::connect(
        &address,
        &ClusterKey::generate().unwrap(),
        &ConnectOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(error.to_string().contains(&address), "{error}");
    assert_eq!(error.code(), ErrorCode::Unreachable);
}

/// Authenticate over a raw socket so the test can then misbehave.
async fn raw_authenticated(address: &str, key: &ClusterKey) -> tokio::net::TcpStream {
    // A real connection authenticates; we take over a second raw stream using the codec.
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    raw_authenticate(&mut stream, key).await;
    stream
}

/// The client's side of the handshake, by hand, on any stream.
async fn raw_authenticate<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    key: &ClusterKey,
) {
    let hello = freeflow_rpc::read_frame(&mut *stream, 0).await.unwrap();
    let hello: freeflow_proto::handshake::Hello = freeflow_proto::decode(&hello.header).unwrap();
    let mut hasher = blake3::Hasher::new_keyed(key.bytes());
    hasher.update(b"freeflow v1 client proof");
    hasher.update(&hello.nonce);
    let authenticate = freeflow_proto::handshake::Authenticate {
        proof: *hasher.finalize().as_bytes(),
        client_nonce: [0; 32],
        client_name: "raw".into(),
        client_id: 0,
    };
    freeflow_rpc::write_frame(
        &mut *stream,
        0,
        freeflow_proto::frame::OPCODE_AUTHENTICATE,
        0,
        &freeflow_proto::encode(&authenticate),
        &[],
    )
    .await
    .unwrap();
    let reply = freeflow_rpc::read_frame(&mut *stream, 0).await.unwrap();
    let outcome: Result<freeflow_proto::handshake::ServerProof, WireError> =
        freeflow_proto::decode(&reply.header).unwrap();
    outcome.unwrap();
}

/// The server closes the stream within 5 s (what it sends before, such as a ping reply
/// telling a new window, is read past).
async fn assert_closed_by_server<S: tokio::io::AsyncRead + Unpin>(mut stream: S) {
    let mut buffer = [0u8; 64];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let result = tokio::time::timeout_at(deadline, stream.read(&mut buffer))
            .await
            .expect("server did not close");
        if matches!(result, Ok(0) | Err(_)) {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_peers_lose_only_their_own_connection() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("test");
    options.payload_length_max = 1 << 20;
    let address = start_server(&key, options).await;
    let good = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();

    // Garbage before the handshake.
    let mut garbage = tokio::net::TcpStream::connect(&address).await.unwrap();
    let _hello = freeflow_rpc::read_frame(&mut garbage, 0).await.unwrap();
    garbage.write_all(&[0xAB; 200]).await.unwrap();
    assert_closed_by_server(garbage).await;

    // Garbage after the handshake.
    let mut stream = raw_authenticated(&address, &key).await;
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert_closed_by_server(stream).await;

    // An unknown opcode.
    let mut stream = raw_authenticated(&address, &key).await;
    freeflow_rpc::write_frame(&mut stream, 0, 9999, 1, b"", b"")
        .await
        .unwrap();
    assert_closed_by_server(stream).await;

    // An oversized frame (announces 64 MiB against a 1 MiB bound; nothing is allocated).
    let mut stream = raw_authenticated(&address, &key).await;
    let fixed = freeflow_proto::frame::FrameHeader {
        flags: 0,
        opcode: WriteObject::OPCODE,
        request_id: 1,
        header_length: 4,
        payload_length: 64 << 20,
        checksum: 0,
        credit: 0,
    };
    stream.write_all(&fixed.encode()).await.unwrap();
    assert_closed_by_server(stream).await;

    // A truncated frame: the header promises more bytes than ever come.
    let mut stream = raw_authenticated(&address, &key).await;
    let fixed = freeflow_proto::frame::FrameHeader {
        flags: 0,
        opcode: WriteObject::OPCODE,
        request_id: 1,
        header_length: 4,
        payload_length: 1000,
        checksum: 0,
        credit: 0,
    };
    stream.write_all(&fixed.encode()).await.unwrap();
    stream.write_all(&[1, 2, 3]).await.unwrap();
    stream.shutdown().await.unwrap();
    assert_closed_by_server(stream).await;

    // A well-framed but undecodable request header.
    let mut stream = raw_authenticated(&address, &key).await;
    freeflow_rpc::write_frame(
        &mut stream,
        0,
        ServerStats::OPCODE.min(WriteObject::OPCODE),
        1,
        &[0xff; 3],
        b"",
    )
    .await
    .unwrap();
    assert_closed_by_server(stream).await;

    // The well-behaved client never noticed.
    let (_, echoed) = good
        .call(&write_request(1, 0), Bytes::from_static(b"still here"))
        .await
        .unwrap();
    assert_eq!(&echoed[..], b"still here");
    assert!(!good.is_closed());
}

/// A server that authenticates, takes one request and then dies (drops the socket), as a
/// kill -9 does: the waiting call must fail at once with `Disconnected`, not wait out its
/// 60-second call timeout (set below).
#[tokio::test]
async fn a_lost_server_fails_waiting_calls_at_once() {
    let key = ClusterKey::generate().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let server_key = key.clone();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let hello = freeflow_proto::handshake::Hello {
            nonce: [3; 32],
            identity: "doomed".into(),
            window_bytes: 1 << 20,
            payload_length_max: 1 << 20,
            epoch: 0,
        };
        freeflow_rpc::write_frame(
            &mut stream,
            0,
            freeflow_proto::frame::OPCODE_HELLO,
            0,
            &freeflow_proto::encode(&hello),
            &[],
        )
        .await
        .unwrap();
        let authenticate = freeflow_rpc::read_frame(&mut stream, 0).await.unwrap();
        let authenticate: freeflow_proto::handshake::Authenticate =
            freeflow_proto::decode(&authenticate.header).unwrap();
        let mut hasher = blake3::Hasher::new_keyed(server_key.bytes());
        hasher.update(b"freeflow v1 server proof");
        hasher.update(&authenticate.client_nonce);
        let outcome: Result<_, WireError> = Ok(freeflow_proto::handshake::ServerProof {
            proof: *hasher.finalize().as_bytes(),
            members: Vec::new(),
        });
        freeflow_rpc::write_frame(
            &mut stream,
            freeflow_proto::frame::FLAG_REPLY,
            freeflow_proto::frame::OPCODE_AUTHENTICATE,
            0,
            &freeflow_proto::encode(&outcome),
            &[],
        )
        .await
        .unwrap();
        let _request = freeflow_rpc::read_frame(&mut stream, 1 << 20)
            .await
            .unwrap();
        drop(stream);
    });
    let connection = Connection::connect(
        &address,
        &key,
        &ConnectOptions {
            call_timeout_ms: 60_000,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(connection.identity(), "doomed");
    let started = std::time::Instant::now();
    let error = connection
        .call(&write_request(1, 0), Bytes::from_static(b"lost"))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, RpcError::Disconnected { address: a } if *a == address),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(connection.is_closed());
    let again = connection
        .call(&write_request(1, 0), Bytes::new())
        .await
        .unwrap_err();
    assert!(matches!(again, RpcError::Disconnected { .. }));
}

/// A call whose server never answers ends with `TimedOut` naming the request.
#[tokio::test]
async fn an_unanswered_call_times_out() {
    let key = ClusterKey::generate().unwrap();
    let address = start_server(&key, ServerOptions::new("test")).await;
    let connection = Connection::connect(
        &address,
        &key,
        &ConnectOptions {
            call_timeout_ms: 300,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let error = connection
        .call(&write_request(1, 5_000), Bytes::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            RpcError::TimedOut {
                request: "WriteObject",
                timeout_ms: 300,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(error.code(), ErrorCode::TimedOut);
    // The connection stays usable; the late reply is discarded.
    let (_, echoed) = connection
        .call(&write_request(1, 0), Bytes::from_static(b"ok"))
        .await
        .unwrap();
    assert_eq!(&echoed[..], b"ok");
}

/// Regression: stopping a server (aborting `serve`) used to leave its accepted connections
/// running, so a "stopped" server kept serving and held its store open.
#[tokio::test]
async fn stopping_the_server_closes_its_connections() {
    let key = ClusterKey::generate().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(serve(
        listener,
        key.clone(),
        ServerOptions::new("test"),
        Arc::new(Echo),
    ));
    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    connection
        .call(&write_request(1, 0), Bytes::new())
        .await
        .unwrap();
    server.abort();
    let _ = server.await;
    let error = tokio::time::timeout(
        Duration::from_secs(5),
        connection.call(&write_request(1, 0), Bytes::new()),
    )
    .await
    .expect("call hung after the server stopped")
    .unwrap_err();
    assert!(matches!(error, RpcError::Disconnected { .. }), "{error}");
}

/// A frame that starts and then stalls (slowloris) is cut off after the frame timeout,
/// while an idle connection between frames is left alone.
#[tokio::test]
async fn a_stalled_frame_is_cut_off_but_idleness_is_not() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("test");
    options.frame_timeout_ms = 300;
    let address = start_server(&key, options).await;
    let idle = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    let mut stalled = raw_authenticated(&address, &key).await;
    stalled
        .write_all(&freeflow_proto::frame::MAGIC.to_le_bytes())
        .await
        .unwrap();
    stalled.write_all(&[1, 0, 200, 0]).await.unwrap();
    assert_closed_by_server(stalled).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (_, echoed) = idle
        .call(&write_request(1, 0), Bytes::from_static(b"idle is fine"))
        .await
        .unwrap();
    assert_eq!(&echoed[..], b"idle is fine");
}

/// Before authentication a peer may not make the server allocate a large header section.
#[tokio::test]
async fn an_unauthenticated_peer_cannot_announce_a_large_header() {
    let key = ClusterKey::generate().unwrap();
    let address = start_server(&key, ServerOptions::new("test")).await;
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let _hello = freeflow_rpc::read_frame(&mut stream, 0).await.unwrap();
    let fixed = freeflow_proto::frame::FrameHeader {
        flags: 0,
        opcode: freeflow_proto::frame::OPCODE_AUTHENTICATE,
        request_id: 0,
        header_length: 100_000,
        payload_length: 0,
        checksum: 0,
        credit: 0,
    };
    stream.write_all(&fixed.encode()).await.unwrap();
    assert_closed_by_server(stream).await;
}

/// Peers that connect and never authenticate cannot take every slot: a slot is held one
/// handshake timeout at most, and a client arriving while all are taken waits for one
/// instead of being closed (many clients connecting at once all get in).
#[tokio::test]
async fn unauthenticated_connections_have_a_limit_of_their_own() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("test");
    options.handshakes_max = 1;
    options.handshake_timeout_ms = 400;
    let address = start_server(&key, options).await;
    let mut squatter = tokio::net::TcpStream::connect(&address).await.unwrap();
    let _hello = freeflow_rpc::read_frame(&mut squatter, 0).await.unwrap();
    let started = std::time::Instant::now();
    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "the client authenticated after {waited:?}, while the squatter held the only slot"
    );
    connection
        .call(&write_request(1, 0), Bytes::new())
        .await
        .unwrap();
    // The squatter was closed at its timeout.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), squatter.read_to_end(&mut rest))
        .await
        .expect("the squatter's connection stays open past its handshake timeout");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
}

/// Far more clients than handshake slots connecting at the same moment all get in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_herd_of_clients_connecting_at_once_all_authenticate() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("test");
    options.handshakes_max = 2;
    let address = start_server(&key, options).await;
    let connects = (0..64).map(|_| {
        let (address, key) = (address.clone(), key.clone());
        tokio::spawn(async move {
            let connection =
                Connection::connect(&address, &key, &ConnectOptions::default()).await?;
            connection.call(&write_request(1, 0), Bytes::new()).await?;
            Ok::<_, RpcError>(connection)
        })
    });
    let mut connections = Vec::new();
    for (index, connect) in connects.collect::<Vec<_>>().into_iter().enumerate() {
        match connect.await.unwrap() {
            Ok(connection) => connections.push(connection),
            Err(error) => panic!("client {index} of 64 was turned away: {error}"),
        }
    }
    assert_eq!(connections.len(), 64);
}

/// With a server-wide payload budget smaller than what clients send at once, requests
/// wait for room instead of failing, and all complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_server_payload_budget_still_carries_every_request() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("budget");
    options.payload_length_max = 64 << 10;
    options.payload_bytes_in_flight_max = 64 << 10;
    let address = start_server(&key, options).await;
    let mut calls = Vec::new();
    for _ in 0..3 {
        let connection = Connection::connect(&address, &key, &ConnectOptions::default())
            .await
            .unwrap();
        for _ in 0..10 {
            let connection = connection.clone();
            calls.push(tokio::spawn(async move {
                connection
                    .call(&write_request(1, 5), Bytes::from(vec![9u8; 40_000]))
                    .await
                    .map(|(_, p)| p.len())
            }));
        }
    }
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 40_000);
    }
}

/// Credits: six connections writing at once to a server whose budget holds two smallest
/// windows. The server hands credit round (none is starved: every call completes well
/// within its timeout), never lets the connections hold more than the budget between
/// them, and each client keeps to the window the server's replies give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_share_a_small_budget_by_credits_and_every_call_completes() {
    const MIB: u32 = 1 << 20;
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("credits");
    options.payload_length_max = MIB;
    options.payload_bytes_in_flight_max = 2 * u64::from(MIB);
    let address = start_server(&key, options).await;
    let mut connections = Vec::new();
    for index in 0..6 {
        let options = ConnectOptions {
            client_name: format!("writer-{index}"),
            call_timeout_ms: 20_000,
            ..ConnectOptions::default()
        };
        connections.push(Connection::connect(&address, &key, &options).await.unwrap());
    }
    // Every client starts from the window its hello gave: one smallest window at most.
    assert!(connections.iter().all(|c| c.window_bytes() <= MIB));
    let mut calls = Vec::new();
    for connection in &connections {
        for _ in 0..8 {
            let connection = connection.clone();
            calls.push(tokio::spawn(async move {
                connection
                    .call(&write_request(1, 10), Bytes::from(vec![5u8; 512 << 10]))
                    .await
                    .map(|(_, payload)| payload.len())
            }));
        }
    }
    // While they run, the windows the clients hold never add up to more than the budget
    // plus what the server may still be telling them (a grant and a take-back travel in
    // separate replies: up to two smallest windows).
    let watcher = {
        let connections = connections.clone();
        tokio::spawn(async move {
            let mut widest = 0u64;
            for _ in 0..40 {
                let total: u64 = connections
                    .iter()
                    .map(|c| u64::from(c.window_bytes()))
                    .sum();
                widest = widest.max(total);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            widest
        })
    };
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 512 << 10);
    }
    let widest = watcher.await.unwrap();
    assert!(
        widest <= 4 * u64::from(MIB),
        "clients held {widest} bytes of window against a budget of 2 MiB"
    );
}

/// Serves reads of `length` bytes after 5 ms, noting the most reply bytes it held at once.
#[derive(Default)]
struct CountedReads {
    held: std::sync::atomic::AtomicU64,
    most: std::sync::atomic::AtomicU64,
}

impl Service for CountedReads {
    fn reply_bytes(&self, opcode: u16, header: &[u8]) -> u32 {
        if opcode != ReadObject::OPCODE {
            return 0;
        }
        freeflow_proto::decode::<ReadObject>(header).map_or(0, |read| read.length)
    }

    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        use std::sync::atomic::Ordering;
        handle(frame, |request: ReadObject, _| async move {
            let length = u64::from(request.length);
            let now = self.held.fetch_add(length, Ordering::SeqCst) + length;
            self.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.held.fetch_sub(length, Ordering::SeqCst);
            Ok((
                ReadReply {
                    length: request.length,
                },
                Bytes::from(vec![3u8; request.length as usize]),
            ))
        })
        .await
    }
}

/// Reads count against the budget too: many clients reading at once from a server whose
/// budget holds two replies never make it hold more, and every read completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_of_reads_stay_within_the_payload_budget() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("reads");
    options.payload_length_max = 1 << 20;
    options.payload_bytes_in_flight_max = 2 << 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let service = Arc::new(CountedReads::default());
    tokio::spawn(serve(listener, key.clone(), options, service.clone()));
    let mut calls = Vec::new();
    for _ in 0..4 {
        let connection = Connection::connect(&address, &key, &ConnectOptions::default())
            .await
            .unwrap();
        for _ in 0..10 {
            let connection = connection.clone();
            calls.push(tokio::spawn(async move {
                let read = ReadObject {
                    object: ObjectId {
                        inode: 1,
                        stripe_index: 0,
                    },
                    offset: 0,
                    length: 1 << 20,
                    map_version: 0,
                };
                connection
                    .call(&read, Bytes::new())
                    .await
                    .map(|(_, payload)| payload.len())
            }));
        }
    }
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 1 << 20);
    }
    let most = service.most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        most <= 2 << 20,
        "the server held {most} bytes of replies at once"
    );
    assert!(most >= 1 << 20);
}

/// A lone writer's window grows from the smallest to the server's largest while it sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_connection_window_grows_to_the_largest() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("grow");
    options.window_bytes = 16 << 20;
    let address = start_server(&key, options).await;
    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(connection.window_bytes(), 1 << 20);
    let started = std::time::Instant::now();
    while connection.window_bytes() < 16 << 20 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "window stuck at {}",
            connection.window_bytes()
        );
        connection
            .call(&write_request(1, 1), Bytes::from(vec![1u8; 256 << 10]))
            .await
            .unwrap();
    }
}

/// An echo server on a TCP port and a Unix socket at once: the directory holding the
/// socket (keep it), the socket's path and the TCP address.
async fn start_server_on_both(key: &ClusterKey) -> (tempfile::TempDir, std::path::PathBuf, String) {
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("server.sock");
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_address = tcp.local_addr().unwrap().to_string();
    let unix = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(serve_with_unix(
        tcp,
        Some(unix),
        key.clone(),
        ServerOptions::new("both"),
        Arc::new(Echo),
    ));
    (directory, socket, tcp_address)
}

/// One server on TCP and a Unix socket at once: calls, large payloads (read to a page
/// boundary) and errors arrive the same way on both, and a wrong key is refused on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answers_on_tcp_and_on_its_unix_socket() {
    let key = ClusterKey::generate().unwrap();
    let (directory, socket, tcp_address) = start_server_on_both(&key).await;
    let unix_address = format!("unix:{}", socket.display());
    for address in [&unix_address, &tcp_address] {
        let connection = Connection::connect(address, &key, &ConnectOptions::default())
            .await
            .unwrap();
        assert_eq!(connection.identity(), "both");
        let payload = Bytes::from((0..(1 << 20) + 7).map(|i| i as u8).collect::<Vec<u8>>());
        let (_, echoed) = connection
            .call(&write_request(1, 0), payload.clone())
            .await
            .unwrap();
        assert_eq!(echoed, payload, "{address}");
        let error = connection
            .call(&write_request(0, 0), Bytes::new())
            .await
            .unwrap_err();
        assert!(
            matches!(&error, RpcError::Remote(wire) if wire.code == ErrorCode::NotFound),
            "{address}: {error}"
        );
        let wrong = ClusterKey::generate().unwrap();
        assert!(
            Connection::connect(address, &wrong, &ConnectOptions::default())
                .await
                .is_err(),
            "{address} refuses a wrong key"
        );
    }
    let missing = format!("unix:{}", directory.path().join("none.sock").display());
    let error = Connection::connect(&missing, &key, &ConnectOptions::default())
        .await
        .unwrap_err();
    assert!(error.to_string().contains("none.sock"), "{error}");
}

/// Frames on a server's Unix socket carry no checksum of their payload (protocol version
/// 5), and on its TCP port they do: a raw request written by that rule is answered (its
/// payload echoed, read by the same rule), and one written by the other rule is a bad
/// checksum that closes the connection.
#[tokio::test]
async fn a_unix_socket_connection_leaves_payloads_out_of_the_checksum() {
    let key = ClusterKey::generate().unwrap();
    let (_directory, socket, tcp_address) = start_server_on_both(&key).await;
    let request = freeflow_proto::encode(&write_request(1, 0));
    let payload: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let send = async |stream: &mut dyn AsyncWriteRead, covered: bool| {
        let extras = freeflow_rpc::FrameExtras {
            credit: None,
            payload_checksum: covered,
        };
        freeflow_rpc::write_frame_with(
            stream,
            extras,
            0,
            WriteObject::OPCODE,
            7,
            &request,
            &payload,
        )
        .await
        .unwrap();
    };
    // The server's rule for each listener, and the answer read by the same rule.
    for (over_unix, covered) in [(true, false), (false, true)] {
        let mut stream = authenticated_on(over_unix, &socket, &tcp_address, &key).await;
        send(&mut *stream, covered).await;
        let reply = loop {
            let frame = freeflow_rpc::read_frame_covering(&mut stream, 1 << 20, covered)
                .await
                .unwrap_or_else(|error| panic!("unix {over_unix}: {error}"));
            if frame.fixed.request_id == 7 {
                break frame;
            }
        };
        assert_eq!(&reply.payload[..], &payload[..], "unix {over_unix}");
    }
    // The other rule on each is refused.
    for (over_unix, covered) in [(true, true), (false, false)] {
        let mut stream = authenticated_on(over_unix, &socket, &tcp_address, &key).await;
        send(&mut *stream, covered).await;
        assert_closed_by_server(stream).await;
    }
}

/// A raw stream to the Unix socket or the TCP port, authenticated by hand.
async fn authenticated_on(
    over_unix: bool,
    socket: &std::path::Path,
    tcp_address: &str,
    key: &ClusterKey,
) -> Box<dyn AsyncWriteRead> {
    let mut stream: Box<dyn AsyncWriteRead> = if over_unix {
        Box::new(tokio::net::UnixStream::connect(socket).await.unwrap())
    } else {
        Box::new(tokio::net::TcpStream::connect(tcp_address).await.unwrap())
    };
    raw_authenticate(&mut stream, key).await;
    stream
}

/// A byte stream both ways, for tests that take TCP and Unix streams alike.
trait AsyncWriteRead: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> AsyncWriteRead for T {}

/// A request that takes longer than the liveness timeout on a server that is alive is
/// not cut off: the server answers the connection's pings while the request runs.
#[tokio::test]
async fn a_slow_request_on_a_live_server_outlasts_the_liveness_timeout() {
    let key = ClusterKey::generate().unwrap();
    let address = start_server(&key, ServerOptions::new("test")).await;
    let connection = Connection::connect(
        &address,
        &key,
        &ConnectOptions {
            liveness_timeout_ms: 200,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (_, echoed) = connection
        .call(&write_request(1, 2_500), Bytes::from_static(b"slow"))
        .await
        .expect("a slow request on a live server completes");
    assert_eq!(&echoed[..], b"slow");
    assert!(!connection.is_closed());
}

/// Passes bytes both ways between a client and a server until frozen; then holds both
/// sockets open and passes nothing (a server cut off or hung, as the client sees it).
async fn freezable_proxy(server: String) -> (String, Arc<std::sync::atomic::AtomicBool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = frozen.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let upstream = tokio::net::TcpStream::connect(&server).await.unwrap();
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = upstream.into_split();
        let pass = |mut from: tokio::net::tcp::OwnedReadHalf,
                    mut to: tokio::net::tcp::OwnedWriteHalf,
                    frozen: Arc<std::sync::atomic::AtomicBool>| async move {
            let mut buffer = vec![0u8; 64 << 10];
            while let Ok(read) = from.read(&mut buffer).await {
                if read == 0 {
                    break;
                }
                if frozen.load(std::sync::atomic::Ordering::Acquire) {
                    // Hold everything: keep both halves, pass nothing, forever.
                    std::future::pending::<()>().await;
                }
                if to.write_all(&buffer[..read]).await.is_err() {
                    break;
                }
            }
            (from, to)
        };
        let up = tokio::spawn(pass(client_read, server_write, flag.clone()));
        let down = tokio::spawn(pass(server_read, client_write, flag));
        let _ = (up.await, down.await);
    });
    (address, frozen)
}

/// A server that goes silent without closing its socket (cut off, hung) while a call
/// waits is found out by the liveness check: the call fails with `Disconnected` long
/// before its own timeout, and the connection is closed, so a caller that retries goes
/// elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_is_found_dead_before_the_call_times_out() {
    let key = ClusterKey::generate().unwrap();
    let server = start_server(&key, ServerOptions::new("test")).await;
    let (address, frozen) = freezable_proxy(server).await;
    let connection = Connection::connect(
        &address,
        &key,
        &ConnectOptions {
            call_timeout_ms: 60_000,
            liveness_timeout_ms: 400,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (_, echoed) = connection
        .call(&write_request(1, 0), Bytes::from_static(b"alive"))
        .await
        .unwrap();
    assert_eq!(&echoed[..], b"alive");
    frozen.store(true, std::sync::atomic::Ordering::Release);
    let error = connection
        .call(&write_request(1, 0), Bytes::from_static(b"lost"))
        .await
        .unwrap_err();
    assert!(matches!(error, RpcError::Disconnected { .. }), "{error}");
    assert!(connection.is_closed());
}

/// A server whose connection is at its request limit reads nothing more (the pings wait
/// behind the next request), but tells the client it is alive while it waits: requests
/// queued behind a slow one outlast the liveness timeout and complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_its_request_limit_is_not_taken_for_dead() {
    let key = ClusterKey::generate().unwrap();
    let mut options = ServerOptions::new("test");
    options.requests_in_flight_max = 1;
    let address = start_server(&key, options).await;
    let connection = Connection::connect(
        &address,
        &key,
        &ConnectOptions {
            liveness_timeout_ms: 400,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (slow_request, queued_request) = (write_request(1, 2_500), write_request(1, 0));
    let slow = connection.call(&slow_request, Bytes::from_static(b"slow"));
    let queued = connection.call(&queued_request, Bytes::from_static(b"queued"));
    let (slow, queued) = tokio::join!(slow, queued);
    assert_eq!(&slow.expect("the slow request completes").1[..], b"slow");
    assert_eq!(
        &queued.expect("the queued request completes").1[..],
        b"queued"
    );
    assert!(!connection.is_closed());
}

/// A replicated metadata cluster's leader is found however its other members fail: one
/// member accepts no connection's handshake (hung, or cut off with its socket open),
/// another answers as a follower (epoch 0), the one tried first refuses our key (a
/// misconfigured member); the leader, listed last, is found well before the hung member's
/// connect timeout (the members are asked at once). With only refusing members, the
/// refusal is the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_is_found_past_a_hung_member_and_a_follower() {
    let key = ClusterKey::generate().unwrap();
    // Bound and listening, never accepting: the kernel completes the TCP handshake, no
    // hello ever comes.
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung_address = hung.local_addr().unwrap().to_string();
    let follower = start_server(&key, ServerOptions::new("meta")).await;
    let mut leading = ServerOptions::new("meta");
    leading.epoch = 5;
    let leader = start_server(&key, leading).await;
    let other_key = ClusterKey::generate().unwrap();
    let mut foreign_leading = ServerOptions::new("meta");
    foreign_leading.epoch = 9;
    let foreign = start_server(&other_key, foreign_leading).await;
    let addresses = format!("{hung_address},{foreign},{follower},{leader}");
    let options = ConnectOptions {
        connect_timeout_ms: 120_000,
        ..ConnectOptions::default()
    };
    let found = tokio::time::timeout(
        Duration::from_secs(60),
        Connection::connect_leader(&addresses, 1, &key, &options),
    )
    .await
    .expect("the leader is found before the hung member's connect timeout")
    .expect("a leader answers");
    assert_eq!(found.1, 3);
    assert_eq!(found.0.epoch(), 5);
    drop(hung);
    let refusing = format!("{foreign},{foreign}");
    let error = Connection::connect_leader(&refusing, 0, &key, &options)
        .await
        .expect_err("no member takes our key");
    assert!(matches!(error, RpcError::Refused { .. }), "{error}");
}

/// A sealed memory file of `length` bytes holding `bytes` at `at`.
fn sealed_region(length: usize, at: u64, bytes: &[u8]) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: a valid name and documented flags.
    let raw = unsafe {
        libc::memfd_create(
            c"test-region".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(raw >= 0);
    // SAFETY: a descriptor just made, owned by nothing else.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    let file = std::fs::File::from(fd.try_clone().unwrap());
    file.set_len(length as u64).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, bytes, at).unwrap();
    // SAFETY: a plain call on our descriptor.
    assert_eq!(
        unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) },
        0
    );
    fd
}

/// A request whose payload is in a shared region is served with the region's bytes (the
/// payload's length counted as any payload's); a reference to a region the server does
/// not know, one past the region's end, and one over TCP close the connection, and the
/// server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_payloads_come_from_their_region_and_bad_references_close_the_connection() {
    use freeflow_rpc::shared::{MappedRegion, SharedRegions};
    let key = ClusterKey::generate().unwrap();
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("server.sock");
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_address = tcp.local_addr().unwrap().to_string();
    let unix = tokio::net::UnixListener::bind(&socket).unwrap();
    let regions = Arc::new(SharedRegions::default());
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    let region_bytes = 1 << 20;
    let fd = sealed_region(region_bytes, 4096, &payload);
    let (name, _unmapped) = regions.insert(MappedRegion::map(&fd).unwrap()).unwrap();
    let options = ServerOptions {
        shared_regions: Some(regions.clone()),
        ..ServerOptions::new("shared")
    };
    tokio::spawn(serve_with_unix(
        tcp,
        Some(unix),
        key.clone(),
        options,
        Arc::new(Echo),
    ));
    let request = freeflow_proto::encode(&write_request(1, 0));
    // A refused frame may be cut off while it is written (the server closes as soon as it
    // knows): only the closed connection is checked then.
    let send = async |stream: &mut dyn AsyncWriteRead, region: u64, offset: u64, length: u32| {
        let at = freeflow_rpc::SharedRef { region, offset };
        freeflow_rpc::write_shared_frame(stream, 0, WriteObject::OPCODE, 7, &request, length, at)
            .await
    };
    let mut stream = authenticated_on(true, &socket, &tcp_address, &key).await;
    send(&mut *stream, name, 4096, payload.len() as u32)
        .await
        .unwrap();
    let reply = loop {
        let frame = freeflow_rpc::read_frame_covering(&mut stream, 1 << 20, false)
            .await
            .unwrap();
        if frame.fixed.request_id == 7 {
            break frame;
        }
    };
    assert_eq!(&reply.payload[..], &payload[..], "the region's bytes");

    for (region, offset, length) in [
        (name ^ 1, 4096, 1000),
        (name, region_bytes as u64 - 100, 1000),
        (name, u64::MAX - 10, 1000),
    ] {
        let mut stream = authenticated_on(true, &socket, &tcp_address, &key).await;
        let _ = send(&mut *stream, region, offset, length).await;
        assert_closed_by_server(stream).await;
    }
    let mut stream = authenticated_on(false, &socket, &tcp_address, &key).await;
    let _ = send(&mut *stream, name, 4096, 1000).await;
    assert_closed_by_server(stream).await;

    // Forgotten, the region is refused too; the server still serves.
    regions.remove(name);
    let mut stream = authenticated_on(true, &socket, &tcp_address, &key).await;
    let _ = send(&mut *stream, name, 4096, 1000).await;
    assert_closed_by_server(stream).await;
    let unix_address = format!("unix:{}", socket.display());
    let connection = Connection::connect(&unix_address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    let (_, echoed) = connection
        .call(&write_request(1, 0), Bytes::from_static(b"still here"))
        .await
        .unwrap();
    assert_eq!(&echoed[..], b"still here");
}

/// Long polls (here WriteObject calls that wait 30 s) take slots of their own: eight of
/// them on a connection whose request limit is 2 leave room for a read, answered at once.
/// Undeclared, the same eight fill the connection's slots and the read waits behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_do_not_take_the_slots_of_other_requests() {
    let key = ClusterKey::generate().unwrap();
    for declared in [true, false] {
        let mut options = ServerOptions::new("test");
        options.requests_in_flight_max = 2;
        if declared {
            options.long_poll_opcodes = vec![WriteObject::OPCODE];
        }
        let address = start_server(&key, options).await;
        let connection = Arc::new(
            Connection::connect(
                &address,
                &key,
                &ConnectOptions {
                    call_timeout_ms: 120_000,
                    ..Default::default()
                },
            )
            .await
            .unwrap(),
        );
        let polls: Vec<_> = (0..8)
            .map(|_| {
                let connection = connection.clone();
                tokio::spawn(async move {
                    let _ = connection
                        .call(&write_request(1, 30_000), Bytes::from_static(b"wait"))
                        .await;
                })
            })
            .collect();
        // Time for the server to have read (at least) two of them on a slow machine.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let read = ReadObject {
            object: ObjectId {
                inode: 1,
                stripe_index: 0,
            },
            offset: 0,
            length: 3,
            map_version: 0,
        };
        let answered =
            tokio::time::timeout(Duration::from_secs(3), connection.call(&read, Bytes::new()))
                .await;
        if declared {
            let (reply, data) = answered
                .expect("a read beside eight long polls is answered at once")
                .expect("the read succeeds");
            assert_eq!((reply.length, &data[..]), (3, &[7u8, 7, 7][..]));
        } else {
            assert!(
                answered.is_err(),
                "undeclared, the polls hold both slots and the read waits"
            );
        }
        for poll in polls {
            poll.abort();
        }
    }
}
