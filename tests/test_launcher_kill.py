"""``baft train`` itself killed with SIGKILL: its ranks stop, the run's manager, in a session of its own,
lives on holding the snapshots; the next launch of the run directory stops it, adopts
them and resumes from the newest; a run that ends leaves nothing in shared memory once its newest snapshot
is on disk, and keeps it in memory where that write fails."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from baft.cli.launch import SHM_ROOT, launch_env, run_id
from baft.recovery.digests import DIGESTS_ENV, redone_differ
from baft.snapshot import slots
from baft.warm import SOCKET_ENV
from conftest import TINY

OWN_SERVER = {SOCKET_ENV: ""}  # the launch starts its own warm server, which dies with it


def baft_train(run_dir: Path, iters: int) -> list[str]:
    return [sys.executable, "-m", "baft.cli", "train", "--example", "gpt", *TINY, "--iters", str(iters),
            "--policy", "baft", "--period", "1", "--max-restarts", "0", "--run-dir", str(run_dir)]


def baft_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baft.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def losses(run_dir: Path) -> list[dict]:
    path = run_dir / "losses.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def described(pids: list[int]) -> list[str]:
    """The processes of ``pids`` still alive: pid, state, parent and command line."""
    found = []
    for pid in filter(alive, pids):
        try:
            p = psutil.Process(pid)
            found.append(f"{pid} ({p.status()}, parent {p.ppid()}): {' '.join(p.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            pass
    return found


def kill(pids: list[int]) -> None:
    """SIGKILL every process of ``pids`` and wait until none is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while any(alive(p) for p in pids):
        time.sleep(0.05)


@contextmanager
def training(tmp_path: Path, run_dir: Path, iters: int, logged: int, env: dict | None = None):
    """``baft train`` of ``run_dir`` in the background, yielded once it has logged ``logged`` steps (its
    manager's pid as ``.manager``); afterwards, whatever failed, no process of it and none of its shared
    memory is left. Its ranks are forked by the suite's warm server unless ``env`` is OWN_SERVER (then they
    are the launcher's descendants)."""
    node = Path(SHM_ROOT) / run_id(run_dir) / "node0"
    out = tmp_path / "first.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(baft_train(run_dir, iters), stdout=sink, stderr=subprocess.STDOUT,
                                env=launch_env(env))
    proc.manager, proc.out = None, out
    try:
        deadline = time.monotonic() + 180
        while len(losses(run_dir)) < logged:
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the launch trained fewer than {logged} steps in 180 s"
            time.sleep(0.2)
        proc.manager = json.loads((node / "manager.json").read_text())["pid"]
        yield proc
    finally:
        kill([proc.pid, *descendants(proc.pid), *([proc.manager] if proc.manager else [])])
        proc.wait()
        shutil.rmtree(node.parent, ignore_errors=True)


@pytest.mark.slow
def test_launcher_killed_by_sigkill_stops_its_training_and_resumes_from_the_manager_it_left(tmp_path, monkeypatch):
    """SIGKILL to the launcher only: torchrun, armed to get SIGTERM when its parent dies, stops the ranks,
    so no training goes on unwatched; the manager keeps the snapshots, and the next launch resumes from them."""
    monkeypatch.setenv(DIGESTS_ENV, str(tmp_path / "digests"))
    run_dir = tmp_path / "run"
    node = Path(SHM_ROOT) / run_id(run_dir) / "node0"
    with training(tmp_path, run_dir, 200, logged=4, env=OWN_SERVER) as first:  # its ranks die with it
        manager = first.manager
        second = subprocess.run(baft_train(run_dir, 60), capture_output=True, text=True, env=launch_env(OWN_SERVER),
                                timeout=60)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"{run_dir}: another `baft train` (pid {first.pid}) is using this run directory" in second.stderr

        trainers = [p for p in descendants(first.pid) if p != manager]
        assert len(trainers) >= 3, "torchrun and its two ranks"
        kill([first.pid])
        first.wait()
        deadline = time.monotonic() + 60
        while any(alive(p) for p in trainers):
            assert time.monotonic() < deadline, f"torchrun or a rank trains on after its launcher died: {described(trainers)}"
            time.sleep(0.1)
        assert alive(manager), "the manager runs in a session of its own and outlives the launcher"
        assert not list(Path(tempfile.gettempdir()).glob(f"baft-warm-{first.pid}-*")), "the warm server's socket"
        assert slots.rank_ids(node) == [0, 1] and all(slots.committed(node, r) for r in (0, 1))
        logged = losses(run_dir)
        assert len(logged) < 200
        before = {r["step"]: r["loss"] for r in logged}
        last = max(before)

        listed = baft_cli("manager", "ls")
        assert f"{node}" in listed.stdout and f"manager pid {manager}" in listed.stdout, listed.stdout
        refused = baft_cli("manager", "clean", node)
        assert refused.returncode == 2 and f"a manager (pid {manager}) serves it" in refused.stderr
        assert (node / "rank1").is_dir(), "a refused clean removed nothing"

        # the run directory deleted (here: moved aside): a launch of its path neither resumes nor drops them unasked
        shutil.move(run_dir, tmp_path / "aside")
        refused = subprocess.run(baft_train(run_dir, last + 3), capture_output=True, text=True, env=launch_env(),
                                 timeout=60)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert (f"baft: error: {run_dir}: no such run directory, but {node.parent} keeps the snapshots an earlier run "
                f"of it left (rank 0 step ") in refused.stderr, refused.stderr
        assert (f"`mkdir {run_dir}` and launch again to go on from them, or free them to start afresh with `baft "
                f"manager clean {node}` (after `baft manager stop --shm-root {node}`: its manager, pid {manager}, "
                "serves it still)") in refused.stderr, refused.stderr
        assert not run_dir.exists() and alive(manager)
        shutil.move(tmp_path / "aside", run_dir)

        resumed = subprocess.run(baft_train(run_dir, last + 3), capture_output=True, text=True, env=launch_env(),
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert f"stopped the manager an earlier launch of {run_dir} left running (pid {manager})" in resumed.stdout
        assert not alive(manager)
        left_behind = sorted(map(str, node.parent.rglob("*"))) if node.parent.exists() else None
    said = re.search(r"^baft: resumed from step (\d+) \(memory\)$", resumed.stdout, re.MULTILINE)
    assert said, resumed.stdout[-2000:]
    restored = int(said[1])
    # the snapshot of step k is copied in iteration k + 1 and sealed on a thread after it; each rank begins
    # one only while at most in_flight - 1 others are still sealing, and rank 1 began the last logged step's
    # (rank 0 waits for its backward): the newest every rank committed is at most in_flight + 1 steps behind
    in_flight = slots.SLOTS - 2
    assert last - 1 - in_flight <= restored <= last, (restored, last)
    after = losses(run_dir)[len(logged):]
    assert [r["step"] for r in after] == list(range(restored + 1, last + 4))
    for r in after:
        if r["step"] in before:
            assert repr(r["loss"]) == repr(before[r["step"]]), f"step {r['step']} differs from the killed launch's"
    assert redone_differ(tmp_path / "digests") == [], "the steps trained again differ from the killed launch's"

    assert left_behind is None, f"a run that ended left its shared-memory directory behind: {left_behind}"
    log = (run_dir / "manager-node0.log").read_text()
    assert log.count("node 0 serving") == 2, "both launches' managers log into the run directory"


@pytest.mark.slow
def test_a_launch_stopped_by_sigterm_keeps_in_shared_memory_the_snapshot_its_manager_cannot_write(tmp_path):
    """SIGTERM to ``baft train`` (a scheduler's preemption) ends the launch as its end would: torchrun stops the
    ranks, and the manager writes the newest snapshot to RUN_DIR/persisted before freeing shared memory; when
    that write fails (here its directory was replaced by a file), it frees nothing, the launch says where the
    snapshot is, and the next launch resumes from memory."""
    run_dir = tmp_path / "run"
    node = Path(SHM_ROOT) / run_id(run_dir) / "node0"
    target = run_dir / "persisted" / "node0"
    with training(tmp_path, run_dir, 200, logged=3) as first:
        shutil.rmtree(target)  # the manager made it at its start
        target.write_text("not a directory")
        trainers = descendants(first.pid)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 128 + signal.SIGTERM, first.out.read_text()[-3000:]
        said = first.out.read_text()
        assert f"baft: stopped by SIGTERM; every rank's output is in {run_dir / 'output.log'}" in said, said[-2000:]
        assert f"baft: node 0's manager could not write its newest snapshot to {target}" in said, said[-2000:]
        assert f"`baft manager clean {node}` frees it" in said
        assert not any(alive(p) for p in [*trainers, first.manager]), described([*trainers, first.manager])
        assert slots.rank_ids(node) == [0, 1], "the manager freed the snapshot it could not write"
        assert "is not on disk: its shared-memory snapshots stay" in (run_dir / "manager-node0.log").read_text()
        kept = min(slots.committed(node, r)[0].record.step for r in (0, 1))
        last = max(r["step"] for r in losses(run_dir))

        target.unlink()
        resumed = subprocess.run(baft_train(run_dir, last + 2), capture_output=True, text=True, env=launch_env(),
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert f"baft: resumed from step {kept} (memory)" in resumed.stdout, resumed.stdout[-2000:]
        assert f"baft: step {last + 2} is kept in {run_dir / 'persisted'}" in resumed.stdout
        steps = [r["step"] for r in losses(run_dir)]
        assert steps == [*range(1, last + 1), *range(kept + 1, last + 3)], steps
        assert not node.parent.exists(), "the second launch wrote its snapshot and freed the shared memory"
