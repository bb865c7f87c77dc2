#!/usr/bin/env python3
"""N-to-1 records through two mounts of one cluster.

Record i (of N, each R bytes, an unaligned size) is written through mount i % 2 by one of
three processes per mount, records in random order, each in random pieces, with an fsync
now and then; then every byte of the file is checked. Two hosts' records meet and take
turns inside pages, which is what a writeback mount's whole-page write-back can lose
(docs/consistency.md, "Concurrent writers").

    python3 bench/n_to_1_records.py MOUNT_A/file MOUNT_B/file [R] [N] [SEED]

Exit status 1 if a record or the size is wrong.
"""
import multiprocessing
import os
import random
import sys

PROCESSES_PER_MOUNT = 3


def content(index, length):
    return bytes((index * 7 + k) % 251 + 1 for k in range(length))


def writer(paths, mount, process, length, count, seed):
    rng = random.Random(seed)
    fd = os.open(paths[mount], os.O_RDWR)
    mine = [
        i for i in range(count)
        if i % 2 == mount and (i // 2) % PROCESSES_PER_MOUNT == process
    ]
    rng.shuffle(mine)
    for index in mine:
        data, done = content(index, length), 0
        while done < length:
            piece = rng.randint(1, length - done)
            os.pwrite(fd, data[done:done + piece], index * length + done)
            done += piece
        if rng.random() < 0.05:
            os.fsync(fd)
    os.close(fd)


def main():
    paths = sys.argv[1:3]
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 4000
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    os.close(os.open(paths[0], os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o644))
    processes = [
        multiprocessing.Process(
            target=writer,
            args=(paths, mount, process, length, count, seed * 100 + mount * 10 + process),
        )
        for mount in (0, 1)
        for process in range(PROCESSES_PER_MOUNT)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    with open(paths[0], "rb") as file:
        got = file.read()
    wrong = [
        i for i in range(count)
        if got[i * length:(i + 1) * length] != content(i, length)
    ]
    print(f"size {len(got)} of {count * length}; records wrong: {len(wrong)} of {count}",
          wrong[:10])
    sys.exit(1 if wrong or len(got) != count * length else 0)


if __name__ == "__main__":
    main()
