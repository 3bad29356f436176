"""Reproducible fault injection: a rank kills itself with SIGKILL at a given step and phase.

A fault is ``rank=R,step=S,phase=P[,restart=N]``: during the iteration that produces
step S of attempt N (0: the first run), rank R dies in phase P — ``forward`` (first
forward pass), ``backward`` (first backward pass), ``copy`` (inside a bubble, with a
snapshot in flight), ``seal`` (after the snapshot's copy is fenced, before its commit
record is written: the snapshot is lost, the one before it is not), ``commit`` (right
after the snapshot is committed, before the optimizer step) or ``optimizer`` (while the
optimizer step runs, the snapshot committed); under recovery in place also ``recover`` (as the
rank begins to recover from a peer's death in that iteration: a second fault during a recovery). ``node=N,step=S`` kills
a whole node at the start of that iteration: its manager (SIGKILL), its shared memory
(deleted) and all its ranks, once the node's parity group holds enough shares of a step to rebuild it (up to
a minute: a node lost before that cannot be rebuilt, and a test of a covered loss would depend on how fast the
managers encode). ``manager=N,step=S`` kills only node N's manager. Each fault
is logged to ``RUN_DIR/chaos.jsonl`` (:mod:`baft.faults`) before the kill, so recovery reports know when it
happened. The hook that kills is :class:`baft.recovery.chaos_hook.ChaosHook`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from baft.errors import ConfigError

PHASES = ("forward", "backward", "copy", "seal", "commit", "optimizer")
IN_PLACE_PHASES = ("recover",)  # only a rank that recovers in place goes through it
ENV = "BAFT_CHAOS"


@dataclass(frozen=True)
class Fault:
    rank: Optional[int]
    step: int
    phase: str  # one of PHASES, "node" or "manager"
    restart: int = 0
    node: Optional[int] = None

    def __str__(self) -> str:
        who = f"{self.phase}={self.node}" if self.node is not None else f"rank={self.rank},phase={self.phase}"
        return f"{who},step={self.step},restart={self.restart}"

    @property
    def what(self) -> str:
        """The fault as the run's fault log names it."""
        return (f"kill {self.phase} {self.node} at step {self.step}" if self.node is not None
                else f"kill rank {self.rank} at step {self.step} ({self.phase})")


def not_fired(faults: list[Fault], logged: list[dict]) -> list[Fault]:
    """The faults asked for that the run's fault log (:func:`baft.faults.read`) does not hold."""
    fired = {(entry.get("what"), entry.get("restart")) for entry in logged}
    return [f for f in faults if (f.what, f.restart) not in fired]


def parse_fault(text: str) -> Fault:
    """``rank=1,step=7,phase=backward[,restart=0]``, ``node=1,step=7`` or ``manager=0,step=7`` as a Fault.

    Anything else is a one-line ConfigError.
    """
    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rank", "node", "manager", "step", "phase", "restart"):
            raise ConfigError(f"fault {text!r}: expected rank=R,step=S,phase=P[,restart=N], node=N,step=S "
                              f"or manager=N,step=S")
        fields[key.strip()] = value.strip()
    whole = next((w for w in ("node", "manager") if w in fields), None)
    missing = [key for key in (whole or "rank", "step") if key not in fields]
    if missing:
        raise ConfigError(f"fault {text!r}: {missing[0]}= is missing")
    try:
        numbers = {key: int(fields[key]) for key in ("rank", "node", "manager", "step", "restart") if key in fields}
    except ValueError:
        raise ConfigError(f"fault {text!r}: rank, node, step and restart must be integers") from None
    negative = next((key for key, number in numbers.items() if number < 0), None)
    if negative:  # no such rank, node or attempt: the run went on to its end, the fault never fired
        raise ConfigError(f"fault {text!r}: {negative} must be 0 or more, got {numbers[negative]}")
    if whole:
        return Fault(None, numbers["step"], whole, numbers.get("restart", 0), numbers[whole])
    if fields.get("phase") not in PHASES + IN_PLACE_PHASES:
        raise ConfigError(f"fault {text!r}: phase must be one of {', '.join(PHASES + IN_PLACE_PHASES)}")
    return Fault(numbers["rank"], numbers["step"], fields["phase"], numbers.get("restart", 0))


def faults_from_env() -> list[Fault]:
    return [parse_fault(f) for f in os.environ.get(ENV, "").split(";") if f.strip()]
