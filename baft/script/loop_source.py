"""The loops around a call to ``train_batch``, read from the script's source (:func:`loop_around`): whether they
count their calls (:mod:`baft.script.counting`), read the engine's step, call a collective or set state between the
calls, and the values they carry (:mod:`baft.script.carried_source`); :mod:`baft.script.loop` acts on what they
are."""

from __future__ import annotations

import ast
import functools
import types
from dataclasses import dataclass
from typing import Optional

import torch

from baft.script import attributes, carried_source, carry, counting, source
from baft.script.carry import Carried

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv"}  # torch.distributed's and deepspeed.comm's


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
    counts = [counting.counts_calls(loop, scope, frame, kept) or (step and _train_calls(file, loop) > 1)
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
                    unread=not reads_step and (counting.count_around_data(loops, counts) or any(
                        not (count or counting.goes_on_itself(loop, frame)
                             or counting.while_from_own_start(loop, scope))
                        for count, (_, loop, scope, frame) in zip(counts, loops))),
                    from_step=any(isinstance(loop, (ast.For, ast.AsyncFor))
                                  and source.reads_engine_step(loop.iter, scope) for _, loop, scope, _ in loops),
                    sets_state=tuple(where for file, loop, _, frame in loops
                                     for where in _sets_state(file, loop, frame, kept)),
                    own_count=next((count for file, loop, scope, frame in loops
                                    for count in _own_count(file, loop, scope, frame, kept)
                                    if count not in {c.where for c in carried if not c.read_before_call}), ""),
                    carried=carried,
                    start_read=any(counting.start_read(loop, scope, frame, kept) for _, loop, scope, frame in loops),
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
                and node.target.id not in set_otherwise and counting.set_to_numbers(node.target.id, scope)
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
