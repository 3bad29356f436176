"""A manager's part in its parity group: distribute shares of its bundles, hold the members', rebuild a lost node's.

With ``--group`` of ``n`` managers and ``--parity-k k``, each manager encodes the bundle of
a step all its ranks have committed (:mod:`baft.manager.erasure`) into ``n`` shares and
sends one to each member, keeping its own; it holds the shares the others send, for the
``SHARE_STEPS_KEPT`` newest steps of each. Any ``k`` members' shares rebuild a node's
bundle, checked end to end against the checksum it was sent with.

A restore needs one step at which every node's snapshot can be had. A manager that cannot
keep up with the trainers skips steps, and managers lag by different amounts, so each takes
a step another member has encoded first, else the roundest step
(:meth:`ParityGroup.step_to_encode`), and keeps, beside each member's newest steps, the
newest steps it holds a share of from every member (:meth:`ParityGroup.common_steps`): a node
lost while its manager lagged is rebuilt at such a step, which the other nodes rebuild from
parity too.

Members speak the requests of :mod:`baft.manager.protocol` over TCP; each request carries
the sender's view of the group and is refused when it differs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from baft.errors import BaftError
from baft.manager import erasure
from baft.manager.config import SHARE_STEPS_KEPT, ManagerConfig, Member, human
from baft.manager.protocol import ManagerClient, ManagerUnavailable
from baft.manager.ranks import NodeRanks

log = logging.getLogger("baft.manager")

PEER_TIMEOUT = 30.0


@dataclass
class Share:
    """One share of a node's bundle of one step, with what the bundle is (size, checksum, ranks)."""

    index: int
    size: int
    checksum: str
    ranks: list[int]
    data: erasure.Buffer


@dataclass
class ParityState:
    """How the distribution of this node's bundles went."""

    acked: dict[int, list[int]] = field(default_factory=dict)  # step → members holding a share of our bundle
    errors: dict[int, str] = field(default_factory=dict)  # member → last failure
    encoded_step: int = -1
    encode_seconds: float = 0.0


def _kept(held: dict[int, Share], common: set[int]) -> dict[int, Share]:
    """Of one origin's shares by step, those kept: the ``SHARE_STEPS_KEPT`` newest and the group's common steps."""
    keep = set(sorted(held)[-SHARE_STEPS_KEPT:]) | common
    return {s: share for s, share in held.items() if s in keep}


class ParityGroup:
    """This manager's shares and the other members, seen from ``config.node_id``; inert without ``--group``.

    ``ranks`` are the node's own (what a bundle covers, and the memory its slots take);
    ``lock`` is the manager's, shared with its other parts.
    """

    def __init__(self, config: ManagerConfig, lock: threading.RLock, ranks: NodeRanks):
        self.config = config
        self.shares: dict[int, dict[int, Share]] = {}  # origin node → step → share
        self.state = ParityState()
        self._lock = lock
        self._ranks = ranks

    # ---- the members ---------------------------------------------------------------------------

    def check_group(self) -> None:
        """Refuse to start when a reachable member describes the group differently."""
        for member in self.config.group:
            if member.node_id == self.config.node_id:
                continue
            try:
                self._request(member, "group", timeout=2.0)
            except ManagerUnavailable:
                log.info("group member %s not reachable yet", member)

    def _request(self, member: Member, op: str, payload=None, timeout: float = PEER_TIMEOUT, **fields):
        with ManagerClient(member.address, timeout=timeout) as client:
            return client.request(op, payload=payload, group=self.config.signature(),
                                  **{"from": self.config.node_id}, **fields)

    def check_peer(self, msg: dict) -> None:
        """Refuse a member's request when its group differs from ours or it is not a member."""
        mine, theirs = self.config.signature(), msg.get("group")
        sender = msg.get("from")
        if theirs != mine:
            def show(sig):
                return f"n={sig.get('n')}, k={sig.get('k')}, members {','.join(sig.get('members', []))}" \
                    if isinstance(sig, dict) else repr(sig)
            raise BaftError(f"--group mismatch: node {sender} has {show(theirs)}; "
                            f"node {self.config.node_id} has {show(mine)}")
        if sender not in [m.node_id for m in self.config.group]:
            raise BaftError(f"unknown node id {sender!r}: not a member of this group")

    def member(self, node) -> Member:
        for m in self.config.group:
            if m.node_id == node:
                return m
        ids = ", ".join(str(m.node_id) for m in self.config.group) or "none: no --group"
        raise BaftError(f"unknown node id {node!r}: this manager's group has members {ids}")

    # ---- distributing this node's bundles ----------------------------------------------------

    def step_to_encode(self, complete: set[int]) -> Optional[int]:
        """Of the ``complete`` steps newer than the last one encoded, the one to encode next (None without a group).

        A manager busier than the trainers skips steps, and a restore needs one step that every node can
        rebuild. So a step another member has already encoded goes first, and among equals the step with
        the most trailing zero bits (8 before 6 before 7), then the newest: managers that see different
        steps complete still tend to pick the same ones.
        """
        if self.config.k is None:
            return None
        fresh = {s for s in complete if s > self.state.encoded_step}
        with self._lock:
            encoded_by_others = {s for origin, held in self.shares.items() if origin != self.config.node_id
                                 for s in held}
        return max(fresh & encoded_by_others or fresh, key=lambda s: (s & -s, s), default=None)

    def distribute(self, step: int, bundle: memoryview) -> None:
        """Encode this node's bundle of ``step`` and send each member its share; note who took one."""
        cfg = self.config
        began = time.perf_counter()
        shares = erasure.encode(bundle, cfg.k, cfg.n)
        encoded = time.perf_counter() - began
        meta = {"step": step, "size": len(bundle), "checksum": erasure.bundle_checksum(bundle),
                "ranks": self._ranks.ids()}
        acked, errors = [], {}
        for index, member in enumerate(cfg.group):
            data, shares[index] = shares[index], None
            if member.node_id == cfg.node_id:
                kept = memoryview(np.frombuffer(data, dtype=np.uint8).copy())  # data shares are views of the bundle
                self.store(cfg.node_id, step, Share(index, meta["size"], meta["checksum"], meta["ranks"], kept))
                acked.append(member.node_id)
                continue
            try:
                self._request(member, "share_put", payload=data, node=cfg.node_id, index=index, **meta)
                acked.append(member.node_id)
            except BaftError as err:
                errors[member.node_id] = str(err)
        with self._lock:
            self.state.acked[step] = acked
            for old in sorted(self.state.acked)[:-SHARE_STEPS_KEPT]:
                del self.state.acked[old]
            self.state.errors = errors
            self.state.encoded_step = step
            self.state.encode_seconds = encoded
        for node, err in errors.items():
            log.warning("parity of step %d: member %d did not take its share: %s", step, node, err)

    # ---- holding the members' shares ---------------------------------------------------------

    def receive(self, msg: dict, payload: Optional[memoryview]) -> None:
        """Keep the share of a ``share_put`` request."""
        origin = self.member(msg["node"]).node_id
        if payload is None or len(payload) != erasure.share_size(msg["size"], self.config.k):
            raise BaftError(f"share_put from node {origin}: share of {len(payload or b'')} bytes does not fit "
                            f"a {msg['size']}-byte bundle with k={self.config.k}")
        self.store(origin, msg["step"], Share(msg["index"], msg["size"], msg["checksum"], msg["ranks"], payload))

    def store(self, origin: int, step: int, share: Share) -> None:
        """Keep ``share`` of ``origin``'s bundle of ``step``, dropping older steps (:meth:`_prune`); refused over
        --memory-limit."""
        with self._lock:
            kept = _kept({**self.shares.get(origin, {}), step: share}, self.common_steps())
            limit = self.config.memory_limit
            if limit is not None and origin != self.config.node_id:
                others = sum(len(s.data) for o, h in self.shares.items() if o != origin for s in h.values())
                total = self._ranks.slot_bytes() + others + sum(len(s.data) for s in kept.values())
                if total > limit:
                    raise BaftError(f"node {self.config.node_id}: a {human(len(share.data))} share of node {origin} "
                                    f"would bring host memory to {human(total)}, over --memory-limit {human(limit)}")
            self.shares[origin] = kept
            self._prune()

    def common_steps(self) -> set[int]:
        """The ``SHARE_STEPS_KEPT`` newest steps this manager holds a share of from every member: every node
        can be rebuilt at them (the newer may lack a share that never reached another member)."""
        with self._lock:
            held = [set(self.shares.get(m.node_id, {})) for m in self.config.group]
        return set(sorted(set.intersection(*held))[-SHARE_STEPS_KEPT:]) if held else set()

    def _prune(self) -> None:
        """Drop every origin's shares but its ``SHARE_STEPS_KEPT`` newest steps and :meth:`common_steps`: when
        the members' parity lags by different steps, the steps they all cover stay rebuildable."""
        common = self.common_steps()
        self.shares = {origin: _kept(held, common) for origin, held in self.shares.items()}

    def held_shares(self, node: int) -> dict[int, list[int]]:
        """The steps of ``node``'s bundle this manager holds a share of, and the ranks each covers."""
        with self._lock:
            return {s: sh.ranks for s, sh in self.shares.get(node, {}).items()}

    def get_share(self, member: Member, node: int, step: int) -> Share:
        """``member``'s share of ``node``'s bundle of ``step`` (this manager's own without a request)."""
        if member.node_id == self.config.node_id:
            with self._lock:
                share = self.shares.get(node, {}).get(step)
            if share is None:
                raise BaftError(f"member {member.node_id}: no share of node {node} step {step}")
            return share
        reply, data = self._request(member, "share_get", node=node, step=step)
        return Share(reply["index"], reply["size"], reply["checksum"], reply["ranks"], data)

    # ---- rebuilding a node's bundle ----------------------------------------------------------

    def steps(self, node: int) -> dict[int, tuple[list[int], list[int]]]:
        """For each step of ``node``'s bundle: which members hold a share, and which ranks it covers.

        Only steps with at least k holders (rebuildable now) are listed; none without a group.
        """
        if not self.config.group:
            return {}
        holders: dict[int, list[int]] = {}
        ranks: dict[int, list[int]] = {}
        for member in self.config.group:
            try:
                listed = self._share_list(member, node)
            except BaftError:
                continue
            for step, covered in listed.items():
                holders.setdefault(step, []).append(member.node_id)
                ranks[step] = covered
        return {s: (h, ranks[s]) for s, h in holders.items() if len(h) >= self.config.k}

    def _share_list(self, member: Member, node: int) -> dict[int, list[int]]:
        if member.node_id == self.config.node_id:
            return self.held_shares(node)
        reply, _ = self._request(member, "share_list", node=node, timeout=5.0)
        return {int(s): r for s, r in reply["steps"].items()}

    def rebuild(self, node: int, step: Optional[int] = None) -> tuple[int, memoryview]:
        """``node``'s bundle of ``step`` (newest rebuildable by default) from k members' shares, checked end to end."""
        cfg = self.config
        if not cfg.group:
            raise BaftError(f"rebuild node {node}: this manager has no --group, so no parity")
        self.member(node)
        available = self.steps(node)
        steps = sorted((s for s in available if step is None or s == step), reverse=True)
        problems = []
        for s in steps:
            shares: dict[int, erasure.Buffer] = {}
            meta = None
            for holder in available[s][0]:
                try:
                    share = self.get_share(self.member(holder), node, s)
                except BaftError as err:
                    problems.append(str(err))
                    continue
                if meta is None:
                    meta = (share.size, share.checksum)
                if (share.size, share.checksum) != meta:
                    problems.append(f"member {holder} holds a share of another bundle of step {s}")
                    continue
                shares[share.index] = share.data
                if len(shares) == cfg.k:
                    break
            if len(shares) < cfg.k:
                continue
            bundle = erasure.decode(shares, cfg.k, cfg.n, meta[0])
            if erasure.bundle_checksum(bundle) != meta[1]:
                problems.append(f"node {node} step {s}: rebuilt bundle fails its checksum")
                continue
            log.info("rebuilt node %d step %d from members %s", node, s, sorted(shares))
            return s, bundle
        wanted = f"step {step}" if step is not None else "any step"
        why = f" ({problems[-1]})" if problems else ""
        raise BaftError(f"rebuild node {node}: {wanted} has fewer than k={cfg.k} reachable shares{why}")

    # ---- status ------------------------------------------------------------------------------

    def share_bytes(self) -> int:
        with self._lock:
            return sum(len(s.data) for held in self.shares.values() for s in held.values())

    def line(self) -> str:
        """One line: the code, the newest step encoded and whether this node's loss is survived."""
        if not self.config.group:
            return "off"
        with self._lock:
            if self.state.encoded_step < 0:
                return f"k={self.config.k} of n={self.config.n}, nothing encoded yet"
            acked = self.state.acked.get(self.state.encoded_step, [])
            others = [a for a in acked if a != self.config.node_id]
            safe = "survives this node's loss" if len(others) >= self.config.k else "NOT protected"
            errors = "; ".join(f"member {m}: {e}" for m, e in self.state.errors.items())
            return (f"k={self.config.k} of n={self.config.n}, step {self.state.encoded_step} held by members "
                    f"{','.join(map(str, acked))} ({safe}){'; ' + errors if errors else ''}")

    def status(self) -> Optional[dict]:
        """The ``parity`` part of the manager's status; None without a group."""
        if not self.config.group:
            return None
        with self._lock:
            return {"k": self.config.k, "n": self.config.n, "members": [str(m) for m in self.config.group],
                    "encoded_step": self.state.encoded_step, "encode_seconds": self.state.encode_seconds,
                    "acked": {str(s): a for s, a in self.state.acked.items()},
                    "errors": {str(m): e for m, e in self.state.errors.items()},
                    "shares": {str(o): sorted(h) for o, h in self.shares.items()},
                    "line": self.line()}
