"""Encode and rebuild throughput of baft's erasure coding (zfec Reed–Solomon) on this machine.

    python experiments/erasure_throughput.py [--sizes 64,128,256] [--codes 1/2,2/3,3/4,4/6] [--runs 5]

For each snapshot bundle size and code k/n: encode = ``baft.erasure.encode`` of the bundle into
n shares; rebuild = ``baft.erasure.decode`` from the worst surviving set (the n-k lost shares
are data shares, so the most parity must be inverted) plus the bundle checksum that proves it.
Throughput is bundle bytes per second of wall time, median of ``--runs`` runs, one thread.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np
import zfec

from baft import erasure


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure(size: int, k: int, n: int, runs: int) -> tuple[float, float]:
    data = np.random.default_rng(size + k * 1000 + n).bytes(size)
    want = erasure.bundle_checksum(data)
    encode_times, rebuild_times = [], []
    for _ in range(runs):
        began = time.perf_counter()
        shares = erasure.encode(data, k, n)
        encode_times.append(time.perf_counter() - began)
        survivors = {i: shares[i] for i in range(n - k, n)}
        del shares
        began = time.perf_counter()
        rebuilt = erasure.decode(survivors, k, n, size)
        ok = erasure.bundle_checksum(rebuilt) == want
        rebuild_times.append(time.perf_counter() - began)
        if not ok:
            raise SystemExit(f"rebuild of {size} bytes with k={k}, n={n} is not bit for bit")
        del survivors, rebuilt
    return size / statistics.median(encode_times) / 1e9, size / statistics.median(rebuild_times) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,128,256", help="bundle sizes in MB")
    parser.add_argument("--codes", default="1/2,2/3,3/4,4/6", help="k/n pairs")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    codes = [tuple(int(x) for x in c.split("/")) for c in args.codes.split(",")]

    print(f"# baft erasure throughput, {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
          f"python {platform.python_version()}, zfec {zfec.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print(f"# median of {args.runs} runs, single thread; rebuild from the n-k parity-heaviest survivors + checksum; "
          f"k=1 is replication (copies, no Reed-Solomon)")
    print()
    print(f"| {'k/n':>5} | {'lost':>4} | {'memory x':>8} | {'bundle':>7} | {'encode GB/s':>11} | {'rebuild GB/s':>12} |")
    print(f"|{'-' * 7}|{'-' * 6}|{'-' * 10}|{'-' * 9}|{'-' * 13}|{'-' * 14}|")
    for k, n in codes:
        for size in sizes:
            enc, reb = measure(size, k, n, args.runs)
            print(f"| {f'{k}/{n}':>5} | {n - k:>4} | {n / k:>8.2f} | {size >> 20:>4} MB | {enc:>11.2f} | {reb:>12.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
