"""Snapshot policies as engine hooks; the bubble-aware one is baft's executor.

Every in-memory policy takes the snapshot of step k during iteration k+1 and commits it
before optimizer step k+1; they differ in when the chunks are copied:

* :class:`BubbleExecutor` (``baft``): while the stage waits in a receive, chunk by chunk,
  until the data lands; whatever is left is flushed before the optimizer step.
* :class:`SyncCopy` (``sync-copy``): everything at the start of the iteration (CheckFreq's
  snapshot phase).
* :class:`ThreadCopy` (``thread-copy``): a background thread, ignoring bubbles.

Each records, per iteration, the *stall*: seconds the trainer spent in the policy outside
bubbles (flush, synchronous copy, join).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Optional

from deepspeed.runtime.pipe.schedule import OptimizerStep

from baft.pipeline.hooks import InstructionHook
from baft.snapshot import state
from baft.snapshot.copy import Snapshot, StateSource, side_stream
from baft.snapshot.layout import CommitRecord
from baft.snapshot.planner import RankPlan
from baft.snapshot.slots import SnapshotWriter


class SnapshotPolicy(InstructionHook):
    """Takes a snapshot at every ``period``-th step boundary into the rank's shared-memory slots."""

    name = "none"

    def __init__(self, shm_root: str, period: int = 1, chunk_bytes: int = 1 << 20, data_iterator=None,
                 link=None):
        self.shm_root, self.period, self.chunk_bytes = shm_root, period, chunk_bytes
        self.data_iterator, self.link = data_iterator, link
        self.source: Optional[StateSource] = None
        self.writer: Optional[SnapshotWriter] = None
        self.snapshot: Optional[Snapshot] = None
        self.stall = 0.0  # this iteration's
        self.commits: list[CommitRecord] = []

    def due(self, engine) -> bool:
        step = engine.global_steps
        return step > 0 and step % self.period == 0 and state.ensure_optimizer_state(engine) is None

    def prepare(self, engine) -> None:
        """Lay out the state and map the slots (once the optimizer state exists)."""
        if self.source is None:
            self.source = StateSource(engine, self.chunk_bytes)
            if self.link is not None:
                self.link.hello(self.source)  # the manager sizes the slots, or refuses
            self.writer = SnapshotWriter(self.shm_root, engine.global_rank, self.source.layout)

    def iteration_start(self, engine):
        self.stall = 0.0
        if self.due(engine):
            self.prepare(engine)
            self.snapshot = Snapshot(self.source, self.writer, engine.global_steps,
                                     state.capture_items(engine, self.data_iterator), side_stream(self.source))
            self.started()

    def started(self) -> None:
        """Called once the snapshot of this iteration has begun."""

    def before(self, engine, index, cmd):
        if isinstance(cmd, OptimizerStep) and self.snapshot is not None:
            start = time.perf_counter()
            self.finish()
            self.stall += time.perf_counter() - start

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.link is not None:
            self.link.close()

    def finish(self) -> None:
        slot = self.snapshot.slot
        record = self.snapshot.finish()
        self.snapshot = None
        self.commits.append(record)
        if self.link is not None:
            self.link.commit(record, slot)


class BubbleExecutor(SnapshotPolicy):
    """baft: copy inside the receive waits, in the order the plan gives; flush the rest."""

    name = "baft"

    def __init__(self, *args, plan: Optional[RankPlan] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.bubble_bytes: dict[int, int] = defaultdict(int)  # slot -> bytes copied there, this iteration
        self.flushed_bytes = 0

    def started(self):
        self.bubble_bytes.clear()
        self.flushed_bytes = 0

    def bubble(self, engine, index, cmd):
        if self.snapshot is None or self.snapshot.done:
            return None
        snapshot = self.snapshot

        def copy_until(landed):
            self.bubble_bytes[index] += snapshot.copy_while(lambda: not landed.is_set())
        return copy_until

    def finish(self):
        self.flushed_bytes = sum(self.source.layout.chunks[i].nbytes for i in self.snapshot.pending)
        super().finish()


class SyncCopy(SnapshotPolicy):
    """Copy the whole state at the start of the iteration, then commit."""

    name = "sync-copy"

    def iteration_start(self, engine):
        super().iteration_start(engine)
        if self.snapshot is not None:
            start = time.perf_counter()
            self.finish()
            self.stall += time.perf_counter() - start


class ThreadCopy(SnapshotPolicy):
    """Copy in a background thread that ignores bubbles; join before the optimizer step."""

    name = "thread-copy"

    def started(self):
        snapshot = self.snapshot
        self.thread = threading.Thread(target=snapshot.copy_while, args=(lambda: True,), daemon=True)
        self.thread.start()

    def finish(self):
        self.thread.join()
        super().finish()

    def close(self):
        if self.snapshot is not None:  # a copy still in flight (the script stopped mid-iteration)
            self.thread.join()
        super().close()
