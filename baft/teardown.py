"""A clean process exit for a protected rank.

A training script usually returns without ``destroy_process_group()``. gloo's worker threads
then may still hold the last collective's work and its tensors when the interpreter
finalizes; releasing such a tensor needs the GIL, a thread asking for it during
finalization is ended through a ``noexcept`` frame, and the process aborts with
"terminate called without an active exception" (pytorch/pytorch#190489) after every step
has finished: the launcher sees a failed job. ``destroy_process_group`` alone does not
stop those threads while DeepSpeed's engine still holds its groups, so the teardown also
waits, with the GIL released, until every gloo worker thread is idle.

Under ``baft train`` a rank also says, as it exits, the step it ended its script at: a rank that returns early (its
loop ends sooner than its peers') leaves them failing on a lost peer, and ``baft train`` names it from that line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from baft.config import LAUNCHER_ENV

_GLOO_WORKERS = ("pt_gloo_runloop", "gloo_tcp_loop")


def teardown(engine) -> None:
    """At interpreter exit: tear baft's protection down, destroy the process groups, let gloo's workers go idle."""
    import torch.distributed as dist

    if LAUNCHER_ENV["run_dir"] in os.environ:  # baft train's watch reads it (baft.cli.runlog)
        print(f"baft: rank {engine.global_rank} ended its script at step {engine.global_steps}", file=sys.stderr,
              flush=True)
    protection = getattr(engine, "baft", None)  # none when the config has no "baft" section
    if protection is not None:
        protection.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    wait_for_idle_comm_threads()


def comm_thread_states() -> list[str]:
    """The scheduler state ("R", "S", ...) of every gloo worker thread of this process (Linux)."""
    states = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if name in _GLOO_WORKERS:
            states.append(stat[stat.rindex(")") + 2])
    return states


def wait_for_idle_comm_threads(timeout: float = 2.0, settle: int = 3) -> bool:
    """Sleep (GIL released) until every gloo worker thread has been asleep ``settle`` polls in a row.

    A worker still releasing a finished work is running, or waiting for the GIL that this
    sleep hands over; an idle one sleeps on its queue. False if they did not settle in time.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < settle:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
        quiet = quiet + 1 if all(s in "SD" for s in comm_thread_states()) else 0
    return True
