"""The attributes of the script's own objects a loop carries from one iteration to the next, read from its source: a
trainer's ``self.prev = loss`` in a method the loop calls, a meter's sum and count, an object whose methods change
what it holds (kept whole), a setting of the script's options or of a loss module read inside ``train_batch``
(:func:`carried_attributes`, :func:`changed_within`)."""

from __future__ import annotations

import argparse
import ast
import types
from typing import Optional

import torch

from baft.script import source
from baft.script.carry import Carried
from baft.script.source import MUTATORS, defined_at
from baft.script.starts import (attribute_started_at_a_literal, started_at_module_level_at_a_literal,
                                unread_attribute_start)


def carried_attributes(filename: str, loop: ast.AST, frame, kept, methods: list) -> list[Carried]:
    """The attributes of objects from outside the loop (run in ``frame``) that the loop, a function or method of the
    same file it calls, or a method of the script's own it calls on such an object (``meter.update(loss)``, its class
    in any file of the script's: ``methods``, :func:`methods_called`) carries from one call to the next
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
                where = f"{file}:{node.lineno} ({ast.unparse(node)})"
                if (((folded or before) and attribute_started_at_a_literal(key[1], file, elsewhere, type(owner)))
                        or _scripts_module_setting(owner, key[1])
                        or _setting_read_in_the_call(owner, key, filename, loop)):
                    found.append(((file, node.lineno), where, key, ""))
                elif folded or before:  # named, not kept
                    start = unread_attribute_start(key[1], file, elsewhere, type(owner))
                    if start is not None:
                        found.append(((file, node.lineno), where, key, f"{file}:{start.lineno} ({ast.unparse(start)})"))
    unique = {key: (line, where, start) for line, where, key, start in sorted(found, reverse=True)}  # each key's first
    return [Carried(where, *key, frame=frame, read_before_call=key in early, start=start)
            for key, (line, where, start) in sorted(unique.items(), key=lambda kv: kv[1])]


def _scripts_module_setting(owner, attr: str) -> bool:
    """Whether ``owner`` is a module of the script's (a config module it imports) whose own statements start ``attr``
    at nothing but a literal: whatever reads it (a layer's forward) reads what the loop set last (probe 23:
    ``settings.NOISE = 0.0`` at a step was back at its first value in a run resumed after it, silently)."""
    filename = getattr(owner, "__file__", None) if isinstance(owner, types.ModuleType) else None
    if filename is None or source.library(filename):
        return False
    tree = source.parsed(filename)
    return tree is not None and started_at_module_level_at_a_literal(attr, tree)


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


def methods_called(loop: ast.AST, frame, kept) -> list[tuple[str, str, str, ast.AST]]:
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
    todo += _called_on_items(loop, frame, made)
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


MOST_ITEMS_FOLLOWED = 64  # a list of callbacks, not of samples or tensors


def _called_on_items(loop: ast.AST, frame, made: set) -> list[tuple[str, str, str]]:
    """(``callbacks[i]``, method, method) for the methods the loop calls on the items of a list or tuple from outside
    it that it goes through (``for c in callbacks: c.on_step_end(...)``, a trainer's ``self.callbacks``; probe 28 K9:
    their attributes were neither carried nor named), each item by its index."""
    found = []
    for node in ast.walk(loop):
        held = source.dotted(node.iter) if isinstance(node, ast.For) and isinstance(node.target, ast.Name) else ""
        items = source.value_in(frame, held) if held and held.split(".")[0] not in made else None
        if not isinstance(items, (list, tuple)) or len(items) > MOST_ITEMS_FOLLOWED:
            continue
        found += [(f"{held}[{index}]", call.func.attr, call.func.attr) for call in ast.walk(node)
                  if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                  and isinstance(call.func.value, ast.Name) and call.func.value.id == node.target.id
                  for index in range(len(items))]
    return found


def changed_within(loop: ast.AST, frame, methods: list) -> list[Carried]:
    """The objects of the script's own whose methods the loop calls (``methods``, :func:`methods_called`) where those
    change an object an attribute holds through that object's own methods (torchvision's ``MetricLogger.update``:
    ``self.meters[name].update(value)``, each meter's count and total), or the items of one in place through a
    ``for``'s variable (an EMA's ``for w, p in zip(self.weights, params): w.mul_(d)``): kept whole, where their
    attributes are data (:func:`baft.script.carry.object_data`). Their attributes alone do not say that state changed
    (probe: a resumed run's running averages started again, silently)."""
    call, ends = source.call_position(frame), source.calls_end(loop)
    found = {}
    for receiver, called, file, body in methods:
        this = body.args.args[0].arg
        items = _bound_to_items(body, this)
        for node in ast.walk(body):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            held = node.func.value  # what the method is called on: reached from an attribute of ``this``, deeper
            path = []
            while isinstance(held, (ast.Attribute, ast.Subscript, ast.Call)):
                path.append(held)
                held = held.value if not isinstance(held, ast.Call) else held.func
            nested = len(path) > 1 or path and node.func.attr not in MUTATORS  # not a list's append (attributes')
            # an item changed in place through the ``for``'s variable, as ``self.w[n].mul_(...)`` changes it
            item = (not path and isinstance(held, ast.Name) and held.id in items
                    and (source.in_place(node) or node.func.attr in MUTATORS))
            if isinstance(held, ast.Name) and (held.id == this and nested or item) and receiver not in found:
                found[receiver] = Carried(f"{file}:{node.lineno} ({ast.unparse(node)})", *_split(receiver),
                                          frame=frame, read_before_call=ends.get(called, (0, 0)) < call, whole=True)
    return list(found.values())


def _bound_to_items(body: ast.AST, this: str) -> set[str]:
    """The names the ``for`` statements of ``body`` bind to the items of an attribute of ``this``: ``for w in
    self.weights``, ``for w, p in zip(self.weights, params)``, ``for i, w in enumerate(self.weights)``."""
    def of_this(expr):
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "values":
            expr = expr.func.value
        return isinstance(expr, ast.Attribute) and source.dotted(expr).split(".")[0] == this

    bound = set()
    for node in ast.walk(body):
        if not isinstance(node, ast.For):
            continue
        pairs = [(node.target, node.iter)]
        wrapped = source.called_name(node.iter.func) if isinstance(node.iter, ast.Call) and node.iter.args else ""
        if wrapped == "zip" and isinstance(node.target, ast.Tuple) and len(node.target.elts) == len(node.iter.args):
            pairs = list(zip(node.target.elts, node.iter.args))
        elif wrapped == "enumerate" and isinstance(node.target, ast.Tuple) and len(node.target.elts) == 2:
            pairs = [(node.target.elts[1], node.iter.args[0])]
        bound |= {target.id for target, iterated in pairs if isinstance(target, ast.Name) and of_this(iterated)}
    return bound


def _split(path: str) -> tuple[str, Optional[str]]:
    """A path of attributes as (its owner's path, the last attribute), or (a name, None)."""
    owner, _, attr = path.rpartition(".")
    return (owner, attr) if owner else (path, None)
