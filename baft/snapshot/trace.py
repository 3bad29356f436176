"""The per-instruction trace of a training run with baft's copies in it (``baft train --trace DIR``).

Every rank writes ``DIR/trace-rank<R>.json`` when it exits (a rank that is killed writes
none; its restarted successor does). The file is the profiler's trace
(:func:`baft.pipeline.profiler.write_trace`, which ``baft profile`` merges) of the newest
``keep`` iterations; each iteration also holds ``step``, the optimizer step it ended with,
and, when baft's :class:`~baft.snapshot.policies.BubbleExecutor` took a snapshot in it:

* ``copies``: ``[instruction, start, end, bytes]`` for every bubble it copied in (``instruction``
  is the receive's index in the iteration's instructions);
* ``flush``: ``[start, end, bytes]``, what was left, copied before ``OptimizerStep`` (the stall).

Times are seconds since the iteration's start, on the clock of its instructions (the host's
on CPU; on a GPU the instructions are device times and the copies host times).

:func:`load_run` reads a trace directory back as one typical iteration of every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from baft.errors import BaftError
from baft.jsonfile import read_json
from baft.pipeline.bubblemap import BubbleMap
from baft.pipeline.merge import merge_trace_docs, trace_paths
from baft.pipeline.profiler import HostClock, InstructionTimer, write_trace
from baft.snapshot import sizes
from baft.snapshot.policies import SnapshotPolicy


class RunTrace(InstructionTimer):
    """Times every instruction of a training run and takes in the copy spans of ``policy``.

    ``policy`` may be any hook; only one with ``spans`` (:class:`~baft.snapshot.policies.CopySpans`,
    baft's executor) adds copies. The trace is written at :meth:`close` (process exit). It costs
    two clock reads per instruction on CPU; on a GPU two CUDA events per instruction and a device
    synchronization per iteration (the profiler's clock).
    """

    def __init__(self, directory, model_name: str, policy: Optional[SnapshotPolicy] = None, keep: int = 200):
        super().__init__()
        self.directory, self.model_name, self.policy, self.keep = Path(directory), model_name, policy, keep
        self.engine = None
        self._host_t0 = 0.0

    def iteration_start(self, engine):
        super().iteration_start(engine)
        # the host time the instructions count from: on CPU their own origin, on a GPU (device times) the nearest
        self._host_t0 = self._t0 if isinstance(self.clock, HostClock) else time.perf_counter()

    def iteration_end(self, engine):
        super().iteration_end(engine)
        self.engine = engine
        self.iterations[-1].update(step=engine.global_steps, **self._copies())
        del self.iterations[:-self.keep]

    def _copies(self) -> dict:
        """This iteration's copy spans, re-based from the policy's iteration start to this trace's."""
        spans = getattr(self.policy, "spans", None)
        if spans is None or spans.flush is None:
            return {}
        shift = spans.origin - self._host_t0
        return {"copies": [[instruction, start + shift, end + shift, nbytes]
                           for instruction, start, end, nbytes in spans.bubbles],
                "flush": [spans.flush[0] + shift, spans.flush[1] + shift, spans.flush[2]]}

    def close(self) -> None:
        if self.engine is not None and self.iterations:
            write_trace(self.directory / f"trace-rank{self.engine.global_rank}.json", self.engine, self,
                        sizes.describe(self.engine))


def start_trace(engine, directory, model_name: str) -> RunTrace:
    """Trace ``engine``'s iterations into ``directory``, first among its hooks (its clock starts first)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    policy = engine.baft.hooks.policy
    trace = RunTrace(directory, model_name, policy if isinstance(policy, SnapshotPolicy) else None)
    engine.baft.hooks.trace = trace
    return trace


@dataclass(frozen=True)
class RankCopies:
    """One rank's snapshot copies in one iteration: inside bubbles, and the flush before the optimizer step."""

    rank: int
    bubbles: tuple[tuple[int, float, float, int], ...]  # instruction, start, end, bytes
    flush: Optional[tuple[float, float, int]]  # start, end, bytes; None: no snapshot in this iteration
    snapshot_bytes: int  # what one snapshot copies: the rank's chunks

    @property
    def in_bubbles(self) -> int:
        return sum(nbytes for *_, nbytes in self.bubbles)

    @property
    def share_in_bubbles(self) -> float:
        return self.in_bubbles / self.snapshot_bytes if self.snapshot_bytes else 1.0

    @property
    def stall(self) -> float:
        """Seconds of the flush before the optimizer step."""
        return self.flush[1] - self.flush[0] if self.flush else 0.0


@dataclass(frozen=True)
class RunTimeline:
    """One iteration (``step``) of a traced run: its measured bubble map and every rank's copies."""

    step: int
    bubble_map: BubbleMap
    copies: dict[int, RankCopies]  # by rank; empty for a run under another policy

    @property
    def copied_bytes(self) -> int:
        return sum(c.snapshot_bytes for c in self.copies.values() if c.flush is not None)

    @property
    def share_in_bubbles(self) -> float:
        """Of the state snapshotted in this iteration, the fraction copied inside bubbles."""
        total = self.copied_bytes
        return sum(c.in_bubbles for c in self.copies.values()) / total if total else 0.0


def load_run(directory) -> RunTimeline:
    """A trace directory as one typical iteration of every rank (:func:`typical_step`)."""
    paths = trace_paths(directory)
    if not paths:
        raise BaftError(f"{directory}: no trace-rank*.json; write them with 'baft train --trace {directory}'")
    traces = [read_json(p) for p in paths]
    step = typical_step(traces)
    chosen = [{**t, "iterations": [_iteration(t, step)]} for t in traces]
    return RunTimeline(step, merge_trace_docs(chosen, skip=0), {t["rank"]: _rank_copies(t, step) for t in traces})


def typical_step(traces: list[dict]) -> int:
    """The step every rank traced whose iteration (its slowest rank's) is the median, preferring steps in
    which every rank copied a snapshot, and leaving out each rank's first (warm-up) iteration unless
    only it snapshotted (a long period: the first after a restart may be the one snapshot traced)."""
    after_warm_up = set.intersection(*({it["step"] for it in t["iterations"][1:]} for t in traces))
    every = set.intersection(*({it["step"] for it in t["iterations"]} for t in traces))
    if not every:
        raise BaftError("the ranks' traces share no step: were they written by one run?")

    def snapshotted(steps: set[int]) -> set[int]:
        return {s for s in steps if all("flush" in _iteration(t, s) for t in traces)}
    candidates = next(c for c in (snapshotted(after_warm_up), snapshotted(every), after_warm_up, every) if c)
    candidates = sorted(candidates, key=lambda s: max(_iteration(t, s)["time"] for t in traces))
    return candidates[(len(candidates) - 1) // 2]


def _iteration(trace: dict, step: int) -> dict:
    return next(it for it in trace["iterations"] if it["step"] == step)


def _rank_copies(trace: dict, step: int) -> RankCopies:
    it = _iteration(trace, step)
    flush = it.get("flush")
    return RankCopies(rank=trace["rank"], bubbles=tuple(tuple(c) for c in it.get("copies", ())),
                      flush=tuple(flush) if flush else None,
                      snapshot_bytes=sum(trace["model"]["chunk_sizes"][str(trace["rank"])]))

