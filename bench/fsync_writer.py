"""The writer of the failover scripts (bench/failover.sh, bench/meta_failover.sh):
creates 64 KiB files with fsync in a loop under MNT (2,000 names, reused with O_TRUNC)
and logs the time each one was done, or ERROR with the time and the error, to LOG.

    python3 bench/fsync_writer.py MNT LOG
"""
import os
import sys
import time

mnt, log = sys.argv[1], sys.argv[2]
data = os.urandom(65536)
with open(log, "w", buffering=1) as out:
    i = 0
    while True:
        try:
            fd = os.open(f"{mnt}/f{i % 2000}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            os.write(fd, data)
            os.fsync(fd)
            os.close(fd)
            out.write(f"{time.time():.6f}\n")
        except OSError as error:
            out.write(f"ERROR {time.time():.6f} {error}\n")
        i += 1
