"""Kill a rank mid-training: the elastic restart resumes from the newest snapshot, bit for bit."""

import json
import re
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
from baft.config import LAUNCHER_ENV
from baft.recovery.digests import DIGESTS_ENV, compare
from baft.recovery.record import load_recoveries
from baft.snapshot import slots
from conftest import TINY, run_worker


def losses(run_dir):
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    """The run directory of the job run without faults, with its state digests in ``digests/``."""
    run_dir = tmp_path_factory.mktemp("clean")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DIGESTS_ENV, str(run_dir / "digests"))
        run_worker(2, [*TINY, "--iters", "10", "--policy", "none", "--run-dir", str(run_dir)])
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(clean_run) -> dict:
    return {r["step"]: r["loss"] for r in losses(clean_run)}


FAULTS = {"receive": ["rank=0,step=4,phase=copy", "rank=1,step=6,phase=seal", "rank=1,step=8,phase=backward"],
          "stream": ["rank=1,step=2,phase=seal", "rank=0,step=4,phase=copy"]}
# killed as the run's first snapshot (of step 1) is committed: rank 0 commits it, rank 1 does not, and the job starts
# again from step 0 (before, it refused to, as if a run's progress had been lost)
FIRST_SNAPSHOT = "rank=1,step=2,phase=seal"


def killed_run(tmp_path, shm_root, executor: str, faults: list[str]) -> Path:
    """A run of the job under ``executor``, killed in each fault in turn (its restart's number), its digests in
    ``tmp_path/executor/digests``: the run directory."""
    work = tmp_path / executor
    env = {"BAFT_CHAOS": ";".join(f"{fault},restart={i}" for i, fault in enumerate(faults)),
           DIGESTS_ENV: str(work / "digests")}
    run_worker(2, [*TINY, "--iters", "10", "--policy", "baft", "--period", "1", "--executor", executor,
                   "--run-dir", str(work / "run"), "--shm-root", str(shm_root / executor)],
               max_restarts=len(faults), env=env)
    return work / "run"


@pytest.mark.slow
def test_killed_ranks_resume_bit_identical_in_every_part(tmp_path, shm_root, clean_run, uninterrupted):
    """One run per executor (side by side), killed in each fault in turn, each resumed from the newest
    snapshot in memory."""
    with ThreadPoolExecutor(len(FAULTS)) as pool:
        runs = {executor: pool.submit(killed_run, tmp_path, shm_root, executor, faults)
                for executor, faults in FAULTS.items()}
        runs = {executor: run.result() for executor, run in runs.items()}
    for executor, faults in FAULTS.items():
        run_dir = runs[executor]
        records, recoveries = losses(run_dir), load_recoveries(run_dir)
        sources = ["fresh" if fault == FIRST_SNAPSHOT else "memory" for fault in faults]
        assert [r.source for r in recoveries] == sources, (executor, recoveries)
        for restart, (fault, recovery) in enumerate(zip(faults, recoveries)):
            killed_step = int(fault.split("step=")[1].split(",")[0])
            cut = [r["step"] for r in records if r["restart"] == restart]
            resumed = [r["step"] for r in records if r["restart"] == restart + 1]
            # died during the iteration of killed_step; a seal runs beside the trainer, which may finish that step
            assert max(cut) in ((killed_step - 1, killed_step) if "seal" in fault else (killed_step - 1,)), fault
            # snapshot of step k is committed during iteration k+1, so the newest one is killed_step - 2 or - 1;
            # killed while its commit is sealed, the snapshot of killed_step - 1 is not committed on that rank, and on a
            # loaded machine the one before may still be sealing beside it (a rank begins a snapshot while at most
            # SLOTS - 3 others seal: seen once at a load of 7, beside two probes' runs)
            lowest = killed_step - (slots.SLOTS - 2) if "seal" in fault else killed_step - 1
            assert lowest <= resumed[0] <= (killed_step - 1 if "seal" in fault else killed_step), fault
            assert recovery.restored_step == resumed[0] - 1
            assert all(getattr(recovery, t) >= 0 for t in ("T0", "T1", "T2", "T3", "T4"))
        assert records[-1]["step"] == 10
        for r in records:
            assert repr(r["loss"]) == repr(uninterrupted[r["step"]]), f"{executor}: step {r['step']} differs"
        assert compare(clean_run / "digests", run_dir.parent / "digests") == [], executor


@pytest.mark.slow
def test_lost_node_is_rebuilt_from_parity_and_resumes_bit_identical(tmp_path, clean_run, uninterrupted):
    """Two simulated nodes (a manager and a rank each, one parity group); node 1 loses its
    manager, its shared memory and its rank. The replaced node's restore rebuilds from parity."""
    import subprocess
    import sys

    from baft.cli.launch import SHM_ROOT, launch_env, run_id

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--example", "gpt", *TINY, "--iters", "10",
                           "--policy", "baft", "--period", "1", "--nodes", "2", "--fault", "node=1,step=7",
                           "--max-restarts", "1", "--run-dir", str(run_dir), "--cold"],
                          capture_output=True, text=True, env=launch_env({DIGESTS_ENV: str(tmp_path / "digests")}),
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recovery = [json.loads(line) for line in (run_dir / "recovery.jsonl").read_text().splitlines()]
    # parity is encoded in the background, newest committed step first: under load the newest
    # snapshot's parity (step 5) may not have landed when the node dies, and an older one is rebuilt
    assert recovery[0]["source"] == "parity" and 1 <= recovery[0]["restored_step"] <= 5
    assert recovery[0]["kind"] == "cold relaunch"  # new interpreters, against the clean run's forked ones
    resumed = [r for r in losses(run_dir) if r["restart"] == 1]
    assert [r["step"] for r in resumed] == list(range(recovery[0]["restored_step"] + 1, 11))
    for r in resumed:
        assert repr(r["loss"]) == repr(uninterrupted[r["step"]])
    assert compare(clean_run / "digests", tmp_path / "digests") == []
    # the replacement manager, started by the replaced node's rank, logs beside the first one
    assert "rebuilt node 1" in (run_dir / "manager-node1.log").read_text()
    assert not (Path(SHM_ROOT) / run_id(run_dir)).exists(), "the run left its shared-memory directory behind"

    damaged = run_dir / "persisted" / "node1" / "step-00000010" / "rank1.safetensors"
    with open(damaged, "r+b") as f:  # probe 21: read on node 1, it was named in no line on the screen
        f.truncate(100)
    refused = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--example", "gpt", *TINY, "--iters", "10",
                              "--policy", "baft", "--period", "1", "--nodes", "2", "--max-restarts", "0",
                              "--run-dir", str(run_dir)], capture_output=True, text=True, env=launch_env(), timeout=300)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"{damaged}: holds 100 bytes" in said, said[-3000:]
    assert ("baft: the snapshot of step 10 on disk is damaged (the error below names its file), and no step persisted "
            "before it is whole on every node: start afresh in another --run-dir") in said, said[-3000:]


def stop_rank_when(digests: Path, step: int, stopped: dict, done: threading.Event, run_dir: Path) -> None:
    """SIGSTOP the client of the rank whose state digests are ``digests`` (the process torchrun started and ``ps``
    shows as the rank: :mod:`baft.warm.client`) once the rank starts the iteration after ``step`` in the first
    attempt (it records a digest line, with its pid, as each iteration starts); in ``stopped`` the rank's pid, start
    time and the time of the stop, and the client's pid."""
    while not done.wait(0.01):
        text = digests.read_text() if digests.exists() else ""
        lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines only
        last = json.loads(lines[-1]) if lines else None
        if last is not None and last["restart"] == 0 and last["step"] >= step:
            client = client_of(run_dir, last["rank"])
            client.send_signal(signal.SIGSTOP)
            stopped.update(pid=last["pid"], started=psutil.Process(last["pid"]).create_time(), at=time.time(),
                           client=client.pid)
            return


def client_of(run_dir: Path, rank: int) -> psutil.Process:
    """The warm client that stands for ``rank`` of the run in ``run_dir`` (the rank, forked, has the warm server's
    command line and initial environment)."""
    wanted = {"RANK": str(rank), LAUNCHER_ENV["run_dir"]: str(run_dir)}
    for proc in psutil.process_iter(["cmdline"]):
        if not any(arg.endswith("baft/warm/client.py") for arg in proc.info["cmdline"] or ()):
            continue
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile, or another user's
            continue
        if all(env.get(k) == v for k, v in wanted.items()):
            return proc
    raise LookupError(f"no warm client of rank {rank} of {run_dir}")


@pytest.mark.slow
def test_a_stopped_rank_is_killed_by_its_manager_and_replaced_in_place_bit_identical(tmp_path, clean_run,
                                                                                   uninterrupted):
    """Rank 1 is SIGSTOPped mid-run under ``baft train --in-place``, as a user stops it: the process ``ps`` and
    torchrun show as the rank, its warm client, which passes the stop on through the warm server (before, the forked
    rank trained on and the stopped client held the job up at its end, forever). Rank 0 blocks in a receive from it,
    the node's manager sees rank 1's heartbeat fall silent for hang_timeout and kills it, the warm server replaces it
    and continues the client, and rank 0 recovers in its own process from the newest snapshot."""
    run_dir = tmp_path / "run"
    stopped, done = {}, threading.Event()
    watcher = threading.Thread(target=stop_rank_when, args=(tmp_path / "digests" / "rank1.jsonl", 4, stopped, done, run_dir))
    watcher.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--in-place", "--example", "gpt", *TINY,
                               "--iters", "10", "--policy", "baft", "--period", "1", "--hang-timeout", "3",
                               "--max-restarts", "1", "--run-dir", str(run_dir)], capture_output=True, text=True,
                              env=launch_env({DIGESTS_ENV: str(tmp_path / "digests")}), timeout=300)
    finally:
        done.set()
        watcher.join()
        if stopped and (left := live(stopped)) is not None:
            left.kill()  # a watchdog that failed must not leave a stopped process behind
        if stopped and psutil.pid_exists(stopped["client"]):
            psutil.Process(stopped["client"]).resume()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert stopped, "rank 1 never reached step 4"
    assert live(stopped) is None, "the stopped rank is still there"
    recovery, = load_recoveries(run_dir)
    assert recovery.kind == "in place", recovery
    assert recovery.fault.startswith(f"hang: rank 1 (pid {stopped['pid']}) silent for 3."), recovery
    # silent for hang_timeout by the manager's clock: stopped at least that long, less the beat it last saw
    assert recovery.source == "memory" and 3 - 0.6 - 0.1 < recovery.killed_at - stopped["at"] < 10, (recovery, stopped)
    assert f"{recovery.fault} (hang_timeout 3 s): killed it" in (run_dir / "manager-node0.log").read_text()
    records = losses(run_dir)
    resumed = [r["step"] for r in records if r["restart"] == 1]
    assert resumed == list(range(recovery.restored_step + 1, 11))
    for r in records:
        assert repr(r["loss"]) == repr(uninterrupted[r["step"]]), f"step {r['step']} differs"
    assert compare(clean_run / "digests", tmp_path / "digests") == []
    pids = {}
    for line in (tmp_path / "digests" / "rank0.jsonl").read_text().splitlines():
        pids.setdefault(json.loads(line)["restart"], set()).add(json.loads(line)["pid"])
    assert pids[0] == pids[1], "rank 0 kept its process"


def live(stopped: dict):
    """The process ``stopped`` names, if it still exists (a zombie or a reused pid is not it)."""
    try:
        proc = psutil.Process(stopped["pid"])
        gone = abs(proc.create_time() - stopped["started"]) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE
        return None if gone else proc
    except psutil.NoSuchProcess:
        return None


def baseline_run(tmp_path, policy: str, iters: int, period: int, fault: str) -> Path:
    """A run of the job under a disk baseline, killed once (``fault``): its run directory."""
    work = tmp_path / policy
    run_worker(2, [*TINY, "--iters", str(iters), "--policy", policy, "--period", str(period),
                   "--run-dir", str(work / "run")], max_restarts=1,
               env={"BAFT_CHAOS": fault, DIGESTS_ENV: str(work / "digests")})
    return work / "run"


@pytest.mark.slow
def test_the_disk_baselines_restart_from_their_newest_checkpoint(tmp_path, clean_run, uninterrupted):
    """The disk baselines the benchmarks compare against restart the usual way (DeepSpeed's: load_checkpoint).
    dcp-async used to restore nothing and train again from step 0 without a word. The two run side by side."""
    with ThreadPoolExecutor(2) as pool:
        deepspeed = pool.submit(baseline_run, tmp_path, "deepspeed", 10, 3, "rank=1,step=8,phase=backward")
        dcp = pool.submit(baseline_run, tmp_path, "dcp-async", 6, 2, "rank=1,step=5,phase=backward")
        deepspeed, dcp = deepspeed.result(), dcp.result()

    resumed = [r for r in losses(deepspeed) if r["restart"] == 1]
    assert [r["step"] for r in resumed] == [7, 8, 9, 10]  # checkpoints at 3 and 6: resumes after 6
    for r in resumed:
        assert repr(r["loss"]) == repr(uninterrupted[r["step"]])
    recovery = json.loads((deepspeed / "recovery.jsonl").read_text().splitlines()[0])
    assert recovery["source"] == "disk" and recovery["restored_step"] == 6
    assert compare(clean_run / "digests", deepspeed.parent / "digests") == []

    saved = sorted(p.name for p in (dcp / "checkpoints").iterdir())
    assert saved == ["step4", "step6"]  # the newest two kept
    assert all((dcp / "checkpoints" / s / ".metadata").exists() for s in saved)
    recovery = json.loads((dcp / "recovery.jsonl").read_text().splitlines()[0])
    # step 4's save is written in the background during step 5: the kill may find it incomplete
    assert recovery["source"] == "disk" and recovery["restored_step"] in (2, 4)
    resumed = [r for r in losses(dcp) if r["restart"] == 1]
    assert [r["step"] for r in resumed] == list(range(recovery["restored_step"] + 1, 7))
    for r in resumed:
        assert repr(r["loss"]) == repr(uninterrupted[r["step"]])
    assert compare(clean_run / "digests", dcp.parent / "digests", last_step=6) == []


@pytest.mark.slow
def test_a_failed_run_goes_on_from_its_newest_snapshot_on_disk(tmp_path, clean_run, uninterrupted):
    """A run that ends (here: a rank dies with no restarts left) shows the end of its log, and frees its shared
    memory only after its manager writes the newest snapshot to RUN_DIR/persisted: launching the run again
    resumes from that step, bit for bit, instead of starting over; once at --iters, a launch trains nothing
    and says so. The resumed launch's manager is killed as it trains: a new one takes over its snapshots as the run
    ends, and writes its last step (before, the launch ended in an error naming no manager running, its snapshots
    left in shared memory, unwritten). A launch whose config asks another batch size goes on at the run's, saying so
    (probe 18: the config's change was dropped without a word). A copy of the run directory elsewhere is another run, refused at start
    (probe 18: it said "resumed from step 10 (disk)", then its first snapshot failed on a manager's error)."""
    import shutil
    import subprocess
    import sys

    from baft.cli.launch import launch_env
    from baft.cli.runlog import LAUNCHER, LOG_NAME, RANKS

    run_dir = tmp_path / "run"

    def train(*extra, run=run_dir) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "baft.cli", "train", "--example", "gpt", *TINY, "--iters", "10",
                               "--policy", "baft", "--period", "1", "--max-restarts", "0", "--run-dir", str(run),
                               *extra], capture_output=True, text=True,
                              env=launch_env({DIGESTS_ENV: str(tmp_path / "digests")}), timeout=300)

    failed = train("--fault", "rank=1,step=6,phase=backward")
    assert failed.returncode == 2 and "Traceback" not in failed.stdout, failed.stdout[-2000:]
    # the screen shows the end of the log: the survivor's error (gloo words it by what the socket saw: closed,
    # reset, ...), or torchrun's stop of it where that came first (a fresh-clone CI: its SIGTERM before the survivor's
    # receive failed), and torchrun's summary, the killed rank's signal
    ranks, launcher = (failed.stderr.split(f"the last lines of {source}:\n")[1] for source in (RANKS, LAUNCHER))
    survivor = "[0] [rank0]:" in ranks or "Signal 15 (SIGTERM) received" in launcher
    assert survivor and "Signal 9 (SIGKILL) received" in launcher, failed.stderr[-3000:]
    assert f"training failed (exit code 1); every rank's output is in {run_dir / LOG_NAME}" in failed.stderr
    assert max(r["step"] for r in losses(run_dir)) == 5
    assert sorted(p.name for p in (run_dir / "persisted" / "node0").glob("step-*")), "nothing persisted at the end"

    resumed = train("--fault", "manager=0,step=8")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert resumed.stderr.count("baft: node 0's manager died during the run; a new one took over its snapshots") == 1
    said = re.search(r"^baft: resumed from step (\d+) \(disk\)$", resumed.stdout, re.MULTILINE)
    assert said, resumed.stdout[-2000:]
    restored = int(said[1])
    # the snapshot of step 5 commits during iteration 6, which the fault cut short; step 4's may still be sealing
    # on the killed rank (a rank begins a snapshot while at most in_flight - 1 others seal)
    assert 5 - (slots.SLOTS - 2) <= restored <= 5, restored
    after = losses(run_dir)[5:]
    assert [r["step"] for r in after] == list(range(restored + 1, 11))
    for r in after:
        assert repr(r["loss"]) == repr(uninterrupted[r["step"]]), f"step {r['step']} differs"
    relaunch, = load_recoveries(run_dir)  # the failed launch had no restart left: this launch is the recovery
    assert (relaunch.restart, relaunch.fault, relaunch.source) == (0, "a new launch", "disk")
    assert relaunch.restored_step == restored and relaunch.lost_steps == 5 - restored
    assert 0 < relaunch.T1 < 60 and relaunch.T3 > 0, relaunch  # T1 from this launch's start, not the last step
    assert "a new launch" in resumed.stdout, "baft train prints the recovery table"
    assert compare(clean_run / "digests", tmp_path / "digests") == []

    again = train("--micro-batches", "2")  # a config asking fewer: the run goes on at its own, and says so
    assert again.returncode == 0, again.stderr[-3000:]
    assert "baft: resumed from step 10 (disk)" in again.stdout
    assert ("the config's train_batch_size is 4 (2 micro-batches), the run's snapshots were taken under a config of "
            "8: it goes on at the restored step's 8 (4 micro-batches), as it trained") in again.stdout + again.stderr
    assert "the run is already at step 10: nothing to train until --iters 10" in again.stdout
    assert len(losses(run_dir)) == 5 + len(after)

    other = train("--d-model", "32")  # another model in the same run directory: refused, not started over
    said = other.stdout + other.stderr
    # (either stage's error may stop the launch first: each rank refuses its own)
    assert other.returncode != 0 and re.search(r"of stage \d is of another model", said), said[-3000:]
    assert re.search(r"another model \(signature \w+, this model's is \w+: only the snapshot has \S+ \(float32, "
                     r"\[\d+(, \d+)*\]\)", said), said[-3000:]  # which tensors differ (probe 18: from disk, none said)
    assert "refusing to start again from step 0" in said and "another --run-dir" in said
    assert "is kept in" in said and "goes on from it" not in said, said[-3000:]  # it would stop the same way again
    assert len(losses(run_dir)) == 5 + len(after)

    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    copied = train(run=moved)
    said = copied.stdout + copied.stderr
    assert copied.returncode != 0 and "resumed from" not in said, said[-3000:]
    assert re.search(r"the snapshot of step 10 of stage \d is of run 'run-\w+', this run is 'moved-\w+' \(baft train "
                     r"names a run by its directory's path", said), said[-3000:]

    damaged = run_dir / "persisted" / "node0" / "step-00000010" / "rank1.safetensors"
    with open(damaged, "r+b") as f:  # probe 20: rank 0's restore, and each stage, blamed it on their own words too
        f.truncate(100)
    truncated = train()
    said = truncated.stdout + truncated.stderr
    assert truncated.returncode != 0 and said.count(str(damaged)) == 1, said[-3000:]
    assert f"{damaged}: holds 100 bytes, the manifest says" in said and "refusing to start again" in said, said[-3000:]
    assert "could not restore rank 0" not in said and "fits this model" not in said, said[-3000:]
    # the way on from the older step on disk, said with the step (probe 21: only a fresh start was offered), taken
    aside = damaged.parent.parent / f"damaged-{damaged.parent.name}"
    assert (f"baft: the snapshot of step 10 on disk is damaged (the error below names its file): to go on from step "
            f"{restored}, the newest step persisted before it whose files are whole on every node, move its directory "
            f"aside (`mv {damaged.parent} {aside}`) and launch again") in said, said[-3000:]
    damaged.parent.rename(aside)
    older = train()
    assert older.returncode == 0 and f"baft: resumed from step {restored} (disk)" in older.stdout, older.stderr[-3000:]
    assert [(r["step"], repr(r["loss"])) for r in losses(run_dir)[-(10 - restored):]] == [
        (step, repr(uninterrupted[step])) for step in range(restored + 1, 11)]
