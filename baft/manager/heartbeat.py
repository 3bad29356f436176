"""A rank's heartbeat: what lets its node's manager tell a hung rank from a slow one.

Every rank protected by an in-memory policy runs a daemon thread that rewrites a small file,
``<node root>/rank<R>/heartbeat.json``, about once a second (five times per ``hang_timeout`` where
that is shorter), until the protection closes. A :class:`Beat` says who beats (the pid, and the
process's start time, so that a reused pid is never taken for the rank), the rank's step, whether
it is inside a training step, and the timeouts its config asks the manager to enforce
(:mod:`baft.manager.watchdog` reads them).

The thread beats while the trainer's thread blocks in a receive or a collective (torch releases
the GIL there), and stops with the whole process: SIGSTOP, a freeze, a death. A file rather than a
message: the thread shares nothing with the trainer's connection to the manager (which the sealing
thread uses too), the manager reads it without a request, and a manager started after the rank
(one that took over a retired one's snapshots) finds it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import psutil

from baft.jsonfile import write_json_atomic
from baft.pipeline.hook import InstructionHook
from baft.snapshot import slots

BEAT_NAME = "heartbeat.json"


@dataclass(frozen=True)
class Beat:
    """One heartbeat of one rank."""

    rank: int
    pid: int
    started: float  # the process's start time (psutil's create_time): tells its pid from a reused one
    restart: int  # torchrun's restart count of the rank's process
    run_dir: Optional[str]  # where a fault that ends the rank is logged
    hang_timeout: Optional[float]
    progress_timeout: Optional[float]
    step: int = 0
    training: bool = False  # inside train_batch
    count: int = 0  # beats so far: the manager watches it change


def beat_path(root, rank: int) -> Path:
    """The heartbeat file of ``rank`` under the node root ``root``."""
    return slots.rank_dir(root, rank) / BEAT_NAME


def read_beat(path) -> Optional[Beat]:
    """The beat in ``path``, or None where there is none (or it is not a beat)."""
    try:
        return Beat(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_beats(root) -> dict[int, Beat]:
    """The newest beat of every rank that has one under the node root ``root``."""
    beats = {rank: read_beat(beat_path(root, rank)) for rank in slots.rank_ids(root)}
    return {rank: beat for rank, beat in beats.items() if beat is not None}


class Heartbeat(InstructionHook):
    """This rank's heartbeat thread (see the module's docstring); :meth:`start` it, :meth:`close` stops it and
    removes the file. As a hook it notes whether the rank is inside a training step."""

    def __init__(self, root, rank: int, restart: int, run_dir: Optional[str], hang_timeout: Optional[float],
                 progress_timeout: Optional[float]):
        self.path = beat_path(root, rank)
        self.interval = min(1.0, hang_timeout / 5) if hang_timeout else 1.0
        self.training = False
        self._beat = Beat(rank, os.getpid(), psutil.Process().create_time(), restart, run_dir, hang_timeout,
                          progress_timeout)
        self._engine = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, engine) -> "Heartbeat":
        """Beat now, then every :attr:`interval` seconds, with ``engine``'s step."""
        self._engine = engine
        self._write()
        self._thread = threading.Thread(target=self._run, name="baft-heartbeat", daemon=True)
        self._thread.start()
        return self

    def iteration_start(self, engine):
        self.training = True

    def iteration_end(self, engine):
        self.training = False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._write()
            except OSError:
                pass  # a beat it cannot write is a beat missed: silent long enough, the manager kills the rank

    def _write(self) -> None:
        self._beat = replace(self._beat, step=self._engine.global_steps, training=self.training,
                             count=self._beat.count + 1)
        write_json_atomic(self.path, asdict(self._beat), indent=None)
