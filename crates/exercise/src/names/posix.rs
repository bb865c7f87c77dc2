//! The namespace exerciser's target on a directory of any file system: a Freeflow mount (each
//! worker on its own mount of one cluster, or all on one), or a local directory that shows
//! what Linux does. Every call is the system call itself (libc), so what is checked is what a
//! program on that mount sees.

use std::ffi::{CStr, CString};
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::{Creator, Errno, ListedEntry, NamesTarget, NodeKind, NodeStatus, RenameFlag, XattrHow};

/// A directory reached by path.
pub struct PosixTarget {
    root: PathBuf,
    creator: Creator,
}

/// The errno of an I/O error (EIO when it carries none).
fn errno_of(error: &io::Error) -> Errno {
    error.raw_os_error().unwrap_or(libc::EIO)
}

fn last_errno() -> Errno {
    errno_of(&io::Error::last_os_error())
}

fn check(result: libc::c_int) -> Result<(), Errno> {
    if result == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// The process's umask (read by setting it and setting it back: call before threads start
/// creating files).
pub fn process_creation_mask() -> u32 {
    // SAFETY: umask has no preconditions; the old value is restored at once.
    let mask = unsafe { libc::umask(0o022) };
    // SAFETY: as above.
    unsafe { libc::umask(mask) };
    mask
}

impl PosixTarget {
    /// The directory `root` (which must exist) as a target; new inodes belong to this
    /// process's effective user and group.
    pub fn new(root: impl Into<PathBuf>) -> io::Result<PosixTarget> {
        let root = root.into();
        if !fs::metadata(&root)?.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a directory", root.display()),
            ));
        }
        // SAFETY: geteuid and getegid have no preconditions.
        let (user_id, group_id) = unsafe { (libc::geteuid(), libc::getegid()) };
        Ok(PosixTarget {
            root,
            creator: Creator {
                user_id,
                group_id,
                creation_mask: process_creation_mask(),
            },
        })
    }

    fn path(&self, relative: &str) -> PathBuf {
        if relative.is_empty() {
            self.root.clone()
        } else {
            self.root.join(relative)
        }
    }

    fn c_path(&self, relative: &str) -> Result<CString, Errno> {
        CString::new(self.path(relative).as_os_str().as_bytes()).map_err(|_| libc::EINVAL)
    }
}

fn c_string(text: &str) -> Result<CString, Errno> {
    CString::new(text).map_err(|_| libc::EINVAL)
}

fn close(descriptor: libc::c_int) -> Result<(), Errno> {
    // SAFETY: a descriptor this target opened and closes once.
    check(unsafe { libc::close(descriptor) })
}

fn status_of(metadata: &fs::Metadata) -> NodeStatus {
    NodeStatus {
        inode_number: metadata.ino(),
        kind: NodeKind::from_mode(metadata.mode()),
        permissions: metadata.mode() & 0o7777,
        size_bytes: metadata.size(),
        link_count: metadata.nlink(),
        user_id: metadata.uid(),
        group_id: metadata.gid(),
    }
}

/// Read a directory with `readdir` itself, for `d_ino` and `d_type` as the file system
/// gives them (the standard library falls back to `lstat` for `DT_UNKNOWN`).
fn read_directory(path: &Path) -> Result<Vec<ListedEntry>, Errno> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| libc::EINVAL)?;
    // SAFETY: a valid NUL-terminated path; the stream is closed below.
    let stream = unsafe { libc::opendir(c_path.as_ptr()) };
    if stream.is_null() {
        return Err(last_errno());
    }
    let mut entries = Vec::new();
    let result = loop {
        // SAFETY: errno is thread-local; cleared to tell the end from an error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: an open stream; the entry is read before the next call.
        let entry = unsafe { libc::readdir64(stream) };
        if entry.is_null() {
            // SAFETY: as above.
            let errno = unsafe { *libc::__errno_location() };
            break if errno == 0 { Ok(()) } else { Err(errno) };
        }
        // SAFETY: readdir returned a valid entry with a NUL-terminated name.
        let (name, inode_number, directory_type) = unsafe {
            let entry = &*entry;
            (
                CStr::from_ptr(entry.d_name.as_ptr()),
                entry.d_ino,
                entry.d_type,
            )
        };
        let name = name.to_string_lossy().into_owned();
        if name == "." || name == ".." {
            continue;
        }
        entries.push(ListedEntry {
            name,
            inode_number,
            kind: NodeKind::from_directory_type(directory_type),
        });
    };
    // SAFETY: closing the stream opened above, once.
    let closed = check(unsafe { libc::closedir(stream) });
    result?;
    closed?;
    Ok(entries)
}

impl NamesTarget for PosixTarget {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    fn creator(&self) -> Creator {
        self.creator
    }

    fn create(&mut self, path: &str) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        let flags = libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC;
        // SAFETY: a valid NUL-terminated path.
        let descriptor = unsafe { libc::open(c_path.as_ptr(), flags, 0o644 as libc::c_uint) };
        if descriptor < 0 {
            return Err(last_errno());
        }
        close(descriptor)
    }

    fn make_directory(&mut self, path: &str) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::mkdir(c_path.as_ptr(), 0o755) })
    }

    fn remove_directory(&mut self, path: &str) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::rmdir(c_path.as_ptr()) })
    }

    fn unlink(&mut self, path: &str) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::unlink(c_path.as_ptr()) })
    }

    fn link(&mut self, source: &str, target: &str) -> Result<(), Errno> {
        let (source, target) = (self.c_path(source)?, self.c_path(target)?);
        // SAFETY: valid NUL-terminated paths; flags 0 links a final symlink itself.
        check(unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                source.as_ptr(),
                libc::AT_FDCWD,
                target.as_ptr(),
                0,
            )
        })
    }

    fn symlink(&mut self, path: &str, contents: &str) -> Result<(), Errno> {
        let (c_path, contents) = (self.c_path(path)?, c_string(contents)?);
        // SAFETY: valid NUL-terminated strings.
        check(unsafe { libc::symlink(contents.as_ptr(), c_path.as_ptr()) })
    }

    fn make_fifo(&mut self, path: &str) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::mknod(c_path.as_ptr(), libc::S_IFIFO | 0o644, 0) })
    }

    fn rename(&mut self, source: &str, target: &str, flag: RenameFlag) -> Result<(), Errno> {
        let (source, target) = (self.c_path(source)?, self.c_path(target)?);
        // SAFETY: valid NUL-terminated paths; renameat2 through syscall(2) so that C
        // libraries without the wrapper work too.
        let result = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                source.as_ptr(),
                libc::AT_FDCWD,
                target.as_ptr(),
                flag.bits(),
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(last_errno())
        }
    }

    fn change_mode(&mut self, path: &str, permissions: u32) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::chmod(c_path.as_ptr(), permissions as libc::mode_t) })
    }

    fn change_owner(&mut self, path: &str, user_id: u32, group_id: u32) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::lchown(c_path.as_ptr(), user_id, group_id) })
    }

    fn set_times(&mut self, path: &str, seconds: i64) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        let time = libc::timespec {
            tv_sec: seconds as libc::time_t,
            tv_nsec: 0,
        };
        let times = [time, time];
        // SAFETY: a valid path and two timespecs.
        check(unsafe {
            libc::utimensat(
                libc::AT_FDCWD,
                c_path.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })
    }

    fn set_xattr(
        &mut self,
        path: &str,
        name: &str,
        value: &[u8],
        how: XattrHow,
    ) -> Result<(), Errno> {
        let (c_path, name) = (self.c_path(path)?, c_string(name)?);
        let flags = match how {
            XattrHow::Any => 0,
            XattrHow::CreateOnly => libc::XATTR_CREATE,
            XattrHow::ReplaceOnly => libc::XATTR_REPLACE,
        };
        // SAFETY: valid strings and a value of `value.len()` bytes.
        check(unsafe {
            libc::lsetxattr(
                c_path.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                flags,
            )
        })
    }

    fn remove_xattr(&mut self, path: &str, name: &str) -> Result<(), Errno> {
        let (c_path, name) = (self.c_path(path)?, c_string(name)?);
        // SAFETY: valid NUL-terminated strings.
        check(unsafe { libc::lremovexattr(c_path.as_ptr(), name.as_ptr()) })
    }

    fn truncate(&mut self, path: &str, size_bytes: u64) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        // SAFETY: a valid NUL-terminated path.
        check(unsafe { libc::truncate(c_path.as_ptr(), size_bytes as libc::off_t) })
    }

    fn write(&mut self, path: &str, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let c_path = self.c_path(path)?;
        let flags = libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC;
        // SAFETY: a valid NUL-terminated path.
        let descriptor = unsafe { libc::open(c_path.as_ptr(), flags) };
        if descriptor < 0 {
            return Err(last_errno());
        }
        // SAFETY: an open descriptor and `data.len()` readable bytes.
        let written = unsafe {
            libc::pwrite(
                descriptor,
                data.as_ptr().cast(),
                data.len(),
                offset as libc::off_t,
            )
        };
        let write_result = if written < 0 {
            Err(last_errno())
        } else if written as usize != data.len() {
            // A short write of a few bytes to a regular file: report it as an I/O error.
            Err(libc::EIO)
        } else {
            Ok(())
        };
        let closed = close(descriptor);
        write_result?;
        closed
    }

    fn read_directory(&mut self, path: &str) -> Result<Vec<ListedEntry>, Errno> {
        read_directory(&self.path(path))
    }

    fn status(&mut self, path: &str) -> Result<NodeStatus, Errno> {
        fs::symlink_metadata(self.path(path))
            .map(|metadata| status_of(&metadata))
            .map_err(|error| errno_of(&error))
    }

    fn read_file(&mut self, path: &str) -> Result<Vec<u8>, Errno> {
        let mut file = fs::File::open(self.path(path)).map_err(|error| errno_of(&error))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|error| errno_of(&error))?;
        Ok(bytes)
    }

    fn read_link(&mut self, path: &str) -> Result<String, Errno> {
        fs::read_link(self.path(path))
            .map(|contents| contents.to_string_lossy().into_owned())
            .map_err(|error| errno_of(&error))
    }

    fn list_xattrs(&mut self, path: &str) -> Result<Vec<(String, Vec<u8>)>, Errno> {
        let c_path = self.c_path(path)?;
        let mut names = vec![0u8; 4096];
        // SAFETY: a valid path and a buffer of `names.len()` bytes.
        let length =
            unsafe { libc::llistxattr(c_path.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if length < 0 {
            return Err(last_errno());
        }
        names.truncate(length as usize);
        let mut attributes = Vec::new();
        for name in names
            .split(|byte| *byte == 0)
            .filter(|name| !name.is_empty())
        {
            if !name.starts_with(b"user.") {
                continue;
            }
            let c_name = CString::new(name).map_err(|_| libc::EINVAL)?;
            let mut value = vec![0u8; 4096];
            // SAFETY: valid strings and a buffer of `value.len()` bytes.
            let length = unsafe {
                libc::lgetxattr(
                    c_path.as_ptr(),
                    c_name.as_ptr(),
                    value.as_mut_ptr().cast(),
                    value.len(),
                )
            };
            if length < 0 {
                return Err(last_errno());
            }
            value.truncate(length as usize);
            attributes.push((String::from_utf8_lossy(name).into_owned(), value));
        }
        Ok(attributes)
    }
}
