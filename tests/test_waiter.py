"""The thread that waits for a pending receive or collective while the engine's thread copies."""

import threading
import time

import pytest

from baft.pipeline.hooks import _wait_while


class Pending:
    """A ``torch.distributed`` Work that completes ``after`` seconds from now (or raises ``error``)."""

    def __init__(self, after: float, error: Exception = None):
        self.done_at, self.error = time.perf_counter() + after, error

    def wait(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        if self.error is not None:
            raise self.error


def waiters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "baft-wait"]


def test_work_runs_until_the_operation_lands_and_one_thread_waits_for_every_operation():
    for _ in range(3):
        chunks = []

        def copy(landed):
            while not landed.is_set():
                chunks.append(time.perf_counter())
                time.sleep(0.002)
        seconds = _wait_while(Pending(0.05), copy)
        assert 0.04 <= seconds < 0.5 and len(chunks) >= 5, "the work ran through the wait and stopped at the landing"
    assert len(waiters()) == 1, "the waiting thread is started once, not per operation"


def test_a_failed_operation_raises_in_the_engines_thread_and_the_next_one_is_still_served():
    with pytest.raises(RuntimeError, match="peer went away"):
        _wait_while(Pending(0.01, RuntimeError("peer went away")), None)
    assert 0.005 <= _wait_while(Pending(0.01), None) < 0.5
