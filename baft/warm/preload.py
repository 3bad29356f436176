"""What the warm fork server imports, and does, once for all its forks, before it forks any.

It imports :data:`PRELOAD` (where a GPU driver is there, :data:`TORCH` alone) single-threaded, while a process of its
own detects the CPU for DeepSpeed's op builders; DeepSpeed's probe of the ops this machine can build and its
shared-memory collectives op; and :data:`PRELOAD_LATER` as the launcher says (:data:`LATER_CHOICES`). A fork copies
no thread: :func:`unforkable` says where an import started one.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

TORCH = ("torch", "torch._dynamo", "torch.optim", "torch.distributed")
PRELOAD = (*TORCH, "deepspeed", "deepspeed.pipe",
           # what baft.initialize imports (a replacement's imports would be on its survivors' wait otherwise)
           "baft.plugin", "baft.protection", "baft.recovery.digests", "baft.recovery.script_checkpoint",
           "baft.position.kept")
# What DeepSpeed imports as it configures a bf16 or ZeRO optimizer (torch._inductor with it): ~1.8 s of a
# rank's T2 on a 2-core VM; where this DeepSpeed has no such module, nothing is lost but the time.
PRELOAD_LATER = ("deepspeed.runtime.zero.muon.muon_optimizer",)
# When the server imports PRELOAD_LATER. "now": before it forks a rank, for a job known to wrap its optimizer, or
# one that recovers in place (its survivors then hold the modules frozen, :func:`freeze`, not in every
# gc.collect). "never": for a job known not to. "idle": not knowing, once no request came for server.IDLE s, so that a
# first launch's ranks do not wait for it; a rank that dies meanwhile is reported as it dies, and the ranks of a
# relaunch are forked once the import is done.
LATER_CHOICES = ("now", "idle", "never")
# Where a GPU driver is there, DeepSpeed's import asks NVML how many GPUs there are, and loading NVML starts a
# driver thread (an H200, gpu.md section 7): a rank forked after it could not use the GPU. There the server
# imports torch's modules alone, and each rank imports DeepSpeed itself.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd")


def preload(later: str = "idle") -> list[str]:
    """Import what every rank imports, and :data:`PRELOAD_LATER` where ``later`` is "now", and detect the CPU (a
    SystemExit, with one line, where the server could not fork after it); the modules left to import once the
    server is idle."""
    detecting = _start_detecting_cpu()
    first, optional = (TORCH, ()) if gpu_driver() else (PRELOAD, PRELOAD_LATER)
    for name in first:
        importlib.import_module(name)
    for name in optional if later == "now" else ():
        import_if_there(name)
    _keep_detected_cpu(detecting)
    if "deepspeed" in first:  # after: DeepSpeed's op builders read the detected CPU
        _probe_deepspeed_ops()
    refusal = unforkable()
    if refusal:
        raise SystemExit(refusal)
    freeze()
    return list(optional) if later == "idle" else []


def _probe_deepspeed_ops() -> None:
    """What every rank's ``deepspeed.init_distributed`` does first on a CPU, done once for its forks: probe which of
    DeepSpeed's ops this machine can build (``deepspeed.ops.__compatible_ops__``: compilers run on test programs,
    0.15 s, more on a loaded machine) and load its shared-memory collectives op (a ninja run). DeepSpeed keeps both
    for the process. Where the op does not load, each rank meets that itself, with its own message."""
    build_shm_op = getattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", None)
    if build_shm_op is None:  # another DeepSpeed: its ranks do what it does
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its "built successfully": a rank says it, not the server
            build_shm_op()
    except Exception:  # noqa: BLE001 - the rank's own call says what it is
        pass


def _start_detecting_cpu() -> Optional[subprocess.Popen]:
    """py-cpuinfo detects the CPU in a new interpreter at every call (1.5 s on a 2-core VM), and DeepSpeed's CPU op
    builders call it twice each time a process loads an op (``FusedAdam`` for a config's ``"Adam"`` on CPU,
    ``DeepSpeedCPUAdam``): 3 s of every rank's ``deepspeed.initialize``, at every relaunch and in every replacement.
    Every fork runs on this CPU: the server detects it once, with py-cpuinfo's own command (``python -m cpuinfo
    --json``, what ``get_cpu_info`` runs) on another core while it imports, and the forks read that.
    None without py-cpuinfo (DeepSpeed's builders fall back to lscpu)."""
    if importlib.util.find_spec("cpuinfo") is None:
        return None
    return subprocess.Popen([sys.executable, "-m", "cpuinfo", "--json"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _keep_detected_cpu(detecting: Optional[subprocess.Popen]) -> None:
    """Once the detection has ended: ``cpuinfo.get_cpu_info`` answers with what it found (a copy: a caller's
    change is its own). Where it failed, each process detects the CPU itself, as it would have."""
    if detecting is None:
        return
    out, _ = detecting.communicate()
    if detecting.returncode != 0:
        return
    import cpuinfo

    detected = json.loads(out)
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(detected)


def gpu_driver() -> bool:
    """Whether a GPU driver's device files are on this machine."""
    return any(os.path.exists(path) for path in GPU_DRIVER_FILES)


def freeze() -> None:
    """Keep what the imports made out of the collector's sight (``gc.freeze``): a rank's ``gc.collect`` (DeepSpeed's
    bf16 optimizer calls four as it starts) then walks only its own objects, not the 200,000 of torch's and
    DeepSpeed's modules (0.16 s each in a survivor), and leaves their pages shared with the server. What the imports
    printed is written out first: a fork would inherit it unwritten in its buffers, and write it as its own."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    gc.collect()
    gc.freeze()


def import_if_there(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        pass


def unforkable() -> Optional[str]:
    """Why a fork of this process would not make a working rank (one line), or None."""
    import torch

    others = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    if others or torch.cuda.is_initialized():  # a fork would copy another thread's locks, or a CUDA context
        started = {t.native_id: t.name for t in threading.enumerate()}  # by Python; others by native code
        names = ", ".join(sorted(started.get(int(t)) or _thread_name(t) for t in others)) or "none"
        return (f"baft: the warm fork server cannot fork after its imports (other threads: {names}; CUDA "
                f"initialised: {torch.cuda.is_initialized()}); ranks start cold")
    return None


def _thread_name(tid: str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:  # it ended meanwhile
        return "?"
