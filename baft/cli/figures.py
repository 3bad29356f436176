"""What ``baft show --png`` draws: a bubble map, a plan or a traced run as a timeline, one lane per rank.

Figures are drawn on a bare :class:`matplotlib.figure.Figure`, which renders through Agg
without touching pyplot or a display, so they work headless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from baft.cli.show import copies_line, pct
from baft.pipeline.bubblemap import Bubble, BubbleMap, RankProfile

if TYPE_CHECKING:
    from baft.pipeline.timeline import Timeline
    from baft.snapshot.trace import RunTimeline

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
        lane.label += f"\ncopied in bubbles {pct(rank.share_in_bubbles)}\nstall {rank.stall * 1e3:.2f} ms"
    title = title or f"{bmap.schedule}, {bmap.stages} stages x {bmap.micro_batches} micro-batches, {copies_line(run)}"
    return _save(_figure(bmap, lanes, title, copies, "copy (measured)", flushes), path)


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
    return f"{lane.label}\nbubble {pct(idle / total if total > 0 else 0.0)}"


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
