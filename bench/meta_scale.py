#!/usr/bin/env python3
"""Replicated metadata at scale (issue 42): three members under Raft and one I/O server from
`freeflow init` configs on this host; N empty files made through the Python package (many
threads: its calls release the GIL); then

- each member's resident memory (VmRSS) and its peak (VmHWM);
- a follower rebuilt from an empty disk: killed, its data removed, started again as a new
  member (a new id, `join = true`, `freeflow meta add --learner`, then `meta replace`); the time
  until the leader reports it in step, the leader's peak memory meanwhile (VmHWM reset
  through /proc/PID/clear_refs first), and whether it installed a snapshot;
- a follower's start-up: stopped with SIGTERM, started again, the time until the leader
  reports it in step again.

Usage: bench/meta_scale.py --files 1000000 [--dir /var/tmp/meta-scale] [--threads 32]
       [--freeflow target/release/freeflow] [--sample SECONDS] [--create-only]
       [--wrap 'N=heaptrack -o /var/tmp/meta-heap'] [--member-env 'N=MALLOC_ARENA_MAX=2']
`--sample` prints every member's resident memory that often while the files are made;
`--wrap` starts member N under a profiler, `--member-env` with extra environment (to compare
members of one run); `--create-only` stops after the files are made and measured.
Run it alone on the machine (it measures memory and times). The figures it prints go into a
note; nothing here is asserted.
"""

import argparse
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

FILES_PER_DIRECTORY = 10_000


def memory_kib(pid):
    """(VmRSS, VmHWM) of a process, KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def mib(kib):
    return f"{kib / 1024:.0f} MiB"


class Member:
    def __init__(self, freeflow, directory, index, wrap=(), env=None):
        self.wrap = list(wrap)
        self.env = dict(env or {})
        self.freeflow = freeflow
        self.index = index
        self.config = os.path.join(directory, f"meta-{index}.toml")
        self.log = os.path.join(directory, f"meta-{index}.log")
        self.data = os.path.join(directory, "data", f"meta-{index}")
        self.process = None

    def start(self):
        log = open(self.log, "a")
        self.process = subprocess.Popen(
            [*self.wrap, self.freeflow, "meta", "--config", self.config],
            stdout=log,
            stderr=log,
            env={**os.environ, "RUST_LOG": "info,openraft=warn", "NO_COLOR": "1", **self.env},
        )

    @property
    def pid(self):
        """The member's own process (under `--wrap`, a child of the wrapper's)."""
        if not self.wrap:
            return self.process.pid
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    words = cmdline.read().split(b"\0")
            except OSError:
                continue
            if words[0] == self.freeflow.encode() and self.config.encode() in words:
                return int(entry)
        return self.process.pid

    def kill(self):
        self.process.kill()
        self.process.wait()

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)

    def log_text(self):
        with open(self.log, errors="replace") as log:
            return log.read()


NEW_ID = 4


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rebuilt_as_new_member(freeflow, old, new_id):
    """A config for member `new_id` in place of `old` (new ports, `join = true`)."""
    directory = os.path.dirname(old.config)
    with open(old.config) as text:
        config = text.read()
    member = Member(freeflow, directory, new_id)
    member.address = f"127.0.0.1:{free_port()}"
    member.raft_address = f"127.0.0.1:{free_port()}"
    config = re.sub(r"(?m)^node_id = \d+$", f"node_id = {new_id}", config)
    config = re.sub(r"(?m)^join = \w+\n", "", config)
    config = config.replace("[meta]\n", "[meta]\njoin = true\n", 1)
    config = re.sub(r'(?m)^listen_address = ".*"$', f'listen_address = "{member.address}"', config)
    config = re.sub(r'(?m)^data_dir = ".*"$', f'data_dir = "{member.data}"', config)
    config += (
        f'\n[[meta.peers]]\nid = {new_id}\naddress = "{member.address}"\n'
        f'raft_address = "{member.raft_address}"\n'
    )
    with open(member.config, "w") as text:
        text.write(config)
    return member


def status(freeflow, client_toml):
    """The members as `freeflow status` lists them: {id: (role, behind text)}."""
    out = subprocess.run(
        [freeflow, "--cluster", client_toml, "status"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    members = {}
    for line in out.splitlines():
        match = re.match(r"^(\d+)\s+\S+\s+(leader|follower|learner)\s+\d+\s+(.*)$", line)
        if match:
            members[int(match.group(1))] = (match.group(2), match.group(3).strip())
    return members


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, required=True)
    parser.add_argument("--dir", default="/var/tmp/meta-scale")
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--freeflow", default="target/release/freeflow")
    parser.add_argument("--rebuild-wait", type=float, default=3600, help="seconds")
    parser.add_argument("--sample", type=float, default=0, help="seconds between samples")
    parser.add_argument("--create-only", action="store_true")
    parser.add_argument("--wrap", action="append", default=[], help="N=COMMAND")
    parser.add_argument("--member-env", action="append", default=[], help="N=NAME=VALUE")
    args = parser.parse_args()
    wraps = {int(n): command.split() for n, command in (w.split("=", 1) for w in args.wrap)}
    envs = {}
    for item in args.member_env:
        n, name, value = item.split("=", 2)
        envs.setdefault(int(n), {})[name] = value
    import freeflow as ff

    freeflow = os.path.abspath(args.freeflow)
    directory = os.path.abspath(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    subprocess.run(
        [
            freeflow, "init", "--out", directory,
            "--meta-host", "127.0.0.1,127.0.0.1,127.0.0.1",
            "--io-hosts", "127.0.0.1",
            "--key-path", os.path.join(directory, "cluster.key"),
            "--data-root", os.path.join(directory, "data"),
        ],
        check=True,
        capture_output=True,
    )
    client_toml = os.path.join(directory, "client.toml")
    members = [
        Member(freeflow, directory, index, wraps.get(index, ()), envs.get(index))
        for index in (1, 2, 3)
    ]
    for member in members:
        member.start()
    io_log = open(os.path.join(directory, "io-0.log"), "a")
    io = subprocess.Popen(
        [freeflow, "io", "--config", os.path.join(directory, "io-0.toml")],
        stdout=io_log,
        stderr=io_log,
    )
    try:
        run(args, ff, freeflow, client_toml, members)
    finally:
        for member in members:
            if member.process and member.process.poll() is None:
                member.kill()
        io.kill()
        io.wait()


def run(args, ff, freeflow, client_toml, members):
    client = None
    for attempt in range(100):
        try:
            client = ff.Client(client_toml)
            client.mkdir("/scale", 0o755)
            break
        except OSError as error:
            client = None
            if attempt == 99:
                sys.exit(f"no client could connect: {error}")
            time.sleep(0.2)
    if client is None:
        sys.exit("no client could connect")
    for _ in range(100):
        out = subprocess.run(
            [freeflow, "--cluster", client_toml, "status"], capture_output=True, text=True
        ).stdout
        if "1 of 1 I/O servers up" in out:
            break
        time.sleep(0.2)
    directories = (args.files + FILES_PER_DIRECTORY - 1) // FILES_PER_DIRECTORY
    for index in range(directories):
        client.mkdir(f"/scale/d{index}", 0o755)
    made = [0]
    lock = threading.Lock()

    def make(first):
        end = min(first + FILES_PER_DIRECTORY // 10, args.files)
        for index in range(first, end):
            with client.open(f"/scale/d{index // FILES_PER_DIRECTORY}/f{index}", "xb"):
                pass
        with lock:
            made[0] += end - first

    def sample(done):
        while not done.wait(args.sample):
            with lock:
                count = made[0]
            line = ", ".join(f"{m.index}: {mib(memory_kib(m.pid)[0])}" for m in members)
            print(f"{time.monotonic() - started:.0f} s, {count} files: {line}", flush=True)

    done = threading.Event()
    started = time.monotonic()
    if args.sample > 0:
        threading.Thread(target=sample, args=(done,), daemon=True).start()
    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(make, range(0, args.files, FILES_PER_DIRECTORY // 10)))
    done.set()
    elapsed = time.monotonic() - started
    print(f"made {made[0]} files in {elapsed:.0f} s ({made[0] / elapsed:.0f}/s)")
    time.sleep(3)
    for member in members:
        rss, peak = memory_kib(member.pid)
        print(f"member {member.index}: resident {mib(rss)}, peak {mib(peak)}")
    if args.create_only:
        for member in members:
            os.kill(member.pid, signal.SIGTERM)
        for member in members:
            member.process.wait(timeout=600)
        return

    listed = status(freeflow, client_toml)
    leader = next(i for i, (role, _) in listed.items() if role == "leader")
    follower = next(m for m in members if m.index != leader)
    leading = next(m for m in members if m.index == leader)
    reset_peak(leading.pid)
    follower.kill()
    shutil.rmtree(follower.data)
    # A member that lost its disk comes back under a new id, as a learner (docs/operations.md).
    old_index = follower.index
    follower = rebuilt_as_new_member(freeflow, follower, NEW_ID)
    members.append(follower)
    started = time.monotonic()
    follower.start()
    subprocess.run(
        [
            freeflow, "--cluster", client_toml, "meta", "add", str(NEW_ID), "--learner",
            "--address", follower.address, "--raft-address", follower.raft_address,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    caught_up = None
    while time.monotonic() - started < args.rebuild_wait:
        if follower.process.poll() is not None:
            sys.exit(f"member {follower.index} stopped:\n{follower.log_text()[-2000:]}")
        behind = status(freeflow, client_toml).get(follower.index, ("", ""))[1]
        if behind == "in step" and time.monotonic() - started > 2:
            caught_up = time.monotonic() - started
            break
        time.sleep(0.5)
    if caught_up:
        subprocess.run(
            [freeflow, "--cluster", client_toml, "meta", "replace", str(old_index), str(NEW_ID)],
            check=True,
            capture_output=True,
            timeout=600,
        )
    rss, peak = memory_kib(leading.pid)
    snapshot = "installed a snapshot" in follower.log_text()
    print(
        f"member {follower.index} rebuilt from empty: "
        + (
            f"in step after {caught_up:.1f} s"
            if caught_up
            else f"NOT in step after {args.rebuild_wait:.0f} s"
        )
        + f", snapshot installed: {snapshot}; the leader meanwhile: peak {mib(peak)}, "
        f"now {mib(rss)}"
    )
    rss, peak = memory_kib(follower.pid)
    print(f"member {follower.index} after its rebuild: resident {mib(rss)}, peak {mib(peak)}")

    follower.stop()
    started = time.monotonic()
    follower.start()
    again = None
    while time.monotonic() - started < 600:
        behind = status(freeflow, client_toml).get(follower.index, ("", ""))[1]
        # The leader's view lags a heartbeat: wait for it to see the member gone first.
        if behind == "in step" and time.monotonic() - started > 1:
            again = time.monotonic() - started
            break
        time.sleep(0.1)
    print(f"member {follower.index} stopped and started again: in step after {again} s")


if __name__ == "__main__":
    main()
