"""The values of the script's own a loop carries from one iteration to the next, read from its source
(:func:`carried`): the previous loss a hand-made schedule compares with, a patience count, a meter's sum and count
(:mod:`baft.script.carry` keeps and sets them)."""

from __future__ import annotations

import ast
from typing import Optional

from baft.script import source
from baft.script.carried_attributes import carried_attributes, changed_within, methods_called
from baft.script.carried_cells import carried_cells
from baft.script.carried_globals import carried_globals, counted_inside_the_call, other_modules_globals, read_as_global
from baft.script.carry import Carried
from baft.script.source import MUTATORS
from baft.script.starts import started_at_a_literal, unread_start


def carried(filename: str, loop: ast.AST, scope: ast.AST, frame, kept) -> list[Carried]:
    """The values ``loop`` (in ``scope``, run in ``frame``) carries from one call to the next: its variables, the
    attributes of objects from outside it (not of ``kept``) and the module's globals, each in order of its lines."""
    methods = methods_called(loop, frame, kept)
    found = (_carried_variables(filename, loop, scope, frame) + carried_attributes(filename, loop, frame, kept, methods)
             + changed_within(loop, frame, methods) + carried_globals(filename, loop, frame)
             + carried_cells(loop, frame)
             + other_modules_globals(filename, loop, frame))
    keys = {value.key for value in found}  # a helper's count the loop calls, found again with the forwards' counts
    return found + [value for value in counted_inside_the_call(filename, frame) if value.key not in keys]


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
    tree = source.parsed(filename)

    def elsewhere(name):
        # a global a function of the file reads, a layer's forward in the next call (probe 23: a noise scale the loop
        # set to 0 once was back at its first value in a run resumed after it, silently), or a local of the loop's
        # function a function nested in it reads (probe 26 G9: a loss_fn closing over main's ``weight``)
        return (read_as_global(scope, name, outside=reached) if isinstance(scope, ast.Module)
                else _read_as_closure(scope, name, outside=reached))

    found = []
    for name, assignments in stores.items():
        first = min(position(a) for a in assignments)
        read = [n for n in reads if n.id == name]
        folded = [a for a in assignments if isinstance(a, ast.AugAssign) or name in names_read(a.value)]
        if ((elsewhere(name) or read and (folded or any(position(n) < first for n in read)))
                and not _recomputed_from_step(name, loop, scope, call)):
            kept = started_at_a_literal(name, loop, scope)
            start = None if kept else unread_start(name, loop, scope, tree)  # named, not kept
            if kept or start is not None:
                found.append((name, min(folded or assignments, key=position), start))
    for name, nodes in changes.items():
        # a dict's item a layer's forward reads (probe 26 G16: ``CTX["step"] = engine.global_steps`` after the call)
        if (name not in stores and (any(n.id == name and id(n) not in changed for n in reads) or elsewhere(name))
                and started_at_a_literal(name, loop, scope)):
            found.append((name, min(nodes, key=position), None))
    for name, nodes in folds.items():
        if name not in stores and name not in {n for n, _, _ in found} and started_at_a_literal(
                name, loop, scope, or_weights=True):
            found.append((name, min(nodes, key=position), None))
    return [Carried(f"{filename}:{node.lineno} ({ast.unparse(node)})", name, frame=frame,
                    start=f"{filename}:{start.lineno} ({ast.unparse(start)})" if start is not None else "",
                    # a list the call's own statement fills (``losses.append(engine.train_batch())``) is refilled
                    read_before_call=any(n.id == name and position(n) < call and id(n) not in changed for n in reads))
            for name, node, start in sorted(found, key=lambda item: position(item[1]))]


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


def _items_changed_in_place(node: ast.AST, iterated: dict) -> Optional[ast.Name]:
    """The variable whose tensor item ``node`` changes in place from itself, a tensor method's (``ema[n].mul_(0.99)``,
    ``average.lerp_(p, 0.1)`` over ``zip(ema, ...)``: ``iterated``, :func:`_iterated`), or None."""
    if not source.in_place(node):
        return None
    first, held, items = node.func.attr, node.func.value, False
    while isinstance(held, ast.Subscript) or source.in_place(held):
        if isinstance(held, ast.Subscript):
            held, items = held.value, True
        else:
            first, held = held.func.attr, held.func.value
    if first in OVERWRITES:
        return None
    if isinstance(held, ast.Name) and (items or held.id in iterated):
        return held if items else ast.Name(id=iterated[held.id], ctx=ast.Load())
    return None


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
