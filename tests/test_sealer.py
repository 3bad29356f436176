"""The thread that seals fenced snapshots: one for the run, each commit reported, errors raised in the trainer's."""

import threading
import time

import pytest

from baft.snapshot.copy import Sealer


class Fenced:
    """What the sealer needs of a fenced snapshot: ``seal()`` (its commit record) and its slot."""

    def __init__(self, step: int, error: Exception = None):
        self.step, self.slot, self.error = step, step % 3, error

    def seal(self):
        time.sleep(0.01)
        if self.error is not None:
            raise self.error
        return self.step


def test_one_thread_seals_every_snapshot_in_turn_and_wait_returns_once_it_is_committed():
    commits = []
    sealer = Sealer(lambda record, slot: commits.append((record, slot, threading.get_ident())))
    for step in range(4):
        sealer.submit(Fenced(step))
        sealer.wait()
        assert commits[-1][:2] == (step, step % 3), "wait() returns after the commit, not before"
    threads = {ident for *_, ident in commits}
    assert len(threads) == 1 and threading.get_ident() not in threads, "one sealing thread, not the trainer's"


def test_a_failed_seal_raises_in_the_trainers_thread_and_the_next_snapshot_is_still_sealed():
    commits = []
    sealer = Sealer(lambda record, slot: commits.append(record))
    sealer.submit(Fenced(1, OSError("no space left on /dev/shm")))
    with pytest.raises(OSError, match="no space left"):
        sealer.wait()
    sealer.submit(Fenced(2))
    sealer.wait()
    assert commits == [2]


def test_submit_does_not_wait_and_wait_leaves_as_many_seals_as_asked():
    commits, release = [], threading.Event()

    class Slow(Fenced):
        def seal(self):
            release.wait()
            return self.step

    sealer = Sealer(lambda record, slot: commits.append(record))
    start = time.perf_counter()
    sealer.submit(Slow(1))
    sealer.submit(Fenced(2))
    assert time.perf_counter() - start < 0.5 and commits == [], "submit returns while the seals are pending"
    waiter = threading.Thread(target=sealer.wait, kwargs={"leave": 1})
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "two seals outstanding: wait(leave=1) waits for the first"
    release.set()
    waiter.join(5)
    assert not waiter.is_alive() and commits[0] == 1
    sealer.wait()
    assert commits == [1, 2], "sealed in turn"


def test_a_failed_seal_is_raised_by_the_next_wait_even_one_that_need_not_wait():
    sealer = Sealer(lambda record, slot: None)
    sealer.submit(Fenced(1, OSError("no space left on /dev/shm")))
    time.sleep(0.3)  # the seal has failed by now
    with pytest.raises(OSError, match="no space left"):
        sealer.wait(leave=5)
