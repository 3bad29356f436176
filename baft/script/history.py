"""What a loop that counts its calls returned at each step (:class:`History`), saved with every snapshot: what its
replayed calls return (:mod:`baft.script.loop`)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np
import torch

# what an eval_batch that returned None recorded (a stage other than the last, under bcast_loss=False): replayed as None
RETURNED_NONE = "none"


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
    rates, ``was_step_applied()`` and ``get_global_grad_norm()``). Kept, and saved with every snapshot, in a process whose loop counts calls; a survivor recovering in
    place keeps its own (its loop does not run again the evaluations after the restored step)."""

    # train.values[k - 1]: the value of step k (a 0-d tensor until a capture reads it; None, read back as NaN, where
    # it cannot be replayed)
    train: Column = field(default_factory=lambda: Column("float64"))
    samples: Column = field(default_factory=lambda: Column("int64"))  # the engine's global_samples after each step
    lrs: Column = field(default_factory=lambda: Column("float64"))  # each param group's lr after each step, in turn
    applied: Column = field(default_factory=lambda: Column("int8"))  # the engine's was_step_applied() after each step
    # the engine's get_global_grad_norm() after each step (NaN where None, once a capture has read it)
    norms: Column = field(default_factory=lambda: Column("float64"))
    groups: int = 0  # param groups a step's lrs hold: the first step's
    unreplayable: set = field(default_factory=set)  # steps whose value was not a number
    evals: dict = field(default_factory=dict)  # step -> the values eval_batch returned while the engine was there
    dtypes: dict = field(default_factory=dict)  # "train", "eval", "grad_norm": the dtype of the values
    first_lrs: list = field(default_factory=list)  # each param group's lr before the first step

    def record_train(self, step: int, value, samples: int, lrs: list, applied: bool = True, grad_norm=None) -> None:
        for column, per_step in ((self.train, 1), (self.samples, 1), (self.lrs, self.groups), (self.applied, 1),
                                 (self.norms, 1)):
            column.truncate((step - 1) * per_step)  # a step trained again (in place, after a restore)
        self.unreplayable.discard(step)
        value = self._value("train", value)
        if value is None:
            self.unreplayable.add(step)
        self.train.values.append(value)
        self.samples.values.append(samples)
        self.groups = self.groups or len(lrs)
        self.lrs.values += (list(lrs) + [float("nan")] * self.groups)[:self.groups]
        self.applied.values.append(int(bool(applied)))
        self.norms.values.append(self._norm(grad_norm))

    def record_eval(self, step: int, value) -> None:
        # None (a stage other than the last, under bcast_loss=False) is replayed as None
        self.evals.setdefault(step, []).append(RETURNED_NONE if value is None else self._value("eval", value))

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

    def kept_after(self, step: int) -> bool:
        """Whether the history says what ``was_step_applied()`` and ``get_global_grad_norm()`` read after ``step`` (a
        record written before baft kept them does not)."""
        return step <= len(self.applied.values)

    def applied_after(self, step: int) -> bool:
        """The engine's ``was_step_applied()`` after ``step``."""
        return bool(self.applied.values[step - 1])

    def grad_norm_after(self, step: int, device):
        """The engine's ``get_global_grad_norm()`` after ``step``: None, a number, or a tensor of its dtype on
        ``device``."""
        value = self.norms.values[step - 1]
        if value is None or value != value:  # NaN: None, read by a capture
            return None
        kind = self.dtypes.get("grad_norm", "float")
        if kind == "float":
            return float(value)
        return torch.tensor(float(value), dtype=getattr(torch, kind), device=device)

    def _norm(self, value):
        """A gradient norm as the column holds it until the next capture reads it (None, a detached scalar tensor, a
        float)."""
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            self.dtypes["grad_norm"] = str(value.dtype).removeprefix("torch.")
            return value.detach().reshape(())
        self.dtypes["grad_norm"] = "float"
        return float(value)

    def _value(self, kind: str, value):
        """A scalar tensor's value (a float once :meth:`items` read it: exact for float32 and bf16); anything else
        cannot be replayed (None)."""
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            return None
        self.dtypes[kind] = str(value.dtype).removeprefix("torch.")
        return value.detach()  # read at the next snapshot's capture: no wait for the device here

    def items(self) -> dict:
        """As the commit record holds it (JSON)."""
        nan = float("nan")
        columns = ((self.train.values, None), (self.norms.values, nan), *((v, None) for v in self.evals.values()))
        for values, none in columns:  # none: what a None recorded is read as
            i = len(values)
            while i and not isinstance(values[i - 1], float):  # those recorded since the last capture
                i -= 1
            values[i:] = [float(v) if isinstance(v, torch.Tensor) else none if v is None else v for v in values[i:]]
        # copies: the commit record is written on another thread while training records on
        return {"train": self.train.encoded(), "samples": self.samples.encoded(), "lrs": self.lrs.encoded(),
                "applied": self.applied.encoded(), "norms": self.norms.encoded(), "groups": self.groups,
                "unreplayable": sorted(self.unreplayable),
                "evals": {str(k): list(v) for k, v in self.evals.items()}, "dtypes": dict(self.dtypes),
                "first_lrs": list(self.first_lrs)}

    @classmethod
    def from_items(cls, items: dict) -> "History":
        train = items["train"]
        unreplayable = set(items.get("unreplayable", []))
        if isinstance(train, list):  # a record written before baft packed the history: None where not replayable
            unreplayable |= {step for step, value in enumerate(train, 1) if value is None}
        return cls(Column.decoded(train, "float64"), Column.decoded(items.get("samples", []), "int64"),
                   Column.decoded(items.get("lrs", []), "float64"), Column.decoded(items.get("applied", []), "int8"),
                   Column.decoded(items.get("norms", []), "float64"), items.get("groups", 0), unreplayable,
                   {int(k): list(v) for k, v in items["evals"].items()}, dict(items["dtypes"]),
                   items.get("first_lrs", []))
