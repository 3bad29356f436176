"""``baft.initialize``: ``deepspeed.initialize`` with baft attached, driven by the ``"baft"`` config section."""

from __future__ import annotations

import os
from pathlib import Path

import deepspeed

from baft.config import parse_config
from baft.engine import attach
from baft.jsonfile import read_json

PROFILE_DIR_ENV = "BAFT_PROFILE_DIR"
PROFILE_ITERS_ENV = "BAFT_PROFILE_ITERS"


def load_ds_config(config) -> dict:
    """A DeepSpeed config given as a dict or a path to a JSON file."""
    if isinstance(config, (str, Path)):
        return read_json(config)
    return dict(config or {})


def initialize(model, config, data_iterator=None, **kwargs):
    """Drop-in for ``deepspeed.initialize``: same arguments and return values, with baft attached.

    Without a ``"baft"`` section (or with ``"enabled": false``) this is exactly
    ``deepspeed.initialize``. ``data_iterator`` is the training iterator whose position is
    saved and restored (any object with ``state_dict``/``load_state_dict``).
    """
    ds_config = load_ds_config(config)
    cfg = parse_config(ds_config)
    profile_dir = os.environ.get(PROFILE_DIR_ENV)
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config=ds_config, **kwargs)
    if not cfg.enabled and not profile_dir:
        return engine, optimizer, loader, scheduler
    attach(engine, cfg.schedule)
    engine.baft_config = cfg
    engine.baft_run_id = cfg.run_id
    if profile_dir:
        _start_profiler(engine, profile_dir, int(os.environ.get(PROFILE_ITERS_ENV, "10")), model)
    elif cfg.policy != "none":
        from baft.policies import make_policy  # noqa: PLC0415 (imports the manager client only when used)
        engine.baft_hooks.append(make_policy(engine, cfg, data_iterator))
    return engine, optimizer, loader, scheduler


def _start_profiler(engine, directory: str, iterations: int, model) -> None:
    from baft.profiler import ProfileSession

    engine.baft_hooks.append(ProfileSession(directory, iterations, type(model).__name__,
                                            show_progress=engine.global_rank == 0))
