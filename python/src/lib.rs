//! `freeflow._native`: the client library for Python (issue 13). The Python package
//! (`python/freeflow`) wraps these classes in the shapes Python code expects: `io` file
//! objects, `os.stat_result`, an fsspec filesystem.
//!
//! - [`Client`] holds one `freeflow_client::Client` (a session at the meta server, pipelined
//!   connections to the I/O servers) and speaks paths.
//! - [`File`] is an open file with a position, the raw layer under `io.BufferedReader` and
//!   `io.BufferedWriter`: `readinto` fills the caller's buffer straight from the reply.
//!
//! Every call that may wait on the network releases the GIL (`Python::detach`) and blocks on
//! a process-wide Tokio runtime, so Python threads read and write in parallel. Errors are
//! `OSError`s built from the errno Freeflow reports, so Python turns them into
//! `FileNotFoundError`, `FileExistsError`, `PermissionError` and the rest.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use freeflow_client::cluster_file::{cluster_file_path, ClientFile};
use freeflow_client::{
    normalize, Attr, ClientError, ErrorCode, FileHandle, FileKind, OpenOptions, SetAttr,
    READ_LENGTH_MAX, ROOT_INODE,
};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// Worker threads of the runtime shared by every client of the process.
const RUNTIME_THREADS: usize = 4;

/// Most bytes one `copy_range_from` call is asked for (the library copies 1 GiB at most).
const COPY_PIECE_BYTES: u64 = 1 << 30;

/// The runtime of this process. A child made by `fork` has none of its parent's threads,
/// so it gets a runtime of its own (the parent's is left alone: its threads are not there
/// to stop), and clients made before the fork refuse to be used in it ([`Client::check`]).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::Mutex<Option<(u32, &'static tokio::runtime::Runtime)>> =
        std::sync::Mutex::new(None);
    let mut current = RUNTIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let pid = std::process::id();
    match *current {
        Some((owner, runtime)) if owner == pid => runtime,
        _ => {
            let runtime: &'static tokio::runtime::Runtime = Box::leak(Box::new(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(RUNTIME_THREADS)
                    .thread_name("freeflow-python")
                    .enable_all()
                    .build()
                    .expect("a Tokio runtime for the freeflow module"),
            ));
            *current = Some((pid, runtime));
            runtime
        }
    }
}

/// Run `future` to its end with the GIL released.
fn wait<T, F>(py: Python<'_>, future: F) -> T
where
    F: Future<Output = T> + Send,
    T: Send,
{
    py.detach(|| runtime().block_on(future))
}

/// The `OSError` (subclass chosen by Python from the errno) for a failed call on `path`.
/// As [`os_error`] for a call on two paths (`rename`, `link`): both in the error.
fn os_error2(error: ClientError, first: &str, second: &str) -> PyErr {
    let errno = error.code().errno();
    PyOSError::new_err((
        errno,
        error.to_string(),
        first.to_string(),
        py_none_int(),
        second.to_string(),
    ))
}

/// The `winerror` slot of `OSError`'s five arguments: unused on Linux.
fn py_none_int() -> Option<i32> {
    None
}

fn os_error(error: ClientError, path: Option<&str>) -> PyErr {
    let errno = error.code().errno();
    match path {
        Some(path) => PyOSError::new_err((errno, error.to_string(), path.to_string())),
        None => PyOSError::new_err((errno, error.to_string())),
    }
}

/// A path argument (`str` or `os.PathLike`) as text: Freeflow names are UTF-8.
fn utf8(path: &std::path::Path) -> PyResult<&str> {
    path.to_str()
        .ok_or_else(|| PyValueError::new_err(format!("{} is not valid UTF-8", path.display())))
}

fn closed_file() -> PyErr {
    PyValueError::new_err("I/O operation on closed file")
}

/// What `os.stat_result` is built from in Python: (mode, inode, link count, user, group,
/// size, atime ns, mtime ns, ctime ns, birth time ns, allocated bytes).
type StatFields = (u32, u64, u32, u32, u32, u64, i128, i128, i128, i128, u64);

fn nanoseconds(time: freeflow_client::TimeSpec) -> i128 {
    i128::from(time.seconds) * 1_000_000_000 + i128::from(time.nanoseconds)
}

fn stat_fields(attr: &Attr) -> StatFields {
    (
        attr.kind.mode_bits() | attr.permissions,
        attr.inode,
        attr.link_count,
        attr.user_id,
        attr.group_id,
        attr.size_bytes,
        nanoseconds(attr.access_time),
        nanoseconds(attr.modify_time),
        nanoseconds(attr.change_time),
        nanoseconds(attr.birth_time),
        attr.allocated_bytes,
    )
}

fn kind_name(kind: FileKind) -> &'static str {
    match kind {
        FileKind::Regular => "file",
        FileKind::Directory => "directory",
        FileKind::Symlink => "link",
        _ => "other",
    }
}

/// A connection to one Freeflow cluster, named by its cluster file (`client.toml`).
#[pyclass(module = "freeflow._native", subclass, frozen)]
pub struct Client {
    inner: freeflow_client::Client,
    cluster: PathBuf,
    /// The process that made it: its connections and tasks live on that process's runtime.
    pid: u32,
}

impl Client {
    /// Refuse use in a process other than the one that made this client (after `fork`),
    /// where its background work does not run and calls would wait forever.
    fn check(&self) -> PyResult<()> {
        if self.pid == std::process::id() {
            return Ok(());
        }
        Err(PyOSError::new_err((
            ErrorCode::InvalidArgument.errno(),
            format!(
                "this freeflow.Client was made in process {}, before a fork: make a new one in process {}",
                self.pid,
                std::process::id()
            ),
        )))
    }

    /// The inode and attributes of the directory holding `path`'s final name, and the name.
    async fn parent_of(&self, path: &str) -> Result<(u64, String), ClientError> {
        let path = normalize(path)?;
        let (parent, name) = match path.rsplit_once('/') {
            Some((_, "")) | None => {
                return Err(ClientError::Path {
                    path,
                    code: ErrorCode::Busy,
                    reason: "the root directory has no parent".into(),
                })
            }
            Some(("", name)) => ("/".to_string(), name.to_string()),
            Some((parent, name)) => (parent.to_string(), name.to_string()),
        };
        let attr = self.inner.stat(&parent).await?;
        if attr.kind != FileKind::Directory {
            return Err(ClientError::Path {
                path: parent,
                code: ErrorCode::NotDirectory,
                reason: "not a directory".into(),
            });
        }
        Ok((attr.inode, name))
    }
}

#[pymethods]
impl Client {
    /// Connect to the cluster of `cluster` (a client.toml); default `$FREEFLOW_CLUSTER`,
    /// then `./freeflow-data/client.toml`.
    #[new]
    #[pyo3(signature = (cluster=None, *, client_name=None))]
    fn new(
        py: Python<'_>,
        cluster: Option<PathBuf>,
        client_name: Option<String>,
    ) -> PyResult<Self> {
        let path = cluster_file_path(cluster);
        let shown = path.display().to_string();
        if !path.exists() {
            return Err(PyOSError::new_err((
                ErrorCode::NotFound.errno(),
                format!("no cluster file at {shown}: start a cluster with `freeflow up`, or name its client.toml"),
                shown,
            )));
        }
        let file = ClientFile::read(&path).map_err(|error| os_error(error, Some(&shown)))?;
        let name = client_name.unwrap_or_else(|| format!("python-{}", std::process::id()));
        let config = file
            .client_config(&path, name)
            .map_err(|error| os_error(error, Some(&shown)))?;
        let inner = wait(py, freeflow_client::Client::connect(config))
            .map_err(|error| os_error(error, Some(&shown)))?;
        Ok(Client {
            inner,
            cluster: path,
            pid: std::process::id(),
        })
    }

    /// The cluster file this client was made from.
    #[getter]
    fn cluster(&self) -> String {
        self.cluster.display().to_string()
    }

    /// The attributes of `path`, following a final symlink, as the fields of `os.stat_result`.
    fn stat_fields(&self, py: Python<'_>, path: PathBuf) -> PyResult<StatFields> {
        self.check()?;
        let path = utf8(&path)?;
        let attr = wait(py, self.inner.stat(path)).map_err(|e| os_error(e, Some(path)))?;
        Ok(stat_fields(&attr))
    }

    /// As `stat_fields`, not following a final symlink.
    fn lstat_fields(&self, py: Python<'_>, path: PathBuf) -> PyResult<StatFields> {
        self.check()?;
        let path = utf8(&path)?;
        let attr = wait(py, self.inner.lstat(path)).map_err(|e| os_error(e, Some(path)))?;
        Ok(stat_fields(&attr))
    }

    /// The names in the directory `path`, in name order ("." and ".." left out).
    fn listdir(&self, py: Python<'_>, path: PathBuf) -> PyResult<Vec<String>> {
        self.check()?;
        let path = utf8(&path)?;
        let entries =
            wait(py, self.inner.read_dir_all(path)).map_err(|e| os_error(e, Some(path)))?;
        Ok(entries.into_iter().map(|entry| entry.name).collect())
    }

    /// Each entry of the directory `path` with its kind ("file", "directory", "link",
    /// "other") and stat fields, in one request per page (readdirplus).
    fn scandir(
        &self,
        py: Python<'_>,
        path: PathBuf,
    ) -> PyResult<Vec<(String, String, StatFields)>> {
        self.check()?;
        let path = utf8(&path)?;
        let directory = path.to_string();
        let listed = wait(py, async {
            let entries = self.inner.read_dir_all_plus(&directory).await?;
            let mut listed = Vec::with_capacity(entries.len());
            for entry in entries {
                let attr = match entry.attr {
                    Some(attr) => attr,
                    None => {
                        let inner = freeflow_client::join(&directory, &entry.name);
                        match self.inner.lstat(&inner).await {
                            Ok(attr) => attr,
                            // Removed since the listing: as os.scandir, not listed.
                            Err(error) if error.code() == ErrorCode::NotFound => continue,
                            Err(error) => return Err(error),
                        }
                    }
                };
                listed.push((
                    entry.name,
                    kind_name(attr.kind).to_string(),
                    stat_fields(&attr),
                ));
            }
            Ok(listed)
        })
        .map_err(|e| os_error(e, Some(path)))?;
        Ok(listed)
    }

    #[pyo3(signature = (path, mode=0o777))]
    fn mkdir(&self, py: Python<'_>, path: PathBuf, mode: u32) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, self.inner.mkdir_path(path, mode & 0o7777))
            .map_err(|e| os_error(e, Some(path)))?;
        Ok(())
    }

    /// Make `path` and its missing parents; an existing directory is an error unless
    /// `exist_ok`, and an existing non-directory always is.
    #[pyo3(signature = (path, exist_ok=false))]
    fn makedirs(&self, py: Python<'_>, path: PathBuf, exist_ok: bool) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, async {
            match self.inner.stat(path).await {
                Ok(attr) if attr.kind == FileKind::Directory && exist_ok => Ok(()),
                Ok(_) => Err(ClientError::Path {
                    path: path.to_string(),
                    code: ErrorCode::Exists,
                    reason: "exists already".into(),
                }),
                Err(error) if error.code() == ErrorCode::NotFound => {
                    self.inner.mkdir_all(path).await.map(|_| ())
                }
                Err(error) => Err(error),
            }
        })
        .map_err(|e| os_error(e, Some(path)))
    }

    /// Remove the empty directory `path`.
    fn rmdir(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, async {
            let (parent, name) = self.parent_of(path).await?;
            self.inner.rmdir(parent, &name).await
        })
        .map_err(|e| os_error(e, Some(path)))
    }

    /// Remove the file or symlink `path` (not a directory: see `rmdir`, `rmtree`).
    fn remove(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, async {
            let (parent, name) = self.parent_of(path).await?;
            self.inner.unlink(parent, &name).await
        })
        .map_err(|e| os_error(e, Some(path)))
    }

    /// Remove `path` and, for a directory, everything below it (symlinks are not followed).
    fn rmtree(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, self.inner.remove_all(path)).map_err(|e| os_error(e, Some(path)))
    }

    /// Rename `source` to `target`, replacing an existing `target` as `rename(2)` does.
    fn rename(&self, py: Python<'_>, source: PathBuf, target: PathBuf) -> PyResult<()> {
        self.check()?;
        let source = utf8(&source)?;
        let target = utf8(&target)?;
        wait(py, self.inner.rename_path(source, target)).map_err(|e| os_error2(e, source, target))
    }

    fn truncate(&self, py: Python<'_>, path: PathBuf, length: u64) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, self.inner.truncate_path(path, length)).map_err(|e| os_error(e, Some(path)))?;
        Ok(())
    }

    fn chmod(&self, py: Python<'_>, path: PathBuf, mode: u32) -> PyResult<()> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, async {
            let attr = self.inner.stat(path).await?;
            let changes = SetAttr {
                permissions: Some(mode & 0o7777),
                ..SetAttr::default()
            };
            self.inner.setattr(attr.inode, changes).await
        })
        .map_err(|e| os_error(e, Some(path)))?;
        Ok(())
    }

    /// Make a symlink at `link` pointing at `target`.
    fn symlink(&self, py: Python<'_>, target: PathBuf, link: PathBuf) -> PyResult<()> {
        self.check()?;
        let target = utf8(&target)?;
        let link = utf8(&link)?;
        wait(py, self.inner.symlink_path(target, link)).map_err(|e| os_error(e, Some(link)))?;
        Ok(())
    }

    fn readlink(&self, py: Python<'_>, path: PathBuf) -> PyResult<String> {
        self.check()?;
        let path = utf8(&path)?;
        wait(py, async {
            let attr = self.inner.lstat(path).await?;
            self.inner.readlink(attr.inode).await
        })
        .map_err(|e| os_error(e, Some(path)))
    }

    /// A second name `new` for the file `existing`.
    fn link(&self, py: Python<'_>, existing: PathBuf, new: PathBuf) -> PyResult<()> {
        self.check()?;
        let existing = utf8(&existing)?;
        let new = utf8(&new)?;
        wait(py, self.inner.link_path(existing, new)).map_err(|e| os_error2(e, existing, new))?;
        Ok(())
    }

    /// Open `path`; the flags are those of `open(2)`. Python's `freeflow.Client.open` turns
    /// a mode string into them and wraps the result in a buffered file object.
    #[pyo3(signature = (path, *, read=true, write=false, append=false, create=false,
                        truncate=false, exclusive=false, permissions=0o666))]
    #[allow(clippy::too_many_arguments)]
    fn open_file(
        &self,
        py: Python<'_>,
        path: PathBuf,
        read: bool,
        write: bool,
        append: bool,
        create: bool,
        truncate: bool,
        exclusive: bool,
        permissions: u32,
    ) -> PyResult<File> {
        self.check()?;
        let path = utf8(&path)?;
        let options = OpenOptions::new()
            .read(read)
            .write(write || append)
            .append(append)
            .create(create)
            .truncate(truncate)
            .exclusive(exclusive)
            .permissions(permissions & 0o7777);
        let handle =
            wait(py, self.inner.open_path(path, &options)).map_err(|e| os_error(e, Some(path)))?;
        if handle.attr().kind != FileKind::Regular {
            // The library opens only regular files; say so as open(2) would for a directory.
            let _ = wait(py, handle.close());
            return Err(os_error(
                ClientError::Path {
                    path: path.to_string(),
                    code: ErrorCode::IsDirectory,
                    reason: "not a regular file".into(),
                },
                Some(path),
            ));
        }
        // As Python's FileIO: an append stream starts at the end.
        let position = if append { handle.size() } else { 0 };
        Ok(File {
            path: path.to_string(),
            pid: self.pid,
            readable: read,
            writable: write || append,
            append,
            state: tokio::sync::Mutex::new(FileState {
                handle: Some(Arc::new(handle)),
                position,
            }),
        })
    }

    /// Copy the file `source` to `target` (created or replaced) on the I/O servers where the
    /// layouts allow, else through this client. Returns the bytes copied.
    fn copy_file(&self, py: Python<'_>, source: PathBuf, target: PathBuf) -> PyResult<u64> {
        self.check()?;
        let source = utf8(&source)?;
        let target = utf8(&target)?;
        wait(py, async {
            let source_attr = self.inner.stat(source).await?;
            match self.inner.stat(target).await {
                Ok(target_attr) if target_attr.inode == source_attr.inode => {
                    return Err(ClientError::Path {
                        path: target.to_string(),
                        code: ErrorCode::InvalidArgument,
                        reason: format!("is the same file as {source}"),
                    });
                }
                _ => {}
            }
            let from = self
                .inner
                .open_path(source, &OpenOptions::new().read(true))
                .await?;
            let to_options = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .permissions(from.attr().permissions);
            let to = match self.inner.open_path(target, &to_options).await {
                Ok(to) => to,
                Err(error) => {
                    let _ = from.close().await;
                    return Err(error);
                }
            };
            let size = from.size();
            let mut copied = 0;
            let mut failure = None;
            while copied < size {
                let piece = (size - copied).min(COPY_PIECE_BYTES);
                match to.copy_range_from(&from, copied, copied, piece).await {
                    Ok(0) => break,
                    Ok(done) => copied += done,
                    Err(error) => {
                        failure = Some(error);
                        break;
                    }
                }
            }
            let closed = to.close().await;
            let _ = from.close().await;
            match failure {
                Some(error) => Err(error),
                None => closed.map(|()| copied),
            }
        })
        .map_err(|e| os_error(e, Some(target)))
    }

    /// Where the data of the file `path` lives: its layout and, per copy of each stripe, the
    /// server, its address, whether it is up, and the object's length.
    fn stripes<'py>(&self, py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
        self.check()?;
        let path = utf8(&path)?;
        let (attr, layout, placements) =
            wait(py, self.inner.stripe_map(path)).map_err(|e| os_error(e, Some(path)))?;
        let dict = PyDict::new(py);
        dict.set_item("size", attr.size_bytes)?;
        dict.set_item("stripe_unit", layout.stripe_unit_bytes)?;
        dict.set_item("stripe_count", layout.stripe_count())?;
        dict.set_item("replicas", layout.replicas())?;
        let rows: Vec<(u32, u32, String, bool, u64)> = placements
            .into_iter()
            .map(|(stripe, server, length)| {
                (stripe, server.server_id, server.address, server.up, length)
            })
            .collect();
        dict.set_item("objects", rows)?;
        Ok(dict)
    }

    /// Capacity and use of the whole cluster.
    fn statfs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check()?;
        let stats = wait(py, self.inner.statfs()).map_err(|e| os_error(e, None))?;
        let dict = PyDict::new(py);
        dict.set_item("capacity_bytes", stats.capacity_bytes)?;
        dict.set_item("free_bytes", stats.free_bytes)?;
        dict.set_item("inode_count", stats.inode_count)?;
        dict.set_item("servers_up", stats.servers_up)?;
        dict.set_item("servers_total", stats.servers_total)?;
        Ok(dict)
    }

    /// Make every metadata change of this client durable at the meta server.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        self.check()?;
        wait(py, self.inner.sync()).map_err(|e| os_error(e, None))
    }

    /// End the session (files still open are closed by the meta server when it expires).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.check()?;
        wait(py, self.inner.shutdown());
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "freeflow.Client(cluster={:?}, session={})",
            self.cluster.display().to_string(),
            self.inner.session_id()
        )
    }
}

struct FileState {
    /// None once closed.
    handle: Option<Arc<FileHandle>>,
    position: u64,
}

/// An open file with a position: the raw file under Python's buffered file objects.
#[pyclass(module = "freeflow._native", frozen)]
pub struct File {
    path: String,
    /// The process that opened it (see [`Client::check`]).
    pid: u32,
    readable: bool,
    writable: bool,
    append: bool,
    /// Taken by each call for its whole length: calls on one file run one at a time, as
    /// on a Python file object.
    state: tokio::sync::Mutex<FileState>,
}

impl File {
    fn check(&self) -> PyResult<()> {
        if self.pid == std::process::id() {
            return Ok(());
        }
        Err(PyOSError::new_err((
            ErrorCode::InvalidArgument.errno(),
            format!(
                "{} was opened in process {}, before a fork: open it again in process {}",
                self.path,
                self.pid,
                std::process::id()
            ),
        )))
    }

    /// The state, for calls that do not wait on the network: taken with the GIL released,
    /// as another thread's call may hold it while it waits on the network.
    fn state_now(&self, py: Python<'_>) -> tokio::sync::MutexGuard<'_, FileState> {
        py.detach(|| self.state.blocking_lock())
    }

    fn error(&self, error: ClientError) -> PyErr {
        os_error(error, Some(&self.path))
    }

    fn check_readable(&self) -> PyResult<()> {
        if self.readable {
            Ok(())
        } else {
            Err(pyo3::exceptions::PyIOError::new_err(format!(
                "{}: not open for reading",
                self.path
            )))
        }
    }

    fn check_writable(&self) -> PyResult<()> {
        if self.writable {
            Ok(())
        } else {
            Err(pyo3::exceptions::PyIOError::new_err(format!(
                "{}: not open for writing",
                self.path
            )))
        }
    }
}

/// The bytes of a caller's buffer, as an address and a length that may cross `detach`.
struct RawSpan {
    address: usize,
    length: usize,
}

fn writable_span(buffer: &PyUntypedBuffer) -> PyResult<RawSpan> {
    if buffer.readonly() {
        return Err(PyValueError::new_err("readinto needs a writable buffer"));
    }
    if !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err("readinto needs a contiguous buffer"));
    }
    Ok(RawSpan {
        address: buffer.buf_ptr() as usize,
        length: buffer.len_bytes(),
    })
}

#[pymethods]
impl File {
    #[getter]
    fn name(&self) -> &str {
        &self.path
    }

    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        self.state_now(py).handle.is_none()
    }

    fn readable(&self) -> bool {
        self.readable
    }

    fn writable(&self) -> bool {
        self.writable
    }

    /// Read into `buffer` (any writable contiguous buffer: bytearray, memoryview, a NumPy
    /// array) from the position; returns the bytes read, 0 at the end of the file.
    fn readinto(&self, py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.check()?;
        self.check_readable()?;
        let view = PyUntypedBuffer::get(buffer)?;
        let span = writable_span(&view)?;
        let read = wait(py, async {
            let mut state = self.state.lock().await;
            let handle = state.handle.clone().ok_or(None)?;
            let wanted = (span.length as u64).min(READ_LENGTH_MAX);
            // The servers' replies as they are, each copied once into the caller's buffer.
            let parts = handle
                .read_parts_at(state.position, wanted)
                .await
                .map_err(Some)?;
            let mut length = 0usize;
            for part in parts {
                let take = part.len().min(span.length - length);
                if take > 0 {
                    // SAFETY: `view` holds the caller's buffer exported (it cannot be
                    // resized or freed) until after this returns, and `length + take` is at
                    // most `span.length`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            part.as_ptr(),
                            (span.address as *mut u8).add(length),
                            take,
                        );
                    }
                }
                length += take;
            }
            state.position += length as u64;
            Ok::<usize, Option<ClientError>>(length)
        });
        drop(view);
        read.map_err(|error| error.map_or_else(closed_file, |error| self.error(error)))
    }

    /// Read up to `size` bytes from the position (all that is left for a negative size).
    #[pyo3(signature = (size=-1))]
    fn read<'py>(&self, py: Python<'py>, size: i64) -> PyResult<Bound<'py, PyBytes>> {
        self.check()?;
        self.check_readable()?;
        let data = wait(py, async {
            let mut state = self.state.lock().await;
            let handle = state.handle.clone().ok_or(None)?;
            // Everything left is read until a short read: the size this handle knows may be
            // behind another client's appends, which the library then asks for.
            let mut wanted = if size < 0 { u64::MAX } else { size as u64 };
            let mut gathered: Vec<Bytes> = Vec::new();
            while wanted > 0 {
                let asked = wanted.min(READ_LENGTH_MAX);
                // The servers' replies, copied once into the result below.
                let parts = handle
                    .read_parts_at(state.position, asked)
                    .await
                    .map_err(Some)?;
                let got: u64 = parts.iter().map(|part| part.len() as u64).sum();
                state.position += got;
                wanted -= got;
                gathered.extend(parts);
                // Shorter than asked only at the end of the file.
                if got < asked {
                    break;
                }
            }
            Ok::<Vec<Bytes>, Option<ClientError>>(gathered)
        })
        .map_err(|error| error.map_or_else(closed_file, |error| self.error(error)))?;
        if let [single] = data.as_slice() {
            return Ok(PyBytes::new(py, single));
        }
        let total = data.iter().map(Bytes::len).sum();
        PyBytes::new_with(py, total, |buffer| {
            let mut at = 0;
            for part in &data {
                buffer[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            Ok(())
        })
    }

    /// Everything from the position to the end of the file.
    fn readall<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.check()?;
        self.read(py, -1)
    }

    /// Write `data` (any contiguous buffer) at the position, or at the end of the file in
    /// append mode; returns its length. The write is in flight when this returns: a failure
    /// is reported by a later write, `flush`, `fsync` or `close`.
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.check()?;
        self.check_writable()?;
        let view = PyUntypedBuffer::get(data)?;
        let bytes = if view.is_c_contiguous() {
            // SAFETY: the buffer is exported and contiguous for `len_bytes` bytes while
            // `view` lives, and we hold the GIL, so nothing changes it during the copy.
            let slice = unsafe {
                std::slice::from_raw_parts(view.buf_ptr() as *const u8, view.len_bytes())
            };
            Bytes::copy_from_slice(slice)
        } else {
            Bytes::from(data.call_method0("tobytes")?.extract::<Vec<u8>>()?)
        };
        drop(view);
        let length = bytes.len();
        wait(py, async {
            let mut state = self.state.lock().await;
            let handle = state.handle.clone().ok_or(None)?;
            if self.append {
                let at = handle.append(bytes).await.map_err(Some)?;
                state.position = at + length as u64;
            } else {
                handle.write_at(state.position, bytes).await.map_err(Some)?;
                state.position += length as u64;
            }
            Ok::<(), Option<ClientError>>(())
        })
        .map_err(|error| error.map_or_else(closed_file, |error| self.error(error)))?;
        Ok(length)
    }

    /// Move the position: `whence` 0 from the start, 1 from the position, 2 from the end
    /// (for a file open only for reading, the size asked of the meta server, so others'
    /// appends count; for a writer, the size it knows, its own writes included). Returns
    /// the position.
    #[pyo3(signature = (offset, whence=0))]
    fn seek(&self, py: Python<'_>, offset: i64, whence: i32) -> PyResult<u64> {
        self.check()?;
        let result = wait(py, async {
            let mut state = self.state.lock().await;
            let handle = state.handle.clone().ok_or(None)?;
            let base = match whence {
                0 => 0,
                1 => state.position,
                2 => {
                    if self.writable {
                        handle.size()
                    } else {
                        handle.refresh().await.map_err(Some)?.size_bytes
                    }
                }
                _ => return Ok(Err(format!("whence {whence} is not 0, 1 or 2"))),
            };
            match base.checked_add_signed(offset) {
                Some(position) => {
                    state.position = position;
                    Ok(Ok(position))
                }
                None => Ok(Err(format!(
                    "seek to {base} + {offset} is outside the file"
                ))),
            }
        })
        .map_err(|error: Option<ClientError>| {
            error.map_or_else(closed_file, |error| self.error(error))
        })?;
        result.map_err(|message| PyOSError::new_err((libc_einval(), message)))
    }

    fn tell(&self, py: Python<'_>) -> PyResult<u64> {
        let state = self.state_now(py);
        state.handle.as_ref().ok_or_else(closed_file)?;
        Ok(state.position)
    }

    fn seekable(&self) -> bool {
        true
    }

    /// Set the size to `size` (default: the position); the position does not move.
    #[pyo3(signature = (size=None))]
    fn truncate(&self, py: Python<'_>, size: Option<u64>) -> PyResult<u64> {
        self.check()?;
        self.check_writable()?;
        wait(py, async {
            let state = self.state.lock().await;
            let handle = state.handle.clone().ok_or(None)?;
            let size = size.unwrap_or(state.position);
            handle.set_size(size).await.map_err(Some)?;
            Ok(size)
        })
        .map_err(|error: Option<ClientError>| {
            error.map_or_else(closed_file, |error| self.error(error))
        })
    }

    /// The size of the file as this handle knows it (its own writes included).
    fn size(&self, py: Python<'_>) -> PyResult<u64> {
        let state = self.state_now(py);
        Ok(state.handle.as_ref().ok_or_else(closed_file)?.size())
    }

    /// Wait for the writes in flight and commit the size at the meta server (what a close
    /// does, without a disk sync): after it, other clients' opens see the data.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.check()?;
        let handle = self.state_now(py).handle.clone();
        let Some(handle) = handle else {
            return Ok(());
        };
        if !self.writable {
            return Ok(());
        }
        wait(py, handle.flush()).map_err(|error| self.error(error))
    }

    /// Make every byte written through this file durable on its servers, and its size and
    /// mtime at the meta server.
    fn fsync(&self, py: Python<'_>) -> PyResult<()> {
        self.check()?;
        let handle = self.state_now(py).handle.clone().ok_or_else(closed_file)?;
        wait(py, handle.fsync()).map_err(|error| self.error(error))
    }

    /// Flush and close; reports a failure of any write made through the file. Closing a
    /// closed file does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.check()?;
        let handle = self.state_now(py).handle.take();
        let Some(handle) = handle else {
            return Ok(());
        };
        wait(py, handle.close_shared()).map_err(|error| self.error(error))
    }

    /// The attributes of the open file as the fields of `os.stat_result`.
    fn stat_fields(&self, py: Python<'_>) -> PyResult<StatFields> {
        let state = self.state_now(py);
        let handle = state.handle.as_ref().ok_or_else(closed_file)?;
        let mut attr = handle.attr();
        attr.size_bytes = handle.size();
        Ok(stat_fields(&attr))
    }
}

impl Drop for File {
    /// A file Python collected without `close`: flush and close it on the runtime (a
    /// failure there has nobody to report to, as with an unclosed Python file).
    fn drop(&mut self) {
        let state = self.state.get_mut();
        if let Some(handle) = state.handle.take() {
            if self.pid == std::process::id() {
                runtime().spawn(async move {
                    let _ = handle.close_shared().await;
                });
            } else {
                // Opened before a fork: its connections are the parent's, and this process
                // has no runtime for a close; the parent's session keeps it open.
                drop(handle);
            }
        }
    }
}

fn libc_einval() -> i32 {
    ErrorCode::InvalidArgument.errno()
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Client>()?;
    module.add_class::<File>()?;
    module.add("ROOT_INODE", ROOT_INODE)?;
    Ok(())
}
