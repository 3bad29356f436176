"""The model against a measured run: a bubble map from ``baft profile`` through the same timeline and planner.

:func:`compare_to_measured` puts the predicted iteration time, bubbles and overhead beside the
measured ones (``baft simulate --measured``); :func:`scenario_from_measured` turns the measured
costs into a :class:`~baft.simulate.scenario.Scenario` (``experiments/lost_time.py --measured``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from rich.table import Table

from baft.errors import ConfigError
from baft.pipeline.bubblemap import BubbleMap
from baft.pipeline.timeline import analytic_bubble_map
from baft.simulate.model import state_chunks
from baft.simulate.scenario import Scenario
from baft.simulate.tables import plain_text
from baft.simulate.units import duration
from baft.snapshot.planner import DEFAULT_BUDGET, DEFAULT_MARGIN, choose_period, plan_rank


@dataclass
class Comparison:
    """Predicted against measured, per stage and for the overhead (:func:`compare_to_measured`)."""

    schedule: str
    stages: int
    micro_batches: int
    rows: list[dict]
    overhead: dict

    def table(self):
        """A rich table, one row per stage, with the overheads as its caption."""
        table = Table(title=f"simulator against measured ({self.schedule}, p={self.stages}, m={self.micro_batches})")
        for col in ("stage", "iteration meas.", "iteration pred.", "bubble meas.", "bubble pred.",
                    "fraction meas.", "fraction pred."):
            table.add_column(col, justify="right")
        for r in self.rows:
            table.add_row(str(r["stage"]), duration(r["iteration_measured"]), duration(r["iteration_predicted"]),
                          duration(r["bubble_measured"]), duration(r["bubble_predicted"]),
                          f"{r['fraction_measured']:.1%}", f"{r['fraction_predicted']:.1%}")
        o = self.overhead
        measured = "not given" if o["measured"] is None else f"{o['measured']:.2%}"
        table.caption = (f"baft overhead: measured {measured}, predicted {o['predicted']:.2%} "
                         f"(period {o['period']}); a synchronous copy would cost {o['sync_copy']:.1%}")
        return table

    def __rich__(self):
        return self.table()

    def render(self, width: int = 120) -> str:
        """The table as plain text, for ``click.echo``."""
        return plain_text([self.table()], width)

    def to_json(self) -> dict:
        """The rows and the overheads as plain JSON."""
        return dataclasses.asdict(self)


def _measured_inputs(bmap: BubbleMap):
    from baft.pipeline.merge import measured_costs  # imports torch: only when comparing

    if not bmap.ranks:
        raise ConfigError("compare_to_measured: the bubble map has no per-rank profiles; give one `baft profile` wrote")
    costs = measured_costs(bmap.ranks, bmap.stages, bmap.optimizer_sync)
    profiles = {s: bmap.rank_profile(s) or next(r for r in bmap.ranks if r.stage == s) for s in range(bmap.stages)}
    return costs, profiles


def compare_to_measured(bmap: BubbleMap, measured_overhead: float | None = None,
                        budget: float = DEFAULT_BUDGET, margin: float = DEFAULT_MARGIN) -> Comparison:
    """Feed a measured bubble map's per-op costs through the simulator's model, side by side.

    The measured forward, backward, optimizer and send times (medians per stage, as the
    profiler reduces them) go through the same timeline; each stage's measured state size and
    copy bandwidth go through the same planner. ``measured_overhead`` (fraction of iteration
    time a baft run actually lost) is shown beside the predicted one when given.
    """
    costs, profiles = _measured_inputs(bmap)
    pred = analytic_bubble_map(bmap.schedule, bmap.stages, bmap.micro_batches, costs, model_chunks=bmap.model_chunks)
    t = pred.makespan
    rows, plans = [], []
    dp = max(1, bmap.data_parallel)
    for stage in range(bmap.stages):
        prof = profiles[stage]
        nbytes = math.ceil((prof.state_bytes.parameters + prof.state_bytes.optimizer) / dp)
        plans.append(plan_rank(pred.stage_bubbles(stage), state_chunks(nbytes, 1 << 20), prof.copy_bandwidth, t,
                               rank=prof.rank, stage=stage, margin=margin))
        rows.append({"stage": stage,
                     "iteration_measured": bmap.iteration_time(stage), "iteration_predicted": t,
                     "bubble_measured": bmap.bubble_time(stage), "bubble_predicted": pred.bubble_time(stage),
                     "fraction_measured": bmap.bubble_fraction(stage),
                     "fraction_predicted": pred.bubble_time(stage) / t if t else 0.0,
                     "state_bytes": nbytes, "copy_bandwidth": prof.copy_bandwidth})
    period = choose_period(plans, budget)
    predicted = max(p.overhead_per_snapshot for p in plans) / period
    sync = max(p.nbytes / p.bandwidth for p in plans) / t if t else 0.0
    return Comparison(bmap.schedule, bmap.stages, bmap.micro_batches, rows,
                      {"measured": measured_overhead, "predicted": predicted, "period": period, "sync_copy": sync})


def scenario_from_measured(bmap: BubbleMap, base: Scenario) -> Scenario:
    """``base`` with the layout, per-op costs, state size and copy bandwidth a profile measured."""
    costs, profiles = _measured_inputs(bmap)
    v = max(1, bmap.model_chunks)
    doc = base.to_dict()
    doc.update({
        "p": bmap.stages, "m": bmap.micro_batches, "v": v, "schedule": bmap.schedule,
        "dp": max(1, bmap.data_parallel), "tp": 1,
        "forward_s": [f * v for f in costs.per_stage("forward", bmap.stages)],
        "backward_s": [b * v for b in costs.per_stage("backward", bmap.stages)],
        "optimizer_s": costs.per_stage("optimizer", bmap.stages), "p2p_s": costs.p2p,
        "state_bytes_per_rank": max(math.ceil((p.state_bytes.parameters + p.state_bytes.optimizer)
                                              / max(1, bmap.data_parallel)) for p in profiles.values()),
        "host_bw": statistics.median(p.copy_bandwidth for p in profiles.values()),
        "layers": None,
        "description": f"{base.description} (costs measured by baft profile)",
    })
    return Scenario.from_dict(doc, "measured bubble map")
