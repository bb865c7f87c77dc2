//! Object files one at a time: names, opening, creating, removing, allocating, copying.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use freeflow_proto::io::AllocateMode;
use freeflow_types::{limits, InodeId, ObjectId};

use crate::error::StoreError;

/// Number of shard directories under `objects/`.
pub const SHARD_COUNT: usize = 256;

/// Capacity and free space of the data directory's file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    pub capacity_bytes: u64,
    /// Free to an unprivileged user (`f_bavail`).
    pub free_bytes: u64,
}

#[derive(Default)]
pub(super) struct ShardCount {
    pub(super) scanned: bool,
    pub(super) objects: u64,
}

/// The shard of an inode: `inode % 256`.
pub fn shard_of(inode: InodeId) -> usize {
    (inode % SHARD_COUNT as u64) as usize
}

/// The object a file name in a shard directory stands for (`<16 hex>.<decimal stripe>`).
pub(super) fn parse_object_name(name: &str) -> Option<ObjectId> {
    if !is_object_name(name) {
        return None;
    }
    let (inode, stripe) = name.split_once('.')?;
    Some(ObjectId {
        inode: u64::from_str_radix(inode, 16).ok()?,
        stripe_index: stripe.parse().ok()?,
    })
}

/// True for `<16 hex>.<decimal stripe>`, the names objects have.
pub(super) fn is_object_name(name: &str) -> bool {
    let Some((inode, stripe)) = name.split_once('.') else {
        return false;
    };
    inode.len() == 16
        && inode.bytes().all(|byte| byte.is_ascii_hexdigit())
        && !stripe.is_empty()
        && stripe.parse::<u32>().is_ok()
}

/// Rejects ranges past the largest file size and requests past the request bound.
pub(super) fn check_range(
    object: ObjectId,
    offset: u64,
    length_bytes: u64,
) -> Result<(), StoreError> {
    if length_bytes > u64::from(limits::IO_REQUEST_BYTES_MAX) {
        return Err(StoreError::RequestTooLong { length_bytes });
    }
    match offset.checked_add(length_bytes) {
        Some(end) if end <= limits::FILE_SIZE_MAX => Ok(()),
        _ => Err(StoreError::FileTooBig {
            object,
            offset,
            length_bytes,
        }),
    }
}

pub(super) fn lock(shard: &Mutex<ShardCount>) -> MutexGuard<'_, ShardCount> {
    // Each update is a single assignment: a poisoned lock is still consistent.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Opens an object read-write (objects opened for a read may later be written through the
/// cache), creating it when `create` is set.
pub(super) fn open_object(path: &Path, create_new: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create_new)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
}

/// Opens the object, creating it if missing, and counts a creation under the shard's lock.
/// Says whether this call created it.
pub(super) fn create_object(shard: &Mutex<ShardCount>, path: &Path) -> io::Result<(File, bool)> {
    match open_object(path, false) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        other => return other.map(|file| (file, false)),
    }
    let mut count = lock(shard);
    match open_object(path, true) {
        Ok(file) => {
            if count.scanned {
                count.objects += 1;
            }
            Ok((file, true))
        }
        // Another task created it between our two opens.
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
            open_object(path, false).map(|file| (file, false))
        }
        Err(error) => Err(error),
    }
}

pub(super) fn lock_set<T>(set: &Mutex<HashSet<T>>) -> MutexGuard<'_, HashSet<T>> {
    set.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Unlinks the object if it exists, counting the removal under the shard's lock.
pub(super) fn remove_object(shard: &Mutex<ShardCount>, path: &Path) -> io::Result<()> {
    let mut count = lock(shard);
    match std::fs::remove_file(path) {
        Ok(()) => {
            if count.scanned {
                count.objects = count.objects.saturating_sub(1);
            }
            Ok(())
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
    }
}

/// `fallocate(2)` with `FALLOC_FL_KEEP_SIZE`, with the fallbacks described at
/// [`ObjectStore::allocate`].
pub(super) fn allocate_range(
    file: &File,
    offset: u64,
    length: u64,
    mode: AllocateMode,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fallocate = |flags: libc::c_int| -> io::Result<()> {
        // Offsets are at most FILE_SIZE_MAX (checked by the caller), well inside off_t.
        // SAFETY: a plain syscall on a descriptor this function borrows.
        let result = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                flags | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                length as libc::off_t,
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    let unsupported =
        |error: &io::Error| matches!(error.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS));
    match mode {
        AllocateMode::Allocate => fallocate(0),
        AllocateMode::PunchHole => match fallocate(libc::FALLOC_FL_PUNCH_HOLE) {
            Err(error) if unsupported(&error) => write_zeros(file, offset, length),
            other => other,
        },
        AllocateMode::ZeroRange => match fallocate(libc::FALLOC_FL_ZERO_RANGE) {
            Err(error) if unsupported(&error) => {
                allocate_range(file, offset, length, AllocateMode::PunchHole)?;
                match fallocate(0) {
                    Err(error) if unsupported(&error) => Ok(()),
                    other => other,
                }
            }
            other => other,
        },
    }
}

/// Bytes of zeros written at a time where a hole cannot be punched.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// Write zeros over a range, but only up to the object's end: a hole past it reads as
/// zeros already, and the object must not grow.
fn write_zeros(file: &File, offset: u64, length: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let end = offset.saturating_add(length).min(file.metadata()?.len());
    let zeros = vec![0u8; ZERO_CHUNK_BYTES];
    let mut at = offset;
    while at < end {
        let piece = (end - at).min(ZERO_CHUNK_BYTES as u64) as usize;
        file.write_all_at(&zeros[..piece], at)?;
        at += piece as u64;
    }
    Ok(())
}

/// The copy behind [`ObjectStore::copy_range`]; `source` None is an object that does not
/// exist (all zeros).
pub(super) fn copy_object_range(
    source: Option<&File>,
    source_offset: u64,
    target: &File,
    target_offset: u64,
    length: u64,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, MetadataExt};
    let mut copied = 0u64;
    if let Some(source) = source {
        let same_file = source.metadata()?.ino() == target.metadata()?.ino();
        let overlapping = same_file
            && source_offset < target_offset + length
            && target_offset < source_offset + length;
        if overlapping {
            // The kernel refuses overlapping ranges of one file: read all, then write.
            // `length` is one request's (at most IO_REQUEST_BYTES_MAX).
            let mut buffer = vec![0u8; length as usize];
            let mut filled = 0usize;
            while filled < buffer.len() {
                match source.read_at(&mut buffer[filled..], source_offset + filled as u64)? {
                    0 => break,
                    read => filled += read,
                }
            }
            target.write_all_at(&buffer[..filled], target_offset)?;
            copied = filled as u64;
        } else {
            while copied < length {
                let mut from = (source_offset + copied) as libc::loff_t;
                let mut to = (target_offset + copied) as libc::loff_t;
                // SAFETY: both descriptors are borrowed for the call; the offsets are ours.
                let result = unsafe {
                    libc::copy_file_range(
                        source.as_raw_fd(),
                        &mut from,
                        target.as_raw_fd(),
                        &mut to,
                        (length - copied) as usize,
                        0,
                    )
                };
                match result {
                    0 => break, // the source ended
                    count if count > 0 => copied += count as u64,
                    _ => {
                        let error = io::Error::last_os_error();
                        if !matches!(
                            error.raw_os_error(),
                            Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS)
                        ) {
                            return Err(error);
                        }
                        // Not through the kernel here: copy through memory, a piece at a time.
                        let mut buffer = vec![0u8; ZERO_CHUNK_BYTES];
                        while copied < length {
                            let want = (length - copied).min(ZERO_CHUNK_BYTES as u64) as usize;
                            let read =
                                source.read_at(&mut buffer[..want], source_offset + copied)?;
                            if read == 0 {
                                break;
                            }
                            target.write_all_at(&buffer[..read], target_offset + copied)?;
                            copied += read as u64;
                        }
                        break;
                    }
                }
            }
        }
    }
    if copied < length {
        // Past the source's end it reads as zeros: so must the target.
        allocate_range(
            target,
            target_offset + copied,
            length - copied,
            AllocateMode::PunchHole,
        )?;
    }
    Ok(())
}

/// Runs blocking file-system work (open, unlink, ftruncate) off the async threads.
pub(super) async fn blocking<T, F>(work: F) -> io::Result<T>
where
    F: FnOnce() -> io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|error| Err(io::Error::other(format!("blocking task failed: {error}"))))
}

pub(super) fn statvfs(path: &Path) -> io::Result<Space> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs fills the zeroed struct from a valid NUL-terminated path.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stats) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let fragment_bytes = stats.f_frsize as u64;
    Ok(Space {
        capacity_bytes: (stats.f_blocks as u64).saturating_mul(fragment_bytes),
        free_bytes: (stats.f_bavail as u64).saturating_mul(fragment_bytes),
    })
}
