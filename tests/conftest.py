"""Shared fixtures: launching real multi-process DeepSpeed pipelines on gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baft.cli.launch import launch_env, torchrun

SCRIPTS = Path(__file__).parent / "scripts"

# A model small enough that a 2-stage run takes seconds, big enough to have many chunks.
TINY = ["--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32", "--vocab", "256",
        "--micro-batches", "4", "--micro-batch-size", "2"]


def run_ranks(nprocs: int, script: str, args: list[str], timeout: float = 240, max_restarts: int = 0,
              env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` on ``nprocs`` local ranks through torchrun."""
    cmd = torchrun(nprocs, [str(SCRIPTS / script), *args], max_restarts=max_restarts, module=False)
    proc = subprocess.run(cmd, env=launch_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} failed with exit code {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_worker(nprocs: int, args: list[str], timeout: float = 240, check: bool = True,
               max_restarts: int = 0) -> subprocess.CompletedProcess:
    """Run the example trainer (``baft.examples.worker``) on ``nprocs`` local ranks."""
    cmd = torchrun(nprocs, ["baft.examples.worker", *args], max_restarts=max_restarts)
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"worker failed with exit code {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def shm_root(tmp_path_factory):
    """A fresh shared-memory root for one test (under /dev/shm where it exists)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.getbasetemp()
    root = base / f"baft-test-{os.getpid()}-{os.urandom(4).hex()}"
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def python() -> str:
    return sys.executable
