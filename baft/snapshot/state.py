"""A rank's training state: the tensors to snapshot and the small items beside them.

Tensors (parameters, buffers, optimizer state) are enumerated in a fixed order so two
processes of the same model agree on the layout. The small items (RNG states, step
counters, optimizer hyper-parameters and per-parameter scalars, LR scheduler, loss scaler,
data position, the script's ``client_state``) are captured as JSON at the step boundary.

When each part is captured and restored (the rule a bit-identical resume rests on):

* captured at the start of iteration k+1: optimizer step k and DeepSpeed's scheduler step after it
  are done, and so is what the script's loop does after a step (counts in its ``client_state``,
  sets the next learning rate), which a resumed script does not do again: it goes on at the
  loop's next call. What the loop does before that call, it does again: a learning rate it sets
  comes out the same, one it multiplies by a factor twice;
* restored at ``baft.initialize``, before the script reads ``global_steps`` or takes its
  iterator: tensors, counters, hyper-parameters, scheduler, loss scaler, data position;
* a learning-rate scheduler the script made on the optimizer itself (:mod:`baft.script.schedulers`):
  captured with the rest, and restored where it exists, and again at the start of the first iteration after
  the restore, with the hyper-parameters (a scheduler made anew sets its first learning rate; one the loop
  steps before its call was stepped once more);
* the RNG states: captured at the start of iteration k+1 and set there again, at the start of the
  first iteration after the restore (:mod:`baft.snapshot.resumed_iteration`). What runs in between draws random
  numbers that an uninterrupted run drew before step 1 instead: DeepSpeed and the script build
  loaders and take iterators (a ``DataLoader`` iterator draws its base seed from torch's
  generator), and the restore itself re-positions the data. The generators the script's loop drew
  from between steps k and k+1 are kept too as they stood when step k ended, and set at
  ``baft.initialize``'s return, so the loop's own draws come out as they did (a ``DataLoader`` iterator the script
  makes before the loop's first call is noted and made again from what it was made from, and leaves them as set:
  :mod:`baft.position.first_iterators`);
* every value goes back with the type and bits it was captured with, never cast to the type
  the fresh engine holds (DeepSpeed's warmup schedulers start ``lr`` at an int 0, which a cast
  would keep at 0 for the first resumed step).
"""

from __future__ import annotations

import base64
import functools
import io
import re
from typing import Callable, Iterable, Iterator, Optional

import torch

from baft.errors import BaftError
from baft.script import schedulers
from baft.script.attributes import changed_module_attributes, replaced_modules, restore_module_attributes
from baft.script.held import PLAIN
from baft.script.main_globals import changed_globals, restore_globals
from baft.script.loop import THIS_PROCESS, frozen, set_frozen
from baft.script.rng import drawn_between, fingerprints, rng_states, to_json
from baft.snapshot.layout import TensorEntry, model_signature
from baft.snapshot.optimizers import base_optimizer, entry, optimizer_adapter
from baft.snapshot.resumed_iteration import RngRestore, set_param_groups

ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _client_state(engine):
    """The script's own state ``baft.initialize`` was given (``client_state=``), or None."""
    return getattr(getattr(engine, "baft", None), "client_state", None)


def check_capturable(engine, data_iterator=None) -> None:
    """A ``BaftError`` naming every part of the state baft cannot save and restore exactly, each with the way
    out: a resumed run would diverge from the uninterrupted one without a word."""
    optimizer_adapter(engine)
    loader = isinstance(data_iterator, torch.utils.data.DataLoader)
    parts = (("lr_scheduler", getattr(engine, "lr_scheduler", None),
              "give it state_dict() and load_state_dict(), as torch's schedulers have"),
             ("data_iterator", data_iterator,
              "pass torchdata's StatefulDataLoader (a drop-in), or deepspeed.utils.RepeatingLoader(loader), and train "
              "on that" if loader else "give it state_dict() and load_state_dict(), or pass torchdata's "
                                       "StatefulDataLoader"))
    problems = []
    for what, obj, way_out in parts:
        if obj is not None and not (callable(getattr(obj, "state_dict", None))
                                    and callable(getattr(obj, "load_state_dict", None))):
            problems.append(f"{what} {type(obj).__module__}.{type(obj).__qualname__}: baft cannot save its state, "
                            f"so a resumed run would silently differ; {way_out}")
    if problems:
        raise BaftError(" | ".join(problems))


def _replicas(engine) -> tuple[int, int]:
    """(this rank's data-parallel replica, the replicas of its stage)."""
    grid = getattr(engine, "grid", None)
    return (grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()) if grid is not None else (0, 1)


def _buffer_name(name: str, replica: int, replicas: int) -> str:
    """A module buffer's name in a snapshot. Each data-parallel replica keeps its own: a forward sets a buffer from
    the replica's own batches (BatchNorm's running statistics, a running mean), so the replicas' differ, and a
    share of each (the parameters') would restore a mix."""
    return f"buffer/{name}" if replicas == 1 else f"buffer/dp{replica}/{name}"


def _module_tensors(module: torch.nn.Module, replica: int,
                    replicas: int) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """(name in a snapshot, kind, name in ``module``, tensor) of every parameter (the ``Parameter``: its ``.data`` is
    the state), then every buffer, named as replica ``replica`` of ``replicas`` names its own: the one walk of the
    module that names its state, so that the layout (:func:`tensor_entries`) and the views (:func:`live_tensors`)
    name and order it alike."""
    for name, p in module.named_parameters():
        yield f"param/{name}", "parameters", name, p
    for name, b in module.named_buffers():
        yield _buffer_name(name, replica, replicas), "other", name, b


def module_tensors(engine, replica: Optional[int] = None,
                   replicas: Optional[int] = None) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name in a snapshot, kind, tensor) of the module's parameters (their ``.data``) and buffers, the buffers named as
    this rank's replica names them, or as replica ``replica`` of ``replicas`` does."""
    if replica is None:
        replica, replicas = _replicas(engine)
    for key, kind, _, t in _module_tensors(engine.module, replica, replicas):
        yield key, kind, t.data if kind == "parameters" else t


def named_state_tensors(engine) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every tensor this rank holds of its state, in a stable order."""
    yield from module_tensors(engine)
    for name, t in optimizer_adapter(engine).tensors():
        yield name, "optimizer", t


def buffer_views(engine, replica: int, replicas: int) -> dict[str, torch.Tensor]:
    """This rank's module buffers as :func:`byte_view` s, named as replica ``replica`` of ``replicas`` names its
    own (a restore with another number of replicas than the snapshot's gives every replica replica 0's)."""
    return {key: byte_view(b) for key, kind, _, b in _module_tensors(engine.module, replica, replicas)
            if kind == "other"}


def register_later_buffers(engine, layouts: Iterable) -> list[str]:
    """The buffers a snapshot of this stage holds that ``engine.module`` has not registered yet, on modules it has: a
    cache a layer registers as it first runs forward, which a restore comes before. Registered now, not persistent
    (what a cache made so is), of the snapshot's dtype and shape, for the restore to fill, where they are all that
    tells this model from the snapshot's (of the first of ``layouts`` so; none of another model's); their names."""
    ours, tried = model_signature(tensor_entries(engine)), set()
    for layout in layouts:
        wanted = model_signature(layout.tensors)
        if wanted == ours:
            return []
        if wanted in tried:
            continue
        tried.add(wanted)
        registered = _register_missing(engine, layout.tensors)
        if registered and model_signature(tensor_entries(engine)) == wanted:
            return registered
        for name in registered:  # not what tells the models apart: left as the model had them
            path, _, attr = name.rpartition(".")
            delattr(engine.module.get_submodule(path), attr)
    return []


def _register_missing(engine, snapshot_tensors) -> list[str]:
    have = {name for name, _ in engine.module.named_buffers()}
    device = next(iter(engine.module.parameters()), torch.empty(0)).device
    registered = []
    for t in snapshot_tensors:
        name = re.sub(r"^buffer/(dp\d+/)?", "", t.name)
        if t.kind != "other" or name in have or name in registered:
            continue
        path, _, attr = name.rpartition(".")
        try:
            module = engine.module.get_submodule(path)
        except AttributeError:
            continue
        if not hasattr(module, attr):
            module.register_buffer(attr, torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=device),
                                   persistent=False)
            registered.append(name)
    return registered


def tensor_entries(engine) -> list[TensorEntry]:
    """Every tensor of the stage's state, the partitions and buffers other replicas own included."""
    _, replicas = _replicas(engine)
    params = [entry(key, p.data, kind) for key, kind, _, p in _module_tensors(engine.module, 0, replicas)
              if kind == "parameters"]
    buffers = [entry(key, b, kind, owner=d if replicas > 1 else None)
               for d in range(replicas) for key, kind, _, b in _module_tensors(engine.module, d, replicas)
               if kind == "other"]
    return params + buffers + optimizer_adapter(engine).entries()


def state_tensors(engine) -> dict[str, torch.Tensor]:
    """This rank's own state tensors by name."""
    return {name: t for name, _, t in named_state_tensors(engine)}


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat uint8 view of its bytes (what a snapshot copies, and a restore fills); of a tensor that is
    not contiguous, a copy of them."""
    return t.detach().reshape(-1).view(torch.uint8)


def byte_views(engine) -> dict[str, torch.Tensor]:
    """:func:`state_tensors` as :func:`byte_view` s."""
    return {name: byte_view(t) for name, t in state_tensors(engine).items()}


def live_tensors(engine) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """A function giving (name, tensor) for every tensor :func:`named_state_tensors` names, as the engine holds it
    when the function is called: a parameter whose ``.data`` was rebound, a buffer the module was given anew
    (``self.count = self.count + 1``), an optimizer state tensor replaced, each gives the tensor that holds its
    value now. The module is walked once, here: a snapshot calls it at each begin, and walking the module of a
    thousand tensors takes milliseconds (the optimizer's state is the adapter's to walk)."""
    module = engine.module
    named = list(_module_tensors(module, *_replicas(engine)))
    params = [(key, p) for key, kind, _, p in named if kind == "parameters"]
    buffers = [(key, _owner(module, name)._buffers, name.rpartition(".")[2]) for key, kind, name, _ in named
               if kind == "other"]
    adapter = optimizer_adapter(engine)

    def now():
        yield from params  # a Parameter object stays; its .data is what a rebinding changes
        for name, held, key in buffers:
            yield name, held[key]
        yield from adapter.tensors()
    return now


def _owner(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """The submodule that holds the buffer or parameter ``name`` (a dotted name relative to ``module``)."""
    path = name.rpartition(".")[0]
    return module.get_submodule(path) if path else module


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _torch_blob(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return _b64(buf.getvalue())


def _torch_unblob(text: str):
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


def unblob(value):
    """A value :func:`capture_items` kept: unpickled where it was pickled (a blob), else as it is."""
    return _torch_unblob(value) if isinstance(value, str) else value


def capture_rng(rng_end: Optional[dict] = None, rng_start: Optional[dict] = None, now: Optional[dict] = None) -> dict:
    """The generators' states now (``now``, where taken already), at an iteration's start (``rng``), as JSON;
    ``rng_between``: of those the script drew from since the previous iteration ended (``rng_end``,
    :func:`~baft.script.rng.rng_states`), their states then, what a resumed script's first such draws come from (:class:`RngRestore`); and
    ``rng_started``: the fingerprints of their states as the previous iteration started (``rng_start``), what a
    replay of the loop's calls up to it compares its own with."""
    now = rng_states() if now is None else now
    items = {"rng": to_json(now)}
    drawn = drawn_between(rng_end, now) if rng_end is not None else []
    if drawn:
        items["rng_between"] = to_json(rng_end, drawn)
    if rng_start is not None:
        items["rng_started"] = fingerprints(rng_start)
    return items


def capture_items(engine, data_iterator=None, script_schedulers: bool = True, carried: bool = True) -> dict:
    """The small state at the step boundary, as JSON-able values: built as such (a commit record per step), not
    walked after. The RNG states are :func:`capture_rng`'s. ``script_schedulers``: look for the schedulers the
    script made (False before its loop has run: they are looked for once per optimizer). ``carried``: keep the values
    the loop carries, as they stand when the next step's call has started, and the client_state a loop sets before
    its call as the call before returned (False where the step has just ended: the loop's code after its call has yet
    to run)."""
    items = {
        "counters": {k: int(getattr(engine, k, 0)) for k in ENGINE_COUNTERS},
        # as the script last set it (set_train_batch_size): a resumed script past where it set it does not again
        "train_batch_size": int(engine.train_batch_size()),
        # the config's: a relaunch whose config asks another is told that the run goes on at the snapshot's
        "configured_batch_size": getattr(getattr(engine, "baft", None), "configured_batch_size", None),
        # the forwards run so far: a PipelineModule with seed_layers seeds every layer's forward from it
        "micro_offset": int(getattr(engine.module, "micro_offset", 0)),
        # a count or setting the script's own modules keep in plain attributes (a loss module's calls), a running
        # statistic in a tensor attribute: pickled where one is not a plain value
        "module_attributes": _json_or_blob(changed_module_attributes(engine.module, engine.global_rank) or {}),
        # the submodules the script replaced by others (a loss swapped once): a restore cannot make them
        "replaced_modules": replaced_modules(engine.module) or {},
        # as the script last set them: one it froze at a step, a resumed script past that step does not freeze again
        "frozen": frozen(engine.module),
        # pickled: tuples (betas), ints (a scheduler's first lr) and tensors must come back as they were
        "param_groups": _torch_blob([{k: v for k, v in g.items() if k != "params"}
                                     for g in base_optimizer(engine.optimizer).param_groups]),
        "optimizer_scalars": _torch_blob(optimizer_adapter(engine).scalars()),
    }
    added = _added_groups(engine)
    if added is not None:  # param groups the script added after making the optimizer (add_param_group)
        items["added_groups"] = added
    if getattr(engine, "lr_scheduler", None) is not None:
        items["lr_scheduler"] = _torch_blob(engine.lr_scheduler.state_dict())
        items["lr_scheduler_settings"] = _torch_blob(schedulers.settings(engine.lr_scheduler))
    kept = schedulers.capture(engine) if script_schedulers else None
    if kept:
        items["script_schedulers"] = _torch_blob(kept)
    scaler = loss_scaler(engine.optimizer)
    if scaler is not None:
        items["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool, type(None)))}
    if data_iterator is not None and hasattr(data_iterator, "state_dict"):
        items["data"] = _torch_blob(data_iterator.state_dict())  # a loader's generator state is a ByteTensor
    client = _client_state(engine)
    if client is not None:  # as the previous call returned, where the loop sets it before its calls
        held = client.held if carried and THIS_PROCESS.client_set_before else None
        items["client_state"] = _torch_blob(held if held is not None else client.capture())
    reads = getattr(getattr(engine, "baft", None), "reads", None)
    reader = reads.reader_state() if reads is not None else None
    if reader is not None:  # a wrapper of the script's around the loader, read by train_batch: its epoch count
        items["reader"] = reader
    if THIS_PROCESS.counts_calls:  # what a process resumed here replays of the loop's calls
        items["loop"] = THIS_PROCESS.history.items()
    values = THIS_PROCESS.carried_values(engine) if carried else None
    if values is not None:
        items["carried"] = _torch_blob(values)
    tensors = changed_globals(engine.global_rank)
    if tensors is not None:  # the tensors of the script's globals that changed (class weights the loss reads)
        items["script_globals"] = _torch_blob(tensors)
    return items


def _json_or_blob(values: dict):
    """``values`` as they are where all are plain (JSON), else pickled."""
    return values if all(isinstance(v, PLAIN) for v in values.values()) else _torch_blob(values)


def loss_scaler(optimizer):
    """The object holding the loss scale (scale, iteration, last overflow, hysteresis), if any:
    ``loss_scaler`` of ZeRO and BF16_Optimizer, ``loss_scale_config`` of the FP16 optimizers."""
    for attr in ("loss_scaler", "loss_scale_config"):
        scaler = getattr(optimizer, attr, None)
        if scaler is not None and hasattr(scaler, "cur_scale"):
            return scaler
    return None


def restore_items(engine, items: dict, data_iterator=None) -> "RngRestore":
    """Put the small state back: counters, batch size, frozen parameters, hyper-parameters, scheduler, scaler, data
    position now; the RNG states by the hook returned, which must run before any other at the next iteration's start,
    the script's own schedulers now where they exist and by that hook, and the hyper-parameters again by that
    hook."""
    for k, v in items["counters"].items():
        setattr(engine, k, v)
    if items.get("train_batch_size", engine.train_batch_size()) != engine.train_batch_size():
        from deepspeed.runtime.pipe.engine import PipelineEngine

        PipelineEngine.set_train_batch_size(engine, items["train_batch_size"])  # DeepSpeed's: no step read yet
    if "micro_offset" in items:
        engine.module.micro_offset = items["micro_offset"]
    module_attributes = unblob(items["module_attributes"]) if "module_attributes" in items else None
    if module_attributes is not None:
        restore_module_attributes(engine.module, module_attributes)
    script_globals = _torch_unblob(items["script_globals"]) if "script_globals" in items else None
    restore_globals(script_globals)
    if "frozen" in items:
        _freeze(engine, items["frozen"])
    groups = items["param_groups"]
    if isinstance(groups, str):
        groups = _torch_unblob(groups)
    else:  # written before baft pickled the groups: JSON values, tuples as lists
        groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in groups]
    set_param_groups(engine, groups)
    if "optimizer_scalars" in items:
        optimizer_adapter(engine).load_scalars(_torch_unblob(items["optimizer_scalars"]))
    if "lr_scheduler" in items and getattr(engine, "lr_scheduler", None) is not None:
        engine.lr_scheduler.load_state_dict(_torch_unblob(items["lr_scheduler"]))
        if "lr_scheduler_settings" in items:
            schedulers.set_settings(engine.lr_scheduler, _torch_unblob(items["lr_scheduler_settings"]))
        schedulers.last_lrs_again(engine.lr_scheduler)
    scaler = loss_scaler(engine.optimizer)
    for k, v in items.get("loss_scaler", {}).items():
        setattr(scaler, k, v)
    if "data" in items and data_iterator is not None:
        saved = items["data"]
        data_iterator.load_state_dict(_torch_unblob(saved) if isinstance(saved, str) else saved)
    client = _client_state(engine)
    if "client_state" in items and client is not None:
        client.restore(_torch_unblob(items["client_state"]))
    if "reader" in items and getattr(getattr(engine, "baft", None), "reads", None) is not None:
        engine.baft.reads.restore_reader(items["reader"])
    # unpickled where they are set, at the loop's first call: one may be an object of a class the script defines
    # after baft.initialize (probe 28's K8: every relaunched rank died here)
    THIS_PROCESS.restored(items.get("loop"), items["counters"],
                          functools.partial(_torch_unblob, items["carried"]) if "carried" in items else None,
                          bool(items.get("at_exit")))
    restore = RngRestore(items["rng"], items.get("rng_between"), at_exit=bool(items.get("at_exit")),
                         started=items.get("rng_started"))
    restore.replaced = items.get("replaced_modules", {})
    # taken as an iteration started: set again as the first resumed one starts; as the process ended: the loop's code
    # before the next call runs on what is set now, once
    restore.script_globals = None if items.get("at_exit") else script_globals or {}
    restore.module_attributes = None if items.get("at_exit") else module_attributes
    # a survivor whose loop counts its calls is not taken back: its call trains to its step, each step from the
    # schedulers' states and learning rates as it first started (baft.script.loop); they are where its loop is
    survivor = THIS_PROCESS.counts_calls and THIS_PROCESS.calls > THIS_PROCESS.to_replay
    if items.get("at_exit"):
        # taken as the process ended, before the loop's code for the next step ran: the resumed loop runs that code
        # once, on what is restored now (probe 19: set again as the first resumed iteration started, the learning
        # rate a finished nanoGPT run had, relaunched to train on, undid the one its loop set for the next step)
        if "script_schedulers" in items and not survivor:
            why = schedulers.restore(engine, _torch_unblob(items["script_schedulers"]))
            if why is not None:  # one the script makes after baft.initialize: loaded as the iteration starts
                restore.schedulers = _torch_unblob(items["script_schedulers"])
    elif not survivor:
        # set again as the first resumed iteration starts: the loop's code before its next train_batch call runs
        # again in the resumed process (a learning rate it multiplies by a factor there, a scheduler it steps there,
        # would be so twice), and they were captured as that iteration started, after that code
        restore.groups, restore.added = groups, items.get("added_groups")
        if "script_schedulers" in items:
            restore.schedulers = _torch_unblob(items["script_schedulers"])
            schedulers.restore(engine, restore.schedulers)  # where the script made them already: else by then
    return restore


def _freeze(engine, names: list[str]) -> None:
    """Freeze the parameters ``names`` of the engine's module and no others. One that DeepSpeed's bf16 optimizer
    holds is linked to its fp32 gradient (``_hp_grad``, which the all-reduce of tied weights reads) as its first
    backward before the script froze it linked it: a process that restores it frozen runs none, and a survivor's
    link is to the optimizer it had before."""
    newly = {id(param) for name, param in engine.module.named_parameters() if name in names and param.requires_grad}
    set_frozen(engine.module, names)
    optimizer = engine.optimizer
    for i, group in enumerate(getattr(optimizer, "bf16_groups", ()) if newly else ()):
        for j, param in enumerate(group):
            if id(param) in newly:
                param._hp_grad = optimizer.fp32_groups_gradients[i][j]


def _added_groups(engine) -> Optional[dict]:
    added = getattr(optimizer_adapter(engine), "added_groups", None)
    return added() if added is not None else None


def optimizer_state_missing(engine) -> Optional[str]:
    """None when the optimizer's state is there to snapshot, else why not. A torch optimizer creates its state
    at its first step (not one skipped for an fp16 overflow); one that created none then (SGD without
    momentum) has none to snapshot. A param group the script added since it made the optimizer
    (``add_param_group``) gets its state at its first step too."""
    optimizer = base_optimizer(engine.optimizer)
    trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    without = sum(1 for p in trained if not optimizer.state.get(p))
    stepped = engine.global_steps - getattr(engine, "skipped_steps", 0) > 0
    if not without or (stepped and without == len(trained)):
        return None
    if not stepped:
        return "optimizer state is created by the first optimizer step"
    first = getattr(optimizer_adapter(engine), "first_groups", len(optimizer.param_groups))
    added = [p for group in optimizer.param_groups[first:] for p in group["params"] if p.requires_grad]
    if without == sum(1 for p in added if not optimizer.state.get(p)):
        # probe 21: said to be parameters never given a gradient, to be frozen
        return (f"{without} of {len(trained)} trainable parameters, in the param groups the script added since it "
                f"made the optimizer (add_param_group), have no optimizer state yet after {engine.global_steps} "
                f"steps: the optimizer makes it at their first step")
    return (f"{without} of {len(trained)} trainable parameters have no optimizer state after "
            f"{engine.global_steps} steps (never given a gradient? set requires_grad=False on them)")


def create_optimizer_state(engine, entries) -> None:
    """Allocate the optimizer-state tensors a snapshot's layout lists, so a restore can fill them.

    Before the first optimizer step a torch optimizer has no state; a snapshot of step
    k >= 1 has it, and every value is overwritten by the restore.
    """
    optimizer_adapter(engine).create_state(entries)
