"""The model: a scenario through the timeline and planner, to periods, overheads and time lost.

The same analytic timeline (:func:`baft.pipeline.timeline.analytic_bubble_map`) and planner
(:func:`baft.snapshot.planner.plan_rank`, :func:`baft.snapshot.planner.choose_period`) that plan a
measured run here, fed with a :class:`~baft.simulate.scenario.Scenario` (model size, parallel
layout, accelerator speed, host-copy, network and disk bandwidths, failure rate, restart costs)
instead of a profile. For each of three checkpointing policies it predicts the snapshot period,
the overhead and the expected time lost per failure and per day:

``baft``
    copies each rank's state shard into host memory inside the pipeline bubbles (planner:
    fill the bubbles at host-copy bandwidth with a safety margin, stall for what is left
    before the optimizer step, period = smallest with amortized stall within the budget).
``sync-copy``
    an in-memory checkpoint that ignores bubbles: the whole shard is copied synchronously
    at the step boundary (stall = full copy time every snapshot), period at the same budget.
``disk``
    synchronous checkpoint to shared storage: flush time = checkpoint bytes / disk write
    bandwidth, period = Young's first-order optimum sqrt(2·δ·MTBF) with δ the flush time,
    rounded to whole iterations (and, when the scenario fixes one, also at that period).

Model (all per iteration unless said otherwise)
-----------------------------------------------
- forward of one micro-batch through one stage
  ``t_f = 2 · (params / p) · (seq_len · micro_batch_size) / (tp · peak_flops · utilization)``;
  backward ``t_b = backward_factor · t_f`` (2 by default; 3 with activation recomputation);
  with ``v`` model chunks per stage (interleaved) each takes ``t_f / v`` and ``t_b / v``.
  Alternatively ``forward_s`` / ``backward_s`` give per-stage times directly.
- state per rank ``= params / p / tp · bytes_per_param / dp`` (ZeRO-1-style: the ``dp``
  replicas of a stage each snapshot a ``1/dp`` shard, DESIGN "Shards"). ``bytes_per_param``
  defaults to 16: 2 (fp16/bf16 weights) + 4 (fp32 master weights) + 4 + 4 (Adam moments).
  Checkpoint bytes of the whole job ``= state per rank · p · tp · dp``.
- copy time ``= state per rank / copy_bw``, where ``copy_bw`` is what one rank gets while every
  rank of its node copies at once: ``min(host_bw, switch_bw / ranks_per_switch,
  node_host_bw / ranks per node)`` (its own device-to-host link, its share of a PCIe switch's
  uplink, its share of the node's host memory; the last two only where the scenario gives them).
  All of a node's ranks copying at once is exact for the replicas of one stage (the same
  bubbles) and for copies beside the compute; ranks of different stages whose bubbles do not
  overlap would get more.
- failures per day ``λ`` (given, or nodes · 24 / ``mtbf_node_hours``); MTBF of the job
  ``M = 86400 / λ`` seconds. A fraction ``node_failure_fraction`` of failures loses the
  node (its host memory with it); the rest are software faults the node's snapshot survives.
- lost per failure ``= T0 + T1 + T2 + T3 + T4`` with T1 ``restart_s``, T2 ``nccl_init_s``,
  T4 ``warmup_s``, and

  * disk: ``T0 = period / 2``, ``T3 = checkpoint bytes / disk_read_bw``;
  * sync-copy (period P iterations of time t): ``T0 = P·t / 2``; baft: ``T0 = (P/2 + 1)·t``
    (the snapshot of step k is copied during iteration k+1 and commits at its end, so about
    one period when P = 1); ``T3 = state per rank / copy_bw`` from local memory;
  * node failure, with parity group (k, n): the manager encodes its node's bundle
    ``B = state per rank · ranks per node`` into n shares of B/k and sends n-1 of them,
    taking ``τ = (n-1)/k · B / net_bw`` in the background; the parity copy is at most every
    ``P' = max(P, ceil(τ / t))`` iterations and lags by τ, so ``T0 = T0(P') + τ``, and the
    rebuild fetches k shares (``B / net_bw``) before the load from memory;
  * node failure without parity: the newest snapshot the manager persisted to disk in the
    background (as often as the disk allows, every ``ceil(δ / t)`` iterations, no stall),
    so ``T0 = T0(ceil(δ/t)) + δ`` and T3 is the disk load.
- lost per day ``= λ · lost per failure + overhead · 86400 s``.

Limits: stages are uniform unless per-stage times are given (embedding and head layers are
ignored); the copy and the parity traffic are assumed not to slow compute or the gradient
all-reduce (on GPUs they run on other engines and links, see DESIGN); storage is assumed not
shared with other jobs; Young's formula assumes δ ≪ MTBF.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from baft.errors import ConfigError
from baft.pipeline.bubblemap import BubbleMap
from baft.pipeline.timeline import analytic_bubble_map
from baft.simulate.scenario import Scenario, load_preset, load_scenario
from baft.simulate.units import bandwidth, duration, size
from baft.snapshot.planner import RankPlan, choose_period, period_within, plan_rank

DAY = 86400.0
MAX_CHUNKS = 4096  # per rank: chunks grow past chunk_bytes for huge states, to keep planning fast


@dataclass
class StageResult:
    """One stage's bubbles and what baft's plan makes of them."""

    stage: int
    bubble_time: float  # seconds of idle per iteration
    bubble_fraction: float
    closed_form: float  # (p-1)/(v·m+p-1)
    stall: float  # baft's copy left for before the optimizer step, seconds per snapshot
    bubble_used: float  # fraction of the bubble time baft's plan fills


@dataclass
class PolicyResult:
    """One checkpointing policy: its period, overhead and expected losses (seconds)."""

    policy: str
    period_iterations: float
    period_s: float
    period_rule: str
    stall_per_snapshot: float
    overhead: float  # fraction of training time
    t0: float  # expected rollback per failure (software/node mix)
    t1: float
    t2: float
    t3: float  # expected load per failure (mix)
    t4: float
    lost_per_failure: float
    lost_per_day: float
    detail: dict = field(default_factory=dict)


@dataclass
class Result:
    """What :func:`simulate_scenario` predicts for one scenario."""

    scenario: Scenario
    bubble_map: BubbleMap
    iteration_time: float
    forward_s: float  # stage 0, one micro-batch, whole stage
    backward_s: float
    state_per_rank: float
    checkpoint_bytes: float
    copy_time: float
    flush_time: float
    failures_per_day: float
    stages: list[StageResult]
    policies: list[PolicyResult]
    rank_plans: list[RankPlan]
    notes: list[str] = field(default_factory=list)

    def policy(self, name: str) -> PolicyResult:
        """The policy named ``name`` (``baft``, ``sync-copy``, ``disk``, ``disk-fixed``)."""
        for p in self.policies:
            if p.policy == name:
                return p
        raise KeyError(name)

    def to_json(self) -> dict:
        """The scenario, the figures, the stages, the policies and the notes, as plain JSON."""
        s = self.scenario
        return {
            "scenario": s.to_dict(),
            "accelerators": s.accelerators, "nodes": s.nodes,
            "iteration_time": self.iteration_time, "forward_s": self.forward_s, "backward_s": self.backward_s,
            "state_per_rank": self.state_per_rank, "checkpoint_bytes": self.checkpoint_bytes,
            "copy_time": self.copy_time, "flush_time": self.flush_time, "failures_per_day": self.failures_per_day,
            "stages": [dataclasses.asdict(x) for x in self.stages],
            "policies": [dataclasses.asdict(x) for x in self.policies],
            "notes": list(self.notes),
        }


def state_chunks(nbytes: float, chunk_bytes: int) -> list[int]:
    """A rank's state as the planner's chunks: ``chunk_bytes`` each (more for huge states), the rest last."""
    total = round(nbytes)
    each = max(chunk_bytes, -(-total // MAX_CHUNKS))
    full, rest = divmod(total, each)
    return [each] * full + ([rest] if rest else [])


def _memory_t0(period: float, t: float, bubble_aware: bool) -> float:
    """Expected rollback for an in-memory snapshot every ``period`` iterations of ``t`` s."""
    return (period / 2 + (1 if bubble_aware else 0)) * t


def _in_memory(name: str, s: Scenario, t: float, period: int, stall: float, flush: float,
               bubble_aware: bool, rate: float, restart: float, explore: bool = True) -> PolicyResult:
    overhead = stall / (period * t) if t > 0 else 0.0
    sw_t0 = _memory_t0(period, t, bubble_aware)
    mem_load = s.state_per_rank / s.copy_bw
    detail = {"software": {"t0": sw_t0, "t3": mem_load, "source": "local host memory"}}
    if s.parity is not None:
        k, n = s.parity
        bundle = s.state_per_rank * s.ranks_per_node
        encode = (n - 1) / k * bundle / s.net_bw
        parity_period = max(period, math.ceil(encode / t - 1e-9)) if t > 0 else period
        node_t0 = _memory_t0(parity_period, t, bubble_aware) + encode
        node_t3 = bundle / s.net_bw + mem_load
        detail["node"] = {"t0": node_t0, "t3": node_t3, "source": f"parity ({k} of {n})",
                          "encode_s": encode, "parity_period": parity_period}
    else:
        persist = max(1, math.ceil(flush / t - 1e-9)) if t > 0 else 1
        node_t0 = _memory_t0(persist, t, bubble_aware) + flush
        node_t3 = s.checkpoint_bytes / s.disk_read_bw
        detail["node"] = {"t0": node_t0, "t3": node_t3, "source": "background disk copy",
                          "persist_period": persist}
    phi = s.node_failure_fraction
    t0 = (1 - phi) * sw_t0 + phi * node_t0
    t3 = (1 - phi) * mem_load + phi * node_t3
    lost = t0 + restart + t3
    if rate > 0 and stall > 0 and t > 0:
        # Rare failures: a longer period than the budget's loses less (Young with δ = stall).
        longer = round(math.sqrt(2 * stall * DAY / rate) / t)
        if longer > period and explore:
            alt = _in_memory(name, s, t, longer, stall, flush, bubble_aware, rate, restart, explore=False)
            detail["young"] = {"period": longer, "overhead": alt.overhead, "lost_per_day": alt.lost_per_day}
    rule = f"planner, stall <= {s.budget:.0%}" if bubble_aware else f"full copy <= {s.budget:.0%}"
    return PolicyResult(name, period, period * t, rule, stall, overhead, t0, s.restart_s, s.nccl_init_s, t3,
                        s.warmup_s, lost, rate * lost + overhead * DAY, detail)


def _disk(name: str, s: Scenario, t: float, period_s: float, rule: str, flush: float, rate: float,
          restart: float) -> PolicyResult:
    iterations = max(1, round(period_s / t)) if t > 0 else 1
    period_s = iterations * t if t > 0 else period_s
    overhead = flush / (period_s + flush) if period_s + flush > 0 else 0.0
    t0 = period_s / 2
    t3 = s.checkpoint_bytes / s.disk_read_bw
    lost = t0 + restart + t3
    return PolicyResult(name, iterations, period_s, rule, flush, overhead, t0, s.restart_s, s.nccl_init_s, t3,
                        s.warmup_s, lost, rate * lost + overhead * DAY, {"flush_s": flush})


def simulate_scenario(s: Scenario) -> Result:
    """Bubble map, periods, overheads and expected losses of ``s`` under each policy."""
    bmap = analytic_bubble_map(s.schedule, s.p, s.m, s.costs(), model_chunks=s.v)
    t = bmap.makespan
    if t <= 0:
        raise ConfigError("scenario: key 'forward_s': the iteration takes no time; give positive compute times")
    chunks = state_chunks(s.state_per_rank, s.chunk_bytes)
    plans = [plan_rank(bmap.stage_bubbles(stage), chunks, s.copy_bw, t, rank=stage, stage=stage, margin=s.margin)
             for stage in range(s.p)]
    closed = (s.p - 1) / (s.v * s.m + s.p - 1)
    stages = [StageResult(stage, bmap.bubble_time(stage), bmap.bubble_time(stage) / t if t else 0.0, closed,
                          plans[stage].stall, plans[stage].bubble_used) for stage in range(s.p)]

    rate = s.failure_rate
    restart = s.restart_s + s.nccl_init_s + s.warmup_s
    copy = sum(chunks) / s.copy_bw  # the bytes the planner packs (whole bytes)
    flush = s.checkpoint_bytes / s.disk_write_bw

    baft_period = choose_period(plans, s.budget)
    baft_stall = max(p.stall for p in plans)
    sync_period = period_within(copy / t, s.budget)
    policies = [
        _in_memory("baft", s, t, baft_period, baft_stall, flush, True, rate, restart),
        _in_memory("sync-copy", s, t, sync_period, copy, flush, False, rate, restart),
    ]
    notes = []
    if s.copy_bw < s.host_bw:
        notes.append(f"the {s.ranks_per_node} ranks of a node copying at once share the host: each copies at "
                     f"{bandwidth(s.copy_bw)}, not its link's {bandwidth(s.host_bw)}")
    if rate > 0:
        young = math.sqrt(2 * flush * DAY / rate)
        policies.append(_disk("disk", s, t, young, "Young sqrt(2·δ·MTBF)", flush, rate, restart))
        if flush > DAY / rate / 2:
            notes.append("disk: the flush is not small against the MTBF; Young's period is only a rough optimum")
    else:
        notes.append("disk: no failures, so Young's period is unbounded; showing none")
    if s.disk_period_s is not None:
        policies.append(_disk("disk-fixed", s, t, s.disk_period_s, f"fixed every {duration(s.disk_period_s)}",
                              flush, rate, restart))
    worst = max(plans, key=lambda plan: plan.stall)
    if worst.leftover_bytes:
        notes.append(f"baft: the bubbles of stage {worst.stage} (the tightest) hold "
                     f"{size(worst.nbytes - worst.leftover_bytes)} of {size(worst.nbytes)} at {s.margin:.0%} "
                     f"of their length; {duration(worst.stall)} stall per snapshot")
    if baft_period > 1:
        notes.append(f"baft snapshots every {baft_period} iterations to stay within {s.budget:.0%}")
    for policy in policies:
        young = policy.detail.get("young")
        if young and young["lost_per_day"] < 0.8 * policy.lost_per_day:
            notes.append(f"{policy.policy}: failures are rare enough that snapshotting every {young['period']} "
                         f"iterations (Young's period for its {duration(policy.stall_per_snapshot)} stall) "
                         f"would lose {duration(young['lost_per_day'])} a day instead of "
                         f"{duration(policy.lost_per_day)}")
    if s.parity is None and s.node_failure_fraction > 0:
        notes.append("no parity group: node failures restore the in-memory policies from their background disk copy")
    fwd, bwd = s.stage_forward()[0], s.stage_backward()[0]
    return Result(s, bmap, t, fwd, bwd, s.state_per_rank, s.checkpoint_bytes, copy, flush, rate, stages,
                  policies, plans, notes)


def run(preset: str | None = None, scenario_file=None, overrides: dict | None = None) -> Result:
    """Load a preset or scenario file (exactly one), apply overrides, simulate.

    ``overrides`` values may be strings as typed on the command line (``"16"``, ``"[3, 4]"``,
    ``"interleaved"``): they are parsed as JSON where they can be.
    """
    if (preset is None) == (scenario_file is None):
        raise ConfigError("simulate: give exactly one of --preset NAME or --scenario FILE")
    scenario = load_preset(preset) if preset is not None else load_scenario(scenario_file)
    return simulate_scenario(scenario.with_overrides(overrides))
