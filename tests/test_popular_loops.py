"""Training loops shaped as popular scripts write theirs (nanoGPT's, Megatron-DeepSpeed's), ported to a DeepSpeed
pipeline under baft, killed and relaunched, recovered in place, and finished then launched again to train on: every
line they print and every part of every rank's state as an uninterrupted run's (probe 19;
``tests/scripts/popular_loops.py``)."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from baft.cli.launch import launch_env
from baft.cli.runlog import LOG_NAME
from baft.recovery.digests import DIGESTS_ENV, compare, redone_differ
from conftest import SCRIPTS

ITERS = 10
LINE = re.compile(r"^(?:\[\d\] )?(rank \d (?:iter|iteration|validation|final) .*)$", re.M)


def train(directory: Path, shape: str, *options: str, iters: int = ITERS, digests: str = "digests"):
    config = directory / "ds_config.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "baft": {"period": 1}}))
    proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "2",
                           "--run-dir", str(directory / "run"), *options, "--", str(SCRIPTS / "popular_loops.py"),
                           "--config", str(config), "--shape", shape, "--iters", str(iters)],
                          capture_output=True, text=True, timeout=300,
                          env=launch_env({DIGESTS_ENV: str(directory / digests)}))
    assert proc.returncode == 0, (directory.name, proc.stderr[-3000:])
    return proc


def printed(directory: Path) -> list[str]:
    """The lines every rank printed, in the order each printed them (a step a restore took back printed again)."""
    return LINE.findall((directory / "run" / LOG_NAME).read_text())


def _runs(tmp_path_factory, cases: dict) -> dict[str, Path]:
    def run(name):
        directory = tmp_path_factory.mktemp(name)
        shape, *options = cases[name]
        if options and options[0] == "finished at":  # a finished run launched again with more steps
            train(directory, shape, iters=options[1])
            train(directory, shape)
        else:
            train(directory, shape, *options)
        return name, directory

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, cases))


@pytest.mark.slow
def test_nanogpt_and_megatron_shaped_loops_resume_as_an_uninterrupted_run(tmp_path_factory):
    """nanoGPT's ``while True`` that breaks once ``iter_num`` passes ``max_iters``, with its first evaluation before any
    call to train, and Megatron's ``iteration = args.iteration`` (0: no checkpoint of its own): resumed, each trained
    as many steps again as it had (probe 19), nanoGPT's said at start naming its evaluation's loop, Megatron's
    silently. Killed in the step right after an evaluation (relaunched), in a step two after one (in place), and
    finished then launched again to train on: the run ends at the uninterrupted run's last step, every line it printed
    among the uninterrupted run's, its final lines and every part of its state at every step the same. Finished and
    launched again, the learning rate nanoGPT's loop sets by hand for the next step was undone by the one its last
    step had (the snapshot taken as the process ended, set again as the first resumed iteration started: probe 19), in
    a loop on the engine's step too. torchtitan's count, its client_state, set at the loop's top before the call:
    resumed, it was one ahead and the run ended a step short (probe 22)."""
    cases = {"nanogpt": ("nanogpt",), "nanogpt-relaunch": ("nanogpt", "--fault", "rank=1,step=4,phase=backward"),
             "nanogpt-in-place": ("nanogpt", "--in-place", "--fault", "rank=0,step=8,phase=forward"),
             "nanogpt-finished": ("nanogpt", "finished at", 6),
             "megatron": ("megatron",), "megatron-relaunch": ("megatron", "--fault", "rank=0,step=5,phase=forward"),
             "steps": ("steps",), "steps-finished": ("steps", "finished at", 7),
             "titan": ("titan",), "titan-relaunch": ("titan", "--fault", "rank=1,step=6,phase=backward")}
    runs = _runs(tmp_path_factory, cases)
    for name, directory in runs.items():
        reference = runs[name.split("-")[0]]
        if directory is reference:
            continue
        said = printed(directory)
        finals = sorted(line for line in said if " final " in line)
        if name.endswith("finished"):  # the first launch's own end, then the run's
            finals = [line for line in finals if f" step {ITERS} " in line]
        assert finals == sorted(line for line in printed(reference) if " final " in line) and len(finals) == 2, (
            name, finals)
        others = [line for line in said if line not in printed(reference) and " final " not in line]
        assert others == [], (name, others)
        assert compare(reference / "digests", directory / "digests") == [], name
        assert redone_differ(directory / "digests") in ([], [f"{directory / 'digests'}: no step is recorded twice, "
                                                             f"nothing to compare"]), name
