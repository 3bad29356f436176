"""Whether a loop around ``train_batch`` counts its calls, read from the script's source: a ``for`` over a count of
its own (``for step in range(n)``, through ``tqdm``/``enumerate``), or a ``while`` over a counter of its own
(``while i < n: ...; i += 1``). A new process goes through such a loop from its start, calling ``train_batch`` again
for the steps already trained, which baft replays (:mod:`baft.script.loop`); a loop on the engine's step
(``while engine.global_steps < n``) goes on by itself."""

from __future__ import annotations

import ast

import numpy as np
import torch

from baft.script import source


SEQUENCES = (range, list, tuple, torch.Tensor, np.ndarray)  # gone through from the start by a new process


def counts_calls(loop: ast.AST, scope: ast.AST, frame=None, kept=()) -> bool:
    """A ``for`` over a count of its own (:func:`_counted`), or a ``while`` over a counter of its own
    (:func:`_while_counts`, :func:`_while_start_read`)."""
    if isinstance(loop, ast.While):
        return _while_counts(loop, scope) or _while_start_read(loop, scope, frame, kept)
    return isinstance(loop, (ast.For, ast.AsyncFor)) and _counted(loop.iter, scope, frame)


# what goes through its first argument, call for call: a progress bar, an enumeration, a copy; the count is its own
PASSED_THROUGH = ("tqdm", "enumerate", "list", "tuple", "reversed", "iter")


RANGES = ("range", "trange", "arange")  # python's, tqdm's, numpy's and torch's


PURE = ("range", "len", "int", "min", "max", "abs")  # builtins a loop's bounds call that change nothing


def _through(expr: ast.AST) -> ast.AST:
    """``expr`` without the :data:`PASSED_THROUGH` calls around it."""
    while isinstance(expr, ast.Call) and source.called_name(expr.func) in PASSED_THROUGH and expr.args:
        expr = expr.args[0]
    return expr


def _range_from_own_start(expr: ast.AST) -> bool:
    """A range (through ``tqdm``, ``enumerate``, ...) whose start is no number in the source: a start of the script's
    own (``range(args.start, n)``: its own resume position, perhaps)."""
    expr = _through(expr)
    return (isinstance(expr, ast.Call) and source.called_name(expr.func) in RANGES and len(expr.args) > 1
            and not (isinstance(expr.args[0], ast.Constant) and isinstance(expr.args[0].value, int)))


def start_read(loop: ast.AST, scope: ast.AST, frame=None, kept=()) -> bool:
    """A ``for`` over a range from a start of the script's own (:func:`_range_from_own_start`), or a ``while`` over a
    counter that counts from its start at the call (:func:`_while_start_read`)."""
    if isinstance(loop, ast.While):
        return _while_start_read(loop, scope, frame, kept)
    return isinstance(loop, (ast.For, ast.AsyncFor)) and _range_from_own_start(loop.iter)


def _counted(expr: ast.AST, scope: ast.AST, frame=None, resolved: int = 0) -> bool:
    """Whether ``expr`` is a count a new process goes through from its start again: a ``range(n)``, ``range(1, n +
    1)``, ``trange(n)``, ``np.arange(n)``, ``count()`` or ``islice`` of one, whose start is a number and whose bounds
    neither read the engine's step nor a name assigned from it; one of them passed through ``tqdm``, ``enumerate``,
    ``list``, ``tuple``, ``reversed`` or a ``zip`` of counts (``repeat`` aside); a name the scope assigns one of
    them to once (``bar = tqdm(range(n))``); in ``frame``, a list, tuple or array the script holds (``for lr in
    lrs``) or a range from 0 or 1 (``range(args.start, n)``, read at that call)."""
    if frame is not None and not source.reads_engine_step(expr, scope):
        value = _value(expr, frame)
        if isinstance(value, range) and value.start in (0, 1) or isinstance(value, SEQUENCES[1:]):
            return True  # a range from another start: the script's own resume position, perhaps
    if isinstance(expr, ast.Name) and resolved < 3:
        assigned = [node.value for node in ast.walk(scope) if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == expr.id for t in node.targets)]
        return len(assigned) == 1 and _counted(assigned[0], scope, frame, resolved + 1)
    if not isinstance(expr, ast.Call):
        return False
    name, args = source.called_name(expr.func), expr.args
    if name in PASSED_THROUGH and args:
        return _counted(args[0], scope, frame, resolved)
    if name == "zip" and args:  # as long as its shortest count; ``repeat(x)`` counts nothing of its own
        counts = [arg for arg in args if not (isinstance(arg, ast.Call) and source.called_name(arg.func) == "repeat")]
        return bool(counts) and all(_counted(arg, scope, frame, resolved) for arg in counts)
    if name == "islice" and len(args) > 1:
        return _counted(args[0], scope, frame, resolved) and not source.reads_engine_step(expr, scope)
    if name == "count":  # itertools.count(start): a range without an end
        return all(isinstance(arg, ast.Constant) and isinstance(arg.value, int) for arg in args)
    if not (name in RANGES and args):
        return False
    return not _range_from_own_start(expr) and not source.reads_engine_step(expr, scope)


def count_around_data(loops: list, counts: list[bool]) -> bool:
    """A loop over the data inside one that counts from a start in the source (``for epoch in range(3): for batch in
    loader``): resumed, the data goes on from the restored position, the count from its start again. ``counts``:
    whether each of ``loops`` counts its calls."""
    return (any(not count and isinstance(loop, (ast.For, ast.AsyncFor)) and _data(loop.iter, frame)
                for count, (_, loop, _, frame) in zip(counts, loops))
            and any(count and not start_read(loop, scope, frame)
                    for count, (_, loop, scope, frame) in zip(counts, loops)))


def goes_on_itself(loop: ast.AST, frame) -> bool:
    """A ``for`` over an object the script holds that is neither a count nor a sequence (a loader, an iterator: it
    goes on from the restored data position), possibly through ``tqdm`` or ``enumerate``, or zipped; or over a range
    from a start of the script's own (its own resume position, perhaps)."""
    return isinstance(loop, (ast.For, ast.AsyncFor)) and (_range_from_own_start(loop.iter) or _data(loop.iter, frame))


def while_from_own_start(loop: ast.AST, scope: ast.AST) -> bool:
    """A ``while`` over a counter (:func:`_while_counter`) its scope sets from something other than a number, or one
    an object or a dict holds (a trainer's ``self.global_step``, the ``client_state``'s ``progress.iteration``,
    litgpt's ``state["iter_num"]``): the script's own
    resume, perhaps (Megatron's ``iteration = args.iteration``, from what its load_checkpoint returned), as a ``range``
    from a start of its own. Where it stands at its start at the call, it counts its calls
    (:func:`_while_start_read`)."""
    counter = _while_counter(loop)
    if not counter:
        return False
    if not counter.isidentifier():
        return True
    return (any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == counter for t in node.targets)
                for node in ast.walk(scope))
            and not set_to_numbers(counter, scope))


def _while_start_read(loop: ast.AST, scope: ast.AST, frame, kept=()) -> bool:
    """A ``while`` over a counter of the script's own (:func:`_while_counter`) started from something other than a
    number in the source (Megatron's ``iteration = args.iteration``, GPT-NeoX's ``neox_args.iteration``, nanoGPT's
    ``iter_num``, which its resume branch sets from its checkpoint, a trainer's ``self.global_step``) that stands at its
    start as the process calls: 0, or 1 where the loop adds to it before the call (read at that call, as a ``range``
    from a variable: probe 19, Megatron's and GPT-NeoX's loops without a checkpoint of their own were taken as resuming
    themselves, and a resumed run trained as many steps again as it had, silently). Not a counter an object baft keeps
    holds (the ``client_state``'s: a restore sets it), nor where the script's own load_checkpoint returned the restored
    step (:mod:`baft.script.loop` reads that)."""
    counter = _while_counter(loop)
    if (frame is None or not counter or not while_from_own_start(loop, scope)
            or source.reads_engine_step(ast.parse(counter, mode="eval").body, scope)):
        return False
    held = ast.parse(counter, mode="eval").body
    if isinstance(held, (ast.Attribute, ast.Subscript)) and any(_value(held.value, frame) is k for k in kept
                                                                 if k is not None):
        return False
    value = _value(held, frame)
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    call = source.call_position(frame)
    before = any((node.lineno, node.col_offset) < call for node in _adds_one(loop, counter))
    return value == (1 if before else 0)


STOPS = (ast.Lt, ast.LtE, ast.NotEq)  # ``while i < n``
REACHED = {ast.Gt: "left", ast.GtE: "left", ast.Eq: "either", ast.Lt: "right", ast.LtE: "right"}  # ``if i >= n: break``


def _while_counter(loop: ast.AST) -> str:
    """The counter of the script's own a ``while`` stops on and adds 1 to, a name or a path of attributes and items
    from one (``i``, ``self.global_step``, litgpt's ``state["iter_num"]``: :func:`_counter_path`): ``while i < n`` (or ``<=``, ``!=``), such a comparison among the conditions an ``and`` joins
    (a trainer's ``while not self.should_stop and self.global_step < self.max_steps``), or a ``while True`` that breaks
    where it reaches a bound (nanoGPT's ``if iter_num > max_iters: break``); "" where there is none."""
    if not isinstance(loop, ast.While):
        return ""
    test = loop.test
    compared = [_counter_path(cond.left) for cond in (test.values if isinstance(test, ast.BoolOp)
                                                      and isinstance(test.op, ast.And) else [test])
                if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and isinstance(cond.ops[0], STOPS)]
    if isinstance(test, ast.Constant) and test.value:
        for stop in _break_conditions(loop.body):
            for cond in _joined(stop):
                side = REACHED.get(type(cond.ops[0])) if isinstance(cond, ast.Compare) and len(cond.ops) == 1 else None
                if side in ("left", "either"):
                    compared.append(_counter_path(cond.left))
                if side in ("right", "either"):
                    compared.append(_counter_path(cond.comparators[0]))
    return next((name for name in compared if name and _adds_one(loop, name)), "")


def _joined(test: ast.AST) -> list[ast.AST]:
    """The conditions an ``or`` or an ``and`` joins in ``test``, those nested in them too; else ``test`` alone. Each
    comparison of a counter among them stops the loop where it reaches its bound: alone (``or``), or with the others
    (minGPT's ``if config.max_iters is not None and self.iter_num >= config.max_iters: break``)."""
    if isinstance(test, ast.BoolOp):
        return [cond for value in test.values for cond in _joined(value)]
    return [test]


def _break_conditions(body: list) -> list[ast.AST]:
    """The conditions of the ``if`` statements of a loop's ``body`` whose own body breaks out of that loop (not out of
    a loop inside it)."""
    found = []
    for statement in body:
        if isinstance(statement, ast.If):
            if any(isinstance(s, ast.Break) for s in _own_statements(statement.body)):
                found.append(statement.test)
            found += _break_conditions(statement.orelse)
            found += _break_conditions([s for s in statement.body if isinstance(s, ast.If)])
        elif isinstance(statement, (ast.With, ast.AsyncWith, ast.Try)):
            found += _break_conditions(statement.body)
    return found


def _own_statements(body: list):
    """The statements of ``body`` and those the blocks in it hold that run with it (a ``with``, a ``try``), not a
    loop's, a condition's or a function's."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.With, ast.AsyncWith, ast.Try)):
            yield from _own_statements(statement.body)


def _counter_path(expr: ast.AST) -> str:
    """``expr`` as its source reads, where it is a name or a path of attributes and items at a constant key from one
    (``i``, ``self.global_step``, litgpt's ``state["iter_num"]``); "" for any other expression."""
    node = expr
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Constant):
            return ""
        node = node.value
    return ast.unparse(expr) if isinstance(node, ast.Name) else ""


def _adds_one(loop: ast.AST, counter: str) -> list[ast.AST]:
    """The statements of ``loop`` that add 1 to ``counter`` (:func:`_counter_path`)."""
    return [node for node in ast.walk(loop) if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add)
            and _counter_path(node.target) == counter and isinstance(node.value, ast.Constant)
            and node.value.value == 1]


def _data(expr: ast.AST, frame) -> bool:
    expr = _through(expr)
    if isinstance(expr, ast.Call) and source.called_name(expr.func) == "zip":
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
    """A ``while`` over a counter (:func:`_while_counter`: ``while i < n``, ``while True`` that breaks at ``i > n``)
    that is a name the scope sets to nothing but numbers, and ``i += 1`` in the loop."""
    counter = _while_counter(loop)
    if not counter or not counter.isidentifier() or source.reads_engine_step(ast.Name(counter, ast.Load()), scope):
        return False
    started = [node.value for node in ast.walk(scope) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == counter for t in node.targets)]
    return bool(started) and all(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in started)


def set_to_numbers(name: str, scope: ast.AST) -> bool:
    """Whether ``scope`` sets ``name`` to nothing but numbers: no resume of the script's own (Megatron's ``iteration =
    args.iteration``, from what its load_checkpoint returned)."""
    return all(isinstance(node.value, ast.Constant) and isinstance(node.value.value, int) for node in ast.walk(scope)
               if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets))
