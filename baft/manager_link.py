"""A rank's link to its node's snapshot manager, beside :mod:`baft.protection`, which holds it.

:func:`connect_manager` finds the node's manager as a rank restores (the node's first rank starts one where the
config describes one and none answers) and says when it runs with settings of its own
(:func:`settings_not_applied`); a :class:`ManagerLink` tells it about the rank's slots and commits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from baft.config import BaftConfig, PersistConfig, node_dir, node_of

if TYPE_CHECKING:
    from baft.protection import Protection


def connect_manager(cfg: BaftConfig, engine, root: str, warn: Callable[[str], None]):
    """This node's manager (a ManagerClient, or None where none answers at ``root``, the node's shared-memory
    root); when the config describes one (parity or persistence) and none answers (a replaced node), the node's
    first rank starts it before every rank connects."""
    import torch.distributed as dist

    from baft.manager.control import start
    from baft.manager.nodes import manager_log
    from baft.manager.protocol import ManagerClient

    if cfg.parity.group or cfg.persist.dir:
        node = node_of(cfg, engine.global_rank)
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node)  # a config with node_id names its own node only
        first = nodes.index(node)
        if engine.global_rank == first and ManagerClient.try_connect(root, warn=lambda m: None) is None:
            warn(f"no manager answers for node {node}; starting one at {root}")
            # beside the other managers' logs, not in the shared memory it frees when it stops
            start(manager_config(cfg, node, root),
                  log_path=manager_log(cfg.run_dir, node) if cfg.run_dir else None)
        dist.barrier()
    # a restore may rebuild from parity or read from disk: allow it time
    client = ManagerClient.try_connect(root, timeout=120.0, warn=lambda m: warn(m.removeprefix("baft: ")))
    if client is not None and engine.global_rank == 0:
        status = client.status()
        ignored = settings_not_applied(cfg, status, node_of(cfg, engine.global_rank))
        if ignored:
            warn(f"the node's manager (pid {status['pid']}) runs with settings of its own, not this "
                 f"config's {'; '.join(ignored)}: `baft train` starts it with its options (--persist-every; "
                 f"on disk in RUN_DIR/persisted), `baft manager start` with its own")
    return client


def settings_not_applied(cfg: BaftConfig, status: dict, node: int) -> list[str]:
    """The keys of the ``"baft"`` section, each with its value and the running manager's (``status``, its
    ``status()``), that ask this node's manager for what it does not do: it was started with settings of its own."""
    persist, defaults = status.get("persist") or {}, PersistConfig()
    wanted = {"persist.dir": str(node_dir(cfg.persist.dir, node)) if cfg.persist.dir else None,
              "persist.every": cfg.persist.every or None, "persist.seconds": cfg.persist.seconds or None,
              "persist.keep": cfg.persist.keep if cfg.persist.keep != defaults.keep else None,
              "memory_limit": cfg.memory_limit}
    running = {"persist.dir": persist.get("dir"), "persist.every": persist.get("every"),
               "persist.seconds": persist.get("seconds"), "persist.keep": persist.get("keep"),
               "memory_limit": status["memory"]["limit"]}
    return [f"{key} {value} (the manager's: {running[key] if running[key] is not None else 'none'})"
            for key, value in wanted.items() if value is not None and value != running[key]]


def manager_config(cfg: BaftConfig, node: int, root):
    """The manager a config asks for on ``node``."""
    from baft.manager.config import ManagerConfig, parse_group

    persist_dir = node_dir(cfg.persist.dir, node) if cfg.persist.dir else None
    return ManagerConfig(node_id=node, shm_root=Path(root), dir=persist_dir,
                         group=parse_group(",".join(cfg.parity.group)) if cfg.parity.group else (),
                         parity_k=cfg.parity.k if cfg.parity.group else None,
                         persist_every=cfg.persist.every or None,
                         persist_seconds=cfg.persist.seconds or None, keep=cfg.persist.keep,
                         memory_limit=cfg.memory_limit).validate()


class ManagerLink:
    """Tells the node's manager about this rank's slots and commits; warns once and trains on if it is gone."""

    def __init__(self, protection: Protection, client):
        self.protection, self.client = protection, client

    def hello(self, source) -> int:
        """Announce this rank's snapshot size and identity (the topology its commit records carry); the number
        of snapshot slots the manager made for it (said in one line when its memory limit allows only the
        fewest)."""
        from baft.snapshot.slots import SLOTS

        if self.client is None:
            return SLOTS
        from baft.snapshot.layout import model_signature

        layout = source.layout
        cfg = self.protection.config
        node_ranks = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        reply = self.client.hello(self.protection.engine.global_rank, layout.nbytes, cfg.run_id,
                                  model_signature(layout.tensors), source.topology(), node_ranks)
        count = len(reply["slots"])
        if count < SLOTS:
            bound = reply["memory"].get("limited_by", "memory_limit")
            self.protection.warn(f"{bound} allows {count} snapshot slots, not {SLOTS}: each snapshot waits "
                                 f"for the previous one's seal")
        return count

    def close(self) -> None:
        """Close the connection to the manager, where there is one."""
        if self.client is not None:
            self.client.close()

    def commit(self, record, slot: int) -> None:
        """Tell the manager that ``slot`` holds ``record``'s snapshot; where it is gone, say so once and go on
        without it."""
        if self.client is None:
            return
        from baft.manager.protocol import ManagerUnavailable

        try:
            self.client.commit(record.rank, record.step, slot)
        except ManagerUnavailable as err:
            self.protection.warn(f"{err}; snapshots stay in shared memory only")
            self.client = None
