//! Limits the handlers, the rings and the session share: a module below all three, so that
//! each names them without naming the others.

/// Most requests handled at once (tasks on the runtime); past it, the kernel channels wait.
pub const REQUESTS_IN_FLIGHT_MAX: usize = 1024;

/// Largest write the kernel sends in one request (and the read size it asks for): 1 MiB,
/// one stripe unit by default (DESIGN.md §6.1).
pub const MAX_WRITE_BYTES: u32 = 1 << 20;

/// The kernel's `fuse.enable_uring` module parameter.
pub const ENABLE_PARAMETER: &str = "/sys/module/fuse/parameters/enable_uring";
