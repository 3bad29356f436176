"""Merge every rank's profiler trace into one measured bubble map, with the analytic model's prediction
from the same measured costs beside it (:mod:`baft.pipeline.timeline`). Run where the map is made (``baft
profile``, ``baft show`` of a traced run), not in the ranks: the timeline's DAG library stays out of them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from baft.errors import BaftError
from baft.jsonfile import read_json
from baft.pipeline.bubblemap import BubbleMap, RankProfile
from baft.pipeline.profiler import measured_bubbles, median_profile
from baft.pipeline.timeline import Costs, analytic_bubble_map

_FORWARD_SIDE = ("LoadMicroBatch", "ForwardPass", "SendActivation")
_BACKWARD_SIDE = ("BackwardPass", "SendGrad")
_OPTIMIZER_SIDE = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")


def measured_costs(profiles: list[RankProfile], stages: int, optimizer_sync: bool = False) -> Costs:
    """Per-stage costs for the analytic model: everything a stage does per micro-batch, minus waits.

    A forward costs its micro-batch's load, forward pass and (blocking) send; a backward,
    its backward pass and send; the optimizer, the reductions and the step, less the step's
    wait for the other stages. Transfers between processes on one host are part of the send,
    so p2p latency is zero.
    """
    def stage_costs(stage):
        rank = next(p for p in profiles if p.stage == stage and p.dp_rank == 0)
        spent, forwards = defaultdict(float), 0
        for ins in rank.instructions:
            name = ins.name.split("(")[0]
            spent[name] += ins.duration - ins.wait
            forwards += name == "ForwardPass"
        m = max(forwards, 1)
        return (sum(spent[n] for n in _FORWARD_SIDE) / m, sum(spent[n] for n in _BACKWARD_SIDE) / m,
                sum(spent[n] for n in _OPTIMIZER_SIDE))

    forward, backward, optimizer = zip(*(stage_costs(s) for s in range(stages)))
    return Costs(forward=list(forward), backward=list(backward), optimizer=list(optimizer), p2p=0.0,
                 optimizer_sync=optimizer_sync)


def merge_traces(paths: list, skip: int = 1) -> BubbleMap:
    """All ranks' traces as one measured bubble map, with the analytic fractions beside it."""
    if not paths:
        raise BaftError("no profiler traces were written; did the run call baft.initialize?")
    return merge_trace_docs([read_json(p) for p in paths], skip)


def merge_trace_docs(traces: list[dict], skip: int = 1) -> BubbleMap:
    """:func:`merge_traces` of traces already read: medians over each trace's iterations after the first ``skip``."""
    head = traces[0]
    profiles = sorted((median_profile(t, skip) for t in traces), key=lambda p: p.rank)
    stages = head["stages"]
    analytic = analytic_bubble_map(head["schedule"], stages, head["micro_batches"],
                                   measured_costs(profiles, stages, head.get("optimizer_sync", False)))
    return BubbleMap(
        schedule=head["schedule"], stages=stages, micro_batches=head["micro_batches"], source="measured",
        bubbles=[b for p in profiles if p.dp_rank == 0 for b in measured_bubbles(p)], ranks=profiles,
        data_parallel=head["data_parallel"], iterations=len(head["iterations"][skip:]),
        optimizer_sync=head.get("optimizer_sync", False),
        makespan=max(p.iteration_time for p in profiles),
        model={**head["model"], **{key: {k: v for t in traces for k, v in t["model"][key].items()}
                                   for key in ("layout", "chunk_sizes")}},
        analytic_bubble_fraction=dict(analytic.analytic_bubble_fraction))


def trace_paths(directory) -> list[Path]:
    return sorted(Path(directory).glob("trace-rank*.json"))
