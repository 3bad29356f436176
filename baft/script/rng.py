"""Every random generator a training step draws from (python's, numpy's, torch's, CUDA's, the generators of
DeepSpeed's model-parallel tracker, and those the model's modules hold): its state as it stands, and as JSON (a
commit record's ``rng``, what a survivor tells a replacement)."""

from __future__ import annotations

import base64
import random
import weakref
from typing import Iterator, Optional

import numpy as np
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker


_HELD: list[tuple[str, "weakref.ref", str]] = []  # the model's generators: (name, its module, the attribute)


def hold_module_generators(module: torch.nn.Module) -> None:
    """Count the ``torch.Generator`` each of ``module``'s modules holds as an attribute (noise a layer draws from a
    generator of its own, ``self.gen = torch.Generator().manual_seed(0)``) among every generator from now on: no
    state of torch's holds it, and a resumed run would draw other noise."""
    _HELD[:] = [(f"{name}.{attr}" if name else attr, weakref.ref(sub), attr)
                for name, sub in module.named_modules() for attr, value in vars(sub).items()
                if isinstance(value, torch.Generator)]


def _held() -> Iterator[tuple[str, torch.Generator]]:
    for name, module, attr in _HELD:
        generator = getattr(module(), attr, None)  # a module gone, or the attribute given another value: not held
        if isinstance(generator, torch.Generator):
            yield name, generator


def rng_states() -> dict:
    """Every generator's state as it is, to compare, keep and set again (:func:`set_rng_states`)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    # Megatron-style dropout draws inside ``get_cuda_rng_tracker().fork()`` from generators of the tracker's own,
    # seeded once by ``model_parallel_cuda_manual_seed``, each advanced by every forward that forks it
    tracked = get_cuda_rng_tracker().get_states()
    if tracked:
        states["tracker"] = dict(tracked)
    held = {name: generator.get_state() for name, generator in _held()}
    if held:
        states["modules"] = held
    return states


def set_rng_states(states: dict) -> None:
    """Set the generators ``states`` holds (all of :func:`rng_states`, or some)."""
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        np.random.set_state(states["numpy"])
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "tracker" in states:
        get_cuda_rng_tracker().set_states(dict(states["tracker"]))
    if "modules" in states:
        held = dict(_held())
        for name, state in states["modules"].items():
            if name in held:
                held[name].set_state(state)


def drawn_between(before: dict, now: dict) -> list[str]:
    """The generators whose state changed from ``before`` to ``now`` (two :func:`rng_states`)."""
    def same(name):
        a, b = before[name], now[name]
        if name == "numpy":
            return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))
        if name == "cuda":
            return all(torch.equal(x, y) for x, y in zip(a, b))
        if name in ("tracker", "modules"):
            return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        return torch.equal(a, b) if name == "torch" else a == b

    return [name for name in now if name in before and not same(name)]


def to_json(states: dict, names: Optional[list] = None) -> dict:
    """:func:`rng_states` (those ``names``) as JSON-able values."""
    out = {}
    for name, value in states.items():
        if names is not None and name not in names:
            continue
        if name == "python":
            out[name] = [value[0], list(value[1]), value[2]]
        elif name == "numpy":
            out[name] = [value[0], value[1].tolist(), int(value[2]), int(value[3]), float(value[4])]
        elif name == "torch":
            out[name] = _b64(value)
        elif name in ("tracker", "modules"):
            out[name] = {key: _b64(state) for key, state in value.items()}
        else:
            out[name] = [_b64(t) for t in value]
    return out


def from_json(items: dict) -> dict:
    """What :func:`to_json` made, as :func:`set_rng_states` takes it."""
    out = {}
    if "python" in items:
        version, internal, gauss = items["python"]
        out["python"] = (version, tuple(internal), gauss)
    if "numpy" in items:
        kind, keys, pos, has_gauss, gauss = items["numpy"]
        out["numpy"] = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss)
    if "torch" in items:
        out["torch"] = _bytes(items["torch"])
    if "cuda" in items:
        out["cuda"] = [_bytes(s) for s in items["cuda"]]
    for name in ("tracker", "modules"):
        if name in items:
            out[name] = {key: _bytes(state) for key, state in items[name].items()}
    return out


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
