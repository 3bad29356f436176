"""The manager's watch over its node's ranks: a hung rank is killed, so that torchrun relaunches the job.

Two ways a rank hangs, both read from the ranks' heartbeats (:mod:`baft.manager.heartbeat`):

* *silent*: its heartbeat has not changed for its ``hang_timeout`` (the process is stopped or frozen);
* *no progress*: every rank of the node keeps beating, inside a training step, but none has finished
  a step for its ``progress_timeout`` (a stuck collective). Only once each has finished a step since
  it started beating, so a slow first iteration after a (re)start never counts, and only while
  inside ``train_batch``, so evaluation or a checkpoint between steps never counts either; the rank
  furthest behind is killed.

Silence is measured on the manager's own monotonic clock, between its own looks at the files: a
beat's wall-clock stamps are never compared across processes, and a look that comes late (the
manager itself starved of CPU, or the whole machine paused) adds at most :data:`MAX_GAP` seconds,
so a pause that froze the ranks and the manager alike kills nobody.

The kill is SIGKILL (it ends a stopped process too), to the pid of the beat after checking that
the process still has the beat's start time (never a reused pid). It is said in one line in the
manager's log and logged in the run's fault log (:mod:`baft.faults`) before the kill, so that
the restart's recovery record names it: "hang: rank 1 (pid 4242) silent for 5.0 s".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from baft import faults
from baft.manager.heartbeat import Beat, read_beats

log = logging.getLogger("baft.manager")

POLL_SECONDS = 0.5
MAX_GAP = 1.0  # seconds of silence one look can add, however late it comes


@dataclass(frozen=True)
class Hung:
    """A rank to kill, and why (one line)."""

    beat: Beat
    what: str
    timeout: str  # the config key that ran out


@dataclass
class _Watched:
    beat: Beat
    silent: float = 0.0  # seconds since its beat last changed
    stalled: float = 0.0  # seconds inside a training step since its step last changed
    advanced: bool = False  # has finished a step since it started beating


class Detector:
    """Which ranks of a node hang, from its ranks' successive beats (no files, no processes: :meth:`observe`
    is given them and the time of the look)."""

    def __init__(self, max_gap: float = MAX_GAP):
        self.max_gap = max_gap
        self._watched: dict[int, _Watched] = {}
        self._named: set[tuple[int, float]] = set()  # (pid, start time) of every process named hung: never again
        self._last: Optional[float] = None

    def observe(self, beats: dict[int, Beat], now: float) -> list[Hung]:
        """Take the node's beats seen at ``now`` (a monotonic clock's seconds); the ranks that hang, each named once
        (a new process of the rank is watched afresh)."""
        elapsed = 0.0 if self._last is None else min(max(now - self._last, 0.0), self.max_gap)
        self._last = now
        watched = {}
        for rank, beat in beats.items():
            if (beat.pid, beat.started) in self._named:
                continue
            w = self._watched.get(rank)
            if w is None or (w.beat.pid, w.beat.started) != (beat.pid, beat.started):
                watched[rank] = _Watched(beat)
                continue
            w.silent = 0.0 if beat.count != w.beat.count else w.silent + elapsed
            if beat.step != w.beat.step:
                w.stalled, w.advanced = 0.0, True
            elif beat.training:
                w.stalled += elapsed
            else:
                w.stalled = 0.0  # between steps: the script's own work (evaluation, a checkpoint) takes its time
            w.beat = beat
            watched[rank] = w
        self._watched = watched
        hung = [Hung(w.beat, f"hang: rank {w.beat.rank} (pid {w.beat.pid}) silent for {w.silent:.1f} s", "hang_timeout")
                for w in watched.values() if w.beat.hang_timeout and w.silent >= w.beat.hang_timeout]
        stuck = self._stuck(watched.values())
        if stuck is not None:
            for w in watched.values():
                w.stalled = 0.0  # one kill per stuck node: torchrun stops its other ranks
            if all(h.beat.rank != stuck.beat.rank for h in hung):
                hung.append(stuck)
        for h in hung:
            del self._watched[h.beat.rank]
            self._named.add((h.beat.pid, h.beat.started))
        return hung

    @staticmethod
    def _stuck(watched) -> Optional[Hung]:
        """Where no rank of the node finished a training step for its progress timeout, the rank furthest behind
        (the most silent of those)."""
        timed = [w for w in watched if w.beat.progress_timeout]
        if not timed or not all(w.advanced and w.stalled >= w.beat.progress_timeout for w in timed):
            return None
        last = min(timed, key=lambda w: (w.beat.step, -w.silent, w.beat.rank))  # behind, then silent (hang_timeout off)
        stalled = min(w.stalled for w in timed)
        return Hung(last.beat, f"no progress: rank {last.beat.rank} (pid {last.beat.pid}) at step {last.beat.step}; "
                               f"no rank of its node finished a step for {stalled:.1f} s", "progress_timeout")


class Watchdog:
    """Watches the beats under the root of node ``node_id`` and kills what hangs (see the module's docstring)."""

    def __init__(self, root, node_id: int):
        self.root, self.node_id = Path(root), node_id
        self.detector = Detector()

    def run(self, stopping: threading.Event) -> None:
        """Look every :data:`POLL_SECONDS` until ``stopping`` is set."""
        while not stopping.wait(POLL_SECONDS):
            try:
                self.look()
            except Exception:  # the manager must outlive any one bad look
                log.exception("watching the ranks failed")

    def look(self) -> list[Hung]:
        """Read the node's beats once and kill the ranks that hang; those killed."""
        live = {rank: beat for rank, beat in read_beats(self.root).items() if _process(beat) is not None}
        hung = self.detector.observe(live, time.monotonic())
        return [h for h in hung if self._kill(h)]

    def _kill(self, hung: Hung) -> bool:
        beat, by = hung.beat, f"the manager of node {self.node_id}"
        proc = _process(beat)
        if proc is None:
            return False  # gone since the look
        if beat.run_dir:
            try:
                faults.append(beat.run_dir, hung.what, beat.restart, by=by)
            except OSError as err:
                log.warning("cannot log the fault in %s (%s)", beat.run_dir, err.strerror)
        try:
            proc.kill()
        except psutil.Error:
            return False
        log.warning("%s (%s %g s): killed it", hung.what, hung.timeout, getattr(beat, hung.timeout))
        return True


def _process(beat: Beat) -> Optional[psutil.Process]:
    """The process that wrote ``beat`` while it still runs (a stopped one included), else None."""
    try:
        proc = psutil.Process(beat.pid)
        if abs(proc.create_time() - beat.started) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None
