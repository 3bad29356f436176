"""The simulator's input: a :class:`Scenario` (a training job and its hardware), validated key by key.

A scenario comes from a bundled preset (``baft/presets/*.json``, each figure with its source
note), from a scenario file, or from :meth:`Scenario.from_dict`; ``--set key=value``
overrides (:func:`parse_overrides`, :meth:`Scenario.with_overrides`) change single keys. A bad
key raises a one-line :class:`~baft.errors.ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

from baft.errors import ConfigError
from baft.pipeline.timeline import Costs
from baft.snapshot.planner import DEFAULT_BUDGET, DEFAULT_MARGIN

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved", "dualpipev")


@dataclass(frozen=True)
class Scenario:
    """A training job and its hardware, in SI units (seconds, bytes, bytes/s, FLOP/s).

    Build it with :meth:`from_dict` (or :func:`load_scenario`, :func:`load_preset`): every
    key is validated and a bad one raises a one-line :class:`~baft.errors.ConfigError`
    naming it. See :mod:`baft.simulate.model` for the formulas and docs/simulator.rst for the keys.
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
    node_host_bw: float | None = None  # the node's host memory bandwidth that its ranks' copies share
    switch_bw: float | None = None  # a PCIe switch's uplink to the host, shared by ranks_per_switch ranks
    ranks_per_switch: int = 1
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
    def copy_bw(self) -> float:
        """Bytes/s one rank copies to the host while every rank of its node copies at once: its own link
        (``host_bw``), its share of its PCIe switch's uplink and its share of the node's host memory."""
        shares = [self.host_bw]
        if self.switch_bw is not None:
            shares.append(self.switch_bw / min(self.ranks_per_switch, self.ranks_per_node))
        if self.node_host_bw is not None:
            shares.append(self.node_host_bw / self.ranks_per_node)
        return min(shares)

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
        """Forward time of one micro-batch through each whole stage (all its model chunks)."""
        if self.forward_s is not None:
            return _per_stage(self.forward_s, self.p, "forward_s")
        flops = 2.0 * (self.params / self.p) * self.tokens_per_microbatch
        return [flops / (self.tp * self.peak_flops * self.utilization)] * self.p

    def stage_backward(self) -> list[float]:
        """Backward time of one micro-batch through each whole stage (all its model chunks)."""
        if self.backward_s is not None:
            return _per_stage(self.backward_s, self.p, "backward_s")
        return [self.backward_factor * f for f in self.stage_forward()]

    def costs(self) -> Costs:
        """Per-op costs for the timeline: one model chunk of one stage, one micro-batch."""
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
        """The scenario's keys and plain values, as :meth:`from_dict` takes them."""
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
                bad("v", f"the interleaved schedule needs at least 2 model chunks per stage, got {self.v}")
            if self.m % self.p:
                bad("m", f"the interleaved schedule needs m a multiple of p={self.p}, got {self.m}")
        elif self.schedule == "dualpipev":
            if self.v != 1:
                bad("v", "dualpipev has its two model chunks built in; leave v at 1")
            if self.m < 2 * self.p:
                bad("m", f"dualpipev needs m >= 2·p = {2 * self.p}, got {self.m}")
        elif self.v != 1:
            bad("v", f"schedule {self.schedule} has one model chunk per stage; use schedule=interleaved for v={self.v}")
        if self.layers is not None and self.layers % (self.p * self.v):
            bad("layers", f"{self.layers} layers do not split evenly over p·v = {self.p * self.v} model chunks")
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
    "host_bw": _POS, "node_host_bw": _POS_OPT, "switch_bw": _POS_OPT, "ranks_per_switch": _INT_POS,
    "net_bw": _POS_OPT, "parity": _parity,
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
    """A bundled preset (:func:`preset_names`) as a validated scenario."""
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


# --- command-line overrides ----------------------------------------------------------------

def parse_overrides(items) -> dict:
    """``["key=value", ...]`` (the CLI's ``--set``) as a dict; values parsed as JSON where possible."""
    values = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        values[key.strip()] = _parse_value(value.strip())
    return values
