"""Reading the script's source: a file's syntax tree as it is now, what a statement assigns, the functions a loop
reaches, where a call stands in an iteration, and what a name holds in a running frame. Shared by
:mod:`baft.script.loop_source` (what kind of loop) and :mod:`baft.script.carried_source` (what values it carries)."""

from __future__ import annotations

import ast
import linecache
import os
import re
import sysconfig
import types
from typing import Optional

# methods that change a list, dict, set or deque in place
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "remove", "clear", "update",
            "setdefault", "add", "discard", "sort", "reverse", "rotate"}

ENGINE_STEP = ("global_steps", "global_samples")  # a bound that reads these resumes with the engine


def parsed(filename: str) -> Optional[ast.Module]:
    """The syntax tree of ``filename`` as the file is now; None where it cannot be read or parsed."""
    linecache.checkcache(filename)  # the file as it is now, not as a traceback once read it
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None


def call_position(frame) -> tuple[int, int]:
    """(line, column) where the call ``frame`` is making now ends (towards ``train_batch``, in a frame of a loop around
    it): its arguments were read before it was made."""
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    _, line, _, column = positions[index] if 0 <= index < len(positions) else (None, None, None, None)
    return (line, column) if line is not None and column is not None else (frame.f_lineno + 1, 0)


def value_in(frame, name: str):
    """What ``name`` (a variable of ``frame``'s or of its module's, or a path of attributes and items of a list or
    tuple from one: ``self.losses``, ``callbacks[0]``) holds in ``frame``; None where nothing."""
    root, *path = re.findall(r"\[\d+\]|[^.\[]+", name) or [name]
    value = frame.f_locals.get(root, frame.f_globals.get(root))
    for attr in path:
        value = _item(value, int(attr[1:-1])) if attr.startswith("[") else getattr(value, attr, None)
    return value


def _item(held, index: int):
    return held[index] if isinstance(held, (list, tuple)) and index < len(held) else None


def dotted(expr: ast.AST) -> str:
    """``a.b.c`` for a name or a chain of attributes of one; "" for any other expression."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = dotted(expr.value)
        return f"{base}.{expr.attr}" if base else ""
    return ""


def calls_end(loop: ast.AST) -> dict[str, tuple[int, int]]:
    """Where the loop's first call of each function ends (after its arguments, a call to ``train_batch`` among them)."""
    ends: dict[str, tuple[int, int]] = {}
    for node in ast.walk(loop):
        if isinstance(node, ast.Call):
            end = (node.end_lineno, node.end_col_offset)
            ends[called_name(node.func)] = min(end, ends.get(called_name(node.func), end))
    return ends


def in_iteration(loop: ast.AST, ends: dict, body: ast.AST, node: ast.AST) -> tuple[int, int]:
    """Where ``node`` of ``body`` (``loop``, or a function it reaches) runs in an iteration of ``loop``: its own
    position in the loop; where the loop calls the function (:func:`calls_end`), or first where the loop does not
    call it itself (reached through another function)."""
    return (node.lineno, node.col_offset) if body is loop else ends.get(body.name, (0, 0))


def reads_engine_step(expr: ast.AST, scope: ast.AST) -> bool:
    """Whether ``expr`` reads the engine's step, itself or through a variable ``scope`` sets from it."""
    if any(word in ast.unparse(expr) for word in ENGINE_STEP):
        return True
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    for node in ast.walk(scope):
        if node is not scope and any(isinstance(t, ast.Name) and t.id in names for t in targets(node)):
            if any(word in ast.unparse(node.value) for word in ENGINE_STEP):
                return True
    return False


def targets(node: ast.AST) -> list[ast.AST]:
    """What the statement ``node`` assigns to: an assignment's targets, an augmented or annotated one's target (an
    annotation alone assigns nothing); [] for any other node."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
        return [node.target]
    return []


def assigned(node: ast.AST, wanted) -> list[ast.AST]:
    """What the assignment ``node`` assigns to the targets ``wanted`` (a predicate on a target) picks: a tuple's item
    where both sides are tuples alike (``best, bad = float("inf"), 0``), else the whole value."""
    def values(target, value):
        if wanted(target):
            return [value]
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return [v for t, item in zip(target.elts, value.elts) for v in values(t, item)]
            return [value] if any(wanted(t) for t in ast.walk(target)) else []
        return []

    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [v for target in targets for v in values(target, node.value)]


def reached(filename: str, loop: ast.AST) -> list[ast.AST]:
    """``loop`` and the functions and methods of the same file it calls (``evaluate()``, ``self.evaluate()``), and
    those they call."""
    functions = {node.name: node for node in ast.walk(parsed(filename))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached, seen = [loop], set()
    for body in reached:
        for call in (node for node in ast.walk(body) if isinstance(node, ast.Call)):
            called = called_name(call.func)
            if called in functions and called not in seen:
                seen.add(called)
                reached.append(functions[called])
    return reached


def called_name(func: ast.AST) -> str:
    """The name a call's ``func`` calls by (``f`` of ``f(...)`` and of ``obj.f(...)``); "" for any other callee."""
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


LIBRARIES = tuple({os.path.realpath(path) + os.sep for key, path in sysconfig.get_paths().items()
                   if key in ("stdlib", "platstdlib", "purelib", "platlib")}
                  | {os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep})  # and baft's own


def in_place(node: ast.AST) -> bool:
    """Whether ``node`` calls a tensor's in-place method (``w.mul_(0.9)``: torch's trailing underscore)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_")
            and not node.func.attr.startswith("_"))


def library(filename: str) -> bool:
    """Whether ``filename`` is Python's, an installed package's or baft's, not the script's own."""
    return os.path.realpath(filename).startswith(LIBRARIES)


def defined_at(code: types.CodeType) -> Optional[ast.AST]:
    """The definition of the function ``code`` is, read from its file; None where it cannot be read."""
    tree = parsed(code.co_filename)
    return next((node for node in ast.walk(tree or ast.Module(body=[], type_ignores=[]))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name
                 and code.co_firstlineno in (node.lineno, *(d.lineno for d in node.decorator_list))), None)
