#!/usr/bin/env python3
"""Re-replication and rebalance throughput, and what they cost foreground work, in one run.

A cluster from `freeflow init` configs on this host (one meta server, I/O servers each on a
tmpfs of its own, as if on disks of their own; two copies of every stripe), a FUSE mount
and the library's `freeflow cp`:

1. baseline: foreground writes (`freeflow cp` of a file, MB/s) and creates through the
   mount (empty files, /s), with nothing moving;
2. re-replication: I/O server 1 killed for good; once the meta server declares it lost
   (`server_dead_after_ms`), the same foreground work runs while the stand-ins copy its
   stripes; the copy's bytes and time come from the stand-ins' logs (`fill done`);
3. rebalance: two servers added; the same foreground work while copies move to them.

Each figure is the median of `--repeats` runs; the costs are ratios to the baseline
measured in the same run. Needs root (tmpfs mounts) and /dev/fuse. Nothing else should run.

    python3 bench/rereplicate.py --binary target/release/freeflow --data-mib 2048
"""

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def run(*args, **kwargs):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kwargs)


def edit(path, replacements):
    text = open(path).read()
    for key, value in replacements.items():
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        if count != 1:
            sys.exit(f"{path}: no single `{key} =` line to set")
    open(path, "w").write(text)


class Cluster:
    def __init__(self, binary, root, io_servers, tmpfs_mib):
        self.binary, self.root = binary, root
        self.conf = os.path.join(root, "conf")
        run(binary, "init", "--out", self.conf, "--meta-host", "127.0.0.1",
            "--io-hosts", ",".join(["127.0.0.1"] * io_servers),
            "--key-path", os.path.join(self.conf, "cluster.key"),
            "--data-root", os.path.join(root, "data"), "--replicas", "2")
        edit(os.path.join(self.conf, "meta.toml"), {
            "server_down_after_ms": "3000",
            "server_dead_after_ms": "8000",
            "rebalance_min_bytes": str(64 << 20),
        })
        self.children, self.mounts = {}, []
        for index in range(io_servers):
            data = os.path.join(root, "data", f"io-{index}")
            os.makedirs(data)
            run("mount", "-t", "tmpfs", "-o", f"size={tmpfs_mib}m", "freeflow-bench", data)
            self.mounts.append(data)
        self.logs = {}

    def start(self, name, role, config):
        log = open(os.path.join(self.root, f"{name}.log"), "a")
        self.logs[name] = log.name
        self.children[name] = subprocess.Popen(
            [self.binary, role, "--config", os.path.join(self.conf, config)],
            stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "info"})

    def cli(self, *args):
        return run(self.binary, "--cluster", os.path.join(self.conf, "client.toml"), *args).stdout

    def wait(self, what, done, limit=600):
        deadline = time.time() + limit
        while time.time() < deadline:
            try:
                if done():
                    return
            except subprocess.CalledProcessError:
                pass  # not serving yet
            time.sleep(0.5)
        sys.exit(f"timed out waiting for {what}\n{self.cli('status')}")

    def stop(self):
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children.values():
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
        for data in self.mounts:
            subprocess.run(["umount", "-l", data])


def write_rate(cluster, source, mib, repeats):
    """Median MB/s of `freeflow cp` of `source` into the cluster."""
    rates = []
    for attempt in range(repeats):
        started = time.time()
        cluster.cli("cp", "--quiet", "--sync", source, f"ff:/fg-{time.time_ns()}")
        rates.append(mib * 1.048576 / (time.time() - started))
    return statistics.median(rates)


def create_rate(mount, seconds, repeats):
    """Median creates/s of empty files through the mount."""
    rates = []
    for attempt in range(repeats):
        directory = os.path.join(mount, f"creates-{time.time_ns()}")
        os.mkdir(directory)
        count, started = 0, time.time()
        while time.time() - started < seconds:
            os.close(os.open(os.path.join(directory, f"f{count}"), os.O_CREAT | os.O_WRONLY, 0o644))
            count += 1
        rates.append(count / (time.time() - started))
    return statistics.median(rates)


def fills(cluster, servers):
    """(bytes, longest elapsed ms) of the `fill done` lines in these servers' logs."""
    total, longest = 0, 0
    for server in servers:
        for line in open(cluster.logs[f"io-{server}"]):
            found = re.search(r"fill done.*bytes=(\d+) elapsed_ms=(\d+)", line)
            if found:
                total += int(found.group(1))
                longest = max(longest, int(found.group(2)))
    return total, longest


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", default="target/release/freeflow")
    parser.add_argument("--data-mib", type=int, default=2048, help="files written before the changes")
    parser.add_argument("--file-mib", type=int, default=64, help="size of each file and of a foreground write")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--create-seconds", type=float, default=2.0)
    args = parser.parse_args()
    binary = os.path.abspath(args.binary)
    root = tempfile.mkdtemp(prefix="freeflow-rerep-")
    # Room for the data's two copies spread over three servers, then over two.
    tmpfs_mib = args.data_mib * 2 // 2 + 2048
    cluster = Cluster(binary, root, 5, tmpfs_mib)
    try:
        cluster.start("meta", "meta", "meta.toml")
        for index in range(3):
            cluster.start(f"io-{index}", "io", f"io-{index}.toml")
        cluster.wait("three I/O servers", lambda: cluster.cli("status").count(" up ") >= 3)
        mount = os.path.join(root, "mnt")
        os.mkdir(mount)
        cluster.children["mount"] = subprocess.Popen(
            [binary, "mount", os.path.join(cluster.conf, "client.toml"), mount],
            stdout=open(os.path.join(root, "mount.log"), "w"), stderr=subprocess.STDOUT)
        cluster.wait("the mount", lambda: os.path.ismount(mount))
        source = os.path.join(root, "source")
        with open(source, "wb") as out:
            out.write(os.urandom(args.file_mib << 20))
        for index in range(args.data_mib // args.file_mib):
            cluster.cli("cp", "--quiet", source, f"ff:/data-{index}")
        figures = {}
        figures["baseline"] = (write_rate(cluster, source, args.file_mib, args.repeats),
                               create_rate(mount, args.create_seconds, args.repeats))

        # A server lost for good: its stripes are copied again while the foreground runs.
        cluster.children["io-1"].kill()
        cluster.wait("server 1 lost", lambda: "lost for good" in cluster.cli("status"))
        started = time.time()
        figures["re-replication"] = (write_rate(cluster, source, args.file_mib, args.repeats),
                                     create_rate(mount, args.create_seconds, args.repeats))
        cluster.wait("the copies made again", lambda: "every copy made again" in cluster.cli("status"))
        copied, longest = fills(cluster, [0, 2])
        rerep = (copied, longest, time.time() - started)

        # Two servers added: copies move to them while the foreground runs.
        for index in (3, 4):
            cluster.start(f"io-{index}", "io", f"io-{index}.toml")
        cluster.wait("a rebalance", lambda: "rebalanced" in cluster.cli("status"), limit=120)
        started = time.time()
        figures["rebalance"] = (write_rate(cluster, source, args.file_mib, args.repeats),
                                create_rate(mount, args.create_seconds, args.repeats))
        status = lambda: cluster.cli("status")
        cluster.wait("the rebalance to end", lambda: "still copying" not in status()
                     and "switch once" not in status())
        moved, longest_move = fills(cluster, [3, 4])
        balance = (moved, longest_move, time.time() - started)
        final = cluster.cli("status")
    finally:
        cluster.stop()
        if os.path.ismount(os.path.join(root, "mnt")):
            subprocess.run(["umount", "-l", os.path.join(root, "mnt")])

    base_write, base_create = figures["baseline"]
    print(f"data {args.data_mib} MiB in {args.file_mib} MiB files, two copies; medians of {args.repeats}")
    print(f"{'phase':<16} {'write MB/s':>11} {'ratio':>6} {'creates/s':>10} {'ratio':>6}")
    for phase, (write, create) in figures.items():
        print(f"{phase:<16} {write:>11.0f} {write / base_write:>6.2f} {create:>10.0f} {create / base_create:>6.2f}")
    for name, (copied, longest, _) in (("re-replication", rerep), ("rebalance", balance)):
        rate = copied / 1e6 / (longest / 1000) if longest else 0
        print(f"{name}: {copied / 2**20:.0f} MiB copied by the stand-ins, the longest fill "
              f"{longest / 1000:.1f} s ({rate:.0f} MB/s for it)")
    print(final)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
