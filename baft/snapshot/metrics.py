"""What a snapshot policy did, as data (the benchmark, ``baft compare``, and the example's summary read this,
never the policy's attributes), and when it snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class Periodic:
    """Snapshots every ``period``-th step, unless ``snapshot_now`` decides instead (a benchmark does, block by
    block, so that every policy snapshots the same iterations)."""

    period: int = 1
    snapshot_now: Optional[bool] = None

    def wanted(self, step: int) -> bool:
        return step % self.period == 0 if self.snapshot_now is None else self.snapshot_now


@dataclass(frozen=True)
class PolicyMetrics:
    """A policy's counters after an iteration (seconds and bytes of that iteration unless said otherwise)."""

    snapshots: int = 0  # taken so far: copied in memory (maybe still sealing), or saved to disk
    snapshotted: bool = False  # one of them in this iteration
    stall: float = 0.0  # the trainer's thread held by the policy
    bubble_bytes: int = 0  # copied inside the waits for other stages
    flushed_bytes: int = 0  # copied at the fence, before the optimizer changes the state
    fence_wait: float = 0.0  # on a GPU: the device's wait at the fence for copies still running
    seal: float = 0.0  # the latest finished seal (copies awaited, checksums, commit record), off the trainer
    seal_cpu: float = 0.0
    seal_wait: float = 0.0  # the trainer's wait, in the stall, for a slot still held by a snapshot sealing
