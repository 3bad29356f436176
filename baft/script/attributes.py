"""The plain values (numbers, strings, None) the model's modules of the script's own classes hold as attributes: a
count a forward keeps (a loss module's ``self.calls += 1`` warming up its label smoothing), a setting the loop
changes, which neither a parameter nor a buffer holds. Those that changed since the process's first
``baft.initialize`` are kept with every snapshot and set again by a restore; one set once at start (a rank, a
width) is not kept, and so not carried to another rank. torch's and DeepSpeed's modules keep theirs in buffers, or
in what baft keeps otherwise (the pipeline's ``micro_offset``)."""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from baft.script import source

PLAIN = (bool, int, float, str, type(None))
_MODULES_OWN = frozenset(vars(torch.nn.Module()))  # what every module holds (``training``): not the script's
_AT_START: list[dict[str, object]] = []  # path -> value, as this process first protected its model


def module_attributes(module: torch.nn.Module) -> dict[str, object]:
    """Every such attribute of ``module`` and its submodules, by path (``loss_fn.calls``; ``.calls`` of ``module``)."""
    return {f"{name}.{attr}": value for name, sub in module.named_modules() if _scripts(type(sub))
            for attr, value in vars(sub).items() if isinstance(value, PLAIN) and attr not in _MODULES_OWN}


def hold_module_attributes(module: torch.nn.Module) -> None:
    """Note the attributes as the process first protects ``module`` (a survivor recovering in place keeps its
    first)."""
    if not _AT_START:
        _AT_START.append(module_attributes(module))


def changed_module_attributes(module: torch.nn.Module) -> Optional[dict[str, object]]:
    """Those that changed since :func:`hold_module_attributes`, or None where none did."""
    start = _AT_START[0] if _AT_START else {}
    changed = {path: value for path, value in module_attributes(module).items()
               if path not in start or start[path] != value or type(start[path]) is not type(value)}
    return changed or None


def restore_module_attributes(module: torch.nn.Module, changed: Optional[dict[str, object]]) -> None:
    """Set the attributes as a snapshot had them: those it holds (``changed``), and the others as the process
    started (a survivor recovering in place may have changed them since)."""
    for path, value in {**(_AT_START[0] if _AT_START else {}), **(changed or {})}.items():
        name, attr = path.rsplit(".", 1)
        try:
            setattr(module.get_submodule(name), attr, value)
        except AttributeError:  # a submodule this model has not: another model's snapshot is refused before this
            continue


@functools.lru_cache(maxsize=None)
def _scripts(cls: type) -> bool:
    """Whether ``cls`` is defined in a file of the script's, not torch's, DeepSpeed's or another installed one (read
    once a class: a snapshot walks every module, and where a file lies takes a look at the disk)."""
    filename = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return filename is not None and not source.library(filename)
