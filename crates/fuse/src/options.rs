//! What a mount is asked for ([`MountOptions`], [`Transport`]) and how mounting fails
//! ([`FuseError`]): below the handlers, the rings and the session, which all read them.

use std::path::PathBuf;

/// How the kernel's requests reach the mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// io_uring rings where the kernel offers them (Linux 6.14+; the mount turns the
    /// kernel's `fuse.enable_uring` on when it can, as root), else `/dev/fuse`.
    #[default]
    Auto,
    /// io_uring rings, or the mount fails saying why.
    IoUring,
    /// `/dev/fuse` reads only.
    DevFuse,
}

/// How the mount behaves. [`MountOptions::default`] documents the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// Let users other than the one mounting use the mount (FUSE `allow_other`).
    pub allow_other: bool,
    /// Make every close durable (fsync at close), as DESIGN.md §5 allows.
    pub sync_on_close: bool,
    /// Let the kernel cache names, missing names and attributes under the meta server's
    /// leases, revoked by callback before another client's conflicting change returns
    /// (default on; off: only the time-outs below).
    pub cache_leases: bool,
    /// Let the kernel gather writes in its page cache and send them in large pieces
    /// (FUSE writeback cache; default off). The kernel then owns each open file's size and
    /// times on this host: see docs/consistency.md, "Writeback mounts", for what other
    /// clients see and when. Needs `cache_leases` (revocations evict what the kernel holds).
    pub writeback: bool,
    /// How the kernel's requests reach the mount: FUSE-over-io_uring rings, one per CPU
    /// (`ring/`), or `/dev/fuse` reads. See [`Transport`].
    pub transport: Transport,
    /// How long the kernel may reuse attributes given without a lease (default 0: with
    /// leases on, a reply without one raced another client's change and is not kept; a
    /// mount without leases may trade some staleness for fewer requests, as `freeflow
    /// mount --no-cache` does with 1000 ms). Every open fetches fresh ones regardless.
    pub attr_timeout_ms: u64,
    /// How long the kernel may reuse a name → inode entry without a lease (default 0:
    /// never, so a name removed by another client is never used here).
    pub entry_timeout_ms: u64,
    /// Kernel channels, one reading thread each (default 4; `clone_fd` when above 1).
    pub threads: usize,
    /// Name shown as the mount's source in /proc/mounts.
    pub source_name: String,
}

impl Default for MountOptions {
    fn default() -> MountOptions {
        MountOptions {
            allow_other: false,
            sync_on_close: false,
            cache_leases: true,
            writeback: false,
            transport: Transport::Auto,
            attr_timeout_ms: 0,
            entry_timeout_ms: 0,
            threads: 4,
            source_name: "freeflow".to_string(),
        }
    }
}

impl MountOptions {
    pub fn validate(&self) -> Result<(), FuseError> {
        let MountOptions {
            allow_other: _,
            sync_on_close: _,
            cache_leases,
            writeback,
            transport: _,
            attr_timeout_ms,
            entry_timeout_ms,
            threads,
            source_name,
        } = self;
        if *threads == 0 || *threads > 64 {
            return Err(FuseError::Options(format!(
                "threads {threads} is not between 1 and 64"
            )));
        }
        if *writeback && !*cache_leases {
            return Err(FuseError::Options(
                "writeback needs the lease cache (it cannot be used with --no-cache): only a \
                 revocation can make the kernel drop a size it owns"
                    .into(),
            ));
        }
        if *attr_timeout_ms > 3_600_000 || *entry_timeout_ms > 3_600_000 {
            return Err(FuseError::Options(
                "attr_timeout_ms and entry_timeout_ms must be at most one hour".into(),
            ));
        }
        if source_name.is_empty() || source_name.contains([',', ' ', '\n']) {
            return Err(FuseError::Options(format!(
                "source name {source_name:?} must be non-empty without commas or spaces"
            )));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("invalid mount options: {0}")]
    Options(String),
    #[error("/dev/fuse is missing: load the fuse module (modprobe fuse)")]
    NoFuseDevice,
    #[error("mount needs a tokio runtime: call it from inside one")]
    NoRuntime,
    #[error("cannot mount on {mountpoint}: {source}")]
    Mount {
        mountpoint: PathBuf,
        source: std::io::Error,
    },
    #[error("FUSE over io_uring: {0}")]
    IoUring(String),
    #[error("unmounting {mountpoint} failed: {reason}")]
    Unmount { mountpoint: PathBuf, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        assert!(MountOptions::default().validate().is_ok());
        let zero_threads = MountOptions {
            threads: 0,
            ..MountOptions::default()
        };
        assert!(zero_threads.validate().is_err());
        let bad_name = MountOptions {
            source_name: "a,b".into(),
            ..MountOptions::default()
        };
        assert!(bad_name.validate().is_err());
        let writeback_without_leases = MountOptions {
            writeback: true,
            cache_leases: false,
            ..MountOptions::default()
        };
        assert!(writeback_without_leases.validate().is_err());
    }
}
