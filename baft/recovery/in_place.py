"""Recovery in place: a survivor of a killed rank keeps its process, and ``train_batch`` returns as if nothing happened.

A rank killed by a signal is replaced by the node's warm server (:mod:`baft.recovery.world`); its
peers' next communication with it fails. In each survivor, the failed ``train_batch``:

1. stops baft's protection (the snapshot in flight is dropped: an iteration that failed left a state
   no step produced) and DeepSpeed's engine (its optimizer's and module's hooks);
2. joins the new world with the replacement; where nobody was replaced, the failure was not a killed
   peer and is raised as it was;
3. does what ``baft.initialize`` did, again, with the same arguments (:func:`baft.plugin.initialize`):
   the model's groups, ``deepspeed.initialize``, then the restore of the newest snapshot every rank
   holds — exactly what the replacement does as it starts, so every collective meets its peer;
4. redoes the iteration from the restored step.

The objects the script holds (engine, optimizer, loader, scheduler) are the ones it had: each takes the
state of its new counterpart.
"""

from __future__ import annotations

import time

from torch.utils.hooks import RemovableHandle

from baft.recovery import record, world
from baft.script.loop import THIS_PROCESS


def recover(engine, error: BaseException) -> bool:
    """Recover ``engine``'s rank in place from ``error``, raised by its ``train_batch``; False where that is not
    for baft to do (no replacement can come), and the error stands."""
    protection = engine.baft
    lost = world.lost_peer(error)
    possible = protection.again is not None and world.available() and lost
    why = THIS_PROCESS.not_in_place or (possible and protection.behind())
    if not possible or why:
        if why and lost:
            error.baft_not_in_place = why  # what the rank's replacement says as it goes
        return False
    seen = time.time()
    for hook in protection.hooks:
        hook.recovering(engine)
    protection.close()
    _stop(engine)
    try:
        replaced = world.rejoin()
    except Exception as err:
        raise RuntimeError(f"baft: rank {engine.global_rank} could not meet a replacement after: {error}") from err
    if not replaced:
        return False
    print(f"baft: rank {engine.global_rank} recovers in place (world {world.generation()}) after: "
          f"{str(error).splitlines()[0][:200]}", flush=True)
    record.restart_in_place(seen)
    protection.again().reads.carry_on(protection.reads)
    world.publish("loop", THIS_PROCESS.progress())  # the replacements wait for it
    return True


def _stop(engine) -> None:
    """DeepSpeed's engine, done with: its optimizer's hooks (``destroy``) and the ones it put on the module; the
    gradients the failed iteration left in the model go too (a new process has none, and the restore puts
    back state, not gradients)."""
    engine.destroy()
    for value in vars(engine).values():
        if isinstance(value, RemovableHandle):
            value.remove()
    for param in engine.module.parameters():
        param.grad = None
