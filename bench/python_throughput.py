#!/usr/bin/env python3
"""Sequential throughput of the Python package against the mount of the same cluster.

    python3 bench/python_throughput.py CLUSTER_FILE MOUNTPOINT [--size-mib 1024] [--rounds 3]

Each round writes a file of SIZE through `freeflow.Client` and another through the mount
(plain Python file I/O, 8 MiB calls), each ended by fsync, then reads both back after
dropping the page cache (root only; otherwise the reads are warm and the report says so).
The two ways alternate within a round so the machine's drift hits both alike. Prints
medians in MB/s and the ratio library / mount.
"""

import argparse
import os
import statistics
import time

import freeflow

CHUNK = 8 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_library(client, path, size, block):
    start = time.perf_counter()
    with client.open(path, "wb", buffering=0) as f:
        done = 0
        while done < size:
            done += f.write(block)
        f.fsync()
    return time.perf_counter() - start


def write_mount(path, size, block):
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < size:
            done += f.write(block)
        os.fsync(f.fileno())
    return time.perf_counter() - start


def read_into(f, size):
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    done = 0
    while True:
        n = f.readinto(view)
        if not n:
            break
        done += n
    if done != size:
        raise SystemExit(f"read {done} bytes, expected {size}")


def read_library(client, path, size):
    start = time.perf_counter()
    with client.open(path, "rb", buffering=0) as f:
        read_into(f, size)
    return time.perf_counter() - start


def read_mount(path, size):
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        read_into(f, size)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cluster")
    parser.add_argument("mountpoint")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = args.size_mib << 20
    block = os.urandom(CHUNK)
    client = freeflow.Client(args.cluster)
    client.makedirs("/pybench", exist_ok=True)
    rates = {"write library": [], "write mount": [], "read library": [], "read mount": []}
    cold = True
    for round_ in range(args.rounds):
        lib_path, mnt_name = f"/pybench/lib-{round_}", f"pybench/mnt-{round_}"
        mnt_path = os.path.join(args.mountpoint, mnt_name)
        order = [("library", lambda: write_library(client, lib_path, size, block)),
                 ("mount", lambda: write_mount(mnt_path, size, block))]
        if round_ % 2:
            order.reverse()
        for name, run in order:
            rates[f"write {name}"].append(size / run() / 1e6)
        order = [("library", lambda: read_library(client, lib_path, size)),
                 ("mount", lambda: read_mount(mnt_path, size))]
        if round_ % 2:
            order.reverse()
        for name, run in order:
            cold &= drop_caches()
            rates[f"read {name}"].append(size / run() / 1e6)
        client.remove(lib_path)
        os.remove(mnt_path)
    client.rmdir("/pybench")
    print(f"{args.size_mib} MiB, {args.rounds} rounds, reads {'cold (page cache dropped)' if cold else 'WARM (not root)'}")
    for kind in ("write", "read"):
        library = statistics.median(rates[f"{kind} library"])
        mount = statistics.median(rates[f"{kind} mount"])
        runs = ", ".join(f"{r:.0f}" for r in rates[f"{kind} library"])
        mruns = ", ".join(f"{r:.0f}" for r in rates[f"{kind} mount"])
        print(f"{kind:5}  library {library:7.0f} MB/s [{runs}]  mount {mount:7.0f} MB/s [{mruns}]  ratio {library / mount:.2f}x")
    client.close()


if __name__ == "__main__":
    main()
