"""Which machine a measurement ran on, for the header every experiment prints (through common.provenance)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import UTC, datetime


def cpu_model() -> str:
    """The CPU's model name, as the kernel or the platform gives it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe() -> str:
    """One line: CPU, cores, memory, OS, Python, torch and DeepSpeed versions."""
    import deepspeed
    import psutil
    import torch

    mem = psutil.virtual_memory().total / 2 ** 30
    return (f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, DeepSpeed {deepspeed.__version__}")


def now() -> str:
    """The date and time in UTC, to the minute."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    """The command that is running, as typed from the repository root."""
    return "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
