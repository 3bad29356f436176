"""The simulator: closed-form bubbles, monotonic properties, preset sanity, scenario validation."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baft.errors import ConfigError
from baft.pipeline.bubblemap import BubbleMap, InstructionTiming, RankProfile, StateBytes
from baft.simulate.__main__ import main
from baft.simulate.measured import compare_to_measured, scenario_from_measured
from baft.simulate.model import DAY, run, simulate_scenario
from baft.simulate.scenario import Scenario, load_preset, parse_overrides, preset_document, preset_names
from baft.simulate.tables import render
from baft.pipeline.timeline import Costs, simulate

BASE = {
    "params": 1e9, "p": 2, "m": 4, "forward_s": 1.0, "backward_s": 1.0, "host_bw": 1e9,
    "disk_write_bw": 1e9, "disk_read_bw": 2e9, "failures_per_day": 1.0, "bytes_per_param": 16,
}


def scenario(**changes) -> Scenario:
    return Scenario.from_dict({**BASE, **changes})


# --- closed forms ---------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, p, m", [(s, p, m) for s in ("1f1b", "gpipe") for p in (2, 3, 5) for m in (1, 4, 9)])
def test_uniform_stages_match_closed_form(schedule, p, m):
    result = simulate_scenario(scenario(schedule=schedule, p=p, m=m))
    for stage in result.stages:
        assert stage.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert stage.closed_form == pytest.approx((p - 1) / (m + p - 1))
    assert result.iteration_time == pytest.approx(2 * (m + p - 1))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (3, 6, 2), (4, 8, 3), (2, 6, 4)])
def test_interleaved_matches_closed_form(p, m, v):
    # forward_s is a whole stage's time: each of its v model chunks takes 1/v of it.
    result = simulate_scenario(scenario(schedule="interleaved", p=p, m=m, v=v))
    for stage in result.stages:
        assert stage.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_forward_time_from_flops():
    s = scenario(forward_s=None, backward_s=None, params=8e9, p=4, tp=2, seq_len=1024, micro_batch_size=2,
                 peak_flops=1e14, utilization=0.5)
    forward = 2 * (8e9 / 4) * 2048 / (2 * 1e14 * 0.5)
    assert s.stage_forward() == pytest.approx([forward] * 4)
    assert s.stage_backward() == pytest.approx([2 * forward] * 4)
    assert s.state_per_rank == pytest.approx(8e9 / 4 / 2 * 16 / 1)
    assert scenario(dp=4).state_per_rank == pytest.approx(1e9 / 2 * 16 / 4)


# --- monotonic properties -------------------------------------------------------------------

layouts = st.tuples(st.sampled_from(["1f1b", "gpipe"]), st.integers(2, 4), st.integers(1, 8))
FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(layouts, st.floats(1e8, 1e10), st.floats(1.0, 20.0), st.floats(1e7, 5e9))
def test_more_host_bandwidth_never_lengthens_baft_period(layout, bw, factor, params):
    schedule, p, m = layout
    slow = simulate_scenario(scenario(schedule=schedule, p=p, m=m, host_bw=bw, params=params))
    fast = simulate_scenario(scenario(schedule=schedule, p=p, m=m, host_bw=bw * factor, params=params))
    assert fast.policy("baft").period_iterations <= slow.policy("baft").period_iterations
    # (the overhead itself is not monotonic: the period is a whole number of iterations)
    assert fast.policy("baft").stall_per_snapshot <= slow.policy("baft").stall_per_snapshot


@FAST
@given(layouts, st.floats(1e7, 1e11), st.floats(1.0, 10.0))
def test_bigger_model_never_copies_faster(layout, params, factor):
    schedule, p, m = layout
    small = simulate_scenario(scenario(schedule=schedule, p=p, m=m, params=params))
    big = simulate_scenario(scenario(schedule=schedule, p=p, m=m, params=params * factor))
    assert big.copy_time >= small.copy_time
    assert big.flush_time >= small.flush_time


@FAST
@given(layouts, st.floats(0.01, 50.0), st.floats(1.0, 10.0), st.floats(0.0, 1.0), st.floats(1e7, 5e9))
def test_lost_time_per_day_grows_with_failure_rate(layout, rate, factor, node_fraction, params):
    schedule, p, m = layout
    common = {"schedule": schedule, "p": p, "m": m, "node_failure_fraction": node_fraction, "params": params,
              "restart_s": 30.0, "nccl_init_s": 5.0, "warmup_s": 5.0}
    low = simulate_scenario(scenario(failures_per_day=rate, **common))
    high = simulate_scenario(scenario(failures_per_day=rate * factor, **common))
    for policy in low.policies:
        assert high.policy(policy.policy).lost_per_day >= policy.lost_per_day * (1 - 1e-9)


@FAST
@given(layouts, st.floats(1e6, 1e11), st.floats(1e8, 1e11), st.floats(0.001, 0.1))
def test_baft_period_never_exceeds_sync_copy_period(layout, params, bw, budget):
    schedule, p, m = layout
    result = simulate_scenario(scenario(schedule=schedule, p=p, m=m, params=params, host_bw=bw, budget=budget))
    baft, sync = result.policy("baft"), result.policy("sync-copy")
    assert baft.period_iterations <= sync.period_iterations
    assert baft.stall_per_snapshot <= sync.stall_per_snapshot + 1e-12


def test_young_period_and_losses():
    s = scenario(failures_per_day=2.0, disk_write_bw=1e8, restart_s=10.0)
    result = simulate_scenario(s)
    disk = result.policy("disk")
    flush = s.checkpoint_bytes / 1e8
    young = math.sqrt(2 * flush * DAY / 2.0)
    assert disk.period_s == pytest.approx(young, abs=result.iteration_time / 2)
    assert disk.t0 == pytest.approx(disk.period_s / 2)
    assert disk.lost_per_failure == pytest.approx(disk.t0 + 10.0 + s.checkpoint_bytes / s.disk_read_bw)
    assert disk.lost_per_day == pytest.approx(2.0 * disk.lost_per_failure + disk.overhead * DAY)
    baft = result.policy("baft")
    # software faults restore from memory one period and the iteration in flight back
    sw = baft.detail["software"]
    assert sw["t0"] == pytest.approx((baft.period_iterations / 2 + 1) * result.iteration_time)


def test_parity_rebuild_for_node_failures():
    s = scenario(p=2, dp=8, accelerators_per_node=4, parity=[3, 4], net_bw=1e9, node_failure_fraction=1.0)
    assert s.nodes == 4
    node = simulate_scenario(s).policy("baft").detail["node"]
    bundle = s.state_per_rank * 4
    assert node["encode_s"] == pytest.approx(3 / 3 * bundle / 1e9)
    assert node["t3"] == pytest.approx(bundle / 1e9 + s.state_per_rank / s.host_bw)


# --- presets --------------------------------------------------------------------------------

def test_presets_listed():
    assert {"gpt3-175b-1024", "gpt3-3b-8", "gpt3-15b-8", "this-machine", "h100-1gpu"} <= set(preset_names())


@pytest.mark.parametrize("name", ["gpt3-175b-1024", "gpt3-3b-8", "gpt3-15b-8", "this-machine", "h100-1gpu"])
def test_every_preset_figure_has_a_source(name):
    doc = preset_document(name)
    assert doc["source"]
    for key, value in doc["scenario"].items():
        assert isinstance(value, dict) and value.get("source"), f"{name}: {key} has no source note"
    load_preset(name)


@pytest.mark.parametrize("name, params, flush", [("gpt3-3b-8", 3e9, 30.0), ("gpt3-15b-8", 15e9, 120.0)])
def test_single_server_presets_reproduce_reference_flush(name, params, flush):
    s = load_preset(name)
    assert s.params == params and s.accelerators == 8 and s.disk_write_bw == 2.7e9
    assert s.checkpoint_bytes / 2.7e9 == pytest.approx(flush, rel=0.2)
    assert s.disk_period_s == 3600


def test_gpt3_175b_preset_matches_megatron_estimate():
    s = load_preset("gpt3-175b-1024")
    assert s.accelerators == 1024 and s.dp * s.m * s.micro_batch_size == 1536
    result = simulate_scenario(s)
    # SC'21: 8·T·P / (n·X) per iteration: T = 1536·2048 tokens, X = 140 TFLOP/s per GPU
    paper = 8 * 1536 * 2048 * 175e9 / (1024 * 140e12)
    assert result.iteration_time == pytest.approx(paper, rel=0.15)
    assert result.policy("baft").overhead < 0.01
    assert result.policy("baft").lost_per_day < result.policy("disk").lost_per_day


def test_h100_preset_reproduces_the_measured_iterations_and_copy():
    """results/gpu.md: 'none' iterations of 321 ms (m=8) and 1136 ms (m=32); 11.5 GB at 53.1 GB/s."""
    for m, measured in ((8, 0.321), (32, 1.136)):
        result = run(preset="h100-1gpu", overrides={"m": m})
        assert result.iteration_time == pytest.approx(measured, rel=0.01)
        assert result.copy_time == pytest.approx(11.48e9 / 53.1e9)
        assert result.stages[0].bubble_time == 0  # one stage: no pipeline bubble, the whole copy is stall


def test_a_nodes_ranks_share_its_host_memory_and_pcie_switches():
    alone = scenario(p=2, dp=4, accelerators_per_node=8, host_bw=50e9)
    assert alone.copy_bw == 50e9
    assert scenario(p=2, dp=4, host_bw=50e9, node_host_bw=320e9).copy_bw == 40e9  # 8 ranks share 320 GB/s
    assert scenario(p=2, dp=4, host_bw=50e9, node_host_bw=800e9, switch_bw=60e9, ranks_per_switch=2).copy_bw == 30e9
    assert scenario(p=1, host_bw=50e9, switch_bw=60e9, ranks_per_switch=2).copy_bw == 50e9  # alone behind its switch
    shared = simulate_scenario(scenario(p=2, dp=4, host_bw=50e9, node_host_bw=100e9))
    free = simulate_scenario(scenario(p=2, dp=4, host_bw=50e9))
    assert shared.copy_time == pytest.approx(4 * free.copy_time)
    assert max(r.stall for r in shared.rank_plans) >= max(r.stall for r in free.rank_plans)
    assert any("share the host" in note for note in shared.notes)
    with pytest.raises(ConfigError, match="node_host_bw"):
        scenario(node_host_bw=-1)


def test_this_machine_preset_matches_design_figures():
    result = run(preset="this-machine")
    assert result.iteration_time == pytest.approx(0.75, rel=0.05)
    assert result.state_per_rank == pytest.approx(2e8)
    assert result.copy_time == pytest.approx(2e8 / 3e9)
    assert result.copy_time / result.iteration_time == pytest.approx(0.08, abs=0.02)  # DESIGN: ~8%
    text = render(result)
    assert "baft" in text and "sync-copy" in text and "disk" in text


# --- configuration errors -------------------------------------------------------------------

@pytest.mark.parametrize("changes, key", [
    ({"pp": 4}, "pp"),
    ({"p": 0}, "p"),
    ({"p": 2.5}, "p"),
    ({"m": "many"}, "m"),
    ({"schedule": "zigzag"}, "schedule"),
    ({"parity": [4, 2]}, "parity"),
    ({"parity": [1, 2]}, "net_bw"),
    ({"utilization": 1.5}, "utilization"),
    ({"host_bw": -1}, "host_bw"),
    ({"forward_s": [1.0, 2.0, 3.0]}, "forward_s"),
    ({"forward_s": None}, "peak_flops"),
    ({"mtbf_node_hours": 1000}, "failures_per_day"),
    ({"schedule": "interleaved", "v": 2, "m": 3}, "m"),
    ({"v": 2}, "v"),
    ({"node_failure_fraction": 2}, "node_failure_fraction"),
])
def test_bad_scenario_names_the_key(changes, key):
    with pytest.raises(ConfigError) as err:
        scenario(**changes)
    message = str(err.value)
    assert repr(key) in message and "\n" not in message


def test_overrides_parse_and_validate():
    assert parse_overrides(["p=4", "schedule=gpipe", "parity=[3, 4]", "name=x"]) == \
        {"p": 4, "schedule": "gpipe", "parity": [3, 4], "name": "x"}
    result = run(preset="this-machine", overrides={"host_bw": "6e9", "failures_per_day": "24"})
    assert result.scenario.host_bw == 6e9 and result.failures_per_day == 24
    with pytest.raises(ConfigError, match="'hostbw'"):
        run(preset="this-machine", overrides={"hostbw": "1"})
    with pytest.raises(ConfigError, match="'p'"):
        run(preset="this-machine", overrides={"p": "-2"})
    with pytest.raises(ConfigError, match="preset"):
        run(preset="gpt-9")
    with pytest.raises(ConfigError, match="exactly one"):
        run()


def test_scenario_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({**BASE, "name": "mine"}))
    assert run(scenario_file=path).scenario.name == "mine"
    path.write_text(json.dumps({"scenario": {**BASE, "p": {"value": 3, "source": "me"}}}))
    assert run(scenario_file=path).scenario.p == 3
    path.write_text(json.dumps({**BASE, "colour": "blue"}))
    with pytest.raises(ConfigError, match="'colour'"):
        run(scenario_file=path)


def test_main(capsys):
    assert main(["--preset", "this-machine", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {p["policy"] for p in doc["policies"]} == {"baft", "sync-copy", "disk"}
    assert main(["--preset", "this-machine", "--set", "p=zero"]) == 2
    assert "'p'" in capsys.readouterr().err


# --- against a measured bubble map ----------------------------------------------------------

def fake_measured(schedule="1f1b", stages=2, micro_batches=4, costs=None, stretch=1.0):
    """A bubble map shaped like the profiler's, from an analytic timeline (times × stretch)."""
    costs = costs or Costs(1.0, 2.0)
    timeline = simulate(schedule, stages, micro_batches, costs)
    ranks, bubbles = [], []
    for stage in range(stages):
        instrs = []
        for i, interval in enumerate(timeline.busy(stage)):
            name = {"F": "ForwardPass()", "B": "BackwardPass()", "o": "OptimizerStep()"}[interval.label[0]]
            instrs.append(InstructionTiming(i, name, interval.start * stretch,
                                            (interval.end - interval.start) * stretch))
        ranks.append(RankProfile(rank=stage, stage=stage, iteration_time=timeline.makespan * stretch,
                                 instructions=tuple(instrs), state_bytes=StateBytes(parameters=1_000_000, optimizer=2_000_000),
                                 copy_bandwidth=1e6))
        for b in timeline.bubbles(stage):
            bubbles.append(type(b)(b.stage, b.start * stretch, b.end * stretch, b.instruction, b.after, b.before,
                                   b.kind, stage))
    return BubbleMap(schedule, stages, micro_batches, "measured", bubbles=bubbles, ranks=ranks,
                     makespan=timeline.makespan * stretch)


def test_compare_to_measured_agrees_with_its_own_costs():
    bmap = fake_measured()
    comparison = compare_to_measured(bmap, measured_overhead=0.004)
    for row in comparison.rows:
        assert row["fraction_predicted"] == pytest.approx(row["fraction_measured"])
        assert row["iteration_predicted"] == pytest.approx(row["iteration_measured"])
    assert comparison.overhead["measured"] == 0.004
    # 3 MB at 1 MB/s does not fit 80% of a 3 s bubble: the planner stalls and stretches the period
    assert comparison.overhead["period"] >= 1 and comparison.overhead["sync_copy"] == pytest.approx(3 / bmap.makespan)
    text = comparison.render()
    assert "overhead" in text and "0.40%" in text


def test_scenario_from_measured_uses_measured_costs():
    bmap = fake_measured(costs=Costs([1.0, 1.5], [2.0, 3.0], optimizer=[0.5, 0.25]))
    s = scenario_from_measured(bmap, load_preset("this-machine"))
    assert s.forward_s == (1.0, 1.5) and s.backward_s == (2.0, 3.0) and s.optimizer_s == (0.5, 0.25)
    assert s.state_per_rank == 3_000_000 and s.host_bw == 1e6
    result = simulate_scenario(s)
    assert result.iteration_time == pytest.approx(bmap.makespan)
    assert result.iteration_time == pytest.approx(compare_to_measured(bmap).rows[0]["iteration_predicted"])


def test_compare_needs_a_measured_map():
    with pytest.raises(ConfigError):
        compare_to_measured(BubbleMap("1f1b", 2, 4, "analytic"))


def test_json_output_is_json_alone():
    """Nothing else on stdout (DeepSpeed's accelerator warning once was), so it pipes into other tools."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "baft.simulate", "--preset", "gpt3-3b-8", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["scenario"]["name"] == "gpt3-3b-8"
