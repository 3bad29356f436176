"""A script that loads its own DeepSpeed checkpoint at start-up (GPT-NeoX's pattern) resumes from baft's newer
snapshot, with its own bookkeeping as of that step, and still starts from a checkpoint written without baft.

Every run is compared part by part, at every step, with the script's uninterrupted run
(:func:`baft.recovery.digests.compare`): weights, optimizer, scheduler, RNG, data position and the
script's own ``client_state`` (iteration, consumed samples).
"""

import functools
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from baft.cli.launch import launch_env
from baft.recovery.digests import DIGESTS_ENV, compare
from baft.recovery.record import load_recoveries
from baft.recovery.script_checkpoint import ClientState, _guarded_load

SCRIPT = Path(__file__).parent / "scripts" / "neox_job.py"


def train(directory: Path, *args, faults=(), policy="baft") -> subprocess.CompletedProcess:
    """``baft train`` of the script with its checkpoints in ``directory/ckpt``, its digests in ``directory/digests``."""
    env = {DIGESTS_ENV: str(directory / "digests"), **({"BAFT_CHAOS": ";".join(faults)} if faults else {})}
    return subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--run-dir", str(directory / "run"),
                           "--max-restarts", str(len(faults)), "--", str(SCRIPT), "--ckpt", str(directory / "ckpt"),
                           "--policy", policy, *args], capture_output=True, text=True, env=launch_env(env), timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every run of this module, side by side (their restarts leave the cores idle), by name: its directory and
    its ``baft train``. ``reference`` is the uninterrupted run, without baft: checkpoints at steps 5 and 10 of
    12; ``first start`` begins from the reference's checkpoint of step 5, so it waits for that run."""
    def run(name, *args, **kwargs):
        directory = tmp_path_factory.mktemp(name.replace(" ", "-"))
        return directory, train(directory, *args, **kwargs)

    def first_start():
        directory, proc = reference.result()
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert (directory / "ckpt" / "latest").read_text().strip() == "global_step10"
        mine = tmp_path_factory.mktemp("first-start")
        shutil.copytree(directory / "ckpt" / "global_step5", mine / "ckpt" / "global_step5")
        (mine / "ckpt" / "latest").write_text("global_step5")
        # snapshots every 3 steps: killed in step 11, the newest is step 9, the script's own checkpoint step 10
        return mine, train(mine, "--register", "callable", "--period", "3", faults=["rank=1,step=11,phase=backward"])

    with ThreadPoolExecutor(3) as pool:
        reference = pool.submit(run, "reference", "--register", "stateful", policy="none")
        jobs = {"reference": reference,
                "kills": pool.submit(run, "kills", "--register", "stateful",
                                     faults=["rank=1,step=3,phase=backward,restart=0",
                                             "rank=0,step=8,phase=forward,restart=1"]),
                "rollback": pool.submit(run, "rollback", faults=["rank=0,step=8,phase=forward"])}
        jobs["first start"] = pool.submit(first_start)
        return {name: job.result() for name, job in jobs.items()}


@pytest.mark.slow
def test_a_kill_before_any_save_and_one_after_resume_from_baft_not_the_older_checkpoint(runs):
    reference, _ = runs["reference"]
    directory, proc = runs["kills"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    before_save, after_save = load_recoveries(directory / "run")  # a step's snapshot commits in the next step
    assert before_save.source == after_save.source == "memory" and before_save.restored_step in (1, 2)
    assert after_save.restored_step in (6, 7), after_save
    assert (f"baft: kept step {after_save.restored_step} (memory) over step 5 in {directory / 'ckpt' / 'global_step5'}"
            in proc.stdout), proc.stdout[-2000:]
    assert compare(reference / "digests", directory / "digests") == []


@pytest.mark.slow
def test_the_first_start_loads_a_checkpoint_written_without_baft_and_a_newer_one_is_trained_again_exactly(runs):
    """The checkpoint of step 10 is newer than the snapshot of step 9, but holds no generator states: baft keeps its
    snapshot and the run trains step 10 again."""
    reference, _ = runs["reference"]
    directory, proc = runs["first start"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "baft: loaded step" not in proc.stdout, proc.stdout
    assert (f"baft: kept step 9 (memory) over step 10 in {directory / 'ckpt' / 'global_step10'} (newer, but a "
            f"DeepSpeed checkpoint holds no generator states: step 10 is trained again)") in proc.stdout, proc.stdout
    assert compare(reference / "digests", directory / "digests") == []


@pytest.mark.slow
def test_a_load_that_would_roll_back_a_snapshot_with_nothing_registered_stops_in_one_line(runs):
    directory, proc = runs["rollback"]
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("baft: error:")]
    assert errors and re.search(rf"engine\.load_checkpoint\({re.escape(str(directory / 'ckpt'))}\) would roll this run "
                                rf"back from step [67] \(memory\) to the checkpoint's step 5: pass baft\.initialize "
                                rf"client_state=", errors[0]), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_load_before_the_scripts_first_save_returns_the_client_state_of_the_restored_step(tmp_path, capsys,
                                                                                            monkeypatch):
    """Megatron's start-up calls ``load_checkpoint`` whether or not a checkpoint exists and counts from 0 where it
    returns ``(None, None)``: killed before the script's first save, the run resumed at baft's step with the script's
    iteration 0 and trained that many steps too many, silently. A callable ``client_state`` gets the restored step's
    back, as from an older checkpoint."""
    monkeypatch.setattr("baft.recovery.script_checkpoint.THIS_PROCESS", SimpleNamespace(script_resumed=False, show_restored=lambda engine: None))
    client = ClientState(lambda: {"iteration": 0})
    client.restore({"iteration": 2})
    engine = SimpleNamespace(global_rank=0, baft=SimpleNamespace(restored=SimpleNamespace(step=2, source="memory")))

    def deepspeeds(load_dir, tag=None, *args, **kwargs):
        return None, None  # DeepSpeed's load_checkpoint where load_dir has no "latest"

    assert _guarded_load(client, engine, deepspeeds, str(tmp_path)) == ("baft://memory/step2", {"iteration": 2})
    assert client.not_returned(2) is None
    assert f"baft: kept step 2 (memory), {tmp_path} holds no checkpoint yet" in capsys.readouterr().out
    assert _guarded_load(None, engine, deepspeeds, str(tmp_path)) == (None, None)  # nothing to return: DeepSpeed's


def test_an_argument_deepspeeds_load_checkpoint_does_not_take_fails_as_deepspeeds_call_would():
    """Probe 22: ``engine.load_checkpoint(dir, client_state=...)`` (save_checkpoint's argument) failed, once baft had
    restored, with ``_guarded_load() got multiple values for argument 'client_state'``, naming baft's guard; plain
    DeepSpeed says the argument is not one it takes."""
    from baft.pipeline.engine import BaftPipelineEngine

    engine = BaftPipelineEngine.__new__(BaftPipelineEngine)
    engine.baft = SimpleNamespace(load_guard=functools.partial(_guarded_load, None))
    with pytest.raises(TypeError, match=r"^load_checkpoint\(\) got an unexpected keyword argument 'client_state'$"):
        engine.load_checkpoint("ckpt", client_state={})


def test_a_callables_restored_state_that_no_load_checkpoint_returned_is_said():
    """GPT-NeoX's start-up loads only where its directory holds a checkpoint: killed before its first save, with a
    callable client_state, nothing handed the restored step's back and its EMA, best loss and meter started again,
    silently (probe 13). Said as the loop starts; not where load_checkpoint returned it, nor for an object a restore
    loads."""
    client = ClientState(lambda: {"best": 1.0})
    assert client.not_returned(5) is None  # nothing restored: a fresh start
    client.restore({"best": 0.5})
    assert "no engine.load_checkpoint returned what it held at the restored step 5" in client.not_returned(5)
    client.returned = True
    assert client.not_returned(5) is None

    class Tracker:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loaded = ClientState(Tracker())
    loaded.restore({})
    assert loaded.not_returned(5) is None
