"""Shared fixtures: launching real multi-process DeepSpeed pipelines on gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from baft.cli.launch import clear_stale_build_locks, launch_env, torchrun
from baft.warm import SOCKET_ENV, WarmServer

SCRIPTS = Path(__file__).parent / "scripts"

# A model small enough that a 2-stage run takes seconds, big enough to have many chunks.
TINY = ["--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32", "--vocab", "256",
        "--micro-batches", "4", "--micro-batch-size", "2"]


# DeepSpeed builds its C++ ops the first time a process needs them, once per Python environment (the build's
# hash holds the environment's paths, so a fresh one, as CI's, builds again): the shared-memory communication
# op every run on the CPU accelerator loads, and the Adam of tests/test_matrix.py's DeepSpeed-Adam case.
BUILD_OPS = """
import deepspeed.ops
from deepspeed.accelerator import get_accelerator

if get_accelerator().device_name() == "cpu":
    for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            builder.load()
"""


def pytest_collection_modifyitems(items):
    """The tests that train no pipeline first: quick feedback, while DeepSpeed's ops build beside them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(request):
    """In a session that trains pipelines, build DeepSpeed's ops in a process of their own from its start, as
    the tests that train none run (~40 s and ~70 s on 2 cores where nothing is built yet; a second of loading
    where it is): the first pipeline tests would otherwise stand still while the ops build inside them. At the
    lowest priority: the build takes the cores the tests leave idle (a quarter of the suite's), not theirs."""
    if not any(item.get_closest_marker("slow") for item in request.session.items):
        yield
        return
    clear_stale_build_locks()  # one a killed session left would hold the suite still
    build = subprocess.Popen([sys.executable, "-c", BUILD_OPS], env=launch_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))
    yield
    build.wait()  # never killed: a build stopped halfway leaves its lock, and every later build waits on it


def run_ranks(nprocs: int, script: str, args: list[str], timeout: float = 240, max_restarts: int = 0,
              env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` on ``nprocs`` local ranks (torchrun when it is to restart them)."""
    return _launch(nprocs, [str(SCRIPTS / script), *args], False, launch_env(env), timeout, max_restarts,
                   check, script)


def run_worker(nprocs: int, args: list[str], timeout: float = 240, check: bool = True,
               max_restarts: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the example trainer (``baft.examples.worker``) on ``nprocs`` local ranks."""
    return _launch(nprocs, ["baft.examples.worker", *args], True, launch_env(env), timeout, max_restarts, check,
                   "worker")


def _launch(nprocs, argv, module, env, timeout, max_restarts, check, name) -> subprocess.CompletedProcess:
    program = [*(["-m"] if module else []), *argv]
    if max_restarts:  # torchrun and its ranks forked warm, as under `baft train`
        cmd = torchrun(nprocs, warm().program(program), max_restarts=max_restarts, module=False)
        cmd = warm().command(cmd)
        proc = subprocess.run(cmd, env={**env, **warm().env()}, capture_output=True, text=True, timeout=timeout)
    else:
        proc = spawn_ranks(nprocs, [sys.executable, *program], env, timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{name} failed with exit code {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


_WARM = WarmServer()


def warm() -> WarmServer:
    """The suite's warm fork server (:mod:`baft.warm`), started at the first launch that uses it."""
    if _WARM.process is None:
        _WARM.start(launch_env())
    return _WARM


@pytest.fixture(scope="session", autouse=True)
def shared_warm(request):
    """In a session that trains pipelines, every ``baft train`` of the suite forks its ranks from the suite's
    warm server (:meth:`WarmServer.running`) rather than starting its own (~7 s of imports each)."""
    if any(item.get_closest_marker("slow") for item in request.session.items):
        os.environ.update(warm().env())
    yield
    os.environ.pop(SOCKET_ENV, None)
    _WARM.close()


def spawn_ranks(nprocs: int, cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """One attempt of ``torchrun --standalone --max-restarts=0`` without its agent (which imports torch
    before any rank starts: ~2 s of a 2-core machine per launch), each rank forked from the warm
    server (:func:`warm`: torch and DeepSpeed imported once, ~6 s of CPU a rank saved): the ranks
    get torchrun's environment, and when one fails the others are stopped, as torchrun stops them.
    The ranks' output comes back rank by rank; the exit code is 1 when any rank failed, as torchrun's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="baft-ranks-") as logs:
        procs = []
        for rank in range(nprocs):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                        "ROLE_RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
                        "ROLE_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
            with open(f"{logs}/{rank}.out", "w") as out, open(f"{logs}/{rank}.err", "w") as err:
                procs.append(subprocess.Popen(warm().command(cmd), env={**rank_env, **warm().env()},
                                              stdin=subprocess.DEVNULL, stdout=out, stderr=err))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                time.sleep(0.5 if failed else 0)  # torchrun's monitor interval: the others may say why too
                _stop(procs)
                if not failed:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        stdout, stderr = ("".join(Path(f"{logs}/{rank}.{kind}").read_text() for rank in range(nprocs))
                          for kind in ("out", "err"))
    return subprocess.CompletedProcess(cmd, 0 if all(p.returncode == 0 for p in procs) else 1, stdout, stderr)


def _stop(procs: list) -> None:
    """SIGTERM, then SIGKILL after 5 s, as torchrun stops the ranks of a failed attempt."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture
def shm_root(tmp_path_factory):
    """A fresh shared-memory root for one test (under /dev/shm where it exists)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.getbasetemp()
    root = base / f"baft-test-{os.getpid()}-{os.urandom(4).hex()}"
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def python() -> str:
    return sys.executable
