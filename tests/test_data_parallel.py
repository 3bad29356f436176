"""pp=2 x dp=2: each replica snapshots its 1/dp shard; restarts work with the same or fewer replicas."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from baft.cli.launch import launch_env
from conftest import TINY, run_worker, run_ranks


@pytest.mark.slow
def test_replicas_snapshot_disjoint_shards_that_cover_the_stage(tmp_path, shm_root):
    run_ranks(4, "snapshot_check.py", [*TINY, "--policy", "baft", "--period", "1", "--iters", "4",
                                       "--shm-root", str(shm_root), "--out", str(tmp_path)], timeout=400)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["mismatches"] == [] and r["checked"] == [1, 2, 3]
    for stage in (0, 1):
        shards = [set(r["chunks"]) for r in results if r["stage"] == stage]
        assert len(shards) == 2
        assert not shards[0] & shards[1], "replicas copied the same chunk"
        assert shards[0] | shards[1] == set(range(results[2 * stage]["total_chunks"]))
        assert min(len(s) for s in shards) >= 0.3 * results[2 * stage]["total_chunks"]


def losses(run_dir):
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_restart_with_fewer_replicas_resumes_from_the_same_snapshot_and_another_stage_count_is_refused(
        tmp_path, shm_root):
    run_dir = tmp_path / "run"
    common = [*TINY, "--layers", "4", "--policy", "baft", "--period", "1", "--shm-root", str(shm_root),
              "--run-dir", str(run_dir)]
    run_worker(4, [*common, "--iters", "5"], timeout=400)
    before = {r["step"]: r["loss"] for r in losses(run_dir)}
    run_worker(2, [*common, "--iters", "7"], timeout=400)
    after = losses(run_dir)[len(before):]
    # the dp=4 run's ranks snapshotted its final state, step 5, as they exited: the dp=2 run goes on from it
    assert [r["step"] for r in after] == [6, 7]
    # one step on, half the batch: close to, not equal to, the wider run's last loss
    assert abs(after[0]["loss"] - before[5]) < 0.05 * before[5]

    proc = run_worker(4, [*common, "--stages", "4", "--iters", "9"], check=False, timeout=400)
    assert proc.returncode != 0
    assert "snapshots were taken with 2 pipeline stages, this run has 4; restart with 2 stages" in proc.stderr
    assert len(losses(run_dir)) == len(before) + len(after), "the refused run trained nothing"


@pytest.mark.slow
def test_each_replica_keeps_its_own_module_buffers_and_fewer_replicas_take_replica_0s(tmp_path):
    """A BatchNorm's running statistics are each replica's own (its batches'): a snapshot held a share of each
    replica's, so a restore gave both a mix. Restarted with one replica, it takes replica 0's."""
    script = Path(__file__).parent / "scripts" / "replica_buffers.py"

    def train(nprocs, steps):
        proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", str(nprocs), "--run-dir",
                               str(tmp_path / "run"), "--", str(script), str(steps)],
                              capture_output=True, text=True, env=launch_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (tmp_path / "run" / "output.log").read_text()

    two = train(4, 3)  # pp=2 x dp=2: ranks 0 and 1 are the first stage's replicas
    ended = dict(re.findall(r"^\[\d\] rank [01] replica (\d) ends at step 3: (\[\[.*\]\])$", two, re.M))
    assert set(ended) == {"0", "1"} and ended["0"] != ended["1"], ended
    one = train(2, 4)
    started = re.findall(r"^\[0\] rank 0 replica 0 starts at step (\d+): (\[\[.*\]\])$", one, re.M)
    assert started[-1] == ("3", ended["0"]), started
