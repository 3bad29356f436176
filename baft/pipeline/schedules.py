"""Pipeline schedules as per-stage streams of DeepSpeed pipeline instructions.

Schedules follow DeepSpeed's ``deepspeed.runtime.pipe.schedule``: a ``PipeSchedule`` is a
generator of steps, each step a list of ``PipeInstruction``. baft adds GPipe (which DeepSpeed
does not ship) and Megatron's interleaved 1F1B, and reuses DeepSpeed's ``TrainSchedule``
(1F1B) and ``DualPipeVSchedule``.

The flattened stream of one iteration is what the bubble map indexes: an instruction is
named by its position in :func:`instruction_stream` of its stage.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    DualPipeVSchedule,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

from baft.errors import ConfigError


class GPipeSchedule(PipeSchedule):
    """GPipe: every forward pass, then every backward pass, then one optimizer step.

    Forwards and backwards both run in micro-batch order (as PyTorch's ``ScheduleGPipe``
    does), so each parameter's gradient accumulates micro-batches in the same order as
    DeepSpeed's 1F1B and one GPipe step equals one 1F1B step bit for bit. One step per
    micro-batch: ``RecvActivation → LoadMicroBatch (first/last stage) →
    ForwardPass → SendActivation``, then ``RecvGrad → BackwardPass → SendGrad``.

    All activations flow downstream before any gradient flows upstream, and every stage
    sends and receives in the same micro-batch order, so the blocking sends and receives
    pair up with their neighbour's in the same step and cannot deadlock. Each ``RecvGrad``
    is directly followed by its ``BackwardPass`` (the engine keeps one shared gradient
    buffer). Runs on DeepSpeed's ``PipelineEngine`` once the last stage's backward uses
    the loss of its own micro-batch rather than ``engine.loss``.
    """

    def steps(self):
        for mb in range(self.micro_batches):
            cmds = []
            if not self.is_first_stage:
                cmds.append(RecvActivation(mb))
            if self.is_first_stage or self.is_last_stage:
                cmds.append(LoadMicroBatch(mb))
            cmds.append(ForwardPass(mb))
            if not self.is_last_stage:
                cmds.append(SendActivation(mb))
            yield cmds
        for mb in range(self.micro_batches):
            cmds = []
            if not self.is_last_stage:
                cmds.append(RecvGrad(mb))
            cmds.append(BackwardPass(mb))
            if not self.is_first_stage:
                cmds.append(SendGrad(mb))
            yield cmds
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def num_pipe_buffers(self):
        """One buffer per micro-batch: all of them are in flight at the turn-around."""
        return self.micro_batches


class InterleavedSchedule(PipeSchedule):
    """Megatron-LM interleaved 1F1B (Narayanan et al., SC'21) with ``model_chunks`` model chunks per rank.

    Rank ``s`` holds virtual stages ``c * stages + s`` for ``c < model_chunks``. Instructions carry
    ``model_chunk=c``; buffer ids are micro-batch indices, one set per model chunk. Requires
    ``micro_batches % stages == 0``. The bubble shrinks to ``(p-1)/(v*m+p-1)`` of the
    iteration for uniform per-model-chunk costs.

    For analysis only (timeline, bubble map, planner): DeepSpeed's ``PipelineEngine``
    holds one model chunk per rank and cannot execute it.
    """

    def __init__(self, micro_batches, stages, stage_id, model_chunks=2):
        super().__init__(micro_batches, stages, stage_id)
        if model_chunks < 1:
            raise ConfigError(f"interleaved schedule needs model_chunks >= 1, got {model_chunks}")
        if micro_batches % stages:
            raise ConfigError(
                f"interleaved schedule needs micro_batches divisible by stages, got {micro_batches} and {stages}")
        self.model_chunks = model_chunks

    def num_pipe_buffers(self):
        return self.micro_batches

    def _virtual_op(self, k, forward):
        """Model chunk and micro-batch of this rank's ``k``-th forward (or backward)."""
        group = self.stages * self.model_chunks
        model_chunk = (k % group) // self.stages
        if not forward:
            model_chunk = self.model_chunks - 1 - model_chunk
        return model_chunk, (k // group) * self.stages + k % self.stages

    def _forward(self, k):
        model_chunk, mb = self._virtual_op(k, True)
        vstage = model_chunk * self.stages + self.stage_id
        last = self.stages * self.model_chunks - 1
        cmds = [RecvActivation(mb, model_chunk=model_chunk)] if vstage > 0 else []
        if vstage in (0, last):
            cmds.append(LoadMicroBatch(mb, model_chunk=model_chunk))
        cmds.append(ForwardPass(mb, model_chunk=model_chunk))
        if vstage < last:
            cmds.append(SendActivation(mb, model_chunk=model_chunk))
        return cmds

    def _backward(self, k):
        model_chunk, mb = self._virtual_op(k, False)
        vstage = model_chunk * self.stages + self.stage_id
        cmds = [RecvGrad(mb, model_chunk=model_chunk)] if vstage < self.stages * self.model_chunks - 1 else []
        cmds.append(BackwardPass(mb, model_chunk=model_chunk))
        if vstage > 0:
            cmds.append(SendGrad(mb, model_chunk=model_chunk))
        return cmds

    def steps(self):
        total = self.micro_batches * self.model_chunks
        if self.micro_batches == self.stages:
            # Megatron runs this case as all forwards then all backwards.
            warmup = total
        else:
            warmup = min(total, (self.stages - self.stage_id - 1) * 2 + (self.model_chunks - 1) * self.stages)
        for k in range(warmup):
            yield self._forward(k)
        for k in range(total - warmup):
            yield self._forward(warmup + k)
            yield self._backward(k)
        for k in range(total - warmup, total):
            yield self._backward(k)
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


SCHEDULES = {
    "gpipe": GPipeSchedule,
    "1f1b": TrainSchedule,
    "interleaved": InterleavedSchedule,
    "dualpipev": DualPipeVSchedule,
}


def make_schedule(name, micro_batches, stages, stage_id, model_chunks=1) -> PipeSchedule:
    """The ``PipeSchedule`` called ``name`` for one stage; bad arguments raise ``ConfigError``.

    ``model_chunks`` is the number of model chunks per rank of the interleaved schedule; the
    other schedules take only ``model_chunks=1`` (DualPipeV's two phases are built in).
    """
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
        raise ConfigError(
            f"schedule {name}: need micro_batches >= 1 and 0 <= stage_id < stages, "
            f"got micro_batches={micro_batches}, stages={stages}, stage_id={stage_id}")
    if name == "interleaved":
        return InterleavedSchedule(micro_batches, stages, stage_id, model_chunks=model_chunks)
    if model_chunks != 1:
        raise ConfigError(f"schedule {name} has no model chunks (model_chunks={model_chunks}); use interleaved")
    try:
        return SCHEDULES[name](micro_batches, stages, stage_id)
    except ValueError as err:  # DualPipeVSchedule checks micro_batches >= 2 * stages
        raise ConfigError(f"schedule {name}: {err}") from None


def instruction_stream(name, micro_batches, stages, stage_id, model_chunks=1) -> list[PipeInstruction]:
    """Every instruction ``stage_id`` executes in one ``train_batch``, in order: its index here names it."""
    return [cmd for step in make_schedule(name, micro_batches, stages, stage_id, model_chunks).steps() for cmd in step]


class ComputeOp(NamedTuple):
    """A forward or backward pass of one micro-batch through one model chunk (or phase) of a stage;
    ``instruction`` is its index in the stage's stream."""

    instruction: int
    kind: str  # "F" or "B"
    micro_batch: int
    model_chunk: int


def model_chunk_of(instr: PipeInstruction) -> int:
    """The model chunk an instruction works on: ``model_chunk`` (interleaved), ``phase`` (DualPipeV) or 0."""
    return instr.kwargs.get("model_chunk", instr.kwargs.get("phase", 0))


def micro_batch_ops(stream) -> list[ComputeOp]:
    """The forward and backward passes of a stream, with their micro-batch and model chunk.

    The n-th ``ForwardPass`` of a model chunk is micro-batch n in every schedule here; a
    ``BackwardPass`` belongs to the micro-batch last forwarded through its buffer (buffers
    are reused, e.g. cyclically in 1F1B, and backwards may run in another order).
    """
    ops, forwards, owner = [], Counter(), {}
    for index, instr in enumerate(stream):
        if not isinstance(instr, (ForwardPass, BackwardPass)):
            continue
        model_chunk = model_chunk_of(instr)
        key = (model_chunk, instr.buffer_id)
        if isinstance(instr, ForwardPass):
            owner[key] = forwards[model_chunk]
            forwards[model_chunk] += 1
            ops.append(ComputeOp(index, "F", owner[key], model_chunk))
        else:
            ops.append(ComputeOp(index, "B", owner[key], model_chunk))
    return ops
