"""baft train --trace and baft show of it: the copies of a real run lie inside its bubbles, and the
ranks' output goes to the run's log, the screen showing rank 0's iteration lines and baft's own."""

import json
import subprocess
import sys

import pytest

from baft.cli.launch import launch_env
from baft.cli.runlog import LOG_NAME, on_screen
from baft.recovery.digests import DIGESTS_ENV, redone_differ
from baft.snapshot.trace import load_run
from test_show import assert_png

RECEIVES = ("RecvActivation", "RecvGrad")
# Each stage's state (~0.6 GB) outgrows its receive waits here: the last stage copies part of it in its
# optimizer step's wait for the other stage's last backward pass (long enough at this width)
WIDE = ["--layers", "8", "--d-model", "1024", "--heads", "4", "--seq", "4", "--vocab", "256",
        "--micro-batches", "4", "--micro-batch-size", "1"]


def baft_cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "baft.cli", *map(str, args)], capture_output=True, text=True,
                          env=launch_env(env), timeout=timeout)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A run under baft, rank 1 killed in step 6 and restarted, every rank traced, its state digests in
    ``base/digests``."""
    base = tmp_path_factory.mktemp("traced")
    run_dir, trace_dir = base / "run", base / "trace"
    proc = baft_cli("train", "--example", "gpt", *WIDE, "--iters", "8", "--policy", "baft", "--period", "1",
                    "--run-dir", run_dir, "--trace", trace_dir, "--fault", "rank=1,step=6,phase=backward",
                    "--max-restarts", "1", env={DIGESTS_ENV: str(base / "digests")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, run_dir, trace_dir


def traces(trace_dir):
    return [json.loads((trace_dir / f"trace-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_every_copy_lies_inside_a_wait_before_the_fence(traced):
    """Copies run inside a receive, or inside the optimizer step's wait for the other stage, which comes
    before the fence (once the stages met, before the step changes any state)."""
    _, _, trace_dir = traced
    for trace in traces(trace_dir):
        copied = [it for it in trace["iterations"] if it.get("copies")]
        assert copied, f"rank {trace['rank']} traced no copies"
        for it in copied:
            instructions = {index: (kind, start, start + duration)
                            for index, _, kind, start, duration, *_ in it["instructions"]}
            for instruction, start, end, nbytes in it["copies"]:
                kind, wait_start, wait_end = instructions[instruction]
                where = (trace["rank"], it["step"], instruction)
                assert kind in (*RECEIVES, "OptimizerStep") and wait_start <= start < end <= wait_end, where
                assert kind in RECEIVES or end <= it["flush"][0], where
                assert nbytes > 0


@pytest.mark.slow
def test_a_snapshot_copied_through_the_optimizer_steps_wait_restores_bit_for_bit(traced):
    """With gradient clipping (DeepSpeed's default) each stage's optimizer step first waits for the other stage
    for the global gradient norm, before its optimizer changes any state: baft's engine holds that meeting as
    one all-reduce, copies through its wait and fences after it; what the waits did not hold is copied at the fence (how much depends on
    this machine's copy speed against its compute). A restart from such snapshots resumes the state it
    captured, bit for bit in every part: the steps trained again equal their first training."""
    _, run_dir, trace_dir = traced
    in_wait = {}
    for it in traces(trace_dir)[1]["iterations"]:
        step = next(ins[0] for ins in it["instructions"] if ins[2] == "OptimizerStep")
        in_wait[it["step"]] = sum(nbytes for instruction, _, _, nbytes in it.get("copies", []) if instruction == step)
    assert any(in_wait.values()), f"the last stage copied nothing in its optimizer step's wait: {in_wait}"
    assert [r["step"] for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())][-1] == 8
    assert redone_differ(run_dir.parent / "digests") == []


@pytest.mark.slow
def test_bubbles_and_flush_copy_the_whole_snapshot_every_step(traced):
    _, _, trace_dir = traced
    for trace in traces(trace_dir):
        state = sum(trace["model"]["chunk_sizes"][str(trace["rank"])])
        snapshots = [it for it in trace["iterations"] if "flush" in it]
        assert [it["step"] for it in snapshots] == [it["step"] for it in trace["iterations"]]  # period 1
        for it in snapshots:
            flush_start, flush_end, flushed = it["flush"]
            assert sum(c[3] for c in it["copies"]) + flushed == state
            optimizer = next(ins for ins in it["instructions"] if ins[2] == "OptimizerStep")
            assert optimizer[3] <= flush_start <= flush_end <= optimizer[3] + optimizer[4]


@pytest.mark.slow
def test_show_draws_a_traced_iteration_with_its_copies(traced, tmp_path):
    _, _, trace_dir = traced
    run = load_run(trace_dir)
    steps = {it["step"] for it in traces(trace_dir)[0]["iterations"]}
    assert run.step in steps and run.copied_bytes == sum(c.snapshot_bytes for c in run.copies.values())
    png = tmp_path / "copies.png"
    proc = baft_cli("show", trace_dir, "--png", png)
    assert proc.returncode == 0, proc.stderr
    assert f"step {run.step}: " in proc.stdout and "of the snapshot" in proc.stdout
    assert "copied inside bubbles" in proc.stdout
    assert_png(png)


@pytest.mark.slow
def test_the_screen_shows_rank_zero_and_baft_the_log_holds_everything(traced):
    proc, run_dir, _ = traced
    screen, log = proc.stdout + proc.stderr, (run_dir / LOG_NAME).read_text()
    assert str(run_dir / LOG_NAME) in proc.stdout
    for line in ("step     3  loss", "step     7  loss", "baft: resumed from step", "baft: recovered T0",
                 "summary: median iteration"):
        assert line in screen and line in log, line
    # DeepSpeed's setup lines and the launcher's: the log only; the surviving rank's traceback too, where it has one
    # (torchrun's SIGTERM may reach it before its receive fails, while it computes a long pass of this wide model)
    for noise in ("built successfully", "stage=0 layers=", "Using topology:", "SIGTERM"):
        assert noise not in screen and noise in log, noise
    assert "Traceback" not in screen


@pytest.mark.parametrize("line, stream, shown", [
    ("[0] step     1  loss 5.64  iter 33.0 ms\n", "stdout", "step     1  loss 5.64  iter 33.0 ms\n"),
    ("[0] rank 0 final step 8 loss 0.5\n", "stdout", "rank 0 final step 8 loss 0.5\n"),  # a script's own line
    ("[0] DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n", "stdout", None),
    ("[0] stage=1 layers=2\n", "stdout", None),
    ("[0]      3: Head\n", "stdout", None),
    ("[0]   loss: lm_loss\n", "stdout", None),
    ("[1] step     1  loss 5.64\n", "stdout", None),
    ("[1] baft: rank 1: snapshots stay in shared memory only\n", "stderr",
     "baft: rank 1: snapshots stay in shared memory only\n"),
    ("[0] [rank0]: Traceback (most recent call last):\n", "stderr", None),
    ("W1122 14:31:05.609000 14700 api.py:1028] Sending process 14705 closing signal SIGTERM\n", "stderr", None),
])
def test_what_reaches_the_screen(line, stream, shown):
    assert on_screen(line, stream) == shown


def test_the_drawn_step_is_a_snapshotted_one_even_if_only_the_first_after_a_restart_is():
    """With a long period the one snapshot a restarted launch traces may be its first (warm-up) iteration:
    drawn rather than a step without copies; otherwise the warm-up is left out."""
    from baft.snapshot.trace import typical_step

    def trace(snapshotted: set[int]) -> dict:
        flush = {"flush": [0.1, 0.1, 0]}
        return {"iterations": [{"step": s, "time": 0.3 + s / 100, **(flush if s in snapshotted else {})}
                               for s in range(9, 15)]}
    assert typical_step([trace({9}), trace({9})]) == 9
    assert typical_step([trace({9, 11, 13}), trace({9, 11, 13})]) == 11  # the warm-up left out: 11 and 13
    assert typical_step([trace(set()), trace(set())]) == 12  # none snapshotted: the median of 10..14
