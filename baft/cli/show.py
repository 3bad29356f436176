"""What ``baft show`` prints: a bubble map, a plan or a traced run as a table (its pictures: :mod:`baft.cli.figures`).

Tables are :class:`rich.table.Table` objects (the CLI prints them); the ``render_*``
functions give the same table as plain text for tests and pipes.

Times in bubble maps and plans are seconds; everything shown is in milliseconds and MB (10^6 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table

from baft.cli.text import to_text
from baft.pipeline.bubblemap import BubbleMap, RankProfile
from baft.snapshot.planner import Plan, RankPlan

if TYPE_CHECKING:
    from baft.snapshot.trace import RankCopies, RunTimeline

DASH = "—"
_ROUNDING = 1e-9  # bubble lengths are differences of floats: 120 ms / 40 ms must be 3 iterations

# --- tables -------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def mb(nbytes: float) -> str:
    megabytes = nbytes / 1e6
    return f"{megabytes:.1f}" if megabytes >= 0.1 or megabytes == 0 else f"{megabytes:.2g}"


def pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def snapshot_bytes(bmap: BubbleMap, profile: RankProfile) -> int:
    """Bytes one rank copies into bubbles per snapshot, as the planner counts them.

    The profiled chunk sizes where the map has them, else the rank's 1/d shard of its
    parameters and optimizer state.
    """
    chunks = bmap.model.get("chunk_sizes", {}).get(str(profile.rank))
    if chunks is not None:
        return sum(chunks)
    state = profile.state_bytes
    return math.ceil((state.parameters + state.optimizer) / max(1, bmap.data_parallel))


def fit_verdict(copy_time: float, bubble_time: float) -> str:
    """Whether one snapshot's copy fits in one iteration's bubbles, in words."""
    if math.isinf(copy_time):
        return "unknown (no copy bandwidth)"
    if copy_time <= 0:
        return "yes (nothing to copy)"
    if bubble_time <= 0:
        return "no (no bubbles)"
    ratio = copy_time / bubble_time
    if ratio <= 1 + _ROUNDING:
        return f"yes: uses {ratio:.0%} of the bubble time"
    iterations = math.ceil(ratio - _ROUNDING)
    return f"no: bubbles hold {1 / ratio:.0%}, needs {iterations} iterations of bubbles"


@dataclass(frozen=True)
class StageRow:
    """The figures of one stage that :func:`summarize` shows."""

    stage: int
    rank: int | None
    measured: bool
    iteration_time: float
    iteration_spread: float
    bubble_time: float
    analytic_fraction: float | None
    profile: RankProfile | None
    copy_time: float | None

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_time / self.iteration_time if self.iteration_time > 0 else 0.0

    @property
    def difference(self) -> float | None:
        """Measured minus analytic bubble fraction, in percentage points (None unless both exist)."""
        if not self.measured or self.analytic_fraction is None:
            return None
        return (self.bubble_fraction - self.analytic_fraction) * 100


def stage_rows(bmap: BubbleMap) -> list[StageRow]:
    """One row per stage: dp_rank 0's profile where measured, the makespan for analytic maps."""
    rows = []
    for stage in range(bmap.stages):
        profile = bmap.rank_profile(stage, 0)
        measured = profile is not None and profile.iteration_time > 0
        bubble_time = bmap.bubble_time(stage)
        copy = profile.copy_time(snapshot_bytes(bmap, profile)) if profile is not None else None
        rows.append(StageRow(
            stage=stage, rank=profile.rank if profile is not None else None, measured=measured,
            iteration_time=profile.iteration_time if measured else bmap.makespan,
            iteration_spread=profile.iteration_spread if measured else 0.0,
            bubble_time=bubble_time, analytic_fraction=bmap.analytic_bubble_fraction.get(stage),
            profile=profile, copy_time=copy))
    return rows


def agreement_line(bmap: BubbleMap, rows: list[StageRow]) -> str:
    """How far apart the measured and analytic bubble fractions are, over all stages."""
    if bmap.source != "measured":
        return "analytic map: its bubble fractions are the schedule model's; nothing measured to compare"
    diffs = [(abs(r.difference), r.stage) for r in rows if r.difference is not None]
    if not diffs:
        return "measured map without an analytic prediction: nothing to compare against"
    worst, stage = max(diffs)
    return (f"measured vs analytic bubble fraction: max |difference| {worst:.1f} percentage points "
            f"(stage {stage}) over {len(diffs)} stage{'s' if len(diffs) != 1 else ''}")


def summarize(bmap: BubbleMap) -> Table:
    """The bubble map as a table, one row per stage, with the measured/analytic agreement below it."""
    rows = stage_rows(bmap)
    shard = f" (1/{bmap.data_parallel} shard)" if bmap.data_parallel > 1 else ""
    table = Table(title=_map_title(bmap), caption=agreement_line(bmap, rows), caption_justify="left")
    table.add_column("stage")
    for name in ("iteration ms", "bubble ms", "bubble", "analytic", "diff (pts)"):
        table.add_column(name, justify="right")
    table.add_column("state MB\nparams / optim / other", justify="right")
    table.add_column(f"copy ms{shard}", justify="right")
    table.add_column("fits in one iteration's bubbles")
    for row in rows:
        table.add_row(*_stage_cells(row))
    return table


def _map_title(bmap: BubbleMap) -> str:
    model_chunks = f", {bmap.model_chunks} model chunks/stage" if bmap.model_chunks > 1 else ""
    dp = f", {bmap.data_parallel} data-parallel replicas" if bmap.data_parallel > 1 else ""
    runs = f", median of {bmap.iterations} iterations" if bmap.iterations > 1 else \
        ", one iteration" if bmap.iterations == 1 else ""
    return f"{bmap.source} bubble map: {bmap.schedule}, {bmap.stages} stages x {bmap.micro_batches} micro-batches" \
           f"{model_chunks}{dp}{runs}"


def _stage_cells(row: StageRow) -> list[str]:
    stage = f"{row.stage}" + (f" (rank {row.rank})" if row.rank is not None else "")
    iteration = ms(row.iteration_time) + (f" ± {ms(row.iteration_spread)}" if row.iteration_spread else "")
    analytic = pct(row.analytic_fraction) if row.analytic_fraction is not None else DASH
    diff = f"{row.difference:+.1f}" if row.difference is not None else DASH
    if row.profile is None:
        state = copy = verdict = DASH
    else:
        sb = row.profile.state_bytes
        state = f"{mb(sb.parameters)} / {mb(sb.optimizer)} / {mb(sb.other)}"
        copy = ms(row.copy_time) if not math.isinf(row.copy_time) else DASH
        verdict = fit_verdict(row.copy_time, row.bubble_time)
    return [stage, iteration, ms(row.bubble_time), pct(row.bubble_fraction), analytic, diff, state, copy, verdict]


def summarize_plan(plan: Plan) -> Table:
    """The plan as a table, one row per rank, with the period, predicted overhead and notes below it."""
    every = f"snapshot every {plan.period} iteration{'s' if plan.period != 1 else ''}"
    overhead = f"predicted overhead {plan.predicted_overhead:.2%} of iteration time (budget {plan.budget:.1%})"
    caption = [f"{every}; {overhead}"] + [f"note: {n}" for n in plan.notes]
    title = f"plan: {plan.schedule}, {plan.stages} stages x {plan.micro_batches} micro-batches"
    table = Table(title=title + (f" (from {plan.source})" if plan.source else ""),
                  caption="\n".join(caption), caption_justify="left")
    for name in ("rank", "stage", "state MB", "bubble ms", "in bubbles MB", "bubble used", "leftover MB",
                 "stall ms", "overhead/snapshot"):
        table.add_column(name, justify="right")
    for r in plan.ranks:
        table.add_row(*_rank_plan_cells(r))
    return table


def _rank_plan_cells(r: RankPlan) -> list[str]:
    planned = sum(b.nbytes for b in r.bubbles)
    return [str(r.rank), str(r.stage), mb(r.nbytes), ms(r.bubble_time), mb(planned), pct(r.bubble_used),
            mb(r.leftover_bytes), ms(r.stall), f"{r.overhead_per_snapshot:.2%}"]


def summarize_run(run: RunTimeline) -> Table:
    """Where every rank copied its snapshot in the traced iteration: inside bubbles, or flushed before the optimizer step."""
    table = Table(title=f"baft's copies in step {run.step}", caption=copies_line(run), caption_justify="left")
    for name in ("rank", "stage", "snapshot MB", "in bubbles MB", "in bubbles", "copying ms", "flush MB",
                 "stall ms"):
        table.add_column(name, justify="right")
    stages = {p.rank: p.stage for p in run.bubble_map.ranks}
    for rank, copies in sorted(run.copies.items()):
        table.add_row(str(rank), str(stages.get(rank, DASH)), *_rank_copy_cells(copies))
    return table


def _rank_copy_cells(c: RankCopies) -> list[str]:
    if c.flush is None:
        return [mb(c.snapshot_bytes)] + [DASH] * 5
    copying = sum(end - start for _, start, end, _ in c.bubbles)
    return [mb(c.snapshot_bytes), mb(c.in_bubbles), pct(c.share_in_bubbles), ms(copying), mb(c.flush[2]), f"{c.stall * 1e3:.2f}"]


def copies_line(run: RunTimeline) -> str:
    """One line: what share of the state the traced iteration copied inside bubbles, and the longest stall."""
    if not run.copied_bytes:
        return f"step {run.step}: no snapshot copies traced (a policy other than baft's, or no snapshot due)"
    stall = max(c.stall for c in run.copies.values())
    return (f"step {run.step}: {pct(run.share_in_bubbles)} of the snapshot ({mb(run.copied_bytes)} MB) copied "
            f"inside bubbles, stall {stall * 1e3:.2f} ms")


def render_run_text(run: RunTimeline) -> str:
    """:func:`summarize_run` as plain text."""
    return to_text(summarize_run(run))


def render_text(bmap: BubbleMap) -> str:
    """:func:`summarize` as plain text."""
    return to_text(summarize(bmap))


def render_plan_text(plan: Plan) -> str:
    """:func:`summarize_plan` as plain text."""
    return to_text(summarize_plan(plan))
