"""A loop that counts its calls and takes a new iterator of its loader each epoch: resumed inside any epoch it reads
on as the uninterrupted run did (the iterator the replay took for the restored step's epoch is made the restored one:
before, it read that epoch from its start, silently); resumed at an epoch's end it stops in one line as the replay
ends (StopIteration, before)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from baft.cli.launch import launch_env

SCRIPT = Path(__file__).parent / "scripts" / "epoch_iterators.py"


def train(tmp_path, name, fault):
    cmd = [sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "1",
           "--run-dir", str(tmp_path / name), *(["--fault", fault] if fault else []), "--", str(SCRIPT)]
    return subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=300)


def losses(tmp_path, name) -> dict[str, str]:
    """Each step's loss as rank 0 printed it last (a resumed run prints again the steps it replays)."""
    return dict(re.findall(r"^\[0\] step (\d+) loss (\S+)$", (tmp_path / name / "output.log").read_text(), re.M))


@pytest.mark.slow
def test_a_new_iterator_each_epoch_resumes_inside_any_epoch_and_stops_in_one_line_at_an_epochs_end(tmp_path):
    reference = train(tmp_path, "reference", None)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert len(losses(tmp_path, "reference")) == 15
    # killed as step 4 (8) computes, before the snapshot of step 3 (7), copied in its bubbles, is committed: resumed
    # from step 2 in the first epoch (6, in the second: the replay took its iterator, made the restored one)
    for name, fault, resumed in (("first-epoch", "rank=1,step=4,phase=backward", 2),
                                 ("second-epoch", "rank=1,step=8,phase=backward", 6)):
        run = train(tmp_path, name, fault)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"resumed from step {resumed} " in (tmp_path / name / "output.log").read_text()
        assert losses(tmp_path, name) == losses(tmp_path, "reference"), name
    ended = train(tmp_path, "epoch-end", "rank=0,step=12,phase=forward")  # resumed from step 10, an epoch's end
    assert ended.returncode != 0
    said = [line for line in (ended.stdout + ended.stderr).splitlines() if "took a new iterator" in line]
    assert said and said[0].startswith("baft: error: the loop took a new iterator of its data loader"), said
