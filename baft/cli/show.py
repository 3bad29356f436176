"""What ``baft show`` prints and draws: a bubble map, a plan or a traced run as a table, a timeline as a PNG.

Tables are :class:`rich.table.Table` objects (the CLI prints them); the ``render_*``
functions give the same table as plain text for tests and pipes. Figures are drawn on a
bare :class:`matplotlib.figure.Figure`, which renders through Agg without touching pyplot
or a display, so they work headless.

Times in bubble maps and plans are seconds; everything shown is in milliseconds and MB (10^6 bytes).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from rich.console import Console
from rich.table import Table

from baft.pipeline.bubblemap import Bubble, BubbleMap, RankProfile
from baft.snapshot.planner import Plan, RankPlan
from baft.snapshot.trace import RankCopies, RunTimeline

if TYPE_CHECKING:
    from baft.pipeline.timeline import Timeline

DASH = "—"

# Instruction kinds, their colours in figures, and their legend names.
KIND_COLOURS = {
    "forward": ("#4c72b0", "forward"),
    "backward": ("#55a868", "backward"),
    "send": ("#8172b2", "send"),
    "recv": ("#c8c8c8", "receive (waiting)"),
    "load": ("#ccb974", "load micro-batch"),
    "optimizer": ("#dd8452", "reduce / optimizer step"),
    "compute": ("#6f7f8f", "busy"),
    "other": ("#937860", "other"),
}
_KIND_PREFIXES = (
    ("Forward", "forward"), ("Backward", "backward"), ("Send", "send"), ("Recv", "recv"),
    ("Load", "load"), ("Reduce", "optimizer"), ("OptimizerStep", "optimizer"),
)
BUBBLE_STYLE = {"facecolor": (0.85, 0.1, 0.1, 0.22), "edgecolor": (0.75, 0.0, 0.0, 0.8), "hatch": "///",
                "linewidth": 0.6}
COPY_COLOUR = "#f2c12e"
FLUSH_COLOUR = "#c51b7d"
_ROUNDING = 1e-9  # bubble lengths are differences of floats: 120 ms / 40 ms must be 3 iterations


# --- tables -------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _mb(nbytes: float) -> str:
    mb = nbytes / 1e6
    return f"{mb:.1f}" if mb >= 0.1 or mb == 0 else f"{mb:.2g}"


def _pct(fraction: float) -> str:
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
    chunks = f", {bmap.chunks} chunks/stage" if bmap.chunks > 1 else ""
    dp = f", {bmap.data_parallel} data-parallel replicas" if bmap.data_parallel > 1 else ""
    runs = f", median of {bmap.iterations} iterations" if bmap.iterations > 1 else \
        ", one iteration" if bmap.iterations == 1 else ""
    return f"{bmap.source} bubble map: {bmap.schedule}, {bmap.stages} stages x {bmap.micro_batches} micro-batches" \
           f"{chunks}{dp}{runs}"


def _stage_cells(row: StageRow) -> list[str]:
    stage = f"{row.stage}" + (f" (rank {row.rank})" if row.rank is not None else "")
    iteration = _ms(row.iteration_time) + (f" ± {_ms(row.iteration_spread)}" if row.iteration_spread else "")
    analytic = _pct(row.analytic_fraction) if row.analytic_fraction is not None else DASH
    diff = f"{row.difference:+.1f}" if row.difference is not None else DASH
    if row.profile is None:
        state = copy = verdict = DASH
    else:
        sb = row.profile.state_bytes
        state = f"{_mb(sb.parameters)} / {_mb(sb.optimizer)} / {_mb(sb.other)}"
        copy = _ms(row.copy_time) if not math.isinf(row.copy_time) else DASH
        verdict = fit_verdict(row.copy_time, row.bubble_time)
    return [stage, iteration, _ms(row.bubble_time), _pct(row.bubble_fraction), analytic, diff, state, copy, verdict]


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
    planned = sum(s.nbytes for s in r.slots)
    return [str(r.rank), str(r.stage), _mb(r.nbytes), _ms(r.bubble_time), _mb(planned), _pct(r.bubble_used),
            _mb(r.leftover_bytes), _ms(r.stall), f"{r.overhead_per_snapshot:.2%}"]


def summarize_run(run: RunTimeline) -> Table:
    """Where every rank copied its snapshot in the traced iteration: inside bubbles, or flushed before the optimizer step."""
    table = Table(title=f"baft's copies in step {run.step}", caption=_copies_line(run), caption_justify="left")
    for name in ("rank", "stage", "snapshot MB", "in bubbles MB", "in bubbles", "copying ms", "flush MB",
                 "stall ms"):
        table.add_column(name, justify="right")
    stages = {p.rank: p.stage for p in run.bubble_map.ranks}
    for rank, copies in sorted(run.copies.items()):
        table.add_row(str(rank), str(stages.get(rank, DASH)), *_rank_copy_cells(copies))
    return table


def _rank_copy_cells(c: RankCopies) -> list[str]:
    if c.flush is None:
        return [_mb(c.snapshot_bytes)] + [DASH] * 5
    copying = sum(end - start for _, start, end, _ in c.bubbles)
    return [_mb(c.snapshot_bytes), _mb(c.in_bubbles), _pct(c.share_in_bubbles), _ms(copying), _mb(c.flush[2]), f"{c.stall * 1e3:.2f}"]


def _copies_line(run: RunTimeline) -> str:
    """One line: what share of the state the traced iteration copied inside bubbles, and the longest stall."""
    if not run.copied_bytes:
        return f"step {run.step}: no snapshot copies traced (a policy other than baft's, or no snapshot due)"
    stall = max(c.stall for c in run.copies.values())
    return (f"step {run.step}: {_pct(run.share_in_bubbles)} of the snapshot ({_mb(run.copied_bytes)} MB) copied "
            f"inside bubbles, stall {stall * 1e3:.2f} ms")


def render_run_text(run: RunTimeline) -> str:
    """:func:`summarize_run` as plain text."""
    return to_text(summarize_run(run))


def to_text(table: Table, width: int = 200) -> str:
    """A rich table as plain text (no colour, no terminal needed)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def render_text(bmap: BubbleMap) -> str:
    """:func:`summarize` as plain text."""
    return to_text(summarize(bmap))


def render_plan_text(plan: Plan) -> str:
    """:func:`summarize_plan` as plain text."""
    return to_text(summarize_plan(plan))


# --- figures ------------------------------------------------------------------------------


@dataclass
class Lane:
    """One horizontal lane of a timeline figure: a rank's (or stage's) bars and bubbles, in seconds."""

    label: str
    stage: int
    rank: int | None
    bars: list[tuple[float, float, str, str]] = field(default_factory=list)  # start, duration, kind, text
    bubbles: list[Bubble] = field(default_factory=list)


def instruction_kind(name: str) -> str:
    """The colour class of an instruction, from its name (``"RecvGrad(buffer_id=0)"`` -> ``"recv"``)."""
    return next((kind for prefix, kind in _KIND_PREFIXES if name.startswith(prefix)), "other")


def timeline_lanes(bmap: BubbleMap, timeline: Timeline | None = None) -> list[Lane]:
    """The lanes of :func:`draw_timeline`: one per profiled rank, else one per stage."""
    if bmap.ranks:
        return [_profile_lane(bmap, p) for p in sorted(bmap.ranks, key=lambda p: (p.stage, p.dp_rank))]
    return [_analytic_lane(bmap, stage, timeline) for stage in range(bmap.stages)]


def _profile_lane(bmap: BubbleMap, profile: RankProfile) -> Lane:
    bubbles = [b for b in bmap.stage_bubbles(profile.stage)
               if b.rank == profile.rank or (b.rank is None and profile.dp_rank == 0)]
    bars = []
    for ins in profile.instructions:
        kind = instruction_kind(ins.name)
        text = ""
        if kind in ("forward", "backward") and ins.micro_batch is not None:
            text = f"{kind[0].upper()}{ins.micro_batch}"
        bars.append((ins.start, ins.duration, kind, text))
    label = f"stage {profile.stage}\nrank {profile.rank}" + (f" (dp {profile.dp_rank})" if bmap.data_parallel > 1
                                                             else "")
    return Lane(label, profile.stage, profile.rank, bars, bubbles)


def _analytic_lane(bmap: BubbleMap, stage: int, timeline: Timeline | None) -> Lane:
    bubbles = bmap.stage_bubbles(stage)
    if timeline is not None:
        bars = [(i.start, i.end - i.start, _op_kind(i.label), i.label) for i in timeline.busy(stage)]
    else:
        bars, cursor = [], 0.0
        for b in bubbles + [Bubble(stage, bmap.makespan, bmap.makespan, -1, "", "", "")]:
            if b.start > cursor:
                bars.append((cursor, b.start - cursor, "compute", ""))
            cursor = max(cursor, b.end)
    return Lane(f"stage {stage}", stage, None, bars, bubbles)


def _op_kind(label: str) -> str:
    return {"F": "forward", "B": "backward"}.get(label[:1], "optimizer")


def draw_timeline(bmap: BubbleMap, path, title: str | None = None,
                  timeline: Timeline | None = None) -> Path:
    """Draw one lane per rank (measured) or stage (analytic): instructions as bars, bubbles shaded.

    For an analytic map, pass the :class:`~baft.pipeline.timeline.Timeline` it was simulated from to
    draw its forward/backward/optimizer ops; without it the busy time is drawn as the
    complement of the bubbles within the makespan. Writes a PNG to ``path`` and returns it.
    """
    lanes = timeline_lanes(bmap, timeline)
    return _save(_figure(bmap, lanes, title, copies={}), path)


def draw_run(run: RunTimeline, path, title: str | None = None) -> Path:
    """One traced iteration of a run: every rank's instructions and bubbles, baft's copies inside
    them and the flush before the optimizer step, titled with the share copied inside bubbles."""
    bmap = run.bubble_map
    lanes = timeline_lanes(bmap)
    copies, flushes = {}, {}
    for i, lane in enumerate(lanes):
        rank = run.copies.get(lane.rank)
        if rank is None or rank.flush is None:
            continue
        copies[i] = [(start, end - start) for _, start, end, _ in rank.bubbles]
        flushes[i] = [(rank.flush[0], rank.stall)]
        lane.label += f"\ncopied in bubbles {_pct(rank.share_in_bubbles)}\nstall {rank.stall * 1e3:.2f} ms"
    title = title or f"{bmap.schedule}, {bmap.stages} stages x {bmap.micro_batches} micro-batches, {_copies_line(run)}"
    return _save(_figure(bmap, lanes, title, copies, "copy (measured)", flushes), path)


def draw_plan(plan: Plan, bmap: BubbleMap, path, title: str | None = None,
              timeline: Timeline | None = None) -> Path:
    """:func:`draw_timeline` with the plan's copies drawn inside the bubbles they are planned into."""
    lanes = timeline_lanes(bmap, timeline)
    copies = {}
    for i, lane in enumerate(lanes):
        rank_plan = _plan_for_lane(plan, lane)
        if rank_plan is None:
            continue
        by_slot = {b.slot: b for b in lane.bubbles}
        copies[i] = [(by_slot[s.slot].start, s.nbytes / rank_plan.bandwidth) for s in rank_plan.slots
                     if s.slot in by_slot]
        if rank_plan.stall > 0:
            lane.label += f"\nstall {_ms(rank_plan.stall)} ms"
    title = title or (_figure_title(bmap) + f" + plan (every {plan.period} it., "
                                            f"overhead {plan.predicted_overhead:.2%})")
    return _save(_figure(bmap, lanes, title, copies), path)


def _plan_for_lane(plan: Plan, lane: Lane) -> RankPlan | None:
    if lane.rank is not None:
        return plan.for_rank(lane.rank)
    return next((r for r in plan.ranks if r.stage == lane.stage), None)


def _figure_title(bmap: BubbleMap) -> str:
    return f"{bmap.schedule}: {bmap.stages} stages x {bmap.micro_batches} micro-batches ({bmap.source})"


def _figure(bmap: BubbleMap, lanes: list[Lane], title: str | None, copies: dict[int, list[tuple[float, float]]],
            copy_label: str = "planned copy", flushes: dict[int, list[tuple[float, float]]] | None = None) -> Figure:
    """The timeline; ``copies`` and ``flushes`` are (start, duration) spans per lane index."""
    flushes = flushes or {}
    fig = Figure(figsize=(13, 1.1 * len(lanes) + 1.9), layout="constrained")
    ax = fig.add_subplot()
    end = max([bmap.makespan] + [s + d for lane in lanes for s, d, _, _ in lane.bars]
              + [b.end for lane in lanes for b in lane.bubbles])
    kinds = []
    for y, lane in enumerate(lanes):
        kinds += _draw_lane(ax, y, lane, end)
        for start, duration in copies.get(y, []):
            ax.broken_barh([(start * 1e3, duration * 1e3)], (y + 0.08, 0.28), facecolor=COPY_COLOUR,
                           edgecolor="black", linewidth=0.5, zorder=4)
        for start, duration in flushes.get(y, []):
            _draw_flush(ax, y, start, duration)
    ax.set_yticks(range(len(lanes)), [_lane_label(lane, bmap) for lane in lanes], fontsize=9)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("time since iteration start (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or _figure_title(bmap), fontsize=11)
    handles = [Patch(facecolor=KIND_COLOURS[k][0], label=KIND_COLOURS[k][1]) for k in KIND_COLOURS if k in kinds]
    if any(lane.bubbles for lane in lanes):
        handles.append(Patch(**BUBBLE_STYLE, label="bubble"))
    if any(copies.values()):
        handles.append(Patch(facecolor=COPY_COLOUR, edgecolor="black", label=copy_label))
    if any(flushes.values()):
        handles.append(Patch(facecolor=FLUSH_COLOUR, edgecolor="black", label="flush before optimizer step (stall)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8), fontsize=9, frameon=False)
    return fig


def _draw_lane(ax, y: int, lane: Lane, end: float) -> list[str]:
    """Draw a lane's bars and bubbles at height ``y``; return the kinds drawn."""
    kinds = sorted({kind for _, duration, kind, _ in lane.bars if duration > 0})
    for kind in kinds:
        spans = [(s * 1e3, d * 1e3) for s, d, k, _ in lane.bars if k == kind]
        ax.broken_barh(spans, (y - 0.3, 0.6), facecolor=KIND_COLOURS[kind][0], edgecolor="white", linewidth=0.4,
                       zorder=2)
    for start, duration, _, text in lane.bars:
        if text and duration / end > 0.004 + 0.006 * len(text):
            ax.text((start + duration / 2) * 1e3, y, text, ha="center", va="center", fontsize=7, color="white",
                    zorder=5)
    if lane.bubbles:
        ax.broken_barh([(b.start * 1e3, b.length * 1e3) for b in lane.bubbles], (y - 0.42, 0.84), zorder=3,
                       **BUBBLE_STYLE)
    return kinds


def _draw_flush(ax, y: int, start: float, duration: float) -> None:
    """The flush as its span, with a marker above it: it may last too little to see."""
    ax.broken_barh([(start * 1e3, duration * 1e3)], (y + 0.08, 0.28), facecolor=FLUSH_COLOUR, edgecolor="black",
                   linewidth=0.5, zorder=4)
    ax.plot([start * 1e3], [y - 0.36], marker="v", markersize=7, color=FLUSH_COLOUR, markeredgecolor="black",
            markeredgewidth=0.5, zorder=6)


def _lane_label(lane: Lane, bmap: BubbleMap) -> str:
    if lane.rank is not None:
        profile = next(p for p in bmap.ranks if p.rank == lane.rank)
        total = profile.iteration_time or bmap.makespan
    else:
        total = bmap.makespan
    idle = sum(b.length for b in lane.bubbles)
    return f"{lane.label}\nbubble {_pct(idle / total if total > 0 else 0.0)}"


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
