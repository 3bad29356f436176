"""A loop that counts its calls and takes a new iterator of its loader each epoch: a resume inside the first epoch
reads on as the uninterrupted run did; one in a later epoch stops in one line as the replay ends (that epoch's
iterator reads from its start: silently other losses, or StopIteration at the epoch's end, before)."""

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
def test_a_new_iterator_each_epoch_resumes_in_the_first_and_stops_in_one_line_in_a_later(tmp_path):
    reference = train(tmp_path, "reference", None)
    assert reference.returncode == 0, reference.stderr[-3000:]
    # killed as step 4 computes, before step 3's snapshot (copied in step 4's bubbles) is committed: resumed from 2
    first = train(tmp_path, "first-epoch", "rank=1,step=4,phase=backward")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resumed from step 2" in (tmp_path / "first-epoch" / "output.log").read_text()
    assert losses(tmp_path, "first-epoch") == losses(tmp_path, "reference") and len(losses(tmp_path, "reference")) == 15
    later = train(tmp_path, "later-epoch", "rank=1,step=8,phase=backward")  # resumed from step 6, in the second
    assert later.returncode != 0
    said = [line for line in (later.stdout + later.stderr).splitlines() if "took a new iterator" in line]
    assert said and said[0].startswith("baft: error: the loop took a new iterator of its data loader"), said
