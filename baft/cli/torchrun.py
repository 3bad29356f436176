"""torchrun as ``baft train`` runs it: ``python -m baft.cli.torchrun ARGS`` is ``torchrun ARGS`` (torch's
elastic agent, unchanged) less two costs its rendezvous adds to every restart of the ranks, before any starts
(``experiments/results/relaunch.md``):

* each of its rendezvous events is named by ``inspect.stack()`` twice, which reads the source of every frame and
  searches ``sys.modules`` for each (CPython's gh-92041): 0.15-0.4 s a rendezvous, more in a launcher forked from the
  warm server, which has imported torch and DeepSpeed. The name comes from the frame itself here, the same name.
* on its first restart the node waits a random 0-0.3 s, to skew nodes that rejoin together; under ``--standalone``
  there is one node, and no other to skew from.

Where torch no longer has what this replaces, torchrun runs as it is.
"""

from __future__ import annotations

import sys


def _method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name``: the name of the function ``depth`` frames up from this one."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


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
    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
