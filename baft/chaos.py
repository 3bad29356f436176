"""Reproducible fault injection: a rank kills itself with SIGKILL at a given step and phase.

A fault is ``rank=R,step=S,phase=P[,restart=N]``: during the iteration that produces
step S of attempt N (0: the first run), rank R dies in phase P — ``forward`` (first
forward pass), ``backward`` (first backward pass), ``copy`` (inside a bubble, with a
snapshot in flight), ``commit`` (right after the snapshot is committed, before the
optimizer step) or ``optimizer`` (while the optimizer step runs). Each fault is logged to
``RUN_DIR/chaos.jsonl`` before the kill, so recovery reports know when it happened.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, OptimizerStep

from baft.engine import InstructionHook
from baft.errors import ConfigError

PHASES = ("forward", "backward", "copy", "commit", "optimizer")
ENV = "BAFT_CHAOS"


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    phase: str
    restart: int = 0

    def __str__(self) -> str:
        return f"rank={self.rank},step={self.step},phase={self.phase},restart={self.restart}"


def parse_fault(text: str) -> Fault:
    """``rank=1,step=7,phase=backward[,restart=0]`` as a Fault; a one-line ConfigError otherwise."""
    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rank", "step", "phase", "restart"):
            raise ConfigError(f"fault {text!r}: expected rank=R,step=S,phase=P[,restart=N]")
        fields[key.strip()] = value.strip()
    if fields.get("phase") not in PHASES:
        raise ConfigError(f"fault {text!r}: phase must be one of {', '.join(PHASES)}")
    try:
        return Fault(int(fields["rank"]), int(fields["step"]), fields["phase"], int(fields.get("restart", 0)))
    except (KeyError, ValueError):
        raise ConfigError(f"fault {text!r}: rank, step and restart must be integers") from None


def random_fault(seed: int, ranks: int, first_step: int, last_step: int, restart: int = 0) -> Fault:
    """A fault drawn from ``seed``: the same seed gives the same fault."""
    rng = random.Random(seed)
    return Fault(rng.randrange(ranks), rng.randint(first_step, last_step), rng.choice(PHASES), restart)


def faults_from_env() -> list[Fault]:
    return [parse_fault(f) for f in os.environ.get(ENV, "").split(";") if f.strip()]


class ChaosHook(InstructionHook):
    """Kills this rank when one of its faults comes due. Install it after the snapshot policy."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int, run_dir: Optional[str]):
        self.faults = [f for f in faults if f.rank == rank and f.restart == attempt]
        self.run_dir = run_dir

    def _due(self, engine, phase: str) -> Optional[Fault]:
        step = engine.global_steps + 1  # the step this iteration produces
        return next((f for f in self.faults if f.step == step and f.phase == phase), None)

    def _kill(self, fault: Fault, delay: float = 0.0) -> None:
        if self.run_dir:
            with open(Path(self.run_dir) / "chaos.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time() + delay, "restart": fault.restart,
                                    "what": f"kill rank {fault.rank} at step {fault.step} ({fault.phase})"}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if delay:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def before(self, engine, index, cmd):
        if isinstance(cmd, ForwardPass) and (fault := self._due(engine, "forward")):
            self._kill(fault)
        elif isinstance(cmd, BackwardPass) and (fault := self._due(engine, "backward")):
            self._kill(fault)
        elif isinstance(cmd, OptimizerStep):
            if fault := self._due(engine, "commit"):
                self._kill(fault)
            elif fault := self._due(engine, "optimizer"):
                self._kill(fault, delay=0.002)

    def bubble(self, engine, index, cmd):
        fault = self._due(engine, "copy")
        if fault is None:
            return None
        return lambda landed: self._kill(fault)
