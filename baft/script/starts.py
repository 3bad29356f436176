"""Whether the script starts a value it carries at nothing but a literal (``prev = None``, ``best = float("inf")``,
``losses = []``, ``deque(maxlen=4)``), read from its source: a value it starts otherwise may be its own resume, which
baft leaves to it (:mod:`baft.script.carried_source`)."""

from __future__ import annotations

import ast
from typing import Optional

from baft.script import source

# what a start made of nothing of the script's reads (``np.float32(np.inf)``, ``1e9 * 2``): not a file (its own
# resume), nor torch (a global tensor made before baft.initialize is kept otherwise: the tensor globals)
NUMERIC_MODULES = {"math", "numpy", "sys"}
NUMERIC_BUILTINS = {"float", "int", "abs", "min", "max", "round", "pow", "bool", "complex"}
READERS = {"load", "loadtxt", "genfromtxt", "fromfile", "from_file"}


def started_at_module_level_at_a_literal(name: str, tree: ast.Module) -> bool:
    """Whether the module's own statements (not its functions' or classes') assign ``name``, and only literals."""
    started, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            started += source.assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)
        todo.extend(ast.iter_child_nodes(node))
    return bool(started) and all(literal(value) for value in started)


def attribute_started_at_a_literal(attr: str, filename: str, inside: set, owner_class: type) -> bool:
    """Whether the file assigns ``.attr`` outside the statements at ``inside`` (line, column), but to ``self`` or an
    object it holds in a class that is not ``owner_class`` nor one of its bases (another class's ``self.state =
    State()``: probe 27, an HF-style callback's ``self.state = {...}`` beside it was not carried; its
    ``self.state.best = ...``: probe 28), or such a class defaults it (a
    dataclass's ``loss_sum: float = 0.0``), and only literals."""
    started = _attribute_starts(attr, filename, inside, owner_class)
    return bool(started) and all(literal(value) for value in started)


def _attribute_starts(attr: str, filename: str, inside: set, owner_class: type) -> list[ast.AST]:
    """What the file assigns ``.attr`` (:func:`attribute_started_at_a_literal`'s), but from itself: another class's
    fold of its own ``.attr`` (``self.state.mean = 0.8 * self.state.mean + ...``) starts nothing."""
    tree = source.parsed(filename)
    ours = {cls.__name__ for cls in owner_class.__mro__}
    classes = [cls for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)]
    others = {(node.lineno, node.col_offset) for cls in classes if cls.name not in ours for node in ast.walk(cls)
              if isinstance(node, ast.stmt)}
    started = [v for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               and (node.lineno, node.col_offset) not in inside and node.value is not None
               for v in source.assigned(node, lambda t: isinstance(t, ast.Attribute) and t.attr == attr and not (
                   (node.lineno, node.col_offset) in others and source.dotted(t.value).split(".")[0] == "self"))
               if not any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(v))]
    started += [v for cls in classes if cls.name in ours for node in cls.body
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                for v in source.assigned(node, lambda t: isinstance(t, ast.Name) and t.id == attr)]
    return started


EMPTY = {"list", "dict", "set", "tuple", "deque", "OrderedDict", "defaultdict", "Counter"}  # made empty by a call


FACTORIES = EMPTY | {"int", "float", "str", "bool"}  # what a defaultdict makes its missing items with


# well-known constants a start reads (``best = math.inf``, ``-np.inf``)
CONSTANTS = {f"{module}.{name}" for module in ("math", "np", "numpy", "torch")
             for name in ("inf", "nan", "pi", "e")} | {"math.tau", "sys.maxsize", "sys.float_info.max",
                                                      "sys.float_info.min", "sys.float_info.epsilon"}


def literal(value: ast.AST) -> bool:
    """A number, a string, None, a bool, ``float("inf")``, a well-known constant (``math.inf``: :data:`CONSTANTS`),
    either sign of one (``-float("inf")``), a choice between two (``inf if MODE == "min" else -inf``), an empty or
    literal list, tuple, dict or set, one made by a call (``deque(maxlen=4)``, ``defaultdict(int)``, ``Counter()``,
    ``dict()``), and a dataclass field of one (``field(default=0)``, ``field(default_factory=list)``); a list, tuple,
    set or dict of them (``{"best": float("inf"), "bad": 0}``)."""
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, (ast.UAdd, ast.USub)):
        return literal(value.operand)
    if isinstance(value, ast.IfExp):
        return literal(value.body) and literal(value.orelse)
    if isinstance(value, ast.Attribute):
        return source.dotted(value) in CONSTANTS
    if isinstance(value, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
        elements = [*value.keys, *value.values] if isinstance(value, ast.Dict) else value.elts
        return all(element is not None and literal(element) for element in elements)
    if isinstance(value, ast.Call) and source.called_name(value.func) in ("float", "int") and not value.keywords:
        return all(literal(arg) for arg in value.args)
    if isinstance(value, ast.Call) and source.called_name(value.func) in EMPTY:
        return _made_empty(value)
    if isinstance(value, ast.Call) and source.called_name(value.func) == "field" and not value.args:
        given = {k.arg: k.value for k in value.keywords}
        factory = given.get("default_factory")
        return ("default" in given and literal(given["default"])
                or isinstance(factory, (ast.Name, ast.Attribute)) and source.called_name(factory) in EMPTY)
    try:
        ast.literal_eval(value)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _made_empty(call: ast.Call) -> bool:
    """Whether ``call`` (of a container type, :data:`EMPTY`) makes one of literals: ``deque(maxlen=n)`` of any size,
    ``defaultdict(int)`` of a plain factory; not one of what a variable holds (``list(state["losses"])``: the script's
    own resume)."""
    args = list(call.args)
    if source.called_name(call.func) == "defaultdict" and args:
        factory = args.pop(0)
        if not (isinstance(factory, (ast.Name, ast.Attribute)) and source.called_name(factory) in FACTORIES
                or isinstance(factory, ast.Lambda) and literal(factory.body)):
            return False
    keywords = [k.value for k in call.keywords if not (k.arg == "maxlen" and source.called_name(call.func) == "deque")]
    return all(literal(value) for value in args + keywords)


WEIGHTS = ("parameters", "named_parameters", "state_dict")  # what a copy of the model's weights is made from


def started_at_a_literal(name: str, loop: ast.AST, scope: ast.AST, or_weights: bool = False) -> bool:
    """Whether ``scope`` assigns ``name`` outside ``loop``, and only a literal (:func:`literal`), or
    (``or_weights``) a copy of the model's weights (``{n: p.detach().clone() for n, p in model.named_parameters()}``,
    an EMA's start: a resumed process makes it from the restored weights, not as the snapshot held it)."""
    started = _starts(name, loop, scope)
    return bool(started) and all(literal(value) or or_weights and _copies_weights(value) for value in started)


def _starts(name: str, loop: ast.AST, scope: ast.AST) -> list[ast.AST]:
    """What ``scope`` assigns ``name`` outside ``loop``."""
    inside = range(loop.lineno, (loop.end_lineno or loop.lineno) + 1)
    return [v for node in ast.walk(scope) if isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None and node.lineno not in inside
            for v in source.assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)]


def unread_start(name: str, loop: ast.AST, scope: ast.AST, tree: ast.Module) -> Optional[ast.AST]:
    """The first start of ``name`` (:func:`started_at_a_literal`'s) that is no literal yet reads nothing of the
    script's nor a file (no name but a numeric builtin or a module of numbers ``tree`` imports, :data:`NUMERIC_MODULES`:
    ``np.float32(np.inf)``, ``1e9 * 2``), or None: not the script's own resume, so a value the loop carries from it is
    named, not dropped silently (probe 28 K6)."""
    return _unread(_starts(name, loop, scope), tree)


def unread_attribute_start(attr: str, filename: str, inside: set, owner_class: type) -> Optional[ast.AST]:
    """:func:`unread_start` of the attribute ``attr`` (:func:`attribute_started_at_a_literal`'s starts)."""
    return _unread(_attribute_starts(attr, filename, inside, owner_class), source.parsed(filename))


def _unread(started: list[ast.AST], tree: ast.Module) -> Optional[ast.AST]:
    numeric = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name in NUMERIC_MODULES} | NUMERIC_BUILTINS
    return next((value for value in started if not literal(value) and all(
        n.id in numeric for n in ast.walk(value) if isinstance(n, ast.Name)) and not any(
        isinstance(n, ast.Attribute) and n.attr in READERS for n in ast.walk(value))), None)


def _copies_weights(value: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in WEIGHTS
               for n in ast.walk(value))
