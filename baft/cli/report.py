"""What ``baft report RUN_DIR`` prints and draws: where the time of every recovery went."""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path

from rich.table import Table

from baft.cli.text import to_text
from baft.errors import BaftError
from baft.recovery.record import PHASE_NAMES, PHASES, Recovery

PHASE_COLOURS = {"T0": "#c44e52", "T1": "#8172b2", "T2": "#ccb974", "T3": "#4c72b0", "T4": "#55a868"}


def _s(seconds: float) -> str:
    return f"{seconds:.2f}"


def recovery_table(recs: list[Recovery]) -> Table:
    """One row per recovery (phases in seconds), and a median row when there is more than one."""
    table = Table(title=f"recoveries: {len(recs)}", caption="seconds; " + ", ".join(PHASE_NAMES.values()),
                  caption_justify="left")
    table.add_column("restart", justify="right")
    table.add_column("fault")
    table.add_column("kind")
    table.add_column("restored step", justify="right")
    table.add_column("source")
    for name in (*PHASES, "total"):
        table.add_column(name, justify="right")
    for r in recs:
        table.add_row(str(r.restart), r.fault, r.kind or "—", _restored(r), r.source or "—", *map(_s, r.phases),
                      _s(r.total))
    if len(recs) > 1:
        medians = [statistics.median(getattr(r, p) for r in recs) for p in (*PHASES, "total")]
        table.add_section()
        table.add_row("median", "", "", "", "", *map(_s, medians))
    return table


def _restored(r: Recovery) -> str:
    if r.restored_step is None:
        return "—"
    return f"{r.restored_step}" + (f" (lost {r.lost_steps})" if r.lost_steps else "")


def render_recovery_text(recs: list[Recovery]) -> str:
    """:func:`recovery_table` as plain text."""
    return to_text(recovery_table(recs))


def draw_recovery(recs: list[Recovery], path) -> Path:
    """Stacked horizontal bars, one per recovery, one colour per phase T0..T4; seconds on the x axis."""
    if not recs:
        raise BaftError(f"{path}: no recoveries to draw")
    from matplotlib.figure import Figure  # loaded to draw only: `baft train` prints the table without it

    fig = Figure(figsize=(11, 0.8 * len(recs) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(recs))
    left = [0.0] * len(recs)
    for i, phase in enumerate(PHASES):
        widths = [r.phases[i] for r in recs]
        ax.barh(ys, widths, left=left, height=0.6, color=PHASE_COLOURS[phase], label=PHASE_NAMES[phase],
                edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, widths)]
    end = max(left) or 1.0
    for y, r in zip(ys, recs):
        ax.text(sum(r.phases) + end * 0.01, y, f"{r.total:.1f} s", va="center", fontsize=9)
    ax.set_yticks(list(ys), [_bar_label(r) for r in recs], fontsize=9)
    ax.set_ylim(len(recs) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.1)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("where the recovery time went", fontsize=11)
    fig.legend(loc="outside lower center", ncols=len(PHASES), fontsize=9, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _bar_label(r: Recovery, width: int = 34) -> str:
    fault = textwrap.wrap(f"#{r.restart} {r.fault}", width, max_lines=2, placeholder=" …")
    source = f"from step {r.restored_step} ({r.source})" if r.restored_step is not None else (r.source or "")
    return "\n".join(fault + [source]).rstrip()
