//! Ordering inside one group-commit batch, observed from the writer thread: what a reaper
//! pass running right after the commit would see.

use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_proto::meta::{Caller, Create, Open, OpenAccess, OpenSession, RegisterServer, Unlink};
use freeflow_proto::ErrorCode;
use freeflow_rpc::{ClusterKey, ConnectOptions, Connection};
use freeflow_types::{FileKind, ROOT_INODE};
use tokio::sync::oneshot;

use crate::records::inode_key;
use crate::store::{StoreRead, TableId};
use crate::{start, MetaConfig, RunningMeta};

fn create(open: Option<(u64, OpenAccess)>, exclusive: bool) -> Create {
    Create {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "x".into(),
        kind: FileKind::Regular,
        permissions: 0o644,
        device: 0,
        exclusive,
        open,
        inode: None,
    }
}

/// Wait until `queued` jobs wait in the writer's channel.
async fn wait_queued(meta: &RunningMeta, queued: usize) {
    let writer = &meta.shared.writer;
    let deadline = Instant::now() + Duration::from_secs(5);
    while writer.max_capacity() - writer.capacity() < queued {
        assert!(Instant::now() < deadline, "{queued} jobs never queued");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_open_handle_is_counted_before_the_commit_that_orphans_the_file() {
    let directory = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate().unwrap();
    let config = MetaConfig {
        listen_address: "127.0.0.1:0".into(),
        data_dir: directory.path().to_path_buf(),
        handles_max: 1,
        ..MetaConfig::default()
    };
    let meta = start(config, key.clone()).await.unwrap();
    let address = meta.listen_address().to_string();
    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    let register = RegisterServer {
        server_id: 1,
        address: "127.0.0.1:9".into(),
        capacity_bytes: 1 << 30,
        free_bytes: 1 << 30,
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
    let session_id = session.session_id;
    let access = OpenAccess {
        read: true,
        write: true,
    };
    let (existing, _) = connection
        .call(&create(None, true), Bytes::new())
        .await
        .unwrap();
    let inode = existing.attr.inode;

    // A failed create-and-open gives its reserved handle back (the limit is one handle).
    for _ in 0..3 {
        let refused = connection
            .call(&create(Some((session_id, access)), true), Bytes::new())
            .await
            .unwrap_err();
        assert_eq!(refused.code(), ErrorCode::Exists);
    }

    // Hold the writer so the next three jobs form one batch.
    let (started_sender, started) = oneshot::channel();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let shared = meta.shared.clone();
    let holder = tokio::spawn(async move {
        shared
            .write(move |_, _| {
                let _ = started_sender.send(());
                let _ = held.recv_timeout(Duration::from_secs(10));
                Ok(())
            })
            .await
    });
    started.await.unwrap();
    let create_open = tokio::spawn({
        let connection = connection.clone();
        async move {
            connection
                .call(&create(Some((session_id, access)), false), Bytes::new())
                .await
        }
    });
    wait_queued(&meta, 1).await;
    let unlink = tokio::spawn({
        let connection = connection.clone();
        async move {
            let request = Unlink {
                caller: Caller::root(),
                parent: ROOT_INODE,
                name: "x".into(),
            };
            connection.call(&request, Bytes::new()).await
        }
    });
    wait_queued(&meta, 2).await;
    // Runs in the same transaction, after the unlink, before the commit.
    let probe = tokio::spawn({
        let shared = meta.shared.clone();
        let observer = meta.shared.clone();
        async move {
            shared
                .write(move |write, _| {
                    let orphaned = write.get(TableId::Orphans, &inode_key(inode))?.is_some();
                    Ok((orphaned, observer.sessions().is_open(inode)))
                })
                .await
        }
    });
    wait_queued(&meta, 3).await;
    release.send(()).unwrap();
    holder.await.unwrap().unwrap();

    let (opened, _) = create_open.await.unwrap().unwrap();
    assert!(!opened.created);
    assert_eq!(opened.attr.inode, inode);
    assert!(opened.handle_id.is_some());
    unlink.await.unwrap().unwrap();
    let (orphaned, open_before_commit) = probe.await.unwrap().unwrap();
    assert!(orphaned, "the probe ran after the unlink in the batch");
    assert!(
        open_before_commit,
        "the handle must be counted before the commit that makes the file an orphan"
    );
    assert!(meta.shared.sessions().is_open(inode));

    // The one handle allowed is in use: a plain open is refused as Busy.
    let open = Open {
        caller: Caller::root(),
        session_id,
        inode,
        access,
    };
    let busy = connection.call(&open, Bytes::new()).await.unwrap_err();
    assert_eq!(busy.code(), ErrorCode::Busy);
    meta.shutdown().await;
}
