"""What a shared-memory directory holds: every node root in it, its snapshots, and whether a manager serves it.

A root outlives its run when nothing stopped its manager: ``baft train`` itself was killed
with SIGKILL (its manager, in a session of its own, may still run, or may have been killed
too), or the run trained without a manager. Its slot files then hold host memory until
someone frees them. :func:`scan` finds them for ``baft manager ls``; :func:`remove` frees one
no manager serves, for ``baft manager clean``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from baft.errors import BaftError
from baft.manager.control import INFO_NAME, LOG_NAME, status
from baft.manager.protocol import SOCKET_NAME, ManagerUnavailable
from baft.snapshot import slots


@dataclass(frozen=True)
class NodeRoot:
    """One node's shared-memory root: the newest committed step of each rank in it, the bytes its
    files take, and the pid of the manager serving it (None: no manager answers)."""

    path: Path
    newest_steps: dict[int, int]
    nbytes: int
    manager_pid: Optional[int]

    def held(self) -> str:
        return ", ".join(f"rank {r} step {s}" for r, s in sorted(self.newest_steps.items())) or "nothing committed"

    def line(self) -> str:
        served = f"manager pid {self.manager_pid}" if self.manager_pid else "no manager"
        return f"{self.path}  {self.nbytes / 1e6:.1f} MB  {served}  ({self.held()})"


def _manager_pid(root: Path) -> Optional[int]:
    if not (root / SOCKET_NAME).exists():
        return None
    try:
        return status(root, timeout=2.0)["pid"]
    except ManagerUnavailable:
        return None


def node_root(path) -> NodeRoot:
    """What the node root at ``path`` holds now."""
    root = Path(path)
    newest = {}
    for rank in slots.rank_ids(root):
        held = slots.committed(root, rank)
        if held:
            newest[rank] = held[0].record.step
    return NodeRoot(root, newest, _bytes_under(root), _manager_pid(root))


def _bytes_under(root: Path) -> int:
    """The bytes of the files under ``root``, those another run removes meanwhile not counted."""
    total = 0
    for directory, _, files in os.walk(root):  # skips a directory removed as it walks
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                pass
    return total


def scan(top) -> list[NodeRoot]:
    """Every node root under ``top`` (a directory with rank directories, or a manager's files), by path. Another run
    on this machine may end as it is scanned (its root removed): a root gone meanwhile is left out (it was a
    FileNotFoundError that stopped baft train, seen with two runs at once)."""
    found = set()
    for directory, subdirectories, files in os.walk(top):
        path = Path(directory)
        if any(slots.rank_of(path / sub) is not None for sub in subdirectories) or {INFO_NAME, SOCKET_NAME,
                                                                                    LOG_NAME} & set(files):
            found.add(path)
    roots = []
    for path in sorted(found):
        try:
            roots.append(node_root(path))
        except FileNotFoundError:
            pass
    return roots


def remove(path) -> NodeRoot:
    """Delete the node root at ``path`` and its snapshots (and its parent directory, once empty);
    what it held. Refused while a manager serves it: ``baft manager stop`` frees those."""
    root = node_root(path)
    if not root.path.is_dir():
        raise BaftError(f"{root.path}: no such directory")
    if root.manager_pid is not None:
        raise BaftError(f"{root.path}: a manager (pid {root.manager_pid}) serves it; stop it with "
                        f"`baft manager stop --shm-root {root.path}`, which frees its snapshots")
    if not slots.rank_ids(root.path) and not any((root.path / n).exists() for n in (INFO_NAME, SOCKET_NAME, LOG_NAME)):
        raise BaftError(f"{root.path}: not a node root (no rank directories, no manager files)")
    shutil.rmtree(root.path)
    try:
        root.path.parent.rmdir()
    except OSError:
        pass
    return root
