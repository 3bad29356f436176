"""DeepSpeed's ``PipelineEngine`` with a selectable schedule and per-instruction hooks.

``attach(engine)`` turns the engine ``deepspeed.initialize`` returned into a
:class:`BaftPipelineEngine` in place (same object, subclass), so DeepSpeed is used as
shipped. Hooks see every instruction of ``train_batch`` with its index in the stage's
stream (the bubble map's ``slot``); a hook may also take over the wait inside a receive
(:meth:`InstructionHook.bubble`), which is where baft's copies run on CPU. On a backend whose
collectives block the host (gloo), the optimizer step's collectives are waits too: with gradient
clipping (DeepSpeed's default) or fp16, every stage's step first reduces the global gradient norm
or overflow flag with the other stages, so a stage that finished its backward passes early waits
there, before its optimizer changes any state. Hooks hear how long (:meth:`InstructionHook.waited`)
and may work through it like a receive.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch.distributed as torch_dist
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from baft.background import BackgroundThread
from baft.pipeline.schedules import make_schedule


_RECV = (schedule.RecvActivation, schedule.RecvGrad)


class BaftPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that runs the schedule ``self.baft.schedule`` names and calls ``self.baft.hooks``
    (``self.baft``: what :func:`attach` was given, in ``baft.initialize`` a :class:`baft.protection.Protection`)."""

    def _train_schedule(self):
        return make_schedule(self.baft.schedule, micro_batches=self.micro_batches, stages=self.num_stages,
                             stage_id=self.stage_id)

    def train_batch(self, data_iter=None):
        for hook in self.baft.hooks:
            hook.iteration_start(self)
        loss = super().train_batch(data_iter)
        for hook in self.baft.hooks:
            hook.iteration_end(self)
        return loss

    def _exec_schedule(self, pipe_schedule):
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._stashed_loss = {}
        index = 0
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
                for hook in self.baft.hooks:
                    hook.before(self, index, cmd)
                work = self._bubble_work(index, cmd)
                if isinstance(cmd, schedule.OptimizerStep) and _collectives_block_host():
                    with _collectives_while(work) as waits:
                        handler(self, **cmd.kwargs)
                    for hook in self.baft.hooks:
                        hook.waited(self, index, sum(waits))
                elif work is None:
                    handler(self, **cmd.kwargs)
                else:
                    with _receive_while(work):
                        handler(self, **cmd.kwargs)
                for hook in self.baft.hooks:
                    hook.after(self, index, cmd)
                index += 1

    def _bubble_work(self, index, cmd):
        if not isinstance(cmd, (*_RECV, schedule.OptimizerStep)):
            return None
        works = [w for w in (h.bubble(self, index, cmd) for h in self.baft.hooks) if w is not None]
        if not works:
            return None

        def run_all(landed):
            for w in works:
                w(landed)
        return run_all

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

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
    }


def attach(engine, baft) -> BaftPipelineEngine:
    """Make a DeepSpeed ``PipelineEngine`` a :class:`BaftPipelineEngine`, in place, running ``baft.schedule``
    (a schedule's name) with ``baft.hooks`` (a :class:`~baft.pipeline.hook.Hooks`)."""
    if not isinstance(engine, PipelineEngine):
        raise TypeError(f"baft needs a DeepSpeed PipelineEngine (a PipelineModule model), got {type(engine).__name__}")
    make_schedule(baft.schedule, micro_batches=engine.micro_batches, stages=engine.num_stages,
                  stage_id=engine.stage_id)  # refuse an unknown name now, not at the first batch
    engine.__class__ = BaftPipelineEngine
    engine.baft = baft
    engine._stashed_loss = {}
    return engine


def detach(engine) -> None:
    """Make a :class:`BaftPipelineEngine` DeepSpeed's ``PipelineEngine`` again (its hooks are the caller's to close)."""
    engine.__class__ = PipelineEngine
    del engine.baft


_blocking_recv = p2p.recv


def _collectives_block_host() -> bool:
    return torch_dist.is_initialized() and torch_dist.get_backend() == "gloo"


class _Waiter:
    """Waits for the engine's pending operations on a :class:`~baft.background.BackgroundThread`, one at a time.

    gloo's ``Work.is_completed()`` does not turn true before ``wait()`` is called, so a thread must
    wait while the engine's thread works.
    """

    def __init__(self):
        self._thread = BackgroundThread("baft-wait")

    def wait_while(self, pending, work: Optional[Callable[[threading.Event], None]]) -> float:
        """Wait for ``pending``, running ``work`` meanwhile (with an event set once it completed); the seconds
        until it completed."""
        landed, outcome = threading.Event(), {}
        start = time.perf_counter()
        self._thread.submit(lambda: self._wait(pending, landed, outcome))
        if work is not None:
            work(landed)
        landed.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["done"] - start

    @staticmethod
    def _wait(pending, landed: threading.Event, outcome: dict) -> None:
        try:
            pending.wait()
        except BaseException as err:  # re-raised in the engine's thread
            outcome["error"] = err
        finally:
            outcome["done"] = time.perf_counter()
            landed.set()


_wait_while = _Waiter().wait_while


@contextmanager
def _collectives_while(work: Optional[Callable[[threading.Event], None]]):
    """Within the block, a blocking ``all_reduce`` (DeepSpeed's go through ``torch.distributed``) runs ``work``
    while it waits; yields the list of the seconds each one waited."""
    waits: list[float] = []
    blocking = torch_dist.all_reduce

    def all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=None, async_op=False):
        pending = blocking(tensor, op=op, group=group, async_op=True)
        if async_op:
            return pending
        waits.append(_wait_while(pending, work))
        return None

    torch_dist.all_reduce = all_reduce
    try:
        yield waits
    finally:
        torch_dist.all_reduce = blocking


@contextmanager
def _receive_while(work: Callable[[threading.Event], None]):
    """Within the block, DeepSpeed's blocking receives run ``work`` while they wait."""

    def recv(tensor, src_stage, async_op=False):
        src = p2p._grid.stage_to_global(stage_id=src_stage)
        _wait_while(torch_dist.irecv(tensor, src), work)

    p2p.recv = recv
    try:
        yield
    finally:
        p2p.recv = _blocking_recv
