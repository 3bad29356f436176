"""What a restore sets as the first resumed iteration starts, not at the restore itself (:class:`RngRestore`, an
instruction hook that runs first): the generators' states, the script's schedulers made after ``baft.initialize``, the
param groups' hyper-parameters, and the weights, the script's globals and the model's attributes where the loop's code
before its call, run again in the resumed process, changed them since. The snapshot was taken as that iteration
started, after that code; set at the restore, they would be changed once more by it (a learning rate multiplied by a
factor, weight noise added twice: probes 19 and 21)."""

from __future__ import annotations

from typing import Optional

import torch

from baft.errors import BaftError
from baft.pipeline.hook import InstructionHook
from baft.script import schedulers
from baft.script.attributes import not_as_replaced, restore_module_attributes
from baft.script.loop import THIS_PROCESS
from baft.script.main_globals import restore_globals
from baft.script.rng import drawn_between, fingerprints, from_json, rng_states, set_rng_states
from baft.snapshot.optimizers import base_optimizer, optimizer_adapter


def set_param_groups(engine, groups: list) -> None:
    """Each of the optimizer's param groups takes the hyper-parameters kept of it (its ``params`` stay). A tensor (a
    learning rate given as one) goes in by value, never as the kept object: a scheduler fills its group's tensor in
    place (as it is made, at each step), and the kept groups are set again as the first resumed iteration starts."""
    for group, saved in zip(base_optimizer(engine.optimizer).param_groups, groups):
        for key, value in saved.items():
            held = group.get(key)
            if not torch.is_tensor(value):
                group[key] = value
            elif (torch.is_tensor(held) and held is not value and held.shape == value.shape
                  and held.dtype == value.dtype):
                held.copy_(value)
            else:
                group[key] = value.clone()


def set_rng(rng: dict) -> None:
    """Set the generators (python, numpy, torch, CUDA) ``rng`` holds to the states :func:`capture_rng` took."""
    set_rng_states(from_json(rng))


class RngRestore(InstructionHook):
    """Sets the restored RNG states at the start of the first iteration after a restore, then never again; and,
    before it, the states of the generators the script draws from between its steps (``between``) as they were
    when the restored step ended: where the script's own loop draws them (:meth:`between_steps`)."""

    def __init__(self, rng: dict, between: Optional[dict] = None, at_exit: bool = False,
                 started: Optional[dict] = None):
        self.rng: Optional[dict] = rng
        self.between = between
        # the fingerprints of the generators as the restored step's iteration started, after the loop's code before
        # its call (capture_rng's rng_started), or None (a snapshot taken before baft kept them)
        self.started = started
        # the snapshot was taken as the process ended (``rng``: the states then), not as an iteration started: the
        # generators are set once, where the loop goes on (:meth:`between_steps`), not again as the iteration starts
        self.at_exit = at_exit
        self.schedulers: Optional[list] = None  # what the script's schedulers kept
        self.groups: Optional[list] = None  # the optimizer's param groups' hyper-parameters kept
        self.added: Optional[dict] = None  # the param groups the script had added by then, by parameter names
        self.weights = None  # the module's parameters and buffers as restored (RestoredWeights)
        self.replay_from: Optional[dict] = None  # the generators as a loop that counts its calls began to replay them
        # the submodules the script had replaced (replaced_modules): checked once the loop's code before the first
        # resumed call has run, which may replace them again
        self.replaced: Optional[dict] = None
        # the script's globals and the model's attributes as restored (main_globals, attributes): set again, the
        # script's code since the restore may have updated one again (an in-place update of the loop's before its
        # call, a normalization before its loop)
        self.script_globals: Optional[dict] = None
        self.module_attributes: Optional[dict] = None

    def replay_started(self) -> None:
        """A loop that counts its calls begins to replay them: the generators now, to tell as the replay ends which the
        loop's code between the calls drew from (:meth:`between_steps`)."""
        if self.rng is not None:
            self.replay_from = rng_states()

    @property
    def sets_between(self) -> bool:
        """Whether :meth:`between_steps` sets generators (those the loop drew from between its steps, or every one
        where the snapshot was taken as the process ended)."""
        return self.rng is not None and bool(self.between or self.at_exit)

    def between_steps(self, replayed: bool = False) -> list[str]:
        """The script's loop goes on after the restored step: at ``baft.initialize``'s return, or after the last
        call a loop that counts its calls replays (``replayed``). Nothing once the first iteration has started.
        Returns the generators whose states were not those set (after a replay: its draws were not the uninterrupted
        run's). A snapshot taken as the process ended sets every generator here, and none as the iteration starts:
        as it ended (its loop's code after the call ran), or where the call ended, for a replay to run that code
        again."""
        if self.rng is None:
            return []
        between, now = from_json(self.between or {}), rng_states()
        differ = drawn_between(between, now)
        if replayed and self.replay_from is not None:
            # drawn between the replayed calls (probe 22: minGPT's sample every few steps, unsaid where the loop drew
            # nothing after the restored step) and left otherwise than the uninterrupted run's loop left them for the
            # restored step's call, where the training's draws the replay does not make are in them. A loop that seeds
            # one before its call (torch.manual_seed(step)) leaves it as then, its draws after the seed the same:
            # compared with the states the restored step's training ended at, its dropout in them, it was said at
            # every resume
            drew = drawn_between(self.replay_from, now)
            if self.started is not None:
                marks = fingerprints(now)
                differ = [name for name in drew if marks.get(name) != self.started.get(name)]
            else:  # a snapshot taken before baft kept the fingerprints
                differ += [name for name in drawn_between({**from_json(self.rng), **between}, now)
                           if name in drew and name not in differ]
            self.replay_from = None
        if not (self.between or self.at_exit):
            return differ
        states = between
        if self.at_exit:
            states = {**from_json(self.rng), **(between if replayed else {})}
            self.rng = None
        set_rng_states(states)
        return differ

    def iteration_start(self, engine):
        if self.rng is not None:
            set_rng(self.rng)
            self.rng = None
        if self.schedulers is not None:
            why = schedulers.restore(engine, self.schedulers)
            self.schedulers = None
            if why is not None:
                raise BaftError(f"{why}; resumed, its learning rates would not be those of an uninterrupted "
                                f"run. Make them before the loop's first train_batch, or give one to "
                                f"deepspeed.initialize (lr_scheduler=)")
        if self.groups is not None:
            if self.added is not None:  # added before the restored step, by a script that does not again past it
                optimizer_adapter(engine).add_groups(self.added, self.groups)
            set_param_groups(engine, self.groups)
            self.groups = self.added = None
        if self.weights is not None:
            self._weights_again(engine)
        if self.script_globals is not None:
            restore_globals(self.script_globals)
            self.script_globals = None
        if self.module_attributes is not None:
            restore_module_attributes(engine.module, self.module_attributes)
            self.module_attributes = None
        if self.replaced is not None:
            why = not_as_replaced(engine.module, self.replaced)
            self.replaced = None
            if why is not None:
                raise BaftError(why)

    def _weights_again(self, engine) -> None:
        """The module's weights as restored, where the script changed them since: the snapshot was taken as this
        iteration started, after the loop's code before its call, which has run again (probe 21: weight noise the
        loop adds before each call was added twice to the first resumed step, silently)."""
        weights, self.weights = self.weights, None
        changed = weights.set_back(engine)
        if changed:
            names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            at = THIS_PROCESS.site.reads_weights if THIS_PROCESS.site is not None else ""
            print(f"baft: rank {engine.global_rank}: the script changed the model's {names} after the restore, "
                  f"before this iteration{f' (at {at})' if at else ''}: the snapshot holds them as the loop's code "
                  f"before its call left them as step {engine.global_steps + 1} started, which this process has run "
                  f"again; set back to the snapshot's, as the uninterrupted run had them", flush=True)

    def cancel(self) -> None:
        """Leave the RNG states and the script's schedulers as they are (a checkpoint newer than the snapshot was
        loaded over it)."""
        if self.weights is not None:
            self.weights.close()
        self.rng = self.schedulers = self.groups = self.added = self.weights = self.replaced = None
        self.script_globals = self.module_attributes = None
