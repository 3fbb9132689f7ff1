#!/usr/bin/env python3
"""Cached reads through `cfmo-pull mount --lazy`, alternating builds.

Each trial mounts LAZY_DIR (a lazy pull whose span cache holds every span,
e.g. after reading every file once through a mount) at a new mount point
with each cfmo-pull given, reads every file (or RANDOM 4 KiB preads at
seeded offsets) through it, unmounts, then reads the same files of ROOTFS
(a full pull's rootfs, page cache warm). Prints the median and best
throughput of each, the CPU seconds of the reader and of the mount's
daemon (load-independent, unlike the times), and the daemon's largest
VmHWM.

    bench/lazy_reads.py LAZY_DIR ROOTFS NAME=CFMO_PULL [NAME=CFMO_PULL...]
        env: TRIALS=5  READER=readv (128 KiB readv into one buffer) | cat
             (find | xargs cat | wc -c, as bench/pull_lazy.sh) | random

Run as root. On a loaded machine the times swing by 3x from one trial to
the next; `chrt -f 10 bench/lazy_reads.py ...` runs the reader and (by
inheritance) the daemon ahead of the other load, which approximates a quiet
machine for the few seconds each trial takes.
"""
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import time


def files(root):
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names)


def read_all(root, reader):
    before = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    total = 0
    if reader == "cat":
        out = subprocess.run(f"cd {root} && find . -type f -print0 | xargs -0 cat | wc -c", shell=True,
                             capture_output=True, text=True, check=True).stdout
        total = int(out)
    elif reader == "random":
        names = [f for f in files(root) if os.path.getsize(f) > 4096]
        rng = random.Random(17)
        picks = []
        for _ in range(int(os.environ.get("RANDOM_READS", "20000"))):
            f = rng.randrange(len(names))
            picks.append((f, rng.randrange(os.path.getsize(names[f]) - 4096)))
        start = time.monotonic()
        fds = {}
        for f, at in picks:
            if f not in fds:
                fds[f] = os.open(names[f], os.O_RDONLY)
            total += len(os.pread(fds[f], 4096, at))
        for fd in fds.values():
            os.close(fd)
    else:
        buf = bytearray(128 << 10)
        for name in files(root):
            fd = os.open(name, os.O_RDONLY)
            while (n := os.readv(fd, [buf])) > 0:
                total += n
            os.close(fd)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime + children_after.ru_utime -
           children.ru_utime + children_after.ru_stime - children.ru_stime)
    return seconds, total, cpu


def daemon_cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_hwm_mb(pid):
    line = next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    lazy, rootfs = sys.argv[1], sys.argv[2]
    builds = dict(arg.split("=", 1) for arg in sys.argv[3:])
    reader = os.environ.get("READER", "readv")
    point = os.path.join(lazy, "..", "lazy-reads-mnt")
    os.makedirs(point, exist_ok=True)
    point = os.path.realpath(point)
    results = {}
    subprocess.run(f"cat {lazy}/cfmo-lazy-cache/*/* >/dev/null", shell=True)  # the span files in the page cache
    read_all(rootfs, reader)
    total = 0
    try:
        for trial in range(int(os.environ.get("TRIALS", "5"))):
            for name, pull in builds.items():
                subprocess.run([pull, "mount", lazy, point, "--lazy", "--max-memory", "64M", "--cache-size", "4G", "-q"],
                               check=True)
                line = next(l for l in open("/proc/self/mountinfo") if f" {point} " in l)
                pid = int(re.search(r"cfmo-pull@(\d+)", line).group(1))
                seconds, total, cpu = read_all(point, reader)
                daemon = daemon_cpu(pid)
                hwm = daemon_hwm_mb(pid)
                subprocess.run([pull, "umount", point, "-q"], check=True)
                results.setdefault(name, []).append((seconds, cpu, daemon, hwm))
            seconds, total, cpu = read_all(rootfs, reader)
            results.setdefault("local", []).append((seconds, cpu, 0.0, 0.0))
            load = open("/proc/loadavg").read().split()[0]
            print(f"trial {trial}: " + ", ".join(f"{k} {v[-1][0]:.3f} s" for k, v in results.items()) + f"; load {load}",
                  flush=True)
    finally:
        subprocess.run(["umount", "-l", point], stderr=subprocess.DEVNULL)
        os.rmdir(point)
    mb = total / 1048576
    local = statistics.median(r[0] for r in results["local"])
    for name, runs in results.items():
        times = [r[0] for r in runs]
        print(f"{name:8s} median {mb / statistics.median(times):6.0f} MB/s ({local / statistics.median(times):.2f}x local)"
              f"  best {mb / min(times):6.0f} MB/s  reader CPU {statistics.median(r[1] for r in runs):.2f} s"
              f"  daemon CPU {statistics.median(r[2] for r in runs):.2f} s"
              f"  daemon VmHWM {max(r[3] for r in runs):.0f} MB")


if __name__ == "__main__":
    main()
