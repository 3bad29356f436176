"""DeepSpeed's ``PipelineEngine`` with a selectable schedule and per-instruction hooks.

``attach(engine, baft)`` turns the engine ``deepspeed.initialize`` returned into a
:class:`BaftPipelineEngine` in place (same object, subclass), so DeepSpeed is used as
shipped: its own ``_exec_schedule`` runs the schedule, through baft's instruction map. Every
handler there calls the hooks around DeepSpeed's own, with the instruction's index in the
stage's stream (the bubble map's ``instruction``), and two kinds of instruction are bubbles, where a
hook's work (:meth:`InstructionHook.bubble`, baft's copies on CPU) runs on a thread of its own
while the engine's thread waits:

* a receive (``RecvActivation``, ``RecvGrad``): DeepSpeed's handler blocks until the data lands;
* ``OptimizerStep``, where the stages meet. On a backend whose collectives block the host
  (gloo), DeepSpeed's step first reduces the global gradient norm or the fp16 overflow flag
  with the other stages (:func:`step_meets_other_stages`), so a stage that finished its
  backward passes early waits there. baft's handler holds that meeting itself, as one
  all-reduce before DeepSpeed's step (whose own collectives then find every stage there):
  post it, run the bubble's work, wait. Hooks then hear :meth:`InstructionHook.before_update`,
  the last moment before the step changes any state.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as torch_dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from baft.accelerator import collective_device
from baft.background import BackgroundThread
from baft.pipeline.hook import Hooks, step_meets_other_stages
from baft.pipeline.schedules import make_schedule
from baft.script.loop import THIS_PROCESS

BubbleWork = Callable[[threading.Event], None]


class Reads(Protocol):
    """What is told of the data each call reads (:class:`baft.position.reads.TrainBatchReads`)."""

    def made(self, loader) -> None:
        """The engine made ``loader`` for the script (``deepspeed_io``)."""

    def call(self, data_iter) -> None: ...

    def evaluated(self, data_iter) -> None: ...

    def ended(self) -> None: ...


class Owner(Protocol):
    """What :func:`attach` is given, as ``engine.baft``: in ``baft.initialize`` a :class:`baft.protection.Protection`."""

    schedule: str  # a schedule's name (baft.pipeline.schedules)
    hooks: Hooks  # called around each instruction
    reads: Reads
    data_position: Any  # the position baft keeps of the data (baft.position), or None
    load_guard: Optional[Callable]  # what the engine's load_checkpoint calls once the run restored, or None

    def replayed(self) -> None:
        """The calls a loop that counts them replays are done: the next one trains."""


class BubbleThread:
    """Runs a bubble's work on a :class:`~baft.background.BackgroundThread` while the engine's thread waits.

    The work gets an event that is set once the wait is over, and stops soon after; the engine's
    thread goes on only then, so the work never overlaps what follows the bubble.
    """

    def __init__(self):
        self._thread = BackgroundThread("baft-bubble")

    def during(self, work: Optional[BubbleWork], wait: Callable[[], None]) -> float:
        """Call ``wait()`` here while ``work`` runs on the thread; the seconds ``wait()`` took. An error in
        either is raised here (the wait's first)."""
        start = time.perf_counter()
        if work is None:
            wait()
            return time.perf_counter() - start
        landed, stopped, outcome = threading.Event(), threading.Event(), {}
        self._thread.submit(lambda: self._run(work, landed, stopped, outcome))
        try:
            wait()
        finally:
            seconds = time.perf_counter() - start
            landed.set()
            stopped.wait()
        if "error" in outcome:
            raise outcome["error"]
        return seconds

    @staticmethod
    def _run(work: BubbleWork, landed: threading.Event, stopped: threading.Event, outcome: dict) -> None:
        try:
            work(landed)
        except BaseException as err:  # re-raised in the engine's thread
            outcome["error"] = err
        finally:
            stopped.set()


def _with_hooks(kind, handler):
    """``handler`` (an instruction's handler) with the hooks of a protected engine around it, in ``train_batch``."""

    def run(self, **kwargs):
        if self._instruction is None:  # not training (eval_batch): DeepSpeed's handler alone
            return handler(self, **kwargs)
        index, cmd = self._instruction, kind(**kwargs)
        for hook in self.baft.hooks:
            hook.before(self, index, cmd)
        self._bubble = self._bubble_work(index, cmd)
        handler(self, **kwargs)
        for hook in self.baft.hooks:
            hook.after(self, index, cmd)
        self._instruction += 1
    return run


class BaftPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that runs the schedule ``self.baft.schedule`` names and calls ``self.baft.hooks``
    (``self.baft``: the :class:`Owner` :func:`attach` was given)."""

    def _train_schedule(self):
        return make_schedule(self.baft.schedule, micro_batches=self.micro_batches, stages=self.num_stages,
                             stage_id=self.stage_id)

    def deepspeed_io(self, *args, **kwargs):
        loader = super().deepspeed_io(*args, **kwargs)
        self.baft.reads.made(loader)
        return loader

    def train_batch(self, data_iter=None):
        loop = THIS_PROCESS
        loop.decide(self, sys._getframe(1))
        self.baft.reads.call(data_iter)
        if loop.replaying:
            if loop.calls == 0 and self.baft.hooks.rng is not None:
                self.baft.hooks.rng.replay_started()
            value = loop.replay_train(self)
            # what the script's code after the call reads, as it read it then (the restored step's, from the next call)
            self.global_steps = loop.calls
            self.global_samples = loop.history.samples_after(loop.calls, self.train_batch_size())
            for group, lr in zip(self.optimizer.param_groups, loop.history.lrs_after(loop.calls)):
                if lr == lr:  # NaN: a group the step had not
                    group["lr"] = lr  # what get_lr() said then (baft.replayed puts the restored step's back)
            if loop.history.kept_after(loop.calls):  # the last replayed call's are the restored step's own
                self._step_applied = loop.history.applied_after(loop.calls)
                self._global_grad_norm = loop.history.grad_norm_after(loop.calls, self.device)
            if not loop.replaying:
                self.baft.replayed_to_exit()  # a snapshot taken as the process ended: its state, where it was taken
                if self.baft.hooks.rng is not None:  # the loop's code after step k draws as then
                    loop.replay_drew(self, self.baft.hooks.rng.between_steps(replayed=True))
            return value
        if loop.calls == loop.to_replay > 0:  # the first call that trains after those replayed
            self.baft.replayed()
        loop.called()
        loop.step_called_for = self.global_steps + 1
        loss = self._train_to(self.global_steps + 1, data_iter)
        self.baft.reads.ended()
        if loop.client_set_before and self.baft.client_state is not None:
            self.baft.client_state.hold()  # what the next step's snapshot keeps of it (ClientState.hold)
        return loss

    def set_train_batch_size(self, train_batch_size):
        if train_batch_size != self.train_batch_size():
            position = self.baft.data_position
            if hasattr(position, "batch_size_changes") and not THIS_PROCESS.replaying:  # the engine's own loader
                position.batch_size_changes()
            THIS_PROCESS.no_survivors(self, "the script changed the engine's batch size (set_train_batch_size): a "
                                            "survivor's new engine would train the steps since the restored one at "
                                            "the configured size",
                                      "Keep the batch size the DeepSpeed config sets for its survivors to recover in "
                                      "place")
        super().set_train_batch_size(train_batch_size)

    def _train_to(self, step: int, data_iter):
        """Train one step, or, in a loop that counts its calls, until the engine is at ``step`` however far back a
        recovery in place goes; the loss of the last step trained."""
        loop = THIS_PROCESS
        again = False
        while True:
            if loop.counts_calls:
                loop.starting(self, self.global_steps + 1, again)
            try:
                loss = self._protected_batch(data_iter)
            except Exception as err:
                recover = getattr(self.baft, "recover", None)  # Protection.recover: in place, after a peer was killed
                if recover is None or not recover(err):
                    raise
                again = True
                continue  # the iteration again, from the restored step
            if not loop.counts_calls or self.global_steps >= step:
                return loss  # a loop on the engine's step calls again for the steps a restore took back

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        loop = THIS_PROCESS
        loop.decide(self, sys._getframe(1), training=False)
        if loop.replays_evaluations:
            if self.is_first_stage() or self.is_last_stage():  # the stages that read data: the script's evaluation
                for _ in range(num_micro_batches or self.micro_batches):  # data goes on where the replayed run's did
                    next(data_iter)
            # DeepSpeed's returns None on a stage other than the last where it broadcasts no loss (bcast_loss=False)
            return loop.replay_eval(self, returns_none=not self.is_last_stage() and not return_logits and not (
                compute_loss and (bcast_loss or self.monitor.enabled)))
        value = super().eval_batch(data_iter, return_logits, compute_loss, reduce_output, bcast_loss, num_micro_batches)
        if loop.counts_calls or not loop.decided:  # (before the training loop: it may count its calls)
            loop.record_eval(self, value)
        else:  # no replay reads the evaluations' batches again
            self.baft.reads.evaluated(data_iter)
        return value

    def save_checkpoint(self, *args, **kwargs):
        if THIS_PROCESS.replays_evaluations:  # written when the step was trained; its peers may not be replaying
            return True
        return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        guard = self.baft.load_guard  # baft.recovery.script_checkpoint's, once baft restored (None before, or unset)
        load = super().load_checkpoint
        try:  # an argument DeepSpeed's does not take fails as DeepSpeed's call would, not inside baft's guard
            inspect.signature(load).bind(load_dir, tag, *args, **kwargs)
        except TypeError as err:
            raise TypeError(f"load_checkpoint() {err}") from None
        return load(load_dir, tag, *args, **kwargs) if guard is None else guard(self, load, load_dir, tag, *args,
                                                                                  **kwargs)

    def _protected_batch(self, data_iter):
        for hook in self.baft.hooks:
            hook.iteration_start(self)
        self._instruction, self._stashed_loss = 0, {}
        try:
            loss = super().train_batch(data_iter)
        finally:
            self._instruction = self._bubble = None  # eval_batch's receives run no bubble work
        if THIS_PROCESS.counts_calls:  # what a replay of this call returns, in the snapshots from the next on
            THIS_PROCESS.history.record_train(self.global_steps, loss, self.global_samples, self.get_lr(),
                                              self.was_step_applied(), self.get_global_grad_norm())
        for hook in self.baft.hooks:
            hook.iteration_end(self)
        return loss

    def _bubble_work(self, index: int, cmd) -> Optional[BubbleWork]:
        """Every hook's work for the bubble at ``index`` (None where ``cmd`` is no bubble, or no hook has any)."""
        if not isinstance(cmd, (schedule.RecvActivation, schedule.RecvGrad, schedule.OptimizerStep)):
            return None
        works = [w for w in (h.bubble(self, index, cmd) for h in self.baft.hooks) if w is not None]
        if not works:
            return None

        def run_all(landed):
            for w in works:
                w(landed)
        return run_all

    def _exec_recv_activations(self, buffer_id):
        self._bubbles.during(self._bubble, lambda: PipelineEngine._exec_recv_activations(self, buffer_id))

    def _exec_recv_grads(self, buffer_id):
        self._bubbles.during(self._bubble, lambda: PipelineEngine._exec_recv_grads(self, buffer_id))

    def _exec_optimizer_step(self, lr_kwargs=None):
        waited = self._bubbles.during(self._bubble, self._meet_other_stages) if self._stages_meet else None
        for hook in self.baft.hooks:
            hook.before_update(self, self._instruction, waited)
        PipelineEngine._exec_optimizer_step(self, lr_kwargs)

    def _meet_other_stages(self) -> None:
        torch_dist.all_reduce(self._meeting, async_op=True).wait()

    # GPipe runs all forwards before the backwards; the last stage's backward reads
    # self.loss, which every forward overwrites, so keep each micro-batch's own loss.
    def _exec_forward_pass(self, buffer_id):
        PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.is_last_stage():
            self._stashed_loss[buffer_id] = self.loss

    def _exec_backward_pass(self, buffer_id):
        if self.is_last_stage():
            self.loss = self._stashed_loss.pop(buffer_id)
        PipelineEngine._exec_backward_pass(self, buffer_id)

    _INSTRUCTION_MAP = {kind: _with_hooks(kind, handler) for kind, handler in {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.OptimizerStep: _exec_optimizer_step,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
    }.items()}


def attach(engine, baft: Owner) -> BaftPipelineEngine:
    """Make a DeepSpeed ``PipelineEngine`` a :class:`BaftPipelineEngine`, in place, running ``baft.schedule``
    (a schedule's name) with ``baft.hooks`` (a :class:`~baft.pipeline.hook.Hooks`): ``engine.baft``."""
    if not isinstance(engine, PipelineEngine):
        raise TypeError(f"baft needs a DeepSpeed PipelineEngine (a PipelineModule model), got {type(engine).__name__}")
    make_schedule(baft.schedule, micro_batches=engine.micro_batches, stages=engine.num_stages,
                  stage_id=engine.stage_id)  # refuse an unknown name now, not at the first batch
    engine.__class__ = BaftPipelineEngine
    engine.baft = baft
    engine._instruction, engine._bubble, engine._stashed_loss = None, None, {}
    engine._bubbles = BubbleThread()
    # every rank decides alike (one backend, one config), so every rank joins each meeting
    engine._stages_meet = (torch_dist.get_backend() == "gloo" and torch_dist.get_world_size() > 1
                           and step_meets_other_stages(engine))
    engine._meeting = torch.zeros(1, device=collective_device())
    return engine


def detach(engine) -> None:
    """Make a :class:`BaftPipelineEngine` DeepSpeed's ``PipelineEngine`` again (its hooks are the caller's to close)."""
    engine.__class__ = PipelineEngine
    for name in ("baft", "_instruction", "_bubble", "_stashed_loss", "_bubbles", "_stages_meet", "_meeting"):
        delattr(engine, name)
