//! The metrics endpoint over HTTP/1.1, with hyper: [`serve_http`] answers `GET /metrics`
//! with [`Registry::render`] and anything else with 404, then closes the connection (a scrape
//! every few seconds gains nothing from keep-alive). A request head may be at most
//! [`REQUEST_BYTES_MAX`] (a larger one is refused with 431), the whole exchange must finish
//! within [`REQUEST_TIMEOUT_MS`], and at most [`CONNECTIONS_MAX`] connections are served at
//! once, so a slow or hostile peer costs a bounded amount. [`scrape`] is the matching
//! client.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::Registry;

/// Largest request head read (hyper's smallest allowed buffer); a scrape's is about 100
/// bytes.
pub const REQUEST_BYTES_MAX: usize = 8 << 10;
/// Time a peer has to send its request and take the response.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Connections served at once; further ones wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 16;
/// Largest response [`scrape`] accepts.
pub const SCRAPE_BYTES_MAX: usize = 16 << 20;

/// The content type of the Prometheus text exposition format this registry renders.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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
            let service = hyper::service::service_fn(move |request| {
                let registry = Arc::clone(&registry);
                async move { Ok::<_, Infallible>(respond(&request, &registry)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .title_case_headers(true)
                .max_buf_size(REQUEST_BYTES_MAX)
                .timer(TokioTimer::new())
                .header_read_timeout(timeout)
                .serve_connection(TokioIo::new(stream), service);
            // A peer that stops reading the response is cut off too.
            let _ = tokio::time::timeout(timeout, connection).await;
            drop(slot);
        });
    }
}

fn respond(request: &Request<Incoming>, registry: &Registry) -> Response<Full<Bytes>> {
    let (status, body) = if request.method() == Method::GET && request.uri().path() == "/metrics" {
        (StatusCode::OK, registry.render())
    } else {
        (
            StatusCode::NOT_FOUND,
            "not found; try GET /metrics\n".to_owned(),
        )
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(METRICS_CONTENT_TYPE),
    );
    response
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
    #[error("reading from {address}: {reason}")]
    Read { address: String, reason: String },
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
    let stream = TcpStream::connect(address)
        .await
        .map_err(|source| ScrapeError::Connect {
            address: address.to_string(),
            source,
        })?;
    let read_error = |reason: String| ScrapeError::Read {
        address: address.to_string(),
        reason,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| read_error(error.to_string()))?;
    let driving = tokio::spawn(connection);
    let request = Request::get("/metrics")
        .header(HOST, address)
        .body(Empty::<Bytes>::new())
        .map_err(|error| read_error(error.to_string()))?;
    let outcome = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|error| read_error(error.to_string()))?;
        if response.status() != StatusCode::OK {
            return Err(ScrapeError::Status {
                address: address.to_string(),
                status: response.status().to_string(),
            });
        }
        let body = Limited::new(response.into_body(), SCRAPE_BYTES_MAX)
            .collect()
            .await
            .map_err(|error| {
                if error.is::<http_body_util::LengthLimitError>() {
                    ScrapeError::TooLarge {
                        address: address.to_string(),
                    }
                } else {
                    read_error(error.to_string())
                }
            })?
            .to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
    .await;
    driving.abort();
    outcome
}
