"""The recovery record: the T0..T4 of every restart, timed by the restart hook and read back.

A run directory holds ``recovery.jsonl``, written by the restart hook
(:class:`RecoveryReport`): one JSON object per line, one line per
fault and restart::

    {"restart": 1, "fault": "kill rank 1 at step 7 (backward)", "killed_at": 1763769600.5,
     "kind": "warm relaunch", "restored_step": 6, "source": "memory", "lost_steps": 1,
     "T0": 0.41, "T1": 3.2, "T2": 1.1, "T3": 0.08, "T4": 0.9, "total": 5.69}

- ``restart``: restart number (int; 0: a new launch that resumed the run, its T1 counted from the
  launch); ``fault``: what was injected, the hang a manager killed, the signal a warm rank was killed by
  that nothing passed on to it (the OOM killer's, a user's: logged by the warm server that reaped it), the exception
  a rank's script raised (``rank 0 raised OSError: ...``), or "process exit" (text);
  ``killed_at``: unix time of the fault, or null when unknown; ``kind``: how the job came back,
  ``in place`` (the survivors kept their processes, the killed rank was replaced:
  :mod:`baft.recovery.in_place`; its T1 is the wait for the replacement, T2 the engine built again),
  ``warm relaunch`` (torchrun restarted every rank, each forked from the node's warm server:
  :mod:`baft.warm`) or ``cold relaunch`` (each a new interpreter, as plain torchrun starts it).
- ``restored_step``: the step training resumed from (int); ``lost_steps``: steps done
  after it and redone (int, from ``losses.jsonl``; null where the script writes none); ``source``: where the state came from, one of ``memory``
  (the node's snapshot manager), ``parity`` (rebuilt from peers' erasure-coded shares),
  ``disk`` (a persisted snapshot) or ``fresh`` (no snapshot: training restarted from step 0).
- Phases, in seconds: ``T0`` rollback (wall time of the work lost since the restored
  step; in a new launch, of the steps ``losses.jsonl`` says ended after it, none where the
  script writes none: how long the run stood still is not lost work), ``T1`` process restart, ``T2`` process-group init, ``T3`` state load, ``T4``
  warm-up until the first resumed iteration completes; ``total`` their sum (recomputed
  from the phases when absent); ``detected``, in a recovery in place that rank 0 survived: the
  part of T1 before it saw the fault (its next send or receive failing), where something says when the fault was
  (the fault log: injected, or a hang a manager killed; ``losses.jsonl``'s last step); else the phases count from
  when rank 0 saw it.

``T0``..``T4`` are required, finite and not negative; the other keys are checked when
present; unknown keys are ignored. Blank lines are skipped.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from baft import faults as fault_log
from baft.config import GENERATION_ENV, LAUNCHER_ENV, ROUND_ENV, WARM_RANK_ENV
from baft.errors import BaftError, says_peer_lost, script_raised
from baft.jsonfile import append_line, parse_object
from baft.pipeline.hook import InstructionHook
from baft.recovery.agree import SOURCES as RESTORE_SOURCES

clock: dict[str, float] = {}  # phase boundaries of this process's restart: unix times (mark)
FILENAME = "recovery.jsonl"
PHASES = ("T0", "T1", "T2", "T3", "T4")
PHASE_NAMES = {
    "T0": "T0 rollback (lost work)",
    "T1": "T1 process restart",
    "T2": "T2 process-group init",
    "T3": "T3 state load",
    "T4": "T4 warm-up",
}
KINDS = ("in place", "warm relaunch", "cold relaunch")
EARLIER_ENV = "BAFT_EARLIER_IN_PLACE"  # recoveries in place of torchrun's earlier attempts
SOURCES = (*RESTORE_SOURCES, "fresh")  # where a restart's state came from: a restore source, or none


def mark(name: str) -> None:
    """Record the wall time of a restart phase boundary (first call wins)."""
    clock.setdefault(name, time.time())


def torchrun_attempt(env=os.environ) -> int:
    """Which of torchrun's attempts a process of environment ``env`` belongs to (0: the first): the rendezvous round
    baft's torchrun started it in (:mod:`baft.cli.torchrun`), the same on every node; else the restart count of its
    node's agent, which on several nodes counts only the restarts for a failure of the node's own ranks."""
    return int(env.get(ROUND_ENV) or env.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_of(env) -> int:
    """Recoveries of the job before a process of environment ``env`` (its attempt, as faults are logged):
    torchrun's restarts, and the recoveries in place since the latest (:mod:`baft.recovery.in_place`)."""
    return torchrun_attempt(env) + sum(int(env.get(name, "0")) for name in (EARLIER_ENV, GENERATION_ENV))


def log_raised(rank: int) -> None:
    """At interpreter exit under ``baft train``: the script's own uncaught exception (not a peer's loss it then saw)
    as the fault of its attempt, where nothing logged one, so that the restart's record names it (before: "process
    exit", or the peer that lost this rank and ended first)."""
    run_dir = os.environ.get(LAUNCHER_ENV["run_dir"])
    error = script_raised()
    if run_dir is None or error is None or says_peer_lost(str(error)):
        return
    said = str(error).splitlines()[0][:120] if str(error) else ""
    fault_log.append_first(run_dir, f"rank {rank} raised {type(error).__name__}{': ' + said if said else ''}",
                           restart_count())


def restart_count() -> int:
    """Recoveries of this job so far (:func:`attempt_of` this process)."""
    return attempt_of(os.environ)


def restart_in_place(seen: float) -> None:
    """Start this rank's clock again for a recovery in place, whose failure it saw at unix time ``seen``: its
    process started long before, and its phases are marked anew."""
    clock.clear()
    clock.update(failure_seen=seen)


@dataclass
class Restored:
    step: int
    source: str
    shards: int
    refused: list[str] = field(default_factory=list)
    rng: Optional[InstructionHook] = None  # sets the restored RNG states at the next iteration's start
    items: Optional[dict] = None  # the snapshot's small state, as its step ended


class RecoveryReport(InstructionHook):
    """After the first resumed iteration: T0..T4 of this restart (or of a new launch that restored a snapshot),
    printed and appended to recovery.jsonl."""

    def __init__(self, restored: Optional[Restored], run_dir: Optional[str]):
        self.restored, self.run_dir, self.done = restored, run_dir, False

    def iteration_end(self, engine):
        if self.done:
            return
        self.done = True
        mark("first_iteration_end")
        if engine.global_rank != 0 or self.run_dir is None or restart_count() == 0 and self.restored is None:
            return  # a run's first launch recovers nothing
        fault = _fault(Path(self.run_dir)) if restart_count() else {}
        record = recovery_record(self.restored, Path(self.run_dir), fault)
        if "by" in fault:  # detected, not injected: the ranks' output has not said it yet
            print(f"baft: {fault['what']}; killed by {fault['by']}", flush=True)
        append_line(Path(self.run_dir) / FILENAME, record)
        print("baft: recovered " + "  ".join(f"{k} {record[k]:.2f}s" for k in ("T0", "T1", "T2", "T3", "T4", "total"))
              + f"  from step {record['restored_step']} ({record['source']})", flush=True)


def _last_progress(run_dir: Path) -> dict[int, float]:
    """step -> wall time it completed, from losses.jsonl (every attempt so far)."""
    done = {}
    path = run_dir / "losses.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[rec["step"]] = rec["time"]
            except (ValueError, KeyError):
                continue
    return done


def _fault(run_dir: Path) -> dict:
    """The newest fault (injected, or a hang a manager detected: :mod:`baft.faults`) that ended the attempt before
    this one, if the run logged one."""
    faults = [f for f in fault_log.read(run_dir) if f.get("restart") == restart_count() - 1]
    return faults[-1] if faults else {}


def relaunch_kind() -> str:
    """How the job came back: in place (the survivors kept their processes), or every rank started again,
    forked from the node's warm server or as a new interpreter."""
    if int(os.environ.get(GENERATION_ENV, "0")):
        return "in place"
    return "warm relaunch" if os.environ.get(WARM_RANK_ENV) == "1" else "cold relaunch"


def process_started() -> float:
    """When this process began, in unix time, to the clock tick: its start in ``/proc/self/stat`` counts from the
    boot (psutil's ``create_time`` adds the boot time in whole seconds, up to a second early)."""
    after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def recovery_record(restored: Optional[Restored], run_dir: Path, fault: dict) -> dict:
    """This restart's record, ``fault`` the logged fault that ended the attempt before (:func:`_fault`; none for
    restart 0, a new launch that resumed the run: its T1 starts with the launch, how long the run stood still
    before it is not baft's to know)."""
    progress = _last_progress(run_dir)
    relaunch = restart_count() == 0
    started = process_started()
    step = restored.step if restored else 0
    # when the restored step ended: the script's losses.jsonl (the bundled example's), else the snapshot's own
    since = progress.get(step) or ((restored.items or {}).get("ended_at") if restored else None)
    if relaunch:  # the lost work is the steps the script says it ended after the restored one; not the stand-still
        failed_at = max((t for t in progress.values() if t < started), default=since or started)
    else:  # when the fault was logged, else the last step the script logged; else, in place, when rank 0 saw it
        failed_at = fault.get("time") or max(progress.values(), default=None) or clock.get("failure_seen", started)
    since = since or failed_at
    t = {
        "T0": max(0.0, failed_at - since),
        # restart, interpreter, imports
        "T1": clock.get("init_start", started) - (started if relaunch else failed_at),
        "T2": clock.get("init_end", 0) - clock.get("init_start", 0),
        "T3": clock["restore_end"] - clock["restore_start"],
        "T4": clock["first_iteration_end"] - clock["restore_end"],
    }
    what = "a new launch" if relaunch else fault.get("what", "process exit")
    # in place, where rank 0 survived: how much of T1 went by before it saw the fault (the rest: the new world), where
    # something says when the fault was
    seen = ({"detected": clock["failure_seen"] - failed_at}
            if "failure_seen" in clock and not relaunch and (fault.get("time") or progress) else {})
    return {"restart": restart_count(), "fault": what, "killed_at": fault.get("time"), "kind": relaunch_kind(),
            "restored_step": step, "source": restored.source if restored else "fresh",
            # (unknown where the script writes no losses.jsonl: the restored step may be a period behind the fault)
            "lost_steps": max(max(progress) - step, 0) if progress else None, **t, "total": sum(t.values()), **seen}


@dataclass(frozen=True)
class Recovery:
    """One fault and the restart that recovered from it; phase times in seconds."""

    restart: int
    fault: str
    killed_at: float | None
    kind: str | None
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
    doc = parse_object(text, where)
    phases = {p: _seconds(doc, p, where) for p in PHASES}
    total = _seconds(doc, "total", where) if "total" in doc else sum(phases.values())
    source = doc.get("source")
    if source is not None and source not in SOURCES:
        raise BaftError(f"{where}: 'source' is {source!r}, expected one of {', '.join(SOURCES)}")
    killed_at = doc.get("killed_at")
    if killed_at is not None and not _is_number(killed_at):
        raise BaftError(f"{where}: 'killed_at' must be a unix time or null, got {killed_at!r}")
    kind = doc.get("kind")
    if kind is not None and kind not in KINDS:
        raise BaftError(f"{where}: 'kind' is {kind!r}, expected one of {', '.join(KINDS)}")
    return Recovery(restart=_count(doc, "restart", where, default=position), fault=str(doc.get("fault", "")),
                    killed_at=killed_at, kind=kind, restored_step=_count(doc, "restored_step", where),
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
