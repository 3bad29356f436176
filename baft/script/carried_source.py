"""The values of the script's own a loop carries from one iteration to the next, read from its source
(:func:`carried`): the previous loss a hand-made schedule compares with, a patience count, a meter's sum and count
(:mod:`baft.script.carry` keeps and sets them)."""

from __future__ import annotations

import argparse
import ast
import functools
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Optional

import torch

from baft.script import source


@dataclass(frozen=True)
class Carried:
    """A value of the script's own a loop carries from one iteration to the next: the variable ``name`` of the
    loop's ``frame`` (or of its module; or a path of attributes from one, ``self.losses``), or its attribute
    ``attr``; ``where``: ``file:line (text)`` of the statement that carries it. The frame is held as long as this is
    (a snapshot at exit reads it after the loop has returned)."""

    where: str
    name: str
    attr: Optional[str] = None
    frame: object = field(default=None, compare=False, repr=False)
    # the loop reads it before its call to train_batch in an iteration (``best = min(best, engine.train_batch())``,
    # a check at the loop's top): set at that call, a resumed process's first iteration would have read it already
    read_before_call: bool = False
    module_global: bool = False  # ``name`` is a global of the frame's module (``global best`` in a function)
    whole: bool = False  # an object of the script's own, kept whole (:func:`_changed_within`)
    module: Optional[str] = None  # ``name`` is a global of this module of the script's (not the frame's)
    cell: bool = False  # ``attr`` is a variable of the closure of the function ``name`` holds (``nonlocal best``)

    @property
    def key(self) -> str:
        own = self.name if self.attr is None else f"{self.name}.{self.attr}"
        return own if self.module is None else f"{self.module}:{own}"


def carried(filename: str, loop: ast.AST, scope: ast.AST, frame, kept) -> list[Carried]:
    """The values ``loop`` (in ``scope``, run in ``frame``) carries from one call to the next: its variables, the
    attributes of objects from outside it (not of ``kept``) and the module's globals, each in order of its lines."""
    methods = _methods_called(loop, frame, kept)
    found = (_carried_variables(filename, loop, scope, frame) + _carried_attributes(filename, loop, frame, kept, methods)
             + _changed_within(loop, frame, methods) + _carried_globals(filename, loop, frame)
             + _carried_cells(loop, frame)
             + _other_modules_globals(filename, loop, frame))
    keys = {value.key for value in found}  # a helper's count the loop calls, found again with the forwards' counts
    return found + [value for value in _counted_inside_the_call(filename, frame) if value.key not in keys]


# methods that change a list, dict, set or deque in place
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "remove", "clear", "update",
            "setdefault", "add", "discard", "sort", "reverse", "rotate"}


def _carried_variables(filename: str, loop: ast.AST, scope: ast.AST, frame) -> list[Carried]:
    """The names ``loop`` (run in ``frame``) carries from one iteration to the next, in source order of the
    statements that carry them. Carried: the loop assigns it and reads it before it assigns it in the same
    iteration (in source order), or folds it into itself (``meter = 0.9 * meter + 0.1 * loss``, ``bad += 1``), or
    changes it in place and reads it otherwise (``losses.append(loss)``, then ``mean(losses[-5:])``); and its scope
    starts it before the loop at nothing but a literal (``prev = None``, ``best = float("inf")``, ``losses = []``): a
    value set otherwise there may be the script's own resume of it. A dict or list whose tensors the loop changes in
    place from themselves (an EMA of the weights, ``ema[n].mul_(0.99).add_(p)``) may start as a copy of the weights."""
    def position(node):
        return node.lineno, node.col_offset

    def names_read(node):
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    stores: dict[str, list] = {}
    changes: dict[str, list] = {}  # changed in place: by a method, or an item assigned
    folds: dict[str, list] = {}  # their tensor items changed in place from themselves (``ema[n].mul_(0.99).add_(p)``)
    changed = set()  # the names those read (ids), not reads of what they hold
    iterated = _iterated(loop)
    for node in ast.walk(loop):
        targets = source.targets(node)
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store):
                    stores.setdefault(name.id, []).append(node)
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                changes.setdefault(target.value.id, []).append(node)
                changed.add(id(target.value))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Name)):
            changes.setdefault(node.func.value.id, []).append(node)
            changed.add(id(node.func.value))
        held = _items_changed_in_place(node, iterated)
        if held is not None:
            folds.setdefault(held.id, []).append(node)
            changed.add(id(held))  # the item's (``ema`` of ``ema[n]``), not a read of the variable otherwise
    reads = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    reached, call = source.reached(filename, loop), source.call_position(frame)

    def elsewhere(name):
        # a global a function of the file reads, a layer's forward in the next call (probe 23: a noise scale the loop
        # set to 0 once was back at its first value in a run resumed after it, silently), or a local of the loop's
        # function a function nested in it reads (probe 26 G9: a loss_fn closing over main's ``weight``)
        return (_read_as_global(scope, name, outside=reached) if isinstance(scope, ast.Module)
                else _read_as_closure(scope, name, outside=reached))

    found = []
    for name, assignments in stores.items():
        first = min(position(a) for a in assignments)
        read = [n for n in reads if n.id == name]
        folded = [a for a in assignments if isinstance(a, ast.AugAssign) or name in names_read(a.value)]
        if ((elsewhere(name) or read and (folded or any(position(n) < first for n in read)))
                and _started_at_a_literal(name, loop, scope) and not _recomputed_from_step(name, loop, scope, call)):
            found.append((name, min(folded or assignments, key=position)))
    for name, nodes in changes.items():
        # a dict's item a layer's forward reads (probe 26 G16: ``CTX["step"] = engine.global_steps`` after the call)
        if (name not in stores and (any(n.id == name and id(n) not in changed for n in reads) or elsewhere(name))
                and _started_at_a_literal(name, loop, scope)):
            found.append((name, min(nodes, key=position)))
    for name, nodes in folds.items():
        if name not in stores and name not in {n for n, _ in found} and _started_at_a_literal(
                name, loop, scope, or_weights=True):
            found.append((name, min(nodes, key=position)))
    return [Carried(f"{filename}:{node.lineno} ({ast.unparse(node)})", name, frame=frame,
                    # a list the call's own statement fills (``losses.append(engine.train_batch())``) is refilled
                    read_before_call=any(n.id == name and position(n) < call and id(n) not in changed for n in reads))
            for name, node in sorted(found, key=lambda item: position(item[1]))]


# what the loop does where a value of the engine's step it keeps changed (an epoch's start): nothing that a resumed
# process, doing it again at its first iteration, would do otherwise than the uninterrupted run did there
REDONE = {"iter", "set_epoch", "print"}


def _recomputed_from_step(name: str, loop: ast.AST, scope: ast.AST, call: tuple[int, int]) -> bool:
    """Whether ``loop`` sets ``name`` from the engine's step alone before its ``call`` towards ``train_batch``, and
    reads it before that only to tell whether it changed, doing nothing then but set it, make an iterator and set a
    sampler's epoch (probe 27's W2: ``if engine.global_steps // n != epoch: epoch = engine.global_steps // n;
    sampler.set_epoch(epoch); it = iter(loader)``): a resumed process recomputes it, it is not carried."""
    stores = [node for node in ast.walk(loop) if any(isinstance(n, ast.Name) and n.id == name
                                                     for t in source.targets(node) for n in ast.walk(t))]
    if not stores or not all(isinstance(node, ast.Assign) and (node.end_lineno, node.end_col_offset) < call
                             and source.reads_engine_step(node.value, scope)
                             and not any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.value))
                             for node in stores):
        return False
    first = min((node.lineno, node.col_offset) for node in stores)
    checks = [node for node in ast.walk(loop) if isinstance(node, ast.If) and not node.orelse
              and _tells_step_changed(node.test, name, scope)]
    tested = {id(n) for node in checks for n in ast.walk(node.test)}
    early = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id == name
             and (n.lineno, n.col_offset) < first]
    return all(id(n) in tested for n in early) and all(_redone(statement, name) for node in checks
                                                       for statement in node.body)


def _tells_step_changed(test: ast.AST, name: str, scope: ast.AST) -> bool:
    """Whether ``test`` compares ``name`` with a value of the engine's step (``engine.global_steps // n != epoch``)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.NotEq, ast.Eq))):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(side, ast.Name) and side.id == name and source.reads_engine_step(other, scope)
               for side, other in (sides, sides[::-1]))


def _redone(statement: ast.AST, name: str) -> bool:
    """Whether ``statement`` is one of what :data:`REDONE` allows: ``name`` or an iterator assigned, a sampler's epoch
    set, a print (a step's value assigned to another name, an epoch's first step, would differ resumed)."""
    if isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
        value = statement.value
        return (isinstance(value, ast.Call) and source.called_name(value.func) == "iter"
                or all(t.id == name for t in statement.targets))
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and source.called_name(statement.value.func) in REDONE)


def _iterated(loop: ast.AST) -> dict[str, str]:
    """The names the loop's ``for`` statements bind to the items of a variable (``for e, p in zip(ema, params)``,
    ``for e in ema.values()``), each to that variable's."""
    def container(expr):
        if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
                and expr.func.attr in ("values", "items")):
            expr = expr.func.value
        return expr.id if isinstance(expr, ast.Name) else None

    bound = {}
    for node in ast.walk(loop):
        if not isinstance(node, ast.For):
            continue
        pairs = [(node.target, node.iter)]
        if isinstance(node.iter, ast.Call) and source.called_name(node.iter.func) == "zip" and isinstance(
                node.target, ast.Tuple) and len(node.target.elts) == len(node.iter.args):
            pairs = list(zip(node.target.elts, node.iter.args))
        for target, iterated in pairs:
            name = container(iterated)
            if name is not None:
                bound.update((n.id, name) for n in ast.walk(target) if isinstance(n, ast.Name))
    return bound


# a tensor's in-place methods that do not read what it holds: an item they change is not folded into itself
OVERWRITES = {"copy_", "zero_", "fill_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "set_",
              "resize_", "requires_grad_", "detach_", "share_memory_"}


def _in_place(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_")
            and not node.func.attr.startswith("_"))


def _items_changed_in_place(node: ast.AST, iterated: dict) -> Optional[ast.Name]:
    """The variable whose tensor item ``node`` changes in place from itself, a tensor method's (``ema[n].mul_(0.99)``,
    ``average.lerp_(p, 0.1)`` over ``zip(ema, ...)``: ``iterated``, :func:`_iterated`), or None."""
    if not _in_place(node):
        return None
    first, held, items = node.func.attr, node.func.value, False
    while isinstance(held, ast.Subscript) or _in_place(held):
        if isinstance(held, ast.Subscript):
            held, items = held.value, True
        else:
            first, held = held.func.attr, held.func.value
    if first in OVERWRITES:
        return None
    if isinstance(held, ast.Name) and (items or held.id in iterated):
        return held if items else ast.Name(id=iterated[held.id], ctx=ast.Load())
    return None


def _carried_attributes(filename: str, loop: ast.AST, frame, kept, methods: list) -> list[Carried]:
    """The attributes of objects from outside the loop (run in ``frame``) that the loop, a function or method of the
    same file it calls, or a method of the script's own it calls on such an object (``meter.update(loss)``, its class
    in any file of the script's: ``methods``, :func:`_methods_called`) carries from one call to the next
    (``self.prev = loss`` after reading ``self.prev`` in the same body, ``self.sum += val``), in order of their lines.
    Only where the attribute's file sets it elsewhere to nothing but a literal (``self.prev = None`` in ``__init__``:
    no resume of its own), on an object that is not one of ``kept``."""
    covered = {(file, body.lineno) for _, _, file, body in methods}
    # (the name in ``frame`` that ``self`` stands for in a method called on it, or None; the loop's call of it; file)
    bodies = [(None, None, filename, body) for body in source.reached(filename, loop)
              if body is loop or (filename, body.lineno) not in covered] + methods
    inside = {(file, node.lineno, node.col_offset) for _, _, file, body in bodies for node in ast.walk(body)
              if isinstance(node, ast.stmt)}
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    call, ends = source.call_position(frame), source.calls_end(loop)
    early = set()  # (name, attr) read before the call
    found = []
    for receiver, called, file, body in bodies:
        this = body.args.args[0].arg if receiver is not None and body.args.args else None

        def attribute(node):  # (the path of its owner in ``frame``, the attribute): ``self.state.loss_sum`` too
            owner = source.dotted(node.value) if isinstance(node, ast.Attribute) else ""
            if not owner or receiver is None:
                return (owner, node.attr) if owner else None
            head, _, rest = owner.partition(".")
            return (f"{receiver}.{rest}" if rest else receiver, node.attr) if head == this else None

        # a name the body makes stand for such an attribute (``s = self.state``: ``s["mean"] = ...`` changes it)
        aliases = {node.targets[0].id: attribute(node.value) for node in ast.walk(body)
                   if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                   and isinstance(node.value, ast.Attribute) and attribute(node.value)}

        def attribute_or_alias(node):
            return aliases.get(node.id) if isinstance(node, ast.Name) else attribute(node)

        reads = [(node.lineno, node.col_offset, attribute(node)) for node in ast.walk(body)
                 if attribute(node) and isinstance(node.ctx, ast.Load)]
        reads += [(node.lineno, node.col_offset, aliases[node.id]) for node in ast.walk(body)
                  if isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load)]
        elsewhere = {(line, col) for f, line, col in inside if f == file}
        early |= {attribute(node) for node in ast.walk(body) if attribute(node) and isinstance(node.ctx, ast.Load)
                  and (source.in_iteration(loop, ends, body, node) if called is None else ends.get(called, (0, 0))) < call}
        for node in ast.walk(body):
            targets = source.targets(node)
            changed = None  # a list, dict or set the attribute holds, changed in place and read otherwise
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                    and attribute_or_alias(node.func.value)):
                changed = node.func.value
                targets = [changed]
            # an alias's item set (``s["mean"] = ...``, ``s["bad"] += 1``): its attribute changed in place
            items = [t.value for target in targets for t in ast.walk(target) if isinstance(t, ast.Subscript)
                     and isinstance(t.value, ast.Name) and t.value.id in aliases]
            for target in (t for target in targets for t in ast.walk(target)):
                key = attribute(target) if not isinstance(target, ast.Name) else (
                    aliases[target.id] if target in items or target is changed else None)
                if key is None or key[0].split(".")[0] in made or key[1] in source.ENGINE_STEP:
                    continue
                if changed is not None:
                    folded = sum(read == key for _, _, read in reads) > 1  # read besides as the receiver
                else:
                    folded = isinstance(node, ast.AugAssign) or any(attribute_or_alias(n) == key
                                                                    for n in ast.walk(node.value))
                before = any((line, col) < (node.lineno, node.col_offset) and read == key for line, col, read in reads)
                owner = source.value_in(frame, key[0])
                if owner is None or any(owner is k for k in kept):
                    continue
                if (((folded or before) and _attribute_started_at_a_literal(key[1], file, elsewhere, type(owner)))
                        or _scripts_module_setting(owner, key[1])
                        or _setting_read_in_the_call(owner, key, filename, loop)):
                    found.append(((file, node.lineno), f"{file}:{node.lineno} ({ast.unparse(node)})", key))
    unique = {key: (line, where) for line, where, key in sorted(found, reverse=True)}  # each key's first
    return [Carried(where, *key, frame=frame, read_before_call=key in early)
            for key, (line, where) in sorted(unique.items(), key=lambda kv: kv[1])]


def _scripts_module_setting(owner, attr: str) -> bool:
    """Whether ``owner`` is a module of the script's (a config module it imports) whose own statements start ``attr``
    at nothing but a literal: whatever reads it (a layer's forward) reads what the loop set last (probe 23:
    ``settings.NOISE = 0.0`` at a step was back at its first value in a run resumed after it, silently)."""
    filename = getattr(owner, "__file__", None) if isinstance(owner, types.ModuleType) else None
    if filename is None or source.library(filename):
        return False
    tree = source.parsed(filename)
    return tree is not None and _started_at_module_level_at_a_literal(attr, tree)


OPTIONS = (argparse.Namespace, types.SimpleNamespace)


def _setting_read_in_the_call(owner, key: tuple[str, str], filename: str, loop: ast.AST) -> bool:
    """Whether the attribute ``key`` (owner's path, attribute) the loop sets is a plain value read inside train_batch:
    of a torch module (a loss module outside the model that a loss function closes over: ``crit.delta = 0.1``), or of
    the script's options (argparse's Namespace) that a function of the file reads which the loop does not call and
    which is not the one around it (the loss: ``args.weight``). Probe 26 G10: set once at a step, resumed after it,
    it was back at its first value, silently; a survivor in place takes it back with the restore."""
    if not isinstance(getattr(owner, key[1], None), (bool, int, float, str)):
        return False
    if isinstance(owner, torch.nn.Module):
        return type(owner).__module__.startswith("torch.")
    if not isinstance(owner, OPTIONS):
        return False
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    skipped = {(n.lineno, n.col_offset) for body in source.reached(filename, loop) for n in ast.walk(body)
               if isinstance(n, functions)}
    for function in ast.walk(source.parsed(filename)):
        if (not isinstance(function, functions) or (function.lineno, function.col_offset) in skipped
                or function.lineno <= loop.lineno <= (function.end_lineno or function.lineno)):
            continue
        if any(isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr == key[1]
               and source.dotted(n.value) == key[0] for n in ast.walk(function)):
            return True
    return False


def _methods_called(loop: ast.AST, frame, kept) -> list[tuple[str, str, str, ast.AST]]:
    """The methods of the script's own the loop (run in ``frame``) calls on objects from outside it
    (``meter.update(loss)``, ``self.losses.update(loss)``: defined in a file of the script's, not a library's, on an
    object that is not one of ``kept`` and does not keep itself with ``state_dict``), and those they call on
    ``self``: (the object's name in ``frame``, the method the loop calls on it, the file, the method's definition)."""
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    todo = [(source.dotted(node.func.value), node.func.attr, node.func.attr) for node in ast.walk(loop)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and source.dotted(node.func.value)
            and source.dotted(node.func.value).split(".")[0] not in made]
    # an object called itself (``factor = warm()``): its class's ``__call__`` (probe 26's g13: its count was not read)
    todo += [(node.func.id, node.func.id, "__call__") for node in ast.walk(loop)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in made]
    found, seen = [], set()
    while todo:
        name, called, method = todo.pop(0)
        owner = source.value_in(frame, name)
        if (owner is None or isinstance(owner, types.ModuleType) or any(owner is k for k in kept)
                or callable(getattr(owner, "state_dict", None))):
            continue
        function = getattr(type(owner), method, None)
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is None or (name, code) in seen or source.library(code.co_filename):
            continue
        seen.add((name, code))
        definition = defined_at(code)
        if definition is None or not definition.args.args:
            continue
        found.append((name, called, code.co_filename, definition))
        this = definition.args.args[0].arg
        todo += [(name, called, node.func.attr) for node in ast.walk(definition)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == this]
    return found


def _changed_within(loop: ast.AST, frame, methods: list) -> list[Carried]:
    """The objects of the script's own whose methods the loop calls (``methods``, :func:`_methods_called`) where those
    change an object an attribute holds through that object's own methods (torchvision's ``MetricLogger.update``:
    ``self.meters[name].update(value)``, each meter's count and total): kept whole, where their attributes are data
    (:func:`baft.script.carry.object_data`). Their attributes alone do not say that state changed (probe: a resumed
    run's running averages started again, silently)."""
    call, ends = source.call_position(frame), source.calls_end(loop)
    found = {}
    for receiver, called, file, body in methods:
        this = body.args.args[0].arg
        for node in ast.walk(body):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            held = node.func.value  # what the method is called on: reached from an attribute of ``this``, deeper
            path = []
            while isinstance(held, (ast.Attribute, ast.Subscript, ast.Call)):
                path.append(held)
                held = held.value if not isinstance(held, ast.Call) else held.func
            nested = len(path) > 1 or path and node.func.attr not in MUTATORS  # not a list's append (attributes')
            if isinstance(held, ast.Name) and held.id == this and nested and receiver not in found:
                found[receiver] = Carried(f"{file}:{node.lineno} ({ast.unparse(node)})", *_split(receiver),
                                          frame=frame, read_before_call=ends.get(called, (0, 0)) < call, whole=True)
    return list(found.values())


def _split(path: str) -> tuple[str, Optional[str]]:
    """A path of attributes as (its owner's path, the last attribute), or (a name, None)."""
    owner, _, attr = path.rpartition(".")
    return (owner, attr) if owner else (path, None)


def defined_at(code: types.CodeType) -> Optional[ast.AST]:
    """The definition of the function ``code`` is, read from its file; None where it cannot be read."""
    tree = source.parsed(code.co_filename)
    return next((node for node in ast.walk(tree or ast.Module(body=[], type_ignores=[]))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name
                 and code.co_firstlineno in (node.lineno, *(d.lineno for d in node.decorator_list))), None)


def _carried_globals(filename: str, loop: ast.AST, frame) -> list[Carried]:
    """The module's globals a function or method of the same file the loop calls carries from one call to the next
    (``global best`` and ``best = min(best, loss)`` in its ``after_step``, or a count it adds to that another reads
    first, or a setting it changes that a function the loop does not call reads: a layer's forward), started at the
    module's level at nothing but a literal, in order of their lines."""
    tree, bodies, ends = source.parsed(filename), source.reached(filename, loop), source.calls_end(loop)
    call = source.call_position(frame)
    reads = [(body, n) for body in bodies for n in ast.walk(body)
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    found = {}
    for body in bodies[1:]:
        declared = {name for node in ast.walk(body) if isinstance(node, ast.Global) for name in node.names}
        arguments = {a.arg for a in ast.walk(body.args) if isinstance(a, ast.arg)} if hasattr(body, "args") else set()
        local = {n.id for n in ast.walk(body) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | arguments
        for node in ast.walk(body):
            targets = source.targets(node)
            names = {n.id for t in targets for n in ast.walk(t)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            # a global dict's or list's items set, no ``global`` needed (``STATS["best"] = loss``: probe 27's h5)
            items = {t.value.id for target in targets for t in ast.walk(target)
                     if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)} - local
            for name in (names & declared | items) - set(found):
                read = [(where, n) for where, n in reads if n.id == name]
                stored_at = source.in_iteration(loop, ends, body, node)
                folded = isinstance(node, ast.AugAssign) or any(
                    isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.value))
                earlier = any(source.in_iteration(loop, ends, where, n) < stored_at
                              or (where is body and (n.lineno, n.col_offset) < (node.lineno, node.col_offset))
                              for where, n in read)
                if ((read and (folded or earlier) or _read_as_global(tree, name, outside=bodies))
                        and _started_at_module_level_at_a_literal(name, tree)):
                    found[name] = Carried(f"{filename}:{node.lineno} ({ast.unparse(node)})", name, frame=frame,
                                          read_before_call=any(source.in_iteration(loop, ends, where, n) < call
                                                               for where, n in read),
                                          module_global=True)
    return sorted(found.values(), key=lambda c: c.where)


def _carried_cells(loop: ast.AST, frame) -> list[Carried]:
    """The variables of an enclosing function that a closure the loop calls carries from one call to the next, the way
    :func:`_carried_globals` finds a module's (``nonlocal best`` and ``best = min(best, loss)`` in the
    ``on_step_end`` that ``make_plateau()`` returned, or items of a dict it closes over set: probe 27's h6, a resumed
    run's plateau rule started again, silently), started in the enclosing function at nothing but a literal, in order
    of their lines."""
    call = source.call_position(frame)
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    found = {}
    for node in ast.walk(loop):
        path = source.dotted(node.func) if isinstance(node, ast.Call) else ""
        function = source.value_in(frame, path) if path and path.split(".")[0] not in made else None
        function = getattr(function, "__func__", function)  # a method of an object the loop calls
        if not isinstance(function, types.FunctionType) or not function.__closure__:
            continue
        code = function.__code__
        definition = None if source.library(code.co_filename) else defined_at(code)
        enclosing = _enclosing(source.parsed(code.co_filename), definition) if definition is not None else None
        if enclosing is None:
            continue
        for store, name in _closure_changes(definition, set(code.co_freevars)):
            if (path, name) not in found and _started_at_a_literal(name, definition, enclosing):
                found[(path, name)] = store.lineno, Carried(
                    f"{code.co_filename}:{store.lineno} ({ast.unparse(store)})", path, name, frame=frame, cell=True,
                    read_before_call=(node.end_lineno, node.end_col_offset) < call)
    return [value for _, value in sorted(found.values(), key=lambda item: item[0])]


def _closure_changes(definition: ast.AST, free: set) -> list[tuple[ast.AST, str]]:
    """(statement, variable) for each variable of ``free`` (the closure's) that ``definition`` carries: assigns after
    ``nonlocal`` and reads before or folds into itself, or changes in place (an item set, a list's append) and reads
    otherwise."""
    declared = {name for node in ast.walk(definition) if isinstance(node, ast.Nonlocal) for name in node.names}
    changes = []  # (statement, name, the Name node changed in place, or None where assigned)
    for node in ast.walk(definition):
        for target in source.targets(node):
            changes += [(node, n.id, None) for n in ast.walk(target) if isinstance(n, ast.Name)
                        and isinstance(n.ctx, ast.Store) and n.id in declared]
            changes += [(node, t.value.id, t.value) for t in ast.walk(target) if isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Name) and t.value.id in free]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in free):
            changes.append((node, node.func.value.id, node.func.value))
    receivers = {id(held) for _, _, held in changes if held is not None}
    reads = [n for n in ast.walk(definition) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
             and id(n) not in receivers]
    found = []
    for node, name, held in changes:
        read = [n for n in reads if n.id == name]
        value = getattr(node, "value", None)
        folded = isinstance(node, ast.AugAssign) or value is not None and any(n in read for n in ast.walk(value))
        earlier = any((n.lineno, n.col_offset) < (node.lineno, node.col_offset) for n in read)
        if (read or isinstance(node, ast.AugAssign)) and (folded or earlier or held is not None):
            found.append((node, name))
    return found


def _enclosing(tree: Optional[ast.Module], definition: ast.AST) -> Optional[ast.AST]:
    """The function of ``tree`` ``definition`` (of another parse of its file) is defined in, innermost; None where it
    is not in one."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    around = [f for f in ast.walk(tree or ast.Module(body=[], type_ignores=[])) if isinstance(f, functions)
              and (f.lineno, f.col_offset) < (definition.lineno, definition.col_offset)
              and (f.end_lineno, f.end_col_offset) >= (definition.end_lineno, definition.end_col_offset)]
    return max(around, key=lambda f: (f.lineno, f.col_offset), default=None)


def _counted_inside_the_call(filename: str, frame) -> list[Carried]:
    """The globals of the script's file, or of another module of the script's (its model's file), that a function or
    method of that file no code of it calls by name adds to (called inside train_batch: a layer's forward, ``global
    CALLS`` and ``CALLS += 1``; probe 26 G6: a warm-up from it started again in a resumed run, silently), started at
    that module's level at nothing but a literal, in order of their lines."""
    found = []
    for file, module in [(filename, None), *_scripts_modules(filename)]:
        try:
            counted = _counted_globals(file, os.stat(file).st_mtime_ns)
        except OSError:
            continue
        found += [Carried(where, name, frame=frame, module_global=module is None, module=module)
                  for where, name in counted]
    return found


@functools.lru_cache(maxsize=256)
def _counted_globals(file: str, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    """(``file:line (text)``, name) of :func:`_counted_inside_the_call`'s globals of ``file`` as it is at
    ``mtime_ns`` (read once a version: every module of the script's is read at each loop's first call)."""
    tree = source.parsed(file)
    if tree is None:
        return ()
    called = {source.called_name(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    counted = {}
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.name in called:
            continue
        declared = {name for node in ast.walk(function) if isinstance(node, ast.Global) for name in node.names}
        if not declared:
            continue
        for node in ast.walk(function):
            stored = {n.id for t in source.targets(node) for n in ast.walk(t) if isinstance(n, ast.Name)}
            for name in stored & declared - set(counted):
                folded = isinstance(node, ast.AugAssign) or any(
                    isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.value))
                if folded and _started_at_module_level_at_a_literal(name, tree):
                    counted[name] = node.lineno, f"{file}:{node.lineno} ({ast.unparse(node)})"
    return tuple((where, name) for name, (_, where) in sorted(counted.items(), key=lambda item: item[1][0]))


def _scripts_modules(filename: str) -> list[tuple[str, str]]:
    """(file, module name) of the modules of the script's own imported now, but the one of ``filename``."""
    here = os.path.realpath(filename)
    return [(module.__file__, name) for name, module in list(sys.modules.items())
            if name != "__main__" and isinstance(getattr(module, "__file__", None), str)
            and _scripts_file(module.__file__) and os.path.realpath(module.__file__) != here]


@functools.lru_cache(maxsize=None)
def _scripts_file(file: str) -> bool:
    """Whether ``file`` is Python source of the script's own (read once a file: torch alone imports thousands)."""
    return file.endswith(".py") and not source.library(file)


def _read_as_global(tree: ast.Module, name: str, outside) -> bool:
    """Whether a function or method of ``tree`` not in ``outside`` (the loop and the functions it calls, nor inside
    one of them) reads the global ``name``: one the loop does not call itself (a layer's forward, inside
    ``train_batch``) reads what the loop set last."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    # by where they are: ``outside`` may come from another parse of the file
    skipped = {(n.lineno, n.col_offset) for body in outside for n in ast.walk(body) if isinstance(n, functions)}
    for function in ast.walk(tree):
        if not isinstance(function, functions) or (function.lineno, function.col_offset) in skipped:
            continue
        declared = {n for node in ast.walk(function) if isinstance(node, ast.Global) for n in node.names}
        arguments = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
        names = [n for n in ast.walk(function) if isinstance(n, ast.Name) and n.id == name]
        local = name in arguments or any(isinstance(n.ctx, ast.Store) for n in names)
        if (name in declared or not local) and any(isinstance(n.ctx, ast.Load) for n in names):
            return True
    return False


def _read_as_closure(scope: ast.AST, name: str, outside) -> bool:
    """Whether a function nested in the function ``scope`` and not in ``outside`` (the loop and the functions it
    calls) reads ``scope``'s local ``name`` (not assigning it, nor declaring it global): a loss function given to the
    model reads in the next call what the loop set last."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    skipped = {(n.lineno, n.col_offset) for body in outside for n in ast.walk(body) if isinstance(n, functions)}
    for function in ast.walk(scope):
        if function is scope or not isinstance(function, functions) or (function.lineno, function.col_offset) in skipped:
            continue
        declared = {n for node in ast.walk(function) if isinstance(node, ast.Global) for n in node.names}
        arguments = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
        names = [n for n in ast.walk(function) if isinstance(n, ast.Name) and n.id == name]
        local = name in arguments | declared or any(isinstance(n.ctx, ast.Store) for n in names)
        if not local and any(isinstance(n.ctx, ast.Load) for n in names):
            return True
    return False


def _other_modules_globals(filename: str, loop: ast.AST, frame) -> list[Carried]:
    """The globals of another module of the script's that a function of it the loop calls carries from one call to
    the next (a logging helper's ``global total, count`` and ``total += loss``; probe: a resumed run's averages
    started again, silently), started at that module's level at nothing but a literal."""
    call, ends = source.call_position(frame), source.calls_end(loop)
    found = {}
    for node in ast.walk(loop):
        function = source.value_in(frame, source.dotted(node.func)) if isinstance(node, ast.Call) else None
        if not isinstance(function, types.FunctionType) or function.__code__.co_filename == filename:
            continue
        code = function.__code__
        definition = None if source.library(code.co_filename) else defined_at(code)
        if definition is None:
            continue
        tree = source.parsed(code.co_filename)
        declared = {name for n in ast.walk(definition) if isinstance(n, ast.Global) for name in n.names}
        for store in ast.walk(definition):
            for name in {n.id for t in source.targets(store) for n in ast.walk(t)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} & declared:
                key = (function.__module__, name)
                read = [n for n in ast.walk(definition) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                        and n.id == name]
                folded = isinstance(store, ast.AugAssign) or any(n in read for n in ast.walk(store.value))
                earlier = any((n.lineno, n.col_offset) < (store.lineno, store.col_offset) for n in read)
                if (key not in found and read and (folded or earlier)
                        and _started_at_module_level_at_a_literal(name, tree)):
                    found[key] = Carried(f"{code.co_filename}:{store.lineno} ({ast.unparse(store)})", name,
                                         frame=frame, module=function.__module__,
                                         read_before_call=source.in_iteration(loop, ends, loop, node) < call)
    return list(found.values())


def _started_at_module_level_at_a_literal(name: str, tree: ast.Module) -> bool:
    """Whether the module's own statements (not its functions' or classes') assign ``name``, and only literals."""
    started, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            started += source.assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)
        todo.extend(ast.iter_child_nodes(node))
    return bool(started) and all(_literal(value) for value in started)


def _attribute_started_at_a_literal(attr: str, filename: str, inside: set, owner_class: type) -> bool:
    """Whether the file assigns ``.attr`` outside the statements at ``inside`` (line, column), but to ``self`` in a
    class that is not ``owner_class`` nor one of its bases (another class's ``self.state = State()``: probe 27, an
    HF-style callback's ``self.state = {...}`` beside it was not carried), or such a class defaults it (a
    dataclass's ``loss_sum: float = 0.0``), and only literals."""
    tree = source.parsed(filename)
    ours = {cls.__name__ for cls in owner_class.__mro__}
    classes = [cls for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)]
    others = {(node.lineno, node.col_offset) for cls in classes if cls.name not in ours for node in ast.walk(cls)
              if isinstance(node, ast.stmt)}
    started = [v for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               and (node.lineno, node.col_offset) not in inside and node.value is not None
               for v in source.assigned(node, lambda t: isinstance(t, ast.Attribute) and t.attr == attr and not (
                   (node.lineno, node.col_offset) in others and isinstance(t.value, ast.Name) and t.value.id == "self"))]
    started += [v for cls in classes if cls.name in ours for node in cls.body
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                for v in source.assigned(node, lambda t: isinstance(t, ast.Name) and t.id == attr)]
    return bool(started) and all(_literal(value) for value in started)


EMPTY = {"list", "dict", "set", "tuple", "deque", "OrderedDict", "defaultdict", "Counter"}  # made empty by a call
FACTORIES = EMPTY | {"int", "float", "str", "bool"}  # what a defaultdict makes its missing items with


def _literal(value: ast.AST) -> bool:
    """A number, a string, None, a bool, ``float("inf")``, an empty or literal list, tuple, dict or set, one made by
    a call (``deque(maxlen=4)``, ``defaultdict(int)``, ``Counter()``, ``dict()``), and a dataclass field of one
    (``field(default=0)``, ``field(default_factory=list)``); a list, tuple, set or dict of them
    (``{"best": float("inf"), "bad": 0}``)."""
    if isinstance(value, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
        elements = [*value.keys, *value.values] if isinstance(value, ast.Dict) else value.elts
        return all(element is not None and _literal(element) for element in elements)
    if isinstance(value, ast.Call) and source.called_name(value.func) in ("float", "int") and not value.keywords:
        return all(_literal(arg) for arg in value.args)
    if isinstance(value, ast.Call) and source.called_name(value.func) in EMPTY:
        return _made_empty(value)
    if isinstance(value, ast.Call) and source.called_name(value.func) == "field" and not value.args:
        given = {k.arg: k.value for k in value.keywords}
        factory = given.get("default_factory")
        return ("default" in given and _literal(given["default"])
                or isinstance(factory, (ast.Name, ast.Attribute)) and source.called_name(factory) in EMPTY)
    try:
        ast.literal_eval(value)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _made_empty(call: ast.Call) -> bool:
    """Whether ``call`` (of a container type, :data:`EMPTY`) makes one of literals: ``deque(maxlen=n)`` of any size,
    ``defaultdict(int)`` of a plain factory; not one of what a variable holds (``list(state["losses"])``: the script's
    own resume)."""
    args = list(call.args)
    if source.called_name(call.func) == "defaultdict" and args:
        factory = args.pop(0)
        if not (isinstance(factory, (ast.Name, ast.Attribute)) and source.called_name(factory) in FACTORIES
                or isinstance(factory, ast.Lambda) and _literal(factory.body)):
            return False
    keywords = [k.value for k in call.keywords if not (k.arg == "maxlen" and source.called_name(call.func) == "deque")]
    return all(_literal(value) for value in args + keywords)


WEIGHTS = ("parameters", "named_parameters", "state_dict")  # what a copy of the model's weights is made from


def _started_at_a_literal(name: str, loop: ast.AST, scope: ast.AST, or_weights: bool = False) -> bool:
    """Whether ``scope`` assigns ``name`` outside ``loop``, and only a literal (:func:`_literal`), or
    (``or_weights``) a copy of the model's weights (``{n: p.detach().clone() for n, p in model.named_parameters()}``,
    an EMA's start: a resumed process makes it from the restored weights, not as the snapshot held it)."""
    inside = range(loop.lineno, (loop.end_lineno or loop.lineno) + 1)
    started = [v for node in ast.walk(scope) if isinstance(node, (ast.Assign, ast.AnnAssign))
               and node.value is not None and node.lineno not in inside
               for v in source.assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)]
    return bool(started) and all(_literal(value) or or_weights and _copies_weights(value) for value in started)


def _copies_weights(value: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in WEIGHTS
               for n in ast.walk(value))
