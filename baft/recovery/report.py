"""What ``baft report RUN_DIR`` prints and draws: where the time of every recovery went.

A run directory holds ``recovery.jsonl``, written by the restart hook
(:class:`baft.recovery.restore.RecoveryReport`): one JSON object per line, one line per
fault and restart::

    {"restart": 1, "fault": "kill rank 1 at step 7 (backward)", "killed_at": 1763769600.5,
     "restored_step": 6, "source": "memory", "lost_steps": 1,
     "T0": 0.41, "T1": 3.2, "T2": 1.1, "T3": 0.08, "T4": 0.9, "total": 5.69}

- ``restart``: restart number (int); ``fault``: what was injected or what failed (text);
  ``killed_at``: unix time of the fault, or null when unknown.
- ``restored_step``: the step training resumed from (int); ``lost_steps``: steps done
  after it and redone (int); ``source``: where the state came from, one of ``memory``
  (the node's snapshot manager), ``parity`` (rebuilt from peers' erasure-coded shares),
  ``disk`` (a persisted snapshot) or ``fresh`` (no snapshot: training restarted from step 0).
- Phases, in seconds: ``T0`` rollback (wall time of the work lost since the restored
  step), ``T1`` process restart, ``T2`` process-group init, ``T3`` state load, ``T4``
  warm-up until the first resumed iteration completes; ``total`` their sum (recomputed
  from the phases when absent).

``T0``..``T4`` are required, finite and not negative; the other keys are checked when
present; unknown keys are ignored. Blank lines are skipped.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from rich.table import Table

from baft.cli.show import to_text
from baft.errors import BaftError

FILENAME = "recovery.jsonl"
PHASES = ("T0", "T1", "T2", "T3", "T4")
PHASE_NAMES = {
    "T0": "T0 rollback (lost work)",
    "T1": "T1 process restart",
    "T2": "T2 process-group init",
    "T3": "T3 state load",
    "T4": "T4 warm-up",
}
PHASE_COLOURS = {"T0": "#c44e52", "T1": "#8172b2", "T2": "#ccb974", "T3": "#4c72b0", "T4": "#55a868"}
SOURCES = ("memory", "parity", "disk", "fresh")


@dataclass(frozen=True)
class Recovery:
    """One fault and the restart that recovered from it; phase times in seconds."""

    restart: int
    fault: str
    killed_at: float | None
    restored_step: int | None
    source: str | None
    lost_steps: int | None
    T0: float
    T1: float
    T2: float
    T3: float
    T4: float
    total: float

    @property
    def phases(self) -> tuple[float, ...]:
        return tuple(getattr(self, p) for p in PHASES)


def load_recoveries(run_dir) -> list[Recovery]:
    """Every recovery of a run, in file order; a :class:`BaftError` naming the file and line if one is bad."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise BaftError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise BaftError(f"{run_dir}: not a directory (give the run directory that holds {FILENAME})")
    path = run_dir / FILENAME
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise BaftError(f"{path}: no such file (the run recorded no restart)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise BaftError(f"{path}: cannot read ({err})") from None
    recs = []
    for number, text in enumerate(lines, 1):
        if text.strip():
            recs.append(_parse_line(text, f"{path}:{number}", position=len(recs) + 1))
    if not recs:
        raise BaftError(f"{path}: empty (the run recorded no restart)")
    return recs


def _parse_line(text: str, where: str, position: int) -> Recovery:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise BaftError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(doc, dict):
        raise BaftError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    phases = {p: _seconds(doc, p, where) for p in PHASES}
    total = _seconds(doc, "total", where) if "total" in doc else sum(phases.values())
    source = doc.get("source")
    if source is not None and source not in SOURCES:
        raise BaftError(f"{where}: 'source' is {source!r}, expected one of {', '.join(SOURCES)}")
    killed_at = doc.get("killed_at")
    if killed_at is not None and not _is_number(killed_at):
        raise BaftError(f"{where}: 'killed_at' must be a unix time or null, got {killed_at!r}")
    return Recovery(restart=_count(doc, "restart", where, default=position), fault=str(doc.get("fault", "")),
                    killed_at=killed_at, restored_step=_count(doc, "restored_step", where),
                    source=source, lost_steps=_count(doc, "lost_steps", where), total=total, **phases)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(doc: dict, key: str, where: str) -> float:
    if key not in doc:
        raise BaftError(f"{where}: missing '{key}' ({PHASE_NAMES.get(key, key)}, seconds)")
    value = doc[key]
    if not _is_number(value):
        raise BaftError(f"{where}: '{key}' must be a number of seconds, got {value!r}")
    if value < 0:
        raise BaftError(f"{where}: '{key}' is {value} s; a phase cannot take negative time")
    return float(value)


def _count(doc: dict, key: str, where: str, default: int | None = None) -> int | None:
    value = doc.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise BaftError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _s(seconds: float) -> str:
    return f"{seconds:.2f}"


def recovery_table(recs: list[Recovery]) -> Table:
    """One row per recovery (phases in seconds), and a median row when there is more than one."""
    table = Table(title=f"recoveries: {len(recs)}", caption="seconds; " + ", ".join(PHASE_NAMES.values()),
                  caption_justify="left")
    table.add_column("restart", justify="right")
    table.add_column("fault")
    table.add_column("restored step", justify="right")
    table.add_column("source")
    for name in (*PHASES, "total"):
        table.add_column(name, justify="right")
    for r in recs:
        table.add_row(str(r.restart), r.fault, _restored(r), r.source or "—", *map(_s, r.phases), _s(r.total))
    if len(recs) > 1:
        medians = [statistics.median(getattr(r, p) for r in recs) for p in (*PHASES, "total")]
        table.add_section()
        table.add_row("median", "", "", "", *map(_s, medians))
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
