"""baft show: bubble-map and plan tables, the fits verdict, the agreement line, timeline PNGs."""

from pathlib import Path

import pytest
from matplotlib.image import imread

from baft.pipeline.bubblemap import Bubble, BubbleMap, InstructionTiming, RankProfile, StateBytes
from baft.snapshot.planner import Plan, plan
from baft.cli.figures import draw_run, draw_timeline, instruction_kind, timeline_lanes
from baft.cli.show import fit_verdict, render_plan_text, render_run_text, render_text, snapshot_bytes, stage_rows
from baft.pipeline.timeline import Costs, analytic_bubble_map, simulate
from baft.snapshot.trace import RankCopies, RunTimeline

DATA = Path(__file__).parent / "data"
MEASURED = DATA / "bubblemap-1f1b-2x8.json"  # `baft profile`: 2-stage GPT, 2.7M parameters, 2 cores
UNIFORM = Costs(forward=0.01, backward=0.01, p2p=0.0, optimizer=0.0)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _timings(*ops):
    """InstructionTimings from (name, start ms, duration ms) back to back."""
    mb = {}
    out = []
    for i, (name, start, duration) in enumerate(ops):
        kind = name.split("(")[0]
        micro_batch = None
        if kind in ("ForwardPass", "BackwardPass"):
            micro_batch = mb[kind] = mb.get(kind, -1) + 1
        out.append(InstructionTiming(i, name, start / 1e3, duration / 1e3, micro_batch=micro_batch))
    return tuple(out)


def hand_map(bandwidth: float = 1e9, data_parallel: int = 1) -> BubbleMap:
    """A 2-stage, 2-micro-batch measured map: stage 0 waits 30 + 10 ms, stage 1 10 + 10 ms of 110 ms."""
    state = StateBytes(parameters=10_000_000, optimizer=20_000_000, other=50_000)
    stage0 = _timings(("LoadMicroBatch(buffer_id=0)", 0, 1), ("ForwardPass(buffer_id=0)", 1, 9),
                      ("SendActivation(buffer_id=0)", 10, 0.5), ("ForwardPass(buffer_id=1)", 10.5, 9.5),
                      ("RecvGrad(buffer_id=0)", 20, 30), ("BackwardPass(buffer_id=0)", 50, 20),
                      ("RecvGrad(buffer_id=1)", 70, 10), ("BackwardPass(buffer_id=1)", 80, 20),
                      ("OptimizerStep()", 100, 10))
    stage1 = _timings(("RecvActivation(buffer_id=0)", 0, 10), ("ForwardPass(buffer_id=0)", 10, 10),
                      ("BackwardPass(buffer_id=0)", 20, 20), ("RecvActivation(buffer_id=1)", 40, 10),
                      ("ForwardPass(buffer_id=1)", 50, 10), ("BackwardPass(buffer_id=1)", 60, 20),
                      ("OptimizerStep()", 80, 30))
    ranks = [RankProfile(rank=0, stage=0, iteration_time=0.110, iteration_spread=0.002, instructions=stage0,
                         state_bytes=state, copy_bandwidth=bandwidth),
             RankProfile(rank=1, stage=1, iteration_time=0.110, iteration_spread=0.001, instructions=stage1,
                         state_bytes=state, copy_bandwidth=bandwidth)]
    bubbles = [Bubble(0, 0.020, 0.050, 4, "ForwardPass(buffer_id=1)", "BackwardPass(buffer_id=0)", "steady", 0),
               Bubble(0, 0.070, 0.080, 6, "BackwardPass(buffer_id=0)", "BackwardPass(buffer_id=1)", "steady", 0),
               Bubble(1, 0.000, 0.010, 0, "iteration start", "ForwardPass(buffer_id=0)", "warm-up", 1),
               Bubble(1, 0.040, 0.050, 3, "BackwardPass(buffer_id=0)", "ForwardPass(buffer_id=1)", "steady", 1)]
    return BubbleMap("1f1b", 2, 2, "measured", bubbles, ranks, data_parallel=data_parallel, iterations=5,
                     makespan=0.110, analytic_bubble_fraction={0: 0.30, 1: 0.20})


def row_of(text: str, first_cell: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"│ {first_cell} "))


def assert_png(path: Path, min_height: int = 150) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = imread(path).shape
    assert height >= min_height and width >= 800


# --- tables -------------------------------------------------------------------------------


def test_analytic_1f1b_two_stages_eight_micro_batches_is_one_ninth_bubble():
    text = render_text(analytic_bubble_map("1f1b", 2, 8, UNIFORM))
    for stage in ("0", "1"):
        row = row_of(text, stage)
        assert row.count("11.1%") == 2  # the map's fraction and the analytic one
        assert "180.0" in row and "20.0" in row  # makespan and bubble time, ms
    assert "nothing measured to compare" in text
    assert "+0.0" not in text  # no difference is claimed for an analytic map


def test_measured_row_numbers_and_agreement_line():
    text = render_text(hand_map())
    stage0, stage1 = row_of(text, "0 (rank 0)"), row_of(text, "1 (rank 1)")
    assert "110.0 ± 2.0" in stage0 and "40.0" in stage0 and "36.4%" in stage0 and "30.0%" in stage0
    assert "+6.4" in stage0
    assert "18.2%" in stage1 and "20.0%" in stage1 and "-1.8" in stage1
    assert "10.0 / 20.0 / 0.05" in stage0
    assert "max |difference| 6.4 percentage points (stage 0) over 2 stages" in text


def test_fits_verdict_flips_with_bandwidth():
    # 30 MB to copy; stage 0 idles 40 ms, stage 1 20 ms per iteration.
    fast = render_text(hand_map(bandwidth=1e9))  # 30 ms
    assert "yes: uses 75% of the bubble time" in row_of(fast, "0 (rank 0)")
    assert "no: bubbles hold 67%, needs 2 iterations of bubbles" in row_of(fast, "1 (rank 1)")
    slow = render_text(hand_map(bandwidth=0.25e9))  # 120 ms
    assert "120.0" in row_of(slow, "0 (rank 0)")
    assert "needs 3 iterations of bubbles" in row_of(slow, "0 (rank 0)")
    assert "needs 6 iterations of bubbles" in row_of(slow, "1 (rank 1)")


@pytest.mark.parametrize("copy, bubble, verdict", [
    (0.010, 0.010, "yes: uses 100% of the bubble time"),
    (0.011, 0.010, "no: bubbles hold 91%, needs 2 iterations of bubbles"),
    (0.010, 0.0, "no (no bubbles)"),
    (0.0, 0.0, "yes (nothing to copy)"),
    (float("inf"), 0.010, "unknown (no copy bandwidth)"),
])
def test_fit_verdict(copy, bubble, verdict):
    assert fit_verdict(copy, bubble) == verdict


def test_data_parallel_replicas_copy_their_shard():
    bmap = hand_map(data_parallel=2)
    assert snapshot_bytes(bmap, bmap.ranks[0]) == 15_000_000
    text = render_text(bmap)
    assert "copy ms (1/2 shard)" in text and "15.0" in row_of(text, "0 (rank 0)")


def test_profiled_map_from_file():
    bmap = BubbleMap.load(MEASURED)
    rows = stage_rows(bmap)
    assert [r.rank for r in rows] == [0, 1]
    assert snapshot_bytes(bmap, bmap.ranks[0]) == sum(bmap.model["chunk_sizes"]["0"])
    text = render_text(bmap)
    stage0, stage1 = row_of(text, "0 (rank 0)"), row_of(text, "1 (rank 1)")
    assert "32.4%" in stage0 and "32.9%" in stage0 and "-0.5" in stage0 and "yes" in stage0
    assert "4.6%" in stage1 and "8.0%" in stage1 and "-3.3" in stage1
    assert "max |difference| 3.3 percentage points (stage 1)" in text


def test_plan_table_with_stall_and_period():
    # 0.6 GB/s and an 80% margin: stage 0's 30 and 10 ms bubbles hold 14 + 4
    # of its 30 one-MB chunks, stage 1's two 10 ms bubbles 4 + 4.
    bmap = hand_map(bandwidth=0.6e9)
    result = plan(bmap, chunk_bytes=1_000_000)
    text = render_plan_text(result)
    rank0 = next(line for line in text.splitlines() if line.startswith("│    0 "))
    cells = [c.strip() for c in rank0.strip("│").split("│")]
    assert cells == ["0", "0", "30.0", "40.0", "18.0", "75.0%", "12.0", "20.0", "18.18%"]
    rank1 = next(line for line in text.splitlines() if line.startswith("│    1 "))
    assert [c.strip() for c in rank1.strip("│").split("│")][4:8] == ["8.0", "66.7%", "22.0", "36.7"]
    assert result.period == 34  # the stage with the least bubble sets it: 33.3% per snapshot
    assert "snapshot every 34 iterations" in text
    assert "note: rank 0 (stage 0): bubbles hold 18.0 MB of 30.0 MB" in text


def test_plan_that_fits():
    text = render_plan_text(plan(BubbleMap.load(MEASURED)))
    assert "snapshot every 1 iteration;" in text and "predicted overhead 0.00%" in text
    assert "note:" not in text


def test_version_1_bubble_map_loads():
    # as baft wrote this map before version 2: a bubble's instruction was its "slot", model_chunks was "chunks"
    old = BubbleMap.load(DATA / "bubblemap-v1.json")
    now = analytic_bubble_map("interleaved", 2, 4, Costs(0.5, 1.0, 0.05, 0.2), model_chunks=2)
    assert old.model_chunks == 2
    assert [(b.instruction, b.start, b.end, b.kind) for b in old.bubbles] == [
        (b.instruction, b.start, b.end, b.kind) for b in now.bubbles]


def test_version_1_plan_loads():
    # schedules/gpt-2x8-1f1b.plan.json as baft wrote it before version 2: a rank's bubbles were its "slots",
    # each one's instruction its "slot"
    old = Plan.load(DATA / "plan-v1.json")
    assert [r.placement() for r in old.ranks] == [{5: range(0, 275)}, {0: range(0, 279)}]


# --- figures ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, kind", [
    ("ForwardPass(buffer_id=0)", "forward"), ("BackwardPass(buffer_id=1)", "backward"),
    ("SendGrad(buffer_id=0)", "send"), ("RecvActivation(buffer_id=0)", "recv"),
    ("LoadMicroBatch(buffer_id=0)", "load"), ("ReduceTiedGrads()", "optimizer"),
    ("ReduceGrads()", "optimizer"), ("OptimizerStep()", "optimizer"), ("SnapshotCopy()", "other"),
])
def test_instruction_kind(name, kind):
    assert instruction_kind(name) == kind


def test_analytic_lanes_are_the_complement_of_bubbles():
    bmap = analytic_bubble_map("gpipe", 3, 4, UNIFORM)
    for stage, lane in enumerate(timeline_lanes(bmap)):
        busy = sum(duration for _, duration, _, _ in lane.bars)
        assert busy == pytest.approx(bmap.makespan - bmap.bubble_time(stage))
        assert {kind for _, _, kind, _ in lane.bars} == {"compute"}


def test_measured_lanes_label_micro_batches():
    lanes = timeline_lanes(hand_map())
    assert [lane.rank for lane in lanes] == [0, 1]
    assert [text for _, _, _, text in lanes[1].bars if text] == ["F0", "B0", "F1", "B1"]
    assert [b.instruction for b in lanes[0].bubbles] == [4, 6]


def test_draw_measured_timeline(tmp_path):
    path = draw_timeline(BubbleMap.load(MEASURED), tmp_path / "measured.png")
    assert_png(path)


def test_draw_analytic_timelines(tmp_path):
    timeline = simulate("interleaved", 2, 4, UNIFORM, model_chunks=2)
    assert_png(draw_timeline(timeline.bubble_map(), tmp_path / "ops.png", timeline=timeline))
    assert_png(draw_timeline(analytic_bubble_map("1f1b", 4, 8, UNIFORM), tmp_path / "sub" / "busy.png",
                             title="1F1B, 4 stages"))


def hand_run() -> RunTimeline:
    """:func:`hand_map` as one traced iteration: rank 0 copies 20 + 8 MB in its two bubbles and flushes 2 MB
    at the optimizer step (2 ms); rank 1 copies all 30 MB in its two bubbles (its flush copies nothing)."""
    rank0 = RankCopies(0, ((4, 0.021, 0.049, 20_000_000), (6, 0.071, 0.079, 8_000_000)), (0.100, 0.102, 2_000_000),
                       30_000_000)
    rank1 = RankCopies(1, ((0, 0.001, 0.009, 15_000_000), (3, 0.041, 0.049, 15_000_000)), (0.080, 0.0805, 0),
                       30_000_000)
    return RunTimeline(step=7, bubble_map=hand_map(), copies={0: rank0, 1: rank1})


def test_run_table_says_what_share_was_copied_inside_bubbles():
    text = render_run_text(hand_run())
    assert [c.strip() for c in row_of(text, "   0").strip("│").split("│")] == \
        ["0", "0", "30.0", "28.0", "93.3%", "36.0", "2.0", "2.00"]
    assert [c.strip() for c in row_of(text, "   1").strip("│").split("│")][3:] == \
        ["30.0", "100.0%", "16.0", "0.0", "0.50"]
    assert "step 7: 96.7% of the snapshot (60.0 MB) copied inside bubbles, stall 2.00 ms" in text


def test_draw_run(tmp_path):
    assert_png(draw_run(hand_run(), tmp_path / "run.png"))
