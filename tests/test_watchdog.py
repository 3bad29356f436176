"""The manager's watch over hung ranks: the detector on fake heartbeats, and a real stopped process killed."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from baft.manager.heartbeat import Beat, Heartbeat, beat_path, read_beat
from baft.manager.watchdog import MAX_GAP, Detector, Watchdog


def beat(rank=1, count=0, step=3, training=True, pid=None, hang=5.0, progress=60.0):
    return Beat(rank=rank, pid=100 + rank if pid is None else pid, started=1.0, restart=0, run_dir=None,
                hang_timeout=hang, progress_timeout=progress, step=step, training=training, count=count)


def watch(detector, seconds, every=0.5, start=0.0, **rank_beats):
    """Look every ``every`` seconds for ``seconds``, each rank's beats from its function of the look's time;
    every rank named as hanging, with the time it was."""
    hung, t = [], start
    while t <= start + seconds:
        beats = {int(rank.removeprefix("r")): f(t) for rank, f in rank_beats.items()}
        hung += [(h.beat.rank, t, h.what) for h in detector.observe(beats, t)]
        t += every
    return hung


def test_a_slow_rank_that_beats_is_never_killed():
    """A first iteration, an op build or a checkpoint that takes minutes: the rank beats, its step stands still."""
    detector = Detector()
    assert watch(detector, 900, r1=lambda t: beat(count=int(t)), r0=lambda t: beat(rank=0, count=int(t))) == []
    # slow steps that do finish: each takes longer than hang_timeout, never longer than progress_timeout
    assert watch(detector, 900, r1=lambda t: beat(count=int(t), step=int(t // 50))) == []


def test_a_silent_rank_is_named_once_after_its_hang_timeout():
    detector = Detector()
    hung = watch(detector, 20, r0=lambda t: beat(rank=0, count=int(t)),
                 r1=lambda t: beat(count=min(int(t), 4)))  # stopped at t=4: its beat stays as it was
    [(rank, at, what)] = hung
    assert rank == 1 and 4 + 5 <= at <= 4 + 5 + 1.0
    assert what.startswith("hang: rank 1 (pid 101) silent for 5.")


def test_the_managers_own_late_looks_do_not_count_as_silence():
    """A manager starved of CPU, or a machine paused with its ranks: a look 30 s late adds at most MAX_GAP."""
    detector = Detector()
    assert detector.observe({1: beat(count=1)}, 0.0) == []
    assert detector.observe({1: beat(count=1)}, 30.0) == []  # the rank has not beaten since: paused alike
    assert detector.observe({1: beat(count=2)}, 30.5) == []  # and beats again
    assert watch(detector, 4.0 - MAX_GAP, start=31.0, r1=lambda t: beat(count=2)) == []


def test_a_new_process_of_the_rank_is_watched_afresh():
    detector = Detector()
    watch(detector, 4, r1=lambda t: beat(count=0))
    assert watch(detector, 4, start=4.5, r1=lambda t: beat(count=0, pid=201)) == []


def test_a_stuck_collective_kills_the_rank_furthest_behind_once():
    """Every rank beats inside a training step and none finishes one: after progress_timeout, one rank (torchrun
    stops the others; the node's next kill would wait for a whole progress_timeout again)."""
    detector = Detector()

    def rank(r, stuck_at):
        return lambda t: beat(rank=r, count=int(t), step=min(int(t // 10), stuck_at))
    hung = watch(detector, 160, r0=rank(0, 5), r1=rank(1, 4))  # rank 1 is stuck at step 4, rank 0 at 5
    assert [(r, at) for r, at, _ in hung] == [(1, 50 + 60)], hung  # the last step finished at t=50
    assert hung[0][2] == "no progress: rank 1 (pid 101) at step 4; no rank of its node finished a step for 60.0 s"
    # hang_timeout off, rank 1 stopped: at the same step as rank 0, which waits for it, it is the one named
    hung = watch(Detector(), 100, r0=lambda t: beat(rank=0, count=int(t), step=min(int(t // 10), 3), hang=None),
                 r1=lambda t: beat(count=min(int(t), 35), step=min(int(t // 10), 3), hang=None))
    assert [(r, at) for r, at, _ in hung] == [(1, 30 + 60)], hung


def test_no_progress_counts_only_inside_training_steps_and_after_a_first_step():
    detector = Detector()
    # evaluation (or the script's own checkpoint) between steps for long: not training, never stuck
    assert watch(detector, 300, r0=lambda t: beat(rank=0, count=int(t), step=1 if t > 5 else 0,
                                                  training=t <= 5)) == []
    # a first iteration that takes minutes (no step finished since the rank started beating)
    assert watch(Detector(), 300, r0=lambda t: beat(rank=0, count=int(t))) == []


def test_a_stopped_process_is_killed_and_the_fault_logged(tmp_path):
    """A real process beating through Heartbeat, SIGSTOPped: the watchdog kills it (SIGKILL ends a stopped
    process) and logs the fault in its run directory."""
    root, run_dir = tmp_path / "node0", tmp_path / "run"
    run_dir.mkdir()
    child = subprocess.Popen([sys.executable, "-c", f"""
import time, types
from baft.manager.heartbeat import Heartbeat
Heartbeat({str(root)!r}, 1, 0, {str(run_dir)!r}, 1.0, None).start(types.SimpleNamespace(global_steps=7))
time.sleep(600)
"""])
    try:
        deadline = time.monotonic() + 60
        while (found := read_beat(beat_path(root, 1))) is None or found.count < 2:
            assert child.poll() is None and time.monotonic() < deadline, "the child never beat"
            time.sleep(0.05)
        assert (found.pid, found.step, found.training) == (child.pid, 7, False)
        watchdog = Watchdog(root, node_id=0)
        assert watchdog.look() == []
        os.kill(child.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not (killed := watchdog.look()):
            assert time.monotonic() - stopped < 10, "not killed"
            time.sleep(0.2)
        assert 1.0 <= time.monotonic() - stopped < 3.0
        assert child.wait(10) == -signal.SIGKILL
        [fault] = [json.loads(line) for line in (run_dir / "chaos.jsonl").read_text().splitlines()]
        assert fault["what"] == killed[0].what and fault["what"].startswith(f"hang: rank 1 (pid {child.pid}) silent")
        assert (fault["restart"], fault["by"]) == (0, "the manager of node 0")
        assert watchdog.look() == [], "a dead rank's beat is not watched"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_closed_heartbeat_leaves_no_file(tmp_path):
    import types

    heartbeat = Heartbeat(tmp_path, 0, 0, None, 60.0, 600.0).start(types.SimpleNamespace(global_steps=0))
    assert read_beat(beat_path(tmp_path, 0)).pid == os.getpid() == psutil.Process().pid
    heartbeat.close()
    assert not beat_path(tmp_path, 0).exists()
