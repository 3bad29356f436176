"""A manager's persistence to ``--dir``: which step is due, and the background thread that writes it.

The format on disk and its atomic write are :mod:`baft.manager.persist`'s; this module
decides when (every ``--persist-every`` steps, every ``--persist-seconds`` seconds) and writes
one bundle at a time off the manager's verify-and-encode loop, keeping the ``--keep`` newest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

from baft.errors import BaftError
from baft.manager import erasure, persist
from baft.manager.config import ManagerConfig

log = logging.getLogger("baft.manager")


@dataclass
class PersistState:
    """What was persisted, what is queued or being written, and the last failure."""

    last_time: float
    last_step: Optional[int] = None
    queued_step: int = -1
    writing: Optional[int] = None
    error: Optional[str] = None
    write_seconds: float = 0.0


class Persister:
    """Writes this node's bundles to ``config.dir`` on the thread that runs :meth:`run`, until ``stopping`` is set.

    ``lock`` is the manager's, shared with its other parts; ``started`` counts as the last
    write for ``--persist-seconds``.
    """

    def __init__(self, config: ManagerConfig, lock: threading.RLock, started: float, stopping: threading.Event):
        self.config = config
        self.state = PersistState(last_time=started)
        self._lock = lock
        self._stopping = stopping
        self._cv = threading.Condition()
        self._job: Optional[tuple[int, memoryview]] = None

    def open(self) -> None:
        """Check that ``--dir`` is writable and learn its newest persisted step."""
        directory = self.config.dir
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise BaftError(f"--dir {directory}: not writable ({err.strerror})") from None
        steps = persist.list_steps(directory)
        self.state.last_step = steps[0].step if steps else None

    def due_step(self, common: set[int]) -> Optional[int]:
        """The step of ``common`` (held by every rank) to persist now, if one is due.

        With ``--persist-every N`` that is a multiple of N, so all nodes persist the same
        steps; if the multiple was already recycled the newest step is taken instead, so
        persistence never stalls. With ``--persist-seconds T``, the newest step once T
        seconds have passed since the last write.
        """
        cfg = self.config
        if not cfg.persists_on_schedule:
            return None
        newest = max(common)
        with self._lock:
            done = [s for s in (self.state.queued_step, self.state.last_step) if s is not None and s >= 0]
            last = max(done) if done else None
            since = time.time() - self.state.last_time
        if last is not None and newest <= last:
            return None
        every = cfg.persist_every
        if every is not None:
            aligned = [s for s in common if s % every == 0 and (last is None or s > last)]
            if aligned:
                return max(aligned)
            if last is not None and newest // every * every > last:
                return newest
        if cfg.persist_seconds is not None and since >= cfg.persist_seconds:
            return newest
        return None

    def queue(self, step: int, bundle: memoryview) -> None:
        """Hand ``bundle`` of ``step`` to the writing thread, replacing a job it has not started."""
        with self._cv:
            self._job = (step, bundle)
            self.state.queued_step = step
            self._cv.notify()

    def run(self) -> None:
        """Write queued bundles until ``stopping`` is set and :meth:`wake` is called."""
        while True:
            with self._cv:
                while self._job is None and not self._stopping.is_set():
                    self._cv.wait()
                if self._job is None:
                    return
                step, bundle = self._job
                self._job = None
            self.write(step, bundle)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def write(self, step: int, bundle: memoryview) -> None:
        """Persist ``bundle`` of ``step`` now; a failure is logged and reported in the status."""
        with self._lock:
            self.state.writing = step
        began = time.perf_counter()
        try:
            snapshots = erasure.unpack_bundle(bundle, verify=False).snapshots
            path = persist.write_snapshot(self.config.dir, snapshots, node_id=self.config.node_id, keep=self.config.keep)
        except BaftError as err:
            with self._lock:
                self.state.error = str(err)
                self.state.writing = None
            log.error("%s", err)
            return
        with self._lock:
            self.state.last_step, self.state.last_time = step, time.time()
            self.state.writing, self.state.error = None, None
            self.state.write_seconds = time.perf_counter() - began
        log.info("persisted step %d to %s", step, path)

    def line(self) -> str:
        """One line: where, how often, the last step persisted and a failure if any."""
        cfg = self.config
        if cfg.dir is None:
            return "off"
        with self._lock:
            p = self.state
            every = ", ".join(x for x in (f"every {cfg.persist_every} steps" if cfg.persist_every else "",
                                          f"every {cfg.persist_seconds:g} s" if cfg.persist_seconds else "") if x)
            line = f"{cfg.dir} ({every or 'on stop only'}, keep {cfg.keep}): last persisted step " \
                   f"{p.last_step if p.last_step is not None else '-'}"
            if p.writing is not None:
                line += f", writing step {p.writing}"
            if p.error:
                line += f"; FAILED: {p.error}"
            return line

    def status(self) -> Optional[dict]:
        """The ``persist`` part of the manager's status; None without ``--dir``."""
        if self.config.dir is None:
            return None
        with self._lock:
            return {"dir": str(self.config.dir), "every": self.config.persist_every,
                    "seconds": self.config.persist_seconds, "keep": self.config.keep, "last_step": self.state.last_step,
                    "last_time": self.state.last_time, "writing": self.state.writing,
                    "error": self.state.error, "write_seconds": self.state.write_seconds,
                    "line": self.line()}
