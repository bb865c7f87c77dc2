//! The server loop's metrics: requests, payload bytes and service time per opcode,
//! connections and refused handshakes, counted into the registry given in ServerOptions.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use freeflow_metrics::text::Snapshot;
use freeflow_metrics::Registry;
use freeflow_proto::io::{ReadObject, ReadReply, WriteObject};
use freeflow_proto::Request;
use freeflow_rpc::{
    handle, serve, ClusterKey, ConnectOptions, Connection, Frame, PeerInfo, Reply, ServerMetrics,
    ServerOptions, Service,
};
use freeflow_types::ObjectId;

/// Accepts writes (dropping the data) and answers reads with zeros.
struct Sink;

impl Service for Sink {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        match frame.opcode {
            WriteObject::OPCODE => {
                handle(frame, |_: WriteObject, _| async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok((freeflow_proto::io::ObjectSpace::default(), Bytes::new()))
                })
                .await
            }
            ReadObject::OPCODE => {
                handle(frame, |request: ReadObject, _| async move {
                    let data = Bytes::from(vec![0u8; request.length as usize]);
                    Ok((
                        ReadReply {
                            length: request.length,
                        },
                        data,
                    ))
                })
                .await
            }
            other => Err(format!("unknown opcode {other}")),
        }
    }
}

const OBJECT: ObjectId = ObjectId {
    inode: 9,
    stripe_index: 0,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_bytes_connections_and_handshake_failures_are_counted() {
    let key = ClusterKey::generate().unwrap();
    let registry = Arc::new(Registry::new());
    let options = ServerOptions {
        metrics: Some(ServerMetrics::new(&registry, freeflow_proto::io::OPCODES)),
        ..ServerOptions::new("test")
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(serve(listener, key.clone(), options, Arc::new(Sink)));

    let connection = Connection::connect(&address, &key, &ConnectOptions::default())
        .await
        .unwrap();
    for _ in 0..5 {
        let request = WriteObject {
            grant: 0,
            charged: 0,
            object: OBJECT,
            offset: 0,
            map_version: 0,
            forward: Vec::new(),
        };
        connection
            .call(&request, Bytes::from(vec![1u8; 1000]))
            .await
            .unwrap();
    }
    let read = ReadObject {
        object: OBJECT,
        offset: 0,
        length: 300,
        map_version: 0,
    };
    connection.call(&read, Bytes::new()).await.unwrap();
    let wrong_key = ClusterKey::generate().unwrap();
    assert!(
        Connection::connect(&address, &wrong_key, &ConnectOptions::default())
            .await
            .is_err()
    );

    let snapshot = Snapshot::parse(&registry.render());
    let write = [("op", WriteObject::NAME)];
    let read_op = [("op", ReadObject::NAME)];
    assert_eq!(
        snapshot.value("freeflow_rpc_requests_total", &write),
        Some(5.0)
    );
    assert_eq!(
        snapshot.value("freeflow_rpc_requests_total", &read_op),
        Some(1.0)
    );
    assert_eq!(
        snapshot.value("freeflow_rpc_request_payload_bytes_total", &write),
        Some(5000.0)
    );
    assert_eq!(
        snapshot.value("freeflow_rpc_reply_payload_bytes_total", &read_op),
        Some(300.0)
    );
    let service_time = snapshot
        .histogram("freeflow_rpc_service_time_microseconds", &write)
        .unwrap();
    assert_eq!(service_time.count(), 5.0);
    // Each write slept 2 ms in the service.
    assert!(service_time.sum >= 5.0 * 2000.0, "{service_time:?}");
    assert_eq!(snapshot.value("freeflow_rpc_connections", &[]), Some(1.0));
    assert_eq!(
        snapshot.value("freeflow_rpc_requests_in_flight", &[]),
        Some(0.0)
    );
    // The server counts the refused handshake after sending its refusal.
    eventually(&registry, "freeflow_rpc_handshake_failures_total", 1.0).await;
    drop(connection);
    eventually(&registry, "freeflow_rpc_connections", 0.0).await;
    server.abort();
}

/// Waits (up to 5 s) until the unlabelled metric `name` has `value`.
async fn eventually(registry: &Registry, name: &str, value: f64) {
    let reached = async {
        loop {
            let snapshot = Snapshot::parse(&registry.render());
            if snapshot.value(name, &[]) == Some(value) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), reached)
        .await
        .unwrap_or_else(|_| panic!("{name} never reached {value}:\n{}", registry.render()));
}
