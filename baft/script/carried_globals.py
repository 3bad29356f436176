"""The globals of the script's modules a loop carries from one iteration to the next, read from their source: a
function of the file the loop calls sets them (``global best``, a dict's items), a function of another module of the
script's does, or a layer's ``forward`` counts in one inside ``train_batch`` (:func:`carried_globals`,
:func:`other_modules_globals`, :func:`counted_inside_the_call`)."""

from __future__ import annotations

import ast
import functools
import os
import sys
import types

import torch

from baft.script import source
from baft.script.carry import Carried
from baft.script.source import defined_at
from baft.script.starts import attribute_started_at_a_literal, started_at_module_level_at_a_literal


def carried_globals(filename: str, loop: ast.AST, frame) -> list[Carried]:
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
                if ((read and (folded or earlier) or read_as_global(tree, name, outside=bodies))
                        and started_at_module_level_at_a_literal(name, tree)):
                    found[name] = Carried(f"{filename}:{node.lineno} ({ast.unparse(node)})", name, frame=frame,
                                          read_before_call=any(source.in_iteration(loop, ends, where, n) < call
                                                               for where, n in read),
                                          module_global=True)
    return sorted(found.values(), key=lambda c: c.where)


def counted_inside_the_call(filename: str, frame) -> list[Carried]:
    """The globals of the script's file, or of another module of the script's (its model's file), that a function or
    method of that file no code of it calls by name adds to (called inside train_batch: a layer's forward, ``global
    CALLS`` and ``CALLS += 1``; probe 26 G6: a warm-up from it started again in a resumed run, silently), or to an
    item of (a forward hook's ``HOOK["n"] += 1``), started at that module's level at nothing but a literal, in order
    of their lines; then the attributes such a method adds to of an object ``frame`` holds (a hook object's
    ``self.n += 1`` in its ``__call__``: probe 28 K1), where its file starts them at nothing but a literal."""
    found = []
    for file, module in [(filename, None), *_scripts_modules(filename)]:
        try:
            mtime = os.stat(file).st_mtime_ns
        except OSError:
            continue
        found += [Carried(where, name, frame=frame, module_global=module is None, module=module)
                  for where, name in _counted_globals(file, mtime)]
        found += _counted_in_objects(file, _counted_attributes(file, mtime), frame)
    return found


@functools.lru_cache(maxsize=256)
def _counted_globals(file: str, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    """(``file:line (text)``, name) of :func:`counted_inside_the_call`'s globals of ``file`` as it is at
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
        arguments = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
        local = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                 } - declared | arguments
        for node in ast.walk(function):
            targets = source.targets(node)
            stored = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            items = {t.value.id for target in targets for t in ast.walk(target)
                     if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)} - local
            for name in (stored & declared | items) - set(counted):
                folded = isinstance(node, ast.AugAssign) or any(
                    isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.value))
                if folded and started_at_module_level_at_a_literal(name, tree):
                    counted[name] = node.lineno, f"{file}:{node.lineno} ({ast.unparse(node)})"
    return tuple((where, name) for name, (_, where) in sorted(counted.items(), key=lambda item: item[1][0]))


@functools.lru_cache(maxsize=256)
def _counted_attributes(file: str, mtime_ns: int) -> tuple[tuple[str, str, str, int, int], ...]:
    """(``file:line (text)``, class, attribute, line, column) for each attribute of ``self`` that a method of a class
    of ``file`` no code of it calls by name adds to (``self.n += 1`` in a hook object's ``__call__``, or in a method
    given as a hook), as the file is at ``mtime_ns``."""
    tree = source.parsed(file)
    if tree is None:
        return ()
    called = {source.called_name(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    counted = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for method in cls.body:
            if (not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name in called
                    or not method.args.args):
                continue
            this = method.args.args[0].arg
            for node in ast.walk(method):
                for target in source.targets(node):
                    if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == this):
                        continue
                    folded = isinstance(node, ast.AugAssign) or any(
                        isinstance(n, ast.Attribute) and n.attr == target.attr and isinstance(n.value, ast.Name)
                        and n.value.id == this for n in ast.walk(node.value))
                    if folded:
                        counted.append((f"{file}:{node.lineno} ({ast.unparse(node)})", cls.name, target.attr,
                                        node.lineno, node.col_offset))
    return tuple(counted)


ITERABLE = ("__iter__", "__next__", "__getitem__")  # a dataset, a sampler, an iterator: the data position's


def _counted_in_objects(file: str, counted, frame) -> list[Carried]:
    """The attributes ``counted`` (:func:`_counted_attributes`) of the objects of those classes of ``file`` that a
    variable of ``frame`` (or of its module) holds, where the file starts them at nothing but a literal; not a
    module's (kept with the model's attributes: :mod:`baft.script.attributes`), nor an iterable's (a dataset's, a
    sampler's pass count: kept with the data position, :mod:`baft.position`)."""
    if not counted:
        return []
    found, here = {}, os.path.realpath(file)
    for name, value in {**frame.f_globals, **frame.f_locals}.items():
        cls = type(value)
        if (isinstance(value, (torch.nn.Module, type)) or any(hasattr(cls, m) for m in ITERABLE)
                or _class_file(cls) != here):
            continue
        for where, class_name, attr, line, column in counted:
            if (class_name in {c.__name__ for c in cls.__mro__} and (name, attr) not in found
                    and attribute_started_at_a_literal(attr, file, {(line, column)}, cls)):
                found[name, attr] = Carried(where, name, attr=attr, frame=frame)
    return list(found.values())


def _class_file(cls: type) -> str:
    """The file (its real path) that defines ``cls``'s own methods, read from their code (a script run as ``__main__``
    by a launcher may be no module's ``__file__``); "" for a class without any."""
    code = next((f.__code__ for f in vars(cls).values() if isinstance(f, types.FunctionType)), None)
    return os.path.realpath(code.co_filename) if code is not None else ""


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


def read_as_global(tree: ast.Module, name: str, outside) -> bool:
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


def other_modules_globals(filename: str, loop: ast.AST, frame) -> list[Carried]:
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
                        and started_at_module_level_at_a_literal(name, tree)):
                    found[key] = Carried(f"{code.co_filename}:{store.lineno} ({ast.unparse(store)})", name,
                                         frame=frame, module=function.__module__,
                                         read_before_call=source.in_iteration(loop, ends, loop, node) < call)
    return list(found.values())
