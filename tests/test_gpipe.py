"""GPipe, which DeepSpeed does not ship, trains exactly like DeepSpeed's own 1F1B."""

import pytest
import torch

from conftest import TINY, run_ranks


@pytest.mark.slow
def test_one_gpipe_step_equals_one_1f1b_step(tmp_path):
    """Bit for bit: both schedules run the same forward and backward of every micro-batch on the
    same weights, and accumulate each gradient over micro-batches in the same order (0..m-1), so
    every floating-point operation and its operands are the same on any CPU."""
    results = {}
    for schedule in ("gpipe", "1f1b"):
        out = tmp_path / schedule
        out.mkdir()
        run_ranks(2, "one_step.py", [*TINY, "--schedule", schedule, "--policy", "none", "--out", str(out)])
        results[schedule] = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for gpipe, one_f_one_b in zip(results["gpipe"], results["1f1b"]):
        assert gpipe["params"].keys() == one_f_one_b["params"].keys()
        for name, value in gpipe["params"].items():
            assert torch.equal(value, one_f_one_b["params"][name]), name
        assert repr(gpipe["loss"]) == repr(one_f_one_b["loss"])
    # the step moved the parameters: the comparison is not between two untouched models
    for rank in results["gpipe"]:
        assert any(not torch.equal(rank["initial"][n], v) for n, v in rank["params"].items())
