//! The cost of one RPC over loopback TCP with client and server on one runtime of two
//! workers (as `freeflow up` runs them): a small request answered at once, one at a time
//! (latency) and 64 in flight (throughput). The floor under every metadata operation.
//!
//! `cargo bench -p freeflow-rpc --bench roundtrip`

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use freeflow_proto::io::{ReadObject, ReadReply};
use freeflow_proto::Request;
use freeflow_rpc::{
    handle, serve, ClusterKey, ConnectOptions, Connection, Frame, PeerInfo, Reply, ServerOptions,
    Service,
};
use freeflow_types::ObjectId;

/// Answers every `ReadObject` at once with an empty payload.
struct Answer;

impl Service for Answer {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        match frame.opcode {
            ReadObject::OPCODE => {
                handle(frame, |_: ReadObject, _| async move {
                    Ok((ReadReply { length: 0 }, Bytes::new()))
                })
                .await
            }
            other => Err(format!("unknown opcode {other}")),
        }
    }
}

fn request() -> ReadObject {
    ReadObject {
        object: ObjectId {
            inode: 7,
            stripe_index: 0,
        },
        offset: 0,
        length: 0,
        map_version: 0,
    }
}

fn roundtrip(criterion: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let key = ClusterKey::generate().expect("key");
    let connection = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        tokio::spawn(serve(
            listener,
            key.clone(),
            ServerOptions::new("bench"),
            Arc::new(Answer),
        ));
        Connection::connect(&address, &key, &ConnectOptions::default())
            .await
            .expect("connect")
    });
    let mut group = criterion.benchmark_group("rpc");
    group.measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(1));
    group.bench_function("one_at_a_time", |bencher| {
        bencher.iter_custom(|iterations| {
            let connection = connection.clone();
            // The calls run on a worker, as the client library's do.
            runtime
                .block_on(runtime.spawn(async move {
                    let started = Instant::now();
                    for _ in 0..iterations {
                        connection
                            .call(&request(), Bytes::new())
                            .await
                            .expect("call");
                    }
                    started.elapsed()
                }))
                .expect("bench task")
        })
    });
    const IN_FLIGHT: u64 = 64;
    group.throughput(Throughput::Elements(IN_FLIGHT));
    group.bench_function("64_in_flight", |bencher| {
        bencher.iter_custom(|iterations| {
            let connection = connection.clone();
            runtime
                .block_on(runtime.spawn(async move {
                    let request = request();
                    let started = Instant::now();
                    for _ in 0..iterations {
                        let calls = (0..IN_FLIGHT).map(|_| connection.call(&request, Bytes::new()));
                        for reply in futures_join(calls).await {
                            reply.expect("call");
                        }
                    }
                    started.elapsed()
                }))
                .expect("bench task")
        })
    });
    group.finish();
}

/// Await every call of `calls` concurrently, in order of the results.
async fn futures_join<F: std::future::Future>(calls: impl Iterator<Item = F>) -> Vec<F::Output> {
    futures::future::join_all(calls).await
}

criterion_group!(benches, roundtrip);
criterion_main!(benches);
