"""fp16 and GPU jobs resume bit-identically after a SIGKILL; every precision's snapshot holds what DeepSpeed saves."""

import json
import re

import pytest
import torch

from conftest import TINY, run_ranks, run_worker

# name: (ranks, worker flags). The jobs a GPU runs: on CPU, bf16 and ZeRO-1 (fp32, bf16) jobs killed and resumed
# are tests/test_matrix.py's cases, compared part by part at every step
CONFIGS = {
    "fp16": (2, ["--precision", "fp16"]),
    "zero1-fp16-dp2": (4, ["--precision", "fp16", "--zero-stage", "1"]),
    # one rank, one GPU: the stream executor on CUDA, NCCL, CUDA RNG states
    "gpu-bf16-1stage": (1, ["--stages", "1", "--precision", "bf16"]),
    "gpu-fp16-1stage": (1, ["--stages", "1", "--precision", "fp16"]),
}


def needs_gpus(name: str):
    """fp16 needs a GPU (DeepSpeed refuses it on CPU: "Type fp16 is not supported on your device"), the
    gpu- configurations too; on GPUs every rank needs its own (NCCL refuses two ranks on one device)."""
    ranks = CONFIGS[name][0]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpu = "fp16" in name or name.startswith("gpu-")
    return pytest.mark.skipif(on_gpu and gpus < ranks, reason=f"needs {ranks} GPU(s), this machine has {gpus}")


def digests(output):
    return dict(re.findall(r"digest rank (\d+) step 8 ([0-9a-f]{64})", output))  # ranks share one pipe


def losses(run_dir):
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_gpus(n)) for n in CONFIGS])
def test_killed_rank_resumes_bit_identical(tmp_path, shm_root, name, monkeypatch):
    ranks, flags = CONFIGS[name]
    clean_dir, run_dir = tmp_path / "clean", tmp_path / "run"
    clean = run_worker(ranks, [*TINY, *flags, "--iters", "8", "--policy", "none", "--digest",
                               "--run-dir", str(clean_dir)], timeout=400)
    uninterrupted = {r["step"]: r["loss"] for r in losses(clean_dir)}
    monkeypatch.setenv("BAFT_CHAOS", f"rank={ranks - 1},step=6,phase=backward")
    faulty = run_worker(ranks, [*TINY, *flags, "--iters", "8", "--policy", "baft", "--period", "1", "--digest",
                                "--run-dir", str(run_dir), "--shm-root", str(shm_root)], max_restarts=1, timeout=400)
    resumed = [r for r in losses(run_dir) if r["restart"] == 1]
    assert resumed and resumed[0]["step"] in (5, 6) and resumed[-1]["step"] == 8, [r["step"] for r in resumed]
    for r in resumed:
        assert repr(r["loss"]) == repr(uninterrupted[r["step"]]), f"step {r['step']} differs"
    # a bf16 loss has few bits: the whole state (weights, fp32 masters, moments) must match too
    assert len(digests(clean.stdout)) == ranks and digests(faulty.stdout) == digests(clean.stdout)
    recovery = json.loads((run_dir / "recovery.jsonl").read_text().splitlines()[0])
    assert recovery["source"] == "memory" and recovery["restored_step"] == resumed[0]["step"] - 1


@pytest.mark.slow
@pytest.mark.parametrize("ranks, flags, wrapper", [
    (2, [], "AdamW"),
    (2, ["--precision", "bf16"], "BF16_Optimizer"),
    (4, ["--precision", "bf16", "--zero-stage", "1"], "DeepSpeedZeroOptimizer"),
])
def test_snapshot_holds_every_tensor_deepspeed_saves(tmp_path, ranks, flags, wrapper):
    """Nothing DeepSpeed's own checkpoint holds is missing from what a snapshot copies, byte for byte."""
    run_ranks(ranks, "against_deepspeed.py", [*TINY, *flags, "--policy", "none", "--out", str(tmp_path)], timeout=400)
    for rank in range(ranks):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["wrapper"] == wrapper
        assert any(k.startswith("optim/") for k in result["compared"]), "the optimizer state was compared"
        assert result["missing"] == [] and result["different"] == [], result
