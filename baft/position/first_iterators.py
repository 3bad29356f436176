"""What each iterator of torch's ``DataLoader`` the script makes between ``baft.initialize``'s return and the loop's
first call was made from. A loader the script makes after ``baft.initialize`` is found only at that call
(:class:`~baft.position.found_position.PositionFoundLater`), too late to note its first iterator, and a resumed
process's ``baft.initialize`` sets the generators the loop draws from between its steps as the restored step's loop
left them: that iterator is made there from other states than the uninterrupted run's (its workers' base seed, the
order its sampler draws from torch's generator). Noted, a restore in its epoch makes it again as that run's was
(:mod:`~baft.position.plain_loader`, :mod:`~baft.position.repeated_loader`)."""

from __future__ import annotations

import sys
from typing import Optional

import torch

from baft.position.epoch_starts import generator_states
from baft.position.samplers import drawing_sampler, record_epoch_starts
from baft.script.rng import rng_states, set_rng_states

MADE_FROM = "_baft_made_from"  # an iterator's: the generators' states it was made from
_ITER = torch.utils.data.DataLoader.__iter__.__code__
_NOTING = None  # the profile function that notes, while it does


def note_until_first_call(set_between: bool) -> None:
    """Until :func:`stop_noting` (the loop's first call): each ``DataLoader`` iterator made notes the generators'
    states it is made from (:func:`made_from`), and its sampler the state it draws the order from (a generator of its
    own: :func:`~baft.position.samplers.record_epoch_starts`). Where ``baft.initialize`` ``set_between`` the generators
    as the restored step's loop left them, what it draws leaves them as they were: the uninterrupted run drew it before
    its first step, and the loop's own draws before its first call come from those states, as that run's did.

    Seen through a profile function of this thread's, which sees ``DataLoader.__iter__`` called and return: baft
    changes no class of torch's (``tests/test_layout.py``). Nothing is noted where one is set already (a profiler)."""
    if sys.getprofile() is not None:
        return
    making: list[tuple[dict, Optional[dict]]] = []  # (made from, the generators to leave as they were), per iter()

    def profile(frame, event, returned):
        if frame.f_code is not _ITER:
            return
        if event == "call":
            loader = frame.f_locals["self"]
            record_epoch_starts(drawing_sampler(loader))
            making.append((generator_states(loader), rng_states() if set_between else None))
        elif event == "return" and making:
            made_from, before = making.pop()
            if before is not None:
                set_rng_states(before)
            if returned is not None:  # (None: the iter() raised)
                returned.__dict__[MADE_FROM] = made_from

    global _NOTING
    _NOTING = profile
    sys.setprofile(profile)


def stop_noting() -> None:
    """``DataLoader`` iterators are made noting nothing (the profile function :func:`note_until_first_call` set is
    unset)."""
    global _NOTING
    if _NOTING is not None and sys.getprofile() is _NOTING:
        sys.setprofile(None)
    _NOTING = None


def made_from(iterator) -> Optional[dict]:
    """The generators' states ``iterator`` was made from (:func:`~baft.position.epoch_starts.generator_states`'s),
    where it was made while :func:`note_until_first_call` noted them; None otherwise."""
    return getattr(iterator, "__dict__", {}).get(MADE_FROM)
