"""Learning-rate schedulers a script makes on the engine's optimizer itself, not given to ``deepspeed.initialize``
(``sched = StepLR(engine.optimizer, ...)``, stepped by its loop after each ``train_batch``).

The engine's own scheduler is in every snapshot's small state; such a scheduler is the script's, and its count of
steps (``last_epoch``; a plateau scheduler's best loss) would start again from zero in a resumed process, on top of
the restored learning rate. baft finds them among the live objects (a walk over every object the garbage collector
tracks, tens of milliseconds: at the first snapshot, and again where more refer to the optimizer than at the last
walk, as a scheduler made since does, or where one found has been freed, as one the script replaced by another
is), keeps their ``state_dict`` with every snapshot, and loads it back: at the restore where the scheduler already
exists (made before ``baft.initialize``, a survivor in place), and as the first resumed iteration starts, when the
script has made it again and its loop has run its code before that call (which may have stepped it).
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from collections import Counter
from typing import Optional

import torch

from baft.errors import BaftError
from baft.script.held import PLAIN

_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine's optimizer -> [weakref to a scheduler]
_LOOKED_AT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine's optimizer -> its references then
_ENGINES: "weakref.WeakSet" = weakref.WeakSet()  # every scheduler deepspeed.initialize made or was given here
_CAPTURED: dict = {}  # engine step -> the kinds of the script's schedulers a snapshot of that step kept (the newest)
_KEPT_KINDS = 16  # steps whose kinds are remembered: a recovery in place goes back fewer


def engines_own(scheduler) -> None:
    """``scheduler`` is an engine's (``deepspeed.initialize`` returned it): in the engine's state, not the script's,
    and so is any object that takes its state (:func:`baft.plugin._again`)."""
    if scheduler is not None:
        _ENGINES.add(scheduler)


def _scheduler_kinds() -> tuple[type, ...]:
    """The classes a learning-rate scheduler is an instance of (or of a subclass of, the script's own): torch's
    ``LRScheduler`` and DeepSpeed's (``WarmupLR`` and the rest, which are not torch's), where imported."""
    kinds = [torch.optim.lr_scheduler.LRScheduler]
    deepspeed_schedules = sys.modules.get("deepspeed.runtime.lr_schedules")
    if deepspeed_schedules is not None:
        kinds += [kind for kind in vars(deepspeed_schedules).values() if isinstance(kind, type)
                  and kind.__module__ == deepspeed_schedules.__name__ and hasattr(kind, "load_state_dict")]
    return tuple(kinds)


def script_schedulers(engine) -> list:
    """The schedulers stepping the engine's optimizer other than the engine's own (outermost only: the schedulers
    inside a ``SequentialLR`` or ``ChainedScheduler`` are in its ``state_dict``), as first found; a
    :class:`~baft.errors.BaftError` where two are of one kind, which no restore could tell apart (said as they are
    first found, not at the first fault)."""
    optimizer = engine.optimizer
    if optimizer not in _LOOKED_AT or _references(optimizer) > _LOOKED_AT[optimizer] or _gone(optimizer):
        found = _look(engine)
        why = _alike(found)
        if why:
            raise BaftError(f"{why}: resumed after a fault, its learning rates would not be those of an "
                            f"uninterrupted run. Make one of them (SequentialLR or ChainedScheduler of both, or one "
                            f"LambdaLR), or give one to baft.initialize (lr_scheduler=)")
        _keep(engine, found)
        _LOOKED_AT[optimizer] = _references(optimizer)
    return [s for s in (ref() for ref in _FOUND[optimizer]) if s is not None]


def _gone(optimizer) -> bool:
    """Whether a scheduler found on ``optimizer`` has been freed since: the script may have made another in its
    place (a warm-up ``LinearLR`` replaced by a ``CosineAnnealingLR`` as it ends, ``sched = ...`` again), which
    holds the reference the freed one held, so that the count of references alone does not change."""
    return any(ref() is None for ref in _FOUND.get(optimizer, ()))


def _references(optimizer) -> int:
    """How many references the optimizer and the torch optimizer inside DeepSpeed's wrappers have: a scheduler made
    on them holds one (a count, where walking every object would take tens of milliseconds)."""
    count = 0
    while optimizer is not None:
        count += sys.getrefcount(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return count


def _alike(found: list) -> str:
    """Why a restore could not tell ``found``'s schedulers apart (two of a kind), or ""."""
    names = Counter(type(s).__qualname__ for s in found)
    if any(count > 1 for count in names.values()):
        return (f"the script has more than one learning-rate scheduler of a kind on the engine's optimizer "
                f"({dict(names)}): baft cannot tell them apart")
    return ""


def _keep(engine, found: list) -> None:
    _FOUND[engine.optimizer] = [weakref.ref(obj) for obj in found]


def _look(engine) -> list:
    groups = engine.optimizer.param_groups  # one list: DeepSpeed's wrappers give their torch optimizer's
    # an object recovery in place gave another's state (baft.plugin) is that one: the engines' own among them
    known = {id(vars(scheduler)) for scheduler in _ENGINES}
    optimizers = _optimizers(engine.optimizer)
    found = []
    kinds = _scheduler_kinds()
    looks: dict[type, int] = {}  # each type's: 0 no scheduler, 1 torch's or DeepSpeed's, 2 perhaps one of another's
    for obj in gc.get_objects():
        # by type alone: isinstance reads the object's __class__, and some of gc's objects warn when read
        # (torch.distributed.reduce_op); once per type, of hundreds of thousands of objects
        kind = type(obj)
        look = looks.get(kind)
        if look is None:
            look = looks[kind] = 1 if issubclass(kind, kinds) else 2 if _scheduler_like_kind(kind) else 0
        if (look and (getattr(getattr(obj, "optimizer", None), "param_groups", None) is groups
                      or look == 2 and _holds_any(obj, optimizers))
                and (look == 1 or _holds_no_module(obj)) and id(vars(obj)) not in known):
            known.add(id(vars(obj)))
            found.append(obj)
    inner = {id(s) for obj in found for s in getattr(obj, "_schedulers", ())}
    return [obj for obj in found if id(obj) not in inner]


def _optimizers(optimizer) -> set:
    """The ids of the engine's optimizer and of the optimizers inside DeepSpeed's wrappers of it."""
    found = set()
    while optimizer is not None and id(optimizer) not in found:
        found.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def _holds_any(obj, optimizers: set) -> bool:
    """Whether an attribute of ``obj`` is one of ``optimizers`` (:func:`_optimizers`), under whatever name (probe
    26's g15: a warm-up of the script's holding it as ``self.opt`` was not found, and resumed from a count of 0,
    silently)."""
    held = getattr(obj, "__dict__", None)
    return isinstance(held, dict) and any(id(value) in optimizers for value in held.values())


def _scheduler_like_kind(kind: type) -> bool:
    """Whether objects of ``kind`` may be schedulers of a class neither torch's nor DeepSpeed's (the script's own
    warm-up, timm's ``Scheduler``): it has ``step``, ``state_dict`` and ``load_state_dict``, and is no optimizer (a
    wrapper of the script's, Lookahead), module, or class of torch's, DeepSpeed's or baft's. One is where it holds the
    engine's optimizer, under any name (``self.optimizer``, ``self.opt``), and no module (:func:`_holds_no_module`)."""
    return (all(callable(getattr(kind, name, None)) for name in ("step", "state_dict", "load_state_dict"))
            and not issubclass(kind, (torch.optim.Optimizer, torch.nn.Module))
            and kind.__module__.partition(".")[0] not in ("torch", "deepspeed", "baft"))


def _holds_no_module(obj) -> bool:
    """A scheduler holds the optimizer and numbers; a trainer of the script's that holds the optimizer holds a module
    too (its state_dict is not a scheduler's)."""
    held = getattr(obj, "__dict__", None)
    return isinstance(held, dict) and not any(isinstance(value, torch.nn.Module) for value in held.values())


def last_lrs_again(scheduler) -> None:
    """A DeepSpeed scheduler's last learning rates (``get_last_lr()``) as its latest step set them: its ``state_dict``
    holds its count alone, and it computes its rates from that (torch's keep theirs). Loaded, it read the rates it
    was made with until its next step."""
    if (not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and hasattr(scheduler, "get_lr")
            and getattr(scheduler, "last_batch_iteration", -1) >= 0):
        scheduler._last_lr = scheduler.get_lr()


def settings(scheduler) -> dict:
    """The plain attributes of the engine's scheduler that its ``state_dict`` leaves out (numbers, strings, short
    lists of them): DeepSpeed's WarmupLR, WarmupDecayLR and OneCycle keep their count alone there, and compute their
    rates from settings a loop may change once (``sched.total_num_steps = 40`` to train longer: probe 28's K4, back
    at the config's value in a resumed run, silently); torch's keep every one in theirs."""
    kept = scheduler.state_dict()
    return {name: value for name, value in vars(scheduler).items()
            if name not in kept and (isinstance(value, PLAIN) or isinstance(value, (list, tuple))
                                     and len(value) <= _MOST_RATES and all(isinstance(v, PLAIN) for v in value))}


_MOST_RATES = 4096  # a list of one rate per param group


def set_settings(scheduler, kept: dict) -> None:
    """Set what :func:`settings` gave, before the scheduler's rates are computed again (:func:`last_lrs_again`)."""
    for name, value in kept.items():
        setattr(scheduler, name, copy.copy(value))


def capture(engine) -> Optional[list]:
    """Each script scheduler's class and ``state_dict``, or None where the script has none."""
    found = script_schedulers(engine)
    step = int(getattr(engine, "global_steps", 0))
    _CAPTURED[step] = _kinds(found)
    _CAPTURED.pop(step - _KEPT_KINDS, None)
    return [(type(s).__qualname__, s.state_dict()) for s in found] or None


def _kinds(found: list) -> dict:
    return dict(sorted(Counter(type(s).__qualname__ for s in found).items()))


def replaced_since(engine, step: int) -> Optional[str]:
    """Why a survivor in place cannot go back to ``step``, or None: its loop replaced a scheduler of its own since the
    snapshot of ``step`` (a warm-up's by a decay's as the warm-up ended), and the variable that holds it is the
    loop's, which no restore takes back: the restored state would have no scheduler of its kind to go to."""
    then = _CAPTURED.get(step)
    if then is None:  # no snapshot of that step taken here: nothing to tell
        return None
    now = _kinds(script_schedulers(engine))
    if now == then:
        return None
    return (f"its loop replaced a learning-rate scheduler of its own ({then or 'none'} -> {now or 'none'}) after "
            f"the newest step every rank holds ({step}), and a restore cannot take the loop's variables back")


def restore(engine, kept: list) -> Optional[str]:
    """Load ``kept`` (:func:`capture`'s) into the script's schedulers; None where done, else why not."""
    found = _look(engine)  # the script may make them after baft.initialize's restore: not kept until found
    if found:
        _keep(engine, found)
    names = Counter(type(s).__qualname__ for s in found)
    wanted = Counter(name for name, _ in kept)
    if names != wanted:
        return (f"the snapshot holds the state of the learning-rate schedulers {dict(wanted)} the script made on "
                f"its optimizer, and the script now has {dict(names) or 'none'}")
    why = _alike(found)
    if why:
        return why
    by_name = dict(kept)
    for scheduler in found:  # a copy: some take items out of what they load (CyclicLR its _scale_fn_custom)
        scheduler.load_state_dict(copy.deepcopy(by_name[type(scheduler).__qualname__]))
    return None

