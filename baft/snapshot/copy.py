"""Copying one snapshot of a rank's state into a shared-memory slot, chunk by chunk.

A :class:`Snapshot` is taken at a step boundary: ``begin`` captures the small items and
picks a slot; ``copy`` moves one chunk and checksums it; ``commit`` writes the commit
record once every chunk is in. The policies (bubble-aware executor, synchronous copy,
background thread) differ only in *when* they call ``copy``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import torch

from baft.snapshot import state
from baft.snapshot.layout import CommitRecord, Layout, checksum, model_signature, plan_layout
from baft.snapshot.slots import SnapshotWriter


class StateSource:
    """The rank's state tensors as flat byte views, and the layout of this replica's shard."""

    def __init__(self, engine, chunk_bytes: int):
        grid = engine.grid
        self.engine = engine
        self.layout: Layout = plan_layout(state.tensor_entries(engine), chunk_bytes,
                                          shard=grid.get_data_parallel_rank(),
                                          num_shards=grid.get_data_parallel_world_size())
        self.views = {name: t.detach().reshape(-1).view(torch.uint8)
                      for name, t in state.state_tensors(engine).items()}
        self.on_cuda = any(v.is_cuda for v in self.views.values())

    def view(self, chunk) -> torch.Tensor:
        return self.views[chunk.tensor][chunk.start:chunk.start + chunk.nbytes]

    def topology(self) -> dict:
        grid = self.engine.grid
        return {"pipe": grid.get_pipe_parallel_world_size(), "data": grid.get_data_parallel_world_size(),
                "world": self.engine.world_size}


class Snapshot:
    """One snapshot of step ``step`` in flight: pending chunks, copied bytes, checksums."""

    def __init__(self, source: StateSource, writer: SnapshotWriter, step: int, items: dict,
                 stream: Optional["torch.cuda.Stream"] = None):
        self.source, self.writer, self.step, self.items = source, writer, step, items
        self.buffer = writer.begin(step)
        self.slot = writer.slot
        self.pending = deque(range(len(source.layout.chunks)))
        self.checksums: list[Optional[str]] = [None] * len(source.layout.chunks)
        self.stream = stream
        self.copy_seconds = 0.0

    @property
    def done(self) -> bool:
        return not self.pending

    def copy(self) -> int:
        """Copy the next pending chunk; return its bytes."""
        i = self.pending.popleft()
        chunk = self.source.layout.chunks[i]
        dst = self.buffer[chunk.offset:chunk.offset + chunk.nbytes]
        start = time.perf_counter()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                dst.copy_(self.source.view(chunk), non_blocking=True)
        else:
            dst.copy_(self.source.view(chunk))
            self.checksums[i] = checksum(dst.numpy())
        self.copy_seconds += time.perf_counter() - start
        return chunk.nbytes

    def copy_while(self, keep_going: Callable[[], bool]) -> int:
        copied = 0
        while self.pending and keep_going():
            copied += self.copy()
        return copied

    def finish(self) -> CommitRecord:
        """Copy what is left, checksum, and commit. Returns the commit record."""
        self.copy_while(lambda: True)
        if self.stream is not None:
            self.stream.synchronize()
            for i, chunk in enumerate(self.source.layout.chunks):
                self.checksums[i] = checksum(self.buffer[chunk.offset:chunk.offset + chunk.nbytes].numpy())
        engine = self.source.engine
        record = CommitRecord(step=self.step, rank=engine.global_rank, stage=engine.stage_id,
                              dp_rank=engine.grid.get_data_parallel_rank(), layout=self.source.layout,
                              checksums=list(self.checksums), items=self.items,
                              topology=self.source.topology(), run_id=getattr(engine, "baft_run_id", ""),
                              model=model_signature(self.source.layout.tensors), wall_time=time.time())
        self.writer.commit(record)
        return record


def side_stream(source: StateSource):
    return torch.cuda.Stream() if source.on_cuda else None
