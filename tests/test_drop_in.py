"""``baft.initialize`` in DeepSpeedExamples' pipeline script: its calling form, and its loop, which counts its own calls
to ``train_batch`` (``for step in range(args.steps)``), resumed bit for bit (:mod:`baft.script.loop`)."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from baft.cli.launch import launch_env
from baft.cli.runlog import LOG_NAME
from baft.recovery.digests import DIGESTS_ENV, compare, load, processes
from conftest import SCRIPTS

STEPS = 10
SAMPLES = 72  # 18 micro-batches an epoch: the restores fall inside the first and the second
NUMBER = r"[-+\d.e]+"
# each line's fields, and nothing after them: the screen interleaves lines now and then ("...Engine[0] ")
LINE = re.compile(rf"^(step \d+ loss|eval after step \d+ loss|call \d+ starts at step) ({NUMBER}(?: lr {NUMBER})?"
                  rf"(?: draw {NUMBER})?"
                  rf"(?: applied \w+)?(?: schedule \d+ \[[^\]]*\])?)", re.M)


def train(directory: Path, *options: str, script: Path = SCRIPTS / "example_pipe.py") -> subprocess.CompletedProcess:
    """``baft train`` of the example script for ``STEPS`` steps, an evaluation every 2, a learning rate drawn from
    python's generator before each and a draw from torch's, which a Dropout layer draws from too (seeded from the step
    first, on rank 0), DeepSpeed's WarmupLR, and an EMA of the weights in its ``client_state`` after each, each sample
    flipped at random in the engine's loader workers, in ``directory``."""
    config = directory / "ds_config.json"
    config.write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        # read by the script after each call (probe 14: a replayed call read the restored step's count and rates)
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 6}},
        "baft": {"policy": "baft", "period": 1}}))
    return subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--run-dir", str(directory / "run"),
                           *options, "--", str(script), "--steps", str(STEPS), "--eval-every", "2",
                           "--lr-jitter", "--dropout", "--seed-each-step", "0", "--ema", "--augment",
                           "--samples", str(SAMPLES),
                           "--deepspeed_config", str(config)],
                          capture_output=True, text=True, timeout=300,
                          env=launch_env({DIGESTS_ENV: str(directory / "digests")}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    cases = {"uninterrupted": (),
             # killed in the step after an evaluation: the snapshot of that step is not committed, so the restore goes
             # back one step further than the survivor's loop; then rank 0, whose replacement prints the replays. The
             # survivor trains those steps in one call, each from its EMA as it first started (probe 13: the loop's
             # update after the first was lost)
             "in place": ("--in-place", "--fault", "rank=1,step=5,phase=backward,restart=0",
                          "--fault", "rank=0,step=8,phase=forward,restart=1"),
             "relaunch": ("--fault", "rank=1,step=8,phase=forward"),
             # a collective of the script's between its calls: a replacement replaying them alone would wait there
             "in place, a collective": ("--in-place", "--fault", "rank=1,step=5,phase=backward")}

    def run(name):
        directory = tmp_path_factory.mktemp(name.replace(" ", "-").replace(",", ""))
        if "collective" not in name:
            return directory, train(directory, *cases[name])
        script, call = directory / "example_all_reduce.py", "    loss = engine.train_batch()\n"
        text = (SCRIPTS / "example_pipe.py").read_text()
        assert call in text
        script.write_text(text.replace(call, call + "    torch.distributed.all_reduce(loss.detach().clone())  # a metric\n"))
        return directory, train(directory, *cases[name], script=script)

    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(zip(cases, pool.map(run, cases)))


@pytest.mark.slow
def test_the_deepspeed_pipeline_example_runs_under_baft_in_its_own_calling_form(runs):
    """args with --deepspeed_config, model_parameters=, training_data=, train_batch() with no iterator."""
    directory, proc = runs["uninterrupted"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS and all(line.endswith("engine BaftPipelineEngine") for line in steps), proc.stdout
    assert "the data position will not be restored" not in proc.stdout + proc.stderr  # baft keeps the loader's
    assert f"step {STEPS} is kept" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["in place", "relaunch", "in place, a collective"])
def test_a_loop_that_counts_its_calls_resumes_where_it_was_and_ends_where_an_uninterrupted_one_does(runs, name):
    (reference, ref_proc), (faulted, proc) = runs["uninterrupted"], runs[name]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in (faulted / "run" / "recovery.jsonl").read_text().splitlines()]
    expected_kinds = {"in place": ["in place", "in place"], "relaunch": ["warm relaunch"],
                      "in place, a collective": ["in place"]}
    assert kinds == expected_kinds[name], kinds
    # rank 0's lines: a resumed process prints the replayed calls' losses and evaluations again, the same, and what
    # was_step_applied() read after each (probe 14: False after a replayed call)
    printed, expected = LINE.findall(proc.stdout), LINE.findall(ref_proc.stdout)
    assert dict(printed) == dict(expected) and printed[-1] == expected[-1], (printed, expected)
    assert "counts its calls to train_batch" in proc.stdout
    # python's draws between the replayed calls were the uninterrupted run's (compared above: probe 13's task picks
    # differed); torch's, which stage 0's Dropout layer draws from too, were on rank 0, whose loop seeds it from the
    # step before it draws (said at every resume where the replay's end was compared with the state the restored step's
    # dropout left), not on rank 1's replay to step 6, whose loader drew the second epoch's seed from it in step 5:
    # said there alone
    said = re.findall(r"^\[(\d)\] baft: rank \1: the loop at \S+example_pipe.py:\d+ \(for step in "
                      r"range\(args.steps\)\) drew from torch's generator between the calls it replayed "
                      r"\(steps 1-\d+\) other numbers", (faulted / "run" / LOG_NAME).read_text(), re.M)
    assert said == (["1"] if name == "relaunch" else []), said
    # trained to STEPS, not past it: the last step's snapshot is what the run kept
    last = [max(step for _, step in load(run / "digests")) for run in (reference, faulted)]
    assert f"step {STEPS} is kept" in proc.stdout and last[0] == last[1], last
    assert compare(reference / "digests", faulted / "digests") == []
    pids = processes(faulted / "digests")
    if name == "in place":
        assert pids[1][0] == pids[0][0] and pids[2][1] == pids[1][1], "the survivors kept their processes"
    if name == "in place, a collective":  # every rank replaced: together they replay, and meet at each all_reduce
        assert not set(pids[1].values()) & set(pids[0].values()), pids
        assert ("baft: rank 0 lost a peer and cannot recover in place (its loop calls a collective between its "
                "calls to train_batch, at") in proc.stdout + proc.stderr, proc.stdout[-3000:]
