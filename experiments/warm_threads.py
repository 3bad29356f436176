"""Which call in the warm fork server's imports starts a native thread (on a GPU: the CUDA driver's, after which
a forked rank cannot use CUDA), in the server's order and environment.

    env OMP_NUM_THREADS=1 PYTORCH_NVML_BASED_CUDA_CHECK=1 python3 experiments/warm_threads.py

A profile function watches the thread count of ``/proc/self/task`` as each module's top-level code ends and after
every C function named like a driver, library or device call, and prints the Python stack where it first grew.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import baft.warm.preload as server

SUSPECT = ("cuda", "nccl", "nvml", "cdll", "dlopen", "device", "init", "version", "load", "thread")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> int:
    seen = threads()
    first = []

    def watch(frame, event, arg):
        nonlocal seen
        if event == "return" and frame.f_code.co_name == "<module>":
            where = f"end of module {frame.f_globals.get('__name__')}"
        elif event == "c_return" and any(s in getattr(arg, "__qualname__", "").lower() for s in SUSPECT):
            where = f"C call {getattr(arg, '__module__', None)}.{arg.__qualname__}"
        else:
            return
        count = threads()
        if count > seen:
            seen = count
            first.append(f"{where}\n" + "".join(traceback.format_stack(frame, limit=14)))

    for name in (*server.PRELOAD, *server.PRELOAD_LATER):
        sys.setprofile(watch)
        importlib.import_module(name)
        sys.setprofile(None)
        print(f"after {name}: {server.unforkable() or 'forkable'}", flush=True)
        for found in first:
            print(f"  a thread started at the {found}", flush=True)
        first.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
