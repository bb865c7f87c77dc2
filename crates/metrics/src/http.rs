//! The metrics endpoint: just enough HTTP/1.1 for Prometheus and `freeflow top`.
//!
//! [`serve_http`] answers `GET /metrics` with [`Registry::render`] and anything else with
//! 404, one response per connection (`Connection: close`). It reads at most
//! [`REQUEST_BYTES_MAX`] of request within [`REQUEST_TIMEOUT_MS`] and serves at most
//! [`CONNECTIONS_MAX`] connections at once, so a slow or hostile peer costs a bounded amount.
//! [`scrape`] is the matching client.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::Registry;

/// Largest request head read; a scrape's is about 100 bytes.
pub const REQUEST_BYTES_MAX: usize = 8 << 10;
/// Time a peer has to send its request and take the response.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Connections served at once; further ones wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 16;
/// Largest response [`scrape`] accepts.
pub const SCRAPE_BYTES_MAX: usize = 16 << 20;

/// Serves `registry` on `listener` until the task is aborted. Accept errors (out of
/// descriptors) are retried after a pause.
pub async fn serve_http(listener: TcpListener, registry: Arc<Registry>) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let slot = Arc::clone(&slots)
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Running out of descriptors or a reset during accept is transient; this crate
            // has no logger, and the servers' own logs show descriptor trouble first.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let registry = Arc::clone(&registry);
        connections.spawn(async move {
            let timeout = Duration::from_millis(REQUEST_TIMEOUT_MS);
            let _ = tokio::time::timeout(timeout, respond(stream, &registry)).await;
            drop(slot);
        });
    }
}

async fn respond(mut stream: TcpStream, registry: &Registry) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|window| window == b"\r\n\r\n") {
        if head.len() >= REQUEST_BYTES_MAX {
            return write_response(&mut stream, "431 Request Header Fields Too Large", "").await;
        }
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..read]);
    }
    let request_line = head
        .split(|byte| *byte == b'\r')
        .next()
        .and_then(|line| std::str::from_utf8(line).ok())
        .unwrap_or("");
    let mut parts = request_line.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method == "GET" && path == "/metrics" {
        write_response(&mut stream, "200 OK", &registry.render()).await
    } else {
        write_response(
            &mut stream,
            "404 Not Found",
            "not found; try GET /metrics\n",
        )
        .await
    }
}

async fn write_response(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("cannot reach {address}: {source}")]
    Connect {
        address: String,
        source: std::io::Error,
    },
    #[error("{address} did not answer within {timeout_ms} ms")]
    TimedOut { address: String, timeout_ms: u64 },
    #[error("reading from {address}: {source}")]
    Read {
        address: String,
        source: std::io::Error,
    },
    #[error("{address} answered with more than {SCRAPE_BYTES_MAX} bytes")]
    TooLarge { address: String },
    #[error("{address} answered {status:?}, not 200 with a metrics page")]
    Status { address: String, status: String },
}

/// Fetches `http://address/metrics` and returns the body, all within `timeout`.
pub async fn scrape(address: &str, timeout: Duration) -> Result<String, ScrapeError> {
    let timed_out = || ScrapeError::TimedOut {
        address: address.to_string(),
        timeout_ms: timeout.as_millis() as u64,
    };
    tokio::time::timeout(timeout, scrape_unbounded(address))
        .await
        .map_err(|_| timed_out())?
}

async fn scrape_unbounded(address: &str) -> Result<String, ScrapeError> {
    let mut stream = TcpStream::connect(address)
        .await
        .map_err(|source| ScrapeError::Connect {
            address: address.to_string(),
            source,
        })?;
    let read_error = |source| ScrapeError::Read {
        address: address.to_string(),
        source,
    };
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(read_error)?;
    let mut response = Vec::new();
    let mut limited = (&mut stream).take(SCRAPE_BYTES_MAX as u64 + 1);
    limited
        .read_to_end(&mut response)
        .await
        .map_err(read_error)?;
    if response.len() > SCRAPE_BYTES_MAX {
        return Err(ScrapeError::TooLarge {
            address: address.to_string(),
        });
    }
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.lines().next().unwrap_or("").to_string();
    if !status.starts_with("HTTP/1.1 200 ") && !status.starts_with("HTTP/1.0 200 ") {
        return Err(ScrapeError::Status {
            address: address.to_string(),
            status,
        });
    }
    Ok(body.to_string())
}
