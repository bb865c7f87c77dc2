//! Freeflow's metrics (DESIGN.md §9): what each server and the mount count, and how they
//! are read.
//!
//! `freeflow up` runs a meta server, N I/O servers and possibly a mount in one process, each
//! with its own endpoint, so a process-global recorder (the `metrics` crate facade) does not
//! fit: every server owns a [`Registry`] instance instead. Metrics are plain atomics
//! registered once at start-up with fixed (static) labels; the hot path is one relaxed
//! `fetch_add` per counter, with no lock and no allocation.
//!
//! - [`registry`]: [`Registry`], [`Counter`], [`Gauge`], [`Histogram`] and
//!   [`Registry::render`] to the Prometheus text exposition format (version 0.0.4).
//! - [`http`]: [`serve_http`], the HTTP/1.1 endpoint (hyper) answering `GET /metrics`, and
//!   [`scrape`], its client side (used by `freeflow top`).
//! - [`text`]: [`text::parse`] of that format back into samples, and histogram
//!   quantiles from the difference of two scrapes.

pub mod http;
pub mod registry;
pub mod text;

pub use http::{scrape, serve_http, ScrapeError};
pub use registry::{
    Counter, Gauge, Histogram, Labels, Registry, COUNT_BUCKETS, LATENCY_BUCKETS_US,
};
