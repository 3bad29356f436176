"""What a hook of a protected engine hears: callbacks around each instruction of ``train_batch``
(:mod:`baft.pipeline.engine` calls them). Importing this module loads neither torch nor DeepSpeed."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator, Optional


class InstructionHook:
    """Callbacks around one ``train_batch``. All methods are optional no-ops."""

    def iteration_start(self, engine) -> None: ...

    def before(self, engine, index: int, cmd) -> None: ...

    def after(self, engine, index: int, cmd) -> None: ...

    def iteration_end(self, engine) -> None: ...

    def close(self) -> None:
        """Stop any work still running and release resources (at process exit)."""

    def bubble(self, engine, index: int, cmd) -> Optional[Callable[[threading.Event], None]]:
        """Work to run, on a thread of its own, while this receive (or the optimizer step's meeting of the
        stages) waits: called with an event set once the wait is over, and expected to return soon after."""
        return None

    def before_update(self, engine, index: int, waited: Optional[float]) -> None:
        """Inside the optimizer step at ``index``, the last moment before it changes any state: after the
        stages met (``waited``: the seconds that took; None where the step holds no meeting)."""

    def recovering(self, engine) -> None:
        """This iteration lost a peer, and the rank is about to recover in place (:mod:`baft.recovery.in_place`),
        nothing stopped yet."""


def step_meets_other_stages(engine) -> bool:
    """Whether DeepSpeed's optimizer step begins with a collective every stage joins: gradient clipping,
    and DeepSpeed's bf16, fp16 and ZeRO optimizers, reduce the global gradient norm (or the fp16 overflow
    flag) across the stages before any state changes (``DeepSpeedEngine._take_model_step``)."""
    return (engine.gradient_clipping() > 0 or engine.fp16_enabled() or engine.bfloat16_enabled()
            or engine.zero_optimization())


@dataclass
class Hooks:
    """The hooks of a protected engine, each in its named place; they run in the order of these fields:
    the trace first (its clock starts first), the restored RNG states before any other hook sees an
    iteration, the state's digests before the policy copies it, the snapshot policy, the recovery report
    of the first resumed iteration, fault injection after the policy's commit, the heartbeat the node's
    manager watches, the profiler (which runs alone), then a caller's own hooks in the order added."""

    trace: Optional[InstructionHook] = None
    rng: Optional[InstructionHook] = None
    digests: Optional[InstructionHook] = None
    policy: Optional[InstructionHook] = None
    report: Optional[InstructionHook] = None
    chaos: Optional[InstructionHook] = None
    liveness: Optional[InstructionHook] = None
    profile: Optional[InstructionHook] = None
    others: list[InstructionHook] = field(default_factory=list)

    def __iter__(self) -> Iterator[InstructionHook]:
        named = (getattr(self, f.name) for f in fields(self) if f.name != "others")
        return itertools.chain((hook for hook in named if hook is not None), self.others)
