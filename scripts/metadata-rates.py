#!/usr/bin/env python3
"""Create, stat and unlink rates of N files in one directory from P processes.

Usage: metadata-rates.py DIRECTORY FILE_COUNT PROCESSES
Each run works in a fresh subdirectory (ext4 creates slowly right after mass deletes in a
reused directory). Prints one line: creates/s stats/s unlinks/s.
"""
import multiprocessing
import os
import sys
import time


def phase(job):
    operation, directory, first, count = job
    for index in range(first, first + count):
        path = os.path.join(directory, "f%07d" % index)
        if operation == "create":
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        elif operation == "stat":
            os.stat(path)
        else:
            os.unlink(path)


def main():
    base, count, processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    directory = os.path.join(base, "rates-%d-%d" % (os.getpid(), time.monotonic_ns()))
    os.mkdir(directory)
    share = count // processes
    rates = []
    with multiprocessing.Pool(processes) as pool:
        for operation in ("create", "stat", "unlink"):
            jobs = [(operation, directory, worker * share, share) for worker in range(processes)]
            started = time.monotonic()
            pool.map(phase, jobs)
            rates.append(share * processes / (time.monotonic() - started))
    os.rmdir(directory)
    print("%.0f %.0f %.0f" % tuple(rates))


if __name__ == "__main__":
    main()
