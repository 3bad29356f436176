"""torchrun as ``baft train`` runs it: ``python -m baft.cli.torchrun ARGS`` is ``torchrun ARGS`` (torch's
elastic agent, unchanged) less four costs its rendezvous adds to every restart of the ranks
(``experiments/results/relaunch.md``, ``experiments/results/multinode-relaunch.md``):

* each of its rendezvous events is named by ``inspect.stack()`` twice, which reads the source of every frame and
  searches ``sys.modules`` for each (CPython's gh-92041): 0.15-0.4 s a rendezvous, more in a launcher forked from the
  warm server, which has imported torch and DeepSpeed. The name comes from the frame itself here, the same name.
* on its first restart the node waits a random 0-0.3 s, to skew nodes that rejoin together; under ``--standalone``
  there is one node, and no other to skew from.
* a node in the rendezvous reads its state at most once a second (between two reads it is served its copy), so every
  restart of a job on several nodes spends seconds in it, each node's step (leaving the last round, joining the next,
  seeing it complete) seen by the others a second late. Here it reads it every 0.05 s on a few nodes, less often on
  more (every read returns the state of every node), once a second from 500 nodes on (:func:`poll_seconds`).
* the store the ranks meet in (``MASTER_PORT``). torch 2.13's agent serves one for all its attempts, and the keys an
  attempt's ranks left there (gloo's addresses) send the next attempt's gloo to dead peers ("Connection refused").
  With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 serves one as it starts instead, and a rank that asks before
  it listens waits out torch's connect backoff: 0.1-0.7 s of about half the warm relaunches. Here the agent serves
  a new one each rendezvous round, listening before any rank starts, holding no earlier attempt's keys.

It also keeps a death signal from leaving the agent hung or unheard. torch's handler raises its exception wherever
the agent is as it comes: inside ``logging``, which caught it (the agent then restarted the ranks as if no signal had
come: three restarts where ``baft train``, which stops a run no restart can get past as it reads the agent's line
that an attempt failed, asked for none), or as the agent stopped an attempt's ranks, between a lock's acquiring and
its ``with`` block (the agent's shutdown then waited for that lock for ever: a fresh-clone CI's ``baft train`` hung
until its test's timeout). Here the signal is held, and raised where the agent next starts or watches its ranks (every
``--monitor-interval``) or waits in a rendezvous (:func:`_death_signal_held`).

Where torch no longer has what this replaces, torchrun runs as it is (the store unshared).

``baft torchrun ARGS`` (:func:`main` with ``warm``) is the same torchrun with its ranks forked from a warm server of
this node's (:mod:`baft.warm`), started as torchrun makes its first workers and stopped as it ends: the launch of
a job on every node of a cluster, whose every restart then forks its ranks instead of starting new interpreters.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Callable, Optional

from baft.config import ROUND_ENV

UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def poll_seconds(nodes: int) -> float:
    """How long a node waiting in the rendezvous of a job on at most ``nodes`` nodes sleeps between two reads of its
    state (torch: 1 s)."""
    return min(1.0, max(0.05, nodes / 500))


def _shorter_waits(delay, nodes: int, poll: float, first: Callable[[], None] = lambda: None):
    """``dynamic_rendezvous._delay`` for a job on at most ``nodes`` nodes: a poll's wait of ``poll`` seconds at most,
    and the first round's skew between nodes only where there are several; ``first`` called before each."""

    def _delay(seconds) -> None:
        first()
        if isinstance(seconds, tuple):  # the random skew of the first round
            if nodes > 1:
                delay(seconds)
        else:
            delay(min(seconds, poll))

    return _delay


def _method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name``: the name of the function ``depth`` frames up from this one."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def _each_round(handler: type, poll: float) -> bool:
    """Have ``DynamicRendezvousHandler`` serve the ranks a new store each round (it made one, once), read the
    rendezvous state again after ``poll`` seconds rather than serve its copy of a second ago, and tell the ranks the
    round (``ROUND_ENV``: which attempt of the job they are, the same on every node, where each node's agent counts
    only the restarts for its own ranks' failures); whether it could serve a new store."""
    kept = {"_shared_tcp_store_server", "_bootstrap_store_info"}  # what its first round makes, and later ones reuse
    next_rendezvous = getattr(handler, "next_rendezvous", None)
    if next_rendezvous is None:
        return False
    new_store = kept <= set(handler.__init__.__code__.co_names)

    @functools.wraps(next_rendezvous)
    def next_rendezvous_each_round(self):
        if new_store:
            self._shared_tcp_store_server = self._bootstrap_store_info = None  # the old server closes with its object
        holder = getattr(self, "_state_holder", None)
        if hasattr(holder, "_cache_duration"):
            holder._cache_duration = poll
        joined = next_rendezvous(self)
        if isinstance(getattr(getattr(holder, "state", None), "round", None), int):
            os.environ[ROUND_ENV] = str(holder.state.round)  # the environment torchrun starts the ranks with
        return joined

    handler.next_rendezvous = next_rendezvous_each_round
    return new_store


def _death_signal_held(launcher_api, agent: type) -> Optional[Callable[[], None]]:
    """Have ``agent`` (torch's agent class) raise the exception of a death signal, which ``launcher_api``'s handler
    (``torch.distributed.elastic.multiprocessing.api``) raises wherever the agent is as the signal comes, where the
    agent next starts or watches its ranks, or calls the function returned (None where it could not)."""
    methods = ("_initialize_workers", "_monitor_workers")
    if not hasattr(launcher_api, "_terminate_process_handler") or not hasattr(launcher_api, "SignalException") \
            or not all(hasattr(agent, m) for m in methods):
        return None
    received: list[signal.Signals] = []

    def hold(signum, frame) -> None:
        received.append(signal.Signals(signum))

    def raise_held() -> None:
        if received:
            said = f"Process {os.getpid()} got signal: {received[0]}"  # as torch's handler says it
            raise launcher_api.SignalException(said, sigval=received[0])

    def signal_first(method):
        @functools.wraps(method)
        def unless_signalled(self, *args, **kwargs):
            raise_held()
            return method(self, *args, **kwargs)
        return unless_signalled

    launcher_api._terminate_process_handler = hold  # looked up as the agent starts its ranks and registers it
    for name in methods:
        setattr(agent, name, signal_first(getattr(agent, name)))
    return raise_held


def _ranks_warm(run_module, servers: list) -> None:
    """Have torchrun start each rank whose program is ``python [-m] PROGRAM ARGS`` as a client of a warm server
    (``python -u CLIENT [-m] PROGRAM ARGS``), the server started here as torchrun reads its program; any other
    program (``--no-python``, ``--run-path``, another Python named by ``PYTHON_EXEC``) as it is. ``servers`` gets
    the server, to stop once torchrun ends."""
    from baft.cli.launch import clear_stale_build_locks, launch_env
    from baft.cli.preflight import later_imports
    from baft.warm import CLIENT, WarmServer

    made = run_module.config_from_args

    def config_from_args(args):
        config, cmd, cmd_args = made(args)
        if cmd != sys.executable or cmd_args[:1] != ["-u"]:  # another program, or Python (PYTHON_EXEC)
            return config, cmd, cmd_args
        env = launch_env()
        clear_stale_build_locks(env["TORCH_EXTENSIONS_DIR"])
        server = WarmServer.running(env)
        if server is None:
            program = [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]
            server = WarmServer().start(env, later=later_imports(False, None, program))
            servers.append(server)
        os.environ.update({**env, **server.env()})  # the ranks' environment, as torchrun gives them its own
        return config, cmd, ["-u", CLIENT, *cmd_args[1:]]

    run_module.config_from_args = config_from_args


def main(argv: list[str], warm: bool = False) -> None:
    """torchrun ``argv``, less the costs above; ``warm``: its ranks forked from a warm server."""
    from torch.distributed import run as run_module
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api as launcher_api
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.run import main as torchrun

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = _method_name
    args = run_module.parse_args(argv)
    nodes = 1 if args.standalone else run_module.parse_min_max_nnodes(args.nnodes)[1]
    poll = poll_seconds(nodes)
    raise_held = _death_signal_held(launcher_api, LocalElasticAgent)
    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is not None:
        dynamic_rendezvous._delay = _shorter_waits(delay, nodes, poll, first=raise_held or (lambda: None))
    if not _each_round(dynamic_rendezvous.DynamicRendezvousHandler, poll):
        os.environ.setdefault(UNSHARED_STORE_ENV, "1")
    servers: list = []
    if warm:
        _ranks_warm(run_module, servers)
    try:
        torchrun(argv)
    finally:
        for server in servers:
            server.close()


if __name__ == "__main__":
    main(sys.argv[1:])
