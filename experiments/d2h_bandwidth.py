"""Device-to-host copy bandwidth into the memory a snapshot lands in (needs a CUDA GPU).

    python experiments/d2h_bandwidth.py [--gib 4] [--repeats 5] [--out experiments/results]

Copies a ``--gib`` GiB device tensor, on a side stream with ``non_blocking=True`` as baft's
stream executor does, into:

* a shared-memory slot registered with ``cudaHostRegister`` (what baft's slots are), whole
  and in baft's 1 MiB chunks (one copy call per chunk, as the executor queues them);
* the same slot unregistered (pageable shared memory: the copy is staged by the driver);
* ``torch.empty(pin_memory=True)`` (page-locked by the CUDA allocator, DCP's pinned staging);
* ``torch.empty()`` (pageable process memory).

Each is timed with CUDA events around the copies, after one untimed warm-up copy; the median
of ``--repeats`` is reported in GB/s (10^9 bytes). Writes ``gpu-d2h.md`` and ``gpu-d2h.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from baft.snapshot.layout import DEFAULT_CHUNK_BYTES as CHUNK
from baft.snapshot.slots import map_file, register_with_cuda, unregister_from_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, md_table, provenance  # noqa: E402


def timed_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, chunk: int | None) -> float:
    """Seconds the copy stream spends copying ``src`` into ``dst`` (whole, or ``chunk`` bytes a call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record()
        if chunk is None:
            dst.copy_(src, non_blocking=True)
        else:
            for offset in range(0, src.numel(), chunk):
                dst[offset:offset + chunk].copy_(src[offset:offset + chunk], non_blocking=True)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bandwidth(dst: torch.Tensor, src: torch.Tensor, repeats: int, chunk: int | None = None) -> dict:
    stream = torch.cuda.Stream()
    timed_copy(dst, src, stream, chunk)  # warm-up: first touch, driver staging buffers
    seconds = [timed_copy(dst, src, stream, chunk) for _ in range(repeats)]
    assert torch.equal(dst[-CHUNK:].cuda(), src[-CHUNK:]), "the copy landed"
    return {"gb_per_s": src.numel() / statistics.median(seconds) / 1e9,
            "seconds": seconds}


def measure(nbytes: int, repeats: int) -> list[dict]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        mapping = map_file(Path(shm) / "slot", nbytes, create=True, populate=True)
        slot = torch.frombuffer(mapping, dtype=torch.uint8)
        registered = register_with_cuda(slot)
        if not registered:
            raise SystemExit("cudaHostRegister of the shared-memory slot failed (see the warning above)")
        rows.append({"into": "shared-memory slot, registered (baft)", **bandwidth(slot, src, repeats)})
        rows.append({"into": "shared-memory slot, registered, 1 MiB chunks (baft's executor)",
                     **bandwidth(slot, src, repeats, CHUNK)})
        unregister_from_cuda(slot)
        rows.append({"into": "shared-memory slot, not registered", **bandwidth(slot, src, repeats)})
        del slot
        mapping.close()
    rows.append({"into": "torch.empty(pin_memory=True)", **bandwidth(torch.empty(nbytes, dtype=torch.uint8,
                                                                                 pin_memory=True), src, repeats)})
    rows.append({"into": "torch.empty() (pageable)", **bandwidth(torch.empty(nbytes, dtype=torch.uint8), src, repeats)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="bytes copied per measurement, in GiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("d2h_bandwidth.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
    start = time.time()
    rows = measure(int(args.gib * (1 << 30)), args.repeats)
    prov = {**provenance(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-d2h.json").write_text(json.dumps({**prov, "gib": args.gib, "rows": rows}, indent=1) + "\n")
    lines = ["# Device-to-host copy bandwidth into a snapshot's memory", "", *header(prov, time.time() - start),
             f"- GPU: {prov['gpu']}; torch {prov['torch']}; {args.gib:g} GiB per copy, median of {args.repeats}", "",
             *md_table(["into", "GB/s"], [[r["into"], f"{r['gb_per_s']:.1f}"] for r in rows])]
    (args.out / "gpu-d2h.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
