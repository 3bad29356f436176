"""A job that checkpoints with DeepSpeed adopts baft: its first start loads the newest DeepSpeed checkpoint."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from baft.recovery.digests import DIGESTS_ENV, compare
from conftest import TINY, run_worker

# bf16 with ZeRO-1 on pp=2 x dp=2, as GPT-NeoX trains (DeepSpeed 0.19 cannot load its own bf16 ZeRO-0 checkpoints)
BF16 = [*TINY, "--precision", "bf16", "--zero-stage", "1"]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_first_start_under_baft_continues_a_deepspeed_checkpoint_bit_for_bit(tmp_path, shm_root):
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run trains beside the job so far
        clean = pool.submit(run_worker, 4, [*BF16, "--iters", "8", "--policy", "none", "--run-dir",
                                            str(tmp_path / "clean")],
                            timeout=400, env={DIGESTS_ENV: str(tmp_path / "clean" / "digests")})
        # the job so far: DeepSpeed's save_checkpoint every 4 steps, no baft snapshots
        run_worker(4, [*BF16, "--iters", "4", "--policy", "deepspeed", "--period", "4", "--run-dir",
                       str(tmp_path / "ds")], timeout=400)
        clean.result()
    checkpoints = tmp_path / "ds" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step4"
    adopted = run_worker(4, [*BF16, "--iters", "8", "--policy", "baft", "--period", "1", "--adopt", str(checkpoints),
                             "--run-dir", str(tmp_path / "baft"), "--shm-root", str(shm_root)], timeout=400,
                         env={DIGESTS_ENV: str(tmp_path / "baft" / "digests")})
    assert "adopted the DeepSpeed checkpoint of step 4" in adopted.stdout
    continued = losses(tmp_path / "baft")
    assert sorted(continued) == [5, 6, 7, 8], "training went on from the checkpoint's step"
    uninterrupted = losses(tmp_path / "clean")
    for step, loss in continued.items():
        assert repr(loss) == repr(uninterrupted[step]), f"step {step} differs"
    # every part of every rank's state, from the adopted step on
    assert compare(tmp_path / "clean" / "digests", tmp_path / "baft" / "digests") == []


@pytest.mark.slow
def test_adopting_a_directory_without_a_checkpoint_is_refused_in_one_line(tmp_path, shm_root):
    empty = tmp_path / "none"
    empty.mkdir()
    proc = run_worker(2, [*TINY, "--iters", "2", "--policy", "baft", "--adopt", str(empty),
                          "--shm-root", str(shm_root)], check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("baft: error:")]
    assert errors and f"baft.adopt: {empty} holds no DeepSpeed checkpoint" in errors[0]
    assert "Traceback" not in "\n".join(errors)
