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

It also keeps a death signal torch's agent lost: its handler raises an exception in the agent, which two places on
its way from an attempt's failure to the next attempt catch and log (``logging``'s own error handling, where the
signal came as the agent wrote a line, and its wait for the tails of the ranks' files): the agent then restarted the
ranks as if no signal had come. That is where ``baft train`` stops a run no restart can get past, as it reads the
agent's line that the attempt failed (:mod:`baft.cli.runlog`); here the agent raises it again before it starts or
watches the ranks next, and not while it starts them (:func:`_death_signal_kept`).

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

from baft.config import ROUND_ENV

UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def poll_seconds(nodes: int) -> float:
    """How long a node waiting in the rendezvous of a job on at most ``nodes`` nodes sleeps between two reads of its
    state (torch: 1 s)."""
    return min(1.0, max(0.05, nodes / 500))


def _shorter_waits(delay, nodes: int, poll: float):
    """``dynamic_rendezvous._delay`` for a job on at most ``nodes`` nodes: a poll's wait of ``poll`` seconds at most,
    and the first round's skew between nodes only where there are several."""

    def _delay(seconds) -> None:
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


def _death_signal_kept(launcher_api, agent: type) -> bool:
    """Have ``agent`` (torch's agent class) raise the exception of a death signal that ``launcher_api``'s handler
    (``torch.distributed.elastic.multiprocessing.api``) raised and something caught on the way, as it would next start
    or watch its ranks; and hold a signal that comes while it starts an attempt's ranks until it tracks them (raised
    there, the agent stopped the ranks of the attempt before, not these, and waited at its exit for ever for the
    threads that tail their output: a fresh-clone CI's ``baft train`` hung so); whether it could."""
    handler = getattr(launcher_api, "_terminate_process_handler", None)
    methods = ("_initialize_workers", "_monitor_workers", "_start_workers")
    if handler is None or not hasattr(launcher_api, "SignalException") or not all(hasattr(agent, m) for m in methods):
        return False
    received: list[signal.Signals] = []
    starting: list[bool] = []  # not empty while the agent starts the ranks

    def terminate(signum, frame) -> None:
        received.append(signal.Signals(signum))
        if not starting:
            handler(signum, frame)

    def signal_first(method):
        @functools.wraps(method)
        def unless_signalled(self, *args, **kwargs):
            if received:
                said = f"Process {os.getpid()} got signal: {received[0]}"  # as torch's handler says it
                raise launcher_api.SignalException(said, sigval=received[0])
            return method(self, *args, **kwargs)
        return unless_signalled

    def tracked_first(method):
        @functools.wraps(method)
        def start_unsignalled(self, *args, **kwargs):
            starting.append(True)
            try:
                return method(self, *args, **kwargs)
            finally:
                starting.clear()
        return start_unsignalled

    launcher_api._terminate_process_handler = terminate  # looked up as the agent starts its ranks and registers it
    for name in methods[:2]:
        setattr(agent, name, signal_first(getattr(agent, name)))
    agent._start_workers = tracked_first(agent._start_workers)
    return True


def _ranks_warm(run_module, servers: list) -> None:
    """Have torchrun start each rank whose program is ``python [-m] PROGRAM ARGS`` as a client of a warm server
    (``python -u CLIENT [-m] PROGRAM ARGS``), the server started here as torchrun reads its program; any other
    program (``--no-python``, ``--run-path``, another Python named by ``PYTHON_EXEC``) as it is. ``servers`` gets
    the server, to stop once torchrun ends."""
    from baft.cli.launch import launch_env
    from baft.cli.preflight import later_imports
    from baft.warm import CLIENT, WarmServer

    made = run_module.config_from_args

    def config_from_args(args):
        config, cmd, cmd_args = made(args)
        if cmd != sys.executable or cmd_args[:1] != ["-u"]:  # another program, or Python (PYTHON_EXEC)
            return config, cmd, cmd_args
        env = launch_env()
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
    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is not None:
        dynamic_rendezvous._delay = _shorter_waits(delay, nodes, poll)
    if not _each_round(dynamic_rendezvous.DynamicRendezvousHandler, poll):
        os.environ.setdefault(UNSHARED_STORE_ENV, "1")
    _death_signal_kept(launcher_api, LocalElasticAgent)
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
