"""Measure where each rank's bubbles are: time every executed pipeline instruction.

:class:`InstructionTimer` is an engine hook that records the start and duration of every
instruction of every ``train_batch`` on its rank. Each rank writes a trace;
:func:`baft.pipeline.merge.merge_traces` turns the traces of all ranks into one measured bubble
map, with the analytic prediction from the same per-op costs beside it.

A bubble is time a stage's compute waits in a receive, or at the optimizer step for the other
stages (the meeting before the global gradient norm: see :mod:`baft.pipeline.engine`). On CPU the host
blocks there, so the host clock measures it. On a GPU the host does not block (NCCL makes the compute stream
wait), so every instruction is bracketed by CUDA events on the compute stream instead, and
a receive's duration is the time the *device* idled in it; the host waits once per
iteration, at its end, to read the events.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from baft.errors import BaftError
from baft.jsonfile import write_json_atomic
from baft.pipeline.bubblemap import Bubble, InstructionTiming, RankProfile, StateBytes
from baft.pipeline.hook import InstructionHook, step_meets_other_stages

_COMPUTE = ("ForwardPass", "BackwardPass")
_RECEIVE = ("RecvActivation", "RecvGrad")


def sync_device():
    """Wait for the device's queued work, so host time covers it (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostClock:
    """Marks are host times; a CPU instruction is done when its call returns."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self) -> None:
        pass


class CudaClock:
    """Marks are CUDA events recorded on the current (compute) stream: device time, no host wait."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def wait(self) -> None:
        torch.cuda.synchronize()


class InstructionTimer(InstructionHook):
    """Records every instruction's (index, repr, start, duration) for each iteration."""

    def __init__(self):
        self.iterations: list[dict] = []
        self.clock = CudaClock() if torch.cuda.is_available() else HostClock()
        self._t0 = self._start = None
        self._current: list[tuple] = []

    def iteration_start(self, engine):
        self._t0 = self.clock.mark()
        self._current = []
        self._waits: dict[int, float] = {}

    def before(self, engine, index, cmd):
        self._start = self.clock.mark()

    def before_update(self, engine, index, waited):
        if waited is not None:
            self._waits[index] = waited

    def after(self, engine, index, cmd):
        self._current.append((index, repr(cmd), type(cmd).__name__, self._start, self.clock.mark()))

    def iteration_end(self, engine):
        """The iteration's record: (index, repr, kind, start, duration[, wait]) per instruction, the wait
        (seconds the optimizer step waited for the other stages) only where one was timed."""
        end = self.clock.mark()
        self.clock.wait()
        seconds = self.clock.seconds
        self.iterations.append({"time": seconds(self._t0, end), "instructions": [
            (index, text, kind, seconds(self._t0, start), seconds(start, stop),
             *([self._waits[index]] if index in self._waits else []))
            for index, text, kind, start, stop in self._current]})


class ProfileSession(InstructionTimer):
    """Times one warm-up plus ``iterations`` iterations, writes this rank's trace, and ends the run.

    ``describe_state(engine)`` says how big this rank's snapshot is and how fast it copies
    (:class:`StateDescription`); the profiler records it beside the bubbles.
    """

    def __init__(self, directory, iterations: int, model_name: str,
                 describe_state: Callable[..., StateDescription], show_progress: bool = True):
        super().__init__()
        self.directory, self.total, self.model_name = Path(directory), iterations + 1, model_name
        self.describe_state = describe_state
        self.bar = tqdm(total=self.total, desc="profiling", unit="iter", disable=not show_progress, file=sys.stderr)

    def iteration_end(self, engine):
        super().iteration_end(engine)
        self.bar.update(1)
        if len(self.iterations) < self.total:
            return
        self.bar.close()
        write_trace(self.directory / f"trace-rank{engine.global_rank}.json", engine, self, self.describe_state(engine))
        dist.barrier()
        sys.exit(0)


@dataclasses.dataclass(frozen=True)
class StateDescription:
    """A rank's snapshot as the bubble map records it: its size, chunks, layout and copy speed."""

    state_bytes: StateBytes
    copy_bandwidth: float  # bytes per second into host memory
    layout: str  # the layout fingerprint
    chunk_sizes: list[int]


def write_trace(path, engine, timer: InstructionTimer, described: StateDescription) -> Path:
    """One rank's raw trace: every profiled iteration, its state size and copy bandwidth."""
    grid = engine.grid
    model = {"name": timer.model_name, "parameters": sum(p.numel() for p in engine.module.parameters()),
             "layout": {str(engine.stage_id): described.layout},
             "chunk_sizes": {str(engine.global_rank): described.chunk_sizes}}
    return write_json_atomic(path, {
        "rank": engine.global_rank, "stage": engine.stage_id, "dp_rank": grid.get_data_parallel_rank(),
        "stages": engine.num_stages, "data_parallel": grid.get_data_parallel_world_size(),
        "micro_batches": engine.micro_batches, "schedule": engine.baft.schedule, "model": model,
        "state_bytes": dataclasses.asdict(described.state_bytes),
        "copy_bandwidth": described.copy_bandwidth, "iterations": timer.iterations,
        "optimizer_sync": step_meets_other_stages(engine),
    })


def median_profile(trace: dict, skip: int) -> RankProfile:
    """One rank's profile from its trace: each instruction's median start and duration over the
    iterations after the first ``skip`` (all of them if none is left)."""
    iters = trace["iterations"][skip:] or trace["iterations"]
    lengths = {len(it["instructions"]) for it in iters}
    if len(lengths) != 1:
        raise BaftError(f"rank {trace['rank']}: iterations ran different instruction streams")
    instructions, seen = [], {}
    for i, first in enumerate(iters[0]["instructions"]):
        starts = [it["instructions"][i][3] for it in iters]
        durations = [it["instructions"][i][4] for it in iters]
        waits = [it["instructions"][i][5] if len(it["instructions"][i]) > 5 else 0.0 for it in iters]
        name = first[2]
        micro_batch = None
        if name in _COMPUTE:
            micro_batch = seen.get(name, 0)
            seen[name] = micro_batch + 1
        instructions.append(InstructionTiming(
            index=first[0], name=first[1], start=statistics.median(starts),
            duration=statistics.median(durations), spread=_spread(durations), micro_batch=micro_batch,
            wait=statistics.median(waits)))
    times = [it["time"] for it in iters]
    return RankProfile(rank=trace["rank"], stage=trace["stage"], dp_rank=trace["dp_rank"],
                       iteration_time=statistics.median(times), iteration_spread=_spread(times),
                       instructions=tuple(instructions), state_bytes=StateBytes(**trace["state_bytes"]),
                       copy_bandwidth=trace["copy_bandwidth"])


def _spread(values) -> float:
    """Interquartile range (0 for fewer than 4 values' worth of spread)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return max(0.0, q[2] - q[0])


def measured_bubbles(profile: RankProfile) -> list[Bubble]:
    """The waits of one rank (its receives, its optimizer step's wait for the other stages), classified by where
    they fall in its stream. The optimizer step's wait is placed at its start: the step's own work follows it."""
    instrs = profile.instructions
    compute = [i for i, ins in enumerate(instrs) if ins.name.split("(")[0] in _COMPUTE]
    first, last = (compute[0], compute[-1]) if compute else (0, len(instrs))
    bubbles = []
    for i, ins in enumerate(instrs):
        receive = ins.name.split("(")[0] in _RECEIVE
        length = ins.duration if receive else ins.wait
        if length <= 0:
            continue
        if receive:
            kind = "warm-up" if i < first else "cool-down" if i > last else "steady"
            then = instrs[i + 1].name if i + 1 < len(instrs) else "iteration end"
        else:
            kind, then = "optimizer", ins.name
        bubbles.append(Bubble(stage=profile.stage, rank=profile.rank, start=ins.start, end=ins.start + length,
                              instruction=ins.index, after=instrs[i - 1].name if i else "iteration start",
                              before=then, kind=kind))
    return bubbles
