"""Pipeline schedules: registry, instruction streams, micro-batch mapping, GPipe pairing."""

from collections import Counter

import pytest
from deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

from baft.errors import ConfigError
from baft.pipeline.schedules import (
    SCHEDULES,
    GPipeSchedule,
    InterleavedSchedule,
    instruction_stream,
    make_schedule,
    micro_batch_ops,
)

# (schedule, stages, micro_batches, model_chunks) that every schedule accepts
SHAPES = [
    ("gpipe", 1, 3, 1), ("gpipe", 3, 2, 1), ("gpipe", 4, 7, 1),
    ("1f1b", 1, 3, 1), ("1f1b", 3, 2, 1), ("1f1b", 4, 7, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 3), ("interleaved", 4, 4, 2), ("interleaved", 2, 6, 1),
    ("dualpipev", 2, 4, 1), ("dualpipev", 3, 9, 1), ("dualpipev", 4, 8, 1),
]


def run_blocking(streams):
    """Execute streams with rendezvous sends and receives; return the matched pairs.

    A send completes only together with the neighbour's matching receive (the strictest
    blocking model), so a schedule that passes here cannot deadlock on blocking p2p.
    """
    peer = {SendActivation: (1, RecvActivation), SendGrad: (-1, RecvGrad)}
    comm = (SendActivation, SendGrad, RecvActivation, RecvGrad)
    pcs, pairs = [0] * len(streams), []

    def current(s):
        return streams[s][pcs[s]] if pcs[s] < len(streams[s]) else None

    progress = True
    while progress:
        progress = False
        for s in range(len(streams)):
            while current(s) is not None and not isinstance(current(s), comm):
                pcs[s] += 1
                progress = True
            instr = current(s)
            if type(instr) in peer:
                step, recv_type = peer[type(instr)]
                other = current(s + step)
                if isinstance(other, recv_type):
                    pairs.append((s, instr, s + step, other))
                    pcs[s] += 1
                    pcs[s + step] += 1
                    progress = True
    stuck = {s: current(s) for s in range(len(streams)) if current(s) is not None}
    assert not stuck, f"deadlock, stages blocked in {stuck}"
    return pairs


def streams_of(name, stages, micro_batches, model_chunks=1):
    return [instruction_stream(name, micro_batches, stages, s, model_chunks) for s in range(stages)]


def test_registry():
    assert SCHEDULES["1f1b"] is TrainSchedule
    assert SCHEDULES["gpipe"] is GPipeSchedule
    assert isinstance(make_schedule("interleaved", 4, 2, 1, model_chunks=2), InterleavedSchedule)


@pytest.mark.parametrize("name", ["pipedream", "GPIPE", ""])
def test_unknown_schedule(name):
    with pytest.raises(ConfigError, match=f"unknown pipeline schedule '{name}'.*gpipe, 1f1b, interleaved, dualpipev"):
        make_schedule(name, 4, 2, 0)


@pytest.mark.parametrize("name, micro_batches, stages, stage_id, model_chunks, problem", [
    ("interleaved", 5, 2, 0, 2, "divisible"),
    ("interleaved", 4, 2, 0, 0, "model_chunks >= 1"),
    ("dualpipev", 3, 2, 0, 1, "at least"),
    ("1f1b", 4, 2, 0, 2, "no model chunks"),
    ("gpipe", 4, 2, 2, 1, "stage_id"),
    ("gpipe", 0, 2, 0, 1, "micro_batches"),
])
def test_bad_arguments(name, micro_batches, stages, stage_id, model_chunks, problem):
    with pytest.raises(ConfigError, match=problem):
        make_schedule(name, micro_batches, stages, stage_id, model_chunks)


@pytest.mark.parametrize("name, stages, micro_batches, model_chunks", SHAPES)
def test_every_micro_batch_once_per_model_chunk(name, stages, micro_batches, model_chunks):
    n_model_chunks = 2 if name == "dualpipev" else model_chunks
    for stage, stream in enumerate(streams_of(name, stages, micro_batches, model_chunks)):
        ops = micro_batch_ops(stream)
        assert Counter((o.kind, o.model_chunk) for o in ops) == {
            (k, c): micro_batches for k in "FB" for c in range(n_model_chunks)}
        position = {(o.kind, o.model_chunk, o.micro_batch): o.instruction for o in ops}
        assert len(position) == len(ops)
        for (kind, model_chunk, mb), instruction in position.items():
            if kind == "B":
                assert position["F", model_chunk, mb] < instruction
        assert isinstance(stream[-1], OptimizerStep)


def test_micro_batch_ops_follow_buffers():
    # 1F1B reuses buffers cyclically; backward i must still be micro-batch i.
    stream = instruction_stream("1f1b", 8, 4, 0)
    backwards = [o.micro_batch for o in micro_batch_ops(stream) if o.kind == "B"]
    assert backwards == list(range(8))
    gpipe = instruction_stream("gpipe", 5, 2, 0)
    # GPipe holds one buffer per micro-batch and runs backwards in 1F1B's order (same gradient sums)
    assert [o.micro_batch for o in micro_batch_ops(gpipe) if o.kind == "B"] == list(range(5))


def test_interleaved_carries_model_chunks():
    stream = instruction_stream("interleaved", 4, 2, 0, model_chunks=2)
    assert all(instr.model_chunk in (0, 1) for instr in stream if hasattr(instr, "buffer_id"))
    assert [repr(i) for i in stream[:3]] == [
        "LoadMicroBatch(buffer_id=0, model_chunk=0)",
        "ForwardPass(buffer_id=0, model_chunk=0)",
        "SendActivation(buffer_id=0, model_chunk=0)",
    ]
    # rank 0 holds the first virtual stage (loads data) and virtual stage 2 (receives)
    assert any(isinstance(i, RecvActivation) and i.model_chunk == 1 for i in stream)
    assert not any(isinstance(i, RecvActivation) and i.model_chunk == 0 for i in stream)


@pytest.mark.parametrize("stages, micro_batches", [(1, 3), (2, 1), (2, 4), (3, 5), (4, 8)])
def test_gpipe_stream_shape(stages, micro_batches):
    for stage, stream in enumerate(streams_of("gpipe", stages, micro_batches)):
        sched = make_schedule("gpipe", micro_batches, stages, stage)
        assert sched.num_pipe_buffers() == micro_batches
        assert [type(i) for i in stream[-3:]] == [ReduceTiedGrads, ReduceGrads, OptimizerStep]
        for i, instr in enumerate(stream):
            if isinstance(instr, RecvGrad):
                nxt = stream[i + 1]
                assert isinstance(nxt, BackwardPass) and nxt.buffer_id == instr.buffer_id
        loads = [i.buffer_id for i in stream if isinstance(i, LoadMicroBatch)]
        assert loads == (list(range(micro_batches)) if stage in (0, stages - 1) else [])
        forwards = [i.buffer_id for i in stream if isinstance(i, ForwardPass)]
        assert forwards == list(range(micro_batches))


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 5])
def test_gpipe_blocking_p2p_pairs_in_order(stages, micro_batches):
    pairs = run_blocking(streams_of("gpipe", stages, micro_batches))
    assert len(pairs) == 2 * (stages - 1) * micro_batches
    for _, send, _, recv in pairs:
        assert send.buffer_id == recv.buffer_id


def test_blocking_checker_finds_deadlock():
    run_blocking(streams_of("1f1b", 4, 6))  # DeepSpeed's own schedule passes
    both_receive_first = [
        [RecvGrad(0), SendActivation(0)],
        [RecvActivation(0), SendGrad(0)],
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        run_blocking(both_receive_first)
