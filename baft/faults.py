"""The run's fault log, ``RUN_DIR/chaos.jsonl``: one JSON line per fault, written just before the kill.

A fault is injected (:mod:`baft.recovery.chaos`: a rank kills itself) or detected (a hung rank its node's
manager killed: :mod:`baft.manager.watchdog`; a warm rank killed by a signal nothing passed on to it, logged as it
died by the warm server that reaped it, :mod:`baft.warm.server`, where nothing logged its attempt's fault). Each
line holds ``time`` (unix time of the kill), ``restart`` (the attempt it ended) and ``what`` (one line of text); one
a manager detected also ``by`` (who killed it). The
restart's recovery record (:mod:`baft.recovery.record`) names the fault and counts its phases from it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from baft.jsonfile import append_line

FILENAME = "chaos.jsonl"


def append(run_dir, what: str, restart: int, at: Optional[float] = None, **more) -> None:
    """Log a fault of attempt ``restart`` at unix time ``at`` (now by default), on disk before it returns."""
    line = {"time": time.time() if at is None else at, "restart": restart, "what": what, **more}
    append_line(Path(run_dir) / FILENAME, line, sync=True)


def append_first(run_dir, what: str, restart: int) -> None:
    """Log a fault of attempt ``restart`` where none is logged for it yet: the first ended it (a peer that failed
    because of it, or a later account of it, is not its cause)."""
    if not any(f.get("restart") == restart for f in read(run_dir)):
        append(run_dir, what, restart)


def read(run_dir) -> list[dict]:
    """Every fault logged in ``run_dir``, oldest first (a line a kill cut short is skipped)."""
    path = Path(run_dir) / FILENAME
    faults = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            faults.append(json.loads(line))
        except ValueError:
            continue
    return faults
