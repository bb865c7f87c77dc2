"""Freeflow from Python, without a mount.

``freeflow.Client`` reaches a cluster from its cluster file (the ``client.toml`` that
``freeflow up`` and ``freeflow init`` write) and speaks absolute paths inside the
namespace::

    import freeflow

    with freeflow.Client("freeflow-data/client.toml") as fs:
        fs.makedirs("/runs/7", exist_ok=True)
        with fs.open("/runs/7/out.bin", "wb") as f:
            f.write(b"...")
        print(fs.stat("/runs/7/out.bin").st_size, fs.listdir("/runs/7"))

Files are real ``io`` objects (subclasses of ``io.BufferedReader``/``BufferedWriter``/
``BufferedRandom`` over :class:`RawFile`, or ``io.TextIOWrapper`` in text mode), so
everything that takes a Python file takes them. Their ``flush`` publishes what was written
(another client's open then sees it) and their ``fsync`` makes it durable. The ``ff://`` protocol of fsspec (:mod:`freeflow.fsspec`) is
registered when the package is installed, for pandas, PyArrow, Dask, xarray and zarr.

Calls release the GIL while they wait on the network; errors are ``OSError`` subclasses
chosen by errno (``FileNotFoundError``, ``FileExistsError``, ``PermissionError``, ...).
A client belongs to the process that made it: its background work (lease renewal,
write-behind) runs on threads a forked child does not have, so a child that uses its
parent's client gets an ``OSError`` saying so. Make clients in the child (with
``multiprocessing``, in the worker; PyTorch's ``DataLoader``: in ``worker_init_fn``).
"""

from __future__ import annotations

import atexit
import errno
import io
import os
import stat as _stat
import weakref
from typing import IO, Any, Iterator, List, NamedTuple, Optional, Tuple, Union

from ._native import Client as _NativeClient
from ._native import File as _NativeFile

__all__ = [
    "Client",
    "RawFile",
    "BufferedReader",
    "BufferedWriter",
    "BufferedRandom",
    "DirEntry",
    "DEFAULT_BUFFER_SIZE",
]

#: Buffer of the file objects :meth:`Client.open` returns: reads and writes smaller than
#: this are gathered into requests of this size (one stripe unit by default).
DEFAULT_BUFFER_SIZE = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]


def _path(path: PathLike) -> str:
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"a Freeflow path is a str, not {type(path).__name__}")
    return path


def _stat_result(fields: Tuple[int, ...]) -> os.stat_result:
    """An ``os.stat_result`` from the fields the native module returns."""
    (mode, inode, links, uid, gid, size, atime_ns, mtime_ns, ctime_ns, _birth_ns, allocated) = fields
    return os.stat_result(
        (mode, inode, 0, links, uid, gid, size, atime_ns // 10**9, mtime_ns // 10**9, ctime_ns // 10**9),
        {
            "st_atime": atime_ns / 1e9,
            "st_mtime": mtime_ns / 1e9,
            "st_ctime": ctime_ns / 1e9,
            "st_atime_ns": atime_ns,
            "st_mtime_ns": mtime_ns,
            "st_ctime_ns": ctime_ns,
            "st_blocks": (allocated + 511) // 512,
            "st_blksize": DEFAULT_BUFFER_SIZE,
        },
    )


class DirEntry(NamedTuple):
    """One entry of :meth:`Client.scandir`: its name, full path, kind ("file",
    "directory", "link" or "other") and attributes (of the entry itself, not followed)."""

    name: str
    path: str
    kind: str
    stat: os.stat_result

    def is_dir(self) -> bool:
        return self.kind == "directory"

    def is_file(self) -> bool:
        return self.kind == "file"

    def is_symlink(self) -> bool:
        return self.kind == "link"


class RawFile(io.RawIOBase):
    """An open Freeflow file with a position: unbuffered, as ``open(..., buffering=0)``.

    ``readinto`` fills the caller's buffer (``bytearray``, ``memoryview``, a NumPy array)
    straight from the reply. A write is in flight when it returns; ``flush`` waits for the
    writes and publishes the size (other clients' opens then see the data), ``fsync`` makes
    them durable, ``close`` does what ``flush`` does and reports any failed write.
    """

    def __init__(self, native: _NativeFile, mode: str) -> None:
        super().__init__()
        self._native = native
        self._mode = mode

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def mode(self) -> str:
        return self._mode

    def readable(self) -> bool:
        self._checkClosed()
        return self._native.readable()

    def writable(self) -> bool:
        self._checkClosed()
        return self._native.writable()

    def seekable(self) -> bool:
        self._checkClosed()
        return True

    def readinto(self, buffer: Any) -> int:
        self._checkClosed()
        self._checkReadable()
        return self._native.readinto(buffer)

    def read(self, size: Optional[int] = -1) -> bytes:
        self._checkClosed()
        self._checkReadable()
        return self._native.read(-1 if size is None else size)

    def readall(self) -> bytes:
        self._checkClosed()
        self._checkReadable()
        return self._native.readall()

    def write(self, data: Any) -> int:
        self._checkClosed()
        self._checkWritable()
        return self._native.write(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if whence == io.SEEK_SET and offset < 0:
            raise OSError(errno.EINVAL, "Invalid argument: negative seek position")
        return self._native.seek(offset, whence)

    def tell(self) -> int:
        self._checkClosed()
        return self._native.tell()

    def truncate(self, size: Optional[int] = None) -> int:
        self._checkClosed()
        self._checkWritable()
        if size is not None and size < 0:
            raise ValueError(f"negative size value {size}")
        return self._native.truncate(size)

    def flush(self) -> None:
        if not self.closed:
            self._native.flush()

    def fsync(self) -> None:
        """Make every byte written so far durable (``os.fsync`` of a local file)."""
        self._checkClosed()
        self._native.fsync()

    def fstat(self) -> os.stat_result:
        self._checkClosed()
        return _stat_result(self._native.stat_fields())

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a Freeflow file opened by the library has no descriptor")

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._native.close()
        finally:
            super().close()

    def __repr__(self) -> str:
        return f"<freeflow.RawFile name={self.name!r} mode={self._mode!r}>"


class _Publishing:
    """What Freeflow's buffered files add to Python's: ``flush`` also waits for the writes
    and publishes the size (CPython's buffered ``flush`` only writes its buffer to the raw
    file), and ``fsync`` flushes, then makes every byte durable."""

    raw: RawFile

    def flush(self) -> None:
        super().flush()  # type: ignore[misc]
        self.raw.flush()

    def fsync(self) -> None:
        self.flush()
        self.raw.fsync()


class BufferedWriter(_Publishing, io.BufferedWriter):
    pass


class BufferedRandom(_Publishing, io.BufferedRandom):
    pass


class BufferedReader(io.BufferedReader):
    def fsync(self) -> None:
        self.raw.fsync()


def _open_flags(mode: str) -> Tuple[dict, bool]:
    """The open flags for a mode string of ``open()``, and whether it is binary."""
    letters = set(mode)
    if len(letters) != len(mode) or not letters <= set("rwxab+t") or len(letters & set("rwxa")) != 1:
        raise ValueError(f"invalid mode: {mode!r}")
    if "b" in letters and "t" in letters:
        raise ValueError("can't have text and binary mode at once")
    plus = "+" in letters
    flags = dict(read=True, write=False, append=False, create=False, truncate=False, exclusive=False)
    if "w" in letters:
        flags.update(read=plus, write=True, create=True, truncate=True)
    elif "x" in letters:
        flags.update(read=plus, write=True, create=True, exclusive=True)
    elif "a" in letters:
        flags.update(read=plus, write=True, append=True, create=True)
    else:
        flags.update(write=plus)
    return flags, "b" in letters


#: Clients not closed yet, ended when the interpreter exits (see `_close_at_exit`).
_open_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _close_at_exit() -> None:
    """End the session of every client of this process nobody closed (fsspec's shared
    clients, a script that never calls ``close``). A client that just goes away keeps its
    session and its cache leases at the meta server until they run out, and every other
    client's change in a directory it listed waits for them (10 s by default)."""
    for client in list(_open_clients):
        if getattr(client, "_pid", None) != os.getpid():
            continue  # a parent's, before a fork: not ours to end
        try:
            client.close()
        except OSError:
            pass


atexit.register(_close_at_exit)


class Client(_NativeClient):
    """A session with one Freeflow cluster.

    ``Client(cluster=None)`` reads the cluster file ``cluster``, else ``$FREEFLOW_CLUSTER``,
    else ``./freeflow-data/client.toml``. Paths are absolute inside the namespace. Safe to
    share between threads. ``close()`` (or leaving a ``with`` block) ends the session; a
    client still open when the interpreter exits is closed then.
    """

    def __init__(
        self, cluster: Optional[PathLike] = None, *, client_name: Optional[str] = None
    ) -> None:
        # The session was opened by the native constructor; remember it to end it at exit.
        self._pid = os.getpid()
        _open_clients.add(self)

    def close(self) -> None:
        """End the session (files still open are closed by the meta server)."""
        _open_clients.discard(self)
        super().close()

    def open(
        self,
        path: PathLike,
        mode: str = "r",
        buffering: int = -1,
        encoding: Optional[str] = None,
        errors: Optional[str] = None,
        newline: Optional[str] = None,
        permissions: int = 0o666,
    ) -> IO[Any]:
        """Open a file as the builtin ``open`` does: the same modes, buffering and text
        arguments; ``permissions`` are those of a file it creates."""
        path = _path(path)
        flags, binary = _open_flags(mode)
        if binary and encoding is not None:
            raise ValueError("binary mode doesn't take an encoding argument")
        if buffering == 0 and not binary:
            raise ValueError("can't have unbuffered text I/O")
        raw = RawFile(self.open_file(path, permissions=permissions, **flags), mode)
        if buffering == 0:
            return raw
        size = DEFAULT_BUFFER_SIZE if buffering in (-1, 1) else buffering
        try:
            if flags["read"] and flags["write"]:
                buffered: Any = BufferedRandom(raw, size)
            elif flags["write"]:
                buffered = BufferedWriter(raw, size)
            else:
                buffered = BufferedReader(raw, size)
            if binary:
                return buffered
            return io.TextIOWrapper(buffered, encoding, errors, newline, line_buffering=buffering == 1)
        except BaseException:
            raw.close()
            raise

    def stat(self, path: PathLike) -> os.stat_result:
        """The attributes of ``path``, following a final symlink."""
        return _stat_result(self.stat_fields(_path(path)))

    def lstat(self, path: PathLike) -> os.stat_result:
        """The attributes of ``path`` itself."""
        return _stat_result(self.lstat_fields(_path(path)))

    def exists(self, path: PathLike) -> bool:
        """As ``os.path.exists``: False for any error (a missing name, a file on the way)."""
        try:
            self.stat_fields(_path(path))
        except OSError:
            return False
        return True

    def isdir(self, path: PathLike) -> bool:
        try:
            return _stat.S_ISDIR(self.stat(path).st_mode)
        except OSError:
            return False

    def isfile(self, path: PathLike) -> bool:
        try:
            return _stat.S_ISREG(self.stat(path).st_mode)
        except OSError:
            return False

    def scandir(self, path: PathLike) -> List[DirEntry]:  # type: ignore[override]
        """The entries of a directory with their attributes, in name order."""
        path = _path(path)
        base = path.rstrip("/")
        return [
            DirEntry(name, f"{base}/{name}", kind, _stat_result(fields))
            for name, kind, fields in super().scandir(path)
        ]

    def walk(self, top: PathLike) -> Iterator[Tuple[str, List[str], List[str]]]:
        """As ``os.walk`` (top-down, symlinks to directories not followed)."""
        top = _path(top)
        directories: List[str] = []
        files: List[str] = []
        for entry in self.scandir(top):
            (directories if entry.is_dir() else files).append(entry.name)
        yield top, directories, files
        base = top.rstrip("/")
        for name in directories:
            yield from self.walk(f"{base}/{name}")

    def read_bytes(self, path: PathLike) -> bytes:
        with self.open(path, "rb", buffering=0) as f:
            return f.read()

    def write_bytes(self, path: PathLike, data: Any) -> int:
        with self.open(path, "wb", buffering=0) as f:
            return f.write(data)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
