"""Start training processes through torch's elastic launcher (``torchrun``).

baft writes no supervisor of its own: ``torch.distributed.run`` starts one process per
rank, and with ``--max-restarts`` restarts them all when one dies (run as :mod:`baft.cli.torchrun`, without two
waits of its rendezvous a one-node restart does not need).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from baft.errors import BaftError

SHM_ROOT = "/dev/shm/baft"  # where ``baft train`` keeps the snapshot slots of its runs
LOCK_NAME = "train.lock"  # in a run directory: held by the ``baft train`` using it
# glibc's malloc hands freed memory back to the kernel (munmap, trim), and the next iteration
# faults it back in page by page: on the CPU VMs baft is measured on that made an iteration
# 10-25% longer. The ranks keep freed memory instead, as PyTorch's
# ``torch.backends.xeon.run_cpu`` launcher does with jemalloc (README: "Memory").
# ``BAFT_KEEP_FREED_MEMORY=0`` leaves glibc's own behaviour.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
KEEP_FREED_MEMORY_ENV = "BAFT_KEEP_FREED_MEMORY"
STALE_BUILD_LOCK = 120.0  # seconds: a build's lock this old, with no process building beside it, outlived its build


def extensions_dir() -> str:
    """Where DeepSpeed's JIT-built ops are cached between runs (the first build takes ~40 s)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "baft" / "torch_extensions")


def clear_stale_build_locks(root: str | None = None) -> list[Path]:
    """Remove the locks of DeepSpeed's op builds under ``root`` (:func:`extensions_dir`) that a build stopped halfway
    left, saying each; those removed. torch takes the lock as a build starts (``FileBaton``: a file, no process named in
    it) and removes it as the build ends: one left makes every later load of the op wait for ever, silently, the
    ranks before their first step (a run stopped during its first minute, as the ops built). Stale: over
    :data:`STALE_BUILD_LOCK` seconds old, with no process (ninja, a compiler) working in the op's directory."""
    removed = []
    for lock in Path(root or extensions_dir()).glob("*/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # its build just ended
            continue
        if age > STALE_BUILD_LOCK and not _working_in(lock.parent):
            lock.unlink(missing_ok=True)
            removed.append(lock)
            print(f"baft: removed {lock}, left {age / 60:.0f} min ago by a build of DeepSpeed's {lock.parent.name} op "
                  f"stopped halfway (no process builds there): every rank would have waited on it for ever",
                  file=sys.stderr, flush=True)
    return removed


def _working_in(directory: Path) -> bool:
    """Whether a process (this user's: another's cannot be read) has ``directory`` as its working directory."""
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)) == directory.resolve():
                return True
        except OSError:  # gone, or another user's
            continue
    return False


def launch_env(extra: dict | None = None) -> dict:
    """The environment for the launched ranks."""
    env = {**os.environ, **(extra or {})}
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    # the ranks build DeepSpeed's ops with this Python environment's ninja, as where it is activated: two ninja
    # versions building in one TORCH_EXTENSIONS_DIR read each other's log as stale, and rebuild an op at every start
    tools = os.path.dirname(sys.executable)
    if tools not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = os.pathsep.join(filter(None, [tools, env.get("PATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if env.get(KEEP_FREED_MEMORY_ENV, "1") != "0":
        for name, value in KEEP_FREED_MEMORY.items():
            env.setdefault(name, value)
    return env


def torchrun(nprocs: int, module_args: list[str], max_restarts: int = 0, module: bool = True,
             options: list[str] = ()) -> list[str]:
    """The command that runs ``python -m <module_args>`` (or a script) on ``nprocs`` local ranks;
    ``options`` are more of torchrun's own (``--tee``, ``--log-dir``)."""
    cmd = [sys.executable, "-m", "baft.cli.torchrun", "--standalone", f"--nproc-per-node={nprocs}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *options]
    # "--": a script's own option that abbreviates one of torchrun's (``--n 40``) is the script's
    return cmd + (["-m"] if module else []) + ["--", *module_args]


def flags(opts: dict) -> list[str]:
    """Command-line flags from options: ``{"micro_batches": 8}`` is ``--micro-batches 8``; None values are left out."""
    return [arg for key, value in opts.items() if value is not None
            for arg in (f"--{key.replace('_', '-')}", str(value))]


def example_args(opts: dict) -> list[str]:
    """``baft.examples.worker`` and its arguments from CLI options."""
    return ["baft.examples.worker", *flags(opts)]


def run_id(run_dir) -> str:
    """The run id ``baft train`` gives a run directory: one shared-memory root per directory."""
    run = Path(run_dir).resolve()
    return f"{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:8]}"


@contextmanager
def exclusive_run(run_dir: Path):
    """Hold ``RUN_DIR/train.lock`` for a launch: a second ``baft train`` of the same directory, whose
    managers and snapshots are this one's, is refused. The kernel drops the lock when its holder
    dies, even by SIGKILL, so a launch after a killed one goes ahead."""
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise BaftError(f"{run_dir}: another `baft train` (pid {holder}) is using this run directory") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)


def run_command(cmd: list[str], env: dict) -> int:
    """Run a command in the foreground, its output on the terminal; its exit code."""
    return subprocess.run(cmd, env=env).returncode
