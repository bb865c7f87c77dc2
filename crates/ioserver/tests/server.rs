//! The I/O server over the real RPC layer, in one process: requests and their error codes on
//! the wire, the data directory's identity, and registration with a (fake) meta server,
//! including a meta server that only appears after the I/O server started.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use freeflow_ioserver::{start, EngineKind, IoConfig, IoServerError};
use freeflow_proto::io::{
    ReadObject, RemoveObjects, ServerStats, SyncObjects, TruncateObject, WriteObject,
};
use freeflow_proto::meta::{RegisterReply, RegisterServer};
use freeflow_proto::{ErrorCode, Request};
use freeflow_rpc::{
    handle, ClusterKey, ConnectOptions, Connection, Frame, PeerInfo, Reply, RpcError, Service,
};
use freeflow_types::{limits, ObjectId};

fn config(directory: &tempfile::TempDir, engine: EngineKind, meta_address: String) -> IoConfig {
    IoConfig {
        server_id: 5,
        listen_address: "127.0.0.1:0".to_owned(),
        data_dir: directory.path().join("data"),
        meta_address,
        engine,
        buffer_count: 8,
        buffer_bytes: 64 << 10,
        register_backoff_max_ms: 200,
        meta_connect_timeout_ms: 500,
        ..IoConfig::default()
    }
}

/// An address nothing answers at (connections are refused) until [`start_fake_meta`]
/// listens there: the port stays bound by the returned socket, so no other test running
/// at the same time can be handed it.
fn dead_address() -> (String, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let address = socket.local_addr().unwrap().to_string();
    (address, socket)
}

async fn requests_over_rpc(engine: EngineKind) {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (meta_address, reserved) = dead_address();
    let (meta, meta_task) = start_fake_meta(reserved, &key).await;
    let server = start(config(&directory, engine, meta_address), key.clone())
        .await
        .unwrap();
    wait_until("serving data", || server.serves_data()).await;
    assert!(!meta.registrations.lock().unwrap().is_empty());
    let expected_engine = if engine == EngineKind::Uring {
        "io_uring"
    } else {
        "threads"
    };
    assert_eq!(server.engine_name(), expected_engine);
    let connection = Connection::connect(
        &server.listen_address().to_string(),
        &key,
        &ConnectOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(connection.identity(), "io:5");

    let object = ObjectId {
        inode: 42,
        stripe_index: 2,
    };
    // 200 KiB: more than three 64 KiB buffers.
    let data: Vec<u8> = (0..200 << 10)
        .map(|index: u32| (index % 251) as u8)
        .collect();
    let write = WriteObject {
        grant: 0,
        charged: 0,
        object,
        offset: 4096,
        map_version: 0,
        forward: Vec::new(),
    };
    connection
        .call(&write, Bytes::from(data.clone()))
        .await
        .unwrap();
    let (reply, payload) = connection
        .call(
            &ReadObject {
                object,
                offset: 0,
                length: 1 << 20,
                map_version: 0,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(reply.length as usize, 4096 + data.len());
    assert_eq!(payload.len(), reply.length as usize);
    assert!(payload[..4096].iter().all(|&byte| byte == 0));
    assert!(payload[4096..] == data[..]);

    connection
        .call(
            &SyncObjects {
                objects: vec![object],
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    connection
        .call(
            &TruncateObject {
                object,
                length: 100,
                forward: Vec::new(),
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    let (reply, _) = connection
        .call(
            &ReadObject {
                object,
                offset: 0,
                length: 4096,
                map_version: 0,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(reply.length, 100);

    let (stats, _) = connection
        .call(&ServerStats {}, Bytes::new())
        .await
        .unwrap();
    assert_eq!(stats.server_id, 5);
    assert_eq!(stats.engine, expected_engine);
    assert!(stats.capacity_bytes >= stats.free_bytes && stats.capacity_bytes > 0);

    connection
        .call(
            &RemoveObjects {
                inode: 42,
                stripes: vec![2, 3],
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    let (reply, payload) = connection
        .call(
            &ReadObject {
                object,
                offset: 0,
                length: 4096,
                map_version: 0,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!((reply.length, payload.len()), (0, 0));

    fn code<T: std::fmt::Debug>(result: Result<T, RpcError>) -> ErrorCode {
        result.unwrap_err().code()
    }
    let too_far = WriteObject {
        grant: 0,
        charged: 0,
        object,
        offset: limits::FILE_SIZE_MAX,
        map_version: 0,
        forward: Vec::new(),
    };
    assert_eq!(
        code(connection.call(&too_far, Bytes::from_static(b"x")).await),
        ErrorCode::FileTooBig
    );
    let too_long = ReadObject {
        object,
        offset: 0,
        length: limits::IO_REQUEST_BYTES_MAX + 1,
        map_version: 0,
    };
    assert_eq!(
        code(connection.call(&too_long, Bytes::new()).await),
        ErrorCode::InvalidArgument
    );
    // The connection survives argument errors.
    assert!(!connection.is_closed());
    connection
        .call(&SyncObjects { objects: vec![] }, Bytes::new())
        .await
        .unwrap();

    assert!(server.is_registered());
    server.shutdown().await;
    meta_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_rpc_with_io_uring() {
    requests_over_rpc(EngineKind::Uring).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_rpc_with_threads() {
    requests_over_rpc(EngineKind::Threads).await;
}

#[tokio::test]
async fn a_data_dir_of_another_server_is_refused() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (dead, _reserved) = dead_address();
    let mut config = config(&directory, EngineKind::Threads, dead);
    start(config.clone(), key.clone())
        .await
        .unwrap()
        .shutdown()
        .await;
    config.server_id = 6;
    let error = start(config, key)
        .await
        .err()
        .expect("a foreign data dir must be refused");
    assert!(matches!(
        error,
        IoServerError::ServerIdMismatch {
            stored: 5,
            configured: 6,
            ..
        }
    ));
}

/// A meta server that records registrations and answers them with `cuts_owed`.
#[derive(Default)]
struct FakeMeta {
    registrations: Mutex<Vec<RegisterServer>>,
    cuts_owed: AtomicU32,
}

impl Service for FakeMeta {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        if frame.opcode != RegisterServer::OPCODE {
            return Err(format!("unexpected opcode {}", frame.opcode));
        }
        handle(frame, |request: RegisterServer, _| async move {
            self.registrations.lock().unwrap().push(request);
            Ok((
                RegisterReply {
                    heartbeat_interval_ms: 50,
                    cuts_owed: self.cuts_owed.load(Ordering::SeqCst),
                    map_version: 0,
                    resync: None,
                    fill: None,
                    lease_ms: 60_000,
                },
                Bytes::new(),
            ))
        })
        .await
    }
}

/// A fake meta server listening on the socket [`dead_address`] reserved.
async fn start_fake_meta(
    reserved: tokio::net::TcpSocket,
    key: &ClusterKey,
) -> (Arc<FakeMeta>, tokio::task::JoinHandle<std::io::Result<()>>) {
    let meta = Arc::new(FakeMeta::default());
    let listener = reserved.listen(128).unwrap();
    let task = tokio::spawn(freeflow_rpc::serve(
        listener,
        key.clone(),
        freeflow_rpc::ServerOptions::new("meta"),
        Arc::clone(&meta),
    ));
    (meta, task)
}

async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "never {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A write at the start of `object` by a client without a space grant.
fn grantless_write(object: ObjectId) -> WriteObject {
    WriteObject {
        grant: 0,
        charged: 0,
        object,
        offset: 0,
        map_version: 0,
        forward: Vec::new(),
    }
}

/// The `Busy` refusal a data request gets while the gate is closed, with its message.
async fn refused_busy(connection: &Connection, object: ObjectId) -> String {
    let write = grantless_write(object);
    match connection.call(&write, Bytes::from_static(b"early")).await {
        Err(RpcError::Remote(error)) if error.code == ErrorCode::Busy => error.message,
        other => panic!("a write before the gate opened was not refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_once_the_meta_server_appears_and_serves_data_only_when_no_cut_is_owed() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (meta_address, reserved) = dead_address();
    let server = start(
        config(&directory, EngineKind::Uring, meta_address.clone()),
        key.clone(),
    )
    .await
    .unwrap();
    let connection = Connection::connect(
        &server.listen_address().to_string(),
        &key,
        &ConnectOptions::default(),
    )
    .await
    .unwrap();
    let object = ObjectId {
        inode: 7,
        stripe_index: 0,
    };
    // The meta server is away: the I/O server answers, but serves no data, since it cannot
    // know whether a file was shrunk while it was down.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!server.is_registered());
    assert!(!server.serves_data());
    let refusal = refused_busy(&connection, object).await;
    assert!(refusal.contains("has not answered"), "{refusal}");
    let read = ReadObject {
        object,
        offset: 0,
        length: 10,
        map_version: 0,
    };
    let refused = connection.call(&read, Bytes::new()).await.unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Busy);
    // The meta server's own requests pass: the cuts themselves, and statistics.
    connection
        .call(
            &TruncateObject {
                object,
                length: 0,
                forward: Vec::new(),
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    connection
        .call(&ServerStats {}, Bytes::new())
        .await
        .unwrap();

    // It appears, but says two cuts are still owed here.
    let (meta, meta_task) = start_fake_meta(reserved, &key).await;
    meta.cuts_owed.store(2, Ordering::SeqCst);
    wait_until("registered", || server.is_registered()).await;
    let refusal = refused_busy(&connection, object).await;
    assert!(refusal.contains("2 truncation cut(s)"), "{refusal}");
    assert!(!server.serves_data());

    // Owed cuts made: data flows.
    meta.cuts_owed.store(0, Ordering::SeqCst);
    wait_until("serving data", || server.serves_data()).await;
    write_at_start(&connection, object, b"after").await;
    let (_, data) = connection.call(&read, Bytes::new()).await.unwrap();
    assert_eq!(&data[..], b"after");

    // A later heartbeat that reports a cut owed closes the gate again.
    meta.cuts_owed.store(1, Ordering::SeqCst);
    wait_until("refusing data again", || !server.serves_data()).await;
    let refused = connection.call(&read, Bytes::new()).await.unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Busy);

    let count = meta.registrations.lock().unwrap().len();
    meta.cuts_owed.store(0, Ordering::SeqCst);
    wait_until("heartbeating", || {
        meta.registrations.lock().unwrap().len() >= count + 3
    })
    .await;
    assert!(server.serves_data());
    let last = meta.registrations.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.server_id, 5);
    assert_eq!(last.address, server.listen_address().to_string());
    assert!(last.capacity_bytes > 0);
    server.shutdown().await;
    meta_task.abort();
}

/// An I/O server with `unix_socket` answers there as on TCP; a stale socket left by a
/// stopped server is replaced, a socket a running server answers on is not taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_is_served_and_never_taken_from_a_running_server() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let socket = directory.path().join("io.sock");
    let (dead, _reserved) = dead_address();
    let mut config = config(&directory, EngineKind::Threads, dead);
    config.unix_socket = Some(socket.clone());
    config.advertise_address = Some(format!("unix:{}", socket.display()));
    let server = start(config.clone(), key.clone()).await.unwrap();
    let unix = Connection::connect(
        &format!("unix:{}", socket.display()),
        &key,
        &ConnectOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(unix.identity(), "io:5");
    let (stats, _) = unix.call(&ServerStats {}, Bytes::new()).await.unwrap();
    assert_eq!(stats.server_id, 5);

    // A second server on the same socket (its own data directory and port) is refused.
    let other = tempfile::tempdir().unwrap();
    let mut second = config.clone();
    second.data_dir = other.path().join("data");
    let error = start(second.clone(), key.clone())
        .await
        .err()
        .expect("refused");
    assert!(
        error.to_string().contains("another server is listening"),
        "{error}"
    );
    assert!(unix.call(&ServerStats {}, Bytes::new()).await.is_ok());

    // Stopped, its socket file is stale: the next start replaces it.
    server.shutdown().await;
    drop(unix);
    assert!(socket.exists(), "a stopped server leaves its socket behind");
    let server = start(second, key.clone()).await.unwrap();
    let unix = Connection::connect(
        &format!("unix:{}", socket.display()),
        &key,
        &ConnectOptions::default(),
    )
    .await
    .unwrap();
    assert!(unix.call(&ServerStats {}, Bytes::new()).await.is_ok());
    server.shutdown().await;
}

/// Write `data` at the start of `object`, as a client without a grant does.
async fn write_at_start(connection: &Connection, object: ObjectId, data: &'static [u8]) {
    let write = grantless_write(object);
    connection
        .call(&write, Bytes::from_static(data))
        .await
        .unwrap();
}

/// An I/O server (io_uring engine) that also listens on a Unix socket in `directory`: the
/// socket's path and the server.
async fn start_on_unix_socket(
    directory: &tempfile::TempDir,
    key: &ClusterKey,
    meta_address: &str,
) -> (std::path::PathBuf, freeflow_ioserver::RunningIo) {
    let socket = directory.path().join("io.sock");
    let server = start(
        IoConfig {
            unix_socket: Some(socket.clone()),
            ..config(directory, EngineKind::Uring, meta_address.to_owned())
        },
        key.clone(),
    )
    .await
    .unwrap();
    (socket, server)
}

/// One I/O server serving data on a Unix socket (with its fake meta server): its
/// directory (kept while the test runs), key, meta task, socket and server.
async fn serving_on_a_unix_socket() -> (
    tempfile::TempDir,
    ClusterKey,
    tokio::task::JoinHandle<std::io::Result<()>>,
    std::path::PathBuf,
    freeflow_ioserver::RunningIo,
) {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (meta_address, meta_task) = serve_fake_meta(&key).await;
    let (socket, server) = start_on_unix_socket(&directory, &key, &meta_address).await;
    wait_until("serving data", || server.serves_data()).await;
    (directory, key, meta_task, socket, server)
}

/// A fake meta server on a port of its own, up before any I/O server: an address found
/// free and bound later could be one another test here counts on nobody answering at.
async fn serve_fake_meta(
    key: &ClusterKey,
) -> (String, tokio::task::JoinHandle<std::io::Result<()>>) {
    let meta_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let meta_address = meta_listener.local_addr().unwrap().to_string();
    let meta_task = tokio::spawn(freeflow_rpc::serve(
        meta_listener,
        key.clone(),
        freeflow_rpc::ServerOptions::new("meta"),
        Arc::new(FakeMeta::default()),
    ));
    (meta_address, meta_task)
}

/// `length` bytes of `object` at `offset`, read through `connection`.
async fn read_object(
    connection: &Connection,
    object: ObjectId,
    offset: u64,
    length: usize,
) -> Bytes {
    let request = ReadObject {
        object,
        offset,
        length: length as u32,
        map_version: 0,
    };
    connection.call(&request, Bytes::new()).await.unwrap().1
}

/// One question on a local-reads socket: the answer and the descriptor with it.
async fn ask_local(
    connection: &freeflow_rpc::local::SeqpacketConn,
    object: ObjectId,
) -> (
    Result<freeflow_proto::io::OpenedForReading, freeflow_proto::WireError>,
    Option<std::os::fd::OwnedFd>,
) {
    let request = freeflow_proto::io::LocalRequest::Open(freeflow_proto::io::OpenForReading {
        version: freeflow_proto::PROTOCOL_VERSION,
        object,
    });
    connection
        .send(&freeflow_proto::encode(&request), None)
        .await
        .unwrap();
    let mut packet = vec![0u8; freeflow_rpc::local::LOCAL_PACKET_BYTES_MAX];
    let (length, descriptor) = connection.recv(&mut packet).await.unwrap();
    assert!(length > 0, "the server closed the connection");
    (
        freeflow_proto::decode(&packet[..length]).unwrap(),
        descriptor,
    )
}

/// The local-reads socket beside a Unix socket hands out read-only descriptors of
/// existing objects only while the server serves data, closes every connection when a
/// heartbeat says a cut is owed, survives malformed packets, and closes with the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_reads_hand_out_descriptors_only_while_data_is_served() {
    use freeflow_rpc::local::{local_reads_path, SeqpacketConn};
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (meta_address, reserved) = dead_address();
    let (socket, server) = start_on_unix_socket(&directory, &key, &meta_address).await;
    let local_path = std::path::PathBuf::from(local_reads_path(&socket.to_string_lossy()));
    let object = ObjectId {
        inode: 9,
        stripe_index: 1,
    };
    let local = SeqpacketConn::connect(&local_path).unwrap();
    let (answer, descriptor) = ask_local(&local, object).await;
    assert_eq!(
        answer.unwrap_err().code,
        ErrorCode::Busy,
        "no registration yet"
    );
    assert!(descriptor.is_none());

    let (meta, meta_task) = start_fake_meta(reserved, &key).await;
    wait_until("serving data", || server.serves_data()).await;
    let (answer, descriptor) = ask_local(&local, object).await;
    assert!(!answer.unwrap().exists, "no object yet");
    assert!(descriptor.is_none());
    let connection = Connection::connect(
        &server.listen_address().to_string(),
        &key,
        &ConnectOptions::default(),
    )
    .await
    .unwrap();
    write_at_start(&connection, object, b"local bytes").await;
    let (answer, descriptor) = ask_local(&local, object).await;
    assert!(answer.unwrap().exists);
    let file = std::fs::File::from(descriptor.expect("a descriptor"));
    let mut read = [0u8; 64];
    let length = std::os::unix::fs::FileExt::read_at(&file, &mut read, 0).unwrap();
    assert_eq!(&read[..length], b"local bytes");
    let error = std::os::unix::fs::FileExt::write_at(&file, b"x", 0).unwrap_err();
    assert_eq!(error.raw_os_error(), Some(libc::EBADF), "read-only");

    // A malformed packet is answered with an error; the connection goes on.
    let other = SeqpacketConn::connect(&local_path).unwrap();
    other.send(b"\xff\xff\xff\xff", None).await.unwrap();
    let mut packet = vec![0u8; freeflow_rpc::local::LOCAL_PACKET_BYTES_MAX];
    let (length, _) = other.recv(&mut packet).await.unwrap();
    let answer: Result<freeflow_proto::io::OpenedForReading, freeflow_proto::WireError> =
        freeflow_proto::decode(&packet[..length]).unwrap();
    assert_eq!(answer.unwrap_err().code, ErrorCode::Protocol);
    let (answer, _) = ask_local(&local, object).await;
    assert!(answer.unwrap().exists);

    // A heartbeat says a cut is owed: every connection closes, and a new one is refused.
    meta.cuts_owed.store(1, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(10), local.closed())
        .await
        .expect("the server closed the local-reads connection");
    assert!(local.hung_up());
    let again = SeqpacketConn::connect(&local_path).unwrap();
    let (answer, descriptor) = ask_local(&again, object).await;
    assert_eq!(answer.unwrap_err().code, ErrorCode::Busy);
    assert!(descriptor.is_none());

    server.shutdown().await;
    tokio::time::timeout(Duration::from_secs(10), again.closed())
        .await
        .expect("the connection closed with the server");
    meta_task.abort();
}

/// A client on the server's host that asks for it shares a region of memory over the
/// local socket and places large write payloads there: more at once than the region has
/// places, of a whole place and below the smallest shared, all land as written and read
/// back through the server; every place is free again once its reply came. A client that
/// does not ask, or that connects over TCP, sends through its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_write_payloads_land_as_written() {
    use freeflow_rpc::shared::{REGION_SLOTS, REGION_SLOT_BYTES, SHARED_PAYLOAD_MIN};
    let (_directory, key, meta_task, socket, server) = serving_on_a_unix_socket().await;
    let sharing = ConnectOptions {
        shared_payloads: true,
        ..ConnectOptions::default()
    };
    let unix_address = format!("unix:{}", socket.display());
    let shared = Connection::connect(&unix_address, &key, &sharing)
        .await
        .unwrap();
    assert!(shared.shares_payloads());
    assert_eq!(shared.shared_places_free(), Some(REGION_SLOTS));
    let plain = Connection::connect(&unix_address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    assert!(!plain.shares_payloads());
    let tcp = Connection::connect(&server.listen_address().to_string(), &key, &sharing)
        .await
        .unwrap();
    assert!(!tcp.shares_payloads());

    let object = ObjectId {
        inode: 21,
        stripe_index: 0,
    };
    // Twice as many payloads at once as there are places, each its own bytes.
    let piece = 64 << 10;
    let pieces = 2 * REGION_SLOTS;
    let bytes_of = |index: usize, length: usize| -> Bytes {
        (0..length)
            .map(|at| (at * 7 + index * 13) as u8)
            .collect::<Vec<u8>>()
            .into()
    };
    let mut writes = tokio::task::JoinSet::new();
    for index in 0..pieces {
        let write = WriteObject {
            offset: (index * piece) as u64,
            ..grantless_write(object)
        };
        let (shared, payload) = (shared.clone(), bytes_of(index, piece));
        writes.spawn(async move { shared.call(&write, payload).await.unwrap() });
    }
    while let Some(written) = writes.join_next().await {
        written.unwrap();
    }
    // A payload of a whole place, and one too short to share.
    let whole_at = (pieces * piece) as u64;
    let whole = bytes_of(pieces, REGION_SLOT_BYTES);
    let write = WriteObject {
        offset: whole_at,
        ..grantless_write(object)
    };
    shared.call(&write, whole.clone()).await.unwrap();
    let short_at = whole_at + REGION_SLOT_BYTES as u64;
    let short = bytes_of(pieces + 1, SHARED_PAYLOAD_MIN - 1);
    let write = WriteObject {
        offset: short_at,
        ..grantless_write(object)
    };
    shared.call(&write, short.clone()).await.unwrap();
    assert_eq!(
        shared.shared_places_free(),
        Some(REGION_SLOTS),
        "every place is free again after its reply"
    );

    let read = async |offset: u64, length: usize| -> Bytes {
        read_object(&plain, object, offset, length).await
    };
    for index in 0..pieces {
        let got = read((index * piece) as u64, piece).await;
        assert!(
            got == bytes_of(index, piece),
            "piece {index} landed as written"
        );
    }
    assert!(read(whole_at, whole.len()).await == whole);
    assert!(read(short_at, short.len()).await == short);
    server.shutdown().await;
    meta_task.abort();
}

/// A client's one payload area, shared on its connections to two servers of its host: a
/// payload made in the area goes to either server from its place (no place taken for a
/// copy), a slice of one (a write split across stripe units) too, and a payload made
/// elsewhere is copied into a free place; every place is free again once the replies
/// came and the payloads are dropped, and every byte reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_made_in_the_shared_area_go_to_any_server_without_a_copy() {
    use freeflow_rpc::shared::{PayloadArea, REGION_SLOT_BYTES};
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (meta_address, meta_task) = serve_fake_meta(&key).await;
    let first_dir = tempfile::tempdir_in(directory.path()).unwrap();
    let second_dir = tempfile::tempdir_in(directory.path()).unwrap();
    let (first_socket, first) = start_on_unix_socket(&first_dir, &key, &meta_address).await;
    let (second_socket, second) = start_on_unix_socket(&second_dir, &key, &meta_address).await;
    wait_until("serving data", || {
        first.serves_data() && second.serves_data()
    })
    .await;
    let slots = 4;
    let area = PayloadArea::new(slots).unwrap();
    assert!(!area.is_shared(), "no server took it yet");
    let sharing = ConnectOptions {
        shared_payloads: true,
        payload_area: Some(area.clone()),
        ..ConnectOptions::default()
    };
    let connect = async |socket: &std::path::Path| {
        let connection = Connection::connect(&format!("unix:{}", socket.display()), &key, &sharing)
            .await
            .unwrap();
        assert!(connection.shares_payloads());
        connection
    };
    let to_first = connect(&first_socket).await;
    let to_second = connect(&second_socket).await;
    assert!(area.is_shared());
    assert_eq!(to_first.shared_places_free(), Some(slots));
    assert_eq!(to_second.shared_places_free(), Some(slots));

    let bytes_of = |seed: usize, length: usize| -> Vec<u8> {
        (0..length).map(|at| (at * 11 + seed * 29) as u8).collect()
    };
    let object = ObjectId {
        inode: 33,
        stripe_index: 0,
    };
    let write = |offset: u64| WriteObject {
        offset,
        ..grantless_write(object)
    };
    // Made in the area: one place taken, by the payload itself.
    let whole = bytes_of(1, REGION_SLOT_BYTES);
    let made = area.copy_in(&whole).expect("a place");
    assert_eq!(area.free_places(), slots - 1);
    // Two slices of it, one to each server, as a write across stripe units goes.
    let half = REGION_SLOT_BYTES / 2;
    let at_zero = write(0);
    let (first_call, second_call) = tokio::join!(
        to_first.call(&at_zero, made.slice(..half)),
        to_second.call(&at_zero, made.slice(half..)),
    );
    first_call.unwrap();
    second_call.unwrap();
    assert_eq!(
        area.free_places(),
        slots - 1,
        "the payload holds its place until it is dropped; the slices' replies freed nothing"
    );
    drop(made);
    assert_eq!(
        area.free_places(),
        slots,
        "the place is free once the payload is dropped"
    );
    // Made elsewhere: copied into a place for the request, free again after the reply.
    let elsewhere = bytes_of(2, 100_000);
    let past_half = write(half as u64);
    to_first
        .call(&past_half, Bytes::from(elsewhere.clone()))
        .await
        .unwrap();
    assert_eq!(area.free_places(), slots);
    assert_eq!(area.abandoned(), 0);

    assert!(read_object(&to_first, object, 0, half).await == whole[..half]);
    assert!(read_object(&to_second, object, 0, half).await == whole[half..]);
    assert!(read_object(&to_first, object, half as u64, elsewhere.len()).await == elsewhere[..]);
    first.shutdown().await;
    second.shutdown().await;
    meta_task.abort();
}

/// A request given up before its reply keeps its payload's place taken (the server may
/// still read it) until the connection is gone and the server has released the region
/// (forgotten it and dropped every view of it): then the place is free again. The bytes
/// land all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_given_up_comes_back_once_the_server_releases_the_region() {
    use freeflow_rpc::shared::{PayloadArea, REGION_SLOT_BYTES};
    let (_directory, key, meta_task, socket, server) = serving_on_a_unix_socket().await;
    let slots = 2;
    let area = PayloadArea::new(slots).unwrap();
    let sharing = ConnectOptions {
        shared_payloads: true,
        payload_area: Some(area.clone()),
        ..ConnectOptions::default()
    };
    let address = format!("unix:{}", socket.display());
    let connection = Connection::connect(&address, &key, &sharing).await.unwrap();
    let object = ObjectId {
        inode: 34,
        stripe_index: 0,
    };
    let bytes: Vec<u8> = (0..REGION_SLOT_BYTES).map(|at| (at % 241) as u8).collect();
    let payload = area.copy_in(&bytes).expect("a place");
    let write = WriteObject {
        offset: 0,
        ..grantless_write(object)
    };
    // Polled until its frame is queued, then given up.
    let call = connection.call(&write, payload);
    let given_up = tokio::time::timeout(std::time::Duration::ZERO, call).await;
    assert!(given_up.is_err(), "the call was given up before its reply");
    assert_eq!(area.abandoned(), 1);
    assert_eq!(
        area.free_places(),
        slots - 1,
        "the given-up place stays taken"
    );
    // A later connection reads the bytes back: the request was served all the same.
    let reader = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while read_object(&reader, object, 0, bytes.len()).await != bytes {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the given-up write never landed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(connection);
    wait_until("the region released and its place free again", || {
        area.free_places() == slots && area.abandoned() == 0
    })
    .await;
    server.shutdown().await;
    meta_task.abort();
}
