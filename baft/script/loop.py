"""A training loop that counts its own calls to ``train_batch`` from zero, kept in step after a restore.

DeepSpeedExamples' pipeline script loops ``for step in range(args.steps): engine.train_batch()``. Every
process counts from 0, so a run resumed at step k would train ``args.steps`` more steps (to k +
``args.steps``), and a replacement in place would call ``train_batch`` k times more than its peers, whose
last calls would find nobody to meet. A loop on the engine's step (``while engine.global_steps < N``) has
neither problem.

baft reads the loops around the script's first call to ``train_batch`` or ``eval_batch`` in a process,
from the source of the calling frames (:func:`loop_around`). Where every loop around it is a ``range``
from a number (``range(n)``, ``range(1, n + 1)``) whose bounds do not read the engine's step, an
``itertools.count()``, or a ``while`` over a counter the script sets to a number and adds 1 to, the loop
*counts calls*, and baft keeps it in step:

* a process restored at step k *replays* its first k calls: each returns the value that call returned
  in the run that trained it (:class:`History`, saved with every snapshot) and trains nothing; the
  ``eval_batch`` calls among them return theirs, and ``save_checkpoint`` writes nothing (the step's
  checkpoint was written when it was trained); the script's own code between the calls runs, and what it
  changed of the state baft keeps is put back as step k + 1 first started when the loop calls to train it;
* in place, a survivor's call finishes the step it was called for, however far back the restore went
  (each step trained again from the generators and hyper-parameters it first started with), and a
  replacement's calls from k + 1 train those steps with it, replaying the evaluations and checkpoints the
  survivors made then.

The ``"loop"`` key of the ``"baft"`` section overrides what is read: ``"calls"`` or ``"steps"``. A script
that calls ``train_batch`` from a loop of the other kind later (a warm-up phase on the engine's step, then a
``range``) is warned when it does: a process resumed in the second loop could not tell how many of its calls
were made, and stops there with an error.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Callable, Optional

import torch

from baft.config import GENERATION_ENV, STORE_ENV
from baft.errors import BaftError
from baft.script.history import RETURNED_NONE, History
from baft.script import carry
from baft.script.carry import Carried
from baft.script.loop_source import LoopSite, loop_around, set_before_call, trains_around
from baft.script.rng import rng_states, set_rng_states
from baft.script.schedulers import script_schedulers

KEPT_STARTS = 64  # steps whose starting generators a survivor keeps: a recovery in place goes back fewer


class Loop:
    """How this process's script loops over ``train_batch``, read at its first call, what it returned, and the
    calls it replays. One per process: a survivor recovering in place keeps its loop (its engine is made
    again, not its loop)."""

    def __init__(self):
        self.site: Optional[LoopSite] = None
        self.decided = False
        self.counts_calls = False
        self.history = History()
        self.calls = 0  # calls to train_batch the loop has made in this process
        self.to_replay = 0  # the first calls, which trained the steps up to the restored one in an earlier process
        self.evaluated_until = 0  # the loop's evaluations and checkpoints up to this step were made then too
        self.evals_replayed = 0  # eval_batch calls replayed since the latest train_batch call
        self.step_called_for = 0  # the step the loop's latest call that trains is for
        self.peers: Optional[dict] = None  # in a replacement in place: the survivors' progress()
        self.started: dict[int, dict] = {}  # step -> generators and hyper-parameters as its iteration started
        self.recorded = False  # whether the restored snapshot holds a loop's history
        # why a peer's death relaunches every rank rather than replace it in place: the first no_survivors() was told
        self.not_in_place = ""
        self.call_sites: set = set()  # where train_batch was called from (the first one: what the loop read)
        self.said_unreplayable = False  # whether an eval_batch value a replay could not return was said
        # whether the script's own load_checkpoint returned the restored step's client_state: it resumes itself
        self.script_resumed = False
        self.counters: dict = {}  # the engine's counters a restore set
        # the values of the script's own a loop on the engine's step carries, read at its first train_batch call
        self.carried: Optional[list[Carried]] = None
        self.site_at_train_batch = False  # whether the site was read at a train_batch call (not eval_batch's)
        self.carried_restored: Optional[Callable[[], dict]] = None  # their values the restored snapshot holds
        self.said_not_kept: set = set()  # the keys of those said to be in no snapshot
        self.said_own_count = ""  # where the loop adds to a count of the script's own, once said at its first call
        self.hidden: Optional[dict] = None  # the counters and learning rates restored, shown as at the first call
        self.restored_count: Optional[int] = None  # the engine's scheduler's count as restored, before a replay
        self.restored_at_exit = False  # the restored snapshot was taken as the process that trained it ended
        self.client_set_before = ""  # where the loop sets its client_state before its call (file:line), if it does
        self.evals_at_exit = 0

    def restored(self, items: Optional[dict], counters: dict, carried: Optional[Callable[[], dict]] = None,
                 at_exit: bool = False) -> None:
        """The history a snapshot holds, the engine's ``counters`` it set and the values the loop carried then
        (``carried`` returns them, key -> value; put back at the loop's first call, where the classes of the script's
        they may be objects of are defined), in a process that has not trained yet (a survivor keeps its own).
        ``at_exit``: the snapshot was taken as the process that trained the step ended."""
        if not self.decided:
            self.history = History.from_items(items) if items else History()
            self.recorded = items is not None
            self.counters = dict(counters)
            self.carried_restored = carried
            self.restored_at_exit = at_exit
            # the evaluations made after the restored step's call before the process ended: replayed, the rest made
            self.evals_at_exit = len(self.history.evals.get(counters.get("global_steps", 0), [])) if at_exit else 0
        elif not self.counts_calls and self.carried and carried is not None:
            # a survivor in place, taken back to the snapshot's step: its call trains the step after it and returns to
            # the loop's code, which reads them as they were when that step first started
            values = carried()
            for value_of in self.carried:
                if value_of.key in values:
                    carry.write(value_of, values[value_of.key])

    def before_first_call(self, engine) -> None:
        """As ``baft.initialize`` returns. A process resumed from a loop that counted its calls replays them from the
        first, so its code before the first reads the engine as an uninterrupted run's did there: counters 0, the
        first learning rates (an evaluation at the top of the loop gated on the step). The loop's first call puts
        the restored ones back where it does not replay (:meth:`show_restored`); each replayed call sets what the
        script read after it then, and the last the restored step's. A new process keeps its first learning rates."""
        if self.decided:
            return
        if not self.recorded:
            # as the script reads them: a scheduler's first rate may be the int 0 (WarmupLR's warmup_min_lr)
            self.history.first_lrs = [lr if isinstance(lr, (int, float)) else float(lr) for lr in engine.get_lr()]
            return
        if engine.baft.config.loop == "steps" or not self.counters.get("global_steps"):
            return
        groups = engine.optimizer.param_groups
        self.hidden = {"counters": {k: getattr(engine, k) for k in self.counters},
                       "lrs": [group["lr"] for group in groups]}
        for k in self.counters:
            setattr(engine, k, 0)
        for group, lr in zip(groups, self.history.first_lrs):
            group["lr"] = lr

    def show_restored(self, engine) -> None:
        """The restored counters and learning rates :meth:`before_first_call` hid, back, and the generators the script
        drew from after the restored step as they were then: the loop does not replay (it is on the engine's step, or
        the script loads its own checkpoint to resume itself)."""
        if self.hidden is None:
            return
        for k, v in self.hidden["counters"].items():
            setattr(engine, k, v)
        for group, lr in zip(engine.optimizer.param_groups, self.hidden["lrs"]):
            group["lr"] = lr
        self.hidden = None
        if engine.baft.hooks.rng is not None:
            engine.baft.hooks.rng.between_steps()

    def replay_drew(self, engine, generators: list[str]) -> None:
        """After the last replayed call: said where the ``generators`` the loop's code drew from between the calls
        were not as the uninterrupted run left them there (the training draws from them too, and a replay trains
        nothing; or the script does not seed them), by each rank where so."""
        if generators:
            loop = self.site.named if self.site else "the loop"
            print(f"baft: rank {engine.global_rank}: {loop} drew from {', '.join(generators)}'s generator between the "
                  f"calls it replayed (steps 1-{self.calls}) other numbers than the uninterrupted run (the training "
                  f"draws from it too, and a replayed call trains nothing; or the script does not seed it): what the "
                  f"loop computed from them then may differ (a count of picks, a logged value; a DataLoader's iter() "
                  f"draws its workers' base seed from torch's: where that is all it drew, only the seeds of the "
                  f"iterators it made in the replay differ); its draws from step {self.calls + 1} on are the same. Loop "
                  f"on the engine's step (while engine.global_steps < N), which replays nothing, or seed it from the "
                  f"step before the loop draws (torch.manual_seed(step) before each call)", flush=True)

    def decide(self, engine, frame, training: bool = True) -> None:
        """At each call to ``train_batch`` (``training``) or ``eval_batch`` (``frame``: its caller's): at the
        process's first, what its loop is; at a ``train_batch`` from another place, whether that place's loop is of
        the same kind."""
        if training:
            site = (frame.f_code, frame.f_lineno, frame.f_back.f_lineno if frame.f_back is not None else None)
            if site not in self.call_sites:
                if self.call_sites and self.decided:
                    self._elsewhere(engine, frame)
                self.call_sites.add(site)
        if not self.decided:
            if not training and engine.baft.config.loop == "auto" and not trains_around(frame):
                return  # an evaluation before the training loop (a sanity check): read at that loop's first call
            self._decide(engine, frame, training)
        if training and not self.counts_calls and self.carried is None:
            self._carry(engine, frame)

    def _decide(self, engine, frame, training: bool) -> None:
        self.decided = True
        client = getattr(engine.baft, "client_state", None)  # the script's own, restored as of the engine's step
        unread = client.not_returned(engine.global_steps) if client is not None else None
        if unread and engine.global_rank == 0:
            print(f"baft: warning: {unread}", file=sys.stderr, flush=True)
        mode = engine.baft.config.loop
        self.site = loop_around(frame, kept=self._kept(engine), training=training) if mode == "auto" else None
        self.site_at_train_batch = training
        # a range from a start read at the call counts from 0, unless the script resumed itself to that start
        self.counts_calls = mode == "calls" or (mode == "auto" and self.site is not None and self.site.counts_calls
                                                and not (self.site.start_read and self.script_resumed))
        if self.site is not None:
            self._sets_state(engine, self.site, carried_kept=not self.counts_calls)
        if self.site is not None and self.site.unread:
            self._say(engine, "around train_batch does not read the engine's step, and baft cannot read what it "
                              "counts: resumed after a fault it would run as many steps again as it ran from the "
                              "start. Loop on the engine's step (while engine.global_steps < N), or say \"loop\": "
                              "\"calls\" in the baft section if it counts its calls from 0")
        if not self.counts_calls:
            self.show_restored(engine)
            self._weights_not_kept(engine)
            if self.site is not None and training:
                self._client_set_before_call(engine, frame)
            if self.site is not None and self.site.own_count:
                self.said_own_count = self.site.own_count
                self._say(engine, f"adds to a count of the script's own, {self.site.own_count}, which no snapshot "
                                  f"holds: resumed after a fault it starts again from its first value, not where the "
                                  f"uninterrupted run had it. Count with the engine's step (engine.global_steps), or "
                                  f"keep it in client_state= of baft.initialize")
            if self.site is not None and self.site.from_step:
                self.no_survivors(engine, f"its loop ({self.site.named}) makes a fixed number of "
                                          f"calls from the step it started at: a survivor's, started before the "
                                          f"restored step, would end before its replacement's",
                                  "Loop on the engine's step (while engine.global_steps < N) for its survivors to "
                                  "recover in place")
            return
        if self.site is not None and self.site.collective:
            self.no_survivors(engine, f"its loop calls a collective between its calls to train_batch, at "
                                      f"{self.site.collective}: a replacement replaying the calls before the restored "
                                      f"step would wait there for peers that are not",
                              "Loop on the engine's step (while engine.global_steps < N), which replays no calls, for "
                              "its survivors to recover in place")
        # the snapshot of step k was taken as step k + 1 started: the loop's evaluations after step k were made
        restored = engine.global_steps if self.hidden is None else self.hidden["counters"]["global_steps"]
        self.hidden = None  # the replay sets what the script reads; the restored state is put back after it
        self.to_replay = self.evaluated_until = k = restored
        loop = self.site.named if self.site else 'the loop ("loop": "calls")'
        if k and not self.recorded:
            raise BaftError(f"{loop} counts its calls to train_batch, and the snapshot of step {k} this process "
                            f"resumes from holds no record of them (the process that took it called train_batch "
                            f"from a loop on the engine's step, or the job started from a checkpoint): baft cannot "
                            f"tell how many of its calls were made. Loop on the engine's step (while "
                            f"engine.global_steps < N) in every phase of the script")
        peers = self.peers
        if peers is not None and peers["counts_calls"]:
            # a replacement in place: its peers' loops went on past the restored step, and made the evaluations and
            # checkpoints of the steps it trains again with them
            self.evaluated_until = peers["step_called_for"] - 1
            # those of the steps after the restored one (the restored record holds this stage's own up to it)
            self.history.evals.update({int(step): v for step, v in peers["evals"].items() if int(step) > k})
        if not k or (engine.global_rank != 0 and peers is None):
            return
        print(f"baft: {loop} counts its calls to train_batch: resumed at step {k}, its first {k} calls return "
              f"what steps 1-{k} returned, without training them again (\"loop\": \"steps\" in the baft section "
              f"if it stops on the engine's step)", flush=True)
        reads_weights, saves = (self.site.reads_weights, self.site.saves) if self.site else ("", "")
        no_replay = "loop on the engine's step (while engine.global_steps < N), which replays no calls"
        if reads_weights:
            self._warn(f"{loop} reads the model's weights between its calls, at {reads_weights}: as it replays "
                       f"calls 1-{k}, those are step {k}'s, not each call's, and what it computes from them (an EMA "
                       f"of the weights, a noise scale, a logged norm) is not the uninterrupted run's as it replays "
                       f"them (probe 19). Keep such an object in client_state= of baft.initialize (put back as step "
                       f"{k + 1} starts), or {no_replay}")
        if saves:
            self._warn(f"{loop} calls torch.save between its calls, at {saves}: as it replays calls 1-{k}, what "
                       f"that saves of the model or the optimizer is step {k}'s, not what each call had, over what "
                       f"it saved then (engine.save_checkpoint writes nothing in a replay). {no_replay.capitalize()}, "
                       f"or save with engine.save_checkpoint")

    @staticmethod
    def _warn(text: str) -> None:
        print(f"baft: warning: {text}", file=sys.stderr, flush=True)

    def _weights_not_kept(self, engine) -> None:
        """A loop on the engine's step that updates an object of the script's own from the model's weights between its
        calls (timm's ``model_ema.update(model)``), which no snapshot holds (an ``nn.Module``, kept by no value baft
        keeps): said at start, as a resumed process makes it again from the restored weights (probe 19)."""
        site = self.site
        if site is None or not site.weights_owner:
            return
        self._say(engine, f"updates {site.weights_owner} from the model's weights between its calls, at "
                          f"{site.reads_weights}, which no snapshot holds: resumed after a fault it starts again from "
                          f"what the script makes it from, not where the uninterrupted run had it. Keep it in "
                          f"client_state= of baft.initialize (an object with state_dict() and load_state_dict(): an "
                          f"nn.Module's)")

    def _client_set_before_call(self, engine, frame) -> None:
        """A loop that does not count its calls and sets its ``client_state`` before its call to ``train_batch`` in an
        iteration (torchtitan's ``train_state.step += 1`` at its top): its snapshots keep the ``client_state`` as the
        call before returned (:meth:`~baft.recovery.script_checkpoint.ClientState.hold`), for a resumed loop's code to
        set it for the next step once (probe 22: a count one ahead, and a run that stops on it trained a step short,
        silently). A survivor's has moved on past the restored step's: every rank is replaced."""
        client = getattr(getattr(engine.baft, "client_state", None), "source", None)
        where = set_before_call(frame, client) if client is not None else ""
        if where:
            self.client_set_before = where
            self.no_survivors(engine, f"its loop sets its client_state before its call to train_batch, at {where}: a "
                                      f"survivor's has moved on past the restored step's",
                              "Set it after the call for its survivors to recover in place")

    def carried_values(self, engine) -> Optional[dict]:
        """What a snapshot keeps of the values the loop carries (key -> a copy of the value), or None where there are
        none; one that cannot be kept is said once, by rank 0."""
        kept = {}
        for value_of in self.carried or ():
            value = carry.read(value_of)
            if value is carry.UNREADABLE or not (carry.object_data(value) if value_of.whole else carry.is_data(value)):
                continue  # an object of the script's own (a writer made at the first step): made again as it first was
            why = carry.why_not_kept(value_of, value)
            if why is None:
                kept[value_of.key] = value
            elif value_of.key not in self.said_not_kept:
                self.said_not_kept.add(value_of.key)
                if value_of.where != self.said_own_count:
                    self._say(engine, f"carries a value of the script's own from one iteration to the next, "
                                      f"{value_of.where}, which no snapshot holds ({why}): resumed after a fault it "
                                      f"starts again from its first value, not where the uninterrupted run had it, "
                                      f"and what the loop sets from it (a learning rate, an early stop) may differ. "
                                      f"Keep it in client_state= of baft.initialize (an object with state_dict() and "
                                      f"load_state_dict())")
                self.no_survivors(engine, f"its loop carries {value_of.key} from one iteration to the next, which no "
                                          f"snapshot holds: a survivor would train the steps since the restored one "
                                          f"with its latest value",
                                  "Keep it in client_state= of baft.initialize for its survivors to recover in place")
        return copy.deepcopy(kept) or None  # as they are now: the loop goes on changing them

    def _carry(self, engine, frame) -> None:
        """At the loop's first call to ``train_batch`` (``frame``: its caller's), where snapshots are taken: the values
        it carries, and in a resumed process, those the snapshot holds set as they were then."""
        site = self.site
        if site is not None and not self.site_at_train_batch:  # read at an eval_batch call: where it reads them differs
            site = loop_around(frame, kept=self._kept(engine))
        self.carried = list(site.carried) if site is not None else []
        restored = self.carried_restored() if self.carried_restored is not None and self.carried else {}
        put = [value_of for value_of in self.carried if value_of.key in restored]
        for value_of in put:
            carry.write(value_of, restored[value_of.key])
        if put and engine.global_rank == 0:
            print(f"baft: {site.named} carries {', '.join(v.key for v in put)} from one iteration to the next: "
                  f"set as they were at step {engine.global_steps}", flush=True)

    def _say(self, engine, what: str) -> None:
        """One line about the loop read at the first call, by rank 0."""
        if engine.global_rank == 0:
            print(f"baft: {self.site.named} {what}", file=sys.stderr, flush=True)

    def _sets_state(self, engine, site: LoopSite, carried_kept: bool = False) -> None:
        """Where the loop sets state baft does not keep: in place, a survivor's call trains the steps since the
        restored one (two at a snapshot every step: the latest is committed as the next step ends) with its latest
        value, as the loop left it; a new process runs the loop again. ``carried_kept``: the values the loop carries
        are kept with every snapshot (one that cannot be is said by :meth:`carried_values`), as a count of a
        trainer's (probe 26: said kept and restored, then every rank replaced for it)."""
        kept = {c.where for c in site.carried if not c.read_before_call} if carried_kept else set()
        where = next((where for where in site.sets_state if where not in kept), None)
        if where is None:
            return
        self.no_survivors(engine, f"its loop sets {where} between its calls to train_batch, which "
                                  f"baft does not keep: a survivor would train the steps since the restored one with "
                                  f"its latest value",
                          "Keep it in a state baft saves (client_state= of baft.initialize, or the data iterator's "
                          "state_dict) for its survivors to recover in place")

    def no_survivors(self, engine, why: str, advice: str = "") -> None:
        """A peer's death replaces this rank too, not only the killed one (``why``): said once, by rank 0, where
        recovery in place is on. The one record of why this process cannot recover in place
        (:func:`baft.recovery.in_place.recover` reads it): the first reason given is kept, later ones are not said."""
        if self.not_in_place:
            return
        self.not_in_place = why
        in_place = STORE_ENV in os.environ  # a killed rank is replaced in place (baft.recovery.world.available)
        if in_place and os.environ.get(GENERATION_ENV, "0") == "0" and engine.global_rank == 0:
            print(f"baft: on a fault every rank is replaced, not only the killed one: {why}.{' ' if advice else ''}"
                  f"{advice}", file=sys.stderr, flush=True)

    @staticmethod
    def _kept(engine) -> tuple:
        """The objects whose attributes a loop may set without saying so: the engine, the script's client_state."""
        return engine, getattr(getattr(engine.baft, "client_state", None), "source", None)

    def _elsewhere(self, engine, frame) -> None:
        """``train_batch`` called from another place than before: said where its loop is of the other kind, or sets
        state baft does not keep (a curriculum after a warm-up)."""
        if engine.baft.config.loop != "auto" or self.site is None:
            return
        other = loop_around(frame, kept=self._kept(engine))
        if other is not None:
            self._sets_state(engine, other)
        if other is None or other.counts_calls == self.counts_calls or engine.global_rank != 0:
            return
        kinds = {True: "counts its calls", False: "does not count its calls"}
        print(f"baft: train_batch is called now from {other.named}, which "
              f"{kinds[other.counts_calls]}, after {self.site.named}, which "
              f"{kinds[self.counts_calls]}: a process resumed in the second could not tell how many of its calls "
              f"were made, and would stop with an error. Loop on the engine's step (while engine.global_steps < N) "
              f"in every phase", file=sys.stderr, flush=True)

    def progress(self) -> dict:
        """In a survivor recovering in place: whether its loop counts its calls, and if so the step its call is for and
        what ``eval_batch`` returned, for the replacements (their :attr:`peers`)."""
        if not self.counts_calls:
            return {"counts_calls": False}
        return {"counts_calls": True, "step_called_for": self.step_called_for, "evals": self.history.items()["evals"]}

    def starting(self, engine, step: int, again: bool) -> None:
        """Before the iteration that trains ``step``: where a survivor trains it again in the call that failed,
        the generators, the parameters frozen, the optimizer's hyper-parameters, the script's schedulers, its
        ``client_state`` and a data iterator of its own as they were when it first started (the script's loop, which
        does not run again for the steps before its call's, drew from those and may have set, stepped or updated
        these: an EMA in its ``client_state``, the task its data iterator reads, a layer it froze); else they are kept
        for that."""
        groups = engine.optimizer.param_groups
        if again and step in self.started:
            kept = self.started[step]
            set_rng_states(kept["rng"])
            set_frozen(engine.module, kept["frozen"])
            for group, values in zip(groups, kept["groups"]):
                group.update(values)
            for scheduler, state in kept["schedulers"]:
                scheduler.load_state_dict(copy.deepcopy(state))
            for own, state in kept["own"] or ():
                own.load_state_dict(copy.deepcopy(state))
            return
        self.started[step] = {"rng": rng_states(), "frozen": frozen(engine.module),
                              "groups": [{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in groups],
                              "schedulers": [(s, copy.deepcopy(s.state_dict())) for s in script_schedulers(engine)],
                              "own": [(own, copy.deepcopy(own.state_dict())) for own in _script_states(engine)]
                              if STORE_ENV in os.environ else None}  # only a survivor in place trains a step again
        self.started.pop(step - KEPT_STARTS, None)
        # the script's own states cost what they hold (an EMA of the weights): kept only as far back as a recovery in
        # place goes from the two newest snapshots
        period = getattr(getattr(engine.baft, "policy", None), "period", None)
        older = self.started.get(step - 2 * period - 2) if isinstance(period, int) else None
        if older is not None:
            older["own"] = None

    @property
    def replaying(self) -> bool:
        """Whether the loop's next ``train_batch`` call is one that trained a step up to the restored one, or may be
        (the restored counters are hidden until the first call: :meth:`before_first_call`)."""
        return self.hidden is not None or self.calls < self.to_replay

    def left_in_replay(self) -> str:
        """Why this process must not end now, or "": its loop, replaying its calls up to the restored step, stopped
        before it (its code between the calls read state as restored, not as it stood at that call: an early stop's
        count kept in ``client_state``), so the run would end short of the uninterrupted one's end, unsaid."""
        if not self.counts_calls or not 0 < self.calls < self.to_replay:
            return ""
        loop = self.site.named if self.site else "the loop"
        return (f"{loop} stopped at its call {self.calls} of the {self.to_replay} it replayed up to the restored step: "
                f"its code between the calls read what the restore had set (a count in client_state?), not what it "
                f"was at that call, so the run would end short of the uninterrupted one. Loop on the engine's step "
                f"(while engine.global_steps < N), which replays nothing")

    @property
    def replays_evaluations(self) -> bool:
        """Whether an ``eval_batch`` or ``save_checkpoint`` call now was made, after the same call to
        ``train_batch``, by the process that trained the step (or by the survivors, for a replacement in place)."""
        if not self.decided:  # an evaluation before the training loop: made then, where it counts its calls
            return (self.recorded and bool(self.counters.get("global_steps"))
                    and self.evals_replayed < len(self.history.evals.get(0, [])))
        if not 0 < self.evaluated_until or self.calls > self.evaluated_until:
            return False
        if self.calls == self.evaluated_until and self.restored_at_exit and self.peers is None:
            # the snapshot was taken as the process that trained the step ended: it evaluated after the call (the
            # loop's code after it, Megatron's), not where the loop's next iteration begins (nanoGPT's, at its top:
            # probe 19, a finished run launched again to train on stopped there, nothing recorded to replay)
            return self.evals_replayed < self.evals_at_exit
        return True

    def called(self) -> None:
        """A call to ``train_batch``, replayed or not."""
        self.calls += 1
        self.evals_replayed = 0

    def record_eval(self, engine, value) -> None:
        """What ``eval_batch`` returned at the engine's step; said once where it cannot be replayed."""
        self.history.record_eval(engine.global_steps, value)
        if self.history.evals[engine.global_steps][-1] is None and not self.said_unreplayable and self.decided:
            self.said_unreplayable = True
            if engine.global_rank == 0:
                print(f"baft: eval_batch returned {type(value).__name__} at step {engine.global_steps}, not a scalar "
                      f"(return_logits=True?): a process resumed after a fault replays the loop's calls before the "
                      f"restored step and could not replay this one, and would stop there. Loop on the engine's step "
                      f"(while engine.global_steps < N) to resume without replaying", file=sys.stderr, flush=True)

    def replay_train(self, engine):
        """What the next replayed ``train_batch`` call returns."""
        self.called()
        self._scheduled_as_then(getattr(engine, "lr_scheduler", None))
        return self._recorded(engine, "train", self.history.value(self.calls), f"step {self.calls}")

    def _scheduled_as_then(self, scheduler) -> None:
        """The engine's scheduler as the replayed call left it then: its count (one a step, back from the restored
        one) and its last learning rates (the step's); the restored state is loaded again after the replay."""
        counter = next((name for name in ("last_batch_iteration", "last_epoch") if hasattr(scheduler, name)), None)
        if counter is None or self.counters.get("skipped_steps", 0):  # a skipped step did not count (fp16 overflow)
            return
        if self.restored_count is None:
            self.restored_count = getattr(scheduler, counter)
        setattr(scheduler, counter, self.restored_count - (self.to_replay - self.calls))
        lrs = self.history.lrs_after(self.calls)
        if lrs and all(lr == lr for lr in lrs):
            scheduler._last_lr = list(lrs)

    def replay_eval(self, engine, returns_none: bool = False):
        """What the next replayed ``eval_batch`` call returns: None where DeepSpeed's returns None on this stage
        (``returns_none``: a stage other than the last, under ``bcast_loss=False``), else what the call returned then.
        In place, a replacement's record of the steps after the restored one is a survivor's, on another stage: its
        None there (recorded as :data:`RETURNED_NONE`) is not what this stage returned, and cannot be replayed."""
        self.evals_replayed += 1
        if returns_none:
            return None
        values = self.history.evals.get(self.calls, [])
        recorded = values[self.evals_replayed - 1] if self.evals_replayed <= len(values) else None
        return self._recorded(engine, "eval", None if recorded == RETURNED_NONE else recorded,
                              f"eval_batch call {self.evals_replayed} after step {self.calls}")

    def _recorded(self, engine, kind: str, value, what: str):
        if value is None:
            raise BaftError(f"the loop replays its calls before the restored step, and {what} returned nothing "
                            f"baft recorded (not a scalar, or trained before baft recorded it); loop on the engine's "
                            f"step (while engine.global_steps < N) to resume without replaying")
        return torch.tensor(float(value), dtype=getattr(torch, self.history.dtypes[kind]), device=engine.device)


def frozen(module: torch.nn.Module) -> list[str]:
    """The names of the parameters of ``module`` that do not require a gradient."""
    return [name for name, param in module.named_parameters() if not param.requires_grad]


def set_frozen(module: torch.nn.Module, names: list[str]) -> None:
    """Freeze the parameters ``names`` of ``module`` and no others (:func:`frozen`'s)."""
    names = set(names)
    for name, param in module.named_parameters():
        if param.requires_grad == (name in names):
            param.requires_grad_(name not in names)


def _script_states(engine) -> list:
    """What the script's loop may change between its calls that baft keeps with ``load_state_dict``: its
    ``client_state`` object and a data iterator of its own (not a loader whose position baft keeps, nor baft's)."""
    client = getattr(getattr(engine.baft, "client_state", None), "source", None)
    data = getattr(engine.baft, "data_position", None)
    return [own for own in (client, data) if callable(getattr(own, "state_dict", None))
            and callable(getattr(own, "load_state_dict", None)) and not type(own).__module__.startswith("baft.")]


THIS_PROCESS = Loop()
