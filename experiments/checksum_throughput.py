"""Throughput of baft's chunk checksum on the host, against xxh3 (the checksum it replaced).

    python experiments/checksum_throughput.py [--sizes 1,2,4] [--chunks 64] [--repeats 5] [--gpu-gib G]

For each chunk size (MiB), ``--chunks`` random chunks (more than the caches hold, so each is read
from memory, as a seal reads a slot) are checksummed one after the other by:

* xxh3             ``xxhash.xxh3_64(chunk).hexdigest()``, what commit records held until format 2;
* torch            ``TorchSums.of`` on a CPU tensor: what a CPU trainer computes (``torch.dot``,
                   GIL released); on a GPU the same sum runs as a kernel on the copy stream;
* torch, unaligned the same on a chunk at an odd address (copied to an aligned buffer first);
* numpy            ``checksum.digest``: what a restore and the manager verify with (GIL held);
* torch, run       ``TorchSums.of_chunks`` over all chunks as one run (how the stream copier asks).

GB/s of chunk bytes, best of ``--repeats`` passes, one thread (``torch.set_num_threads(1)``).
With ``--gpu-gib G`` (needs CUDA) it also times ``TorchSums.of_chunks`` over G GiB on the GPU in
1 MiB chunks, as the stream copier queues it (CUDA events, best of ``--repeats``), and checks
the sums against the host's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import xxhash

from baft.snapshot import checksum


def best_rate(fn, items, nbytes: int, repeats: int) -> float:
    fn(items[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4", help="chunk sizes, MiB")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu-gib", type=float, default=0.0, help="also time the device checksum (needs CUDA)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sums = checksum.TorchSums()
    print(f"{'chunk':>6}  {'xxh3':>6}  {'torch':>6}  {'torch, unaligned':>16}  {'numpy':>6}  {'torch, run':>10}   (GB/s)")
    for mib in (int(s) for s in args.sizes.split(",")):
        size = mib << 20
        data = torch.from_numpy(np.random.default_rng(mib).integers(0, 256, size * args.chunks + 8, dtype=np.uint8))
        chunks = [data[i * size:(i + 1) * size] for i in range(args.chunks)]
        odd = [data[i * size + 3:(i + 1) * size + 3] for i in range(args.chunks)]
        total = size * args.chunks
        rates = [
            best_rate(lambda c: xxhash.xxh3_64(c.numpy()).hexdigest(), chunks, total, args.repeats),
            best_rate(lambda c: checksum.hexdigest(int(sums.of(c))), chunks, total, args.repeats),
            best_rate(lambda c: checksum.hexdigest(int(sums.of(c))), odd, total, args.repeats),
            best_rate(lambda c: checksum.digest(c.numpy()), chunks, total, args.repeats),
            best_rate(lambda run: sums.of_chunks(run, size).tolist(), [data[:total]], total, args.repeats),
        ]
        print(f"{mib:>4} MiB  " + "  ".join(f"{r:>{w}.2f}" for r, w in zip(rates, (6, 6, 16, 6, 10))))
    if args.gpu_gib:
        on_gpu(sums, args.gpu_gib, args.repeats)


def on_gpu(sums: checksum.TorchSums, gib: float, repeats: int) -> None:
    """Device checksums of ``gib`` GiB in 1 MiB chunks: GB/s, and the first chunks checked against the host."""
    data = torch.randint(0, 256, (int(gib * (1 << 30)),), dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        values = sums.of_chunks(data, 1 << 20)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    host = data[:8 << 20].cpu().numpy()
    expected = [checksum.digest(host[i:i + (1 << 20)]) for i in range(0, host.size, 1 << 20)]
    agree = [checksum.hexdigest(v) for v in values[:8].tolist()] == expected
    print(f"GPU: {data.numel() / best / 1e9:.1f} GB/s over {gib} GiB in 1 MiB chunks; first 8 agree with the host: {agree}")


if __name__ == "__main__":
    main()
