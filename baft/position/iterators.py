"""A loader's iterator as the loop holds it: what marks its epoch, and a restored iterator's state moved into the
one the loop holds."""

from __future__ import annotations

from torch.utils.data._utils import signal_handling


def epoch_mark(iterator):
    """What changes as ``iterator`` begins another epoch: the iterator of its sampler (with ``persistent_workers`` a
    loader's ``iter()`` resets the one iterator it keeps, with a new one)."""
    return getattr(iterator, "_sampler_iter", None)


class _Handed:
    """What an iterator becomes once another took its state: nothing left to shut down when it is collected."""


def take_over(live, restored) -> None:
    """Make the iterator the script holds (``live``) the ``restored`` one: ``live``'s own loader workers shut
    down, ``restored``'s workers and queues its own (``restored``, collected, would shut them down under it)."""
    if hasattr(live, "_shutdown_workers"):
        live._shutdown_workers()
    live.__class__, live.__dict__ = type(restored), restored.__dict__
    restored.__class__, restored.__dict__ = _Handed, {}
    if getattr(live, "_worker_pids_set", False):  # torch's SIGCHLD handler knows the workers by their iterator's id
        signal_handling._remove_worker_pids(id(restored))
        signal_handling._set_worker_pids(id(live), tuple(w.pid for w in live._workers))
