"""Bit-identical resume in the jobs people run, proven part by part: each case trains the matrix job
uninterrupted and with SIGKILLs (from inside a phase, or from outside), and every part of every rank's
state (weights, masters, moments and step counts, every param-group hyper-parameter, the LR scheduler,
loss scaler, every RNG, data position, the micro-batches read) must be identical at every step.

The cases take every value of every axis at least once, the scripts of the bit-identical issue among
them (DeepSpeed's warmup schedulers in fp32, bf16 and ZeRO-1 bf16 at dp=2, and the DeepSpeedExamples
shape: ``args``, ``training_data=``, dropout). ``experiments/matrix.py`` runs cases drawn at random."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from matrix import AXES, PHASES, Case, Fault, run_case  # noqa: E402  (experiments/ is not a package)

# Seven cases that together take every value of every axis of experiments/matrix.py (AXES, PHASES) at least
# once; the first three are the scripts of the bit-identical issue. Those that recover in place check too that
# every rank but the killed one kept its process (experiments/matrix.py: survivors_relaunched)
CASES = {
    "warmuplr-bf16-deepspeed-examples-shape": Case(
        seed=12, optimizer="adam", scheduler="WarmupLR", precision="bf16", data="engine", dropout=[True, True],
        checkpointing=False, tied=False, frozen=False, micro_batches=2, period="auto", form="args",
        # the examples' own loop; resumed from step 6, where an epoch of the engine's loader ends (12 micro-batches)
        recovery="in place", loop="calls", faults=[Fault(1, 7, "forward")]),
    "warmup-decay-zero1-bf16-dp2": Case(
        seed=13, optimizer="sgd", scheduler="WarmupDecayLR-log", precision="zero1-bf16", data="set",
        dropout=[False, True], checkpointing=False, tied=False, frozen=False, micro_batches=2, period=3,
        # ranks 1 and 2 survive both kills: the second restores the snapshot of step 6 their new engines took; the
        # script's own scheduler is on the torch optimizer inside ZeRO's, which a survivor's new engine makes again
        form="config_params", recovery="in place", loop="calls", own_scheduler=True,
        faults=[Fault(3, 5, "commit"), Fault(0, 7, "optimizer")]),
    "warmup-decay-fp32-stateful-tied-frozen": Case(
        # DeepSpeed's C++ Adam: its beta products, followed by one adapter per optimizer however it was reached
        seed=11, optimizer="ds-adam", scheduler="WarmupDecayLR-linear", precision="fp32", data="stateful",
        # 4 micro-batches of the 12 an epoch holds: epochs end at steps 3 and 6, and a resume lands on one
        dropout=[True, False], checkpointing=True, tied=True, frozen=True, micro_batches=4, period=1, form="dict",
        # buffers each forward changes in place (recomputed ones too): the first stage's forwards run before its
        # bubbles, so its snapshot must have copied them as the iteration began
        recovery="in place", seed_layers=True, buffers="counter-inplace",
        faults=[Fault(1, 4, "outside"), Fault(1, 7, "copy")]),  # rank 0 survives both
    "adam-cosine-zero1-fp32-dp2": Case(
        # Megatron's dropout, from DeepSpeed's model-parallel tracker, recomputed by activation checkpointing; a
        # BatchNorm whose running statistics each replica keeps of its own batches (a snapshot held a share of each
        # replica's, and a restore gave both a mix, silently: refused at start, then)
        seed=14, optimizer="adam", scheduler="WarmupCosineLR", precision="zero1-fp32", data="stateful",
        dropout=[True, True], dropout_rng="tracker", checkpointing=True, tied=True, frozen=False, micro_batches=8,
        period=3, form="path", recovery="relaunch", buffers="batchnorm", faults=[Fault(2, 7, "copy")]),
    "adamw-no-scheduler-bf16-engine-data": Case(
        seed=15, optimizer="adamw", scheduler="none", precision="bf16", data="engine", dropout=[True, False],
        # the batch size doubled from step 3 on: killed in step 4's optimizer step, it resumes from step 3, 4 + 4 + 8
        # micro-batches into the engine's loader (not 3 x 8), then killed in step 7, from step 6 (16 + 3 x 8)
        checkpointing=False, tied=True, frozen=False, micro_batches=4, period=1, form="path",
        recovery="relaunch", seed_layers=True, own_scheduler=True, batch_ramp=True,
        faults=[Fault(0, 4, "optimizer"), Fault(1, 7, "backward")]),
    "sgd-onecycle-fp32-stateful": Case(
        # a loop on the engine's step: the survivor calls again for the step the restore took back, and its own
        # scheduler steps again after it
        seed=16, optimizer="sgd-plain", scheduler="OneCycle", precision="fp32", data="stateful", dropout=[False, True],
        dropout_rng="tracker", checkpointing=True, tied=False, frozen=True, micro_batches=2, period="auto", form="dict",
        # buffers given new tensors by each forward and parameters new .data by each step: a snapshot copies the
        # tensors the engine holds as it begins, not those it held at the first
        recovery="in place", own_scheduler=True, buffers="rebind", faults=[Fault(1, 5, "backward")]),
    "deepspeed-adam-torch-scheduler-fp32-iterator": Case(
        seed=17, optimizer="ds-adam", scheduler="torch", precision="fp32", data="iterator", dropout=[False, False],
        # killed sealing step 6's snapshot, resumed from step 5: DeepSpeed's C++ Adam must go on multiplying
        # beta^t as the uninterrupted run does (beta2^6 by pow rounds otherwise)
        checkpointing=False, tied=False, frozen=False, micro_batches=8, period=1, form="config_params",
        recovery="relaunch", buffers="batchnorm", faults=[Fault(1, 7, "seal")]),
}


def test_the_cases_take_every_value_of_every_axis():
    for axis, values in AXES.items():
        taken = [getattr(case, axis) for case in CASES.values()]
        assert all(value in taken for value in values), f"{axis}: {[v for v in values if v not in taken]} untested"
    assert set(PHASES) <= {fault.phase for case in CASES.values() for fault in case.faults}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_resumes_bit_identical_in_every_part(name, tmp_path):
    outcome = run_case(CASES[name], tmp_path)
    assert not outcome.refused, outcome.refused
    assert len(outcome.resumed) == len(CASES[name].faults) and min(outcome.resumed) >= 1, outcome.resumed
    assert outcome.problems == [], "\n".join(outcome.problems)
