#!/usr/bin/env python3
"""Listing rate of directories: os.listdir of each directory under a base, timed per pass.

    list_rate.py make BASE DIRS NAMES   make DIRS directories of NAMES empty files each
    list_rate.py BASE [PASSES] [--cold] list every directory of BASE, PASSES times

With --cold the kernel's page cache (where it keeps listings it read) is dropped before
each pass (needs root), so each pass is a first listing; without it the second pass on
shows what the kernel kept. Prints entries per second of each pass.
"""

import os
import sys
import time


def make(base, dirs, names):
    os.makedirs(base, exist_ok=True)
    for d in range(dirs):
        path = os.path.join(base, f"d{d:05d}")
        os.mkdir(path)
        for n in range(names):
            with open(os.path.join(path, f"f{n:07d}"), "x"):
                pass


def passes(base, count, cold):
    directories = sorted(os.path.join(base, name) for name in os.listdir(base))
    for round_ in range(count):
        if cold:
            with open("/proc/sys/vm/drop_caches", "w") as drop:
                drop.write("1")
        started = time.perf_counter()
        entries = sum(len(os.listdir(path)) for path in directories)
        elapsed = time.perf_counter() - started
        print(
            f"pass {round_ + 1}: {entries} entries in {len(directories)} directories, "
            f"{elapsed * 1e3:.2f} ms, {entries / elapsed:,.0f}/s"
        )


def main(argv):
    if len(argv) == 5 and argv[1] == "make":
        make(argv[2], int(argv[3]), int(argv[4]))
        return 0
    args = [arg for arg in argv[1:] if arg != "--cold"]
    if len(args) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    passes(args[0], int(args[1]) if len(args) == 2 else 4, "--cold" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
