"""How big a rank's snapshot is and how fast it copies: what the profiler records beside the bubbles."""

from __future__ import annotations

import json
import statistics
import time

import torch

from baft.pipeline.bubblemap import StateBytes
from baft.pipeline.profiler import StateDescription, sync_device
from baft.snapshot import state
from baft.snapshot.checksum import TorchSums
from baft.snapshot.layout import DEFAULT_CHUNK_BYTES, plan_layout


def describe(engine) -> StateDescription:
    """This rank's snapshot: bytes by kind, chunk sizes and layout fingerprint of its shard, copy bandwidth."""
    grid = engine.grid
    layout = plan_layout(state.tensor_entries(engine), shard=grid.get_data_parallel_rank(),
                         num_shards=grid.get_data_parallel_world_size())
    return StateDescription(state_bytes=state_bytes(engine), copy_bandwidth=measure_copy_bandwidth(engine),
                            layout=layout.fingerprint, chunk_sizes=[c.nbytes for c in layout.chunks])


def state_bytes(engine) -> StateBytes:
    """Bytes of parameters, optimizer state and everything else (RNG, data position) on this rank."""
    sizes = {"parameters": 0, "optimizer": 0, "other": 0}
    for entry in state.tensor_entries(engine):
        sizes[entry.kind] += entry.nbytes
    small = state.capture_items(engine, script_schedulers=False, carried=False)
    sizes["other"] += len(json.dumps({**small, **state.capture_rng()}))
    return StateBytes(**sizes)


def measure_copy_bandwidth(engine, repeats: int = 3, limit: int = 256 << 20) -> float:
    """Bytes per second of copying this rank's state tensors into a host buffer the way baft's executor
    copies inside a bubble: on a GPU one device-to-host copy per tensor; on CPU chunk by chunk, each
    chunk's source checksummed as it is copied (on CPU the checksums take a third to half of that time:
    planning from a plain copy put more in a bubble than it held; on a GPU the device computes them)."""
    tensors = [t.detach().reshape(-1).view(torch.uint8) for t in state.state_tensors(engine).values()
               if t.numel() and t.is_contiguous()]
    total = min(sum(t.numel() for t in tensors), limit)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    pieces, offset = [], 0
    for t in tensors:
        n = min(t.numel(), total - offset)
        if n <= 0:
            break
        step = n if t.is_cuda else DEFAULT_CHUNK_BYTES
        pieces += [(host[offset + i:offset + min(i + step, n)], t[i:min(i + step, n)]) for i in range(0, n, step)]
        offset += n
    sums, times = TorchSums(), []
    for _ in range(repeats):
        sync_device()
        start = time.perf_counter()
        for dst, src in pieces:
            dst.copy_(src, non_blocking=True)
            if not src.is_cuda:
                sums.of(src)
        sync_device()
        times.append(time.perf_counter() - start)
    return total / statistics.median(times)
