"""The ``ff://`` filesystem for fsspec, and through it pandas, PyArrow, Dask, xarray, zarr.

Installed with the package (entry point ``fsspec.specs``), so ``fsspec.filesystem("ff")``
and every ``ff://`` URL work without an import::

    import pandas as pd
    df.to_parquet("ff:///datasets/day1.parquet")
    pd.read_parquet("ff:///datasets/day1.parquet")

A URL names an absolute path in the namespace: ``ff:///a/b`` and ``ff://a/b`` are the same
file. The cluster is the ``cluster`` storage option (a client.toml), else
``$FREEFLOW_CLUSTER``, else ``./freeflow-data/client.toml``::

    pd.read_parquet("ff:///x.parquet", storage_options={"cluster": "/etc/freeflow/client.toml"})

Files opened here are the package's own buffered files (``freeflow.Client.open``): reads
and writes go straight to the I/O servers, with the client library's read-ahead and
write-behind, not through fsspec's block cache.
"""

from __future__ import annotations

import datetime
import os
import stat as _stat
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

from fsspec.spec import AbstractFileSystem
from fsspec.utils import stringify_path, tokenize
from fsspec.core import has_magic

from . import Client

__all__ = ["FreeflowFileSystem"]

# fsspec keeps one filesystem instance per thread; they share one client (one session, one
# set of connections) per process and cluster file.
_clients: Dict[Tuple[int, str], Client] = {}
_clients_lock = threading.Lock()


def _shared_client(cluster: Optional[str]) -> Client:
    # The file the client will read, as it finds it (see freeflow.Client).
    path = cluster or os.environ.get("FREEFLOW_CLUSTER") or "./freeflow-data/client.toml"
    key = (os.getpid(), os.path.abspath(path))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = Client(cluster)
            _clients[key] = client
        return client


class FreeflowFileSystem(AbstractFileSystem):
    """fsspec filesystem over one Freeflow cluster (protocol ``ff``)."""

    protocol = ("ff",)
    root_marker = "/"

    def __init__(
        self,
        cluster: Optional[str] = None,
        client: Optional[Client] = None,
        auto_mkdir: bool = True,
        **kwargs: Any,
    ) -> None:
        """``auto_mkdir``: opening a file for writing makes its missing parent directories,
        as data libraries written for object stores expect (zarr, xarray, Dask write
        ``a/b/c`` without making ``a/b``); ``False`` refuses as ``open(2)`` does."""
        super().__init__(cluster=cluster, auto_mkdir=auto_mkdir, **kwargs)
        self.client = client if client is not None else _shared_client(cluster)
        self.auto_mkdir = auto_mkdir

    def __reduce__(self) -> Any:
        # Pickled (to Dask workers, say) with the cluster file this client uses, so the
        # copy reaches the same cluster whatever its environment.
        from fsspec.spec import make_instance

        options = dict(self.storage_options, cluster=self.client.cluster)
        options.pop("client", None)
        return make_instance, (type(self), self.storage_args, options)

    @property
    def fsid(self) -> str:
        return f"ff-{self.client.cluster}"

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        for prefix in ("ff://", "ff:"):
            if path.startswith(prefix):
                path = path[len(prefix):]
                break
        parts = [part for part in path.split("/") if part not in ("", ".")]
        return "/" + "/".join(parts)

    @classmethod
    def _parent(cls, path: str) -> str:
        path = cls._strip_protocol(path)
        parent = path.rsplit("/", 1)[0]
        return parent or cls.root_marker

    def unstrip_protocol(self, name: str) -> str:
        return "ff://" + self._strip_protocol(name)

    # -- Attributes and listings -----------------------------------------------------------

    def _describe(self, path: str, kind: str, st: Any) -> Dict[str, Any]:
        info = {
            "name": path,
            "size": st.st_size,
            "type": kind if kind in ("file", "directory") else "other",
            "created": st.st_ctime,
            "islink": False,
            "mode": st.st_mode,
            "uid": st.st_uid,
            "gid": st.st_gid,
            "mtime": st.st_mtime,
            "ino": st.st_ino,
            "nlink": st.st_nlink,
        }
        if kind == "link":
            # As the local filesystem: a link is described by what it points at.
            info["islink"] = True
            info["destination"] = self.client.readlink(path)
            try:
                target = self.client.stat(path)
            except FileNotFoundError:
                info["size"] = 0
            else:
                info["size"] = target.st_size
                info["type"] = _kind(target.st_mode)
        return info

    def info(self, path: str, **kwargs: Any) -> Dict[str, Any]:
        path = self._strip_protocol(path)
        st = self.client.lstat(path)
        kind = "link" if _stat.S_ISLNK(st.st_mode) else _kind(st.st_mode)
        return self._describe(path, kind, st)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Union[List[str], List[Dict[str, Any]]]:
        path = self._strip_protocol(path)
        here = self.info(path)
        if here["type"] != "directory":
            return [here] if detail else [here["name"]]
        entries = self.client.scandir(path)
        if not detail:
            return [entry.path for entry in entries]
        listed = []
        for entry in entries:
            try:
                listed.append(self._describe(entry.path, entry.kind, entry.stat))
            except FileNotFoundError:
                continue  # a link removed since the listing
        return listed

    def lexists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.client.lstat(self._strip_protocol(path))
        except FileNotFoundError:
            return False
        return True

    def islink(self, path: str) -> bool:
        try:
            return _stat.S_ISLNK(self.client.lstat(self._strip_protocol(path)).st_mode)
        except FileNotFoundError:
            return False

    def created(self, path: str) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.info(path)["created"], tz=datetime.timezone.utc)

    def modified(self, path: str) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)

    def ukey(self, path: str) -> str:
        info = self.info(path)
        return tokenize(self.fsid, info["name"], info["ino"], info["size"], info["mtime"])

    # -- Changes ---------------------------------------------------------------------------

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if create_parents:
            if self.lexists(path):
                raise FileExistsError(path)
            self.client.makedirs(path, exist_ok=True)
        else:
            self.client.mkdir(path, kwargs.get("mode", 0o777))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.client.makedirs(self._strip_protocol(path), exist_ok)

    def rmdir(self, path: str) -> None:
        self.client.rmdir(self._strip_protocol(path))

    def rm_file(self, path: str) -> None:
        self.client.remove(self._strip_protocol(path))

    def _rm(self, path: str) -> None:
        path = self._strip_protocol(path)
        if self.isdir(path) and not self.islink(path):
            self.client.rmdir(path)
        else:
            self.client.remove(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Optional[int] = None) -> None:
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            p = self._strip_protocol(p)
            if has_magic(p):
                # A glob: what it names, deepest first, as fsspec's default does.
                for found in reversed(self.expand_path(p, recursive=recursive, maxdepth=maxdepth)):
                    self._rm(found)
                continue
            if self.isdir(p) and not self.islink(p):
                if not recursive:
                    raise ValueError(f"{p} is a directory: remove it with recursive=True")
                if p == "/":
                    raise ValueError("refusing to remove the root of the file system")
                if maxdepth is not None:
                    # Only what lies within maxdepth, deepest first, as fsspec's default.
                    for found in reversed(self.expand_path(p, recursive=True, maxdepth=maxdepth)):
                        self._rm(found)
                else:
                    self.client.rmtree(p)
            else:
                self.client.remove(p)

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: Optional[int] = None, **kwargs: Any) -> None:
        """One path to another: one rename at the meta server (``rename(2)``: an existing
        file at ``path2`` is replaced; its parent is made under ``auto_mkdir``). Lists and
        globs move as fsspec's default does (copy, then remove)."""
        if isinstance(path1, list) or isinstance(path2, list) or has_magic(str(path1)):
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        source, target = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.auto_mkdir:
            self.client.makedirs(self._parent(target), exist_ok=True)
        self.client.rename(source, target)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.isdir(path1):
            self.makedirs(path2, exist_ok=True)
            return
        if self.auto_mkdir:
            self.client.makedirs(self._parent(path2), exist_ok=True)
        self.client.copy_file(path1, path2)

    def chmod(self, path: str, mode: int) -> None:
        self.client.chmod(self._strip_protocol(path), mode)

    def symlink(self, source: str, destination: str, **kwargs: Any) -> None:
        """Make ``destination`` a symlink to ``source``, as the local filesystem's."""
        self.client.symlink(self._strip_protocol(source), self._strip_protocol(destination))

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if truncate or not self.exists(path):
            with self.client.open(path, "wb"):
                pass
        else:
            raise NotImplementedError("touch of an existing file without truncating it")

    # -- Files -----------------------------------------------------------------------------

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: Optional[int] = None,
        autocommit: bool = True,
        cache_options: Optional[dict] = None,
        **kwargs: Any,
    ) -> Any:
        if not autocommit:
            raise NotImplementedError("Freeflow files are written in place; fsspec transactions are not supported")
        path = self._strip_protocol(path)
        if self.auto_mkdir and any(letter in mode for letter in "wxa"):
            self.client.makedirs(self._parent(path), exist_ok=True)
        buffering = block_size if isinstance(block_size, int) and block_size > 0 else -1
        return self.client.open(path, mode, buffering=buffering)


def _kind(mode: int) -> str:
    if _stat.S_ISDIR(mode):
        return "directory"
    if _stat.S_ISREG(mode):
        return "file"
    return "other"
