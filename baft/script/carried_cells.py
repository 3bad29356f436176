"""The variables of an enclosing function a closure the loop calls carries from one iteration to the next, read from
its source (:func:`carried_cells`; probe 27's h6: a plateau rule's ``nonlocal best, bad``)."""

from __future__ import annotations

import ast
import types
from typing import Optional

from baft.script import source
from baft.script.carry import Carried
from baft.script.source import MUTATORS, defined_at
from baft.script.starts import started_at_a_literal


def carried_cells(loop: ast.AST, frame) -> list[Carried]:
    """The variables of an enclosing function that a closure the loop calls carries from one call to the next, the way
    :func:`baft.script.carried_globals.carried_globals` finds a module's (``nonlocal best`` and ``best = min(best,
    loss)`` in the ``on_step_end`` that ``make_plateau()`` returned, or items of a dict it closes over set: probe 27's
    h6, a resumed run's plateau rule started again, silently), started in the enclosing function at nothing but a
    literal, in order of their lines."""
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
            if (path, name) not in found and started_at_a_literal(name, definition, enclosing):
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
