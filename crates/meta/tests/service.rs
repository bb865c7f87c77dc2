//! The metadata server over real RPC connections, in this process: group commit, the
//! orphan reaper against a fake I/O server, truncation cuts made by the meta server, and a
//! restart on the same data directory.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_meta::{start, MetaConfig, RunningMeta};
use freeflow_proto::io::{RemoveObjects, TruncateObject};
use freeflow_proto::meta::{
    Caller, CloseHandles, ClusterStatus, Create, GetAttr, Lookup, Mkdir, OpenAccess, OpenSession,
    ReadDir, RegisterServer, ReplyStamp, SetAttributes, Sync, Unlink,
};
use freeflow_proto::{ErrorCode, Request};
use freeflow_rpc::{
    handle, serve, ClusterKey, ConnectOptions, Connection, Frame, PeerInfo, Reply, RpcError,
    ServerOptions, Service,
};
use freeflow_types::{Attr, FileKind, InodeId, ObjectId, SetAttr, ROOT_INODE};

fn config(data_dir: &std::path::Path) -> MetaConfig {
    MetaConfig {
        listen_address: "127.0.0.1:0".into(),
        data_dir: data_dir.to_path_buf(),
        lease_ms: 400,
        ..MetaConfig::default()
    }
}

async fn connect(meta: &RunningMeta, key: &ClusterKey) -> Connection {
    let address = meta.listen_address().to_string();
    Connection::connect(&address, key, &ConnectOptions::default())
        .await
        .expect("connect")
}

fn remote_code(error: RpcError) -> ErrorCode {
    error.code()
}

/// An I/O server that only records `RemoveObjects` and `TruncateObject`; it answers a
/// cut only `cut_delay` after recording it.
#[derive(Default)]
struct FakeIo {
    removed: Mutex<Vec<RemoveObjects>>,
    cuts: Mutex<Vec<TruncateObject>>,
    cut_delay: Duration,
}

impl Service for FakeIo {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        match frame.opcode {
            RemoveObjects::OPCODE => {
                handle(frame, |request: RemoveObjects, _| async move {
                    self.removed.lock().unwrap().push(request);
                    Ok(((), Bytes::new()))
                })
                .await
            }
            TruncateObject::OPCODE => {
                handle(frame, |request: TruncateObject, _| async move {
                    self.cuts.lock().unwrap().push(request);
                    tokio::time::sleep(self.cut_delay).await;
                    Ok((freeflow_proto::io::ObjectSpace::default(), Bytes::new()))
                })
                .await
            }
            other => Err(format!("unexpected opcode {other}")),
        }
    }
}

async fn start_fake_io(key: &ClusterKey) -> (Arc<FakeIo>, String, tokio::task::JoinHandle<()>) {
    start_fake_io_with(key, FakeIo::default()).await
}

async fn start_fake_io_with(
    key: &ClusterKey,
    fake: FakeIo,
) -> (Arc<FakeIo>, String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let fake = Arc::new(fake);
    let task = tokio::spawn({
        let (key, fake) = (key.clone(), fake.clone());
        async move {
            let _ = serve(listener, key, ServerOptions::new("io:1"), fake).await;
        }
    });
    (fake, address, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_mutations_share_commits() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let meta = start(config(directory.path()), key.clone()).await.unwrap();
    let connection = connect(&meta, &key).await;
    let before = meta.commit_count();
    let count = 64;
    let mut tasks = Vec::new();
    for index in 0..count {
        let connection = connection.clone();
        tasks.push(tokio::spawn(async move {
            let request = Mkdir {
                caller: Caller::root(),
                parent: ROOT_INODE,
                name: format!("dir-{index}"),
                permissions: 0o755,
            };
            connection.call(&request, Bytes::new()).await
        }));
    }
    // One request in the middle of the stream fails; the others must still commit.
    let failing = Mkdir {
        caller: Caller::root(),
        parent: 999_999,
        name: "orphaned".into(),
        permissions: 0o755,
    };
    let failure = connection.call(&failing, Bytes::new()).await.unwrap_err();
    assert_eq!(remote_code(failure), ErrorCode::NotFound);
    for task in tasks {
        let (attr, _) = task.await.unwrap().expect("mkdir");
        assert_eq!(attr.kind, FileKind::Directory);
    }
    let commits = meta.commit_count() - before;
    assert!(commits < count, "{count} mutations took {commits} commits");
    let listing = ReadDir {
        caller: Caller::root(),
        inode: ROOT_INODE,
        after: None,
        limit: 1000,
        with_attributes: false,
    };
    let (page, _) = connection.call(&listing, Bytes::new()).await.unwrap();
    assert_eq!(page.entries.len(), count as usize);
    assert_eq!(meta.inode_count(), 1 + count);
    meta.shutdown().await;
}

/// A mutation is answered before its commit finishes (the commit runs while the reply
/// travels): whoever reads after the reply still sees it, on this connection or another
/// client's, and a `Sync` sent after the reply makes it durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_answered_before_its_commit_is_seen_by_every_later_read() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let meta = start(config(directory.path()), key.clone()).await.unwrap();
    // Clients (not the server's own id 0, whose changes are answered after their commit).
    let as_client = |client_id| ConnectOptions {
        client_id,
        ..ConnectOptions::default()
    };
    let address = meta.listen_address().to_string();
    let writer = Connection::connect(&address, &key, &as_client(7))
        .await
        .expect("connect");
    let reader = Connection::connect(&address, &key, &as_client(8))
        .await
        .expect("connect");
    for index in 0..2000 {
        let name = format!("d-{index}");
        let mkdir = Mkdir {
            caller: Caller::root(),
            parent: ROOT_INODE,
            name: name.clone(),
            permissions: 0o755,
        };
        if index % 10 == 0 {
            // Everything durable before: only this mkdir is not.
            writer.call(&Sync {}, Bytes::new()).await.expect("sync");
        }
        let (made, stamp) = writer.call(&mkdir, Bytes::new()).await.expect("mkdir");
        if index % 10 == 0 {
            // A Sync right after the answer covers it, commit still running or not.
            let stamp: ReplyStamp = freeflow_proto::decode(&stamp).expect("reply stamp");
            writer.call(&Sync {}, Bytes::new()).await.expect("sync");
            assert!(
                meta.durable_txn() >= stamp.txn,
                "sync returned with mkdir {index} (txn {}) not durable",
                stamp.txn
            );
        }
        let connection = if index % 2 == 0 { &reader } else { &writer };
        let lookup = Lookup {
            caller: Caller::root(),
            parent: ROOT_INODE,
            name,
        };
        let (found, _) = connection
            .call(&lookup, Bytes::new())
            .await
            .unwrap_or_else(|error| panic!("lookup {index} right after its mkdir: {error}"));
        assert_eq!(found.inode, made.inode);
        let (root, _) = connection
            .call(&GetAttr { inode: ROOT_INODE }, Bytes::new())
            .await
            .expect("getattr");
        assert_eq!(
            root.link_count,
            2 + index + 1,
            "the parent's count after mkdir {index}"
        );
    }
    meta.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaper_removes_data_after_the_last_close_and_restart_keeps_the_namespace() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let (fake, fake_address, fake_task) = start_fake_io(&key).await;
    let meta = start(config(directory.path()), key.clone()).await.unwrap();
    let connection = connect(&meta, &key).await;

    let create = |open| Create {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "f".into(),
        kind: FileKind::Regular,
        permissions: 0o644,
        device: 0,
        exclusive: true,
        open,
        inode: None,
    };
    let refused = connection
        .call(&create(None), Bytes::new())
        .await
        .unwrap_err();
    assert_eq!(remote_code(refused), ErrorCode::NoSpace);

    let register = RegisterServer {
        server_id: 1,
        address: fake_address,
        capacity_bytes: 1 << 30,
        free_bytes: 1 << 29,
        object_count: 0,
        metrics_address: None,
        incarnation: 1,
        map_version: 0,
        fresh: false,
        cleaned_version: 0,
    };
    connection.call(&register, Bytes::new()).await.unwrap();
    let (session, _) = connection
        .call(
            &OpenSession {
                client_name: "test".into(),
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    let access = OpenAccess {
        read: true,
        write: true,
    };
    let (created, _) = connection
        .call(&create(Some((session.session_id, access))), Bytes::new())
        .await
        .unwrap();
    assert!(created.created);
    let handle_id = created.handle_id.expect("create opened the file");
    let inode = created.attr.inode;
    assert_eq!(created.attr.layout.as_ref().unwrap().servers, vec![1]);

    let unlink = Unlink {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "f".into(),
    };
    connection.call(&unlink, Bytes::new()).await.unwrap();
    // Open: the data stays, the inode is still readable by its handle.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(fake.removed.lock().unwrap().is_empty());
    let (attr, _) = connection
        .call(&GetAttr { inode }, Bytes::new())
        .await
        .unwrap();
    assert_eq!(attr.link_count, 0);
    let (status, _) = connection
        .call(&ClusterStatus {}, Bytes::new())
        .await
        .unwrap();
    assert_eq!(status.orphan_count, 1);

    // Gathered closes: more than the bound is refused whole; an id not open is named
    // back and the others are closed all the same (the last close makes the reaper go).
    let too_many = CloseHandles {
        session_id: session.session_id,
        handle_ids: vec![handle_id; freeflow_types::limits::CLOSE_HANDLES_MAX + 1],
    };
    let refused = connection.call(&too_many, Bytes::new()).await.unwrap_err();
    assert_eq!(remote_code(refused), ErrorCode::InvalidArgument);
    assert_eq!(meta.orphan_count(), 1, "a refused request closed nothing");
    let close = CloseHandles {
        session_id: session.session_id,
        handle_ids: vec![handle_id + 1000, handle_id],
    };
    let (not_open, _) = connection.call(&close, Bytes::new()).await.unwrap();
    assert_eq!(not_open, vec![handle_id + 1000]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while meta.orphan_count() > 0 {
        assert!(Instant::now() < deadline, "orphan not reaped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    {
        let removed = fake.removed.lock().unwrap();
        assert_eq!(
            removed.as_slice(),
            &[RemoveObjects {
                inode,
                stripes: vec![0]
            }]
        );
    }
    let gone = connection
        .call(&GetAttr { inode }, Bytes::new())
        .await
        .unwrap_err();
    assert_eq!(remote_code(gone), ErrorCode::NotFound);

    let mkdir = Mkdir {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "kept".into(),
        permissions: 0o700,
    };
    let (kept, _) = connection.call(&mkdir, Bytes::new()).await.unwrap();
    let inode_count = meta.inode_count();
    drop(connection);
    meta.shutdown().await;

    // Restart on the same directory: the store lock was released, the namespace is there.
    let meta = start(config(directory.path()), key.clone()).await.unwrap();
    assert_eq!(meta.inode_count(), inode_count);
    let connection = connect(&meta, &key).await;
    let (again, _) = connection
        .call(&GetAttr { inode: kept.inode }, Bytes::new())
        .await
        .unwrap();
    assert_eq!(again.permissions, 0o700);
    meta.shutdown().await;
    fake_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_survive_a_restart_and_wait_one_lease_before_reaping() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    // An address where nothing listens: the reaper cannot remove the data yet.
    let dead_address = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let meta = start(config(directory.path()), key.clone()).await.unwrap();
    let connection = connect(&meta, &key).await;
    let register = |address: String| RegisterServer {
        server_id: 1,
        address,
        capacity_bytes: 1 << 30,
        free_bytes: 1 << 29,
        object_count: 0,
        metrics_address: None,
        incarnation: 1,
        map_version: 0,
        fresh: false,
        cleaned_version: 0,
    };
    connection
        .call(&register(dead_address), Bytes::new())
        .await
        .unwrap();
    let create = Create {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "doomed".into(),
        kind: FileKind::Regular,
        permissions: 0o644,
        device: 0,
        exclusive: true,
        open: None,
        inode: None,
    };
    let (created, _) = connection.call(&create, Bytes::new()).await.unwrap();
    let unlink = Unlink {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "doomed".into(),
    };
    connection.call(&unlink, Bytes::new()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(meta.orphan_count(), 1);
    drop(connection);
    meta.shutdown().await;

    let (fake, fake_address, fake_task) = start_fake_io(&key).await;
    let started = Instant::now();
    let meta = start(config(directory.path()), key.clone()).await.unwrap();
    assert_eq!(meta.orphan_count(), 1);
    let connection = connect(&meta, &key).await;
    connection
        .call(&register(fake_address), Bytes::new())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while meta.orphan_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "orphan from before the restart not reaped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Not before one lease (400 ms) after the start.
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    let removed = fake.removed.lock().unwrap().clone();
    assert_eq!(
        removed,
        vec![RemoveObjects {
            inode: created.attr.inode,
            stripes: vec![0]
        }]
    );
    meta.shutdown().await;
    fake_task.abort();
}

fn register(server_id: u32, address: String) -> RegisterServer {
    RegisterServer {
        server_id,
        address,
        capacity_bytes: 1 << 30,
        free_bytes: 1 << 29,
        object_count: 0,
        metrics_address: None,
        incarnation: 1,
        map_version: 0,
        fresh: false,
        cleaned_version: 0,
    }
}

fn create_file(name: &str) -> Create {
    Create {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: name.into(),
        kind: FileKind::Regular,
        permissions: 0o644,
        device: 0,
        exclusive: true,
        open: None,
        inode: None,
    }
}

fn set_size(caller: Caller, inode: InodeId, size_bytes: u64) -> SetAttributes {
    SetAttributes {
        caller,
        inode,
        changes: SetAttr {
            size_bytes: Some(size_bytes),
            ..SetAttr::default()
        },
        through_handle: None,
    }
}

fn cut_count(fakes: &[&FakeIo]) -> usize {
    fakes
        .iter()
        .map(|fake| fake.cuts.lock().unwrap().len())
        .sum()
}

/// The cut each stripe's server must receive for a file cut at `size_bytes`.
fn expected_cut(attr: &Attr, size_bytes: u64, stripe_index: u32) -> TruncateObject {
    let layout = attr.layout.as_ref().expect("a regular file has a layout");
    TruncateObject {
        object: ObjectId {
            inode: attr.inode,
            stripe_index,
        },
        length: layout.object_length(size_bytes, stripe_index),
        forward: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrink_cuts_every_stripe_before_replying_and_nothing_else_cuts() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let cut_delay = Duration::from_millis(300);
    let slow = || FakeIo {
        cut_delay,
        ..FakeIo::default()
    };
    let (first, first_address, first_task) = start_fake_io_with(&key, slow()).await;
    let (second, second_address, second_task) = start_fake_io_with(&key, slow()).await;
    let meta_config = MetaConfig {
        stripe_unit_bytes: 4096,
        ..config(directory.path())
    };
    let meta = start(meta_config, key.clone()).await.unwrap();
    let connection = connect(&meta, &key).await;
    for (id, address) in [(1, first_address), (2, second_address)] {
        connection
            .call(&register(id, address), Bytes::new())
            .await
            .unwrap();
    }
    let (created, _) = connection
        .call(&create_file("f"), Bytes::new())
        .await
        .unwrap();
    let inode = created.attr.inode;
    let servers = created.attr.layout.clone().unwrap().servers;
    assert_eq!(servers.len(), 2);
    let fakes = [&*first, &*second];

    // Growing cuts nothing; neither does setting the same size.
    let grown_bytes = 3 * 4096 + 100;
    for _ in 0..2 {
        let (attr, _) = connection
            .call(&set_size(Caller::root(), inode, grown_bytes), Bytes::new())
            .await
            .unwrap();
        assert_eq!(attr.size_bytes, grown_bytes);
    }
    assert_eq!(cut_count(&fakes), 0);

    // A shrink the caller may not make (no write permission) is refused and cuts nothing.
    let stranger = Caller {
        user_id: 1000,
        group_id: 1000,
        groups: vec![],
    };
    let refused = connection
        .call(&set_size(stranger, inode, 10), Bytes::new())
        .await
        .unwrap_err();
    assert_eq!(remote_code(refused), ErrorCode::PermissionDenied);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(cut_count(&fakes), 0);
    let (attr, _) = connection
        .call(&GetAttr { inode }, Bytes::new())
        .await
        .unwrap();
    assert_eq!(attr.size_bytes, grown_bytes);

    // A shrink: every stripe's server cuts, and only then the reply comes.
    let shrunk_bytes = 4096 + 10;
    let sent = Instant::now();
    let (attr, _) = connection
        .call(&set_size(Caller::root(), inode, shrunk_bytes), Bytes::new())
        .await
        .unwrap();
    assert_eq!(attr.size_bytes, shrunk_bytes);
    assert!(
        sent.elapsed() >= cut_delay,
        "replied after {:?}",
        sent.elapsed()
    );
    for (stripe_index, server) in servers.iter().enumerate() {
        let fake = if *server == 1 { &first } else { &second };
        let cuts = fake.cuts.lock().unwrap().clone();
        let expected = expected_cut(&attr, shrunk_bytes, stripe_index as u32);
        assert_eq!(cuts, vec![expected], "server {server}");
    }
    // Stripe 0 keeps its whole first unit, stripe 1 the last 10 bytes.
    let lengths: Vec<u64> = (0..2)
        .map(|stripe| expected_cut(&attr, shrunk_bytes, stripe).length)
        .collect();
    assert_eq!(lengths, vec![4096, 10]);
    // Nothing is left pending: the reaper does not cut again.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(cut_count(&fakes), 2);
    meta.shutdown().await;
    first_task.abort();
    second_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_pending_on_a_dead_server_survives_a_restart_and_is_made_when_it_returns() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let dead_address = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let meta_config = || MetaConfig {
        stripe_unit_bytes: 4096,
        ..config(directory.path())
    };
    let meta = start(meta_config(), key.clone()).await.unwrap();
    let connection = connect(&meta, &key).await;
    connection
        .call(&register(1, dead_address), Bytes::new())
        .await
        .unwrap();
    let (created, _) = connection
        .call(&create_file("g"), Bytes::new())
        .await
        .unwrap();
    let inode = created.attr.inode;
    connection
        .call(&set_size(Caller::root(), inode, 10_000), Bytes::new())
        .await
        .unwrap();
    let pending = connection
        .call(&set_size(Caller::root(), inode, 100), Bytes::new())
        .await
        .unwrap_err();
    let message = pending.to_string();
    assert_eq!(remote_code(pending), ErrorCode::Unreachable);
    assert!(message.contains("pending on server 1"), "{message}");
    assert!(message.contains("size"), "{message}");
    // The size is set even though the cut is pending; a later grow keeps the cut at 100.
    let (attr, _) = connection
        .call(&GetAttr { inode }, Bytes::new())
        .await
        .unwrap();
    assert_eq!(attr.size_bytes, 100);
    connection
        .call(&set_size(Caller::root(), inode, 5_000), Bytes::new())
        .await
        .unwrap();
    drop(connection);
    meta.shutdown().await;

    let (fake, fake_address, fake_task) = start_fake_io(&key).await;
    let meta = start(meta_config(), key.clone()).await.unwrap();
    let connection = connect(&meta, &key).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(cut_count(&[&fake]), 0, "not registered at this address yet");
    connection
        .call(&register(1, fake_address), Bytes::new())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while cut_count(&[&fake]) == 0 {
        assert!(
            Instant::now() < deadline,
            "pending cut not made after restart"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let expected = expected_cut(&created.attr, 100, 0);
    assert_eq!(expected.length, 100);
    // Made once: settled, so not retried.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fake.cuts.lock().unwrap().clone(), vec![expected]);
    let (attr, _) = connection
        .call(&GetAttr { inode }, Bytes::new())
        .await
        .unwrap();
    assert_eq!(attr.size_bytes, 5_000);
    meta.shutdown().await;
    fake_task.abort();
}
