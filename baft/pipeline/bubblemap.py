"""The bubble map: where each pipeline stage is idle during one training iteration.

A bubble map is what ``baft profile`` writes (measured on a real run) and what the
timeline computes from a schedule (analytic). Both share these dataclasses and one
versioned JSON format, described by ``baft/schemas/bubblemap.schema.json``.

Times are seconds from the start of the iteration on that rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from baft.errors import ConfigError
from baft.jsonfile import load_versioned, renamed, write_json_atomic

SCHEMA = "baft.bubblemap"
VERSION = 2

BUBBLE_KINDS = ("warm-up", "steady", "cool-down", "optimizer")


@dataclass(frozen=True)
class Bubble:
    """One idle interval of one stage.

    ``instruction`` is the index, in the stage's instruction stream for one iteration, of the
    instruction that waits through the bubble (on CPU a receive, or the optimizer step waiting
    for the other stages: kind "optimizer"). ``after`` and ``before`` name the instructions that
    close and reopen the stage's work around it.
    """

    stage: int
    start: float
    end: float
    instruction: int
    after: str
    before: str
    kind: str
    rank: Optional[int] = None

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class InstructionTiming:
    """One executed instruction: median start and duration over the profiled iterations; ``wait``: the part of
    the duration an optimizer step spent waiting for the other stages."""

    index: int
    name: str
    start: float
    duration: float
    spread: float = 0.0
    micro_batch: Optional[int] = None
    wait: float = 0.0


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state a rank must snapshot."""

    parameters: int = 0
    optimizer: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.other


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured: its timeline, its state size and its host-copy bandwidth."""

    rank: int
    stage: int
    dp_rank: int = 0
    iteration_time: float = 0.0
    iteration_spread: float = 0.0
    instructions: tuple[InstructionTiming, ...] = ()
    state_bytes: StateBytes = StateBytes()
    copy_bandwidth: float = 0.0  # bytes per second

    def copy_time(self, nbytes: Optional[int] = None) -> float:
        """Seconds to copy ``nbytes`` (default: the whole state) at the measured bandwidth."""
        nbytes = self.state_bytes.total if nbytes is None else nbytes
        return nbytes / self.copy_bandwidth if self.copy_bandwidth > 0 else float("inf")


@dataclass
class BubbleMap:
    """Per-stage bubbles of one iteration of one schedule, with the costs behind them."""

    schedule: str
    stages: int
    micro_batches: int
    source: str  # "measured" or "analytic"
    bubbles: list[Bubble] = field(default_factory=list)
    ranks: list[RankProfile] = field(default_factory=list)
    model_chunks: int = 1  # model chunks per stage (interleaved schedules)
    data_parallel: int = 1
    iterations: int = 0
    makespan: float = 0.0
    model: dict = field(default_factory=dict)
    analytic_bubble_fraction: dict = field(default_factory=dict)  # stage -> fraction
    optimizer_sync: bool = False  # do the stages' optimizer steps wait for each other
    notes: list[str] = field(default_factory=list)

    def stage_bubbles(self, stage: int) -> list[Bubble]:
        return sorted((b for b in self.bubbles if b.stage == stage), key=lambda b: b.start)

    def bubble_time(self, stage: int) -> float:
        return sum(b.length for b in self.stage_bubbles(stage))

    def iteration_time(self, stage: int) -> float:
        times = [r.iteration_time for r in self.ranks if r.stage == stage and r.iteration_time > 0]
        return sorted(times)[len(times) // 2] if times else self.makespan

    def bubble_fraction(self, stage: int) -> float:
        total = self.iteration_time(stage)
        return self.bubble_time(stage) / total if total > 0 else 0.0

    def rank_profile(self, stage: int, dp_rank: int = 0) -> Optional[RankProfile]:
        for r in self.ranks:
            if r.stage == stage and r.dp_rank == dp_rank:
                return r
        return None

    # --- serialization -------------------------------------------------------------

    def to_json(self) -> dict:
        body = dataclasses.asdict(self)
        body["analytic_bubble_fraction"] = {str(k): v for k, v in self.analytic_bubble_fraction.items()}
        return {"schema": SCHEMA, "version": VERSION, **body}

    @classmethod
    def from_json(cls, doc: dict) -> "BubbleMap":
        body = {k: v for k, v in doc.items() if k not in ("schema", "version")}
        body["bubbles"] = [Bubble(**b) for b in body.get("bubbles", [])]
        body["ranks"] = [_rank_from_json(r) for r in body.get("ranks", [])]
        body["analytic_bubble_fraction"] = {int(k): v for k, v in body.get("analytic_bubble_fraction", {}).items()}
        return cls(**body)

    def save(self, path) -> Path:
        return write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path, stages: Optional[int] = None) -> "BubbleMap":
        """Read and validate a bubble map; ``stages`` checks it fits the running pipeline."""
        doc = load_versioned(path, SCHEMA, VERSION, "bubblemap.schema.json", upgrade=_from_version_1)
        bmap = cls.from_json(doc)
        if stages is not None and bmap.stages != stages:
            raise ConfigError(f"{path}: bubble map is for {bmap.stages} pipeline stages, this run has {stages}")
        return bmap


def _from_version_1(doc: dict) -> dict:
    """A version-1 map in version 2's field names: a bubble's ``slot`` is its ``instruction``, the map's ``chunks``
    its ``model_chunks`` (no other field baft wrote in version 1 has either name)."""
    return renamed(doc, {"slot": "instruction", "chunks": "model_chunks"})


def _rank_from_json(doc: dict) -> RankProfile:
    doc = dict(doc)
    doc["instructions"] = tuple(InstructionTiming(**i) for i in doc.get("instructions", []))
    doc["state_bytes"] = StateBytes(**doc.get("state_bytes", {}))
    return RankProfile(**doc)


def dumps(bmap: BubbleMap) -> str:
    return json.dumps(bmap.to_json(), indent=1)
