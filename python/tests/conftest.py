"""A real cluster for the tests: `freeflow up` (one meta server, two I/O servers) in its
own process on free loopback ports, stopped with Ctrl-C at the end of the session.

The binary is $FREEFLOW_BIN, else the workspace's target/debug or target/release build,
else `freeflow` on PATH.
"""

import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import threading
import urllib.request
import uuid

import pytest

import freeflow

REPO = pathlib.Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 60


def _binary() -> str:
    named = os.environ.get("FREEFLOW_BIN")
    if named:
        return named
    for profile in ("debug", "release"):
        built = REPO / "target" / profile / "freeflow"
        if built.exists():
            return str(built)
    found = shutil.which("freeflow")
    if found is None:
        pytest.exit("no freeflow binary: build it (cargo build) or set FREEFLOW_BIN", returncode=2)
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> int:
    """A meta port whose I/O ports (port + 10, + 11) and metrics ports (port + 1 for the
    meta server, + 100 and + 101 for the I/O servers) are free too."""
    for _ in range(100):
        port = random.randrange(20000, 40000, 200)
        if all(_free(p) for p in (port, port + 1, port + 10, port + 11, port + 100, port + 101)):
            return port
    raise RuntimeError("no free ports for a cluster")


class Cluster:
    def __init__(self, data: pathlib.Path) -> None:
        self.data = data
        self.process = None
        self.log = []
        self.port = 0

    def start(self) -> None:
        port = _ports()
        self.port = port
        self.process = subprocess.Popen(
            [_binary(), "up", "--data", str(self.data), "--port", str(port), "--io-servers", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = threading.Event()

        def follow() -> None:
            for line in self.process.stdout:
                self.log.append(line)
                if "Freeflow is up" in line:
                    ready.set()

        threading.Thread(target=follow, daemon=True).start()
        if not ready.wait(UP_TIMEOUT_S) or self.process.poll() is not None:
            self.stop()
            raise RuntimeError("freeflow up did not come up:\n" + "".join(self.log))

    @property
    def cluster_file(self) -> str:
        return str(self.data / "client.toml")

    def meta_gauge(self, name: str) -> float:
        """A gauge of the meta server's metrics endpoint (docs/metrics.md)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port + 1}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"no {name} in the meta server's metrics")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("cluster") / "data")
    running.start()
    os.environ["FREEFLOW_CLUSTER"] = running.cluster_file
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(cluster):
    with freeflow.Client(cluster.cluster_file) as connected:
        yield connected


@pytest.fixture
def home(client):
    """A fresh directory for one test."""
    path = f"/t-{uuid.uuid4().hex[:12]}"
    client.mkdir(path)
    return path
