//! Hard limits of the file system. Each one is a bound that requests are checked against
//! before any work is done (TigerBeetle's "a limit on everything").

/// Most handles one `CloseHandles` request closes.
pub const CLOSE_HANDLES_MAX: usize = 1024;
/// Most inode numbers one `ReserveInodes` takes.
pub const INODE_RESERVE_MAX: u32 = 4096;

/// Longest name of one directory entry, in bytes (POSIX `NAME_MAX`).
pub const NAME_LENGTH_MAX: usize = 255;

/// Longest symlink target, in bytes (POSIX `PATH_MAX`).
pub const SYMLINK_TARGET_LENGTH_MAX: usize = 4096;

/// Largest file size: 2^60 bytes, far beyond any disk but small enough that
/// `offset + length` arithmetic on u64 never overflows after validation.
pub const FILE_SIZE_MAX: u64 = 1 << 60;

/// Smallest and largest stripe unit. The largest stays below the RPC payload bound so that
/// one stripe unit always fits in one request.
pub const STRIPE_UNIT_BYTES_MIN: u32 = 4096;
pub const STRIPE_UNIT_BYTES_MAX: u32 = 8 << 20;

/// Default stripe unit: 1 MiB, the size of one FUSE write request.
pub const STRIPE_UNIT_BYTES_DEFAULT: u32 = 1 << 20;

/// Most servers one file may be striped over.
pub const STRIPE_COUNT_MAX: u32 = 256;
/// Most copies of one stripe (the length of its chain).
pub const REPLICAS_MAX: u32 = 4;

/// Largest extended attribute name and value (Linux's own limits).
pub const XATTR_NAME_LENGTH_MAX: usize = 255;
pub const XATTR_VALUE_LENGTH_MAX: usize = 65536;

/// Largest number of entries returned by one readdir request.
pub const READDIR_ENTRIES_MAX: u32 = 4096;

/// Largest single read or write request to an I/O server (payload bytes).
pub const IO_REQUEST_BYTES_MAX: u32 = 8 << 20;

/// Most bytes one `AllocateObject` may reserve on an I/O server; clients split larger
/// ranges, so a request of a few bytes never makes a server allocate without bound.
pub const ALLOCATE_BYTES_MAX: u64 = 1 << 30;

/// Deepest symlink chain followed while resolving a path (Linux's `MAXSYMLINKS`).
pub const SYMLINK_FOLLOW_MAX: u32 = 40;
