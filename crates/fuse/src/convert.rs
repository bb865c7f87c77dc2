//! Conversions between Freeflow's vocabulary and the kernel's: attributes, kinds, times,
//! names and error numbers. Kept apart so the request handlers read as the operations they
//! are, and so the conversions can be unit-tested without a mount.

use std::ffi::OsStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use freeflow_client::{Attr, ClientError, FileKind, TimeSpec};
use fuser::{Errno, FileAttr, FileType, INodeNo, TimeOrNow};

/// Block size reported by `statfs` (the unit of its block counts).
pub const STATFS_BLOCK_BYTES: u32 = 4096;

/// Preferred I/O size reported by `stat` when a file has no layout: one FUSE request.
pub const IO_BLOCK_BYTES_DEFAULT: u32 = 1 << 20;

/// The errno for a client error: the client's one table, except that an I/O server that
/// cannot be reached is `EIO` (the data is unavailable; `ENOTCONN` would read as "the
/// mount is gone"). Such a failure is logged with the server named, since `EIO` alone does
/// not say which.
pub fn errno(error: &ClientError) -> Errno {
    if let Some(server_id) = error.unreachable_io_server() {
        tracing::warn!(server_id, %error, "an I/O server is unreachable: EIO");
        return Errno::EIO;
    }
    Errno::from_i32(error.code().errno())
}

pub fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::Regular => FileType::RegularFile,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

/// A Freeflow time as a `SystemTime` (times before 1970 included).
pub fn system_time(time: TimeSpec) -> SystemTime {
    let nanoseconds = Duration::from_nanos(u64::from(time.nanoseconds.min(999_999_999)));
    if time.seconds >= 0 {
        UNIX_EPOCH + Duration::from_secs(time.seconds as u64) + nanoseconds
    } else {
        UNIX_EPOCH - Duration::from_secs(time.seconds.unsigned_abs()) + nanoseconds
    }
}

pub fn time_spec(time: SystemTime) -> TimeSpec {
    match time.duration_since(UNIX_EPOCH) {
        Ok(since) => TimeSpec::new(since.as_secs() as i64, since.subsec_nanos()),
        Err(before) => {
            let before = before.duration();
            let mut seconds = -(before.as_secs() as i64);
            let mut nanoseconds = before.subsec_nanos();
            if nanoseconds > 0 {
                seconds -= 1;
                nanoseconds = 1_000_000_000 - nanoseconds;
            }
            TimeSpec::new(seconds, nanoseconds)
        }
    }
}

/// `UTIME_NOW` becomes the current time of this host.
pub fn time_or_now(time: TimeOrNow) -> TimeSpec {
    match time {
        TimeOrNow::SpecificTime(time) => time_spec(time),
        TimeOrNow::Now => time_spec(SystemTime::now()),
    }
}

/// The kernel's attributes for a Freeflow inode; `size_bytes` may be larger than the meta
/// server's when this mount has writes in flight. `st_blocks` counts what the I/O servers
/// store (`Attr::allocated_bytes`), so sparse files and holes show as they are.
pub fn file_attr(attr: &Attr, size_bytes: u64) -> FileAttr {
    let block_bytes = attr
        .layout
        .as_ref()
        .map(|layout| layout.stripe_unit_bytes)
        .unwrap_or(IO_BLOCK_BYTES_DEFAULT);
    FileAttr {
        ino: INodeNo(attr.inode),
        size: size_bytes,
        blocks: attr.allocated_bytes.div_ceil(512),
        atime: system_time(attr.access_time),
        mtime: system_time(attr.modify_time),
        ctime: system_time(attr.change_time),
        crtime: system_time(attr.birth_time),
        kind: file_type(attr.kind),
        perm: (attr.permissions & 0o7777) as u16,
        nlink: attr.link_count,
        uid: attr.user_id,
        gid: attr.group_id,
        // Device numbers are kept in the kernel's 32-bit encoding (what mknod passes).
        rdev: attr.device as u32,
        blksize: block_bytes,
        flags: 0,
    }
}

/// A name from the kernel as UTF-8 (the client API's names are strings), no longer than
/// a name may be (`ENAMETOOLONG` otherwise: checked here, as the mount answers some
/// lookups and creates without the meta server, which checks it too).
pub fn name(name: &OsStr) -> Result<&str, Errno> {
    let name = name.to_str().ok_or(Errno::EINVAL)?;
    if name.len() > freeflow_types::limits::NAME_LENGTH_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_client::ErrorCode;

    #[test]
    fn names_are_utf8_and_no_longer_than_a_name_may_be() {
        let longest = "n".repeat(freeflow_types::limits::NAME_LENGTH_MAX);
        assert_eq!(name(OsStr::new(&longest)), Ok(longest.as_str()));
        let longer = format!("{longest}x");
        assert_eq!(name(OsStr::new(&longer)), Err(Errno::ENAMETOOLONG));
        use std::os::unix::ffi::OsStrExt;
        assert_eq!(name(OsStr::from_bytes(b"\xff")), Err(Errno::EINVAL));
    }

    #[test]
    fn times_round_trip_before_and_after_the_epoch() {
        for time in [
            TimeSpec::new(0, 0),
            TimeSpec::new(1_700_000_000, 123_456_789),
            TimeSpec::new(-1, 500_000_000),
            TimeSpec::new(-86_400, 0),
        ] {
            assert_eq!(time_spec(system_time(time)), time, "{time:?}");
        }
    }

    #[test]
    fn errors_map_to_their_errno() {
        let error = ClientError::Config("x".into());
        assert_eq!(errno(&error).code(), libc::EINVAL);
        assert_eq!(ErrorCode::Unreachable.errno(), libc::ENOTCONN);
        assert_eq!(ErrorCode::NoData.errno(), libc::ENODATA);
    }

    #[test]
    fn kinds_map_one_to_one() {
        assert_eq!(file_type(FileKind::Fifo), FileType::NamedPipe);
        assert_eq!(file_type(FileKind::Directory), FileType::Directory);
        assert_eq!(file_type(FileKind::BlockDevice), FileType::BlockDevice);
    }
}
