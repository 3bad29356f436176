"""A script's own checkpoints beside baft: its ``client_state`` saved with every snapshot, and its
``load_checkpoint`` at start-up kept from undoing baft's restore.

Scripts built on DeepSpeed (GPT-NeoX, Megatron-DeepSpeed, DeepSpeedExamples) load their newest
checkpoint at start-up and read their own bookkeeping (iteration, consumed samples, data position)
back from its ``client_state``. After a fault baft has already restored a newer snapshot by then;
loading the older checkpoint over it would drop the steps in between without a word. On a
protected engine ``load_checkpoint`` therefore:

* loads, as DeepSpeed does, when baft restored nothing, or the script gave baft no ``client_state`` and
  the directory holds no checkpoint or one as new as baft's snapshot;
* otherwise (a directory with no checkpoint yet too: a fault before the script's first save) keeps
  baft's state, says so in one line, and returns the ``client_state`` as of baft's step, captured with every snapshot from what the script gave
  ``baft.initialize(client_state=...)``; without it, it stops in one line saying how to give it. A
  checkpoint newer than the snapshot too: DeepSpeed's holds no generator states (nor what else baft keeps
  that the script may not save), so the run trains the steps in between again rather than resume from
  it inexactly. Without a ``client_state`` it loads, saying the resume may not be exact from there.

A script whose counters live outside the engine gives a ``Stateful`` object: a restore loads it,
so the counters are right after a fault that came before the script's first checkpoint too.
"""

from __future__ import annotations

import copy
import functools
import glob
import os
from typing import Optional

import torch

from baft.errors import BaftError
from baft.script.loop import THIS_PROCESS
from baft.recovery import world


class ClientState:
    """The script's own state, given to ``baft.initialize(client_state=...)``: an object with
    ``state_dict()``/``load_state_dict()`` (torch.distributed.checkpoint's ``Stateful``), which a restore
    loads, or a callable returning the dict the script saves with ``save_checkpoint(client_state=...)``."""

    def __init__(self, source):
        self.stateful = callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))
        if not (self.stateful or callable(source)):
            raise BaftError(f"baft.initialize client_state=: expected an object with state_dict() and "
                            f"load_state_dict(), or a callable returning the dict your script saves as "
                            f"save_checkpoint(client_state=...); got {type(source).__name__}")
        self.source = source
        self.restored: Optional[dict] = None  # as of the restored step
        self.returned = False  # whether the script's load_checkpoint returned it
        self.held: Optional[dict] = None  # a copy as the loop's latest call returned (hold)

    def not_returned(self, step: int) -> Optional[str]:
        """What to say as the script's loop starts where a callable's state, restored as of ``step``, never reached the
        script (no ``load_checkpoint`` returned it: GPT-NeoX's start-up loads only where a checkpoint exists); None
        where it did, or a restore loaded it."""
        if self.stateful or self.restored is None or self.returned:
            return None
        return (f"the client_state given to baft.initialize is a callable, and no engine.load_checkpoint returned what "
                f"it held at the restored step {step}: the script's own state (its counts, averages, best loss) "
                f"stands where the script set it, not where the uninterrupted run had it. Give client_state= an "
                f"object with state_dict() and load_state_dict(), which a restore loads, or call "
                f"engine.load_checkpoint(dir) before the loop: it returns the client_state of step {step}, whether or "
                f"not dir holds a checkpoint")

    def capture(self) -> dict:
        return self.source.state_dict() if self.stateful else self.source()

    def hold(self) -> None:
        """Keep a copy of the state as it stands now, before the loop's code for the next step runs: where that code
        sets it before its call (torchtitan's ``train_state.step += 1`` at the loop's top), a snapshot, taken as the
        call starts, keeps this copy, which a resumed loop's code sets for that step once (probe 22: a count one ahead
        of the engine's step, a run a step short)."""
        self.held = copy.deepcopy(self.capture())

    def restore(self, saved: dict) -> None:
        self.restored = saved
        if self.stateful:
            self.source.load_state_dict(saved)


def checkpoint_step(load_dir, tag=None) -> tuple[Optional[str], Optional[int]]:
    """(the checkpoint's directory, its ``global_steps``) of DeepSpeed's checkpoint ``tag`` in ``load_dir`` (the
    one its ``latest`` file names when ``tag`` is None); the step is None when there is no such checkpoint."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    states = sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")))
    if not states:
        return path, None
    saved = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)
    return path, int(saved["global_steps"])


def guard_load_checkpoint(engine, client_state: Optional[ClientState]) -> None:
    """Make ``engine.load_checkpoint`` keep a snapshot baft restored over an older checkpoint (module docstring): the
    protected engine's method (:meth:`baft.pipeline.engine.BaftPipelineEngine.load_checkpoint`) calls the guard from
    now on, until the protection closes and gives the engine back as DeepSpeed made it."""
    engine.baft.load_guard = functools.partial(_guarded_load, client_state)


def _guarded_load(client_state: Optional[ClientState], engine, load, load_dir, tag=None, *args, **kwargs):
    """What ``engine.load_checkpoint(load_dir, tag, ...)`` does on a protected engine; ``load``: DeepSpeed's."""
    THIS_PROCESS.show_restored(engine)  # the script resumes itself from what it loads: its loop replays nothing
    restored = engine.baft.restored
    path, step = checkpoint_step(load_dir, tag)
    kept_client = client_state is not None and client_state.restored is not None
    # as new as the snapshot: the same state, kept without DeepSpeed's load (which cannot read its own bf16
    # checkpoints without ZeRO, deepspeedai/DeepSpeed#7786) where baft holds the client_state too
    newer = restored is not None and step is not None and step > restored.step
    # no checkpoint yet (a fault before the script's first save) is older too: DeepSpeed's load would return (None,
    # None), and a script that resumes its counters from the loaded client_state (Megatron's) would count from 0 again
    if restored is None or (not kept_client and (step is None or step >= restored.step)):
        if newer:
            if world.generation():  # a replacement: its peers kept their processes and the snapshot
                raise RuntimeError(f"baft: rank {engine.global_rank} replaced in place, but its script loads step "
                                   f"{step} from {path}, newer than the step {restored.step} its peers restored; "
                                   f"every rank starts again instead")
            if restored.rng is not None:
                restored.rng.cancel()  # whatever the script keeps of the generators is the run's now
            _say(engine, f"baft: loaded step {step} from {path} over step {restored.step} ({restored.source}): the "
                         f"checkpoint is newer, but what it does not hold (the generators' states, unless the "
                         f"script saves them) is not restored: the run may differ from an uninterrupted one from "
                         f"here. Give baft.initialize client_state= to resume exactly from step {restored.step}")
            THIS_PROCESS.script_resumed = True
        return load(load_dir, tag, *args, **kwargs)
    kept = f"step {restored.step} ({restored.source})"
    if not kept_client:
        raise BaftError(f"engine.load_checkpoint({load_dir}) would roll this run back from {kept} to the "
                        f"checkpoint's step {step}: pass baft.initialize client_state=, an object with "
                        f"state_dict()/load_state_dict() or a callable giving what your script saves as "
                        f"save_checkpoint(client_state=...) ({{}} if nothing), and load_checkpoint returns it as "
                        f"of step {restored.step}")
    if step is None:
        _say(engine, f"baft: kept {kept}, {path or load_dir} holds no checkpoint yet; load_checkpoint returns the "
                     f"client_state of step {restored.step}")
    else:
        redo = f"step {step} is" if step == restored.step + 1 else f"steps {restored.step + 1}-{step} are"
        again = f" (newer, but a DeepSpeed checkpoint holds no generator states: {redo} trained again)" if newer else ""
        _say(engine, f"baft: kept {kept} over step {step} in {path}{again}; load_checkpoint returns the "
                     f"client_state of step {restored.step}")
    THIS_PROCESS.script_resumed = client_state.returned = True
    return f"baft://{restored.source}/step{restored.step}", client_state.restored


def _say(engine, line: str) -> None:
    if engine.global_rank == 0:
        print(line, flush=True)
