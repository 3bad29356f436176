"""``baft.initialize``: ``deepspeed.initialize`` with baft attached, driven by the ``"baft"`` config section."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Optional

import deepspeed
import torch

from baft.config import LAUNCHER_ENV, PROFILE_DIR_ENV, PROFILE_ITERS_ENV, TRACE_DIR_ENV, parse_config
from baft.errors import ConfigError
from baft.jsonfile import read_json
from baft.script.loop import THIS_PROCESS, frozen, set_frozen
from baft.script.rng import hold_script_generators
from baft.script.schedulers import engines_own
from baft.recovery import world
from baft.recovery.record import log_raised, mark
from baft.snapshot.optimizers import base_optimizer
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
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)  # DeepSpeed's own TypeError
    if bound.arguments.get("model_parameters") is not None:  # a generator, as often, is used up by the first call
        bound.arguments["model_parameters"] = list(bound.arguments["model_parameters"])
    args, kwargs = bound.args, bound.kwargs
    own_collectives = world.collectives_before() if world.available() else 0
    if world.available() and not world.generation():
        world.register()
    tied = world.tied_dtypes(bound.arguments.get("model"))  # as the constructor left them: DeepSpeed converts them
    frozen_first = _frozen(bound.arguments.get("model"))  # what DeepSpeed's bf16 and ZeRO wrappers leave out
    hold_script_generators(_script_frame(), data_iterator)
    returned = _initialize(args, kwargs, data_iterator, client_state)
    if world.available() and world.generation():  # a replacement in place: how far the survivors' loops are
        THIS_PROCESS.peers = world.published("loop")
    engine, given_optimizer = returned[0], bound.arguments.get("optimizer")
    # an optimizer object DeepSpeed wrapped (bf16, ZeRO) now holds the wrapper's copies: it cannot be wrapped again
    wrapped = given_optimizer is not None and not callable(given_optimizer) and engine.optimizer is not given_optimizer
    # the script's own state given as a callable comes back only through its own load_checkpoint, which a survivor
    # does not run again
    own_state = client_state is not None and not hasattr(client_state, "load_state_dict")
    own_groups = world.groups_before(bound.arguments.get("model")) if world.available() else 0
    if getattr(engine, "baft", None) is not None and world.available():
        if wrapped:
            THIS_PROCESS.no_survivors(engine, "the optimizer object DeepSpeed wrapped cannot be wrapped again",
                                      "Give deepspeed.initialize a callable making the optimizer, or the optimizer "
                                      "in its config, for its survivors to recover in place")
        elif own_state:
            THIS_PROCESS.no_survivors(engine, "its client_state comes back only through the script's own "
                                              "load_checkpoint",
                                      "Give client_state= an object with state_dict() and load_state_dict() for its "
                                      "survivors to recover in place")
        elif own_groups:
            THIS_PROCESS.no_survivors(engine, f"the script made {own_groups} process groups before its "
                                              f"PipelineModule, which a replacement makes again and a survivor cannot "
                                              f"make with it")
        elif own_collectives:
            THIS_PROCESS.no_survivors(engine, f"the script called collectives before baft.initialize "
                                              f"({own_collectives}: a barrier while rank 0 prepares the data?), "
                                              f"which a replacement calls again and a survivor, inside train_batch, "
                                              f"never meets",
                                      "Have the other ranks wait for the data's file rather than at a barrier, or "
                                      "prepare the data before baft train, for its survivors to recover in place")
        else:
            engine.baft.again = functools.partial(_again, args, kwargs, data_iterator, client_state, returned, tied,
                                                  [base_optimizer(returned[1])], frozen_first)
    return returned


def _script_frame():
    """The frame of the script's call of ``baft.initialize``: the first outside baft."""
    frame, here = sys._getframe(1), os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame = frame.f_back
    return frame


SET_ON_THE_ENGINE = ("batch_fn", "has_attention_mask")  # PipelineEngine.set_batch_fn(), set_has_attention_mask()


def _again(args, kwargs, data_iterator, client_state, first: tuple, tied: dict, bases: list,
           frozen_first: Optional[list]):
    """In a survivor of a killed rank, in the new world (:mod:`baft.recovery.in_place`): what :func:`initialize`
    did, again, on the same model, its parameters frozen as they were then (``frozen_first``: the restore freezes
    those the script froze since, as a replacement's does); the engine, optimizer, loader and scheduler the script
    holds from the first call take the state of the new ones, and so do the torch optimizers inside DeepSpeed's
    bf16 or ZeRO wrappers so far (``bases``: a scheduler the script made holds one). Returns the engine's new
    protection."""
    model = inspect.signature(deepspeed.initialize).bind(*args, **kwargs).arguments.get("model")
    if frozen_first is not None:
        set_frozen(model, frozen_first)
    world.regroup(model, tied)
    fresh = _initialize(args, kwargs, data_iterator, client_state, again=True)
    held_engine = first[0]
    if getattr(held_engine, "training_dataloader", None) is None and fresh[0].data_iterator is None:
        fresh[0].data_iterator = held_engine.data_iterator  # the script's, given by set_dataiterator()
    for name in SET_ON_THE_ENGINE:  # which the script set after initialize, and does not set again (probe 29's L1)
        if hasattr(held_engine, name):
            setattr(fresh[0], name, getattr(held_engine, name))
    base = base_optimizer(fresh[1])
    for held, new in [*zip(first, fresh), *((old, base) for old in bases)]:
        if held is not None and new is not None and held is not new:
            # one state: what baft's hooks and DeepSpeed's hold is the new object (the engine's class: baft's again)
            held.__class__, held.__dict__ = type(new), new.__dict__
    first[0].baft.again = functools.partial(_again, args, kwargs, data_iterator, client_state, first, tied,
                                            [*bases, base], frozen_first)
    return first[0].baft


def _frozen(model) -> Optional[list]:
    """The parameters of ``model`` frozen now, where it is a module (:func:`baft.script.loop.frozen`)."""
    return frozen(model) if isinstance(model, torch.nn.Module) else None


def _initialize(args, kwargs, data_iterator, client_state, again: bool = False) -> tuple:
    """``initialize``'s work; ``again``: a survivor's, in the new world, whose loop is past its first call."""
    mark("init_start")
    given = inspect.signature(deepspeed.initialize).bind(*args, **kwargs).arguments  # DeepSpeed's own TypeError
    ds_config = load_ds_config(_config_source(given))
    cfg = _with_launcher_defaults(parse_config(ds_config), ds_config)
    if cfg.enabled:
        _make_run_dir(cfg.run_dir)
    profile_dir = os.environ.get(PROFILE_DIR_ENV)
    engine, optimizer, loader, scheduler = deepspeed.initialize(*args, **kwargs)
    mark("init_end")
    engines_own(scheduler)
    atexit.register(_not_mid_replay)  # after the teardown (the last registered runs first)
    atexit.register(teardown, engine)  # a clean exit, with or without baft attached
    atexit.register(log_raised, engine.global_rank)  # before the teardown's end of the process groups: peers see it
    said = unprotected(ds_config)
    if said and engine.global_rank == 0:
        print(f"baft: warning: {said}", file=sys.stderr, flush=True)
    if not cfg.enabled and not profile_dir:
        return engine, optimizer, loader, scheduler
    from baft.protection import Protection

    protection = Protection(engine, cfg).attach()
    if profile_dir:
        _start_profiler(protection, profile_dir, int(os.environ.get(PROFILE_ITERS_ENV, "10")), given.get("model"))
        return engine, optimizer, loader, scheduler
    from baft.recovery.digests import digests_hook
    from baft.recovery.script_checkpoint import ClientState, guard_load_checkpoint
    from baft.position.kept import data_position, not_restored, say_open_file_stream
    from baft.position.first_iterators import note_until_first_call
    from baft.position.found_position import PositionFoundLater

    data_iterator = protection.data_position = data_position(engine, data_iterator, given.get("training_data"))
    protection.client_state = ClientState(client_state) if client_state is not None else None
    protection.hooks.digests = digests_hook(data_iterator)
    if cfg.policy != "none":
        found_later = isinstance(data_iterator, PositionFoundLater)
        caveat = None if found_later else not_restored(data_iterator)  # (said of as the loop first reads it)
        if caveat and engine.global_rank == 0:
            protection.warn(caveat)
        say_open_file_stream(engine, data_iterator)
        protection.restore(data_iterator)
        if found_later:
            data_iterator.resumed = protection.restored is not None
        if protection.client_state is not None:  # as the loop's first code will find it
            protection.client_state.hold()
        protection.protect()
        guard_load_checkpoint(engine, protection.client_state)
        THIS_PROCESS.before_first_call(engine)
        # the script's loop goes on from the restored step; one that replays its calls draws as it did, from the start
        rng = protection.hooks.rng if not THIS_PROCESS.replaying else None
        set_between = rng is not None and rng.sets_between
        if rng is not None:
            rng.between_steps()
        if found_later and not again:  # a loader the script makes now is found at the loop's first call
            note_until_first_call(set_between)
    if os.environ.get(TRACE_DIR_ENV):
        from baft.snapshot.trace import start_trace

        start_trace(engine, os.environ[TRACE_DIR_ENV], type(given.get("model")).__name__)
    return engine, optimizer, loader, scheduler


def _not_mid_replay() -> None:
    """At interpreter exit: a process whose loop stopped while it replayed its calls fails, saying why
    (:meth:`~baft.script.loop.Loop.left_in_replay`), rather than end as if finished."""
    why = THIS_PROCESS.left_in_replay()
    if why:
        print(f"baft: error: {why}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _config_source(given: dict):
    """Where ``deepspeed.initialize`` finds its config: ``config``, ``config_params``, or the ``args`` namespace."""
    for key in ("config", "config_params"):
        if given.get(key) is not None:
            return given[key]
    args = given.get("args")
    return getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)


def unprotected(ds_config: dict) -> Optional[str]:
    """What to say where ``baft train`` launched a script whose DeepSpeed config has no ``"baft"`` section."""
    if "baft" in ds_config or not os.environ.get(LAUNCHER_ENV["run_dir"]):
        return None
    return ("the DeepSpeed config has no \"baft\" section: the script runs unprotected (no snapshots; a restart "
            "begins again at step 0)")


def _with_launcher_defaults(cfg, ds_config: dict):
    """``baft train -- script`` tells the script's ranks its run id, shm root and run dir; a config that says
    otherwise is refused in one line (the launch's managers would watch where its ranks keep nothing, and its
    report read a run directory they never write)."""
    section = ds_config.get("baft") or {}
    launcher = {key: os.environ[env] for key, env in LAUNCHER_ENV.items() if env in os.environ}
    for key, value in launcher.items():
        if key in section and not _same_place(key, section[key], value):
            raise ConfigError(f"baft.{key} {section[key]!r}: baft train runs this job with {key} {value!r} (its "
                              f"managers and report look there); leave {key} out of the config under baft train")
    given = {key: value for key, value in launcher.items() if key not in section}
    return dataclasses.replace(cfg, **given) if given else cfg


def _make_run_dir(run_dir: Optional[str]) -> None:
    """Make ``baft.run_dir`` where it is not there yet (every rank may be the first to write in it: rank 0 its
    recovery record, a rank's fault its line); a ``ConfigError`` naming it where it cannot be made."""
    if run_dir is None:
        return
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"baft.run_dir {run_dir!r}: cannot be made a directory ({err.strerror})") from None


def _same_place(key: str, configured, launched: str) -> bool:
    if key == "run_id":
        return configured == launched
    return Path(str(configured)).resolve() == Path(launched).resolve()


def _start_profiler(protection, directory: str, iterations: int, model) -> None:
    from baft.pipeline.profiler import ProfileSession
    from baft.snapshot import sizes

    protection.hooks.profile = ProfileSession(directory, iterations, type(model).__name__, sizes.describe,
                                              show_progress=protection.engine.global_rank == 0)
