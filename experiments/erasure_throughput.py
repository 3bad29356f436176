"""Encode and rebuild throughput of baft's erasure coding across nodes, on this machine.

    python experiments/erasure_throughput.py [--sizes 64,128,256] [--codes 1/2,2/3,3/4,4/6] [--runs 5]

A node snapshot of SIZE MB (two ranks, 1 MB chunks with their checksums, as the manager sees
them in shared memory) is coded with each k/n:

* encode   ``baft.manager.erasure.encode`` of the bundle into n shares;
* rebuild  ``baft.manager.erasure.decode`` from the worst surviving set: the n-k lost shares are data
           shares, so the most parity must be inverted;
* node→shares     what the manager does per commit: pack the ranks into a bundle, encode;
* shares→verified what a rebuild does: decode, then check every chunk's checksum.

Throughput is snapshot bytes per second of wall time, median of ``--runs`` runs, one thread.
k=1 is replication (the shares are the bundle), n=k+1 XOR parity (numpy), else Reed–Solomon (zfec).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import zfec

from baft.manager import erasure
from baft.snapshot.layout import CommitRecord, TensorEntry, checksum, plan_layout
from common import provenance


def node_snapshot(size: int) -> list[tuple[CommitRecord, np.ndarray]]:
    out = []
    for rank in (0, 1):
        nbytes = size // 2
        layout = plan_layout([TensorEntry("w", "float32", (nbytes // 4,), nbytes // 4 * 4, "parameters")])
        buffer = np.frombuffer(np.random.default_rng(rank).bytes(layout.nbytes), dtype=np.uint8)
        sums = [checksum(buffer[c.offset:c.offset + c.nbytes]) for c in layout.chunks]
        out.append((CommitRecord(1, rank, rank, layout, sums), buffer))
    return out


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(snapshots, k: int, n: int, runs: int) -> tuple[float, float, float, float]:
    size = sum(r.layout.nbytes for r, _ in snapshots)
    bundle = erasure.pack_bundle(0, 1, snapshots)
    lost = range(n - k)
    times = {"encode": [], "rebuild": [], "pack+encode": [], "decode+verify": []}
    for _ in range(runs):
        times["encode"].append(timed(lambda: erasure.encode(bundle, k, n)))
        shares = erasure.encode(bundle, k, n)
        survivors = {i: s for i, s in enumerate(shares) if i not in lost}
        times["rebuild"].append(timed(lambda: erasure.decode(survivors, k, n, len(bundle))))
        times["pack+encode"].append(timed(lambda: erasure.encode(erasure.pack_bundle(0, 1, snapshots), k, n)))
        times["decode+verify"].append(timed(lambda: erasure.unpack_bundle(erasure.decode(survivors, k, n, len(bundle)))))
        rebuilt = erasure.decode(survivors, k, n, len(bundle))
        if erasure.bundle_checksum(rebuilt) != erasure.bundle_checksum(bundle):
            raise SystemExit(f"rebuild with k={k}, n={n} is not bit for bit")
    return tuple(size / statistics.median(t) / 1e9 for t in times.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,128,256", help="node snapshot sizes in MB")
    parser.add_argument("--codes", default="1/2,2/3,3/4,4/6", help="k/n pairs")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) << 20 for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: expected whole megabytes, like 64,128")
    try:
        codes = [(int(k), int(n)) for k, n in (c.split("/") for c in args.codes.split(","))]
    except ValueError:
        parser.error(f"--codes {args.codes!r}: expected k/n pairs, like 2/3,4/6")

    prov = provenance()
    print(f"# baft erasure throughput, {prov['date']}; baft revision {prov['revision']}")
    print(f"# command: {prov['command']}")
    print(f"# machine: {prov['machine']}, zfec {zfec.__version__}, numpy {np.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print(f"# GB/s of snapshot bytes, median of {args.runs} runs, one thread; rebuild from the parity-heaviest "
          f"survivors; k=1 replication, n=k+1 XOR, else Reed-Solomon")
    print()
    head = ("k/n", "lost", "mem x", "snapshot", "encode", "rebuild", "node→shares", "shares→verified")
    widths = (5, 4, 5, 8, 7, 7, 11, 15)
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for size in sizes:
        snapshots = node_snapshot(size)
        for k, n in codes:
            rates = measure(snapshots, k, n, args.runs)
            shown = [f"{r:.2f}" for r in rates]
            if k == 1:  # the shares are the bundle itself: nothing to compute
                shown[:2] = ["no-op", "no-op"]
            cells = (f"{k}/{n}", str(n - k), f"{n / k:.2f}", f"{size >> 20} MB", *shown)
            print("| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
