"""The ``"baft"`` section of a DeepSpeed config: every key, its default, and its validation."""

from __future__ import annotations

import difflib
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

from baft.errors import ConfigError

# what `baft profile` and `baft train --trace` tell the ranks they launch
PROFILE_DIR_ENV = "BAFT_PROFILE_DIR"
PROFILE_ITERS_ENV = "BAFT_PROFILE_ITERS"
TRACE_DIR_ENV = "BAFT_TRACE_DIR"  # every rank writes its run trace there
# what `baft train -- script` tells the script's ranks, by the "baft" section's key it stands for (baft.plugin)
LAUNCHER_ENV = {"run_id": "BAFT_RUN_ID", "shm_root": "BAFT_SHM_ROOT", "run_dir": "BAFT_RUN_DIR"}
# In-place recovery (baft.recovery.world): how many killed ranks of a job the server replaces (the launcher's
# budget), the c10d store where survivors and replacements meet (the server's), and the mark of a replacement.
REPLACE_ENV = "BAFT_REPLACE_RANKS"
STORE_ENV = "BAFT_STORE"
REPLACEMENT_ENV = "BAFT_REPLACEMENT"
GENERATION_ENV = "BAFT_GENERATION"  # the world a job that recovers in place is in
ROUND_ENV = "BAFT_RENDEZVOUS_ROUND"  # the rendezvous round baft's torchrun (baft.cli.torchrun) started the ranks in
SPARES_ENV = "BAFT_SPARES"  # spare processes a job that recovers in place keeps (baft.warm.spares)
WARM_RANK_ENV = "BAFT_WARM_RANK"  # "1" in a rank forked from the warm server (the recovery record's "warm relaunch")

DEFAULT_SHM_ROOT = "/dev/shm/baft"  # the top shared-memory directory: <top>/<run_id>/node<N> per node (node_root)
DEFAULT_CHUNK_BYTES = 1 << 20  # bytes of a snapshot's chunk, each checksummed and copied in one piece
POLICIES = ("none", "baft", "sync-copy", "thread-copy", "deepspeed", "torch-save", "dcp-async")
IN_MEMORY = ("baft", "sync-copy", "thread-copy")  # the policies whose snapshots a node's manager keeps
# how baft copies in a bubble: while the host waits in a receive (CPU), or queued on a copy stream
# (a CUDA side stream; on CPU a thread); "auto": the stream where the state is on a GPU
EXECUTORS = ("auto", "receive", "stream")
LEFTOVERS = ("fence", "start")
LOOPS = ("auto", "calls", "steps")
TIMEOUTS = ("hang_timeout", "progress_timeout")  # what a rank's heartbeat asks its node's manager to enforce
MIN_TIMEOUT = 1.0  # a rank beats about once a second and the manager looks twice a second: less would kill on noise


@dataclass(frozen=True)
class PersistConfig:
    every: int = 0  # persist every N-th committed snapshot (0: never, unless seconds is set)
    seconds: float = 0.0  # or every T seconds
    dir: Optional[str] = None
    keep: int = 2


@dataclass(frozen=True)
class ParityConfig:
    group: tuple[str, ...] = ()  # host:port of every manager of the group, in node-id order
    k: int = 1  # data shares needed to rebuild; the group tolerates len(group) - k lost nodes


@dataclass(frozen=True)
class BaftConfig:
    """Validated ``"baft"`` section. See README.rst for the table of keys."""

    enabled: bool = True
    policy: str = "baft"
    schedule: str = "1f1b"
    bubble_map: Optional[str] = None
    plan: Optional[str] = None
    period: Union[int, str] = "auto"
    executor: str = "auto"
    leftovers: str = "fence"  # stream executor: where the chunks no bubble holds are queued
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shm_root: str = DEFAULT_SHM_ROOT
    run_id: str = "default"
    node_id: Optional[int] = None  # this process's node; default rank // ranks_per_node
    ranks_per_node: Optional[int] = None  # default: torchrun's LOCAL_WORLD_SIZE (all local ranks share a node)
    require_manager: bool = False
    memory_limit: Optional[int] = None  # bytes of host memory snapshots may hold on this node
    persist: PersistConfig = field(default_factory=PersistConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    # may a start that finds no snapshot of this run begin at step 0? "always": even when it finds
    # snapshots but can restore none of them (their progress is then dropped, loudly)
    fresh_start: Union[bool, str] = True
    run_dir: Optional[str] = None  # where restarts append recovery.jsonl
    save_dir: Optional[str] = None  # checkpoint directory of the disk baselines (deepspeed, torch-save, dcp-async)
    adopt: Optional[str] = None  # a DeepSpeed checkpoint directory the run's first start loads (no snapshot yet)
    # seconds a rank's heartbeat may be silent (stopped, frozen) before its node's manager kills it (None: never)
    hang_timeout: Optional[float] = 60.0
    # seconds every rank of a node may spend in training steps none of them finishes (a stuck collective)
    progress_timeout: Optional[float] = 600.0
    # how the script's loop over train_batch resumes (baft.script.loop): "auto" reads it from the source;
    # "calls": it counts its calls from 0, so a resumed process replays those before the restored step;
    # "steps": it stops on the engine's step
    loop: str = "auto"


def _check_type(key: str, value, expected) -> None:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if expected is int and isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"baft.{key}: expected {names.get(expected, expected.__name__)}, got {value!r}")


def _section(cls, doc: dict, prefix: str):
    if not isinstance(doc, dict):
        raise ConfigError(f"{prefix}: expected an object, got {doc!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
    return known


def _field_type(key: str) -> tuple[type, bool]:
    """The type a BaftConfig key takes, and whether null is allowed."""
    hint = typing.get_type_hints(BaftConfig)[key]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    return (args[0] if args else hint), optional


def parse_config(ds_config: Optional[dict]) -> BaftConfig:
    """The ``"baft"`` section of a DeepSpeed config dict, validated; disabled when absent."""
    doc = (ds_config or {}).get("baft")
    if doc is None and "baft" in (ds_config or {}):
        raise ConfigError("baft: expected a section (an object of baft's keys, {} for the defaults), got null")
    if doc is None:
        keys = {k.lower(): k for k in ds_config or {} if isinstance(k, str)}
        near = difflib.get_close_matches("baft", keys, n=1, cutoff=0.75)
        if near:  # "bafts", "Baft": the run would be unprotected without a word
            raise ConfigError(f"{keys[near[0]]!r}: not a DeepSpeed key; did you mean \"baft\"? (without a \"baft\" "
                              f"section baft takes no snapshots)")
        return BaftConfig(enabled=False)
    _section(BaftConfig, doc, "baft")
    values = {}
    for key, value in doc.items():
        if key == "persist":
            _section(PersistConfig, value, "baft.persist")
            for k, v in value.items():
                _check_type(f"persist.{k}", v, {"every": int, "seconds": float, "dir": str, "keep": int}[k])
            values[key] = PersistConfig(**value)
        elif key == "parity":
            _section(ParityConfig, value, "baft.parity")
            group = tuple(value.get("group", ()))
            if not all(isinstance(g, str) and ":" in g for g in group):
                raise ConfigError(f"baft.parity.group: expected a list of \"host:port\" strings, got {group!r}")
            k = value.get("k", 1)
            _check_type("parity.k", k, int)
            if group and not 1 <= k < len(group):
                raise ConfigError(f"baft.parity.k: must be at least 1 and less than the group size {len(group)}, got {k}")
            values[key] = ParityConfig(group, k)
        elif key == "period":
            if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"baft.period: expected \"auto\" or an integer >= 1, got {value!r}")
            values[key] = value
        elif key == "fresh_start":
            if value not in (True, False, "always"):
                raise ConfigError(f"baft.fresh_start: expected true, false or \"always\", got {value!r}")
            values[key] = value
        elif key in TIMEOUTS:
            values[key] = _timeout(key, value)
        elif key == "memory_limit":
            if value is not None:
                _check_type(key, value, int)
            values[key] = value
        else:
            expected, optional = _field_type(key)
            if not (optional and value is None):
                _check_type(key, value, expected)
            values[key] = value
    cfg = BaftConfig(**values)
    if cfg.policy not in POLICIES:
        raise ConfigError(f"baft.policy: unknown policy {cfg.policy!r} (one of {', '.join(POLICIES)})")
    if cfg.executor not in EXECUTORS:
        raise ConfigError(f"baft.executor: expected one of {', '.join(EXECUTORS)}, got {cfg.executor!r}")
    if cfg.leftovers not in LEFTOVERS:
        raise ConfigError(f"baft.leftovers: expected one of {', '.join(LEFTOVERS)}, got {cfg.leftovers!r}")
    if cfg.loop not in LOOPS:
        raise ConfigError(f"baft.loop: expected one of {', '.join(LOOPS)}, got {cfg.loop!r}")
    if cfg.chunk_bytes < 4096:
        raise ConfigError(f"baft.chunk_bytes: must be at least 4096, got {cfg.chunk_bytes}")
    if (cfg.persist.every or cfg.persist.seconds) and not cfg.persist.dir:
        raise ConfigError("baft.persist.dir: required when persist.every or persist.seconds is set")
    if cfg.persist.keep < 1:
        raise ConfigError(f"baft.persist.keep: must be at least 1, got {cfg.persist.keep}")
    _check_bounds(cfg)
    return cfg


def _check_bounds(cfg: BaftConfig) -> None:
    """Refuse the values no run can mean (before, a negative ``node_id`` kept the snapshots in a node root no manager
    serves, left in shared memory after the run; a ``run_id`` with a slash put them outside the run's directory)."""
    least = {"node_id": 0, "ranks_per_node": 1, "memory_limit": 1, "persist.every": 0, "persist.seconds": 0}
    values = {"node_id": cfg.node_id, "ranks_per_node": cfg.ranks_per_node, "memory_limit": cfg.memory_limit,
              "persist.every": cfg.persist.every, "persist.seconds": cfg.persist.seconds}
    for key, value in values.items():
        if value is not None and value < least[key]:
            raise ConfigError(f"baft.{key}: must be at least {least[key]}, got {value!r}")
    if cfg.run_id in ("", ".", "..") or "/" in cfg.run_id:
        raise ConfigError(f"baft.run_id: expected a name (no '/'), got {cfg.run_id!r}")


def _timeout(key: str, value) -> Optional[float]:
    """A timeout in seconds: 0 or null turn it off (None), anything else must be at least a second."""
    if value is not None:
        _check_type(key, value, float)
    if not value:
        return None
    if value < MIN_TIMEOUT:
        raise ConfigError(f"baft.{key}: expected 0 or null (off) or at least {MIN_TIMEOUT:g} second, got {value!r}")
    return float(value)


def node_root(top, run_id: str, node: int) -> Path:
    """The shared-memory root of a run's node (its manager's ``shm_root``, its ranks' slots): ``top/run_id/node<N>``,
    ``top`` being the config's ``shm_root``. Ranks and their manager meet only where they spell it alike."""
    return node_dir(Path(top) / run_id, node)


def node_dir(parent, node: int) -> Path:
    """A node's own directory under ``parent``: ``parent/node<N>`` (its shared-memory root, its persisted
    snapshots)."""
    return Path(parent) / f"node{node}"


def node_of(cfg: BaftConfig, rank: int) -> int:
    """The node whose manager keeps ``rank``'s snapshots. With ``node_id`` set, a process's config names
    its own node only: ``rank`` must be this process's (other ranks' nodes are gathered from them)."""
    if cfg.node_id is not None:
        return cfg.node_id
    per_node = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1 << 30
    return rank // per_node


def parse_policies(text: str) -> list[tuple[str, str, int | None]]:
    """``none,deepspeed/10,baft`` as (name, kind, period); period None: baft's planner chooses."""
    out = []
    for name in text.split(","):
        kind, _, period = name.partition("/")
        if kind not in POLICIES:
            raise ConfigError(f"--policies: unknown policy {kind!r} (known: {', '.join(POLICIES)})")
        if period and not (period.isdigit() and int(period) >= 1):
            raise ConfigError(f"--policies: {name!r}: the period after '/' must be a whole number of steps")
        out.append((name, kind, int(period) if period else (None if kind == "baft" else 1)))
    if len({n for n, _, _ in out}) < len(out):
        raise ConfigError(f"--policies: {text!r} names a policy twice")
    return out
