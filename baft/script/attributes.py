"""The plain values (numbers, strings, None) the model's modules of the script's own classes and of torch's hold as
attributes, and the script's classes hold as class attributes: a count a forward keeps (a loss module's ``self.calls += 1`` warming up its label smoothing), a setting
the loop changes (a ``Dropout``'s ``p`` it sets to 0 once a warm-up ends), which neither a parameter nor a buffer
holds; and the tensors and the lists, tuples and dicts of plain values the script's own modules hold as plain
attributes (a running mean a forward updates in ``self.running``, not a registered buffer; a list it appends to: probe
26, resumed from their first values, silently), as :mod:`baft.script.held` compares and keeps them. Those that changed since the
process's first ``baft.initialize`` are kept with every snapshot and set again by a restore; one set once at start
(a rank, a width) is not kept, and so not carried to another rank. DeepSpeed's modules keep theirs in what baft keeps
otherwise (the pipeline's ``micro_offset``); another library's are not read: one may set a flag as it first runs
forward, which a new process's restore must not set before it has."""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from baft.script import held, source
from baft.script.held import PLAIN
_MODULES_OWN = frozenset(vars(torch.nn.Module()))  # what every module holds (``training``): not the script's
_AT_START: list[dict[tuple[str, str], object]] = []  # (module path, attribute) -> value (held.hold's), as this
# process first protected its model
_CLASSES_AT_START: list[dict[str, type]] = []  # module path -> its class, as this process first protected its model
_CLASS_VALUES_AT_START: list[dict[str, object]] = []  # "module.Class:attribute" -> value, then


@dataclass
class _Walk:
    """``module``'s submodules as last walked (:func:`_walked`): by path, with what each held as its children and the
    classes of the script's among them."""

    module: weakref.ref
    named: list[tuple[str, torch.nn.Module]]
    modules: list[torch.nn.Module]
    leaves: list[dict]  # the ``_modules`` of those that held no children
    parents: list[tuple[dict, list]]  # those of the others, and their items then
    types: list[type]
    classes: dict[str, type]

    def same(self, module: torch.nn.Module) -> bool:
        return (self.module() is module and not any(map(len, self.leaves))
                and all(list(held.items()) == items for held, items in self.parents)
                and list(map(type, self.modules)) == self.types)


_LAST_WALK: list[_Walk] = []


def _walked(module: torch.nn.Module) -> _Walk:
    """``module``'s submodules, walked again only where one was replaced, added or removed since the last walk: every
    snapshot reads their attributes, and ``named_modules`` with the classes' MROs took 2-3 ms a snapshot of a model of
    480 modules (the lists of children compared here, ~0.1 ms)."""
    if _LAST_WALK and _LAST_WALK[0].same(module):
        return _LAST_WALK[0]
    named = list(module.named_modules())
    classes = {_named(cls): cls for _, sub in named for cls in type(sub).__mro__
               if issubclass(cls, torch.nn.Module) and not _torchs(cls) and _read(cls)}
    subs = [sub for _, sub in named]
    walk = _Walk(weakref.ref(module), named, subs, [sub._modules for sub in subs if not sub._modules],
                 [(sub._modules, list(sub._modules.items())) for sub in subs if sub._modules], list(map(type, subs)),
                 classes)
    _LAST_WALK[:] = [walk]
    return walk


def _values(module: torch.nn.Module) -> dict[tuple[str, str], object]:
    """Every such attribute of ``module`` and its submodules by (module path, attribute): a snapshot reads them all,
    and the paths are joined only for those it keeps (a model of torch's layers has thousands)."""
    own, values = _MODULES_OWN, {}
    for name, sub in _walked(module).named:
        kinds = _kinds(type(sub))
        if kinds:
            values.update(((name, attr), value) for attr, value in vars(sub).items()
                          if attr not in own and isinstance(value, kinds))
    values.update(_held_objects(module))
    values.update(_hook_objects(module))
    return values


def _held_objects(module: torch.nn.Module) -> dict[tuple[str, str], object]:
    """The plain values of the objects of the script's own classes, not modules, that ``module`` holds as attributes,
    by (attribute, theirs): a loss that is a plain callable class (``loss_fn=WarmedLoss()``, a PipelineModule's
    attribute, not a submodule) counting its calls (probe 26's g11: not kept, silently), or whose method it holds
    (``loss_fn=crit.loss``: probe 28 K5)."""
    return {(attr, its): value for attr, held_here in vars(module).items()
            for obj in [getattr(held_here, "__self__", held_here)] if _script_object(type(obj))
            for its, value in vars(obj).items() if isinstance(value, PLAIN)}


HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hook_objects(module: torch.nn.Module) -> dict[tuple[str, str], object]:
    """The plain values of the hook objects of the script's own classes that ``module``'s submodules hold (torch calls
    them, never the script: a forward hook's ``self.calls += 1``; probe 28 K1), or whose methods they hold as hooks,
    and those their parameters hold as gradient hooks (``p.register_hook(GradCount())``), by (the submodule's path and
    the hook's place, ``0[_forward_hooks/1]``, ``0[weight/0]``, theirs)."""
    found = {}
    for name, sub in _walked(module).named:
        held_here = vars(sub)
        # most hold none: passed over at one look each (every snapshot reads them: ~0.2 ms for 480 modules here)
        if (held_here.get("_forward_hooks") or held_here.get("_forward_pre_hooks")
                or held_here.get("_backward_hooks") or held_here.get("_backward_pre_hooks")):
            for kind in HOOKS:
                _add_hook_objects(found, f"{name}[{kind}", held_here.get(kind))
        for its, parameter in held_here["_parameters"].items():
            if parameter is not None and parameter._backward_hooks:
                _add_hook_objects(found, f"{name}[{its}", parameter._backward_hooks)
    return found


def _add_hook_objects(found: dict, held_at: str, hooks) -> None:
    """Add to ``found`` the plain values of the objects of the script's among ``hooks`` (a dict of them, or None), or
    whose methods they are, by (``held_at`` and the hook's place, ``0[_forward_hooks/1]``, theirs)."""
    for place, hook in enumerate(hooks.values() if hooks else ()):
        obj = getattr(hook, "__self__", hook)
        if _script_object(type(obj)):
            found.update(((f"{held_at}/{place}]", its), value) for its, value in vars(obj).items()
                         if isinstance(value, PLAIN))


def _hook_object(module: torch.nn.Module, name: str):
    """The hook object at ``name`` (``path[kind/place]``, :func:`_hook_objects`), or None where there is none."""
    path, _, where = name[:-1].rpartition("[")
    kind, _, place = where.partition("/")
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        return None
    held_hooks = vars(sub).get(kind) if kind in HOOKS else getattr(vars(sub)["_parameters"].get(kind),
                                                                   "_backward_hooks", None)
    hooks = list(held_hooks.values()) if held_hooks else []
    hook = hooks[int(place)] if int(place) < len(hooks) else None
    obj = getattr(hook, "__self__", hook)
    return obj if _script_object(type(obj)) else None


@functools.lru_cache(maxsize=None)
def _script_object(cls: type) -> bool:
    return (not issubclass(cls, (torch.nn.Module, type)) and not _torchs(cls) and _read(cls)
            and "__dict__" in dir(cls))


def _script_classes(module: torch.nn.Module) -> dict[str, type]:
    """The module classes of the script's own (not torch's) of ``module``'s submodules and their bases, by name."""
    return _walked(module).classes


def _class_values(module: torch.nn.Module) -> dict[str, object]:
    """The plain values those classes hold as class attributes, by ``"module.Class:attribute"`` (a setting the loop
    changes for every instance at once: ``Block.scale = 0.5`` at a step; probe 23: not kept, silently)."""
    return {f"{name}:{attr}": value for name, cls in _script_classes(module).items()
            for attr, value in vars(cls).items() if not attr.startswith("__") and isinstance(value, PLAIN)}


def module_attributes(module: torch.nn.Module) -> dict[str, object]:
    """Every such attribute of ``module`` and its submodules, by path (``loss_fn.calls``; ``.calls`` of ``module``)."""
    return {f"{name}.{attr}": value for (name, attr), value in _values(module).items() if held.data(value)}


def hold_module_attributes(module: torch.nn.Module) -> None:
    """Note the attributes as the process first protects ``module`` (a survivor recovering in place keeps its
    first)."""
    if not _AT_START:
        _AT_START.append({key: held.hold(value) for key, value in _values(module).items()})
        _CLASSES_AT_START.append({name: type(sub) for name, sub in module.named_modules()})
        _CLASS_VALUES_AT_START.append(_class_values(module))


def changed_module_attributes(module: torch.nn.Module, rank: int = 0) -> Optional[dict[str, object]]:
    """Those that changed since :func:`hold_module_attributes`, by path (a tensor's value, a container's copy), or None
    where none did; a tensor over :data:`~baft.script.held.MOST_BYTES` is not kept, and said once by ``rank``."""
    start = _AT_START[0] if _AT_START else {}
    changed = {}
    for (name, attr), value in _values(module).items():
        was = start.get((name, attr), held.NOT_KEPT)
        if was is value or was is not held.NOT_KEPT and not held.differs(was, value):  # the first: most, at no call
            continue
        if not isinstance(value, PLAIN):
            value = held.kept(value, rank, f"the model's {name}.{attr} (a plain attribute, not a buffer)",
                              f"Register it as a buffer in its module's __init__: self.register_buffer(\"{attr}\", "
                              f"tensor, persistent=False)" if isinstance(value, torch.Tensor) else
                              "Keep it in client_state= of baft.initialize (an object with state_dict() and "
                              "load_state_dict())")
            if value is held.NOT_KEPT:
                continue
        changed[f"{name}.{attr}"] = value
    classes = _CLASS_VALUES_AT_START[0] if _CLASS_VALUES_AT_START else {}
    changed.update((key, value) for key, value in _class_values(module).items()
                   if key not in classes or classes[key] != value or type(classes[key]) is not type(value))
    return changed or None


def keeps_class_attribute(cls: object, attr: str) -> bool:
    """Whether a snapshot keeps ``cls.attr`` where the script sets it (its loop's ``Block.scale = 0.75``): a plain
    value one of the classes of :func:`_class_values` held as this process first protected its model, which a restore
    sets as the snapshot had it, or back as it started."""
    values = _CLASS_VALUES_AT_START[0] if _CLASS_VALUES_AT_START else {}
    return isinstance(cls, type) and f"{_named(cls)}:{attr}" in values


def replaced_modules(module: torch.nn.Module) -> Optional[dict[str, str]]:
    """The submodules the script replaced by one of another class since :func:`hold_module_attributes` (a loss the loop
    swaps for another once a warm-up ends: ``engine.module.loss_fn = nn.SmoothL1Loss()``), by path: the class now at
    each (``torch.nn.modules.loss.SmoothL1Loss``), or None where none was."""
    start = _CLASSES_AT_START[0] if _CLASSES_AT_START else {}
    replaced = {name: _named(type(sub)) for name, sub in _walked(module).named if start.get(name) is not type(sub)}
    return replaced or None


def not_as_replaced(module: torch.nn.Module, replaced: Optional[dict[str, str]]) -> Optional[str]:
    """Why ``module``'s submodules are not of the classes a snapshot had (``replaced``: those the script had replaced,
    :func:`replaced_modules`; the others as this process started), or None where they are: no restore can make the
    object the script made (probe 23: a loss the loop swapped once, resumed after it, trained with the first again,
    silently)."""
    start = {name: _named(cls) for name, cls in (_CLASSES_AT_START[0] if _CLASSES_AT_START else {}).items()}
    expected = {**start, **(replaced or {})}
    for name, sub in module.named_modules():
        had = expected.get(name)
        if had is not None and had != _named(type(sub)):
            now = _named(type(sub)).rsplit(".", 1)[-1]
            return (f"the model's {name or 'module'} here is {now}, where at the restored step it was "
                    f"{had.rsplit('.', 1)[-1]}: the script replaced one by the other at a step, which a restore "
                    f"cannot undo or redo (it would train on with {now}). Replace it before each call from the "
                    f"engine's step (if engine.global_steps >= N: ...), which a resumed loop does again")
    return None


def setting(value) -> bool:
    """Whether ``value`` is a setting a snapshot keeps by value where the data pipeline holds it: a plain value or a
    small dict of them (``dataset.opts = {"half": False}``; not a table of samples)."""
    return isinstance(value, PLAIN) or (isinstance(value, dict) and len(value) <= 64 and all(
        isinstance(k, PLAIN) and isinstance(v, PLAIN) for k, v in value.items()))


def keeps_data_attribute(obj: object, attr: str) -> bool:
    """Whether a snapshot keeps ``obj.attr`` where the loop sets it (``dataset.noise = 0.05 * engine.global_steps``,
    ``sampler.weights = ...``): a :func:`setting` a dataset holds, or a tensor a sampler holds, which the data
    position of the loader reading them keeps and a restore sets again, in the workers of the restored epoch's
    iterator and its sampler's draw as that epoch began (:mod:`baft.position.settings`)."""
    value = vars(obj).get(attr) if hasattr(obj, "__dict__") else None
    if isinstance(obj, torch.utils.data.Sampler):
        return isinstance(value, torch.Tensor)
    return isinstance(obj, torch.utils.data.Dataset) and setting(value)


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def restore_module_attributes(module: torch.nn.Module, changed: Optional[dict[str, object]]) -> None:
    """Set the attributes as a snapshot had them: those it holds (``changed``; a tensor copied into the one the module
    holds, where of its shape and dtype), and the others as the process started (a survivor recovering in place may
    have changed them since)."""
    changed = changed or {}
    classes = _script_classes(module)
    for path, value in {**(_CLASS_VALUES_AT_START[0] if _CLASS_VALUES_AT_START else {}), **changed}.items():
        if ":" in path:  # a class attribute
            name, attr = path.split(":")
            if name in classes:
                setattr(classes[name], attr, value)
    start = _AT_START[0] if _AT_START else {}
    for (name, attr), was in start.items():
        if f"{name}.{attr}" not in changed:
            _set(module, name, attr, _unless_generator(held.as_started), was)
    for path, value in changed.items():
        if ":" not in path:
            name, attr = path.rsplit(".", 1)
            _set(module, name, attr, held.put, value)


def _unless_generator(value_for):
    """``value_for``, but for an attribute that holds a generator now: one a module made as it first ran forward,
    None as the process started, whose state the RNG states keep and set (:mod:`baft.script.rng`)."""
    def set_unless_generator(given, current, device):
        return held.NOT_KEPT if isinstance(current, torch.Generator) else value_for(given, current, device)
    return set_unless_generator


def _set(module: torch.nn.Module, name: str, attr: str, value_for, given) -> None:
    """Set ``attr`` of ``module``'s submodule ``name`` to ``value_for(given, its value now, the submodule's device)``
    (:func:`~baft.script.held.put`, :func:`~baft.script.held.as_started`), where that is not
    :data:`~baft.script.held.NOT_KEPT`."""
    try:  # a submodule, or an object of the script's the module holds (_held_objects) or a hook of its (_hook_objects)
        held_object = _hook_object(module, name) if name.endswith("]") else vars(module).get(name)
        held_object = getattr(held_object, "__self__", held_object)  # a method of it held (``loss_fn=crit.loss``)
        sub = held_object if _script_object(type(held_object)) else module.get_submodule(name)
    except AttributeError:  # a submodule this model has not: another model's snapshot is refused before this
        return
    current = getattr(sub, attr, None)
    value = value_for(given, current, _device(sub if isinstance(sub, torch.nn.Module) else module))
    if value is not held.NOT_KEPT and value is not current:
        setattr(sub, attr, value)


def _device(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s tensors are: a tensor attribute it had not yet is set there."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _kinds(cls: type) -> tuple:
    """The kinds of attributes read of a module of ``cls``: a script's class's plain values, tensors and containers
    (:data:`~baft.script.held.KINDS`), torch's plain values (its tensors and tuples are set as a module is made: a
    ``Conv2d``'s padding, compared at every snapshot, would cost ~2 us a layer), or none (:func:`_read`)."""
    if not _read(cls):
        return ()
    return PLAIN if _torchs(cls) else held.KINDS


def _torchs(cls: type) -> bool:
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


@functools.lru_cache(maxsize=None)
def _read(cls: type) -> bool:
    """Whether ``cls`` is torch's or defined in a file of the script's, not DeepSpeed's or another installed one (read
    once a class: a snapshot walks every module, and where a file lies takes a look at the disk). torch's own set
    their plain attributes only as they are made (probe 23: an ``nn.Dropout``'s ``p`` the loop set to 0 at a step was
    not kept, and a run resumed after it trained with dropout again, silently)."""
    if _torchs(cls):
        return True
    filename = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return filename is not None and not source.library(filename)
