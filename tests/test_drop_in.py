"""``baft.initialize`` takes ``deepspeed.initialize``'s own calling forms."""

import json
import re
from pathlib import Path

from conftest import run_ranks


def test_the_deepspeed_pipeline_example_call_shape(tmp_path, shm_root):
    """args with --deepspeed_config, model_parameters=, training_data=, train_batch() with no iterator."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "baft": {"policy": "baft", "period": 1, "shm_root": str(shm_root)}}))
    proc = run_ranks(2, "example_pipe.py", ["--deepspeed", "--deepspeed_config", str(config)])
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all(line.endswith("engine BaftPipelineEngine") for line in steps), proc.stdout
    assert "the data position will not be restored" not in proc.stderr  # baft keeps the loader's position
    assert any(Path(shm_root).rglob("slot*.commit.json")), "no snapshot was committed"


def losses(output):
    return [(int(m[0]), m[1]) for m in re.findall(r"^step (\d+) loss (\S+) engine", output, re.M)]


def test_the_engines_own_loader_resumes_at_its_position(tmp_path, shm_root, monkeypatch):
    """A rank killed in step 6 of the example: the resumed steps read the same micro-batches, bit for bit."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "baft": {"policy": "baft", "period": 1, "shm_root": str(shm_root)}}))
    args = ["--deepspeed", "--deepspeed_config", str(config), "--steps", "20"]  # 20 steps: 40 of 16 batches
    clean = dict(losses(run_ranks(2, "example_pipe.py", [*args, "--no-baft"]).stdout))
    monkeypatch.setenv("BAFT_CHAOS", "rank=1,step=18,phase=backward")
    faulty = losses(run_ranks(2, "example_pipe.py", args, max_restarts=1).stdout)
    steps = [step for step, _ in faulty]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] in (17, 18) and steps[-1] == 20, steps  # resumed past an epoch boundary of the loader
    for step, loss in faulty:
        assert loss == clean[step], f"step {step}: {loss} != {clean[step]}"
