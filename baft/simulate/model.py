"""What-if at cluster scale: the timeline and planner driven by published hardware figures.

The same analytic timeline (:func:`baft.pipeline.timeline.analytic_bubble_map`) and planner
(:func:`baft.snapshot.planner.plan_rank`, :func:`baft.snapshot.planner.choose_period`) that plan a measured run
here, fed with a :class:`Scenario` (model size, parallel layout, accelerator speed, host-copy,
network and disk bandwidths, failure rate, restart costs) instead of a profile. For each of
three checkpointing policies it predicts the snapshot period, the overhead and the expected
time lost per failure and per day:

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
  with ``v`` interleaved chunks each chunk op takes ``t_f / v`` and ``t_b / v``.
  Alternatively ``forward_s`` / ``backward_s`` give per-stage times directly.
- state per rank ``= params / p / tp · bytes_per_param / dp`` (ZeRO-1-style: the ``dp``
  replicas of a stage each snapshot a ``1/dp`` shard, DESIGN "Shards"). ``bytes_per_param``
  defaults to 16: 2 (fp16/bf16 weights) + 4 (fp32 master weights) + 4 + 4 (Adam moments).
  Checkpoint bytes of the whole job ``= state per rank · p · tp · dp``.
- copy time ``= state per rank / host_bw``.
- failures per day ``λ`` (given, or nodes · 24 / ``mtbf_node_hours``); MTBF of the job
  ``M = 86400 / λ`` seconds. A fraction ``node_failure_fraction`` of failures loses the
  node (its host memory with it); the rest are software faults the node's snapshot survives.
- lost per failure ``= T0 + T1 + T2 + T3 + T4`` with T1 ``restart_s``, T2 ``nccl_init_s``,
  T4 ``warmup_s``, and

  * disk: ``T0 = period / 2``, ``T3 = checkpoint bytes / disk_read_bw``;
  * sync-copy (period P iterations of time t): ``T0 = P·t / 2``; baft: ``T0 = (P/2 + 1)·t``
    (the snapshot of step k is copied during iteration k+1 and commits at its end, so about
    one period when P = 1); ``T3 = state per rank / host_bw`` from local memory;
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

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from baft.errors import BaftError, ConfigError
from baft.pipeline.bubblemap import BubbleMap
from baft.snapshot.planner import (
    DEFAULT_BUDGET,
    DEFAULT_MARGIN,
    RankPlan,
    choose_period,
    plan_rank,
)
from baft.pipeline.timeline import Costs, analytic_bubble_map

DAY = 86400.0
MAX_CHUNKS = 4096  # per rank: chunks grow past chunk_bytes for huge states, to keep planning fast

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved", "dualpipev")


# --- the scenario -------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """A training job and its hardware, in SI units (seconds, bytes, bytes/s, FLOP/s).

    Build it with :meth:`from_dict` (or :func:`load_scenario`, :func:`load_preset`): every
    key is validated and a bad one raises a one-line :class:`~baft.errors.ConfigError`
    naming it. See the module docstring for the formulas and docs/simulator.rst for the keys.
    """

    name: str = "custom"
    description: str = ""
    # model
    params: float = 0.0
    layers: int | None = None
    hidden: int | None = None
    seq_len: int = 2048
    micro_batch_size: int = 1
    bytes_per_param: float = 16.0
    state_bytes_per_rank: float | None = None
    # parallel layout and schedule
    p: int = 1
    m: int = 1
    v: int = 1
    schedule: str = "1f1b"
    dp: int = 1
    tp: int = 1
    accelerators_per_node: int = 8
    # compute
    peak_flops: float | None = None
    utilization: float | None = None
    forward_s: Any = None  # float or one per stage
    backward_s: Any = None
    backward_factor: float = 2.0
    optimizer_s: Any = 0.0  # float or one per stage
    p2p_s: float = 0.0
    # copies, network, disk
    host_bw: float = 0.0
    net_bw: float | None = None
    parity: tuple | None = None  # (k, n)
    disk_write_bw: float = 0.0
    disk_read_bw: float = 0.0
    disk_period_s: float | None = None
    # failures and restart
    failures_per_day: float | None = None
    mtbf_node_hours: float | None = None
    node_failure_fraction: float = 0.78
    restart_s: float = 0.0
    nccl_init_s: float = 0.0
    warmup_s: float = 0.0
    # planning
    budget: float = DEFAULT_BUDGET
    margin: float = DEFAULT_MARGIN
    chunk_bytes: int = 1 << 20

    # -- derived --

    @property
    def accelerators(self) -> int:
        return self.p * self.tp * self.dp

    @property
    def ranks_per_node(self) -> int:
        return min(self.accelerators_per_node, self.accelerators)

    @property
    def nodes(self) -> int:
        return math.ceil(self.accelerators / self.accelerators_per_node)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq_len * self.micro_batch_size

    @property
    def state_per_rank(self) -> float:
        """Bytes each rank snapshots: params / p / tp · bytes_per_param / dp, unless given."""
        if self.state_bytes_per_rank is not None:
            return float(self.state_bytes_per_rank)
        return self.params / self.p / self.tp * self.bytes_per_param / self.dp

    @property
    def checkpoint_bytes(self) -> float:
        """Bytes of the whole job's checkpoint (every rank's shard)."""
        return self.state_per_rank * self.accelerators

    @property
    def failure_rate(self) -> float:
        """Failures per day of the whole job."""
        if self.failures_per_day is not None:
            return float(self.failures_per_day)
        return self.nodes * 24.0 / self.mtbf_node_hours

    def stage_forward(self) -> list[float]:
        """Forward time of one micro-batch through each whole stage (all its chunks)."""
        if self.forward_s is not None:
            return _per_stage(self.forward_s, self.p, "forward_s")
        flops = 2.0 * (self.params / self.p) * self.tokens_per_microbatch
        return [flops / (self.tp * self.peak_flops * self.utilization)] * self.p

    def stage_backward(self) -> list[float]:
        if self.backward_s is not None:
            return _per_stage(self.backward_s, self.p, "backward_s")
        return [self.backward_factor * f for f in self.stage_forward()]

    def costs(self) -> Costs:
        """Per-op costs for the timeline: one chunk of one stage, one micro-batch."""
        return Costs(forward=[f / self.v for f in self.stage_forward()],
                     backward=[b / self.v for b in self.stage_backward()],
                     p2p=self.p2p_s, optimizer=_per_stage(self.optimizer_s, self.p, "optimizer_s"))

    # -- construction --

    @classmethod
    def from_dict(cls, doc: dict, where: str = "scenario") -> Scenario:
        """Validate ``doc`` (plain values, or ``{"value": ..., "source": ...}`` per key)."""
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a JSON object of scenario keys, got {type(doc).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, raw in doc.items():
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
            if isinstance(raw, dict):
                if "value" not in raw:
                    raise ConfigError(f"{where}: key {key!r}: expected a value or {{\"value\": ..., \"source\": ...}}")
                raw = raw["value"]
            values[key] = _VALIDATORS[key](key, raw, where)
        scenario = cls(**values)
        scenario._check(where)
        return scenario

    def with_overrides(self, overrides: dict | None, where: str = "--set") -> Scenario:
        """A copy with ``overrides`` applied; string values are parsed as JSON where they can be."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        doc = self.to_dict()
        for key, value in overrides.items():
            doc[key] = _parse_value(value)
        # One failure-rate form replaces the other.
        for key, other in (("failures_per_day", "mtbf_node_hours"), ("mtbf_node_hours", "failures_per_day")):
            if key in overrides and other not in overrides and doc[key] is not None:
                doc[other] = None
        return Scenario.from_dict(doc, where)

    def to_dict(self) -> dict:
        doc = dataclasses.asdict(self)
        if doc["parity"] is not None:
            doc["parity"] = list(doc["parity"])
        return doc

    def _check(self, where: str) -> None:
        def bad(key, why):
            raise ConfigError(f"{where}: key {key!r}: {why}")

        if self.params <= 0 and self.state_bytes_per_rank is None:
            bad("params", "give the model's parameter count (or state_bytes_per_rank)")
        if self.forward_s is None:
            if self.params <= 0:
                bad("params", "needed to compute the forward time (or give forward_s)")
            if self.peak_flops is None:
                bad("peak_flops", "needed to compute the forward time (or give forward_s)")
            if self.utilization is None:
                bad("utilization", "needed to compute the forward time (or give forward_s)")
        else:
            _per_stage(self.forward_s, self.p, "forward_s", where)
        if self.backward_s is not None:
            _per_stage(self.backward_s, self.p, "backward_s", where)
        if self.optimizer_s is None:
            bad("optimizer_s", "give the optimizer-step time in seconds (0 to ignore it)")
        _per_stage(self.optimizer_s, self.p, "optimizer_s", where)
        if self.schedule == "interleaved":
            if self.v < 2:
                bad("v", f"the interleaved schedule needs at least 2 chunks per stage, got {self.v}")
            if self.m % self.p:
                bad("m", f"the interleaved schedule needs m a multiple of p={self.p}, got {self.m}")
        elif self.schedule == "dualpipev":
            if self.v != 1:
                bad("v", "dualpipev has its two chunks built in; leave v at 1")
            if self.m < 2 * self.p:
                bad("m", f"dualpipev needs m >= 2·p = {2 * self.p}, got {self.m}")
        elif self.v != 1:
            bad("v", f"schedule {self.schedule} has one chunk per stage; use schedule=interleaved for v={self.v}")
        if self.layers is not None and self.layers % (self.p * self.v):
            bad("layers", f"{self.layers} layers do not split evenly over p·v = {self.p * self.v} chunks")
        if (self.failures_per_day is None) == (self.mtbf_node_hours is None):
            bad("failures_per_day", "give exactly one of failures_per_day and mtbf_node_hours")
        if self.host_bw <= 0:
            bad("host_bw", "give the host-copy bandwidth in bytes/s")
        for key in ("disk_write_bw", "disk_read_bw"):
            if getattr(self, key) <= 0:
                bad(key, "give the disk bandwidth of the whole job in bytes/s")
        if self.parity is not None:
            _, n = self.parity
            if self.net_bw is None:
                bad("net_bw", "parity needs the network bandwidth per node in bytes/s")
            if n > self.nodes:
                bad("parity", f"a group of n={n} nodes needs at least {n} nodes; the job has {self.nodes}")


def _per_stage(value, stages: int, key: str, where: str = "scenario") -> list[float]:
    values = [float(value)] * stages if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(values) != stages:
        raise ConfigError(f"{where}: key {key!r}: {len(values)} entries for p={stages} stages")
    return values


def _parse_value(value):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _number(minimum=None, positive=False, maximum=None, integer=False, optional=False):
    def check(key, raw, where):
        if raw is None and optional:
            return None
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or (isinstance(raw, float) and not math.isfinite(raw)):
            raise ConfigError(f"{where}: key {key!r}: expected a number, got {raw!r}")
        if integer:
            if raw != int(raw):
                raise ConfigError(f"{where}: key {key!r}: expected a whole number, got {raw!r}")
            raw = int(raw)
        if positive and raw <= 0:
            raise ConfigError(f"{where}: key {key!r}: must be positive, got {raw!r}")
        if minimum is not None and raw < minimum:
            raise ConfigError(f"{where}: key {key!r}: must be at least {minimum}, got {raw!r}")
        if maximum is not None and raw > maximum:
            raise ConfigError(f"{where}: key {key!r}: must be at most {maximum}, got {raw!r}")
        return raw
    return check


def _text(key, raw, where):
    if not isinstance(raw, str):
        raise ConfigError(f"{where}: key {key!r}: expected a string, got {raw!r}")
    return raw


def _schedule(key, raw, where):
    if raw not in SCHEDULE_NAMES:
        raise ConfigError(f"{where}: key {key!r}: unknown schedule {raw!r}; valid: {', '.join(SCHEDULE_NAMES)}")
    return raw


def _times(key, raw, where):
    if raw is None:
        return None
    if isinstance(raw, tuple):
        raw = list(raw)
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise ConfigError(f"{where}: key {key!r}: expected a time in seconds or one per stage, got []")
    for item in items:
        _number(minimum=0)(key, item, where)
    return tuple(float(x) for x in raw) if isinstance(raw, list) else float(raw)


def _parity(key, raw, where):
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise ConfigError(f"{where}: key {key!r}: expected [k, n] (any k of n nodes rebuild), got {raw!r}")
    k, n = (_number(integer=True, minimum=1)(key, x, where) for x in raw)
    if not k < n:
        raise ConfigError(f"{where}: key {key!r}: need 1 <= k < n, got k={k}, n={n}")
    return (k, n)


_POS = _number(positive=True)
_POS_OPT = _number(positive=True, optional=True)
_NONNEG = _number(minimum=0)
_INT_POS = _number(integer=True, minimum=1)
_VALIDATORS = {
    "name": _text, "description": _text,
    "params": _NONNEG, "layers": _number(integer=True, minimum=1, optional=True),
    "hidden": _number(integer=True, minimum=1, optional=True),
    "seq_len": _INT_POS, "micro_batch_size": _INT_POS, "bytes_per_param": _POS,
    "state_bytes_per_rank": _POS_OPT,
    "p": _INT_POS, "m": _INT_POS, "v": _INT_POS, "schedule": _schedule, "dp": _INT_POS, "tp": _INT_POS,
    "accelerators_per_node": _INT_POS,
    "peak_flops": _POS_OPT, "utilization": _number(positive=True, maximum=1, optional=True),
    "forward_s": _times, "backward_s": _times, "backward_factor": _POS, "optimizer_s": _times, "p2p_s": _NONNEG,
    "host_bw": _POS, "net_bw": _POS_OPT, "parity": _parity,
    "disk_write_bw": _POS, "disk_read_bw": _POS, "disk_period_s": _POS_OPT,
    "failures_per_day": _number(minimum=0, optional=True), "mtbf_node_hours": _POS_OPT,
    "node_failure_fraction": _number(minimum=0, maximum=1),
    "restart_s": _NONNEG, "nccl_init_s": _NONNEG, "warmup_s": _NONNEG,
    "budget": _number(positive=True, maximum=1), "margin": _number(positive=True, maximum=1),
    "chunk_bytes": _INT_POS,
}


# --- presets and scenario files ------------------------------------------------------------

def preset_names() -> list[str]:
    """The bundled presets (baft/presets/*.json)."""
    return sorted(p.name[:-5] for p in resources.files("baft.presets").iterdir() if p.name.endswith(".json"))


def preset_document(name: str) -> dict:
    """A bundled preset's JSON, with its per-key source notes."""
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r}; valid: {', '.join(preset_names())}")
    return json.loads(resources.files("baft.presets").joinpath(f"{name}.json").read_text())


def load_preset(name: str) -> Scenario:
    return _from_document(preset_document(name), f"preset {name}")


def load_scenario(path) -> Scenario:
    """A scenario file: a preset-shaped document or a flat object of scenario keys."""
    from baft.jsonfile import read_json

    return _from_document(read_json(path), str(path))


def _from_document(doc: dict, where: str) -> Scenario:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if "scenario" not in doc:
        return Scenario.from_dict(doc, where)
    extra = set(doc) - {"name", "description", "source", "scenario"}
    if extra:
        raise ConfigError(f"{where}: unknown top-level key {min(extra)!r} (known: name, description, source, scenario)")
    body = dict(doc["scenario"]) if isinstance(doc["scenario"], dict) else doc["scenario"]
    if isinstance(body, dict):
        body.setdefault("name", doc.get("name", "custom"))
        body.setdefault("description", doc.get("description", ""))
    return Scenario.from_dict(body, where)


def scenario_sources(name: str) -> dict:
    """``{key: source note}`` of a preset (empty notes for keys given as plain values)."""
    body = preset_document(name)["scenario"]
    return {k: v.get("source", "") if isinstance(v, dict) else "" for k, v in body.items()}


# --- results --------------------------------------------------------------------------------

@dataclass
class StageResult:
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
        for p in self.policies:
            if p.policy == name:
                return p
        raise KeyError(name)

    def to_json(self) -> dict:
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


def _chunks(nbytes: float, chunk_bytes: int) -> list[int]:
    total = round(nbytes)
    size = max(chunk_bytes, -(-total // MAX_CHUNKS))
    full, rest = divmod(total, size)
    return [size] * full + ([rest] if rest else [])


def _memory_t0(period: float, t: float, bubble_aware: bool) -> float:
    """Expected rollback for an in-memory snapshot every ``period`` iterations of ``t`` s."""
    return (period / 2 + (1 if bubble_aware else 0)) * t


def _in_memory(name: str, s: Scenario, t: float, period: int, stall: float, flush: float,
               bubble_aware: bool, rate: float, restart: float, explore: bool = True) -> PolicyResult:
    overhead = stall / (period * t) if t > 0 else 0.0
    sw_t0 = _memory_t0(period, t, bubble_aware)
    mem_load = s.state_per_rank / s.host_bw
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
    bmap = analytic_bubble_map(s.schedule, s.p, s.m, s.costs(), chunks=s.v)
    t = bmap.makespan
    if t <= 0:
        raise ConfigError("scenario: key 'forward_s': the iteration takes no time; give positive compute times")
    chunks = _chunks(s.state_per_rank, s.chunk_bytes)
    plans = [plan_rank(bmap.stage_bubbles(stage), chunks, s.host_bw, t, rank=stage, stage=stage, margin=s.margin)
             for stage in range(s.p)]
    closed = (s.p - 1) / (s.v * s.m + s.p - 1)
    stages = [StageResult(stage, bmap.bubble_time(stage), bmap.bubble_time(stage) / t if t else 0.0, closed,
                          plans[stage].stall, plans[stage].bubble_used) for stage in range(s.p)]

    rate = s.failure_rate
    restart = s.restart_s + s.nccl_init_s + s.warmup_s
    copy = sum(chunks) / s.host_bw  # the bytes the planner packs (whole bytes)
    flush = s.checkpoint_bytes / s.disk_write_bw

    baft_period = choose_period(plans, s.budget)
    baft_stall = max(p.stall for p in plans)
    sync_period = max(1, math.ceil((copy / t) / s.budget - 1e-9)) if copy > 0 else 1  # as choose_period
    policies = [
        _in_memory("baft", s, t, baft_period, baft_stall, flush, True, rate, restart),
        _in_memory("sync-copy", s, t, sync_period, copy, flush, False, rate, restart),
    ]
    notes = []
    if rate > 0:
        young = math.sqrt(2 * flush * DAY / rate)
        policies.append(_disk("disk", s, t, young, "Young sqrt(2·δ·MTBF)", flush, rate, restart))
        if flush > DAY / rate / 2:
            notes.append("disk: the flush is not small against the MTBF; Young's period is only a rough optimum")
    else:
        notes.append("disk: no failures, so Young's period is unbounded; showing none")
    if s.disk_period_s is not None:
        policies.append(_disk("disk-fixed", s, t, s.disk_period_s, f"fixed every {_duration(s.disk_period_s)}",
                              flush, rate, restart))
    worst = max(plans, key=lambda plan: plan.stall)
    if worst.leftover_bytes:
        notes.append(f"baft: the bubbles of stage {worst.stage} (the tightest) hold "
                     f"{_bytes(worst.nbytes - worst.leftover_bytes)} of {_bytes(worst.nbytes)} at {s.margin:.0%} "
                     f"of their length; {_duration(worst.stall)} stall per snapshot")
    if baft_period > 1:
        notes.append(f"baft snapshots every {baft_period} iterations to stay within {s.budget:.0%}")
    for policy in policies:
        young = policy.detail.get("young")
        if young and young["lost_per_day"] < 0.8 * policy.lost_per_day:
            notes.append(f"{policy.policy}: failures are rare enough that snapshotting every {young['period']} "
                         f"iterations (Young's period for its {_duration(policy.stall_per_snapshot)} stall) "
                         f"would lose {_duration(young['lost_per_day'])} a day instead of "
                         f"{_duration(policy.lost_per_day)}")
    if s.parity is None and s.node_failure_fraction > 0:
        notes.append("no parity group: node failures restore the in-memory policies from their background disk copy")
    fwd, bwd = s.stage_forward()[0], s.stage_backward()[0]
    return Result(s, bmap, t, fwd, bwd, s.state_per_rank, s.checkpoint_bytes, copy, flush, rate, stages,
                  policies, plans, notes)


def parse_overrides(items) -> dict:
    """``["key=value", ...]`` (the CLI's ``--set``) as a dict; values parsed as JSON where possible."""
    values = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        values[key.strip()] = _parse_value(value.strip())
    return values


def run(preset: str | None = None, scenario_file=None, overrides: dict | None = None) -> Result:
    """Load a preset or scenario file (exactly one), apply overrides, simulate.

    ``overrides`` values may be strings as typed on the command line (``"16"``, ``"[3, 4]"``,
    ``"interleaved"``): they are parsed as JSON where they can be.
    """
    if (preset is None) == (scenario_file is None):
        raise ConfigError("simulate: give exactly one of --preset NAME or --scenario FILE")
    scenario = load_preset(preset) if preset is not None else load_scenario(scenario_file)
    return simulate_scenario(scenario.with_overrides(overrides))


# --- rendering ------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    if math.isnan(seconds) or math.isinf(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _rate(bw: float | None) -> str:
    return "-" if bw is None else f"{bw / 1e9:.1f} GB/s"


def tables(result: Result):
    """The result as rich tables: scenario summary, per-stage bubbles, policies."""
    from rich.table import Table

    s = result.scenario
    summary = Table(title=f"{s.name}: {s.description}" if s.description else s.name, show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    size = f"{_count(s.params)} parameters" if s.params else "given state size"
    summary.add_row("model", f"{size}, {s.tokens_per_microbatch} tokens per micro-batch")
    summary.add_row("layout", f"p={s.p} m={s.m} v={s.v} {s.schedule}, tp={s.tp}, dp={s.dp}: "
                              f"{s.accelerators} accelerators on {s.nodes} node(s)")
    summary.add_row("per micro-batch", f"forward {_duration(result.forward_s)}, backward {_duration(result.backward_s)} "
                                       f"(stage 0)")
    summary.add_row("iteration", _duration(result.iteration_time))
    summary.add_row("state per rank", f"{_bytes(result.state_per_rank)} (checkpoint {_bytes(result.checkpoint_bytes)})")
    summary.add_row("copy per snapshot", f"{_duration(result.copy_time)} at {_rate(s.host_bw)}")
    summary.add_row("disk flush", f"{_duration(result.flush_time)} at {_rate(s.disk_write_bw)}")
    summary.add_row("failures", f"{result.failures_per_day:.3g} per day "
                                f"({s.node_failure_fraction:.0%} lose a node)")
    parity = f"{s.parity[0]} of {s.parity[1]} nodes over {_rate(s.net_bw)}" if s.parity else "none"
    summary.add_row("parity", parity)

    stages = Table(title="bubbles per stage")
    for col in ("stage", "bubble / iter", "bubble", "closed form", "baft stall", "bubble used"):
        stages.add_column(col, justify="right")
    for x in result.stages:
        stages.add_row(str(x.stage), _duration(x.bubble_time), f"{x.bubble_fraction:.1%}", f"{x.closed_form:.1%}",
                       _duration(x.stall) if x.stall else "0", f"{x.bubble_used:.0%}")

    policies = Table(title="policies")
    for col in ("policy", "period", "rule", "overhead", "T0", "T1+T2+T4", "T3", "lost / failure", "lost / day"):
        policies.add_column(col, justify="left" if col in ("policy", "rule") else "right")
    for x in result.policies:
        iters = f"{x.period_iterations:.0f} it" if x.period_iterations < 1e4 else f"{x.period_iterations:.3g} it"
        policies.add_row(x.policy, f"{iters} ({_duration(x.period_s)})", x.period_rule, f"{x.overhead:.2%}",
                         _duration(x.t0), _duration(x.t1 + x.t2 + x.t4), _duration(x.t3),
                         _duration(x.lost_per_failure), _duration(x.lost_per_day))
    return summary, stages, policies


def render(result: Result, width: int = 140) -> str:
    """The result as plain text (tables and notes), for ``click.echo``."""
    from rich.console import Console

    console = Console(width=width, record=True, file=_Null(), color_system=None)
    for table in tables(result):
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    return console.export_text().rstrip()


class _Null:
    def write(self, _):
        return 0

    def flush(self):
        pass


# --- against measurements -------------------------------------------------------------------

@dataclass
class Comparison:
    """Predicted against measured, per stage and for the overhead (:func:`compare_to_measured`)."""

    schedule: str
    stages: int
    micro_batches: int
    rows: list[dict]
    overhead: dict

    def table(self):
        from rich.table import Table

        table = Table(title=f"simulator against measured ({self.schedule}, p={self.stages}, m={self.micro_batches})")
        for col in ("stage", "iteration meas.", "iteration pred.", "bubble meas.", "bubble pred.",
                    "fraction meas.", "fraction pred."):
            table.add_column(col, justify="right")
        for r in self.rows:
            table.add_row(str(r["stage"]), _duration(r["iteration_measured"]), _duration(r["iteration_predicted"]),
                          _duration(r["bubble_measured"]), _duration(r["bubble_predicted"]),
                          f"{r['fraction_measured']:.1%}", f"{r['fraction_predicted']:.1%}")
        o = self.overhead
        measured = "not given" if o["measured"] is None else f"{o['measured']:.2%}"
        table.caption = (f"baft overhead: measured {measured}, predicted {o['predicted']:.2%} "
                         f"(period {o['period']}); a synchronous copy would cost {o['sync_copy']:.1%}")
        return table

    def __rich__(self):
        return self.table()

    def render(self, width: int = 120) -> str:
        from rich.console import Console

        console = Console(width=width, record=True, file=_Null(), color_system=None)
        console.print(self.table())
        return console.export_text().rstrip()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _measured_inputs(bmap: BubbleMap):
    from baft.pipeline.profiler import measured_costs  # imports torch: only when comparing

    if not bmap.ranks:
        raise ConfigError("compare_to_measured: the bubble map has no per-rank profiles; give one `baft profile` wrote")
    costs = measured_costs(bmap.ranks, bmap.stages, bmap.optimizer_sync)
    profiles = {s: bmap.rank_profile(s) or next(r for r in bmap.ranks if r.stage == s) for s in range(bmap.stages)}
    return costs, profiles


def compare_to_measured(bmap: BubbleMap, measured_overhead: float | None = None,
                        budget: float = DEFAULT_BUDGET, margin: float = DEFAULT_MARGIN) -> Comparison:
    """Feed a measured bubble map's per-op costs through the simulator's model, side by side.

    The measured forward, backward, optimizer and send times (medians per stage, as the
    profiler reduces them) go through the same timeline; each stage's measured state size and
    copy bandwidth go through the same planner. ``measured_overhead`` (fraction of iteration
    time a baft run actually lost) is shown beside the predicted one when given.
    """
    costs, profiles = _measured_inputs(bmap)
    pred = analytic_bubble_map(bmap.schedule, bmap.stages, bmap.micro_batches, costs, chunks=bmap.chunks)
    t = pred.makespan
    rows, plans = [], []
    dp = max(1, bmap.data_parallel)
    for stage in range(bmap.stages):
        prof = profiles[stage]
        nbytes = math.ceil((prof.state_bytes.parameters + prof.state_bytes.optimizer) / dp)
        plans.append(plan_rank(pred.stage_bubbles(stage), _chunks(nbytes, 1 << 20), prof.copy_bandwidth, t,
                               rank=prof.rank, stage=stage, margin=margin))
        rows.append({"stage": stage,
                     "iteration_measured": bmap.iteration_time(stage), "iteration_predicted": t,
                     "bubble_measured": bmap.bubble_time(stage), "bubble_predicted": pred.bubble_time(stage),
                     "fraction_measured": bmap.bubble_fraction(stage),
                     "fraction_predicted": pred.bubble_time(stage) / t if t else 0.0,
                     "state_bytes": nbytes, "copy_bandwidth": prof.copy_bandwidth})
    period = choose_period(plans, budget)
    predicted = max(p.overhead_per_snapshot for p in plans) / period
    sync = max(p.nbytes / p.bandwidth for p in plans) / t if t else 0.0
    return Comparison(bmap.schedule, bmap.stages, bmap.micro_batches, rows,
                      {"measured": measured_overhead, "predicted": predicted, "period": period, "sync_copy": sync})


def scenario_from_measured(bmap: BubbleMap, base: Scenario) -> Scenario:
    """``base`` with the layout, per-op costs, state size and copy bandwidth a profile measured."""
    costs, profiles = _measured_inputs(bmap)
    v = max(1, bmap.chunks)
    doc = base.to_dict()
    doc.update({
        "p": bmap.stages, "m": bmap.micro_batches, "v": v, "schedule": bmap.schedule,
        "dp": max(1, bmap.data_parallel), "tp": 1,
        "forward_s": [f * v for f in costs.per_stage("forward", bmap.stages)],
        "backward_s": [b * v for b in costs.per_stage("backward", bmap.stages)],
        "optimizer_s": costs.per_stage("optimizer", bmap.stages), "p2p_s": costs.p2p,
        "state_bytes_per_rank": max(math.ceil((p.state_bytes.parameters + p.state_bytes.optimizer)
                                              / max(1, bmap.data_parallel)) for p in profiles.values()),
        "host_bw": statistics.median(p.copy_bandwidth for p in profiles.values()),
        "layers": None,
        "description": f"{base.description} (costs measured by baft profile)",
    })
    return Scenario.from_dict(doc, "measured bubble map")


# --- command line ---------------------------------------------------------------------------

def main(argv=None) -> int:
    """``python -m baft.simulate [--preset NAME | --scenario FILE] [--set key=value ...] [--json]``."""
    parser = argparse.ArgumentParser(prog="baft simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    parser.add_argument("--scenario", help="a scenario JSON file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = run(args.preset, args.scenario, parse_overrides(args.overrides))
    except BaftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result))
    return 0
