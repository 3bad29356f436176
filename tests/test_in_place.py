"""Recovery in place (:mod:`baft.recovery.in_place`): under ``baft train`` a killed rank is replaced and its peers
keep their processes; every step after it is identical, part by part, to the uninterrupted run's. (Four cases of
tests/test_matrix.py recover in place too, ZeRO-1 bf16 at pp=2 x dp=2 among them, each checking the survivors' pids.)"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from baft.cli.launch import launch_env
from baft.recovery.digests import DIGESTS_ENV, compare, load
from baft.warm import SOCKET_ENV
from conftest import TINY


def train(directory: Path, *faults: str, max_restarts: int = 2, env: dict | None = None,
          spares: int = 1) -> subprocess.Popen:
    """``baft train`` of the example for 10 steps with ``faults``, its state digests in ``directory/digests``."""
    return subprocess.Popen([sys.executable, "-m", "baft.cli", "train", "--in-place", "--spares", str(spares),
                             "--example", "gpt", *TINY,
                             "--iters", "10", "--policy", "baft", "--period", "1", "--run-dir", str(directory / "run"),
                             "--max-restarts", str(max_restarts), *(a for f in faults for a in ("--fault", f))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launch_env({DIGESTS_ENV: str(directory / "digests"), **(env or {})}))


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pids_by_restart(digests: Path) -> dict[int, dict[int, int]]:
    """restart -> rank -> the pid that recorded that rank's state in it."""
    found: dict[int, dict[int, int]] = {}
    for path in sorted(digests.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            found.setdefault(rec["restart"], {})[rec["rank"]] = rec["pid"]
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The uninterrupted run and the faulted ones, side by side (a recovery leaves the cores idle meanwhile)."""
    cases = {"reference": (), "two kills": ("rank=1,step=4,phase=backward,restart=0", "rank=0,step=7,phase=optimizer,restart=1"),
             "budget spent": ("rank=1,step=3,phase=forward,restart=0", "rank=1,step=6,phase=backward,restart=1"),
             # rank 0 dies as it begins to recover from rank 1's death: a second fault during the recovery
             "killed recovering": ("rank=1,step=4,phase=backward,restart=0", "rank=0,step=4,phase=recover,restart=0")}

    def run(name):
        directory = tmp_path_factory.mktemp(name.replace(" ", "-"))
        return directory, finish(train(directory, *cases[name], max_restarts=1 if name == "budget spent" else 2))

    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(zip(cases, pool.map(run, cases)))


def recoveries(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "run" / "recovery.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_kills_recover_in_place_the_survivors_keep_their_processes_and_every_part_is_identical(runs):
    (reference, ref_proc), (faulted, proc) = runs["reference"], runs["two kills"]
    assert ref_proc.returncode == 0 and proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = recoveries(faulted)
    assert [r["kind"] for r in records] == ["in place", "in place"], records
    assert records[0]["restored_step"] == 2 and records[1]["restored_step"] >= 5 and all(r["source"] == "memory" for r in records)
    assert compare(reference / "digests", faulted / "digests") == []
    pids = pids_by_restart(faulted / "digests")
    assert sorted(pids) == [0, 1, 2]
    assert pids[1][0] == pids[0][0] and pids[1][1] != pids[0][1], "rank 1 was replaced, rank 0 kept its process"
    assert pids[2][1] == pids[1][1] and pids[2][0] != pids[1][0], "then rank 0 was replaced, rank 1 kept its own"
    assert "recovers in place" in proc.stdout and "in place" in proc.stdout  # the rank's line and the report's


@pytest.mark.slow
def test_a_rank_killed_once_more_than_its_replacements_allow_brings_a_relaunch_of_every_rank(runs):
    (reference, _), (faulted, proc) = runs["reference"], runs["budget spent"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = recoveries(faulted)
    assert [r["kind"] for r in records] == ["in place", "warm relaunch"], records
    assert [r["restart"] for r in records] == [1, 2], "a relaunch counts on from the recoveries in place"
    assert compare(reference / "digests", faulted / "digests") == []
    pids = pids_by_restart(faulted / "digests")
    assert pids[1][0] == pids[0][0] and not set(pids[2].values()) & set(pids[1].values())
    assert len(load(faulted / "digests")) == len(load(reference / "digests"))


@pytest.mark.slow
def test_a_survivor_killed_as_it_recovers_is_replaced_too_and_every_part_is_identical(runs):
    (reference, _), (faulted, proc) = runs["reference"], runs["killed recovering"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = recoveries(faulted)
    # one recovery of both faults: the two replacements meet in the same new world
    assert [(r["kind"], r["restored_step"]) for r in records] == [("in place", 2)], records
    assert compare(reference / "digests", faulted / "digests") == []
    pids = pids_by_restart(faulted / "digests")
    assert sorted(pids) == [0, 1] and not set(pids[1].values()) & set(pids[0].values()), "both ranks were replaced"


def kill_first_replacement(launcher: int, killed: dict, done: threading.Event) -> None:
    """SIGKILL the first process the launcher's warm server forks after torchrun, its store keeper and two ranks:
    a replacement, killed as it starts (its pid in ``killed``)."""
    server, ranks = None, None
    while not done.wait(0.002):
        try:
            if server is None:
                server = next((p for p in psutil.Process(launcher).children(recursive=True)
                               if "baft.warm.server" in " ".join(p.cmdline())), None)
                continue
            children = {p.pid for p in server.children()}
            if ranks is None:
                ranks = children if len(children) == 4 else None
            elif children - ranks:
                killed["pid"] = min(children - ranks)
                os.kill(killed["pid"], signal.SIGKILL)
                return
        except psutil.NoSuchProcess:
            continue


@pytest.mark.slow
def test_a_replacement_killed_as_it_starts_is_replaced_again_and_every_part_is_identical(runs, tmp_path):
    """No spare kept: rank 1 is killed in step 4 and its replacement the moment the warm server forks it; the next
    replacement takes its place, rank 0 keeps its process, and every step is identical."""
    reference, _ = runs["reference"]
    proc = train(tmp_path, "rank=1,step=4,phase=backward,restart=0", env={SOCKET_ENV: ""}, spares=0)  # its own server
    killed, done = {}, threading.Event()
    watcher = threading.Thread(target=kill_first_replacement, args=(proc.pid, killed, done))
    watcher.start()
    try:
        result = finish(proc)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert killed, "no replacement was forked"
    assert [(r["kind"], r["restored_step"]) for r in recoveries(tmp_path)] == [("in place", 2)]
    assert compare(reference / "digests", tmp_path / "digests") == []
    pids = pids_by_restart(tmp_path / "digests")
    assert pids[1][0] == pids[0][0], "rank 0 kept its process"
    assert killed["pid"] not in (pids[0][1], pids[1][1]) and pids[1][1] != pids[0][1], pids


def kill_the_spare(launcher: int, seen: dict[int, float], killed: dict, done: threading.Event) -> None:
    """SIGKILL the spare the launcher's warm server forks with the job's first rank (its fourth child: after torchrun,
    the store keeper and that rank; its pid in ``killed``); ``seen``: when each child was first seen."""
    server = None
    while not done.wait(0.002):
        try:
            if server is None:
                server = next((p for p in psutil.Process(launcher).children(recursive=True)
                               if "baft.warm.server" in " ".join(p.cmdline())), None)
                continue
            children = sorted(p.pid for p in server.children())
        except psutil.NoSuchProcess:
            continue
        for pid in children:
            seen.setdefault(pid, time.time())
        if "pid" not in killed and len(children) >= 4:
            killed["pid"] = children[3]
            os.kill(killed["pid"], signal.SIGKILL)


@pytest.mark.slow
def test_a_spare_killed_is_forked_again_and_the_new_one_takes_the_killed_ranks_place(runs, tmp_path):
    """Issue 33's spare itself killed: the warm server forks another behind it, which becomes rank 1 when rank 1 is
    killed in step 4 (a process there before the kill); rank 0 keeps its process, and every step is identical."""
    reference, _ = runs["reference"]
    proc = train(tmp_path, "rank=1,step=4,phase=backward,restart=0", env={SOCKET_ENV: ""})  # a server of its own
    seen, killed, done = {}, {}, threading.Event()
    watcher = threading.Thread(target=kill_the_spare, args=(proc.pid, seen, killed, done))
    watcher.start()
    try:
        result = finish(proc)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert killed, "no spare was forked"
    [record] = recoveries(tmp_path)
    assert (record["kind"], record["restored_step"]) == ("in place", 2), record
    assert compare(reference / "digests", tmp_path / "digests") == []
    pids = pids_by_restart(tmp_path / "digests")
    assert pids[1][0] == pids[0][0], "rank 0 kept its process"
    replacement = pids[1][1]
    assert replacement not in (killed["pid"], pids[0][1]) and seen[replacement] < record["killed_at"], (pids, seen)
