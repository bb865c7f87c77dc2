//! The exerciser's target on any path: a Freeflow mount (or two mounts of one cluster,
//! alternating with a close and an open between them), or a local file system to compare.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::{AllocateMode, Target};

/// One file reached through one or more paths (the same file on several mounts).
pub struct PosixTarget {
    paths: Vec<PathBuf>,
    current: usize,
    file: Option<File>,
}

fn open(path: &Path, truncate: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .mode(0o644)
        .open(path)
}

fn check(result: libc::c_int) -> io::Result<()> {
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The system's page size (mapping offsets must be multiples of it).
fn page_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as u64
    } else {
        4096
    }
}

/// A shared mapping of `[start, start + length)` of a file, unmapped on drop.
struct Mapping {
    address: *mut libc::c_void,
    length: usize,
}

impl Mapping {
    fn new(file: &File, start: u64, length: usize, writable: bool) -> io::Result<Mapping> {
        let protection = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an open descriptor; the pointer is used only
        // within `length` and unmapped on drop.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                protection,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { address, length })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `length` bytes long and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.address as *const u8, self.length) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and the mapping is writable when this is called.
        unsafe { std::slice::from_raw_parts_mut(self.address as *mut u8, self.length) }
    }

    fn sync(&self) -> io::Result<()> {
        // SAFETY: the range is this mapping.
        check(unsafe { libc::msync(self.address, self.length, libc::MS_SYNC) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped.
        unsafe { libc::munmap(self.address, self.length) };
    }
}

impl PosixTarget {
    /// The file at `paths[0]` (created if missing), also reachable at the other paths.
    pub fn open(paths: Vec<PathBuf>) -> io::Result<PosixTarget> {
        if paths.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the exerciser needs a path",
            ));
        }
        let file = open(&paths[0], false)?;
        Ok(PosixTarget {
            paths,
            current: 0,
            file: Some(file),
        })
    }

    fn file(&self) -> io::Result<&File> {
        self.file
            .as_ref()
            .ok_or_else(|| io::Error::other("the file is not open (an earlier open failed)"))
    }

    fn path(&self) -> &Path {
        &self.paths[self.current]
    }
}

impl Target for PosixTarget {
    fn describe(&self) -> String {
        self.path().display().to_string()
    }

    fn read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>> {
        let file = self.file()?;
        let mut buffer = vec![0u8; length as usize];
        let mut filled = 0usize;
        while filled < buffer.len() {
            match file.read_at(&mut buffer[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(read) => filled += read,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        buffer.truncate(filled);
        Ok(buffer)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file()?.write_all_at(data, offset)
    }

    fn supports_mmap(&self) -> bool {
        true
    }

    fn map_read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>> {
        let start = offset - offset % page_bytes();
        let mapping = Mapping::new(
            self.file()?,
            start,
            (offset + length - start) as usize,
            false,
        )?;
        Ok(mapping.bytes()[(offset - start) as usize..].to_vec())
    }

    fn map_write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let start = offset - offset % page_bytes();
        let length = (offset + data.len() as u64 - start) as usize;
        let mut mapping = Mapping::new(self.file()?, start, length, true)?;
        mapping.bytes_mut()[(offset - start) as usize..].copy_from_slice(data);
        mapping.sync()
    }

    fn set_size(&mut self, size: u64, by_path: bool) -> io::Result<()> {
        if by_path {
            let path = CString::new(self.path().as_os_str().as_bytes())
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
            // SAFETY: a valid NUL-terminated path.
            check(unsafe { libc::truncate(path.as_ptr(), size as libc::off_t) })
        } else {
            self.file()?.set_len(size)
        }
    }

    fn allocate(&mut self, offset: u64, length: u64, mode: AllocateMode) -> io::Result<()> {
        let flags = match mode {
            AllocateMode::Allocate => 0,
            AllocateMode::AllocateKeepSize => libc::FALLOC_FL_KEEP_SIZE,
            AllocateMode::PunchHole => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            AllocateMode::ZeroRange => libc::FALLOC_FL_ZERO_RANGE,
            AllocateMode::ZeroRangeKeepSize => {
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
            }
        };
        let fd = self.file()?.as_raw_fd();
        // SAFETY: a plain syscall on an open descriptor.
        check(unsafe { libc::fallocate(fd, flags, offset as libc::off_t, length as libc::off_t) })
    }

    fn copy_range(
        &mut self,
        source_offset: u64,
        target_offset: u64,
        length: u64,
    ) -> io::Result<u64> {
        let fd = self.file()?.as_raw_fd();
        let mut copied = 0u64;
        while copied < length {
            let mut from = (source_offset + copied) as libc::loff_t;
            let mut to = (target_offset + copied) as libc::loff_t;
            // SAFETY: one open descriptor as both ends; the offsets are ours.
            let result = unsafe {
                libc::copy_file_range(fd, &mut from, fd, &mut to, (length - copied) as usize, 0)
            };
            match result {
                0 => break,
                count if count > 0 => copied += count as u64,
                _ => {
                    let error = io::Error::last_os_error();
                    if error.kind() != io::ErrorKind::Interrupted {
                        return Err(error);
                    }
                }
            }
        }
        Ok(copied)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file()?.sync_all()
    }

    fn reopen(&mut self, truncate: bool, choice: u64) -> io::Result<String> {
        // Close first: close-to-open is what two mounts promise each other.
        drop(self.file.take());
        self.current = (choice % self.paths.len() as u64) as usize;
        self.file = Some(open(self.path(), truncate)?);
        Ok(self.describe())
    }

    fn size(&mut self) -> io::Result<u64> {
        Ok(self.file()?.metadata()?.len())
    }
}
