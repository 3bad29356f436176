"""Analytic timeline: closed-form bubble fractions, bubble placement, DAG invariants."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baft.errors import ConfigError
from baft.pipeline.bubblemap import BUBBLE_KINDS, Bubble, BubbleMap
from baft.pipeline.timeline import Costs, analytic_bubble_map, simulate

UNIFORM = Costs(forward=1.0, backward=1.0, p2p=0.0, optimizer=0.0)


def assert_every_stage_idle(timeline, fraction):
    for stage in range(timeline.stages):
        assert timeline.idle_fraction(stage) == pytest.approx(fraction, abs=1e-12), f"stage {stage}"


@pytest.mark.parametrize("name, stages, micro_batches", [
    (name, p, m) for name in ("gpipe", "1f1b") for p in range(2, 7) for m in range(1, 13)])
def test_uniform_bubble_fraction(name, stages, micro_batches):
    timeline = simulate(name, stages, micro_batches, UNIFORM)
    assert_every_stage_idle(timeline, (stages - 1) / (micro_batches + stages - 1))


@pytest.mark.parametrize("stages, micro_batches, model_chunks", [
    (p, m, v) for v in (2, 3, 4) for p in range(2, 6) for m in range(p, 13, p)])
def test_uniform_interleaved_bubble_fraction(stages, micro_batches, model_chunks):
    per_model_chunk = Costs(forward=1 / model_chunks, backward=1 / model_chunks, p2p=0.0, optimizer=0.0)
    timeline = simulate("interleaved", stages, micro_batches, per_model_chunk, model_chunks=model_chunks)
    assert_every_stage_idle(timeline, (stages - 1) / (model_chunks * micro_batches + stages - 1))


@pytest.mark.parametrize("stages, micro_batches", [
    (p, m) for p in range(2, 6) for m in (2 * p, 2 * p + 1, 3 * p + 2)])
def test_dualpipev_beats_1f1b(stages, micro_batches):
    # DualPipeV cuts the model into 2p stages: each of a rank's two model chunks is half the work.
    half = Costs(forward=0.5, backward=0.5, p2p=0.0, optimizer=0.0)
    dualpipev = simulate("dualpipev", stages, micro_batches, half)
    one_f_one_b = simulate("1f1b", stages, micro_batches, UNIFORM)
    assert dualpipev.makespan < one_f_one_b.makespan
    for stage in range(stages):
        assert dualpipev.idle_fraction(stage) < one_f_one_b.idle_fraction(stage)


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (3, 4), (4, 8)])
def test_gpipe_p2p_latency_crosses_pipeline_twice(stages, micro_batches):
    timeline = simulate("gpipe", stages, micro_batches, Costs(1.0, 1.0, p2p=0.25, optimizer=0.0))
    assert timeline.makespan == pytest.approx(2 * (micro_batches + stages - 1) + 2 * (stages - 1) * 0.25)


def test_gpipe_bubbles_two_stages():
    bmap = analytic_bubble_map("gpipe", 2, 2, UNIFORM)
    assert bmap.source == "analytic" and bmap.makespan == 6.0
    assert bmap.bubbles == [
        Bubble(0, 2.0, 4.0, 6, "ForwardPass(buffer_id=1)", "BackwardPass(buffer_id=0)", "steady"),
        Bubble(1, 0.0, 1.0, 0, "iteration start", "ForwardPass(buffer_id=0)", "warm-up"),
        Bubble(1, 5.0, 6.0, 10, "BackwardPass(buffer_id=1)", "ReduceTiedGrads()", "cool-down"),
    ]
    assert bmap.analytic_bubble_fraction == {0: pytest.approx(1 / 3), 1: pytest.approx(1 / 3)}


def test_optimizer_bubbles():
    synced = simulate("1f1b", 2, 4, Costs(1.0, 1.0, 0.0, optimizer=[1.0, 3.0]))
    tail = synced.bubbles(0)[-1]
    assert (tail.kind, tail.start, tail.end, tail.after, tail.before) == (
        "optimizer", 11.0, 13.0, "OptimizerStep()", "iteration end")
    assert tail.instruction == len(synced.streams[0]) - 1
    assert synced.bubbles(1)[-1].kind == "cool-down"
    independent = simulate("1f1b", 2, 4, Costs(1.0, 1.0, 0.0, 0.0, optimizer_sync=False))
    assert [b.kind for b in independent.bubbles(1)] == ["warm-up", "optimizer"]


def test_dualpipev_waits_in_commit():
    timeline = simulate("dualpipev", 2, 4, Costs(1.0, 1.0, p2p=0.1))
    warm_up = timeline.bubbles(1)[0]
    assert warm_up.kind == "warm-up"
    assert repr(timeline.streams[1][warm_up.instruction]) == "CommitP2P()"
    assert timeline.busy(0)[0].label == "F0/0"


def test_bubble_map_round_trips_through_schema(tmp_path):
    bmap = analytic_bubble_map("interleaved", 2, 4, Costs(0.5, 1.0, 0.05, 0.2), model_chunks=2)
    loaded = BubbleMap.load(bmap.save(tmp_path / "analytic.json"), stages=2)
    assert loaded == bmap


@pytest.mark.parametrize("costs, problem", [
    (Costs(forward=[1.0, 2.0, 3.0]), "3 entries for 2"),
    (Costs(backward=-1.0), "backward must not be negative"),
    (Costs(p2p=-0.1), "p2p must not be negative"),
])
def test_bad_costs(costs, problem):
    with pytest.raises(ConfigError, match=problem):
        simulate("1f1b", 2, 4, costs)


@st.composite
def scenarios(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "dualpipev"]))
    stages = draw(st.integers(1, 4))
    model_chunks = draw(st.integers(1, 3)) if name == "interleaved" else 1
    if name == "interleaved":
        micro_batches = stages * draw(st.integers(1, 3))
    elif name == "dualpipev":
        micro_batches = draw(st.integers(2 * stages, 2 * stages + 4))
    else:
        micro_batches = draw(st.integers(1, 8))
    cost = st.floats(0.01, 10.0)
    per_stage = st.lists(cost, min_size=stages, max_size=stages)
    costs = Costs(
        forward=draw(per_stage),
        backward=draw(per_stage),
        p2p=draw(st.floats(0.0, 2.0)),
        optimizer=draw(st.lists(st.floats(0.0, 5.0), min_size=stages, max_size=stages)),
        optimizer_sync=draw(st.booleans()),
    )
    return name, stages, micro_batches, costs, model_chunks


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_timeline_invariants(scenario):
    name, stages, micro_batches, costs, model_chunks = scenario
    timeline = simulate(name, stages, micro_batches, costs, model_chunks)
    graph, makespan = timeline.graph, timeline.makespan

    for u, v, lag in graph.edges(data="lag"):
        assert graph.nodes[v]["start"] >= graph.nodes[u]["end"] + lag

    for stage in range(stages):
        busy = timeline.busy(stage)
        assert all(0 <= start <= end <= makespan for start, end, _ in busy)
        assert all(a.end <= b.start for a, b in pairwise(busy))
        busy_time = sum(end - start for start, end, _ in busy)
        assert busy_time + timeline.idle_time(stage) == pytest.approx(makespan, rel=1e-6)

        bubbles = timeline.bubbles(stage)
        assert bubbles == sorted(bubbles, key=lambda b: b.start)
        assert all(a.end <= b.start for a, b in pairwise(bubbles))
        for b in bubbles:
            assert 0 <= b.start < b.end <= makespan
            assert b.kind in BUBBLE_KINDS
            assert 0 <= b.instruction < len(timeline.streams[stage])
            assert not any(start < b.end and b.start < end for start, end, _ in busy if end > start)

    fractions = timeline.bubble_map().analytic_bubble_fraction
    assert set(fractions) == set(range(stages))
    assert all(0 <= f <= 1 for f in fractions.values())
