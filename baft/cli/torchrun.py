"""torchrun as ``baft train`` runs it: ``python -m baft.cli.torchrun ARGS`` is ``torchrun ARGS`` (torch's
elastic agent, unchanged) less three costs its rendezvous adds to every restart of the ranks
(``experiments/results/relaunch.md``):

* each of its rendezvous events is named by ``inspect.stack()`` twice, which reads the source of every frame and
  searches ``sys.modules`` for each (CPython's gh-92041): 0.15-0.4 s a rendezvous, more in a launcher forked from the
  warm server, which has imported torch and DeepSpeed. The name comes from the frame itself here, the same name.
* on its first restart the node waits a random 0-0.3 s, to skew nodes that rejoin together; under ``--standalone``
  there is one node, and no other to skew from.
* the store the ranks meet in (``MASTER_PORT``). torch 2.13's agent serves one for all its attempts, and the keys an
  attempt's ranks left there (gloo's addresses) send the next attempt's gloo to dead peers ("Connection refused").
  With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 serves one as it starts instead, and a rank that asks before
  it listens waits out torch's connect backoff: 0.1-0.7 s of about half the warm relaunches. Here the agent serves
  a new one each rendezvous round, listening before any rank starts, holding no earlier attempt's keys.

Where torch no longer has what this replaces, torchrun runs as it is (the store unshared).
"""

from __future__ import annotations

import functools
import os
import sys

UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name``: the name of the function ``depth`` frames up from this one."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def _a_store_each_round(handler: type) -> bool:
    """Have ``DynamicRendezvousHandler`` serve the ranks a new store each round (it made one, once); whether it
    could."""
    kept = {"_shared_tcp_store_server", "_bootstrap_store_info"}  # what its first round makes, and later ones reuse
    next_rendezvous = getattr(handler, "next_rendezvous", None)
    if next_rendezvous is None or not kept <= set(handler.__init__.__code__.co_names):
        return False

    @functools.wraps(next_rendezvous)
    def next_rendezvous_with_a_new_store(self):
        self._shared_tcp_store_server = self._bootstrap_store_info = None  # the old server closes with its object
        return next_rendezvous(self)

    handler.next_rendezvous = next_rendezvous_with_a_new_store
    return True


def main(argv: list[str]) -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.run import main as torchrun

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = _method_name
    delay = getattr(dynamic_rendezvous, "_delay", None)
    own = argv[:argv.index("--")] if "--" in argv else argv  # torchrun's options, not the program's
    if delay is not None and "--standalone" in own:

        def _one_node_delay(seconds) -> None:
            if not isinstance(seconds, tuple):  # a poll's wait, not a skew between nodes
                delay(seconds)

        dynamic_rendezvous._delay = _one_node_delay
    if not _a_store_each_round(dynamic_rendezvous.DynamicRendezvousHandler):
        os.environ.setdefault(UNSHARED_STORE_ENV, "1")
    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
