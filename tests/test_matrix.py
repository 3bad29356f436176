"""Bit-identical resume in the jobs people run, proven part by part: each case trains the matrix job
uninterrupted and with SIGKILLs (from inside a phase, or from outside), and every part of every rank's
state (weights, masters, moments and step counts, every param-group hyper-parameter, the LR scheduler,
loss scaler, every RNG, data position, the micro-batches read) must be identical at every step.

The cases are the scripts of the bit-identical issue: DeepSpeed's warmup schedulers in fp32, bf16 and
ZeRO-1 bf16 at dp=2, and the DeepSpeedExamples shape (``args``, ``training_data=``, dropout).
``experiments/matrix.py`` runs cases drawn at random over every axis."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from matrix import Case, Fault, run_case  # noqa: E402  (experiments/ is not a package)

CASES = {
    "warmup-decay-fp32-stateful-tied-frozen": Case(
        seed=11, optimizer="adamw", scheduler="WarmupDecayLR-linear", precision="fp32", data="stateful",
        # 5 micro-batches of the 12 an epoch holds: epochs end inside steps, never at a step boundary, where
        # torchdata 0.11's StatefulDataLoader resumes a shuffled epoch in the wrong order (README: Limits)
        dropout=[True, False], checkpointing=True, tied=True, frozen=True, micro_batches=5, period=1, form="dict",
        faults=[Fault(1, 4, "outside"), Fault(0, 7, "copy")]),
    "warmuplr-bf16-deepspeed-examples-shape": Case(
        seed=12, optimizer="adam", scheduler="WarmupLR", precision="bf16", data="engine", dropout=[True, True],
        checkpointing=False, tied=False, frozen=False, micro_batches=2, period="auto", form="args",
        faults=[Fault(1, 6, "forward")]),
    "warmup-decay-zero1-bf16-dp2": Case(
        seed=13, optimizer="sgd", scheduler="WarmupDecayLR-log", precision="zero1-bf16", data="iterator",
        dropout=[False, True], checkpointing=False, tied=False, frozen=False, micro_batches=2, period=3,
        form="config_params", faults=[Fault(3, 5, "commit")]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_resumes_bit_identical_in_every_part(name, tmp_path):
    outcome = run_case(CASES[name], tmp_path)
    assert not outcome.refused, outcome.refused
    assert len(outcome.resumed) == len(CASES[name].faults) and min(outcome.resumed) >= 1, outcome.resumed
    assert outcome.problems == [], "\n".join(outcome.problems)
