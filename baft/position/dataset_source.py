"""Reading the source of the data pipeline's own classes (a dataset's, a transform's): where a method sets an attribute
of the object itself (``self.rest = list(buf)`` in a stream's ``__iter__``), and where one draws from a global
generator (``torch.randn(8)``, ``np.random.rand()``, ``random.random()``; not from a generator it is given or makes,
``torch.randn(8, generator=g)``, ``np.random.default_rng(i).normal()``)."""

from __future__ import annotations

import ast
import inspect
import os
import types
from typing import Iterator, Optional

from baft.script import source

_TORCH_DRAWS = frozenset({"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
                          "rand_like", "randn_like", "randint_like"})
_TENSOR_DRAWS = frozenset({"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_",
                           "log_normal_"})
_NOT_DRAWS = frozenset({"default_rng", "RandomState", "Generator", "SeedSequence", "BitGenerator", "PCG64", "MT19937",
                        "Philox", "SFC64", "Random", "SystemRandom", "seed", "get_state", "set_state", "getstate",
                        "setstate"})
_READS = ("__getitem__", "__getitems__", "__iter__", "__next__", "__call__")  # what a loader calls as it reads


def sets_itself(cls: type, attr: str) -> Optional[str]:
    """Where a method of ``cls`` that the loader calls as it reads (``__getitem__``, ``__iter__``, ``__call__``: not
    one the loop calls, ``set_epoch``), or one such a method calls on the object, assigns the object's own ``attr``
    (``self.rest = ...``), as ``Packed.__iter__ (script.py:76)``; None where none does."""
    return next((where for name, where in _sets(cls) if name == attr), None)


def first_set(cls: type) -> Optional[tuple[str, str]]:
    """The first attribute of its own that a method of ``cls`` the loader calls as it reads sets (as
    :func:`sets_itself` finds them), and where: ``("seen", "Samples.__getitem__ (script.py:40)")``; None where none
    does."""
    return next(_sets(cls), None)


def _sets(cls: type) -> Iterator[tuple[str, str]]:
    """Each attribute of the object's own that a method of ``cls`` the loader calls as it reads (or one it calls on
    the object) assigns, and where."""
    methods = {function.__name__: (function, node) for function, node in _definitions(cls)}
    names, reached = [name for name in _READS if name in methods], set()
    while names:
        name = names.pop()
        if name in reached or not methods[name][1].args.args:
            continue
        reached.add(name)
        function, node = methods[name]
        me = node.args.args[0].arg
        for n in ast.walk(node):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                    yield t.attr, f"{function.__qualname__} ({_at(function, n)})"
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                    and n.func.value.id == me and n.func.attr in methods):
                names.append(n.func.attr)


def draws_globally(cls: type) -> Optional[str]:
    """Where a method of ``cls``, or a function of the script's it calls by name, draws from torch's, numpy's or
    python's global generator, as ``script.py:27``; None where none does."""
    for function, node in _definitions(cls):
        found = _draw(function, node)
        if found:
            return found
        for called in _called(function, node):
            definition = _definition(called)
            found = definition is not None and _draw(called, definition)
            if found:
                return found
    return None


def _draw(function: types.FunctionType, node: ast.AST) -> Optional[str]:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        name = source.dotted(call.func)
        given = any(k.arg == "generator" for k in call.keywords)
        root, _, rest = name.partition(".")
        module = function.__globals__.get(root)
        full = f"{module.__name__}.{rest}" if isinstance(module, types.ModuleType) and rest else ""
        last = name.rpartition(".")[2]
        if (full.startswith("torch.") and last in _TORCH_DRAWS and not given
                or full.startswith(("numpy.random.", "random.")) and last not in _NOT_DRAWS
                or isinstance(call.func, ast.Attribute) and call.func.attr in _TENSOR_DRAWS and not given):
            return _at(function, call)
    return None


def _called(function: types.FunctionType, node: ast.AST) -> Iterator[types.FunctionType]:
    """The script's functions ``function`` calls by a name of its module."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        value = function.__globals__.get(call.func.id)
        if isinstance(value, types.FunctionType) and _the_scripts(value):
            yield value


def _definitions(cls: type) -> list[tuple[types.FunctionType, ast.FunctionDef]]:
    """The methods of ``cls`` (of the script's: its own and those it inherits, not those it overrides), with their
    definitions as read from their files."""
    found, names = [], set()
    for owner in cls.__mro__:
        for name, value in vars(owner).items():
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if name not in names and isinstance(function, types.FunctionType) and _the_scripts(function):
                node = _definition(function)
                if node is not None:
                    found.append((function, node))
            names.add(name)
    return found


def _the_scripts(function: types.FunctionType) -> bool:
    module = function.__module__ or ""
    return not module.startswith(("torch", "numpy", "deepspeed", "baft")) and module != "builtins"


def _definition(function: types.FunctionType) -> Optional[ast.AST]:
    """The definition of ``function`` as read from its file; None where it cannot be read."""
    code = function.__code__
    tree = source.parsed(code.co_filename)
    return next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == code.co_name and code.co_firstlineno in (n.lineno, *(d.lineno for d in n.decorator_list))),
                None) if tree else None


def _at(function: types.FunctionType, node: ast.AST) -> str:
    return f"{os.path.basename(inspect.getsourcefile(function) or function.__code__.co_filename)}:{node.lineno}"
