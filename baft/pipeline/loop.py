"""A training loop that counts its own calls to ``train_batch`` from zero, kept in step after a restore.

DeepSpeedExamples' pipeline script loops ``for step in range(args.steps): engine.train_batch()``. Every
process counts from 0, so a run resumed at step k would train ``args.steps`` more steps (to k +
``args.steps``), and a replacement in place would call ``train_batch`` k times more than its peers, whose
last calls would find nobody to meet. A loop on the engine's step (``while engine.global_steps < N``) has
neither problem.

baft reads the loops around the script's first call to ``train_batch`` or ``eval_batch`` in a process,
from the source of the calling frames (:func:`loop_around`). Where every loop around it is a ``range``
from a number (``range(n)``, ``range(1, n + 1)``) whose bounds do not read the engine's step, an
``itertools.count()``, or a ``while`` over a counter the script sets to a number and adds 1 to, the loop
*counts calls*, and baft keeps it in step:

* a process restored at step k *replays* its first k calls: each returns the value that call returned
  in the run that trained it (:class:`History`, saved with every snapshot) and trains nothing; the
  ``eval_batch`` calls among them return theirs, and ``save_checkpoint`` writes nothing (the step's
  checkpoint was written when it was trained); the script's own code between the calls runs, and what it
  changed of the state baft keeps is put back as step k + 1 first started when the loop calls to train it;
* in place, a survivor's call finishes the step it was called for, however far back the restore went
  (each step trained again from the generators and hyper-parameters it first started with), and a
  replacement's calls from k + 1 train those steps with it, replaying the evaluations and checkpoints the
  survivors made then.

The ``"loop"`` key of the ``"baft"`` section overrides what is read: ``"calls"`` or ``"steps"``. A script
that calls ``train_batch`` from a loop of the other kind later (a warm-up phase on the engine's step, then a
``range``) is warned when it does: a process resumed in the second loop could not tell how many of its calls
were made, and stops there with an error.
"""

from __future__ import annotations

import ast
import base64
import copy
import linecache
import sys
import types
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from baft.errors import BaftError
from baft.pipeline.rng import rng_states, set_rng_states
from baft.pipeline.schedulers import script_schedulers
from baft.recovery import world

ENGINE_STEP = ("global_steps", "global_samples")  # a bound that reads these resumes with the engine
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv"}  # torch.distributed's and deepspeed.comm's
SEQUENCES = (range, list, tuple, torch.Tensor, np.ndarray)  # gone through from the start by a new process
KEPT_STARTS = 64  # steps whose starting generators a survivor keeps: a recovery in place goes back fewer


@dataclass(frozen=True)
class LoopSite:
    """The loops around a call to ``train_batch`` (outermost first), as read from the source."""

    where: str  # file:line of the innermost loop
    text: str  # that loop's header
    counts_calls: bool
    # none of the loops reads the engine's step, and one is a ``while`` over something else (a counter of the
    # script's own?): resumed, it would run as many steps again as it ran from the start
    unread: bool = False
    collective: str = ""  # a collective the loops call between the calls (file:line and its text), if any
    # a ``for`` over a range from the engine's step: a fixed number of calls from where the process started
    from_step: bool = False
    # where the loops set an attribute of an object from outside them (``data.active = ...``), file:line and text
    sets_state: str = ""


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
    return LoopSite(where=f"{filename}:{innermost.lineno}", text=header,
                    collective=next(filter(None, (_collective(file, loop) for file, loop, _, _ in loops)), ""),
                    counts_calls=all(_counts_calls(loop, scope, frame) for _, loop, scope, frame in loops),
                    unread=not reads_step and any(isinstance(loop, ast.While) and not _counts_calls(loop, scope)
                                                  for _, loop, scope, _ in loops),
                    from_step=any(isinstance(loop, (ast.For, ast.AsyncFor)) and _reads_engine_step(loop.iter, scope)
                                  for _, loop, scope, _ in loops),
                    sets_state=next(filter(None, (_sets_state(file, loop, frame, kept)
                                                  for file, loop, _, frame in loops)), ""))


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
    """A ``for`` over ``range(n)``, ``range(1, n + 1)``, ``trange(n)``, ``count()`` (or one of them in ``tqdm(...)``
    or ``enumerate(...)``): a start that is a number, bounds that neither read the engine's step nor a name
    assigned from it; in ``frame``, over a list, tuple or array the script holds (``for lr in lrs``) or a range
    from 0 or 1 (``range(args.start, n)``), which a new process goes through from its start again; or a
    ``while`` over a counter of its own (:func:`_while_counts`)."""
    if isinstance(loop, ast.While):
        return _while_counts(loop, scope)
    if not isinstance(loop, (ast.For, ast.AsyncFor)):
        return False
    call = loop.iter
    while isinstance(call, ast.Call) and _name(call.func) in ("tqdm", "enumerate") and call.args:
        call = call.args[0]
    if frame is not None and not _reads_engine_step(call, scope):
        value = _value(call, frame)
        if isinstance(value, range) and value.start in (0, 1) or isinstance(value, SEQUENCES[1:]):
            return True  # a range from another start: the script's own resume position, perhaps
    if not isinstance(call, ast.Call):
        return False
    if _name(call.func) == "count":  # itertools.count(start): a range without an end
        return all(isinstance(arg, ast.Constant) and isinstance(arg.value, int) for arg in call.args)
    if not (_name(call.func) in ("range", "trange") and call.args):
        return False
    if len(call.args) > 1 and not (isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, int)):
        return False
    return not _reads_engine_step(call, scope)


def _value(expr: ast.AST, frame):
    """What ``expr`` holds in ``frame``, where it only reads names, attributes, items and arithmetic, and calls
    ``range`` or ``len`` (nothing it evaluates can change anything); None otherwise."""
    allowed = (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Load, ast.BinOp, ast.UnaryOp, ast.operator,
               ast.unaryop, ast.Slice, ast.Tuple, ast.List, ast.Call)
    for node in ast.walk(expr):
        if not isinstance(node, allowed) or (isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in ("range", "len") and not node.keywords)):
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
    ``self.step += 1``), but of a module or one of ``kept``, as ``file:line (text)``; "" where none is."""
    made = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    found = []
    for node in ast.walk(loop):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            base = target
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if not isinstance(target, ast.Attribute) or not isinstance(base, ast.Name) or base.id in made:
                continue
            value = frame.f_locals.get(base.id, frame.f_globals.get(base.id))
            if not isinstance(value, types.ModuleType) and not any(value is k for k in kept):
                found.append((node.lineno, f"{filename}:{node.lineno} ({ast.unparse(node)})"))
    return min(found)[1] if found else ""


def _collective(filename: str, loop: ast.AST) -> str:
    """The first call of a collective of ``torch.distributed`` (or ``deepspeed.comm``) in ``loop``, or in a function of
    the same file it calls, as ``file:line (text)``; "" where none is."""
    tree = _parsed(filename)
    functions = {node.name: node for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in ("torch.distributed", "deepspeed.comm") for alias in node.names}

    def is_collective(call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Name):
            return func.id in COLLECTIVES and func.id in imported
        return (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES
                and any(word in ast.unparse(func.value) for word in ("dist", "comm")))

    calls = [node for node in ast.walk(loop) if isinstance(node, ast.Call)]
    for call in calls + [node for call in calls if isinstance(call.func, ast.Name) and call.func.id in functions
                         for node in ast.walk(functions[call.func.id]) if isinstance(node, ast.Call)]:
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
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        if node is not scope and getattr(node, "value", None) is not None and any(
                isinstance(t, ast.Name) and t.id in names for t in targets):
            if any(word in ast.unparse(node.value) for word in ENGINE_STEP):
                return True
    return False


class Column:
    """One number per step, as a commit record holds it: the base64 of their bytes. The record is written with
    every snapshot and the history grows with the run, so each block of steps is encoded once (a list of 100,000
    floats took 130 ms as JSON, every snapshot); blocks of a multiple of 3 values make their base64 join."""

    BLOCK = 3 * 1024

    def __init__(self, dtype: str, values=()):
        self.dtype, self.values, self.blocks = np.dtype(dtype), list(values), []

    def truncate(self, steps: int) -> None:
        """Keep the first ``steps`` values (a step trained again replaces what it had)."""
        del self.values[steps:], self.blocks[steps // self.BLOCK:]

    def encoded(self) -> str:
        """The values' bytes in base64 (every value a number by now)."""
        full = len(self.values) // self.BLOCK
        while len(self.blocks) < full:
            start = len(self.blocks) * self.BLOCK
            self.blocks.append(_base64(self.values[start:start + self.BLOCK], self.dtype))
        return "".join(self.blocks) + _base64(self.values[full * self.BLOCK:], self.dtype)

    @classmethod
    def decoded(cls, text, dtype: str) -> "Column":
        """From :meth:`encoded`'s text, or the JSON list a record held before baft packed it."""
        if isinstance(text, list):
            return cls(dtype, text)
        return cls(dtype, np.frombuffer(base64.b64decode(text), dtype=dtype).tolist())


def _base64(values: list, dtype) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


@dataclass
class History:
    """What ``train_batch`` returned at each step, and ``eval_batch`` after each: what a replayed call returns;
    and what the script's code after the call reads of the engine then (its ``global_samples``, its learning
    rates). Kept, and saved with every snapshot, in a process whose loop counts calls; a survivor recovering in
    place keeps its own (its loop does not run again the evaluations after the restored step)."""

    # train.values[k - 1]: the value of step k (a 0-d tensor until a capture reads it; None, read back as NaN, where
    # it cannot be replayed)
    train: Column = field(default_factory=lambda: Column("float64"))
    samples: Column = field(default_factory=lambda: Column("int64"))  # the engine's global_samples after each step
    lrs: Column = field(default_factory=lambda: Column("float64"))  # each param group's lr after each step, in turn
    groups: int = 0  # param groups a step's lrs hold: the first step's
    unreplayable: set = field(default_factory=set)  # steps whose value was not a number
    evals: dict = field(default_factory=dict)  # step -> the values eval_batch returned while the engine was there
    dtypes: dict = field(default_factory=dict)  # "train", "eval": the dtype of the values

    def record_train(self, step: int, value, samples: int, lrs: list) -> None:
        for column, per_step in ((self.train, 1), (self.samples, 1), (self.lrs, self.groups)):
            column.truncate((step - 1) * per_step)  # a step trained again (in place, after a restore)
        self.unreplayable.discard(step)
        value = self._value("train", value)
        if value is None:
            self.unreplayable.add(step)
        self.train.values.append(value)
        self.samples.values.append(samples)
        self.groups = self.groups or len(lrs)
        self.lrs.values += (list(lrs) + [float("nan")] * self.groups)[:self.groups]

    def record_eval(self, step: int, value) -> None:
        self.evals.setdefault(step, []).append(self._value("eval", value))

    def value(self, step: int):
        """What the call that trained ``step`` returned (a float), or None where it cannot be replayed."""
        if step > len(self.train.values) or step in self.unreplayable:
            return None
        return self.train.values[step - 1]

    def samples_after(self, step: int, batch_size: int) -> int:
        """The engine's ``global_samples`` after ``step`` (at ``batch_size`` a step, where an earlier snapshot's
        history does not say)."""
        return self.samples.values[step - 1] if step <= len(self.samples.values) else step * batch_size

    def lrs_after(self, step: int) -> list[float]:
        """The param groups' learning rates after ``step`` (NaN for a group the step had not); [] where not kept."""
        if step * self.groups > len(self.lrs.values):
            return []
        return self.lrs.values[(step - 1) * self.groups:step * self.groups]

    def _value(self, kind: str, value):
        """A scalar tensor's value (a float once :meth:`items` read it: exact for float32 and bf16); anything else
        cannot be replayed (None)."""
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            return None
        self.dtypes[kind] = str(value.dtype).removeprefix("torch.")
        return value.detach()  # read at the next snapshot's capture: no wait for the device here

    def items(self) -> dict:
        """As the commit record holds it (JSON)."""
        for values in (self.train.values, *self.evals.values()):
            i = len(values)
            while i and not isinstance(values[i - 1], float):  # those recorded since the last capture
                i -= 1
            values[i:] = [float(v) if isinstance(v, torch.Tensor) else v for v in values[i:]]
        # copies: the commit record is written on another thread while training records on
        return {"train": self.train.encoded(), "samples": self.samples.encoded(), "lrs": self.lrs.encoded(),
                "groups": self.groups, "unreplayable": sorted(self.unreplayable),
                "evals": {str(k): list(v) for k, v in self.evals.items()}, "dtypes": dict(self.dtypes)}

    @classmethod
    def from_items(cls, items: dict) -> "History":
        return cls(Column.decoded(items["train"], "float64"), Column.decoded(items.get("samples", []), "int64"),
                   Column.decoded(items.get("lrs", []), "float64"), items.get("groups", 0),
                   set(items.get("unreplayable", [])) | {i + 1 for i, v in enumerate(items["train"]) if v is None}
                   if isinstance(items["train"], list) else set(items.get("unreplayable", [])),
                   {int(k): list(v) for k, v in items["evals"].items()}, dict(items["dtypes"]))


class Loop:
    """How this process's script loops over ``train_batch``, read at its first call, what it returned, and the
    calls it replays. One per process: a survivor recovering in place keeps its loop (its engine is made
    again, not its loop)."""

    def __init__(self):
        self.site: Optional[LoopSite] = None
        self.decided = False
        self.counts_calls = False
        self.history = History()
        self.calls = 0  # calls to train_batch the loop has made in this process
        self.to_replay = 0  # the first calls, which trained the steps up to the restored one in an earlier process
        self.evaluated_until = 0  # the loop's evaluations and checkpoints up to this step were made then too
        self.evals_replayed = 0  # eval_batch calls replayed since the latest train_batch call
        self.step_called_for = 0  # the step the loop's latest call that trains is for
        self.peers: Optional[dict] = None  # in a replacement in place: the survivors' progress()
        self.started: dict[int, dict] = {}  # step -> generators and hyper-parameters as its iteration started
        self.recorded = False  # whether the restored snapshot holds a loop's history
        self.not_in_place = ""  # why a peer's death relaunches every rank rather than replace it in place
        self.call_sites: set = set()  # where train_batch was called from (the first one: what the loop read)
        self.said_unreplayable = False  # whether an eval_batch value a replay could not return was said

    def restored(self, items: Optional[dict]) -> None:
        """The history a snapshot holds, in a process that has not trained yet (a survivor keeps its own)."""
        if not self.decided:
            self.history = History.from_items(items) if items else History()
            self.recorded = items is not None

    def decide(self, engine, frame, training: bool = True) -> None:
        """At each call to ``train_batch`` (``training``) or ``eval_batch`` (``frame``: its caller's): at the
        process's first, what its loop is; at a ``train_batch`` from another place, whether that place's loop is of
        the same kind."""
        if training:
            site = (frame.f_code, frame.f_lineno, frame.f_back.f_lineno if frame.f_back is not None else None)
            if site not in self.call_sites:
                if self.call_sites and self.decided:
                    self._elsewhere(engine, frame)
                self.call_sites.add(site)
        if self.decided:
            return
        self.decided = True
        mode = engine.baft.config.loop
        client = getattr(engine.baft, "client_state", None)
        self.site = loop_around(frame, kept=(engine, getattr(client, "source", None))) if mode == "auto" else None
        if self.site is not None and self.site.sets_state:
            self._sets_state(engine)
        self.counts_calls = mode == "calls" or (mode == "auto" and self.site is not None and self.site.counts_calls)
        if self.site is not None and self.site.unread and engine.global_rank == 0:
            print(f"baft: the loop at {self.site.where} ({self.site.text}) around train_batch does not read the "
                  f"engine's step: resumed after a fault it would run as many steps again as it ran from the start. "
                  f"Loop on the engine's step (while engine.global_steps < N), or say \"loop\": \"calls\" in the "
                  f"baft section if it counts its calls from 0", file=sys.stderr, flush=True)
        if not self.counts_calls:
            if self.site is not None and self.site.from_step:
                self.not_in_place = (f"its loop at {self.site.where} ({self.site.text}) makes a fixed number of calls "
                                     f"from the step it started at: a survivor's, started before the restored step, "
                                     f"would end before its replacement's")
            return
        if self.site is not None and self.site.collective:
            self.not_in_place = (f"its loop calls a collective between its calls to train_batch, at "
                                 f"{self.site.collective}: a replacement replaying the calls before the restored step "
                                 f"would wait there for peers that are not")
        # the snapshot of step k was taken as step k + 1 started: the loop's evaluations after step k were made
        self.to_replay = self.evaluated_until = k = engine.global_steps
        loop = f"the loop at {self.site.where} ({self.site.text})" if self.site else 'the loop ("loop": "calls")'
        if k and not self.recorded:
            raise BaftError(f"{loop} counts its calls to train_batch, and the snapshot of step {k} this process "
                            f"resumes from holds no record of them (the process that took it called train_batch "
                            f"from a loop on the engine's step, or the job started from a checkpoint): baft cannot "
                            f"tell how many of its calls were made. Loop on the engine's step (while "
                            f"engine.global_steps < N) in every phase of the script")
        peers = self.peers
        if peers is not None and peers["counts_calls"]:
            # a replacement in place: its peers' loops went on past the restored step, and made the evaluations and
            # checkpoints of the steps it trains again with them
            self.evaluated_until = peers["step_called_for"] - 1
            self.history.evals.update({int(step): v for step, v in peers["evals"].items()})
        if k and (engine.global_rank == 0 or peers is not None):
            print(f"baft: {loop} counts its calls to train_batch: resumed at step {k}, its first {k} calls return "
                  f"what steps 1-{k} returned, without training them again (\"loop\": \"steps\" in the baft section "
                  f"if it stops on the engine's step)", flush=True)

    def _sets_state(self, engine) -> None:
        """The loop sets state baft does not keep: in place, a survivor's call trains the steps since the restored
        one (two at a snapshot every step: the latest is committed as the next step ends) with its latest value, as
        the loop left it; a new process runs the loop again. Said at start where recovery in place is on."""
        self.not_in_place = (f"its loop sets {self.site.sets_state} between its calls to train_batch, which baft does "
                             f"not keep: a survivor would train the steps since the restored one with its latest value")
        if world.available() and world.generation() == 0 and engine.global_rank == 0:
            print(f"baft: on a fault every rank is replaced, not only the killed one: {self.not_in_place}. Keep it in "
                  f"a state baft saves (client_state= of baft.initialize, or the data iterator's state_dict) for its "
                  f"survivors to recover in place", file=sys.stderr, flush=True)

    def _elsewhere(self, engine, frame) -> None:
        """``train_batch`` called from another place than before: said where its loop is of the other kind."""
        if engine.baft.config.loop != "auto" or self.site is None or engine.global_rank != 0:
            return
        other = loop_around(frame)
        if other is None or other.counts_calls == self.counts_calls:
            return
        kinds = {True: "counts its calls", False: "does not count its calls"}
        print(f"baft: train_batch is called now from the loop at {other.where} ({other.text}), which "
              f"{kinds[other.counts_calls]}, after the loop at {self.site.where} ({self.site.text}), which "
              f"{kinds[self.counts_calls]}: a process resumed in the second could not tell how many of its calls "
              f"were made, and would stop with an error. Loop on the engine's step (while engine.global_steps < N) "
              f"in every phase", file=sys.stderr, flush=True)

    def progress(self) -> dict:
        """In a survivor recovering in place: whether its loop counts its calls, and if so the step its call is for and
        what ``eval_batch`` returned, for the replacements (their :attr:`peers`)."""
        if not self.counts_calls:
            return {"counts_calls": False}
        return {"counts_calls": True, "step_called_for": self.step_called_for, "evals": self.history.items()["evals"]}

    def starting(self, engine, step: int, again: bool) -> None:
        """Before the iteration that trains ``step``: where a survivor trains it again in the call that failed,
        the generators, the optimizer's hyper-parameters and the script's schedulers as they were when it first
        started (the script's loop, which does not run again for the steps before its call's, drew from those
        and may have set or stepped these); else they are kept for that."""
        groups = engine.optimizer.param_groups
        if again and step in self.started:
            kept = self.started[step]
            set_rng_states(kept["rng"])
            for group, values in zip(groups, kept["groups"]):
                group.update(values)
            for scheduler, state in kept["schedulers"]:
                scheduler.load_state_dict(copy.deepcopy(state))
            return
        self.started[step] = {"rng": rng_states(),
                              "groups": [{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in groups],
                              "schedulers": [(s, copy.deepcopy(s.state_dict())) for s in script_schedulers(engine)]}
        self.started.pop(step - KEPT_STARTS, None)

    @property
    def replaying(self) -> bool:
        """Whether the loop's next ``train_batch`` call is one that trained a step up to the restored one."""
        return self.calls < self.to_replay

    @property
    def replays_evaluations(self) -> bool:
        """Whether an ``eval_batch`` or ``save_checkpoint`` call now was made, after the same call to
        ``train_batch``, by the process that trained the step (or by the survivors, for a replacement in place)."""
        return 0 < self.evaluated_until and self.calls <= self.evaluated_until

    def called(self) -> None:
        """A call to ``train_batch``, replayed or not."""
        self.calls += 1
        self.evals_replayed = 0

    def record_eval(self, engine, value) -> None:
        """What ``eval_batch`` returned at the engine's step; said once where it cannot be replayed."""
        self.history.record_eval(engine.global_steps, value)
        if self.history.evals[engine.global_steps][-1] is None and not self.said_unreplayable:
            self.said_unreplayable = True
            if engine.global_rank == 0:
                print(f"baft: eval_batch returned {type(value).__name__} at step {engine.global_steps}, not a scalar "
                      f"(return_logits=True?): a process resumed after a fault replays the loop's calls before the "
                      f"restored step and could not replay this one, and would stop there. Loop on the engine's step "
                      f"(while engine.global_steps < N) to resume without replaying", file=sys.stderr, flush=True)

    def replay_train(self, engine):
        """What the next replayed ``train_batch`` call returns."""
        self.called()
        return self._recorded(engine, "train", self.history.value(self.calls), f"step {self.calls}")

    def replay_eval(self, engine):
        """What the next replayed ``eval_batch`` call returns."""
        self.evals_replayed += 1
        values = self.history.evals.get(self.calls, [])
        return self._recorded(engine, "eval", values[self.evals_replayed - 1] if self.evals_replayed <= len(values)
                              else None, f"eval_batch call {self.evals_replayed} after step {self.calls}")

    def _recorded(self, engine, kind: str, value, what: str):
        if value is None:
            raise BaftError(f"the loop replays its calls before the restored step, and {what} returned nothing "
                            f"baft recorded (not a scalar, or trained before baft recorded it); loop on the engine's "
                            f"step (while engine.global_steps < N) to resume without replaying")
        return torch.tensor(float(value), dtype=getattr(torch, self.history.dtypes[kind]), device=engine.device)


THIS_PROCESS = Loop()
