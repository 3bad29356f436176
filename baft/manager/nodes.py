"""The managers of a run: one per node, and on one machine, one per simulated node.

On a cluster each node runs ``baft manager start`` itself. ``baft train --nodes N`` on one
machine starts N managers with their own node ids, shared-memory roots and loopback ports,
joined in one parity group, so node failures can be exercised with the same code.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

from baft.config import node_dir, node_root
from baft.manager.config import ManagerConfig, Member
from baft.manager.control import kill_silent, retire, start, status, stop
from baft.manager.protocol import ManagerUnavailable


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_configs(shm_root, run_id: str, nodes: int, persist_dir: Optional[Path] = None,
                 persist_every: Optional[int] = None, parity_k: Optional[int] = None) -> list[ManagerConfig]:
    """One manager configuration per node; with more than one node, a parity group over loopback. With
    ``persist_dir``, each persists the newest snapshot there when it stops, and every ``persist_every``-th step."""
    group = ()
    if nodes > 1:
        group = tuple(Member(n, "127.0.0.1", port) for n, port in enumerate(free_ports(nodes)))
    return [ManagerConfig(node_id=n, shm_root=node_root(shm_root, run_id, n),
                          dir=node_dir(persist_dir, n) if persist_dir else None,
                          group=group, parity_k=(parity_k or nodes - 1) if group else None,
                          persist_every=persist_every).validate()
            for n in range(nodes)]


def manager_log(run_dir, node: int) -> Path:
    """Where the manager of ``node`` logs in a run directory."""
    return Path(run_dir) / f"manager-node{node}.log"


def start_all(configs: list[ManagerConfig], log_dir: Optional[Path] = None) -> list[int]:
    """Start every manager, each logging to :func:`manager_log` in ``log_dir`` (default: its shm root); their pids."""
    return [start(c, log_path=manager_log(log_dir, c.node_id) if log_dir else None) for c in configs]


def revive_all(configs: list[ManagerConfig], log_dir: Optional[Path] = None) -> list[tuple[int, Optional[int]]]:
    """Start again each manager of ``configs`` that no longer answers (killed during the run, or stopped: that one is
    killed first, else it outlived the run, and served again a root the new one had freed once continued), on its
    root: it adopts the snapshots its ranks left there, so that :func:`stop_all` writes and frees them as it does a
    live one's. The node ids of those started again, each with the pid of the silent manager killed, or None."""
    dead = []
    for c in configs:
        try:
            status(c.shm_root)
        except ManagerUnavailable:
            dead.append((c, kill_silent(c.shm_root)))
    start_all([c for c, _ in dead], log_dir)
    return [(c.node_id, killed) for c, killed in dead]


def retire_all(configs: list[ManagerConfig]) -> list[int]:
    """Stop managers an earlier launch left serving these roots, keeping their snapshots for the new
    managers to adopt; the pids stopped."""
    return [pid for c in configs if (pid := retire(c.shm_root)) is not None]


def stop_all(configs: list[ManagerConfig]) -> None:
    """Stop every manager, freeing its snapshots, and remove the run's shared-memory directory once empty."""
    for c in configs:
        stop(c.shm_root)
    for run_root in {c.shm_root.parent for c in configs}:
        try:
            run_root.rmdir()
        except OSError:
            pass
