"""Every random generator a training step draws from (python's, numpy's, torch's, CUDA's, the generators of
DeepSpeed's model-parallel tracker, those the model's modules hold, and those the script names): its state as it
stands, and as JSON (a commit record's ``rng``, what a survivor tells a replacement)."""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import inspect
import pickle
import random
import sys
import types
import weakref
from typing import Iterator, Optional

import numpy as np
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
from deepspeed.runtime.dataloader import DeepSpeedDataLoader

from baft.script import source


GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_HELD: list[tuple[str, "weakref.ref", str]] = []  # the model's generators: (name, its module, the attribute)
_LATER: list[tuple[str, "weakref.ref", str]] = []  # the attributes of the script's modules that were None then
_NAMED: dict[str, object] = {}  # the generators the script names (its variables, its collate function's globals)


def hold_module_generators(module: torch.nn.Module) -> None:
    """Count the ``torch.Generator`` each of ``module``'s modules holds as an attribute (noise a layer draws from a
    generator of its own, ``self.gen = torch.Generator().manual_seed(0)``) among every generator from now on: no
    state of torch's holds it, and a resumed run would draw other noise."""
    _HELD[:] = [(f"{name}.{attr}" if name else attr, weakref.ref(sub), attr)
                for name, sub in module.named_modules() for attr, value in vars(sub).items()
                if isinstance(value, torch.Generator)]
    # None now in a module of the script's: a generator it may make as it first runs forward, said where it does
    _LATER[:] = [(f"{name}.{attr}" if name else attr, weakref.ref(sub), attr)
                 for name, sub in module.named_modules() if _scripts_module(type(sub))
                 for attr, value in vars(sub).items() if value is None]


@functools.lru_cache(maxsize=None)
def _scripts_module(cls: type) -> bool:
    filename = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return filename is not None and not source.library(filename)


def _hold_made_later() -> None:
    """A generator a module of the script's made since :func:`hold_module_generators` (``if self.gen is None:
    self.gen = torch.Generator().manual_seed(1)`` in its forward; probe 26's g12: a resumed run drew from one made
    again, silently): a torch one is held from now on, as those made before (a restore where the module has none yet
    makes it, :func:`set_rng_states`); another kind is said once, by the rank holding it."""
    for held in [h for h in _LATER if isinstance(getattr(h[1](), h[2], None), GENERATORS)]:
        _LATER.remove(held)
        if isinstance(getattr(held[1](), held[2]), torch.Generator):
            _HELD.append(held)
            continue
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"baft: rank {rank}: the model's {held[0]} is a generator its module made after baft.initialize (as it "
              f"first ran forward), which no snapshot holds: a run resumed after a fault draws from one made again, "
              f"not where the uninterrupted run's stood. Make it in the module's __init__", file=sys.stderr, flush=True)


def _made_again(name: str, state: torch.Tensor) -> Optional[torch.Generator]:
    """Where ``name`` is a module's attribute still None (:data:`_LATER`) that held a torch generator of ``state`` at
    the snapshot: one made there now, held from now on."""
    held = next((h for h in _LATER if h[0] == name and getattr(h[1](), h[2], False) is None), None)
    if held is None:
        return None
    # a CPU generator's state is its Mersenne Twister's (5056 bytes), a CUDA one's its seed and offset (16)
    generator = torch.Generator() if state.numel() > 16 else torch.Generator(device=torch.cuda.current_device())
    setattr(held[1](), held[2], generator)
    _LATER.remove(held)
    _HELD.append(held)
    return generator


def hold_script_generators(frame, data_iterator=None) -> None:
    """Count the generators the script names among every generator from now on: the variables of ``frame`` (the
    script's call of ``baft.initialize``) and of its callers, its module's globals, and the globals read by the
    code of its loader's ``collate_fn`` and dataset (``rng = np.random.default_rng(0)`` at the top of the script,
    drawn by its loop between steps or by a collate function). No state of torch's holds them, and a resumed run
    would draw from them as first seeded. Named once, by the first ``baft.initialize``: a survivor's again keeps
    them."""
    if _NAMED:
        return
    while frame is not None:
        scope = "script" if frame.f_code.co_name == "<module>" else frame.f_code.co_name
        _name_generators(frame.f_locals, scope)
        if frame.f_code.co_name == "<module>":
            break
        frame = frame.f_back
    hold_loader_generators(getattr(data_iterator, "loader", data_iterator))  # a RepeatingLoader's: the loader


def hold_loader_generators(loader) -> None:
    """Count the generators ``loader``'s dataset and ``collate_fn`` hold, and the globals their code reads, among
    every generator from now on (:func:`hold_script_generators`; a loader baft finds as the loop first reads it)."""
    if isinstance(loader, (torch.utils.data.DataLoader, DeepSpeedDataLoader)):
        # the loader's state keeps them as the iteration starts, but the loop may draw from them before (in this
        # process's copy, where workers draw from theirs): kept as the RNG states are, they are set as step k left them
        _name_generators(held_by(loader), "loader")
    collate = getattr(loader, "collate_fn", None)
    if isinstance(collate, types.FunctionType):
        _name_generators(_read_globals(collate), "collate_fn")
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.Dataset):
        for method in vars(type(dataset)).values():
            if isinstance(method, types.FunctionType):
                _name_generators(_read_globals(method), "dataset")


def held_by(loader) -> dict:
    """The generators that the dataset of ``loader`` (and the datasets it wraps: a ``Subset``'s, a ``ConcatDataset``'s)
    or its ``collate_fn`` hold as attributes, by where they are (``dataset.rng``)."""
    return {f"{path}.{name}": value for path, obj in data_objects(loader) for name, value in vars(obj).items()
            if isinstance(value, GENERATORS)}


def data_objects(loader) -> Iterator[tuple[str, object]]:
    """The dataset of ``loader``, the datasets it wraps and its ``collate_fn`` where that is an object (not a
    function), and the objects of the script's they hold (a torchvision-style ``transform``, the transforms a
    ``Compose`` lists, the arguments a ``functools.partial`` binds), by where they are (``dataset``,
    ``dataset.dataset``, ``dataset.datasets[0]``, ``dataset.transform.transforms[0]``, ``collate_fn``)."""
    seen = set()

    def walk(obj, path: str, depth: int) -> Iterator[tuple[str, object]]:
        if isinstance(obj, functools.partial):  # its bound arguments, as attributes of one object
            obj, path = _Bound(obj), f"{path}.keywords"
        if id(obj) in seen or depth > 3 or not _of_the_script(obj):
            return
        seen.add(id(obj))
        yield path, obj
        for name, value in vars(obj).items():
            if _of_the_script(value) or isinstance(value, functools.partial):
                yield from walk(value, f"{path}.{name}", depth + 1)
            elif isinstance(value, (list, tuple)) and len(value) <= 64:  # a ConcatDataset's, not a list of samples
                for i, item in enumerate(value):
                    if _of_the_script(item):
                        yield from walk(item, f"{path}.{name}[{i}]", depth + 1)

    yield from walk(getattr(loader, "dataset", None), "dataset", 0)
    collate = getattr(loader, "collate_fn", None)
    if collate is not None and not inspect.isfunction(collate) and not inspect.ismethod(collate):
        yield from walk(collate, "collate_fn", 0)


class _Bound:
    """A ``functools.partial``'s keyword arguments as the attributes of an object (the same dict: set here, set
    there)."""

    def __init__(self, bound: functools.partial):
        self.__dict__ = bound.keywords


def _of_the_script(obj) -> bool:
    """Whether ``obj`` is an object of the data pipeline whose attributes baft reads: a dataset, or an instance of a
    class with attributes of its own (a transform), not a module, class, function, tensor, model or generator."""
    if isinstance(obj, torch.utils.data.Dataset):
        return True
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType, types.FunctionType,
                                                              types.MethodType, torch.Tensor, torch.nn.Module,
                                                              *GENERATORS))
            and not type(obj).__module__.startswith(("torch.", "numpy", "builtins")))


def _name_generators(scope: dict, where: str) -> None:
    for name, value in scope.items():
        if (isinstance(value, GENERATORS) and value is not torch.default_generator
                and not any(value is held for held in _NAMED.values())):
            _NAMED[f"{where}.{name}"] = value


def _read_globals(function: types.FunctionType) -> dict:
    """The globals and closed-over variables ``function``'s code (and the code it defines) reads."""
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [const for const in code.co_consts if inspect.iscode(const)]
    read = {name: function.__globals__[name] for name in names if name in function.__globals__}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            read[name] = cell.cell_contents
        except ValueError:  # a cell not yet set
            pass
    return read


def _held() -> Iterator[tuple[str, object]]:
    for name, module, attr in _HELD:
        generator = getattr(module(), attr, None)  # a module gone, or the attribute given another value: not held
        if isinstance(generator, torch.Generator):
            yield name, generator
    yield from _NAMED.items()


def generator_state(generator):
    """The state of one generator of any kind :data:`GENERATORS` names."""
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return copy.deepcopy(generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        return generator.get_state()
    return generator.getstate()


def set_generator_state(generator, state) -> None:
    """Set one generator to what :func:`generator_state` gave."""
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)


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
    if _LATER:
        _hold_made_later()
    held = {name: generator_state(generator) for name, generator in _held()}
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
            generator = held.get(name)
            if generator is None and isinstance(state, torch.Tensor):
                generator = _made_again(name, state)
            if generator is not None:
                set_generator_state(generator, state)


def drawn_between(before: dict, now: dict) -> list[str]:
    """The generators whose state changed from ``before`` to ``now`` (two :func:`rng_states`)."""
    def same(name):
        a, b = before[name], now[name]
        if name == "numpy":
            return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))
        if name == "cuda":
            return all(torch.equal(x, y) for x, y in zip(a, b))
        if name == "tracker":
            return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if name == "modules":
            return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
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
        elif name == "tracker":
            out[name] = {key: _b64(state) for key, state in value.items()}
        elif name == "modules":  # a torch generator's state as bytes, another kind's pickled
            out[name] = {key: _b64(state) if torch.is_tensor(state) else {"pickle": _pickled(state)}
                         for key, state in value.items()}
        else:
            out[name] = [_b64(t) for t in value]
    return out


def fingerprints(states: dict) -> dict:
    """A short digest of each generator's state in ``states`` (a :func:`rng_states`), by name: equal where the states
    are, to tell later whether a generator stands where it stood."""
    return {name: hashlib.blake2b(pickle.dumps(_plain(value)), digest_size=8).hexdigest()
            for name, value in states.items()}


def _plain(value):
    """A state with its tensors as their bytes (a pickled tensor holds more than its values, and costs more)."""
    if torch.is_tensor(value):
        return value.numpy().tobytes()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):  # CUDA's, one a device (python's and numpy's are tuples of numbers)
        return [_plain(item) for item in value]
    return value


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
    if "tracker" in items:
        out["tracker"] = {key: _bytes(state) for key, state in items["tracker"].items()}
    if "modules" in items:
        out["modules"] = {key: pickle.loads(base64.b64decode(state["pickle"])) if isinstance(state, dict)
                          else _bytes(state) for key, state in items["modules"].items()}
    return out


def same_state(a, b) -> bool:
    """Whether two states :func:`generator_state` gave are equal."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    return pickle.dumps(a) == pickle.dumps(b)


def _pickled(state) -> str:
    return base64.b64encode(pickle.dumps(state)).decode()


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
