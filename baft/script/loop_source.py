"""The loops around a call to ``train_batch``, read from the script's source (:func:`loop_around`): whether they
count their calls, read the engine's step, call a collective or set state between the calls, and the values they
carry (:mod:`baft.script.carried_source`); :mod:`baft.script.loop` acts on what they are."""

from __future__ import annotations

import ast
import functools
import types
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from baft.script import attributes, carried_source, carry, source
from baft.script.carry import Carried

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv"}  # torch.distributed's and deepspeed.comm's


SEQUENCES = (range, list, tuple, torch.Tensor, np.ndarray)  # gone through from the start by a new process


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
    saves: str = ""  # a torch.save the loops call between the calls (file:line and its text), if any
    # a ``for`` over a range from the engine's step: a fixed number of calls from where the process started
    from_step: bool = False
    # where the loops set an attribute of an object from outside them (``data.active = ...``), file:line and text
    sets_state: tuple[str, ...] = ()
    # where the loops (or what they call) add a number to a count of the script's own, file:line and text
    # (``iteration += 1``, a trainer's ``self.global_step += 1``)
    own_count: str = ""
    # the values of the script's own the loops carry from one iteration to the next (the previous loss, a patience
    # count, a loss meter), started before them at a literal, in source order
    carried: tuple[Carried, ...] = ()
    # one of the loops is a range from a start read at the call (``range(start, n)``): 0 or 1 then, it counts its
    # calls, unless the script resumed itself to that start
    start_read: bool = False
    # where the loops (or what they call) read the model's weights or gradients between the calls (an EMA of the
    # weights, a noise scale), file:line and text, and the name of the object of the script's whose method does
    reads_weights: str = ""
    weights_owner: str = ""

    @property
    def named(self) -> str:
        """The loop as baft's lines name it: ``the loop at FILE:LINE (HEADER)``."""
        return f"the loop at {self.where} ({self.text})"


def loop_around(frame, kept=(), training: bool = True) -> Optional[LoopSite]:
    """The loops around the call ``frame`` is in, and those around its callers' calls up to the script's
    module level; None where no loop is found (the source unreadable, or the call in no loop). ``kept``: objects
    whose attributes the loops may set without saying so (the engine, whose state baft keeps). A call to
    ``eval_batch`` (not ``training``) is read from the innermost loop that calls ``train_batch`` too: the loops of
    the evaluation itself (nanoGPT's ``for k in range(eval_iters)``, a ``for batch in val_loader``) count nothing the
    training loop does (probe 19: nanoGPT, which evaluates before its first step, was read from its evaluation's loop,
    and named it)."""
    loops = _loops_of(frame)
    if loops is None:
        return None
    if not training:
        trains = next((i for i, (file, loop, _, at) in enumerate(loops) if _reaches_train_batch(file, loop, at)), 0)
        loops = loops[trains:]
    if not loops:
        return None
    filename, innermost, _, _ = loops[0]
    header = (f"for {ast.unparse(innermost.target)} in {ast.unparse(innermost.iter)}"
              if isinstance(innermost, (ast.For, ast.AsyncFor)) else f"while {ast.unparse(innermost.test)}")
    reads_step = any(source.reads_engine_step(loop, scope) for _, loop, scope, _ in loops)
    # a count inside a ``while`` on the engine's step (``for _ in range(2): train_batch()``): resumed inside the
    # count, it would start again from 0; replayed, the while reads the step each replayed call sets
    on_step = [isinstance(loop, ast.While) and source.reads_engine_step(loop.test, scope)
               for _, loop, scope, _ in loops]
    # so is such a ``while`` that calls ``train_batch`` more than once a pass (a task's step, then another's): resumed
    # between its calls, its pass would start again from the first
    counts = [_counts_calls(loop, scope, frame, kept) or (step and _train_calls(file, loop) > 1)
              for (file, loop, scope, frame), step in zip(loops, on_step)]
    carried = tuple(value for file, loop, scope, frame in loops
                    for value in carried_source.carried(file, loop, scope, frame, kept))
    reads = [(where, owner, at) for file, loop, _, at in loops for where, owner in _reads_weights(file, loop, at)]
    for where, owner, at in reads:
        averaged = source.value_in(at, owner) if _held_apart(owner, at, kept, carried) else None
        if isinstance(averaged, torch.nn.Module) and carry.fits(averaged.state_dict()):
            # an EMA of the weights (torch's AveragedModel, timm's): kept with every snapshot as the values the loop
            # carries are (probe 28 K2: a resumed run made it again from the restored weights, silently)
            carried += (Carried(where, owner, frame=at, stateful=True),)
    # where it reads them otherwise, if it does (weight noise before the call: what a set-back names)
    kept_as_carried = {c.where for c in carried if c.stateful}
    weights, owner, at = next((read for read in reads if read[0] not in kept_as_carried),
                              reads[0] if reads else ("", "", None))
    held = _held_apart(owner, at, kept, carried) if weights else ""
    return LoopSite(where=f"{filename}:{innermost.lineno}", text=header,
                    collective=next(filter(None, (_collective(file, loop) for file, loop, _, _ in loops)), ""),
                    saves=next(filter(None, (_torch_save(file, loop) for file, loop, _, _ in loops)), ""),
                    counts_calls=any(counts) and all(count or step for count, step in zip(counts, on_step)),
                    unread=not reads_step and (_count_around_data(loops, counts) or any(
                        not (count or _goes_on_itself(loop, frame) or _while_from_own_start(loop, scope))
                        for count, (_, loop, scope, frame) in zip(counts, loops))),
                    from_step=any(isinstance(loop, (ast.For, ast.AsyncFor))
                                  and source.reads_engine_step(loop.iter, scope) for _, loop, scope, _ in loops),
                    sets_state=tuple(where for file, loop, _, frame in loops
                                     for where in _sets_state(file, loop, frame, kept)),
                    own_count=next((count for file, loop, scope, frame in loops
                                    for count in _own_count(file, loop, scope, frame, kept)
                                    if count not in {c.where for c in carried if not c.read_before_call}), ""),
                    carried=carried,
                    start_read=any(_start_read(loop, scope, frame, kept) for _, loop, scope, frame in loops),
                    reads_weights=weights, weights_owner=held)


def _loops_of(frame) -> Optional[list[tuple[str, ast.AST, ast.AST, object]]]:
    """(file, loop, its scope, its frame) for the loops around the call ``frame`` is in and its callers' calls up to
    the script's module level, innermost first; None where a source cannot be read."""
    loops: list[tuple[str, ast.AST, ast.AST, object]] = []
    while frame is not None:
        filename = frame.f_code.co_filename
        tree = source.parsed(filename)
        if tree is None:
            return None
        found = _loops_at(tree, frame.f_lineno)
        loops += [(filename, loop, scope, frame) for loop, scope in reversed(found)]
        if frame.f_code.co_name == "<module>":
            break
        frame = frame.f_back
    return loops


def trains_around(frame) -> bool:
    """Whether a loop around the call ``frame`` is in (an ``eval_batch`` call's caller) calls ``train_batch`` too: not
    where the script evaluates before its training loop (a trainer's sanity check over a few validation batches),
    whose loops say nothing of the training loop's (probe 19: read from a sanity check's ``for batch in val_loader``,
    a trainer's loop that counts its calls was taken as one on the engine's step, and a resumed run's epochs and
    learning rates differed, silently)."""
    loops = _loops_of(frame)
    return loops is None or any(_reaches_train_batch(file, loop, at) for file, loop, _, at in loops)


def set_before_call(frame, owner) -> str:
    """Where a loop around the call ``frame`` is in sets an attribute or item of ``owner`` (the script's
    ``client_state``, or the object whose method it is) before that call in an iteration (torchtitan's ``while
    train_state.step < steps: train_state.step += 1`` at its top), as ``file:line (text)``; "" where none does. A
    snapshot of step k is taken as step k + 1's call starts, after that code: a resumed loop runs it again on what the
    restore set (probe 22: a count one ahead, and a run that stops on it trained a step short, silently)."""
    owners = [o for o in (owner, getattr(owner, "__self__", None)) if o is not None]
    for filename, loop, _, at in _loops_of(frame) or ():
        call = source.call_position(at)
        for node in ast.walk(loop):
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or node.lineno < loop.body[0].lineno:
                continue  # (the loop's header: its bounds, not its iteration's code)
            for target in source.targets(node):
                base = target
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if (target is not base and isinstance(base, ast.Name) and (node.lineno, node.col_offset) < call
                        and any(source.value_in(at, base.id) is o for o in owners)):
                    return f"{filename}:{node.lineno} ({ast.unparse(node)})"
    return ""


def _reaches_train_batch(filename: str, loop: ast.AST, frame) -> bool:
    """Whether ``loop`` (run in ``frame``) calls ``train_batch``, or a function it calls does: one of the same file
    (:func:`source.reached`), or of another module of the script's it names (GPT-NeoX's ``train_step``), and those
    they call."""
    return any(source.called_name(call.func) == "train_batch"
               for _, call, _, _ in _calls_reached(filename, loop, frame))


def _calls_reached(filename: str, loop: ast.AST, frame):
    """(file, call, owner, method) for each call ``loop`` (run in ``frame``) makes, and the functions it calls make:
    those of the same file (:func:`source.reached`), and those of the script's own it names, in another module or as a
    method of an object of the script's it holds (``model_ema.update(model)``, ``self.flatten_grads()`` in it), and
    those they call; ``owner``: the name in ``frame`` of the object whose method makes the call (``model_ema``), else
    None; ``method``: where the call is to a method of a library's class, its name in ``frame``
    (``avg.update_parameters``) and its function, else None."""
    def named(name: str, names: Optional[dict]):  # what ``name`` (``a.b``) holds in the frame, or a function's names
        if names is None:
            return source.value_in(frame, name)
        root, *path = name.split(".")
        value = names.get(root)
        for attr in path:
            value = getattr(value, attr, None)
        return value

    todo, seen = [(filename, body, None, None) for body in source.reached(filename, loop)], set()
    while todo:
        file, body, names, owner = todo.pop(0)
        for call in (node for node in ast.walk(body) if isinstance(node, ast.Call)):
            path = source.dotted(call.func)
            function = named(path, names) if path else None
            this = None
            if isinstance(function, types.MethodType):
                this, function = function.__self__, function.__func__
            code = getattr(function, "__code__", None)
            library = isinstance(function, types.FunctionType) and source.library(code.co_filename)
            yield file, call, owner, (owner or path.rpartition(".")[0], function) if this is not None and library else None
            if (not isinstance(function, types.FunctionType) or code in seen or library
                    or (this is None and code.co_filename == file and names is None)):
                continue  # a function of the loop's own file: reached already
            seen.add(code)
            definition = source.defined_at(code)
            if definition is None:
                continue
            scope = dict(function.__globals__)
            if this is not None and definition.args.args:
                scope[definition.args.args[0].arg] = this
            holder = owner if owner is not None else (path.rpartition(".")[0] or None) if this is not None else None
            todo += [(code.co_filename, b, scope, holder) for b in source.reached(code.co_filename, definition)]


WEIGHTS = ("parameters", "named_parameters", "buffers", "named_buffers", "state_dict")
NOT_WEIGHTS = ("optim", "sched", "loader", "sampler", "data", "iter", "scaler")  # state_dict()s of other state


def _reads_weights(filename: str, loop: ast.AST, frame):
    """Where the loop (run in ``frame``), or what it calls, reads the model's weights or gradients between its calls
    to train (``model.parameters()``, ``model.state_dict()``, ``p.grad``: an EMA of the weights, a noise scale, a
    logged norm), as ``file:line (text)``, and the name of the object whose method reads them (``model_ema``), or "",
    for each such read in the order they are found. Not a ``state_dict()`` beside a ``save`` (a checkpoint:
    :func:`_torch_save`), nor one of what its name says is other state (an optimizer's, a loader's); a library's
    method that reads them from an object it is given (torch's ``AveragedModel.update_parameters(model)``: probe 28
    K2) is one at its call."""
    for file, call, owner, method in _calls_reached(filename, loop, frame):
        if method is not None and _reads_argument_weights(method[1]):
            yield f"{file}:{call.lineno} ({ast.unparse(call)})", method[0]
            continue
        name = source.called_name(call.func)
        receiver = source.dotted(call.func.value).rpartition(".")[2].lower() if isinstance(call.func,
                                                                                         ast.Attribute) else ""
        if (name not in WEIGHTS or not isinstance(call.func, ast.Attribute) or receiver.startswith("opt")
                or any(w in receiver for w in NOT_WEIGHTS)):
            continue
        if name == "state_dict" and _beside_a_save(file, call):
            continue
        yield f"{file}:{call.lineno} ({ast.unparse(call)})", owner or ""


def _reads_argument_weights(function: types.FunctionType) -> bool:
    """Whether the method ``function`` (a library's), or a method of ``self`` it calls, reads the weights of an object
    it is given, not its own (``model.parameters()`` in ``update_parameters(self, model)``, timm's ``_update(self,
    model)``)."""
    return _given_weights_read(function.__code__)


@functools.lru_cache(maxsize=512)
def _given_weights_read(code: types.CodeType) -> bool:
    """:func:`_reads_argument_weights` of the method whose code is ``code`` (read once: a library's file is long)."""
    tree = source.parsed(code.co_filename)
    found = [(cls, m) for cls in ast.walk(tree or ast.Module(body=[], type_ignores=[])) if isinstance(cls, ast.ClassDef)
             for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == code.co_name
             and code.co_firstlineno in (m.lineno, *(d.lineno for d in m.decorator_list))]
    if not found or not found[0][1].args.args:
        return False
    owner, definition = found[0]
    this = definition.args.args[0].arg
    called = {node.func.attr for node in ast.walk(definition) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == this}
    bodies = [definition] + [m for m in owner.body if isinstance(m, ast.FunctionDef) and m.name in called]
    for body in bodies:
        given = {a.arg for a in [*body.args.posonlyargs, *body.args.args[1:], *body.args.kwonlyargs]}
        if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WEIGHTS
               and isinstance(node.func.value, ast.Name) and node.func.value.id in given for node in ast.walk(body)):
            return True
    return False


def _held_apart(owner: str, frame, kept, carried) -> str:
    """``owner`` (a name in ``frame``) with its type's name, ``model_ema (ModelEmaV2)``, where it is an object no
    snapshot holds: not one of ``kept`` (the engine, the ``client_state``: its object, or the one whose method it is),
    nor one whose attributes are among the values the loop carries; else ""."""
    held = source.value_in(frame, owner) if owner else None
    if held is None or any(k is held or getattr(k, "__self__", None) is held for k in kept if k is not None):
        return ""
    if any(c.key == owner or c.key.startswith(owner + ".") for c in carried):
        return ""
    return f"{owner} ({type(held).__name__})"


def _beside_a_save(filename: str, call: ast.Call) -> bool:
    """Whether the innermost block (an ``if``, a loop, a function) that holds ``call`` in ``filename`` calls a
    ``save`` too (``torch.save({'model': model.state_dict()}, path)``)."""
    tree = source.parsed(filename)
    blocks = [node for node in ast.walk(tree) if isinstance(node, (ast.If, ast.For, ast.While, ast.FunctionDef,
                                                                   ast.AsyncFunctionDef))
              and node.lineno <= call.lineno <= (node.end_lineno or node.lineno)]
    if not blocks:
        return False
    innermost = max(blocks, key=lambda node: node.lineno)
    return any(isinstance(node, ast.Call) and source.called_name(node.func) == "save" for node in ast.walk(innermost))


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


def _counts_calls(loop: ast.AST, scope: ast.AST, frame=None, kept=()) -> bool:
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


def _start_read(loop: ast.AST, scope: ast.AST, frame=None, kept=()) -> bool:
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


def _count_around_data(loops: list, counts: list[bool]) -> bool:
    """A loop over the data inside one that counts from a start in the source (``for epoch in range(3): for batch in
    loader``): resumed, the data goes on from the restored position, the count from its start again. ``counts``:
    whether each of ``loops`` counts its calls."""
    return (any(not count and isinstance(loop, (ast.For, ast.AsyncFor)) and _data(loop.iter, frame)
                for count, (_, loop, _, frame) in zip(counts, loops))
            and any(count and not _start_read(loop, scope, frame)
                    for count, (_, loop, scope, frame) in zip(counts, loops)))


def _goes_on_itself(loop: ast.AST, frame) -> bool:
    """A ``for`` over an object the script holds that is neither a count nor a sequence (a loader, an iterator: it
    goes on from the restored data position), possibly through ``tqdm`` or ``enumerate``, or zipped; or over a range
    from a start of the script's own (its own resume position, perhaps)."""
    return isinstance(loop, (ast.For, ast.AsyncFor)) and (_range_from_own_start(loop.iter) or _data(loop.iter, frame))


def _while_from_own_start(loop: ast.AST, scope: ast.AST) -> bool:
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
            and not _set_to_numbers(counter, scope))


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
    if (frame is None or not counter or not _while_from_own_start(loop, scope)
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


def _sets_state(filename: str, loop: ast.AST, frame, kept) -> list[str]:
    """The assignments in ``loop`` to an attribute of an object it did not make (``data.active = ...``,
    ``self.step += 1``), but of a module, one of ``kept``, a class of the model's whose plain class attribute a
    snapshot keeps (``Block.scale = 0.75``: :func:`attributes.keeps_class_attribute`), or a dataset's setting
    (``dataset.noise = ...``: :func:`attributes.keeps_data_attribute`), each as ``file:line (text)``, in their
    lines' order; those a loop on the engine's step carries its snapshots keep (:meth:`baft.script.loop.Loop
    ._sets_state`). An ``iter(...)`` assigned (``self.it = iter(loader)``, an epoch's) is not state: which iterator
    ``train_batch`` reads is checked at every call (:meth:`baft.protection.Protection.reads`)."""
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    found = []
    for node in ast.walk(loop):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and source.called_name(node.value.func) == "iter":
            continue
        for target in source.targets(node):
            base = target
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if not isinstance(target, ast.Attribute) or not isinstance(base, ast.Name) or base.id in made:
                continue
            value = source.value_in(frame, base.id)
            if (not isinstance(value, types.ModuleType) and not any(value is k for k in kept)
                    and not (target.value is base and (attributes.keeps_class_attribute(value, target.attr)
                                                       or attributes.keeps_data_attribute(value, target.attr)))):
                found.append((node.lineno, f"{filename}:{node.lineno} ({ast.unparse(node)})"))
    return [where for _, where in sorted(found)]


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
                and not source.reads_engine_step(ast.Name(node.target.id, ast.Load()), scope)):
            found.append(f"{filename}:{node.lineno} ({ast.unparse(node)})")
    reached = [node for body in source.reached(filename, loop) for node in ast.walk(body)]
    read = {n.attr for n in reached if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
    assigned = [t for node in ast.walk(source.parsed(filename)) if isinstance(node, ast.Assign)
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
                and node.target.attr in read and node.target.attr not in resumed | set(source.ENGINE_STEP)):
            owner = source.value_in(frame, node.target.value.id)
            if not any(owner is k for k in kept):
                found.append(f"{filename}:{node.lineno} ({ast.unparse(node)})")
    return found


def _set_to_numbers(name: str, scope: ast.AST) -> bool:
    """Whether ``scope`` sets ``name`` to nothing but numbers: no resume of the script's own (Megatron's ``iteration =
    args.iteration``, from what its load_checkpoint returned)."""
    return all(isinstance(node.value, ast.Constant) and isinstance(node.value.value, int) for node in ast.walk(scope)
               if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets))


def _adds_a_number(node: ast.AST) -> bool:
    return (isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int))


def _train_calls(filename: str, loop: ast.AST) -> int:
    """The calls of ``train_batch`` every pass of ``loop`` makes: in its body outside conditions and inner loops (an
    ``if`` choosing one task's call or another's makes one), and so in the functions and methods of the same file it
    calls there, and those they call."""
    functions = {node.name: node for node in ast.walk(source.parsed(filename))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def calls(nodes, seen: frozenset) -> int:
        found = 0
        for node in (sub for statement in nodes for sub in _unconditional(statement)):
            name = source.called_name(node.func) if isinstance(node, ast.Call) else ""
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
    method of the same file it calls, and those they call (:func:`source.reached`), as ``file:line (text)``; "" where none
    is."""
    tree = source.parsed(filename)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in ("torch.distributed", "deepspeed.comm") for alias in node.names}

    def is_collective(call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Name):
            return func.id in COLLECTIVES and func.id in imported
        return (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES
                and any(word in ast.unparse(func.value) for word in ("dist", "comm")))

    for body in source.reached(filename, loop):
        for call in (node for node in ast.walk(body) if isinstance(node, ast.Call)):
            if is_collective(call):
                return f"{filename}:{call.lineno} ({ast.unparse(call)})"
    return ""


def _torch_save(filename: str, loop: ast.AST) -> str:
    """The first call of ``torch.save`` in ``loop``, or in a function or method of the same file it calls, and those
    they call (:func:`~baft.script.source.reached`), as ``file:line (text)``; "" where none is."""
    imported = {alias.asname or alias.name for node in ast.walk(source.parsed(filename)) if isinstance(node, ast.ImportFrom)
                and node.module == "torch" for alias in node.names if alias.name == "save"}
    for body in source.reached(filename, loop):
        for call in (node for node in ast.walk(body) if isinstance(node, ast.Call)):
            func = call.func
            if (isinstance(func, ast.Name) and func.id in imported) or (
                    isinstance(func, ast.Attribute) and func.attr == "save" and ast.unparse(func.value) == "torch"):
                return f"{filename}:{call.lineno} ({ast.unparse(call)})"
    return ""
