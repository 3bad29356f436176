"""One long-lived thread that runs the work handed to it, in order.

baft keeps work off the trainer's thread on such threads (waiting for a receive while the
trainer copies, sealing a snapshot). Each is started once: ``Thread.start`` returns only when
the new thread runs, and on a host whose cores are all training that took a scheduler slice
from the trainer every time a thread was started (about 1 ms per receive, measured).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class BackgroundThread:
    """A daemon thread named ``name`` that runs each callable given to :meth:`submit`, one after another.

    It starts on the first :meth:`submit`, and again in a forked child (which has no threads).
    A callable must not raise: it hands its outcome back itself.
    """

    def __init__(self, name: str):
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._work: Optional[queue.SimpleQueue] = None  # the started thread's

    def submit(self, work: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._work = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, args=(self._work,), name=self.name, daemon=True)
            self._thread.start()
        self._work.put(work)

    @staticmethod
    def _serve(work: queue.SimpleQueue) -> None:
        while True:
            work.get()()
