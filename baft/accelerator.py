"""DeepSpeed's accelerator detection and log lines, kept off a command's standard output."""

import contextlib
import importlib
import os
import sys


def quiet_detection() -> None:
    """Without a GPU, tell DeepSpeed it runs on CPU before it is imported: its detection would
    print a warning on stdout."""
    if not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def deepspeed_lines_to_stderr() -> None:
    """Import DeepSpeed with its log handler bound to stderr (it binds the stream it finds at
    import), so a command whose stdout is data (``--json``) carries nothing else."""
    with contextlib.redirect_stdout(sys.stderr):
        importlib.import_module("deepspeed.utils.logging")


def collective_device(group=None):
    """Where a tensor must live for a collective on ``group``: the current GPU under NCCL, which
    takes device tensors only; the host under gloo (or ``cpu:gloo,cuda:nccl``)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
