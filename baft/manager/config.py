"""What a snapshot manager is told: its node, parity group, persistence and memory limit.

:class:`ManagerConfig` is the validated form of ``python -m baft.manager``'s command line
(:func:`parse_args`); :func:`memory_needed` is the host memory such a manager holds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from baft.config import DEFAULT_SHM_ROOT, node_dir
from baft.errors import BaftError
from baft.manager import erasure
from baft.manager.protocol import check_socket_path, socket_path
from baft.snapshot import slots

SHARE_STEPS_KEPT = 2  # an origin may die mid-distribution: the step before stays rebuildable


@dataclass(frozen=True)
class Member:
    """One manager of a parity group, reachable at ``host:port``."""

    node_id: int
    host: str
    port: int

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def __str__(self) -> str:
        return f"{self.node_id}@{self.host}:{self.port}"


def parse_group(text: str) -> tuple[Member, ...]:
    """``host:port,...`` (node ids 0, 1, ... in order) or ``ID@host:port,...``."""
    members = []
    for i, item in enumerate(p.strip() for p in text.split(",")):
        node, _, address = item.rpartition("@")
        host, _, port = address.rpartition(":")
        try:
            node_id = int(node) if node else i
            port_no = int(port)
        except ValueError:
            raise BaftError(f"--group: {item!r} is not host:port or ID@host:port") from None
        if not host or not 0 < port_no < 65536:
            raise BaftError(f"--group: {item!r} is not host:port or ID@host:port")
        members.append(Member(node_id, host, port_no))
    ids = [m.node_id for m in members]
    if len(set(ids)) != len(ids):
        raise BaftError(f"--group: node id {next(i for i in ids if ids.count(i) > 1)} is listed twice")
    return tuple(members)


def parse_bytes(text: str) -> int:
    """``123``, ``512M``, ``8G``, ``1.5T`` (powers of 1024) as bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise BaftError(f"--memory-limit: {text!r} is not a byte count (like 512M or 8G)") from None


def human(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TB"


@dataclass
class ManagerConfig:
    """Everything ``python -m baft.manager`` takes on its command line."""

    node_id: int
    shm_root: Path
    dir: Optional[Path] = None
    group: tuple[Member, ...] = ()
    parity_k: Optional[int] = None
    persist_every: Optional[int] = None
    persist_seconds: Optional[float] = None
    keep: int = 3
    memory_limit: Optional[int] = None

    @property
    def n(self) -> int:
        return len(self.group)

    @property
    def k(self) -> Optional[int]:
        return self.parity_k if self.group else None

    @property
    def me(self) -> Optional[Member]:
        return next((m for m in self.group if m.node_id == self.node_id), None)

    @property
    def persists_on_schedule(self) -> bool:
        """Whether snapshots go to ``dir`` while the run trains (``dir`` alone: the newest, at a clean stop)."""
        return self.dir is not None and (self.persist_every is not None or self.persist_seconds is not None)

    def validate(self) -> "ManagerConfig":
        """Check the configuration; a one-line BaftError naming the flag otherwise."""
        self.shm_root = Path(self.shm_root)
        self.dir = Path(self.dir) if self.dir is not None else None
        if not isinstance(self.node_id, int) or self.node_id < 0:
            raise BaftError(f"--node-id {self.node_id!r}: must be a non-negative integer")
        if self.group:
            ids = [m.node_id for m in self.group]
            if self.node_id not in ids:
                raise BaftError(f"--node-id {self.node_id}: not a member of --group (members {', '.join(map(str, ids))})")
            if len(self.group) < 2:
                raise BaftError(f"--group: {len(self.group)} member; a parity group needs at least 2")
            if self.parity_k is None:
                self.parity_k = self.n - 1
            if not 1 <= self.parity_k < self.n or self.n > erasure.MAX_SHARES:
                raise BaftError(f"--parity-k {self.parity_k}: must be at least 1 and below the group size {self.n} "
                                f"(and the group at most {erasure.MAX_SHARES})")
        elif self.parity_k is not None:
            raise BaftError(f"--parity-k {self.parity_k}: needs --group (the managers that hold the parity)")
        if self.persist_every is not None and self.persist_every < 1:
            raise BaftError(f"--persist-every {self.persist_every}: must be at least 1")
        if self.persist_seconds is not None and self.persist_seconds <= 0:
            raise BaftError(f"--persist-seconds {self.persist_seconds}: must be positive")
        if (self.persist_every is not None or self.persist_seconds is not None) and self.dir is None:
            raise BaftError("--persist-every/--persist-seconds: need --dir (where to persist)")
        if self.keep < 1:
            raise BaftError(f"--keep {self.keep}: must keep at least 1 persisted snapshot")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise BaftError(f"--memory-limit {self.memory_limit}: must be positive")
        check_socket_path(socket_path(self.shm_root))
        return self

    def argv(self) -> list[str]:
        """The command-line arguments that give this configuration back."""
        out = ["--node-id", str(self.node_id), "--shm-root", str(self.shm_root)]
        if self.dir is not None:
            out += ["--dir", str(self.dir)]
        if self.group:
            out += ["--group", ",".join(str(m) for m in self.group)]
        if self.parity_k is not None:
            out += ["--parity-k", str(self.parity_k)]
        if self.persist_every is not None:
            out += ["--persist-every", str(self.persist_every)]
        if self.persist_seconds is not None:
            out += ["--persist-seconds", str(self.persist_seconds)]
        out += ["--keep", str(self.keep)]
        if self.memory_limit is not None:
            out += ["--memory-limit", str(self.memory_limit)]
        return out

    def signature(self) -> dict:
        """What every member of a group must agree on."""
        return {"k": self.k, "n": self.n, "members": [str(m) for m in self.group]}


def memory_needed(rank_bytes: Iterable[int], k: Optional[int] = None, n: int = 0,
                  slot_counts: Optional[Iterable[int]] = None) -> int:
    """Host memory a manager needs for ranks of these snapshot sizes.

    ``slot_counts`` slot files per rank (``SLOTS`` each by default); with parity, the shares it
    keeps of every member's bundle for its ``SHARE_STEPS_KEPT`` newest steps and as many steps
    common to the group (members' bundles taken to be as large as its own), plus one encode in
    flight (the bundle and its ``n`` shares).
    """
    rank_bytes = list(rank_bytes)
    counts = list(slot_counts) if slot_counts is not None else [slots.SLOTS] * len(rank_bytes)
    local = sum(rank_bytes)
    total = sum(c * b for c, b in zip(counts, rank_bytes))
    if k:
        share = erasure.share_size(local, k)
        total += 2 * SHARE_STEPS_KEPT * n * share + local + n * share
    return total


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BaftError(f"baft manager: {message}")


def parse_args(argv: Optional[list[str]] = None) -> ManagerConfig:
    """The configuration of ``python -m baft.manager ARGS``, validated (one-line BaftError otherwise)."""
    parser = _Parser(prog="python -m baft.manager", description="baft per-node snapshot manager")
    parser.add_argument("--node-id", type=int, required=True)
    parser.add_argument("--shm-root", type=Path, help="shared-memory directory of this node's snapshots")
    parser.add_argument("--dir", type=Path, help="where to persist snapshots")
    parser.add_argument("--group", help="parity group members: host:port,... or ID@host:port,...")
    parser.add_argument("--parity-k", type=int, help="data shares of the group's code (default n-1)")
    parser.add_argument("--persist-every", type=int, metavar="N")
    parser.add_argument("--persist-seconds", type=float, metavar="T")
    parser.add_argument("--keep", type=int, default=3, metavar="R")
    parser.add_argument("--memory-limit", metavar="BYTES")
    args = parser.parse_args(argv)
    config = ManagerConfig(
        node_id=args.node_id,
        shm_root=args.shm_root or node_dir(DEFAULT_SHM_ROOT, args.node_id),
        dir=args.dir,
        group=parse_group(args.group) if args.group else (),
        parity_k=args.parity_k,
        persist_every=args.persist_every,
        persist_seconds=args.persist_seconds,
        keep=args.keep,
        memory_limit=parse_bytes(args.memory_limit) if args.memory_limit is not None else None,
    )
    return config.validate()
