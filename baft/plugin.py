"""``baft.initialize``: ``deepspeed.initialize`` with baft attached, driven by the ``"baft"`` config section."""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import os
from pathlib import Path

import deepspeed

from baft.config import PROFILE_DIR_ENV, PROFILE_ITERS_ENV, TRACE_DIR_ENV, parse_config
from baft.errors import BaftError
from baft.jsonfile import read_json
from baft.pipeline.hooks import attach
from baft.teardown import teardown


def load_ds_config(config) -> dict:
    """A DeepSpeed config given as a dict or a path to a JSON file."""
    if isinstance(config, (str, Path)):
        return read_json(config)
    return dict(config or {})


def initialize(*args, data_iterator=None, client_state=None, **kwargs):
    """Drop-in for ``deepspeed.initialize``: same arguments and return values, with baft attached.

    Takes every calling form of ``deepspeed.initialize`` (``args`` carrying
    ``--deepspeed_config``, ``config=``, ``config_params=``, ``model_parameters=``,
    ``training_data=``, ``lr_scheduler=``, ...) and passes them on unchanged. Without a
    ``"baft"`` section in the config (or with ``"enabled": false``) this is
    ``deepspeed.initialize`` with only the clean exit of :mod:`baft.teardown`.
    ``data_iterator`` is the training iterator whose position is saved and restored (any
    object with ``state_dict``/``load_state_dict``); without it, the position of the
    engine's own loader (``training_data=``) is. ``client_state`` is the script's own state: an
    object with ``state_dict``/``load_state_dict`` (a restore loads it), or a callable returning
    what the script saves with ``save_checkpoint(client_state=...)``. baft saves it with every
    snapshot, and after a restore the script's own ``load_checkpoint`` of an older checkpoint
    keeps baft's state and returns it as of the restored step (:mod:`baft.recovery.script_checkpoint`).
    """
    from baft.recovery.record import mark
    mark("init_start")
    given = inspect.signature(deepspeed.initialize).bind(*args, **kwargs).arguments  # DeepSpeed's own TypeError
    ds_config = load_ds_config(_config_source(given))
    cfg = _with_launcher_defaults(parse_config(ds_config), ds_config)
    profile_dir = os.environ.get(PROFILE_DIR_ENV)
    engine, optimizer, loader, scheduler = deepspeed.initialize(*args, **kwargs)
    mark("init_end")
    atexit.register(teardown, engine)  # a clean exit, with or without baft attached
    if not cfg.enabled and not profile_dir:
        return engine, optimizer, loader, scheduler
    attach(engine, cfg.schedule)
    engine.baft_config = cfg
    engine.baft_run_id = cfg.run_id
    if profile_dir:
        _start_profiler(engine, profile_dir, int(os.environ.get(PROFILE_ITERS_ENV, "10")), given.get("model"))
        return engine, optimizer, loader, scheduler
    from baft.recovery.digests import digests_hook
    from baft.recovery.script_checkpoint import ClientState, guard_load_checkpoint
    from baft.snapshot.data import data_position, not_restored

    data_iterator = data_position(engine, data_iterator, given.get("training_data"))
    engine.baft_client_state = ClientState(client_state) if client_state is not None else None
    digests = digests_hook(data_iterator)
    if digests is not None:
        engine.baft_hooks.append(digests)
    if cfg.policy != "none":
        caveat = not_restored(data_iterator)
        if caveat and engine.global_rank == 0:
            from baft.snapshot.build import warn

            warn(engine, caveat)
        _protect(engine, cfg, data_iterator)
        guard_load_checkpoint(engine, engine.baft_client_state)
    if os.environ.get(TRACE_DIR_ENV):
        from baft.snapshot.trace import start_trace

        start_trace(engine, os.environ[TRACE_DIR_ENV], type(given.get("model")).__name__)
    return engine, optimizer, loader, scheduler


def _config_source(given: dict):
    """Where ``deepspeed.initialize`` finds its config: ``config``, ``config_params``, or the ``args`` namespace."""
    for key in ("config", "config_params"):
        if given.get(key) is not None:
            return given[key]
    args = given.get("args")
    return getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)


def _protect(engine, cfg, data_iterator) -> None:
    """Restore the newest snapshot every rank holds, then snapshot as the policy says."""
    from baft.recovery import chaos, record
    from baft.recovery.restore import restore
    from baft.snapshot import state
    from baft.snapshot.build import IN_MEMORY, make_policy, shm_root, warn

    state.check_capturable(engine, data_iterator)  # what baft cannot restore exactly is refused now, in one line
    root = shm_root(cfg, engine.global_rank)
    client = None
    engine.baft_restored = None
    if cfg.policy in IN_MEMORY:
        client = _connect_manager(engine, cfg, root)
        if client is None and cfg.require_manager:
            raise BaftError(f"baft.require_manager: no snapshot manager answers at {root}; start one with "
                            f"'baft manager start' or set require_manager to false")
        log = lambda m: warn(engine, m)  # noqa: E731
        restored = restore(engine, root, client, data_iterator, True if cfg.adopt else cfg.fresh_start, log=log)
        if restored is None and cfg.adopt:  # the first start under baft: from the job's DeepSpeed checkpoint
            from baft.recovery.adopt import adopt

            restored = adopt(engine, cfg.adopt, data_iterator, log=log)
            if engine.global_rank == 0:
                print(f"baft: adopted the DeepSpeed checkpoint of step {restored.step} in {cfg.adopt}", flush=True)
        elif restored is not None and engine.global_rank == 0:
            print(f"baft: resumed from step {restored.step} ({restored.source})", flush=True)
        engine.baft_restored = restored
    policy = make_policy(engine, cfg, data_iterator, link=ManagerLink(engine, client))
    if cfg.policy not in IN_MEMORY:  # the disk baselines restart the usual way: from their newest checkpoint
        record.mark("restore_start")
        loaded = policy.restore(engine)
        record.mark("restore_end")
        engine.baft_restored = record.Restored(loaded[0], "disk", 1, rng=loaded[1]) if loaded else None
        if loaded and engine.global_rank == 0:
            print(f"baft: resumed from step {loaded[0]} (disk, {cfg.policy})", flush=True)
    if engine.baft_restored is not None and engine.baft_restored.rng is not None:
        engine.baft_hooks.insert(0, engine.baft_restored.rng)  # before any hook sees the iteration
    engine.baft_hooks.append(policy)
    engine.baft_hooks.append(record.RecoveryReport(engine.baft_restored, cfg.run_dir))
    faults = chaos.faults_from_env()
    if faults:
        from baft.config import node_of
        from baft.recovery.chaos_hook import ChaosHook

        engine.baft_hooks.append(ChaosHook(faults, engine.global_rank, record.restart_count(), cfg.run_dir,
                                           node=node_of(cfg, engine.global_rank), node_root=root))


def _connect_manager(engine, cfg, root):
    """This node's manager; when the config describes one (parity or persistence) and none answers
    (a replaced node), the node's first rank starts it before every rank connects."""
    import torch.distributed as dist

    from baft.config import node_of
    from baft.manager.control import start
    from baft.manager.nodes import manager_log
    from baft.manager.protocol import ManagerClient
    from baft.snapshot.build import warn

    if cfg.parity.group or cfg.persist.dir:
        node = node_of(cfg, engine.global_rank)
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node)  # a config with node_id names its own node only
        first = nodes.index(node)
        if engine.global_rank == first and ManagerClient.try_connect(root, warn=lambda m: None) is None:
            warn(engine, f"no manager answers for node {node}; starting one at {root}")
            # beside the other managers' logs, not in the shared memory it frees when it stops
            start(manager_config(cfg, node, root), log_path=manager_log(cfg.run_dir, node) if cfg.run_dir else None)
        dist.barrier()
    # a restore may rebuild from parity or read from disk: allow it time
    return ManagerClient.try_connect(root, timeout=120.0, warn=lambda m: warn(engine, m.removeprefix("baft: ")))


def manager_config(cfg, node: int, root):
    """The manager a config asks for on ``node``."""
    from baft.manager.config import ManagerConfig, parse_group

    persist_dir = Path(cfg.persist.dir) / f"node{node}" if cfg.persist.dir else None
    return ManagerConfig(node_id=node, shm_root=Path(root), dir=persist_dir,
                         group=parse_group(",".join(cfg.parity.group)) if cfg.parity.group else (),
                         parity_k=cfg.parity.k if cfg.parity.group else None,
                         persist_every=cfg.persist.every or None,
                         persist_seconds=cfg.persist.seconds or None, keep=cfg.persist.keep,
                         memory_limit=cfg.memory_limit).validate()


class ManagerLink:
    """Tells the node's manager about this rank's slots and commits; warns once and trains on if it is gone."""

    def __init__(self, engine, client):
        self.engine, self.client = engine, client

    def hello(self, source) -> None:
        """Announce this rank's snapshot size and identity (the topology its commit records carry)."""
        if self.client is None:
            return
        from baft.snapshot.layout import model_signature

        layout = source.layout
        self.client.hello(self.engine.global_rank, layout.nbytes, self.engine.baft_run_id,
                          model_signature(layout.tensors), source.topology())

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def commit(self, record, slot: int) -> None:
        if self.client is None:
            return
        from baft.manager.protocol import ManagerUnavailable
        from baft.snapshot.build import warn

        try:
            self.client.commit(record.rank, record.step, slot)
        except ManagerUnavailable as err:
            warn(self.engine, f"{err}; snapshots stay in shared memory only")
            self.client = None


LAUNCHER_ENV = {"run_id": "BAFT_RUN_ID", "shm_root": "BAFT_SHM_ROOT", "run_dir": "BAFT_RUN_DIR"}


def _with_launcher_defaults(cfg, ds_config: dict):
    """``baft train -- script`` tells the script's ranks its run id, shm root and run dir, unless the config does."""
    section = ds_config.get("baft") or {}
    given = {key: os.environ[env] for key, env in LAUNCHER_ENV.items() if env in os.environ and key not in section}
    return dataclasses.replace(cfg, **given) if given else cfg


def _start_profiler(engine, directory: str, iterations: int, model) -> None:
    from baft.pipeline.profiler import ProfileSession
    from baft.snapshot import sizes

    engine.baft_hooks.append(ProfileSession(directory, iterations, type(model).__name__, sizes.describe,
                                            show_progress=engine.global_rank == 0))
