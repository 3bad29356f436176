"""``baft.initialize`` takes ``deepspeed.initialize``'s own calling forms."""

import json
from pathlib import Path

import pytest

from conftest import run_ranks


@pytest.mark.slow
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
