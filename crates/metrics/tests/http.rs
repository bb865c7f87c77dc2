//! The endpoint over real sockets: a scrape returns the render, other paths get 404, and a
//! peer that never finishes its request neither blocks other scrapes nor gets an answer.

use std::sync::Arc;
use std::time::Duration;

use freeflow_metrics::text::Snapshot;
use freeflow_metrics::{scrape, serve_http, Registry, ScrapeError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn start(registry: Arc<Registry>) -> (String, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    (address, tokio::spawn(serve_http(listener, registry)))
}

#[tokio::test]
async fn a_scrape_round_trips_the_registry_and_sees_updates() {
    let registry = Arc::new(Registry::new());
    let requests = registry.counter("ff_requests_total", "Requests.", &[("op", "Read")]);
    let (address, server) = start(Arc::clone(&registry)).await;
    // A peer that connects and says nothing must not hold up the scrapes.
    let _silent = tokio::net::TcpStream::connect(&address).await.unwrap();
    let timeout = Duration::from_secs(5);
    requests.add(3);
    let first = Snapshot::parse(&scrape(&address, timeout).await.unwrap());
    assert_eq!(
        first.value("ff_requests_total", &[("op", "Read")]),
        Some(3.0)
    );
    requests.add(4);
    let second = Snapshot::parse(&scrape(&address, timeout).await.unwrap());
    assert_eq!(
        second.value("ff_requests_total", &[("op", "Read")]),
        Some(7.0)
    );
    server.abort();
}

#[tokio::test]
async fn other_paths_get_404_and_oversized_requests_are_refused() {
    let registry = Arc::new(Registry::new());
    let (address, server) = start(registry).await;
    let exchange = |request: Vec<u8>| {
        let address = address.clone();
        async move {
            let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
            stream.write_all(&request).await.unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).await.unwrap();
            response
        }
    };
    let response = exchange(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()).await;
    assert!(response.starts_with("HTTP/1.1 404 "), "{response}");
    let response = exchange(b"POST /metrics HTTP/1.1\r\n\r\n".to_vec()).await;
    assert!(response.starts_with("HTTP/1.1 404 "), "{response}");
    let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 20 << 10));
    // The server answers 431 and closes with the rest unread, which may reach us as a
    // reset before the answer: either way the request is refused, and promptly.
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let _ = stream.write_all(&huge).await;
    let mut response = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
        .await
        .expect("an oversized request is answered at once");
    match read {
        Ok(_) => assert!(response.starts_with(b"HTTP/1.1 431 "), "{response:?}"),
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset),
    }
    let response = exchange(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n".to_vec()).await;
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.contains("Content-Length: 0\r\n"), "{response}");
    server.abort();
}

#[tokio::test]
async fn scraping_nothing_fails_with_the_address() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    drop(listener);
    let error = scrape(&address, Duration::from_secs(2)).await.unwrap_err();
    assert!(matches!(error, ScrapeError::Connect { .. }), "{error}");
    assert!(error.to_string().contains(&address), "{error}");
}

/// A peer that answers something other than a metrics page: the status is named.
#[tokio::test]
async fn a_scrape_of_something_else_names_its_status() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let peer = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 1024];
        let _ = stream.read(&mut head).await.unwrap();
        stream
            .write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
            .await
            .unwrap();
    });
    let error = scrape(&address, Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(&error, ScrapeError::Status { status, .. } if status.contains("503")),
        "{error}"
    );
    peer.await.unwrap();
}
