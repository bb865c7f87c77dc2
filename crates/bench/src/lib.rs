//! `freeflow bench`: the seeds' own workloads (dd-like sequential I/O, PxFS's chunk.py,
//! concurrent writers, 4 KiB random I/O, mdtest-like metadata, start-up with N files,
//! incast, striping over rate-capped links) run the same way on several targets in one
//! run, interleaved, so that ratios hold on a noisy 2-core machine. Targets are plain
//! directories (the Freeflow mount, the local disk, a peer file system's mount); the
//! scenarios that need Freeflow internals start their own clusters.
//!
//! The crate is a library so the `freeflow` binary stays a thin front end: it parses the
//! command line into [`RunOptions`], calls [`run`] and writes the [`Report`] out with
//! [`table::render`], [`Report::to_json`] and [`plot::render`]. The JSON schema is in
//! docs/BENCHMARKS.md.

pub mod cluster;
pub mod error;
pub mod json;
pub mod model;
pub mod netns;
pub mod plot;
mod runner;
pub mod scenarios;
pub mod sizes;
pub mod system;
pub mod table;

pub use error::{BenchError, SetupError, StepError};
pub use model::{Better, Measurement, MetricSpec, Report, Target, SCHEMA};
pub use runner::{run, RunOptions, REPEAT_MAX};
pub use scenarios::ALL as SCENARIOS;
pub use sizes::{SizePreset, Sizes};
