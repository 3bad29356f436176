"""The tensors the script's main file holds in globals as the process first protects its model, which its loop or a
function the loop does not call (the loss, a layer's forward) updates in place (``W.mul_(0.9).add_(...)``) or
rebinds (``W = 0.9 * W + ...``): class weights the loss function reads (probe 26: resumed from their first values,
silently; the loop's source names no such update, :mod:`baft.script.carried_source` reads assignments started at a
literal). Those that changed are kept with every snapshot, as :mod:`baft.script.held` compares and keeps them, and set
by a restore; the others are set back as they started. A tensor of the model's state (a parameter or buffer the
script also holds in a global) is the snapshot's already, and is not looked at."""

from __future__ import annotations

import itertools
import sys
from typing import Optional

import torch

from baft.script import held

_AT_START: list[dict[str, held.Held]] = []  # name -> the tensor held.hold made of it, as this process first protected
# its model


def _names() -> dict:
    main = sys.modules.get("__main__")
    return vars(main) if main is not None else {}


def hold_globals(module: torch.nn.Module) -> None:
    """Note the main file's tensors as the process first protects ``module`` (a survivor recovering in place keeps
    its first), but those of ``module``'s state."""
    if _AT_START:
        return
    state = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}
    _AT_START.append({name: held.hold(value) for name, value in list(_names().items())
                      if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                      and value.untyped_storage().data_ptr() not in state})


def changed_globals(rank: int = 0) -> Optional[dict[str, object]]:
    """Those that changed since :func:`hold_globals`, by name (a tensor's value, or the plain value it was rebound
    to), or None where none did; a tensor over :data:`~baft.script.held.MOST_BYTES` is not kept, said once by
    ``rank``."""
    names, changed = _names(), {}
    for name, was in (_AT_START[0] if _AT_START else {}).items():
        value = names.get(name, held.NOT_KEPT)
        if value is held.NOT_KEPT or not held.differs(was, value):
            continue
        value = held.kept(value, rank, f"the script's global {name}",
                          "Keep it in client_state= of baft.initialize (an object with state_dict() and "
                          "load_state_dict()), or in a buffer of the model (register_buffer)")
        if value is not held.NOT_KEPT:
            changed[name] = value
    return changed or None


def globals_now() -> dict[str, object]:
    """The values of the globals :func:`hold_globals` noted, as they are now (what a digest reads)."""
    names = _names()
    return {name: names[name] for name in (_AT_START[0] if _AT_START else {}) if held.data(names.get(name))}


def restore_globals(changed: Optional[dict[str, object]]) -> None:
    """Set the globals as a snapshot had them: those it holds (``changed``; a tensor copied into the one the global
    holds, where of its shape and dtype), and the others as the process started (a survivor's may have moved on)."""
    names, changed = _names(), changed or {}
    for name, was in (_AT_START[0] if _AT_START else {}).items():
        current = names.get(name)
        value = held.put(changed[name], current) if name in changed else held.as_started(was, current)
        if value is not held.NOT_KEPT and value is not current:
            names[name] = value
