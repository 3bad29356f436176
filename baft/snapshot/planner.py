"""Pack a rank's state chunks into its bubbles, and choose the snapshot period.

A snapshot of step k must be copied between optimizer step k and optimizer step k+1:
parameters and optimizer state change at every step, so one snapshot cannot spread over
several iterations and stay consistent. The planner therefore fills one iteration's
bubbles in time order, at the measured copy bandwidth with a safety margin; what does not
fit is copied just before the next optimizer step (the *stall*). When the stall would
cost more than the overhead budget every iteration, the planner snapshots every
``period``-th iteration instead: the smallest period whose stall, amortized, fits the budget.

The stall also counts the wait for a slot: a snapshot is sealed (checksums gathered, commit
record written) after its fence, and with four slots the next one is copied meanwhile, so the
trainer waits only for a seal longer than the snapshot period; with three slots (all that
``memory_limit`` allows) the next snapshot waits for the seal, which has only the time left of
the period after the fence.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from baft.config import DEFAULT_CHUNK_BYTES
from baft.errors import ConfigError
from baft.jsonfile import load_versioned, renamed, write_json_atomic
from baft.pipeline.bubblemap import Bubble, BubbleMap
from baft.snapshot.slots import SLOTS

SCHEMA = "baft.plan"
VERSION = 2
DEFAULT_BUDGET = 0.01
DEFAULT_MARGIN = 0.8  # use 80% of a profiled bubble: bubbles jitter


@dataclass(frozen=True)
class BubblePlan:
    """The chunks to copy in one bubble: while the instruction at index ``instruction`` of the stage's stream waits."""

    instruction: int
    bubble: float  # profiled length, seconds
    first_chunk: int
    chunks: int
    nbytes: int


@dataclass
class RankPlan:
    """One rank's plan for one snapshot."""

    rank: int
    stage: int
    layout: str  # fingerprint of the state layout planned for
    total_chunks: int
    nbytes: int
    bandwidth: float
    iteration_time: float
    bubbles: list[BubblePlan] = field(default_factory=list)  # the bubbles that hold chunks, in time order
    leftover_chunks: int = 0
    leftover_bytes: int = 0
    stall: float = 0.0  # predicted seconds of copy before the optimizer step
    bubble_time: float = 0.0
    seal: float = 0.0  # seconds a seal takes (measured), after the fence
    slots: int = SLOTS  # the rank's snapshot slots

    @property
    def overhead_per_snapshot(self) -> float:
        """The stall of a snapshot taken every iteration, as a fraction of an iteration (its wait for a slot
        included)."""
        return self.cost(1)

    def seal_wait(self, period: int = 1) -> float:
        """Seconds a snapshot begun every ``period`` iterations waits for a slot a seal still holds. With two
        snapshots in flight the seals keep pace unless one takes longer than a period; with one, a seal that
        starts at the fence (taken as the iteration's end) has ``period - 1`` iterations before the next begin."""
        lag = period if self.slots - 2 >= 2 else period - 1
        return max(0.0, self.seal - lag * self.iteration_time)

    def cost(self, period: int) -> float:
        """A snapshot's stall, its wait for a slot included, as a fraction of an iteration, at ``period``."""
        return (self.stall + self.seal_wait(period)) / self.iteration_time if self.iteration_time else 0.0

    def placement(self) -> dict[int, range]:
        """Instruction index -> the chunks copied in the bubble that begins there (the rest: at the fence)."""
        return {b.instruction: range(b.first_chunk, b.first_chunk + b.chunks) for b in self.bubbles}

    @property
    def bubble_used(self) -> float:
        """Fraction of the profiled bubble time the plan fills with copies."""
        planned = sum(b.nbytes for b in self.bubbles) / self.bandwidth if self.bandwidth else 0.0
        return planned / self.bubble_time if self.bubble_time else 0.0


@dataclass
class Plan:
    """Every rank's plan, the snapshot period chosen, and why."""

    schedule: str
    stages: int
    micro_batches: int
    period: int
    budget: float
    ranks: list[RankPlan]
    source: str = ""  # the bubble map planned from
    notes: list[str] = field(default_factory=list)

    @property
    def predicted_overhead(self) -> float:
        """Iteration-time overhead averaged over a period, for the worst rank."""
        return max((r.cost(self.period) for r in self.ranks), default=0.0) / self.period

    def for_rank(self, rank: int) -> Optional[RankPlan]:
        return next((r for r in self.ranks if r.rank == rank), None)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, doc: dict) -> "Plan":
        body = {k: v for k, v in doc.items() if k not in ("schema", "version")}
        body["ranks"] = [RankPlan(**{**r, "bubbles": [BubblePlan(**b) for b in r["bubbles"]]}) for r in body["ranks"]]
        return cls(**body)

    def save(self, path) -> Path:
        return write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path) -> "Plan":
        return cls.from_json(load_versioned(path, SCHEMA, VERSION, "plan.schema.json", upgrade=_from_version_1))


def _from_version_1(doc: dict) -> dict:
    """A version-1 plan in version 2's field names: a rank's ``slots`` are its ``bubbles``, a bubble's ``slot`` its
    ``instruction`` (no other field baft wrote in version 1 has either name)."""
    return renamed(doc, {"slots": "bubbles", "slot": "instruction"})


def plan_rank(bubbles: list[Bubble], chunk_sizes: list[int], bandwidth: float, iteration_time: float,
              rank: int = 0, stage: int = 0, layout: str = "", margin: float = DEFAULT_MARGIN) -> RankPlan:
    """Fill ``bubbles`` (in time order) with chunks, in order; the rest is the stall."""
    if bandwidth <= 0:
        raise ConfigError(f"rank {rank}: copy bandwidth must be positive to plan, got {bandwidth}")
    filled, next_chunk = [], 0
    for bubble in sorted(bubbles, key=lambda b: b.start):
        capacity = bubble.length * margin * bandwidth
        first, used = next_chunk, 0
        while next_chunk < len(chunk_sizes) and used + chunk_sizes[next_chunk] <= capacity:
            used += chunk_sizes[next_chunk]
            next_chunk += 1
        if next_chunk > first:
            filled.append(BubblePlan(bubble.instruction, bubble.length, first, next_chunk - first, used))
    leftover = sum(chunk_sizes[next_chunk:])
    return RankPlan(rank=rank, stage=stage, layout=layout, total_chunks=len(chunk_sizes), nbytes=sum(chunk_sizes),
                    bandwidth=bandwidth, iteration_time=iteration_time, bubbles=filled,
                    leftover_chunks=len(chunk_sizes) - next_chunk, leftover_bytes=leftover,
                    stall=leftover / bandwidth, bubble_time=sum(b.length for b in bubbles))


def period_within(cost: float, budget: float = DEFAULT_BUDGET) -> int:
    """The smallest period (in iterations) at which a snapshot costing ``cost`` of an iteration, amortized
    over the period, fits ``budget`` (a fraction of an iteration too)."""
    return max(1, math.ceil(cost / budget - 1e-9)) if cost > 0 else 1


def choose_period(ranks: list[RankPlan], budget: float = DEFAULT_BUDGET) -> int:
    """The smallest period at which every rank's amortized stall, its wait for a slot included, fits the budget.

    A longer period leaves a seal more time, so the cost per snapshot only falls with it: the period that fits
    the cost at period 1 is an upper bound."""
    worst = lambda period: max((r.cost(period) for r in ranks), default=0.0)  # noqa: E731
    bound = period_within(worst(1), budget)
    return next((p for p in range(1, bound) if worst(p) / p <= budget), bound)


def plan(bmap: BubbleMap, chunk_bytes: int = DEFAULT_CHUNK_BYTES, budget: float = DEFAULT_BUDGET,
         margin: float = DEFAULT_MARGIN, period: Optional[int] = None, source: str = "") -> Plan:
    """Plan every rank of a measured bubble map, with chunks of ``chunk_bytes``."""
    ranks = []
    for profile in bmap.ranks:
        chunks = bmap.model.get("chunk_sizes", {}).get(str(profile.rank))
        if chunks is None:  # an analytic or hand-made map: cut the state bytes evenly
            size = math.ceil((profile.state_bytes.parameters + profile.state_bytes.optimizer) / bmap.data_parallel)
            chunks = [chunk_bytes] * (size // chunk_bytes) + ([size % chunk_bytes] if size % chunk_bytes else [])
        bubbles = [b for b in bmap.stage_bubbles(profile.stage)]
        ranks.append(plan_rank(bubbles, chunks, profile.copy_bandwidth, profile.iteration_time,
                               rank=profile.rank, stage=profile.stage,
                               layout=str(bmap.model.get("layout", {}).get(str(profile.stage), "")), margin=margin))
    return finish_plan(bmap, ranks, budget, period, source)


def finish_plan(bmap: BubbleMap, ranks: list[RankPlan], budget: float, period: Optional[int],
                source: str = "") -> Plan:
    chosen = period or choose_period(ranks, budget)
    notes = []
    for r in ranks:
        if r.leftover_bytes:
            notes.append(f"rank {r.rank} (stage {r.stage}): bubbles hold {_mb(r.nbytes - r.leftover_bytes)} of "
                         f"{_mb(r.nbytes)}; {_mb(r.leftover_bytes)} is copied before the optimizer step "
                         f"({r.stall * 1e3:.1f} ms stall per snapshot)")
        if r.seal_wait(chosen):
            notes.append(f"rank {r.rank} (stage {r.stage}): each snapshot waits {r.seal_wait(chosen) * 1e3:.1f} ms "
                         f"for a slot the previous one's seal ({r.seal * 1e3:.1f} ms) holds ({r.slots} slots)")
    if chosen > 1:
        notes.append(f"a snapshot must be copied within one iteration (the optimizer step changes the state), "
                     f"so baft snapshots every {chosen} iterations to stay within {budget:.1%}")
    return Plan(bmap.schedule, bmap.stages, bmap.micro_batches, chosen, budget, ranks, source, notes)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def check_plan(plan_: Plan, rank: int, stages: int, layout: str, nbytes: int, chunks: int) -> RankPlan:
    """The rank's plan, or a ConfigError saying why it does not fit this run (``chunks``: how many chunks the run
    cuts the rank's state into; a plan's bubbles name chunks by index)."""
    if plan_.stages != stages:
        raise ConfigError(f"plan is for {plan_.stages} pipeline stages, this run has {stages}")
    mine = plan_.for_rank(rank)
    if mine is None:
        raise ConfigError(f"plan has no entry for rank {rank}")
    if mine.layout and mine.layout != layout:
        raise ConfigError(f"plan for rank {rank} was made for state layout {mine.layout}, this model's is {layout}")
    if mine.nbytes != nbytes:
        raise ConfigError(f"plan for rank {rank} covers {mine.nbytes} bytes of state, this rank has {nbytes}")
    if mine.total_chunks != chunks:
        raise ConfigError(f"plan for rank {rank} cuts its state into {mine.total_chunks} chunks, this run into "
                          f"{chunks}: baft.chunk_bytes differs from the profile's; profile and plan again")
    return mine
