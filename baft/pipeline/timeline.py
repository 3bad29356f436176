"""The analytic timeline: a pipeline schedule as a DAG of ops, and the bubble map it implies.

Nodes are the forward and backward passes of every (stage, micro-batch, model chunk) plus one
optimizer op per stage (``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``). Edges are
each stage's execution order (from :func:`baft.pipeline.schedules.instruction_stream`) and the data
dependencies between virtual stages: the forward of virtual stage k+1 needs the forward of
virtual stage k, the backward of k needs the backward of k+1, and the backward of the last
virtual stage needs its own forward. Edges between ranks add the p2p latency. Every op
starts as soon as its predecessors end (sends never block), which gives each stage's busy
and idle intervals: the analytic bubble map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import networkx as nx
from deepspeed.runtime.pipe.schedule import (
    CommitP2P,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
)

from baft.errors import ConfigError
from baft.pipeline.bubblemap import Bubble, BubbleMap
from baft.pipeline.schedules import instruction_stream, micro_batch_ops

PerStage = float | Sequence[float]

# Instructions a stage blocks in while its input is on the way (DualPipeV's receives only
# queue work; its CommitP2P waits).
_WAITS = (RecvActivation, RecvGrad, CommitP2P)
_STEP = (ReduceTiedGrads, ReduceGrads, OptimizerStep)

# Gaps shorter than this fraction of the makespan are floating-point rounding, not bubbles.
_ROUNDING = 1e-9


@dataclass(frozen=True)
class Costs:
    """Op durations for the analytic model, in any time unit (seconds when measured).

    ``forward``/``backward``: one micro-batch through one model chunk of a stage, as one
    number for every stage or a sequence with one entry per stage. ``p2p``: latency of one
    activation or gradient message between ranks. ``optimizer``: a stage's
    ReduceTiedGrads + ReduceGrads + OptimizerStep, one number or one per stage.
    ``optimizer_sync``: the optimizer ops of all stages start together, once every stage's
    last backward is done, as when DeepSpeed all-reduces the gradient norm over the pipeline
    (gradient clipping, fp16 overflow checks); if False each stage steps on its own.
    """

    forward: PerStage = 1.0
    backward: PerStage = 2.0
    p2p: float = 0.0
    optimizer: PerStage = 0.0
    optimizer_sync: bool = True

    def per_stage(self, name: str, stages: int) -> list[float]:
        """The cost ``name`` (forward, backward or optimizer) of each of ``stages`` stages."""
        value = getattr(self, name)
        values = [float(value)] * stages if isinstance(value, (int, float)) else [float(v) for v in value]
        if len(values) != stages:
            raise ConfigError(f"costs: {name} has {len(values)} entries for {stages} pipeline stages")
        if min(values) < 0:
            raise ConfigError(f"costs: {name} must not be negative, got {values}")
        return values


class Op(NamedTuple):
    """A node of the timeline DAG: kind "F", "B" or "opt" (micro_batch and model_chunk are None)."""

    stage: int
    kind: str
    micro_batch: int | None = None
    model_chunk: int | None = None


class Interval(NamedTuple):
    """A busy interval of one stage."""

    start: float
    end: float
    label: str


@dataclass
class Timeline:
    """Earliest-start times of every op of one iteration.

    ``graph`` holds the DAG: node attributes ``first`` and ``last`` (the index in the
    stage's stream of the op's first and last instruction), ``duration``, ``start``, ``end``,
    ``label``; edge attribute ``lag`` (p2p latency or 0).
    """

    schedule: str
    stages: int
    micro_batches: int
    model_chunks: int
    costs: Costs
    streams: list[list[PipeInstruction]]
    graph: nx.DiGraph
    makespan: float

    def ops(self, stage: int) -> list[Op]:
        """The stage's ops in execution order."""
        return sorted((n for n in self.graph if n.stage == stage), key=lambda n: self.graph.nodes[n]["first"])

    def busy(self, stage: int) -> list[Interval]:
        """The stage's ops as ``(start, end, label)``, in execution order (for plots)."""
        nodes = self.graph.nodes
        return [Interval(nodes[op]["start"], nodes[op]["end"], nodes[op]["label"]) for op in self.ops(stage)]

    def bubbles(self, stage: int) -> list[Bubble]:
        """The stage's idle intervals, in time order (see :func:`analytic_bubble_map`)."""
        stream, nodes = self.streams[stage], self.graph.nodes
        tol = _ROUNDING * self.makespan
        bubbles, cursor, prev = [], 0.0, None
        for op in self.ops(stage):
            start, first = nodes[op]["start"], nodes[op]["first"]
            if start - cursor > tol:
                if prev is None:
                    kind = "warm-up"
                else:
                    kind = "cool-down" if op.kind == "opt" else "steady"
                after = "iteration start" if prev is None else repr(stream[nodes[prev]["last"]])
                wait = self._waiting_instruction(stream, -1 if prev is None else nodes[prev]["last"], first)
                bubbles.append(Bubble(stage, cursor, start, wait, after, repr(stream[first]), kind))
            cursor, prev = nodes[op]["end"], op
        if self.makespan - cursor > tol:
            last = nodes[prev]["last"]
            bubbles.append(Bubble(stage, cursor, self.makespan, last, repr(stream[last]), "iteration end", "optimizer"))
        return bubbles

    @staticmethod
    def _waiting_instruction(stream, prev_last: int, first: int) -> int:
        """The index of the last waiting instruction between the previous op and this one, else of the op's first."""
        for i in range(first - 1, prev_last, -1):
            if isinstance(stream[i], _WAITS):
                return i
        return first

    def idle_time(self, stage: int) -> float:
        return sum(b.length for b in self.bubbles(stage))

    def idle_fraction(self, stage: int) -> float:
        return self.idle_time(stage) / self.makespan if self.makespan > 0 else 0.0

    def bubble_map(self) -> BubbleMap:
        """This timeline as an analytic :class:`~baft.pipeline.bubblemap.BubbleMap`."""
        return BubbleMap(
            schedule=self.schedule,
            stages=self.stages,
            micro_batches=self.micro_batches,
            source="analytic",
            bubbles=[b for s in range(self.stages) for b in self.bubbles(s)],
            model_chunks=self.model_chunks,
            makespan=self.makespan,
            analytic_bubble_fraction={s: min(1.0, self.idle_fraction(s)) for s in range(self.stages)},
        )


def _virtual_stage(schedule: str, stages: int, stage: int, model_chunk: int) -> int:
    if schedule == "dualpipev":
        return stage if model_chunk == 0 else 2 * stages - 1 - stage
    return model_chunk * stages + stage


def simulate(schedule: str, stages: int, micro_batches: int, costs: Costs = Costs(), model_chunks: int = 1) -> Timeline:
    """Build the DAG of one iteration of ``schedule`` and give every op its earliest start."""
    forward = costs.per_stage("forward", stages)
    backward = costs.per_stage("backward", stages)
    optimizer = costs.per_stage("optimizer", stages)
    if costs.p2p < 0:
        raise ConfigError(f"costs: p2p must not be negative, got {costs.p2p}")
    streams = [instruction_stream(schedule, micro_batches, stages, s, model_chunks) for s in range(stages)]
    several_model_chunks = schedule == "dualpipev" or model_chunks > 1

    graph = nx.DiGraph()
    compute = {}  # (kind, virtual stage, micro-batch) -> Op
    last_compute, optimizers = [], []
    for stage, stream in enumerate(streams):
        order = []
        for c in micro_batch_ops(stream):
            op = Op(stage, c.kind, c.micro_batch, c.model_chunk)
            duration = forward[stage] if c.kind == "F" else backward[stage]
            label = f"{c.kind}{c.micro_batch}" + (f"/{c.model_chunk}" if several_model_chunks else "")
            graph.add_node(op, first=c.instruction, last=c.instruction, duration=duration, label=label)
            compute[c.kind, _virtual_stage(schedule, stages, stage, c.model_chunk), c.micro_batch] = op
            order.append(op)
        step = [i for i, instr in enumerate(stream) if isinstance(instr, _STEP)]
        opt = Op(stage, "opt")
        graph.add_node(opt, first=step[0], last=step[-1], duration=optimizer[stage], label="opt")
        last_compute.append(order[-1])
        optimizers.append(opt)
        nx.add_path(graph, order + [opt], lag=0.0)

    last_virtual = max(v for _, v, _ in compute)
    for (kind, v, mb), op in compute.items():
        if kind == "F" and v > 0:
            dep = compute["F", v - 1, mb]
        elif kind == "B":
            dep = compute["B", v + 1, mb] if v < last_virtual else compute["F", v, mb]
        else:
            continue
        graph.add_edge(dep, op, lag=costs.p2p if dep.stage != op.stage else 0.0)
    if costs.optimizer_sync:
        graph.add_edges_from(((last, opt) for last in last_compute for opt in optimizers), lag=0.0)

    nodes = graph.nodes
    for op in nx.topological_sort(graph):
        start = max((nodes[p]["end"] + graph.edges[p, op]["lag"] for p in graph.predecessors(op)), default=0.0)
        nodes[op]["start"], nodes[op]["end"] = start, start + nodes[op]["duration"]
    makespan = max(nodes[op]["end"] for op in graph)
    return Timeline(schedule, stages, micro_batches, model_chunks, costs, streams, graph, makespan)


def analytic_bubble_map(schedule: str, stages: int, micro_batches: int, costs: Costs,
                        model_chunks: int = 1) -> BubbleMap:
    """The bubble map the schedule implies for these per-op costs (measured or assumed).

    Bubble kinds: "warm-up" before a stage's first forward, "steady" between two compute
    ops, "cool-down" after its last compute op and before its optimizer op, "optimizer"
    after its optimizer op until the makespan (the slowest stage's end). ``instruction`` is the
    index of the instruction the stage waits in: the last receive (or DualPipeV
    ``CommitP2P``) before the op that starts late, else that op itself; for "optimizer"
    bubbles, the stage's ``OptimizerStep``.
    """
    return simulate(schedule, stages, micro_batches, costs, model_chunks).bubble_map()
