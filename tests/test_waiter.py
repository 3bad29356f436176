"""The thread that runs a bubble's work (baft's copies) while the engine's thread waits in a receive or a collective."""

import threading
import time

import pytest

from baft.pipeline.engine import BubbleThread


def wait_for(seconds: float, error: Exception = None):
    """A blocking receive that returns ``seconds`` from now (or raises ``error`` then)."""
    def wait():
        time.sleep(seconds)
        if error is not None:
            raise error
    return wait


def bubble_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "baft-bubble"]


def test_work_runs_beside_the_wait_stops_when_it_ends_and_one_thread_serves_every_bubble():
    bubbles = BubbleThread()
    for _ in range(3):
        chunks, threads, stopped = [], set(), []

        def copy(landed):
            while not landed.is_set():
                chunks.append(time.perf_counter())
                threads.add(threading.current_thread().name)
                time.sleep(0.002)
            stopped.append(time.perf_counter())
        seconds = bubbles.during(copy, wait_for(0.05))
        back = time.perf_counter()
        assert 0.04 <= seconds < 0.5 and len(chunks) >= 5, "the work ran through the wait"
        assert threads == {"baft-bubble"}, "the work ran on the bubble's thread, not the engine's"
        assert stopped and stopped[0] <= back, "the engine's thread went on before the work stopped"
    assert len(bubble_threads()) == 1, "the bubble's thread is started once, not per bubble"


def test_a_failed_wait_or_work_raises_in_the_engines_thread_and_the_next_bubble_is_still_served():
    bubbles = BubbleThread()
    with pytest.raises(RuntimeError, match="peer went away"):
        bubbles.during(lambda landed: landed.wait(), wait_for(0.01, RuntimeError("peer went away")))

    def failing(landed):
        raise OSError("slot unmapped")
    with pytest.raises(OSError, match="slot unmapped"):
        bubbles.during(failing, wait_for(0.01))
    assert 0.005 <= bubbles.during(None, wait_for(0.01)) < 0.5
    assert 0.005 <= bubbles.during(lambda landed: None, wait_for(0.01)) < 0.5
