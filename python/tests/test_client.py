"""freeflow.Client against a real cluster: bytes, buffers, positions, errors, namespace."""

import errno
import io
import os
import pathlib
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import freeflow

MiB = 1 << 20


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [0, 1, 4095, MiB, 5 * MiB + 7])
def test_bytes_come_back_as_written_across_stripes(client, home, size):
    data = payload(size, size)
    path = f"{home}/f-{size}"
    with client.open(path, "wb") as f:
        # In pieces of odd sizes, so the buffer both gathers and passes writes through.
        for start in range(0, size, 300_001):
            f.write(data[start : start + 300_001])
    assert client.stat(path).st_size == size
    with client.open(path, "rb") as f:
        assert f.read() == data
    assert client.read_bytes(path) == data


def test_readinto_fills_the_callers_buffers(client, home):
    data = payload(3 * MiB + 11, 1)
    client.write_bytes(f"{home}/r", data)
    with client.open(f"{home}/r", "rb", buffering=0) as f:
        assert isinstance(f, freeflow.RawFile)
        whole = bytearray(len(data))
        view = memoryview(whole)
        got = 0
        while got < len(data):
            n = f.readinto(view[got : got + 1_000_003])
            assert n > 0
            got += n
        assert bytes(whole) == data
        assert f.readinto(bytearray(10)) == 0  # at the end
        f.seek(MiB + 5)
        array = np.zeros(4096, dtype=np.uint8)
        assert f.readinto(array) == 4096
        assert array.tobytes() == data[MiB + 5 : MiB + 5 + 4096]
        with pytest.raises(ValueError):
            f.readinto(b"read-only")


def test_positions_follow_the_local_file_system(client, home, tmp_path):
    """The same operations on a local file and a Freeflow file give the same results."""
    local = open(tmp_path / "model", "w+b", buffering=0)
    remote = client.open(f"{home}/model", "w+b", buffering=0)
    rng = np.random.default_rng(7)
    for step in range(200):
        op = rng.integers(0, 4)
        if op == 0:
            offset = int(rng.integers(0, 2 * MiB))
            whence = int(rng.integers(0, 3))
            if whence == 2:
                offset = -min(offset, local.seek(0, 2))
            elif whence == 1:
                offset = max(-local.tell(), offset - MiB)
            assert remote.seek(offset, whence) == local.seek(offset, whence), step
        elif op == 1:
            chunk = payload(int(rng.integers(1, 200_000)), step)
            assert remote.write(chunk) == local.write(chunk)
        elif op == 2:
            size = int(rng.integers(0, 300_000))
            assert remote.read(size) == local.read(size), step
        else:
            size = int(rng.integers(0, 3 * MiB))
            assert remote.truncate(size) == local.truncate(size)
        assert remote.tell() == local.tell(), step
    remote.seek(0)
    local.seek(0)
    assert remote.read() == local.read()
    remote.close()
    local.close()
    assert client.stat(f"{home}/model").st_size == os.stat(tmp_path / "model").st_size


def test_append_and_text_modes(client, home):
    path = f"{home}/log.txt"
    with client.open(path, "a", encoding="utf-8") as f:
        f.write("first\n")
    with client.open(path, "a", encoding="utf-8") as f:
        f.write("zweite Zeile ✓\n")
    with client.open(path, "r", encoding="utf-8") as f:
        assert f.readlines() == ["first\n", "zweite Zeile ✓\n"]
    with client.open(path, "ab") as f:
        f.seek(0)  # append mode writes at the end whatever the position
        f.write(b"end")
    assert client.read_bytes(path).endswith(b"\nend")


def test_errors_are_os_errors_with_the_errno(client, home):
    with pytest.raises(FileNotFoundError) as missing:
        client.open(f"{home}/nothing", "rb")
    assert missing.value.errno == errno.ENOENT
    assert missing.value.filename == f"{home}/nothing"
    client.write_bytes(f"{home}/there", b"x")
    with pytest.raises(FileExistsError):
        client.open(f"{home}/there", "xb")
    with pytest.raises(IsADirectoryError):
        client.open(home, "rb")
    with pytest.raises(NotADirectoryError):
        client.listdir(f"{home}/there")
    with pytest.raises(NotADirectoryError):
        client.stat(f"{home}/there/below")
    client.mkdir(f"{home}/full")
    client.write_bytes(f"{home}/full/x", b"x")
    with pytest.raises(OSError) as not_empty:
        client.rmdir(f"{home}/full")
    assert not_empty.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        client.remove(f"{home}/full")
    with pytest.raises(FileExistsError):
        client.makedirs(f"{home}/full")
    with pytest.raises(ValueError):
        client.open(f"{home}/there", "rw")
    with client.open(f"{home}/there", "rb") as f:
        with pytest.raises(io.UnsupportedOperation):
            f.write(b"y")
    f = client.open(f"{home}/there", "rb", buffering=0)
    f.close()
    with pytest.raises(ValueError):
        f.read()


def test_a_cluster_file_that_is_not_there_is_named(tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        freeflow.Client(str(tmp_path / "client.toml"))
    assert str(tmp_path / "client.toml") in str(missing.value)


def test_namespace_operations(client, home):
    client.makedirs(f"{home}/a/b/c")
    client.makedirs(f"{home}/a/b/c", exist_ok=True)
    client.write_bytes(f"{home}/a/one", b"1")
    client.write_bytes(f"{home}/a/two", b"22")
    assert client.listdir(f"{home}/a") == ["b", "one", "two"]
    entries = {entry.name: entry for entry in client.scandir(f"{home}/a")}
    assert entries["b"].is_dir() and entries["two"].is_file()
    assert entries["two"].stat.st_size == 2 and entries["two"].path == f"{home}/a/two"
    assert stat.S_ISDIR(client.stat(f"{home}/a/b").st_mode)
    assert client.isfile(f"{home}/a/one") and not client.isdir(f"{home}/a/one")
    assert not client.exists(f"{home}/a/three")

    client.rename(f"{home}/a/one", f"{home}/a/two")  # replaces
    assert client.read_bytes(f"{home}/a/two") == b"1"
    assert not client.exists(f"{home}/a/one")

    client.symlink(f"{home}/a/two", f"{home}/a/link")
    assert client.readlink(f"{home}/a/link") == f"{home}/a/two"
    assert stat.S_ISLNK(client.lstat(f"{home}/a/link").st_mode)
    assert client.read_bytes(f"{home}/a/link") == b"1"
    client.link(f"{home}/a/two", f"{home}/a/hard")
    assert client.stat(f"{home}/a/two").st_nlink == 2

    client.chmod(f"{home}/a/two", 0o640)
    assert stat.S_IMODE(client.stat(f"{home}/a/two").st_mode) == 0o640
    client.truncate(f"{home}/a/two", 5)
    assert client.read_bytes(f"{home}/a/two") == b"1\0\0\0\0"

    # Path arguments may be os.PathLike.
    base = pathlib.PurePosixPath(home) / "a"
    client.mkdir(base / "p")
    client.rename(base / "p", base / "q")
    assert client.listdir(base / "q") == []
    client.rmdir(base / "q")

    walked = list(client.walk(f"{home}/a"))
    assert walked[0] == (f"{home}/a", ["b"], ["hard", "link", "two"])
    assert [top for top, _, _ in walked] == [f"{home}/a", f"{home}/a/b", f"{home}/a/b/c"]

    client.remove(f"{home}/a/link")
    client.rmdir(f"{home}/a/b/c")
    client.rmtree(f"{home}/a")
    assert client.listdir(home) == []


def test_stripes_say_where_the_data_lives(client, home):
    client.write_bytes(f"{home}/striped", payload(3 * MiB, 3))
    placement = client.stripes(f"{home}/striped")
    assert placement["size"] == 3 * MiB
    assert placement["replicas"] == 1
    objects = placement["objects"]
    assert len(objects) == placement["stripe_count"]
    assert sum(length for *_, length in objects) == 3 * MiB
    assert {server for _, server, _, up, _ in objects if up} <= {0, 1}
    stats = client.statfs()
    assert stats["servers_up"] == stats["servers_total"] == 2


def test_another_client_sees_a_closed_file(cluster, client, home):
    data = payload(2 * MiB + 3, 9)
    with freeflow.Client(cluster.cluster_file) as other:
        with client.open(f"{home}/shared", "wb") as f:
            f.write(data)
            f.fsync()
        assert other.read_bytes(f"{home}/shared") == data
        other.remove(f"{home}/shared")
    with pytest.raises(FileNotFoundError):
        client.stat(f"{home}/shared")


def test_threads_share_one_client(client, home):
    failures = []

    def work(n: int) -> None:
        try:
            data = payload(4 * MiB + n, 100 + n)
            with client.open(f"{home}/thread-{n}", "wb") as f:
                f.write(data)
            with client.open(f"{home}/thread-{n}", "rb") as f:
                if f.read() != data:
                    failures.append(f"thread {n} read other bytes")
        except Exception as error:  # reported below
            failures.append(f"thread {n}: {error!r}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert sorted(client.listdir(home)) == sorted(f"thread-{n}" for n in range(6))


def test_the_gil_is_released_while_a_call_waits(client, home):
    """Another Python thread runs while a large read is under way in the native module
    (with the GIL held it could not run a single bytecode until the call returned).

    Up to three reads: on two busy vCPUs the other thread may, once in a while, get no CPU
    for the middle of one (seen once in CI-like runs), which says nothing of the GIL; with
    the GIL held it could tick in the middle of none of them."""
    size = 128 * MiB
    client.write_bytes(f"{home}/big", payload(size, 11))
    seen = []
    for _attempt in range(3):
        ticks = []
        stop = threading.Event()

        def count() -> None:
            while not stop.is_set():
                ticks.append(time.perf_counter())

        with client.open(f"{home}/big", "rb", buffering=0) as f:
            counter = threading.Thread(target=count)
            counter.start()
            try:
                time.sleep(0.05)  # the counter is running
                start = time.perf_counter()
                data = f.read(size)  # one call into the native module
                end = time.perf_counter()
            finally:
                stop.set()
                counter.join()
        assert len(data) == size
        took = end - start
        print(f"a {size >> 20} MiB read took {took:.3f} s; {len(ticks)} ticks in all")
        assert took > 0.02, f"the read took only {took:.3f} s: too short to tell"
        # Held, the GIL would let the counter tick only at the edges of the call (until the
        # main thread took it back, one switch interval at most): look in the middle third.
        middle = [tick for tick in ticks if start + took / 3 < tick < end - took / 3]
        seen.append((took, len(middle)))
        if middle:
            break
    assert seen[-1][1] > 0, f"no tick of the other thread in the middle of any read: {seen}"


def test_flush_publishes_and_append_starts_at_the_end(cluster, client, home):
    with freeflow.Client(cluster.cluster_file) as other:
        with client.open(f"{home}/flushed", "wb") as f:
            f.write(b"x" * 1000)
            f.flush()  # no close: another client sees the bytes already
            assert other.stat(f"{home}/flushed").st_size == 1000
            assert other.read_bytes(f"{home}/flushed") == b"x" * 1000
        with client.open(f"{home}/flushed", "ab") as f:
            assert f.tell() == 1000
            f.write(b"y")
            assert f.tell() == 1001
        # A reader that opened before another client appended reads to the new end.
        with client.open(f"{home}/flushed", "rb") as reader:
            assert reader.read(10) == b"x" * 10
            with other.open(f"{home}/flushed", "ab") as appender:
                appender.write(b"MORE")
            assert reader.read() == b"x" * 990 + b"yMORE"


def test_copy_keeps_data_and_refuses_a_file_onto_itself(client, home):
    data = payload(3 * MiB + 5, 21)
    client.write_bytes(f"{home}/src", data)
    assert client.copy_file(f"{home}/src", f"{home}/dst") == len(data)
    assert client.read_bytes(f"{home}/dst") == data
    with pytest.raises(OSError) as same:
        client.copy_file(f"{home}/src", f"{home}/src")
    assert same.value.errno == errno.EINVAL
    assert client.read_bytes(f"{home}/src") == data
    client.link(f"{home}/src", f"{home}/alias")
    with pytest.raises(OSError):
        client.copy_file(f"{home}/src", f"{home}/alias")
    assert client.read_bytes(f"{home}/alias") == data
    assert not client.exists(f"{home}/src/below")  # through a file: False, as os.path
    with pytest.raises(FileNotFoundError) as both:
        client.rename(f"{home}/src", f"{home}/nowhere/dst")
    assert both.value.filename2 == f"{home}/nowhere/dst"


def test_a_forked_child_makes_its_own_client(cluster, client, home):
    client.write_bytes(f"{home}/before-fork", b"parent")
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            try:
                client.stat(f"{home}/before-fork")
                status = 2  # the parent's client must refuse
            except OSError as error:
                if "fork" in str(error):
                    with freeflow.Client(cluster.cluster_file) as own:
                        own.write_bytes(f"{home}/from-child", b"child")
                        if own.read_bytes(f"{home}/before-fork") == b"parent":
                            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.read_bytes(f"{home}/from-child") == b"child"


def test_a_client_left_open_ends_its_session_when_python_exits(cluster, client, home):
    # A script that lists a directory (a cache lease on it) and exits without close(), and
    # the same through fsspec's shared client: neither leaves a session at the meta server
    # (its leases would hold up every other client's change there until they ran out).
    before = cluster.meta_gauge("freeflow_meta_sessions")
    scripts = [
        f"import freeflow; c = freeflow.Client({cluster.cluster_file!r}); print(c.listdir({home!r}))",
        f"import fsspec; fs = fsspec.filesystem('ff'); print(fs.ls({home!r}))",
    ]
    for script in scripts:
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        assert cluster.meta_gauge("freeflow_meta_sessions") == before, script
