"""The loops around a call to ``train_batch``, read from the script's source (:func:`loop_around`): whether they
count their calls, read the engine's step, call a collective or set state between the calls
(:mod:`baft.script.loop` acts on what they are)."""

from __future__ import annotations

import ast
import linecache
import os
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

ENGINE_STEP = ("global_steps", "global_samples")  # a bound that reads these resumes with the engine
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv"}  # torch.distributed's and deepspeed.comm's
SEQUENCES = (range, list, tuple, torch.Tensor, np.ndarray)  # gone through from the start by a new process


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

    @property
    def key(self) -> str:
        return self.name if self.attr is None else f"{self.name}.{self.attr}"


@dataclass(frozen=True)
class LoopSite:
    """The loops around a call to ``train_batch`` (outermost first), as read from the source."""

    where: str  # file:line of the innermost loop
    text: str  # that loop's header
    counts_calls: bool
    # none of the loops reads the engine's step, and one is a ``while`` over something else (a counter of the
    # script's own?) or a ``for`` over what baft cannot tell (a count it cannot read?): resumed, it would run as many
    # steps again as it ran from the start
    unread: bool = False
    collective: str = ""  # a collective the loops call between the calls (file:line and its text), if any
    # a ``for`` over a range from the engine's step: a fixed number of calls from where the process started
    from_step: bool = False
    # where the loops set an attribute of an object from outside them (``data.active = ...``), file:line and text
    sets_state: str = ""
    # where the loops (or what they call) add a number to a count of the script's own, file:line and text
    # (``iteration += 1``, a trainer's ``self.global_step += 1``)
    own_count: str = ""
    # the values of the script's own the loops carry from one iteration to the next (the previous loss, a patience
    # count, a loss meter), started before them at a literal, in source order
    carried: tuple[Carried, ...] = ()
    # one of the loops is a range from a start read at the call (``range(start, n)``): 0 or 1 then, it counts its
    # calls, unless the script resumed itself to that start
    start_read: bool = False

    @property
    def named(self) -> str:
        """The loop as baft's lines name it: ``the loop at FILE:LINE (HEADER)``."""
        return f"the loop at {self.where} ({self.text})"


def loop_around(frame, kept=()) -> Optional[LoopSite]:
    """The loops around the call ``frame`` is in, and those around its callers' calls up to the script's
    module level; None where no loop is found (the source unreadable, or the call in no loop). ``kept``: objects
    whose attributes the loops may set without saying so (the engine, whose state baft keeps)."""
    loops: list[tuple[str, ast.AST, ast.AST, object]] = []  # (file, loop, its scope, its frame), innermost first
    while frame is not None:
        filename = frame.f_code.co_filename
        tree = _parsed(filename)
        if tree is None:
            return None
        found = _loops_at(tree, frame.f_lineno)
        loops += [(filename, loop, scope, frame) for loop, scope in reversed(found)]
        if frame.f_code.co_name == "<module>":
            break
        frame = frame.f_back
    if not loops:
        return None
    filename, innermost, _, _ = loops[0]
    header = (f"for {ast.unparse(innermost.target)} in {ast.unparse(innermost.iter)}"
              if isinstance(innermost, (ast.For, ast.AsyncFor)) else f"while {ast.unparse(innermost.test)}")
    reads_step = any(_reads_engine_step(loop, scope) for _, loop, scope, _ in loops)
    # a count inside a ``while`` on the engine's step (``for _ in range(2): train_batch()``): resumed inside the
    # count, it would start again from 0; replayed, the while reads the step each replayed call sets
    on_step = [isinstance(loop, ast.While) and _reads_engine_step(loop.test, scope) for _, loop, scope, _ in loops]
    # so is such a ``while`` that calls ``train_batch`` more than once a pass (a task's step, then another's): resumed
    # between its calls, its pass would start again from the first
    counts = [_counts_calls(loop, scope, frame) or (step and _train_calls(file, loop) > 1)
              for (file, loop, scope, frame), step in zip(loops, on_step)]
    carried = tuple(value for file, loop, scope, frame in loops
                    for value in _carried(file, loop, scope, frame) + _carried_attributes(file, loop, frame, kept)
                    + _carried_globals(file, loop, frame))
    return LoopSite(where=f"{filename}:{innermost.lineno}", text=header,
                    collective=next(filter(None, (_collective(file, loop) for file, loop, _, _ in loops)), ""),
                    counts_calls=any(counts) and all(count or step for count, step in zip(counts, on_step)),
                    unread=not reads_step and (_count_around_data(loops, counts) or any(
                        not (count or _goes_on_itself(loop, frame) or _while_from_own_start(loop, scope))
                        for count, (_, loop, scope, frame) in zip(counts, loops))),
                    from_step=any(isinstance(loop, (ast.For, ast.AsyncFor)) and _reads_engine_step(loop.iter, scope)
                                  for _, loop, scope, _ in loops),
                    sets_state=next(filter(None, (_sets_state(file, loop, frame, kept)
                                                  for file, loop, _, frame in loops)), ""),
                    own_count=next((count for file, loop, scope, frame in loops
                                    for count in _own_count(file, loop, scope, frame, kept)
                                    if count not in {c.where for c in carried if not c.read_before_call}), ""),
                    carried=carried,
                    start_read=any(_start_read(loop) for _, loop, _, _ in loops))


def _parsed(filename: str) -> Optional[ast.Module]:
    linecache.checkcache(filename)  # the file as it is now, not as a traceback once read it
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None


def _loops_at(tree: ast.Module, line: int) -> list[tuple[ast.AST, ast.AST]]:
    """(loop, scope) for the loops whose body holds ``line``, outermost first, within the innermost function
    (or the module) that holds it: the loops of that frame."""
    loops: list[tuple[ast.AST, ast.AST]] = []
    scope: ast.AST = tree
    node: ast.AST = tree
    while True:
        inner = next((child for child in ast.iter_child_nodes(node) if _holds(child, line)), None)
        if inner is None:
            return loops
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            loops, scope = [], inner
        elif isinstance(inner, (ast.For, ast.AsyncFor, ast.While)) and any(_holds(s, line) for s in inner.body):
            loops.append((inner, scope))
        node = inner


def _holds(node: ast.AST, line: int) -> bool:
    start = getattr(node, "lineno", None)
    return start is not None and start <= line <= (node.end_lineno or start)


def _counts_calls(loop: ast.AST, scope: ast.AST, frame=None) -> bool:
    """A ``for`` over a count of its own (:func:`_counted`), or a ``while`` over a counter of its own
    (:func:`_while_counts`)."""
    if isinstance(loop, ast.While):
        return _while_counts(loop, scope)
    return isinstance(loop, (ast.For, ast.AsyncFor)) and _counted(loop.iter, scope, frame)


# what goes through its first argument, call for call: a progress bar, an enumeration, a copy; the count is its own
PASSED_THROUGH = ("tqdm", "enumerate", "list", "tuple", "reversed", "iter")
RANGES = ("range", "trange", "arange")  # python's, tqdm's, numpy's and torch's
PURE = ("range", "len", "int", "min", "max", "abs")  # builtins a loop's bounds call that change nothing


def _through(expr: ast.AST) -> ast.AST:
    """``expr`` without the :data:`PASSED_THROUGH` calls around it."""
    while isinstance(expr, ast.Call) and _name(expr.func) in PASSED_THROUGH and expr.args:
        expr = expr.args[0]
    return expr


def _range_from_own_start(expr: ast.AST) -> bool:
    """A range (through ``tqdm``, ``enumerate``, ...) whose start is no number in the source: a start of the script's
    own (``range(args.start, n)``: its own resume position, perhaps)."""
    expr = _through(expr)
    return (isinstance(expr, ast.Call) and _name(expr.func) in RANGES and len(expr.args) > 1
            and not (isinstance(expr.args[0], ast.Constant) and isinstance(expr.args[0].value, int)))


def _start_read(loop: ast.AST) -> bool:
    """A ``for`` over a range from a start of the script's own (:func:`_range_from_own_start`)."""
    return isinstance(loop, (ast.For, ast.AsyncFor)) and _range_from_own_start(loop.iter)


def _counted(expr: ast.AST, scope: ast.AST, frame=None, resolved: int = 0) -> bool:
    """Whether ``expr`` is a count a new process goes through from its start again: a ``range(n)``, ``range(1, n +
    1)``, ``trange(n)``, ``np.arange(n)``, ``count()`` or ``islice`` of one, whose start is a number and whose bounds
    neither read the engine's step nor a name assigned from it; one of them passed through ``tqdm``, ``enumerate``,
    ``list``, ``tuple``, ``reversed`` or a ``zip`` of counts (``repeat`` aside); a name the scope assigns one of
    them to once (``bar = tqdm(range(n))``); in ``frame``, a list, tuple or array the script holds (``for lr in
    lrs``) or a range from 0 or 1 (``range(args.start, n)``, read at that call)."""
    if frame is not None and not _reads_engine_step(expr, scope):
        value = _value(expr, frame)
        if isinstance(value, range) and value.start in (0, 1) or isinstance(value, SEQUENCES[1:]):
            return True  # a range from another start: the script's own resume position, perhaps
    if isinstance(expr, ast.Name) and resolved < 3:
        assigned = [node.value for node in ast.walk(scope) if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == expr.id for t in node.targets)]
        return len(assigned) == 1 and _counted(assigned[0], scope, frame, resolved + 1)
    if not isinstance(expr, ast.Call):
        return False
    name, args = _name(expr.func), expr.args
    if name in PASSED_THROUGH and args:
        return _counted(args[0], scope, frame, resolved)
    if name == "zip" and args:  # as long as its shortest count; ``repeat(x)`` counts nothing of its own
        counts = [arg for arg in args if not (isinstance(arg, ast.Call) and _name(arg.func) == "repeat")]
        return bool(counts) and all(_counted(arg, scope, frame, resolved) for arg in counts)
    if name == "islice" and len(args) > 1:
        return _counted(args[0], scope, frame, resolved) and not _reads_engine_step(expr, scope)
    if name == "count":  # itertools.count(start): a range without an end
        return all(isinstance(arg, ast.Constant) and isinstance(arg.value, int) for arg in args)
    if not (name in RANGES and args):
        return False
    return not _range_from_own_start(expr) and not _reads_engine_step(expr, scope)


def _count_around_data(loops: list, counts: list[bool]) -> bool:
    """A loop over the data inside one that counts from a start in the source (``for epoch in range(3): for batch in
    loader``): resumed, the data goes on from the restored position, the count from its start again. ``counts``:
    whether each of ``loops`` counts its calls."""
    return (any(not count and isinstance(loop, (ast.For, ast.AsyncFor)) and _data(loop.iter, frame)
                for count, (_, loop, _, frame) in zip(counts, loops))
            and any(count and not _start_read(loop) for count, (_, loop, _, _) in zip(counts, loops)))


def _goes_on_itself(loop: ast.AST, frame) -> bool:
    """A ``for`` over an object the script holds that is neither a count nor a sequence (a loader, an iterator: it
    goes on from the restored data position), possibly through ``tqdm`` or ``enumerate``, or zipped; or over a range
    from a start of the script's own (its own resume position, perhaps)."""
    return isinstance(loop, (ast.For, ast.AsyncFor)) and (_range_from_own_start(loop.iter) or _data(loop.iter, frame))


def _while_from_own_start(loop: ast.AST, scope: ast.AST) -> bool:
    """A ``while i < n`` whose counter its scope sets from something other than a number: the script's own resume
    (Megatron's ``iteration = args.iteration``, from what its load_checkpoint returned), as a ``range`` from a start of
    its own."""
    test = loop.test if isinstance(loop, ast.While) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == test.left.id
                                                         for t in node.targets) for node in ast.walk(scope))
            and not _set_to_numbers(test.left.id, scope))


def _data(expr: ast.AST, frame) -> bool:
    expr = _through(expr)
    if isinstance(expr, ast.Call) and _name(expr.func) == "zip":
        return any(_data(arg, frame) for arg in expr.args)
    value = _value(expr, frame)
    return hasattr(value, "__iter__") and not isinstance(value, SEQUENCES)


def _value(expr: ast.AST, frame):
    """What ``expr`` holds in ``frame``, where it only reads names, attributes, items, arithmetic, comparisons and
    conditions, and calls :data:`PURE` builtins (nothing it evaluates can change anything); None otherwise."""
    allowed = (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Load, ast.BinOp, ast.UnaryOp, ast.operator,
               ast.unaryop, ast.Slice, ast.Tuple, ast.List, ast.Call, ast.IfExp, ast.Compare, ast.cmpop, ast.BoolOp,
               ast.boolop)
    for node in ast.walk(expr):
        if not isinstance(node, allowed) or (isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in PURE and not node.keywords)):
            return None
    try:
        return eval(compile(ast.Expression(expr), "<baft loop>", "eval"), frame.f_globals, frame.f_locals)
    except Exception:  # a name bound only later, an item not there: not a value baft can read
        return None


def _while_counts(loop: ast.While, scope: ast.AST) -> bool:
    """``while i < n`` (or ``<=``, ``!=``) where ``i`` is set to a number in the scope and ``i += 1`` in the loop."""
    test = loop.test
    if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Lt, ast.LtE, ast.NotEq))) or _reads_engine_step(test, scope):
        return False
    counter = test.left.id
    counted = any(isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name)
                  and node.target.id == counter and isinstance(node.value, ast.Constant) and node.value.value == 1
                  for node in ast.walk(loop))
    started = [node.value for node in ast.walk(scope) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == counter for t in node.targets)]
    return counted and bool(started) and all(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in started)


def _sets_state(filename: str, loop: ast.AST, frame, kept) -> str:
    """The first assignment in ``loop`` to an attribute of an object it did not make (``data.active = ...``,
    ``self.step += 1``), but of a module or one of ``kept``, as ``file:line (text)``; "" where none is. An
    ``iter(...)`` assigned (``self.it = iter(loader)``, an epoch's) is not state: which iterator ``train_batch``
    reads is checked at every call (:meth:`baft.protection.Protection.reads`)."""
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    found = []
    for node in ast.walk(loop):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _name(node.value.func) == "iter":
            continue
        for target in _targets(node):
            base = target
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if not isinstance(target, ast.Attribute) or not isinstance(base, ast.Name) or base.id in made:
                continue
            value = value_in(frame, base.id)
            if not isinstance(value, types.ModuleType) and not any(value is k for k in kept):
                found.append((node.lineno, f"{filename}:{node.lineno} ({ast.unparse(node)})"))
    return min(found)[1] if found else ""


def _own_count(filename: str, loop: ast.AST, scope: ast.AST, frame, kept) -> list[str]:
    """The counts of the script's own the loop adds a number to, started before it and read again (resumed, it
    starts from its first value), each as ``file:line (text)``: ``name += <number>`` in ``loop`` whose name
    the loop reads elsewhere and does not set otherwise, nor its scope to anything but a number (the engine's step, a
    resume of the script's own) (``iteration += 1`` feeding a warm-up); a module's global that a function or method of
    the same file the loop calls adds a number to (``global count; count += 1`` in its ``after_step``), read there too,
    that the file sets to nothing but a number; or ``obj.attr += <number>`` in the loop or such a function (a
    trainer's ``self.global_step += 1`` in its ``on_step_end``), read there too, that the file sets to nothing but a
    number (no resume of its own) on an object that is not one of ``kept``."""
    found = []
    loaded = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    set_otherwise = {t.id for node in ast.walk(loop) if isinstance(node, (ast.Assign, ast.AnnAssign))
                     for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)}
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        set_otherwise |= {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for node in ast.walk(loop):
        if (_adds_a_number(node) and isinstance(node.target, ast.Name) and node.target.id in loaded
                and node.target.id not in set_otherwise and _set_to_numbers(node.target.id, scope)
                and not _reads_engine_step(ast.Name(node.target.id, ast.Load()), scope)):
            found.append(f"{filename}:{node.lineno} ({ast.unparse(node)})")
    reached = [node for body in _reached(filename, loop) for node in ast.walk(body)]
    read = {n.attr for n in reached if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
    assigned = [t for node in ast.walk(_parsed(filename)) if isinstance(node, ast.Assign)
                and not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, int))
                for t in node.targets]
    resumed = {t.attr for t in assigned if isinstance(t, ast.Attribute)}
    # a module's global that a function the loop calls adds to (``global count; count += 1`` in its ``after_step``)
    declared = {name for node in reached if isinstance(node, ast.Global) for name in node.names}
    loaded_there = {n.id for n in reached if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    resumed_names = {t.id for t in assigned if isinstance(t, ast.Name)}
    for node in reached:
        if (_adds_a_number(node) and isinstance(node.target, ast.Name) and node.target.id in declared
                and node.target.id in loaded_there and node.target.id not in resumed_names):
            found.append(f"{filename}:{node.lineno} ({ast.unparse(node)})")
    for node in reached:
        if (_adds_a_number(node) and isinstance(node.target, ast.Attribute) and isinstance(node.target.value, ast.Name)
                and node.target.attr in read and node.target.attr not in resumed | set(ENGINE_STEP)):
            owner = value_in(frame, node.target.value.id)
            if not any(owner is k for k in kept):
                found.append(f"{filename}:{node.lineno} ({ast.unparse(node)})")
    return found


# methods that change a list, dict, set or deque in place
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "remove", "clear", "update",
            "setdefault", "add", "discard", "sort", "reverse", "rotate"}


def _carried(filename: str, loop: ast.AST, scope: ast.AST, frame) -> list[Carried]:
    """The names ``loop`` (run in ``frame``) carries from one iteration to the next, in source order of the
    statements that carry them. Carried: the loop assigns it and reads it before it assigns it in the same
    iteration (in source order), or folds it into itself (``meter = 0.9 * meter + 0.1 * loss``, ``bad += 1``), or
    changes it in place and reads it otherwise (``losses.append(loss)``, then ``mean(losses[-5:])``); and its scope
    starts it before the loop at nothing but a literal (``prev = None``, ``best = float("inf")``, ``losses = []``): a
    value set otherwise there may be the script's own resume of it."""
    def position(node):
        return node.lineno, node.col_offset

    def names_read(node):
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    stores: dict[str, list] = {}
    changes: dict[str, list] = {}  # changed in place: by a method, or an item assigned
    changed = set()  # the names those read (ids), not reads of what they hold
    for node in ast.walk(loop):
        targets = _targets(node)
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
    reads = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    found = []
    for name, assignments in stores.items():
        first = min(position(a) for a in assignments)
        read = [n for n in reads if n.id == name]
        folded = [a for a in assignments if isinstance(a, ast.AugAssign) or name in names_read(a.value)]
        if read and (folded or any(position(n) < first for n in read)) and _started_at_a_literal(name, loop, scope):
            found.append((name, min(folded or assignments, key=position)))
    for name, nodes in changes.items():
        if (name not in stores and any(n.id == name and id(n) not in changed for n in reads)
                and _started_at_a_literal(name, loop, scope)):
            found.append((name, min(nodes, key=position)))
    call = _call_position(frame)
    return [Carried(f"{filename}:{node.lineno} ({ast.unparse(node)})", name, frame=frame,
                    # a list the call's own statement fills (``losses.append(engine.train_batch())``) is refilled
                    read_before_call=any(n.id == name and position(n) < call and id(n) not in changed for n in reads))
            for name, node in sorted(found, key=lambda item: position(item[1]))]


def _call_position(frame) -> tuple[int, int]:
    """(line, column) where the call ``frame`` is making now ends (towards ``train_batch``, in a frame of a loop around
    it): its arguments were read before it was made."""
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    _, line, _, column = positions[index] if 0 <= index < len(positions) else (None, None, None, None)
    return (line, column) if line is not None and column is not None else (frame.f_lineno + 1, 0)


def _carried_attributes(filename: str, loop: ast.AST, frame, kept) -> list[Carried]:
    """The attributes of objects from outside the loop (run in ``frame``) that the loop, a function or method of the
    same file it calls, or a method of the script's own it calls on such an object (``meter.update(loss)``, its class
    in any file of the script's: :func:`_methods_called`) carries from one call to the next (``self.prev = loss`` after
    reading ``self.prev`` in the same body, ``self.sum += val``), in order of their lines. Only where the attribute's
    file sets it elsewhere to nothing but a literal (``self.prev = None`` in ``__init__``: no resume of its own), on
    an object that is not one of ``kept``."""
    methods = _methods_called(loop, frame, kept)
    covered = {(file, body.lineno) for _, _, file, body in methods}
    # (the name in ``frame`` that ``self`` stands for in a method called on it, or None; the loop's call of it; file)
    bodies = [(None, None, filename, body) for body in _reached(filename, loop)
              if body is loop or (filename, body.lineno) not in covered] + methods
    inside = {(file, node.lineno, node.col_offset) for _, _, file, body in bodies for node in ast.walk(body)
              if isinstance(node, ast.stmt)}
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    call, ends = _call_position(frame), _calls_end(loop)
    early = set()  # (name, attr) read before the call
    found = []
    for receiver, called, file, body in bodies:
        this = body.args.args[0].arg if receiver is not None and body.args.args else None

        def attribute(node):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                return None
            if receiver is None:
                return node.value.id, node.attr
            return (receiver, node.attr) if node.value.id == this else None

        reads = [(node.lineno, node.col_offset, attribute(node)) for node in ast.walk(body)
                 if attribute(node) and isinstance(node.ctx, ast.Load)]
        elsewhere = {(line, col) for f, line, col in inside if f == file}
        early |= {attribute(node) for node in ast.walk(body) if attribute(node) and isinstance(node.ctx, ast.Load)
                  and (_in_iteration(loop, ends, body, node) if called is None else ends.get(called, (0, 0))) < call}
        for node in ast.walk(body):
            targets = _targets(node)
            changed = None  # a list, dict or set the attribute holds, changed in place and read otherwise
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                    and attribute(node.func.value)):
                changed = node.func.value
                targets = [changed]
            for target in (t for target in targets for t in ast.walk(target)):
                key = attribute(target)
                if key is None or key[0].split(".")[0] in made or key[1] in ENGINE_STEP:
                    continue
                if changed is not None:
                    folded = sum(read == key for _, _, read in reads) > 1  # read besides as the receiver
                else:
                    folded = isinstance(node, ast.AugAssign) or any(attribute(n) == key for n in ast.walk(node.value))
                before = any((line, col) < (node.lineno, node.col_offset) and read == key for line, col, read in reads)
                owner = value_in(frame, key[0])
                if ((folded or before) and owner is not None and not any(owner is k for k in kept)
                        and _attribute_started_at_a_literal(key[1], file, elsewhere)):
                    found.append(((file, node.lineno), f"{file}:{node.lineno} ({ast.unparse(node)})", key))
    unique = {key: (line, where) for line, where, key in sorted(found, reverse=True)}  # each key's first
    return [Carried(where, *key, frame=frame, read_before_call=key in early)
            for key, (line, where) in sorted(unique.items(), key=lambda kv: kv[1])]


def _methods_called(loop: ast.AST, frame, kept) -> list[tuple[str, str, str, ast.AST]]:
    """The methods of the script's own the loop (run in ``frame``) calls on objects from outside it
    (``meter.update(loss)``, ``self.losses.update(loss)``: defined in a file of the script's, not a library's, on an
    object that is not one of ``kept`` and does not keep itself with ``state_dict``), and those they call on
    ``self``: (the object's name in ``frame``, the method the loop calls on it, the file, the method's definition)."""
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    todo = [(_dotted(node.func.value), node.func.attr, node.func.attr) for node in ast.walk(loop)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _dotted(node.func.value)
            and _dotted(node.func.value).split(".")[0] not in made]
    found, seen = [], set()
    while todo:
        name, called, method = todo.pop(0)
        owner = value_in(frame, name)
        if (owner is None or isinstance(owner, types.ModuleType) or any(owner is k for k in kept)
                or callable(getattr(owner, "state_dict", None))):
            continue
        function = getattr(type(owner), method, None)
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is None or (name, code) in seen or _library(code.co_filename):
            continue
        seen.add((name, code))
        definition = _defined_at(code)
        if definition is None or not definition.args.args:
            continue
        found.append((name, called, code.co_filename, definition))
        this = definition.args.args[0].arg
        todo += [(name, called, node.func.attr) for node in ast.walk(definition)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == this]
    return found


def _dotted(expr: ast.AST) -> str:
    """``a.b.c`` for a name or a chain of attributes of one; "" for any other expression."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value)
        return f"{base}.{expr.attr}" if base else ""
    return ""


def value_in(frame, name: str):
    """What ``name`` (a variable of ``frame``'s or of its module's, or a path of attributes from one:
    ``self.losses``) holds in ``frame``; None where nothing."""
    root, *path = name.split(".")
    value = frame.f_locals.get(root, frame.f_globals.get(root))
    for attr in path:
        value = getattr(value, attr, None)
    return value


LIBRARIES = tuple({os.path.realpath(path) + os.sep for key, path in sysconfig.get_paths().items()
                   if key in ("stdlib", "platstdlib", "purelib", "platlib")}
                  | {os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep})  # and baft's own


def _library(filename: str) -> bool:
    """Whether ``filename`` is Python's, an installed package's or baft's, not the script's own."""
    return os.path.realpath(filename).startswith(LIBRARIES)


def _defined_at(code: types.CodeType) -> Optional[ast.AST]:
    """The definition of the function ``code`` is, read from its file; None where it cannot be read."""
    tree = _parsed(code.co_filename)
    return next((node for node in ast.walk(tree or ast.Module(body=[], type_ignores=[]))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name
                 and code.co_firstlineno in (node.lineno, *(d.lineno for d in node.decorator_list))), None)


def _calls_end(loop: ast.AST) -> dict[str, tuple[int, int]]:
    """Where the loop's first call of each function ends (after its arguments, a call to ``train_batch`` among them)."""
    ends: dict[str, tuple[int, int]] = {}
    for node in ast.walk(loop):
        if isinstance(node, ast.Call):
            end = (node.end_lineno, node.end_col_offset)
            ends[_name(node.func)] = min(end, ends.get(_name(node.func), end))
    return ends


def _in_iteration(loop: ast.AST, ends: dict, body: ast.AST, node: ast.AST) -> tuple[int, int]:
    """Where ``node`` of ``body`` (``loop``, or a function it reaches) runs in an iteration of ``loop``: its own
    position in the loop; where the loop calls the function (:func:`_calls_end`), or first where the loop does not
    call it itself (reached through another function)."""
    return (node.lineno, node.col_offset) if body is loop else ends.get(body.name, (0, 0))


def _runs_before(loop: ast.AST, call: tuple[int, int]):
    """Whether a node of ``loop``, or of a function it reaches, runs before the call towards ``train_batch`` that ends
    at ``call`` in an iteration (:func:`_in_iteration`)."""
    ends = _calls_end(loop)
    return lambda body, node: _in_iteration(loop, ends, body, node) < call


def _carried_globals(filename: str, loop: ast.AST, frame) -> list[Carried]:
    """The module's globals a function or method of the same file the loop calls carries from one call to the next
    (``global best`` and ``best = min(best, loss)`` in its ``after_step``, or a count it adds to that another reads
    first), started at the module's level at nothing but a literal, in order of their lines."""
    tree, bodies, ends = _parsed(filename), _reached(filename, loop), _calls_end(loop)
    call = _call_position(frame)
    reads = [(body, n) for body in bodies for n in ast.walk(body)
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    found = {}
    for body in bodies[1:]:
        declared = {name for node in ast.walk(body) if isinstance(node, ast.Global) for name in node.names}
        for node in ast.walk(body):
            targets = _targets(node)
            names = {n.id for t in targets for n in ast.walk(t)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for name in names & declared - set(found):
                read = [(where, n) for where, n in reads if n.id == name]
                stored_at = _in_iteration(loop, ends, body, node)
                folded = isinstance(node, ast.AugAssign) or any(
                    isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.value))
                earlier = any(_in_iteration(loop, ends, where, n) < stored_at
                              or (where is body and (n.lineno, n.col_offset) < (node.lineno, node.col_offset))
                              for where, n in read)
                if read and (folded or earlier) and _started_at_module_level_at_a_literal(name, tree):
                    found[name] = Carried(f"{filename}:{node.lineno} ({ast.unparse(node)})", name, frame=frame,
                                          read_before_call=any(_in_iteration(loop, ends, where, n) < call
                                                               for where, n in read),
                                          module_global=True)
    return sorted(found.values(), key=lambda c: c.where)


def _started_at_module_level_at_a_literal(name: str, tree: ast.Module) -> bool:
    """Whether the module's own statements (not its functions' or classes') assign ``name``, and only literals."""
    started, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            started += _assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)
        todo.extend(ast.iter_child_nodes(node))
    return bool(started) and all(_literal(value) for value in started)


def _attribute_started_at_a_literal(attr: str, filename: str, inside: set) -> bool:
    """Whether the file assigns ``.attr`` outside the statements at ``inside`` (line, column), and only literals."""
    started = [v for node in ast.walk(_parsed(filename)) if isinstance(node, (ast.Assign, ast.AnnAssign))
               and (node.lineno, node.col_offset) not in inside and node.value is not None
               for v in _assigned(node, lambda t: isinstance(t, ast.Attribute) and t.attr == attr)]
    return bool(started) and all(_literal(value) for value in started)


def _literal(value: ast.AST) -> bool:
    """A number, a string, None, a bool, ``float("inf")``, an empty or literal list, tuple, dict or set."""
    if isinstance(value, ast.Call) and _name(value.func) in ("float", "int") and not value.keywords:
        return all(_literal(arg) for arg in value.args)
    try:
        ast.literal_eval(value)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _started_at_a_literal(name: str, loop: ast.AST, scope: ast.AST) -> bool:
    """Whether ``scope`` assigns ``name`` outside ``loop``, and only a literal (:func:`_literal`)."""
    inside = range(loop.lineno, (loop.end_lineno or loop.lineno) + 1)
    started = [v for node in ast.walk(scope) if isinstance(node, (ast.Assign, ast.AnnAssign))
               and node.value is not None and node.lineno not in inside
               for v in _assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)]
    return bool(started) and all(_literal(value) for value in started)


def _targets(node: ast.AST) -> list[ast.AST]:
    """What the statement ``node`` assigns to: an assignment's targets, an augmented or annotated one's target (an
    annotation alone assigns nothing); [] for any other node."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
        return [node.target]
    return []


def _assigned(node: ast.AST, wanted) -> list[ast.AST]:
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


def _set_to_numbers(name: str, scope: ast.AST) -> bool:
    """Whether ``scope`` sets ``name`` to nothing but numbers: no resume of the script's own (Megatron's ``iteration =
    args.iteration``, from what its load_checkpoint returned)."""
    return all(isinstance(node.value, ast.Constant) and isinstance(node.value.value, int) for node in ast.walk(scope)
               if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets))


def _adds_a_number(node: ast.AST) -> bool:
    return (isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int))


def _reached(filename: str, loop: ast.AST) -> list[ast.AST]:
    """``loop`` and the functions and methods of the same file it calls (``evaluate()``, ``self.evaluate()``), and
    those they call."""
    functions = {node.name: node for node in ast.walk(_parsed(filename))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached, seen = [loop], set()
    for body in reached:
        for call in (node for node in ast.walk(body) if isinstance(node, ast.Call)):
            called = _name(call.func)
            if called in functions and called not in seen:
                seen.add(called)
                reached.append(functions[called])
    return reached


def _train_calls(filename: str, loop: ast.AST) -> int:
    """The calls of ``train_batch`` every pass of ``loop`` makes: in its body outside conditions and inner loops (an
    ``if`` choosing one task's call or another's makes one), and so in the functions and methods of the same file it
    calls there, and those they call."""
    functions = {node.name: node for node in ast.walk(_parsed(filename))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def calls(nodes, seen: frozenset) -> int:
        found = 0
        for node in (sub for statement in nodes for sub in _unconditional(statement)):
            name = _name(node.func) if isinstance(node, ast.Call) else ""
            if name == "train_batch":
                found += 1
            elif name in functions and name not in seen:
                found += calls(functions[name].body, seen | {name})
        return found

    return calls(loop.body, frozenset())


def _unconditional(node: ast.AST):
    """``node`` and what it holds that runs whenever it does: not the branches of a condition, the bodies of a loop or
    a ``try``, nor what a function or lambda it defines holds."""
    yield node
    if isinstance(node, (ast.If, ast.IfExp, ast.BoolOp, ast.Try, ast.For, ast.AsyncFor, ast.While, ast.FunctionDef,
                         ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        return
    for child in ast.iter_child_nodes(node):
        yield from _unconditional(child)


def _collective(filename: str, loop: ast.AST) -> str:
    """The first call of a collective of ``torch.distributed`` (or ``deepspeed.comm``) in ``loop``, or in a function or
    method of the same file it calls, and those they call (:func:`_reached`), as ``file:line (text)``; "" where none
    is."""
    tree = _parsed(filename)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in ("torch.distributed", "deepspeed.comm") for alias in node.names}

    def is_collective(call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Name):
            return func.id in COLLECTIVES and func.id in imported
        return (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES
                and any(word in ast.unparse(func.value) for word in ("dist", "comm")))

    for body in _reached(filename, loop):
        for call in (node for node in ast.walk(body) if isinstance(node, ast.Call)):
            if is_collective(call):
                return f"{filename}:{call.lineno} ({ast.unparse(call)})"
    return ""


def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _reads_engine_step(expr: ast.AST, scope: ast.AST) -> bool:
    if any(word in ast.unparse(expr) for word in ENGINE_STEP):
        return True
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    for node in ast.walk(scope):
        if node is not scope and any(isinstance(t, ast.Name) and t.id in names for t in _targets(node)):
            if any(word in ast.unparse(node.value) for word in ENGINE_STEP):
                return True
    return False
