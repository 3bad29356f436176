"""Which training loops count their calls to ``train_batch`` (:mod:`baft.script.loop`), read from their source."""

import collections
import copy
import json
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from baft.cli.launch import launch_env
from baft.script import carry
from baft.script.history import Column, History

STUB = """
import sys
from baft.script.loop_source import loop_around

class Engine:
    global_steps = 0
    def train_batch(self):
        global SITE
        SITE = loop_around(sys._getframe(1), kept=(self,))

engine = Engine()
args = type("Args", (), {"steps": 2, "epochs": 1})()
N = 2

class Loader:  # a DataLoader: no sequence
    def __iter__(self):
        return iter([1, 2])

    def __len__(self):
        return 2

loader = Loader()
"""

COUNTS = {
    "range": "for step in range(args.steps):\n    engine.train_batch()",
    "range from 0": "for step in range(0, N):\n    engine.train_batch()",
    "range from 1": "for step in range(1, args.steps + 1):\n    loss = engine.train_batch()",
    "nested ranges": "for epoch in range(args.epochs):\n    for i in range(N):\n        engine.train_batch()",
    "tqdm": "from tqdm import tqdm\nfor step in tqdm(range(N), disable=True):\n    engine.train_batch()",
    "enumerate": "for i, step in enumerate(range(N)):\n    engine.train_batch()",
    "in a function": "def train():\n    for step in range(N):\n        engine.train_batch()\ntrain()",
    "a counter of its own": "step = 0\nwhile step < N:\n    engine.train_batch()\n    step += 1",
    "a helper in the loop": ("def one_step():\n    return engine.train_batch()\n"
                             "def main():\n    for _ in range(N):\n        one_step()\nmain()"),
    "itertools.count": ("import itertools\nfor step in itertools.count():\n    if step >= N:\n        break\n"
                        "    engine.train_batch()"),
    "count from 1": "from itertools import count\nfor step in count(1):\n    engine.train_batch()\n    break",
    "range from a variable at 0": "start = 0\nfor step in range(start, N):\n    engine.train_batch()",
    "range from a variable at 0, through tqdm": ("from tqdm import tqdm\nstart = 0\n"
                                                 "for step in tqdm(range(start, N), disable=True):\n"
                                                 "    engine.train_batch()"),
    "range from an attribute": "for step in range(args.epochs - 1, args.steps):\n    engine.train_batch()",
    "a list of learning rates": "lrs = [0.1, 0.05]\nfor lr in lrs:\n    engine.train_batch()",
    "a slice of a list": "lrs = [0.1, 0.05, 0.01]\nfor lr in lrs[1:]:\n    engine.train_batch()",
    # forms round six's scripts used, each before trained as many steps again after a resume
    "a progress bar held": ("from tqdm import tqdm\nbar = tqdm(range(N), disable=True)\nfor step in bar:\n"
                            "    engine.train_batch()"),
    "trange": "from tqdm import trange\nfor step in trange(N, disable=True):\n    engine.train_batch()",
    "numpy's arange": "import numpy as np\nfor step in np.arange(N):\n    engine.train_batch()",
    "a list of a range": "for step in list(range(N)):\n    engine.train_batch()",
    "islice of count": ("import itertools\nfor step in itertools.islice(itertools.count(), N):\n"
                        "    engine.train_batch()"),
    "zip of counts": ("import itertools\nfor step, _ in zip(range(N), itertools.repeat(None)):\n"
                      "    engine.train_batch()"),
    "reversed": "for left in reversed(range(N)):\n    engine.train_batch()",
    "its own resume position, none yet": ("resume = None\nfor step in range(int(resume or 0), max(N, 1)):\n"
                                          "    engine.train_batch()"),
    # probe 8: resumed at an odd step, the pair's count started again, and the run trained one step past N
    "a count inside a loop on the engine's step": ("while engine.global_steps < N:\n    for _ in range(2):\n"
                                                   "        engine.train_batch()\n        engine.global_steps += 1"),
    # probe 13: a task's step, then another's; resumed between them, the pass started again with the first task
    "two calls a pass of a loop on the engine's step": ("def both():\n    engine.train_batch()\n    engine.train_batch()\n"
                                                        "while engine.global_steps < N:\n    both()\n"
                                                        "    engine.global_steps += 2"),
    # probe 19: nanoGPT's, which breaks once its counter passes the end (resumed, it trained as many steps again)
    "a while True that breaks at its counter": ("iter_num = 0\nwhile True:\n    engine.train_batch()\n"
                                                 "    iter_num += 1\n    if iter_num > N - 1:\n        break"),
    "a while True that breaks at its counter, in a condition": (
        "it = 0\nwhile True:\n    engine.train_batch()\n    it += 1\n    if N <= it or it < 0:\n        break"),
    "a trainer's own start, at 0": ("start_epoch = start_step = 0\nfor epoch in range(start_epoch, args.epochs):\n"
                                    "    for step in range(start_step if epoch == start_epoch else 0, N):\n"
                                    "        engine.train_batch()"),
}
STEPS = {
    "while on the engine's step": "while engine.global_steps < N:\n    engine.train_batch()\n    engine.global_steps += 1",
    "range from the engine's step": "for step in range(engine.global_steps, N):\n    engine.train_batch()",
    "range of what is left": "for _ in range(N - engine.global_steps):\n    engine.train_batch()",
    "a name from the engine's step": ("left = N - engine.global_steps\nfor _ in range(left):\n"
                                      "    engine.train_batch()"),
    # one task's call or another's, a pass: it makes one
    "a call in each branch of a condition": ("while engine.global_steps < N:\n    if engine.global_steps % 2:\n"
                                             "        engine.train_batch()\n    else:\n        engine.train_batch()\n"
                                             "    engine.global_steps += 1"),
    "range from the script's own start": ("start = args.epochs + 3\nfor step in range(start, start + N):\n"
                                          "    engine.train_batch()"),
    # read as the range alone: not a loop baft cannot read (round eight's review: said to be unread)
    "range from the script's own start, through tqdm": ("from tqdm import tqdm\nstart = args.epochs + 3\n"
                                                        "for step in tqdm(range(start, start + N), disable=True):\n"
                                                        "    engine.train_batch()"),
    # probe 13: Megatron's, from what its own load_checkpoint returned (said to run its steps again: it does not);
    # at 0 it counts its calls (test_a_counter_started_from_a_value_of_the_scripts_counts_from_where_it_stands...)
    "a counter from the script's own resume": ("def train():\n    iteration = args.iteration\n"
                                               "    while iteration < N:\n        engine.train_batch()\n"
                                               "        iteration += 1\n"
                                               "args.iteration = 1\ntrain()"),
    "a while True that breaks on the engine's step": ("while True:\n    engine.train_batch()\n"
                                                      "    engine.global_steps += 1\n"
                                                      "    if engine.global_steps >= N:\n        break"),
    "a list from the engine's step": ("lrs = [0.1] * (N - engine.global_steps)\nfor lr in lrs:\n"
                                      "    engine.train_batch()"),
    "a counter from the engine's step": ("step = engine.global_steps\nwhile step < N:\n    engine.train_batch()\n"
                                         "    step += 1"),
    "over data": "for batch in loader:\n    engine.train_batch()",
    "count from the engine's step": ("from itertools import count\nfor step in count(engine.global_steps):\n"
                                     "    engine.train_batch()\n    break"),
    "data inside a range": "for epoch in range(args.epochs):\n    for batch in loader:\n        engine.train_batch()",
    "zip with data": "for step, batch in zip(range(N), loader):\n    engine.train_batch()",
    "a name assigned twice": ("from tqdm import tqdm\nbar = tqdm(range(N))\nbar = loader\nfor step in bar:\n"
                              "    engine.train_batch()"),
}


def _site(tmp_path, body):
    script = tmp_path / f"train{len(list(tmp_path.iterdir()))}.py"
    script.write_text(STUB + textwrap.dedent(body) + "\n")
    return runpy.run_path(str(script), run_name="__main__")["SITE"], script


@pytest.mark.parametrize("name", COUNTS)
def test_a_loop_that_counts_its_calls(tmp_path, name):
    site, script = _site(tmp_path, COUNTS[name])
    assert site is not None and site.counts_calls, (name, site)
    assert site.where.startswith(f"{script}:") and site.text.startswith(("for ", "while ")), site


@pytest.mark.parametrize("name", STEPS)
def test_a_loop_that_resumes_with_the_engine(tmp_path, name):
    site, _ = _site(tmp_path, STEPS[name])
    assert site is not None and not site.counts_calls, (name, site)


def test_a_loop_that_sets_an_attribute_of_an_object_it_did_not_make_is_read_as_such(tmp_path):
    """State baft does not keep, set between the calls (a curriculum's difficulty on the data, a trainer's counter):
    a survivor in place would train the steps since the restored one with its latest value."""
    sets = {"curriculum": ("class Data:\n    active = 0\ndata = Data()\nwhile engine.global_steps < N:\n"
                           "    data.active = min(8, 2 + engine.global_steps)\n    engine.train_batch()\n"
                           "    engine.global_steps += 1", 5, "data.active = min(8, 2 + engine.global_steps)"),
            "a trainer's counter": ("class Trainer:\n    step = 0\n    def fit(self):\n        for _ in range(N):\n"
                                    "            engine.train_batch()\n            self.step += 1\nTrainer().fit()",
                                    6, "self.step += 1")}
    for name, (body, line, text) in sets.items():
        site, script = _site(tmp_path, body)
        assert site.sets_state[0] == f"{script}:{len(STUB.splitlines()) + line} ({text})", (name, site)
    # the engine's (kept), a module's, one the loop made, an item, a plain name, an epoch's iterator (which one
    # train_batch reads is checked at each call): none of them
    kept = ("import torch\nfor _ in range(N):\n    engine.global_steps += 1\n    torch.backends.mkldnn.enabled = True\n"
            "    for group in [type('G', (), {})()]:\n        group.lr = 0.1\n    losses = {}\n    losses[_] = 1.0\n"
            "    seen = _\n    args.batches = iter(loader)\n    engine.train_batch()")
    assert _site(tmp_path, kept)[0].sets_state == ()
    assert not any(_site(tmp_path, body)[0].sets_state for body in [*STEPS.values(), *COUNTS.values()])
    # a dataset's setting (a number, a dict of them), a sampler's weights, which the data position keeps (probe 25:
    # said "not kept", every rank was replaced in place); an object a dataset holds (a transform) is not kept
    data = ("import torch\nclass Samples(torch.utils.data.Dataset):\n    def __init__(self):\n"
            "        self.noise, self.opts, self.transform = 0.0, {'half': False}, object()\n"
            "ds, sampler = Samples(), torch.utils.data.WeightedRandomSampler(torch.ones(4), 4)\n"
            "while engine.global_steps < N:\n    ds.noise = 0.05 * engine.global_steps\n"
            "    ds.opts = {'half': True}\n    sampler.weights = torch.rand(4)\n    engine.train_batch()\n"
            "    engine.global_steps += 1\n")
    assert _site(tmp_path, data)[0].sets_state == ()
    site, script = _site(tmp_path, data + "    ds.transform = object()\n")
    assert site.sets_state == (f"{script}:{len(STUB.splitlines()) + 12} (ds.transform = object())",), site



def test_a_class_attribute_of_the_models_classes_the_loop_sets_is_kept_state(tmp_path, monkeypatch):
    """``Block.scale = 0.75`` at a step, ``Block.seen += 1``: a plain class attribute of a module class of the script's
    that the model holds, which a snapshot keeps (:mod:`baft.script.attributes`), is not state baft does not keep
    (session 39: read as such, every rank was replaced in place where only the killed one needed to be). One of a
    module class the model does not hold, or of another class of the script's, is."""
    from baft.script import attributes

    for held in ("_AT_START", "_CLASSES_AT_START", "_CLASS_VALUES_AT_START"):
        monkeypatch.setattr(attributes, held, [])
    classes = ("import torch.nn as nn\nfrom baft.script import attributes\n"
               "class Block(nn.Module):\n    scale, seen = 1.0, 0\n"
               "class Head(nn.Module):  # not in the model\n    scale = 1.0\n"
               "class Settings:\n    scale = 1.0\n"
               "attributes.hold_module_attributes(nn.Sequential(Block()))\n")
    kept = ("while engine.global_steps < N:\n    if engine.global_steps == 1:\n        Block.scale = 0.75\n"
            "    Block.seen += 1\n    engine.train_batch()\n    engine.global_steps += 1\n    print(Block.seen)")
    site, _ = _site(tmp_path, classes + kept)
    assert site.sets_state == (), site
    for other in ("Head", "Settings"):
        site, script = _site(tmp_path, classes + kept.replace("Block.scale", f"{other}.scale"))
        line = len(STUB.splitlines()) + len(classes.splitlines()) + 3
        assert site.sets_state == (f"{script}:{line} ({other}.scale = 0.75)",), (other, site)

DECIDED = """
import sys
from types import SimpleNamespace
from baft.script.loop import Loop

LOOP = Loop()
LOOP.script_resumed = {resumed}

class Engine:
    global_steps = global_rank = 0
    baft = SimpleNamespace(config=SimpleNamespace(loop="auto"), client_state=None)
    def train_batch(self):
        LOOP.decide(self, sys._getframe(1))

engine = Engine()
start_epoch, start_step = {start}, 1
for epoch in range(start_epoch, 3):
    for step in range(start_step if epoch == start_epoch else 0, 4):
        engine.train_batch()
        break
    break
"""


def test_a_range_from_a_start_read_at_the_call_counts_its_calls_unless_the_script_resumed_itself_to_it(tmp_path):
    """A trainer's ``range(self.start_epoch, n)`` at 0 or 1 counts its calls from its start (replayed after a
    resume); where the script's own load_checkpoint returned the restored step's client_state and the loop starts
    from it (epoch 1, step 1), the loop resumes itself: no call is replayed."""
    for start, resumed, counts in ((0, False, True), (1, True, False), (1, False, True), (0, True, False)):
        script = tmp_path / f"decided{start}{resumed}.py"
        script.write_text(DECIDED.format(start=start, resumed=resumed))
        loop = runpy.run_path(str(script), run_name="__main__")["LOOP"]
        assert loop.site.start_read and loop.counts_calls == counts, (start, resumed, loop.site)
    site, _ = _site(tmp_path, "for step in range(0, N):\n    engine.train_batch()")
    assert site.counts_calls and not site.start_read, "a start in the source is no start read at the call"
    # through tqdm (or enumerate, ...) a range is read as the range alone
    plain, wrapped = (_site(tmp_path, STEPS[f"range from the script's own start{how}"])[0]
                      for how in ("", ", through tqdm"))
    assert ((plain.start_read, plain.counts_calls, plain.unread) == (wrapped.start_read, wrapped.counts_calls,
                                                                     wrapped.unread) == (True, False, False)), wrapped


FIRST_CALL = STUB + """
class Engine(Engine):  # the site as read at the process's first call, with a client_state kept
    def train_batch(self):
        global SITE
        if 'SITE' not in globals():
            SITE = loop_around(sys._getframe(1), kept=(self, progress))
    def eval_batch(self):
        global SITE
        if 'SITE' not in globals():
            SITE = loop_around(sys._getframe(1), kept=(self, progress), training=False)
engine = Engine()
class Progress:  # a client_state, which a restore sets
    iteration = 0
progress = Progress()
"""


def _first_site(tmp_path, body):
    """The site read at the script's first call (train_batch or eval_batch), as :class:`baft.script.loop.Loop` does."""
    script = tmp_path / f"first{len(list(tmp_path.iterdir()))}.py"
    script.write_text(FIRST_CALL + textwrap.dedent(body) + "\n")
    return runpy.run_path(str(script), run_name="__main__")["SITE"], script


def test_a_counter_started_from_a_value_of_the_scripts_counts_from_where_it_stands_at_the_first_call(tmp_path):
    """Probe 19: Megatron's ``iteration = args.iteration`` and GPT-NeoX's ``neox_args.iteration``, 0 where the script has
    no checkpoint of its own, were taken as the script's own resume: a resumed run trained as many steps again as it
    had, silently; so was nanoGPT's ``while True`` (its resume branch sets ``iter_num`` from its checkpoint) and a
    trainer's ``while not self.should_stop and self.global_step < max_steps``. Each counts its calls where its counter
    stands at its start as the process first calls (read at that call: the script's own resume sets it elsewhere);
    not one the script's client_state holds (a restore sets it), nor one from the engine's step."""
    megatron = ("def train():\n    iteration = args.iteration\n    while iteration < N:\n        engine.train_batch()\n"
                "        iteration += 1\n        args.iteration = iteration\nargs.iteration = {start}\ntrain()")
    neox = ("from dataclasses import dataclass\n@dataclass\nclass NeoXArgs:\n    iteration: int = 0\n"
            "neox_args = NeoXArgs()\nneox_args.iteration = int('{start}')\ndef train(neox_args):\n"
            "    iteration = neox_args.iteration\n    while iteration < N:\n        engine.train_batch()\n"
            "        iteration += 1\n        neox_args.iteration += 1\ntrain(neox_args)")
    nanogpt = ("iter_num = 0\nif N > 5:  # its resume branch\n    iter_num = int('7')\niter_num = {start}\n"
               "def estimate_loss():\n    for split in ['train', 'val']:\n        for k in range(2):\n"
               "            engine.eval_batch()\nwhile True:\n    if iter_num % 2 == 0:\n        estimate_loss()\n"
               "    engine.train_batch()\n    iter_num += 1\n    if iter_num > N:\n        break")
    trainer = ("class Trainer:\n    def __init__(self, start):\n        self.global_step, self.should_stop = start, False\n"
               "    def fit(self):\n        while not self.should_stop and self.global_step < N:\n"
               "            for batch_idx in range(3):\n                engine.train_batch()\n"
               "                self.global_step += 1\nTrainer({start}).fit()")
    before = "def train():\n    i = args.epochs - 1 + {start}\n    while i < N:\n        i += 1\n        engine.train_batch()\ntrain()"
    # probe 22: minGPT's Trainer.run, whose break asks that max_iters be set too (read as a loop baft cannot read:
    # resumed, it trained as many steps again as it had, said at start)
    mingpt = ("class Trainer:\n    def run(self):\n        self.iter_num = {start}\n        while True:\n"
              "            self.loss = engine.train_batch()\n            self.iter_num += 1\n"
              "            if args.steps is not None and self.iter_num >= args.steps:\n                break\n"
              "Trainer().run()")
    # probe 22: litgpt's fit(), its counters in the dict it checkpoints (as minGPT's, before)
    litgpt = ("def fit(state):\n    while True:\n        if state['iter_num'] >= N:\n            break\n"
              "        state['iter_num'] += 1\n        engine.train_batch()\n        state['step_count'] += 1\n"
              "fit({{'iter_num': {start}, 'step_count': 0}})")
    for name, body, header in (("Megatron", megatron, "while iteration < N"), ("GPT-NeoX", neox, "while iteration < N"),
                               ("nanoGPT", nanogpt, "while True"),
                               ("a trainer", trainer, "for batch_idx in range(3)"), ("minGPT", mingpt, "while True"),
                               ("litgpt", litgpt, "while True"),
                               ("a count before the call", before, "while i < N")):
        site, _ = _first_site(tmp_path, body.format(start=0))
        assert (site.counts_calls, site.start_read, site.unread, site.text) == (True, True, False, header), (name, site)
        site, _ = _first_site(tmp_path, body.format(start=1))  # resumed by the script itself: it goes on from there
        assert (site.counts_calls, site.unread) == (False, False), (name, site)
    # a counter of the client_state (a restore sets it), or from the engine's step: it resumes with the engine
    for body in ("while progress.iteration < N:\n    engine.train_batch()\n    progress.iteration += 1",
                 "def f():\n    step = engine.global_steps\n    while step < N:\n        engine.train_batch()\n"
                 "        step += 1\nf()"):
        site, _ = _first_site(tmp_path, body)
        assert (site.counts_calls, site.start_read, site.unread) == (False, False, False), (body, site)
    # a break out of a loop inside it stops no while
    inner = ("it = 0\nwhile True:\n    engine.train_batch()\n    engine.global_steps += 1\n    it += 1\n"
             "    for _ in range(1):\n        if it > 0:\n            break\n    if engine.global_steps >= N:\n"
             "        break")
    assert not _first_site(tmp_path, inner)[0].counts_calls
    # the script resumed itself to that start: its loop goes on from there (Loop reads it)
    script = tmp_path / "resumed_megatron.py"
    script.write_text(DECIDED.format(start=0, resumed=True).split("start_epoch, start_step")[0]
                      + "args = type('Args', (), {})()\nN = 2\n"
                      + megatron.format(start=0).replace("engine.train_batch()", "engine.train_batch()\n        break"))
    loop = runpy.run_path(str(script), run_name="__main__")["LOOP"]
    assert loop.site.start_read and not loop.counts_calls, loop.site


CLIENT_TOP = """
import sys
from types import SimpleNamespace
from baft.script.loop import Loop
from baft.recovery.script_checkpoint import ClientState
from baft.script.loop_source import set_before_call

LOOP = Loop()
FOUND = []

class TrainState:  # torchtitan's, given to baft.initialize as client_state=
    step = 0
    def state_dict(self):
        return {{"step": self.step}}
    def load_state_dict(self, state):
        self.step = state["step"]

train_state = TrainState()

class Engine:
    global_steps = global_rank = 0
    baft = SimpleNamespace(config=SimpleNamespace(loop="auto"), client_state=ClientState({client}))
    def train_batch(self):
        FOUND.append(set_before_call(sys._getframe(1), {client}))
        LOOP.decide(self, sys._getframe(1))

engine = Engine()
def main():
    while train_state.step < 2:
        train_state.step += 1
        engine.train_batch()
    for _ in range(2):  # Megatron's: after the call
        engine.train_batch()
        train_state.step += 1
main()
"""


@pytest.mark.parametrize("client", ["train_state", "train_state.state_dict"])
def test_a_client_state_the_loop_sets_before_its_call_is_found(tmp_path, client):
    """Probe 22: torchtitan's ``while train_state.step < steps: train_state.step += 1`` at its top, its TrainState
    given as client_state=: a snapshot of step k held the count the loop set for step k + 1, and a resumed loop
    added 1 again; the run's steps were logged one ahead and it ended a step short, silently. A loop that does not
    count its calls and sets its client_state (the object, or the one whose state_dict it is) before its call is
    found at its first call (its snapshots keep the client_state as the call before returned:
    tests/test_popular_loops.py); one that sets it after the call is not, nor one whose loop counts its calls (a
    callable's state, which a restore does not load: the replay runs the loop's code and puts the client_state back
    as the next step starts)."""
    script = tmp_path / "client_top.py"
    script.write_text(CLIENT_TOP.format(client=client))
    ran = runpy.run_path(str(script), run_name="__main__")
    assert ran["FOUND"] == [f"{script}:30 (train_state.step += 1)"] * 2 + ["", ""], ran["FOUND"]
    assert ran["LOOP"].client_set_before == (f"{script}:30 (train_state.step += 1)" if client == "train_state" else "")


def test_an_evaluation_before_the_first_step_is_read_from_the_loop_that_trains(tmp_path):
    """Probe 19: nanoGPT evaluates before its first step, from ``estimate_loss``'s ``for k in range(eval_iters)``: the
    site was read from that loop, and named it (the evaluation of a ``for batch in val_loader`` would have been read
    as a loop over the data, not one that counts its calls). The training loop around it is read instead, through a
    function of another module of the script that calls train_batch (GPT-NeoX's ``train_step``)."""
    helper = tmp_path / "helpers.py"
    helper.write_text("def train_step(engine):\n    return engine.train_batch()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        body = ("from helpers import train_step\ndef evaluate():\n    for batch in loader:\n        engine.eval_batch()\n"
                "for step in range(N):\n    if step % 2 == 0:\n        evaluate()\n    train_step(engine)")
        site, script = _first_site(tmp_path, body)
    finally:
        sys.path.remove(str(tmp_path))
    assert site.counts_calls and not site.unread and site.text == "for step in range(N)", site
    assert site.where == f"{script}:{FIRST_CALL.count(chr(10)) + 5}", site


def test_an_evaluation_before_the_training_loop_is_not_read_as_it(tmp_path):
    """Probe 19: a trainer's sanity check, ``eval_batch`` over a few validation batches before its loop, was read as
    the loop (a loop over the data: on the engine's step), and a resumed run of a trainer that counts its calls
    trained its epochs and learning rates otherwise, silently. Such an evaluation is not in a loop that trains: the
    loop is read at the first call to train_batch."""
    script = tmp_path / "sanity.py"
    script.write_text(STUB + textwrap.dedent("""
        from baft.script.loop_source import trains_around
        AROUND = []
        class Engine(Engine):
            def eval_batch(self):
                AROUND.append(trains_around(sys._getframe(1)))
        engine = Engine()
        def fit():
            for batch in loader:  # the sanity check
                engine.eval_batch()
            for step in range(N):
                engine.train_batch()
                if step % 2 == 0:
                    for batch in loader:
                        engine.eval_batch()
        fit()
        """))
    around = runpy.run_path(str(script), run_name="__main__")["AROUND"]
    assert around == [False, False, True, True], around


def test_a_loop_that_reads_the_weights_between_its_calls_is_found(tmp_path):
    """Probe 19: timm's ``model_ema.update(model)`` and GPT-NeoX's noise-scale logger read the model's weights between
    the calls: replayed, from the restored step's (said as the replay starts); on the engine's step, an EMA (an
    ``nn.Module`` of the script's) too large to copy at every snapshot (said at start, where it is not the
    client_state); one small enough, torch's ``AveragedModel`` among them (probe 28 K2: silent), is kept as the values
    the loop carries are."""
    ema = tmp_path / "ema_module.py"
    ema.write_text("import copy\nimport torch\nclass ModelEma(torch.nn.Module):\n    def __init__(self, model):\n"
                   "        super().__init__()\n        self.module = copy.deepcopy(model)\n"
                   "    def _update(self, model):\n        with torch.no_grad():\n"
                   "            for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):\n"
                   "                e.copy_(0.9 * e + 0.1 * m)\n    def update(self, model):\n"
                   "        self._update(model)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        start = "import torch\nfrom ema_module import ModelEma\nnet = torch.nn.Linear(300, 300)\nema = ModelEma(net)\n"
        site, _ = _first_site(tmp_path, start + "while engine.global_steps < N:\n    engine.train_batch()\n"
                                                "    engine.global_steps += 1\n    ema.update(net)")
        assert site.reads_weights == f"{ema}:9 (self.module.state_dict())" and site.weights_owner == "ema (ModelEma)"
        # torch's own EMA, whose library method reads the weights of the model it is given (probe 28 K2: silent)
        site, script = _first_site(tmp_path, "import torch\nfrom torch.optim.swa_utils import AveragedModel\n"
                                             "net = torch.nn.Linear(2, 2)\navg = AveragedModel(net)\n"
                                             "while engine.global_steps < N:\n    engine.train_batch()\n"
                                             "    engine.global_steps += 1\n    avg.update_parameters(net)")
        line = FIRST_CALL.count(chr(10)) + 8
        assert (site.reads_weights, site.weights_owner) == (f"{script}:{line} (avg.update_parameters(net))", ""), site
        assert [(c.key, c.where, c.stateful) for c in site.carried] == [
            ("avg", f"{script}:{line} (avg.update_parameters(net))", True)], site
        (averaged,) = site.carried
        kept = copy.deepcopy(carry.read(averaged))
        assert int(kept["n_averaged"]) == 2, kept
        with torch.no_grad():
            averaged.frame.f_globals["avg"].module.weight.add_(1.0)
        carry.write(averaged, kept)
        assert all(torch.equal(kept[k], v) for k, v in carry.read(averaged).items()), "set back as kept"
        large = _first_site(tmp_path, "import torch\nfrom torch.optim.swa_utils import AveragedModel\n"
                                      "net = torch.nn.Linear(300, 300)\navg = AveragedModel(net)\n"
                                      "while engine.global_steps < N:\n    engine.train_batch()\n"
                                      "    engine.global_steps += 1\n    avg.update_parameters(net)")[0]
        assert (large.weights_owner, large.carried) == ("avg (AveragedModel)", ()), large
        # ... after another read of the weights the loop makes (a logged norm), in a function it calls: kept too
        later = _first_site(tmp_path, "import torch\nfrom torch.optim.swa_utils import AveragedModel\n"
                                      "net = torch.nn.Linear(2, 2)\navg = AveragedModel(net)\ndef after():\n"
                                      "    avg.update_parameters(net)\nwhile engine.global_steps < N:\n"
                                      "    engine.train_batch()\n    engine.global_steps += 1\n"
                                      "    norm = sum(p.norm() for p in net.parameters())\n    after()")[0]
        assert later.reads_weights.endswith("(net.parameters())") and [c.key for c in later.carried] == ["avg"], later
        # ... and a read of them deeper in the loop (weight noise before the call) is still where it reads them
        noised = _first_site(tmp_path, "import torch\nfrom torch.optim.swa_utils import AveragedModel\n"
                                       "net = torch.nn.Linear(2, 2)\navg = AveragedModel(net)\n"
                                       "while engine.global_steps < N:\n    with torch.no_grad():\n"
                                       "        for p in net.parameters():\n            p.add_(0.0)\n"
                                       "    engine.train_batch()\n    engine.global_steps += 1\n"
                                       "    avg.update_parameters(net)")[0]
        assert noised.reads_weights.endswith("(net.parameters())") and [c.key for c in noised.carried] == ["avg"]
        site, _ = _first_site(tmp_path, "import torch\nnet = torch.nn.Linear(2, 2)\nsaved = dict(net.state_dict())\n"
                                        "opt = torch.optim.SGD(net.parameters())\n"
                                        "while engine.global_steps < N:\n    engine.train_batch()\n"
                                        "    engine.global_steps += 1\n    net.load_state_dict(saved)\n    opt.step()")
        assert site.reads_weights == "", "library methods that read no weights they are given"
        site, script = _first_site(tmp_path, "import torch\nnet = torch.nn.Linear(2, 2)\nfor _ in range(N):\n"
                                             "    engine.train_batch()\n    norm = sum(p.norm() for p in net.parameters())")
        assert site.reads_weights.endswith("(net.parameters())") and site.weights_owner == "", site
        # a checkpoint (said as such), an optimizer's state: not the weights
        for body in ("for step in range(N):\n    engine.train_batch()\n    if step < 0:\n"
                     "        torch.save({'model': net.state_dict()}, 'x.pt')",
                     "opt = torch.optim.SGD(net.parameters(), 0.1)\nfor step in range(N):\n    engine.train_batch()\n"
                     "    saved = opt.state_dict()"):
            site, _ = _first_site(tmp_path, "import torch\nnet = torch.nn.Linear(2, 2)\n" + body)
            assert site.reads_weights == "", (body, site)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_count_of_the_scripts_own_in_the_loop_is_found(tmp_path):
    """``iteration += 1`` feeding a warm-up in a loop on the engine's step: no snapshot holds it, so a resumed run
    starts it again from 0 (said at start, where the loop does not count its calls)."""
    body = ("iteration = 0\nwhile engine.global_steps < N:\n    iteration += 1\n    lr = min(1, iteration / 6)\n"
            "    engine.train_batch()\n    engine.global_steps += 1")
    site, script = _site(tmp_path, body)
    assert not site.counts_calls and site.own_count == f"{script}:{STUB.count(chr(10)) + 3} (iteration += 1)", site
    for name in STEPS:  # a counter from the engine's step resumes with it
        assert _site(tmp_path, STEPS[name])[0].own_count == "", name
    # Megatron's: from what its own load_checkpoint returned (probe 13: said, though its client_state= kept it)
    megatron = ("def train():\n    iteration = args.iteration\n    while iteration < N:\n        engine.train_batch()\n"
                "        iteration += 1\n        args.iteration = iteration\nargs.iteration = 0\ntrain()")
    assert _site(tmp_path, megatron)[0].own_count == "", "the script's own resume sets it"
    logged = ("total = 0.0\nwhile engine.global_steps < N:\n    total += engine.train_batch() or 0.5\n"
              "    engine.global_steps += 1\n    print(total)")
    assert _site(tmp_path, logged)[0].own_count == "", "a sum, not a count"
    # a trainer's, in a method its loop calls (round seven's probe: printed only, it restarted at 0)
    trainer = ("class Trainer:\n    def __init__(self):\n        self.global_step = 0\n"
               "    def on_step_end(self):\n        self.global_step += 1\n        print(self.global_step)\n"
               "    def fit(self):\n        while engine.global_steps < N:\n            engine.train_batch()\n"
               "            engine.global_steps += 1\n            self.on_step_end()\nTrainer().fit()")
    site, script = _site(tmp_path, trainer)
    # ... now kept by baft, as a value the loop carries (read after the call: test_a_value_the_loop_carries...)
    counted = f"{script}:{STUB.count(chr(10)) + 5} (self.global_step += 1)"
    assert site.own_count == "" and [(c.where, c.read_before_call) for c in site.carried] == [(counted, False)], site
    # ... not where the trainer resumes it itself, nor where the object is one baft keeps (the engine here)
    resumed = trainer.replace("print(self.global_step)", "print(self.global_step)\n    def load(self, state):\n"
                                                          "        self.global_step = state['step']")
    assert _site(tmp_path, resumed)[0].own_count == "", "the script's own resume sets it"
    kept = ("engine.calls = 0\nwhile engine.global_steps < N:\n    engine.train_batch()\n    engine.global_steps += 1\n"
            "    engine.calls += 1\n    print(engine.calls)")
    assert _site(tmp_path, kept)[0].own_count == "", "an attribute of a kept object"
    # a module's global a function the loop calls adds to (round nine's probe: a warm-up from it, silently restarted)
    global_count = ("count = 0\ndef before():\n    lr = min(1, (count + 1) / 5)\ndef after():\n    global count\n"
                    "    count += 1\nwhile engine.global_steps < N:\n    before()\n    engine.train_batch()\n"
                    "    engine.global_steps += 1\n    after()")
    site, script = _site(tmp_path, global_count)
    assert site.own_count == f"{script}:{STUB.count(chr(10)) + 6} (count += 1)", site
    resumed = global_count.replace("count += 1", "count += 1\ndef load(state):\n    global count\n"
                                                 "    count = state['count']")
    assert _site(tmp_path, resumed)[0].own_count == "", "the script's own resume sets it"


def test_a_setting_the_loop_changes_once_that_a_layer_reads_is_carried(tmp_path):
    """Probe 23: a global of the script that the loop, or a function it calls, sets once (noise turned off at a step),
    read by a layer's forward inside train_batch and nowhere in the loop, or a config module's of the script's: resumed
    after it, it was back at its first value, silently; so were an item of a global dict the loop sets (probe 26 G16)
    and a count a forward keeps in a global (G6). A value the loop sets for itself, read by no function it does not
    call, is not carried."""
    line = STUB.count(chr(10))
    layer = "NOISE = 0.1\nclass Noise:\n    def forward(self, x):\n        return x * NOISE\n"
    at_top = layer + ("while engine.global_steps < N:\n    if engine.global_steps == 1:\n        NOISE = 0.0\n"
                      "    engine.train_batch()\n    engine.global_steps += 1")
    site, script = _site(tmp_path, at_top)
    assert [(c.where, c.key) for c in site.carried] == [(f"{script}:{line + 7} (NOISE = 0.0)", "NOISE")], site
    in_function = layer + ("def after(step):\n    global NOISE\n    if step == 1:\n        NOISE = 0.0\n"
                           "while engine.global_steps < N:\n    engine.train_batch()\n    after(engine.global_steps)\n"
                           "    engine.global_steps += 1")
    site, script = _site(tmp_path, in_function)
    assert [(c.key, c.module_global) for c in site.carried] == [("NOISE", True)], site
    own = layer + ("def log(lr):\n    print(lr)\nwhile engine.global_steps < N:\n    lr = 0.1\n    engine.train_batch()\n"
                   "    log(lr)\n    engine.global_steps += 1")
    assert _site(tmp_path, own)[0].carried == ()
    # a config module of the script's that the layers read (``knobs.NOISE``), set once by the loop
    (tmp_path / "knobs.py").write_text("NOISE = 0.1\n")
    config = (f"sys.path.insert(0, {str(tmp_path)!r})\nimport knobs\nwhile engine.global_steps < N:\n"
              "    if engine.global_steps == 1:\n        knobs.NOISE = 0.0\n    engine.train_batch()\n"
              "    engine.global_steps += 1")
    site, script = _site(tmp_path, config)
    assert [(c.where, c.key) for c in site.carried] == [(f"{script}:{line + 5} (knobs.NOISE = 0.0)", "knobs.NOISE")]
    # a global a layer's forward counts in itself (probe 26 G6), not one it only reads
    count = ("CALLS = 0\nclass Warm:\n    def forward(self, x):\n        global CALLS\n        CALLS += 1\n"
             "        return x * CALLS\nwhile engine.global_steps < N:\n    engine.train_batch()\n"
             "    engine.global_steps += 1")
    site, script = _site(tmp_path, count)
    assert [(c.where, c.key, c.module_global) for c in site.carried] == [
        (f"{script}:{line + 5} (CALLS += 1)", "CALLS", True)], site
    assert _site(tmp_path, count.replace("CALLS += 1", "print(CALLS)"))[0].carried == ()
    # a forward hook's count (probe 28 K1): in an item of a global dict, no ``global`` needed, or in an attribute of a
    # hook object (its ``__call__``, or a method given as the hook), which torch calls, never the loop; not a dict the
    # hook makes, nor a model's module (kept with its own attributes), nor a stream's pass count (the data position's),
    # nor a class no variable holds an object of
    hooks = ('HOOK = {"n": 0}\ndef count(mod, inp, out):\n    made = {"n": 0}\n    made["n"] += 1\n'
             '    HOOK["n"] += 1\nclass Count:\n    def __init__(self):\n        self.n = 0\n'
             '    def __call__(self, mod, inp, out):\n        self.n += 1\nclass Scale:\n'
             '    def __init__(self):\n        self.calls, self.seen = 0, 0\n    def hook(self, mod, inp, out):\n'
             '        self.calls = self.calls + 1\nclass Unheld:\n    def __init__(self):\n        self.k = 0\n'
             '    def __call__(self):\n        self.k += 1\nimport torch\nclass Layer(torch.nn.Module):\n'
             '    def __init__(self):\n        super().__init__()\n        self.m = 0\n'
             '    def forward(self, x):\n        self.m += 1\nclass Stream:\n    def __init__(self):\n'
             '        self.passes = 0\n    def __iter__(self):\n        self.passes += 1\n        return iter([])\n'
             'hook, scale, layer, stream = Count(), Scale(), Layer(), Stream()\n'
             'while engine.global_steps < N:\n    engine.train_batch()\n    engine.global_steps += 1')
    site, script = _site(tmp_path, hooks)
    assert [(c.where, c.key) for c in site.carried] == [
        (f"{script}:{line + 5} (HOOK['n'] += 1)", "HOOK"), (f"{script}:{line + 10} (self.n += 1)", "hook.n"),
        (f"{script}:{line + 15} (self.calls = self.calls + 1)", "scale.calls")], site
    started = hooks.replace("self.n = 0", "self.n = len(sys.argv)")
    assert [c.key for c in _site(tmp_path, started)[0].carried] == ["HOOK", "scale.calls"], "its own start"
    # the layer in a module of the script's, with a helper the loop calls that counts too (found once)
    helper = "TOTAL = 0\ndef note(x):\n    global TOTAL\n    TOTAL += x\n    return TOTAL\n"
    (tmp_path / "layers.py").write_text(count[:count.index("while")] + helper)
    site, script = _site(tmp_path, f"sys.path.insert(0, {str(tmp_path)!r})\nimport layers\n"
                                   + count[count.index("while"):] + "\n    layers.note(1)")
    assert [(c.where, c.key) for c in site.carried] == [(f"{tmp_path / 'layers.py'}:10 (TOTAL += x)", "layers:TOTAL"),
                                                        (f"{tmp_path / 'layers.py'}:5 (CALLS += 1)", "layers:CALLS")]
    sys.modules.pop("layers")
    # an item of a global dict the loop sets after its call, read by a layer (probe 26 G16)
    item = ('CTX = {"step": 0}\nclass Warm:\n    def forward(self, x):\n        return x * CTX["step"]\n'
            'while engine.global_steps < N:\n    engine.train_batch()\n    engine.global_steps += 1\n'
            '    CTX["step"] = engine.global_steps')
    site, script = _site(tmp_path, item)
    assert [(c.where, c.key) for c in site.carried] == [
        (f"{script}:{line + 8} (CTX['step'] = engine.global_steps)", "CTX")], site


def test_a_setting_the_loop_changes_once_that_the_loss_reads_in_main_is_carried(tmp_path):
    """Probe 26 G9: the script's code in ``main()``, its loss function a closure over main's ``weight``, which the loop
    sets once at a step: resumed after it, it trained with the first weight again, silently. A local of main's that no
    nested function reads, or one the nested function assigns itself, is not carried."""
    line = STUB.count(chr(10))
    closure = ("def main():\n    weight = 1.0\n    def loss_fn(out):\n        return out * weight\n"
               "    while engine.global_steps < N:\n        engine.train_batch()\n        engine.global_steps += 1\n"
               "        if engine.global_steps == 1:\n            weight = 0.5\nmain()")
    site, script = _site(tmp_path, closure)
    assert [(c.where, c.key) for c in site.carried] == [(f"{script}:{line + 9} (weight = 0.5)", "weight")], site
    own = closure.replace("return out * weight", "weight = 2.0\n        return out * weight")
    assert _site(tmp_path, own)[0].carried == ()
    unread = closure.replace("return out * weight", "return out")
    assert _site(tmp_path, unread)[0].carried == ()


def test_a_setting_the_loop_changes_once_on_the_options_or_a_loss_module_is_carried(tmp_path):
    """Probe 26 G10: ``args.weight = 0.5`` at a step on argparse's Namespace, read by the loss function, and
    ``crit.delta = 0.1`` on a torch loss module a loss function closes over (outside the model): resumed after the
    step, each was back at its first value, silently. An option only the loop reads is not carried."""
    line = STUB.count(chr(10))
    options = ("import argparse\nopts = argparse.Namespace(weight=1.0)\ndef loss_fn(out):\n"
               "    return out * opts.weight\nwhile engine.global_steps < N:\n    engine.train_batch()\n"
               "    engine.global_steps += 1\n    if engine.global_steps == 1:\n        opts.weight = 0.5")
    site, script = _site(tmp_path, options)
    assert [(c.where, c.key) for c in site.carried] == [(f"{script}:{line + 9} (opts.weight = 0.5)", "opts.weight")]
    own = options.replace("out * opts.weight", "out")
    assert _site(tmp_path, own)[0].carried == ()
    loss_module = ("import torch\ncrit = torch.nn.HuberLoss(delta=1.0)\nwhile engine.global_steps < N:\n"
                   "    engine.train_batch()\n    engine.global_steps += 1\n    if engine.global_steps == 1:\n"
                   "        crit.delta = 0.1")
    site, script = _site(tmp_path, loss_module)
    assert [(c.where, c.key) for c in site.carried] == [(f"{script}:{line + 7} (crit.delta = 0.1)", "crit.delta")]


def test_a_best_score_started_at_a_constant_a_sign_or_a_choice_of_literals_is_carried(tmp_path):
    """Probe 28 K6: a best score started at ``-float("inf")``, ``math.inf``, a choice of literals (the min/max mode's
    start), or in an if/else, was neither kept nor named, and a resumed run's plateau rule decayed the learning rate
    elsewhere, silently. Each is carried now; one started at a constant expression baft does not read as a literal
    (``np.float32(np.inf)``) is named (not kept: said, with what to do); one from the script's own resume is neither,
    nor a tensor of torch's (a global's is kept otherwise)."""
    plateau = ("import math, sys\nimport numpy as np\nimport torch\nMODE = 'min'\nSTART\n"
               "while engine.global_steps < N:\n    loss = engine.train_batch() or 1.0\n"
               "    if -loss > best:\n        best = -loss\n    engine.global_steps += 1")
    for start in ("best = -float('inf')", "best = math.inf", "best = -np.inf", "best = +torch.inf",
                  "best = sys.maxsize", "best = float('inf') if MODE == 'min' else -float('inf')",
                  "if MODE == 'min':\n    best = float('inf')\nelse:\n    best = -math.inf"):
        (carried,) = _site(tmp_path, plateau.replace("START", start))[0].carried
        assert (carried.key, carried.start) == ("best", ""), start
    site, script = _site(tmp_path, plateau.replace("START", "best = np.float32(np.inf)"))
    (named,) = site.carried
    line = STUB.count(chr(10)) + 5
    assert named.start == f"{script}:{line} (np.float32(np.inf))", named
    assert carry.why_not_kept(named, 1.0).startswith(f"it starts at {named.start}, which baft cannot tell"), named
    torch.save(1.0, tmp_path / "best.pt")
    (tmp_path / "best.txt").write_text("1.0")
    for resumed in ("best = float(args.steps)", "best = torch.zeros(())",
                    f"best = float(torch.load('{tmp_path / 'best.pt'}'))",
                    f"best = float(open('{tmp_path / 'best.txt'}').read())"):
        assert _site(tmp_path, plateau.replace("START", resumed))[0].carried == (), "its own resume"
    # probe 27's callback with math.inf (k6_callback_mathinf): best and mean were dropped, bad said carried; another
    # class setting its own state's best and mean does not start them
    callback = ("import math\nclass State:\n    def __init__(self):\n        self.best, self.mean = math.inf, 0.0\n"
                "class Nested:\n    def __init__(self):\n        self.state = State()\n    def step(self, loss):\n"
                "        self.state.mean = 0.8 * self.state.mean + 0.2 * loss\n"
                "        self.state.best = self.state.mean\n"
                "class Plateau:\n    def __init__(self):\n        self.best, self.bad, self.mean = math.inf, 0, 0.0\n"
                "    def on_step_end(self, loss):\n        self.mean = 0.8 * self.mean + 0.2 * loss\n"
                "        if self.mean < self.best:\n            self.best, self.bad = self.mean, 0\n"
                "        else:\n            self.bad += 1\n"
                "cb = Plateau()\nwhile engine.global_steps < N:\n    cb.on_step_end(engine.train_batch() or 1.0)\n"
                "    engine.global_steps += 1")
    assert sorted(c.key for c in _site(tmp_path, callback)[0].carried) == ["cb.bad", "cb.best", "cb.mean"]


def test_callbacks_in_a_list_the_loop_goes_through_are_carried(tmp_path):
    """Probe 28 K9: ``for c in callbacks: c.on_step_end(...)`` over a module's list (or a trainer's
    ``self.callbacks``) of plateau callbacks: their attributes were neither carried nor named (one in a variable
    ``cb`` was). Each item's are carried, by its index; a list the loop makes is not followed."""
    plateau = ("class Plateau:\n    def __init__(self):\n        self.best = float('inf')\n"
               "    def on_step_end(self, loss):\n        if loss < self.best:\n            self.best = loss\n")
    listed = plateau + ("callbacks = [Plateau(), Plateau()]\nwhile engine.global_steps < N:\n"
                        "    loss = engine.train_batch() or 1.0\n    for c in callbacks:\n        c.on_step_end(loss)\n"
                        "    engine.global_steps += 1")
    site, script = _site(tmp_path, listed)
    assert sorted(c.key for c in site.carried) == ["callbacks[0].best", "callbacks[1].best"], site
    assert [carry.read(c) for c in site.carried] == [1.0, 1.0]
    second = next(c for c in site.carried if c.key == "callbacks[1].best")
    carry.write(second, 0.5)
    assert second.frame.f_globals["callbacks"][1].best == 0.5
    trainer = plateau + ("class Trainer:\n    def __init__(self, callbacks):\n        self.callbacks = callbacks\n"
                         "    def fit(self):\n        while engine.global_steps < N:\n"
                         "            loss = engine.train_batch() or 1.0\n            for cb in self.callbacks:\n"
                         "                cb.on_step_end(loss)\n            engine.global_steps += 1\n"
                         "Trainer((Plateau(),)).fit()")
    assert [c.key for c in _site(tmp_path, trainer)[0].carried] == ["self.callbacks[0].best"]
    made = listed.replace("    for c in callbacks:", "    for c in [Plateau()]:")
    assert _site(tmp_path, made)[0].carried == ()


def test_a_value_the_loop_carries_from_one_iteration_to_the_next_is_found(tmp_path):
    """The previous loss a bold-driver learning rate compares with, a loss meter, a patience count, a window of losses:
    resumed, each started again from its first value (a learning rate not halved at the first resumed step, and every
    loss after it differed), so baft keeps them where the loop does not count its calls (a replay recomputes them)."""
    line = STUB.count(chr(10))
    bold = ("prev = None\nwhile engine.global_steps < N:\n    loss = engine.train_batch() or 0.5\n"
            "    if prev is not None and loss > prev:\n        lr = 0.5\n    prev = loss\n    engine.global_steps += 1")
    site, script = _site(tmp_path, bold)
    assert not site.counts_calls and [(c.where, c.key) for c in site.carried] == [
        (f"{script}:{line + 6} (prev = loss)", "prev")], site
    meter = ("meter = 0.0\nwhile engine.global_steps < N:\n    meter = 0.9 * meter + 0.1 * (engine.train_batch() or 1)\n"
             "    engine.global_steps += 1\n    print(meter)")
    site, script = _site(tmp_path, meter)
    assert [c.where for c in site.carried] == [f"{script}:{line + 3} ({meter.splitlines()[2].strip()})"], site
    # read in the call's own statement, before the call: set at the call, too late for it (not kept: said)
    assert site.carried[0].read_before_call and not _site(tmp_path, bold)[0].carried[0].read_before_call
    # an argument of the call the loop's frame makes is read before it; one read after train_batch returned is not
    helper = ("def step(prev):\n    return engine.train_batch() or prev\nprev = 0.0\nwhile engine.global_steps < N:\n"
              "    prev = step(prev)\n    engine.global_steps += 1")
    after = ("prev = 0.0\nwhile engine.global_steps < N:\n    prev = max(engine.train_batch() or 1.0, prev)\n"
             "    engine.global_steps += 1")
    assert [_site(tmp_path, body)[0].carried[0].read_before_call for body in (helper, after)] == [True, False]
    patience = ("best, bad = float('inf'), 0\nwhile engine.global_steps < N:\n    loss = engine.train_batch() or 1\n"
                "    if loss < best:\n        best, bad = loss, 0\n    else:\n        bad += 1\n"
                "    engine.global_steps += 1\n    if bad > 3:\n        break")
    assert [c.key for c in _site(tmp_path, patience)[0].carried] == ["best", "bad"]
    # probe 27's h1: an HF-style callback's state in a dict, changed by item through an alias, started with
    # float("inf"); another class of the file starting its own self.state otherwise does not hide it
    callback = ("class State:\n    def __init__(self):\n        self.state = object()\n"
                "class Plateau:\n    def __init__(self):\n        self.state = {'best': float('inf'), 'bad': 0}\n"
                "    def on_step_end(self, loss):\n        s = self.state\n        if loss < s['best']:\n"
                "            s['best'], s['bad'] = loss, 0\n        else:\n            s['bad'] += 1\n"
                "cb = Plateau()\nwhile engine.global_steps < N:\n    cb.on_step_end(engine.train_batch() or 1.0)\n"
                "    engine.global_steps += 1")
    assert [c.key for c in _site(tmp_path, callback)[0].carried] == ["cb.state"]
    # probe 27's h5: the same state in a module's dict a function the loop calls sets items of (no ``global``); not a
    # dict the function makes
    module_dict = ("STATS = {'best': float('inf'), 'bad': 0}\ndef on_step_end(loss):\n    made = {}\n"
                   "    made['x'] = loss\n    if loss < STATS['best']:\n"
                   "        STATS['best'], STATS['bad'] = loss, 0\n    else:\n        STATS['bad'] += 1\n"
                   "while engine.global_steps < N:\n    on_step_end(engine.train_batch() or 1.0)\n"
                   "    engine.global_steps += 1")
    assert [c.key for c in _site(tmp_path, module_dict)[0].carried] == ["STATS"]
    # probe 27's h6: a closure's cells, a dict it closes over among them; not one only appended to, nor started from
    # what the script resumed, nor a closure the loop makes anew
    closure = ("def make(start):\n    best, stats, seen, own = float('inf'), {'bad': 0}, [], start\n"
               "    def on_step_end(loss):\n        nonlocal best, own\n        seen.append(loss)\n"
               "        own = own + loss\n        if loss < best:\n            best = loss\n        else:\n"
               "            stats['bad'] += 1\n    return on_step_end\ncb = make(0.0)\n"
               "while engine.global_steps < N:\n    cb(engine.train_batch() or 1.0)\n    engine.global_steps += 1")
    assert [c.key for c in _site(tmp_path, closure)[0].carried] == ["cb.best", "cb.stats"]
    assert _site(tmp_path, closure.replace("    cb(", "    cb = make(0.0)\n    cb("))[0].carried == ()
    window = ("losses = []\nwhile engine.global_steps < N:\n    losses.append(engine.train_batch() or 1.0)\n"
              "    if len(losses) > 5 and sum(losses[-5:]) > 5:\n        break\n    engine.global_steps += 1")
    site = _site(tmp_path, window)[0]
    assert site.carried[0].where.endswith("(losses.append(engine.train_batch() or 1.0))")
    assert not site.carried[0].read_before_call, "refilled in place: the list its append was looked up on"
    # an empty container made by a call is a literal start (probe 26's g14: a deque's window was neither kept nor said)
    deque = ("import collections\nrecent = collections.deque(maxlen=4)\nwhile engine.global_steps < N:\n"
             "    recent.append(engine.train_batch() or 1.0)\n"
             "    if len(recent) == 4 and recent[-1] > sum(recent) / 4:\n        break\n    engine.global_steps += 1")
    assert [c.key for c in _site(tmp_path, deque)[0].carried] == ["recent"]
    seen = ("from collections import Counter, defaultdict\nseen = START\nwhile engine.global_steps < N:\n"
            "    loss = engine.train_batch() or 1.0\n    seen[loss] = seen.get(loss, 0) + 1\n"
            "    if max(seen.values()) > 3:\n        break\n    engine.global_steps += 1")
    for start in ("defaultdict(int)", "Counter()", "dict()"):
        assert [c.key for c in _site(tmp_path, seen.replace("START", start))[0].carried] == ["seen"], start
    assert [c.key for c in _site(tmp_path, window.replace("[]", "list()"))[0].carried] == ["losses"]
    assert _site(tmp_path, window.replace("[]", "list([args.steps])"))[0].carried == (), "the script's own resume"
    kept_only = ("losses = []\nwhile engine.global_steps < N:\n    losses.append(engine.train_batch())\n"
                 "    engine.global_steps += 1")
    assert _site(tmp_path, kept_only)[0].carried == (), "changed, never read in the loop"
    # not carried: set before it is read in each iteration; started from what the script resumed; never read
    fresh = ("loss = None\nwhile engine.global_steps < N:\n    loss = engine.train_batch()\n    print(loss)\n"
             "    engine.global_steps += 1")
    resumed = bold.replace("prev = None", "prev = args.steps")
    unread = "last = None\nwhile engine.global_steps < N:\n    last = engine.train_batch()\n    engine.global_steps += 1"
    assert not any(_site(tmp_path, body)[0].carried for body in (fresh, resumed, unread))
    assert not any(_site(tmp_path, STEPS[name])[0].carried for name in STEPS)
    # probe 27's W2: an epoch recomputed from the engine's step before the call, read before only to tell it changed
    # (a resumed process sets the sampler's epoch and makes an iterator again), was said to be carried and not kept;
    # an epoch folded, or one whose change also steps a schedule, is carried
    epochs = ("class Sampler:\n    def set_epoch(self, epoch):\n        pass\n    step = set_epoch\n"
              "sampler, epoch = Sampler(), -1\nwhile engine.global_steps < N:\n"
              "    if engine.global_steps // 2 != epoch:\n        epoch = engine.global_steps // 2\n"
              "        sampler.set_epoch(epoch)\n        it = iter(loader)\n    engine.train_batch()\n"
              "    engine.global_steps += 1")
    assert _site(tmp_path, epochs)[0].carried == ()
    for carries in (epochs.replace("epoch = engine.global_steps // 2", "epoch += 1"),
                    epochs.replace("sampler.set_epoch(epoch)", "sampler.step(epoch)")):
        assert [c.key for c in _site(tmp_path, carries)[0].carried] == ["epoch"], carries
    # a trainer's attribute, in a method its loop calls; not where the trainer resumes it, nor set before it is read
    trainer = ("class Trainer:\n    def __init__(self):\n        self.prev = None\n    def after(self, loss):\n"
               "        if self.prev is not None and loss > self.prev:\n            pass\n        self.prev = loss\n"
               "    def fit(self):\n        while engine.global_steps < N:\n"
               "            self.after(engine.train_batch() or 1.0)\n            engine.global_steps += 1\n"
               "Trainer().fit()")
    site, script = _site(tmp_path, trainer)
    assert [(c.where, c.key) for c in site.carried] == [(f"{script}:{line + 7} (self.prev = loss)", "self.prev")]
    assert not site.carried[0].read_before_call
    before = trainer.replace("self.after(engine.train_batch() or 1.0)", "self.after(1.0)\n            engine.train_batch()")
    assert _site(tmp_path, before)[0].carried[0].read_before_call, "read in a method called before train_batch"
    # a module's global a function the loop calls carries; read before the call where another function reads it first
    glob = ("best = float('inf')\ndef after(loss):\n    global best\n    best = min(best, loss)\n"
            "while engine.global_steps < N:\n    after(engine.train_batch() or 1.0)\n    engine.global_steps += 1")
    site, script = _site(tmp_path, glob)
    assert [(c.where, c.key, c.module_global, c.read_before_call) for c in site.carried] == [
        (f"{script}:{line + 4} (best = min(best, loss))", "best", True, False)]
    early = glob.replace("while engine.global_steps < N:\n", "def before():\n    print(best)\n"
                                                              "while engine.global_steps < N:\n    before()\n")
    assert _site(tmp_path, early)[0].carried[0].read_before_call
    pair = ("best, bad = float('inf'), 0\ndef after(loss):\n    global best, bad\n    if loss < best:\n"
            "        best, bad = loss, 0\n    else:\n        bad += 1\n    return bad > 3\n"
            "while engine.global_steps < N:\n    after(engine.train_batch() or 1.0)\n    engine.global_steps += 1")
    assert [c.key for c in _site(tmp_path, pair)[0].carried] == ["best", "bad"], "started as a tuple's items"
    # a meter's attributes, in a method of its the loop calls on it and one that method calls on self: the meter's
    # (its class in another module of the script's: tests/test_user_script.py); not an object that keeps itself
    meter = ("class Meter:\n    def __init__(self):\n        self.sum, self.count = 0.0, 0\n"
             "    def update(self, value):\n        self.add(value)\n        self.count += 1\n"
             "    def add(self, value):\n        self.sum += value\n"
             "meter = Meter()\nwhile engine.global_steps < N:\n    meter.update(engine.train_batch() or 1.0)\n"
             "    engine.global_steps += 1")
    site, script = _site(tmp_path, meter)
    assert [(c.where, c.key, c.read_before_call) for c in site.carried] == [
        (f"{script}:{line + 6} (self.count += 1)", "meter.count", False),
        (f"{script}:{line + 8} (self.sum += value)", "meter.sum", False)]
    # an object called itself: its class's __call__ (probe 26's g13: a warm-up's count, read before the call, unsaid)
    warm = ("class Warmup:\n    def __init__(self):\n        self.t = 0\n    def step(self):\n        self.t += 1\n"
            "        return min(1.0, self.t / 10)\n    __call__ = step\nwarm = Warmup()\n"
            "while engine.global_steps < N:\n    factor = warm()\n    engine.train_batch()\n"
            "    engine.global_steps += 1")
    site, script = _site(tmp_path, warm)
    assert [(c.where, c.key, c.read_before_call) for c in site.carried] == [
        (f"{script}:{line + 5} (self.t += 1)", "warm.t", True)], site
    # a dict or list of tensors it updates in place from themselves, started from a copy of the weights (probe 26's g7)
    ema = ("import torch\nmodel = torch.nn.Linear(2, 1)\n"
           "ema = {n: p.detach().clone() for n, p in model.named_parameters()}\nwhile engine.global_steps < N:\n"
           "    engine.train_batch()\n    for n, p in model.named_parameters():\n"
           "        ema[n].mul_(0.99).add_(p.detach(), alpha=0.01)\n    engine.global_steps += 1")
    site, script = _site(tmp_path, ema)
    assert [(c.key, c.read_before_call) for c in site.carried] == [("ema", False)], site
    listed = ema.replace("{n: p.detach().clone() for n, p in", "[p.detach().clone() for p in").replace(
        "named_parameters()}", "parameters()]").replace("for n, p in model.named_parameters():\n        ema[n]",
                                                        "for e, p in zip(ema, model.parameters()):\n        e")
    assert [c.key for c in _site(tmp_path, listed)[0].carried] == ["ema"], listed
    noise = ema.replace("ema[n].mul_(0.99).add_(p.detach(), alpha=0.01)", "p.detach().add_(1e-3)")
    copied = ema.replace("ema[n].mul_(0.99).add_(p.detach(), alpha=0.01)", "ema[n].copy_(p.detach())")
    assert not any(_site(tmp_path, body)[0].carried for body in (noise, copied)), "the weights; not from itself"
    keeps_itself = meter.replace("    def add(", "    def state_dict(self):\n        return {}\n    def add(")
    assert _site(tmp_path, keeps_itself)[0].carried == ()
    held = meter.replace("meter = Meter()\nwhile engine.global_steps < N:\n    meter.update(", (
        "class Trainer:\n    def __init__(self):\n        self.losses = Meter()\n    def fit(self):\n"
        "        while engine.global_steps < N:\n            self.losses.update(")).replace(
        "\n    engine.global_steps += 1", "\n            engine.global_steps += 1\nTrainer().fit()")
    assert [c.key for c in _site(tmp_path, held)[0].carried] == ["self.losses.count", "self.losses.sum"], held
    resumed = trainer.replace("    def fit", "    def load(self, state):\n        self.prev = state['prev']\n    def fit")
    stored_first = trainer.replace("if self.prev is not None and loss > self.prev", "if loss > 1")
    assert not any(_site(tmp_path, body)[0].carried for body in (resumed, stored_first))
    # started as a tuple's items; a window of losses the trainer appends to and reads
    patient = ("class Trainer:\n    def __init__(self):\n        self.best, self.bad = float('inf'), 0\n"
               "        self.window = []\n    def after(self, loss):\n        self.window.append(loss)\n"
               "        avg = sum(self.window[-3:]) / 3\n        if avg < self.best:\n"
               "            self.best, self.bad = avg, 0\n        else:\n            self.bad += 1\n"
               "    def fit(self):\n        while engine.global_steps < N:\n"
               "            self.after(engine.train_batch() or 1.0)\n            engine.global_steps += 1\n"
               "Trainer().fit()")
    assert [c.key for c in _site(tmp_path, patient)[0].carried] == ["self.window", "self.best", "self.bad"]
    # a state object the trainer holds, a dataclass's defaults its start (probe: resumed, its sum started again)
    state = ("from dataclasses import dataclass, field\n@dataclass\nclass State:\n    total: float = 0.0\n"
             "    seen: list = field(default_factory=list)\nclass Trainer:\n    def __init__(self):\n"
             "        self.state = State()\n    def fit(self):\n        while engine.global_steps < N:\n"
             "            loss = engine.train_batch() or 1.0\n            self.state.total += loss\n"
             "            self.state.seen.append(loss)\n            print(self.state.seen[-1])\n"
             "            engine.global_steps += 1\nTrainer().fit()")
    assert [c.key for c in _site(tmp_path, state)[0].carried] == ["self.state.total", "self.state.seen"]
    # torchvision's MetricLogger: its update changes the meters it holds through their own update: kept whole
    logger = ("from collections import defaultdict\nclass Smoothed:\n    def __init__(self):\n"
              "        self.total, self.count = 0.0, 0\n    def update(self, value):\n        self.total += value\n"
              "        self.count += 1\nclass MetricLogger:\n    def __init__(self):\n"
              "        self.meters = defaultdict(Smoothed)\n    def update(self, **values):\n"
              "        for name, value in values.items():\n            self.meters[name].update(value)\n"
              "logger = MetricLogger()\nwhile engine.global_steps < N:\n"
              "    logger.update(loss=engine.train_batch() or 1.0)\n    engine.global_steps += 1")
    site, script = _site(tmp_path, logger)
    assert [(c.where, c.key, c.whole) for c in site.carried] == [
        (f"{script}:{line + 13} (self.meters[name].update(value))", "logger", True)]
    # an EMA of the script's own keeping a list of tensors it changes in place through the loop's variable, as the
    # dict form above (h45: relaunched, it started again from the restored weights, silently): kept whole
    ema = ("import torch\nclass EMA:\n    def __init__(self, model):\n"
           "        self.weights = [p.detach().clone() for p in model.parameters()]\n    def update(self, model):\n"
           "        for kept, p in zip(self.weights, model.parameters()):\n"
           "            kept.mul_(0.9).add_(p.detach(), alpha=0.1)\n"
           "model = torch.nn.Linear(2, 1)\nema = EMA(model)\nwhile engine.global_steps < N:\n"
           "    engine.train_batch()\n    ema.update(model)\n    engine.global_steps += 1")
    site, script = _site(tmp_path, ema)
    assert [(c.where, c.key, c.whole) for c in site.carried] == [
        (f"{script}:{line + 7} (kept.mul_(0.9))", "ema", True)], site
    numbered = ema.replace("for kept, p in zip(self.weights, model.parameters()):",
                           "for i, kept in enumerate(self.weights):").replace("p.detach(), alpha", "1.0, alpha")
    direct = numbered.replace("for i, kept in enumerate(self.weights)", "for kept in self.weights")
    assert all([c.key for c in _site(tmp_path, body)[0].carried] == ["ema"] for body in (numbered, direct))
    read = ema.replace("kept.mul_(0.9).add_(p.detach(), alpha=0.1)", "p.detach().add_(kept)")
    assert _site(tmp_path, read)[0].carried == (), "the weights changed, not the list"


def test_a_loop_baft_cannot_read_is_said_to_be_unread(tmp_path):
    """A ``while`` over a counter baft cannot read, or a ``for`` over what it cannot tell from a count or the data (a
    function's result): resumed, it would run its steps again, and is said at start."""
    site, _ = _site(tmp_path, "step = 0\nwhile step < N:\n    engine.train_batch()\n    step += len(loader)")
    assert site.unread and not site.counts_calls and site.text == "while step < N", site
    site, _ = _site(tmp_path, "def steps():\n    return [0, 1]\nfor step in steps():\n    engine.train_batch()")
    assert site.unread and not site.counts_calls and site.text == "for step in steps()", site
    # the data goes on from the restored position, the count of epochs from 0 again: an epoch more
    site, _ = _site(tmp_path, STEPS["data inside a range"])
    assert site.unread and not site.counts_calls and site.text == "for batch in loader", site
    assert not any(_site(tmp_path, STEPS[name])[0].unread for name in STEPS if name != "data inside a range")
    assert not any(_site(tmp_path, COUNTS[name])[0].unread for name in COUNTS)


def test_a_collective_between_the_calls_is_found_in_the_loop_or_a_function_or_method_it_calls(tmp_path):
    """A replacement in place replays a loop that counts its calls alone: a collective there would wait for peers that
    are not (:mod:`baft.recovery.in_place` relaunches every rank instead)."""
    never = "    if engine.global_steps < 0:  # read, not run: no process group here\n    "
    found = {
        f"import torch.distributed as dist\nfor _ in range(N):\n    engine.train_batch()\n{never}    dist.all_reduce(x)":
            "dist.all_reduce(x)",
        ("import torch\ndef log(loss):\n    if loss is not None:\n        torch.distributed.all_reduce(loss)\n"
         "for _ in range(N):\n    log(engine.train_batch())"): "torch.distributed.all_reduce(loss)",
        f"from torch.distributed import barrier\nfor _ in range(N):\n    engine.train_batch()\n{never}    barrier()":
            "barrier()",
        f"from deepspeed import comm\nfor _ in range(N):\n    engine.train_batch()\n{never}    comm.broadcast(x, 0)":
            "comm.broadcast(x, 0)",
        # a trainer's method, through another (round seven's hung in place)
        ("import torch.distributed as dist\nclass Trainer:\n    def mean(self, x):\n        dist.all_reduce(x)\n"
         "    def evaluate(self):\n        return self.mean(1)\n    def fit(self):\n        for _ in range(N):\n"
         "            engine.train_batch()\n            if engine.global_steps < 0:\n                self.evaluate()\n"
         "Trainer().fit()"): "dist.all_reduce(x)",
    }
    for body, call in found.items():
        site, script = _site(tmp_path, body)
        assert site.collective.startswith(f"{script}:") and site.collective.endswith(f" ({call})"), (body, site)
    none = ["import functools\nfor _ in range(N):\n    engine.train_batch()\n    functools.reduce(max, [1, 2])",
            "import torch\nfor _ in range(N):\n    engine.train_batch()\n    torch.gather(torch.ones(2), 0, torch.zeros(2).long())",
            "import torch.distributed as dist\nif N < 0:\n    dist.barrier()\nfor _ in range(N):\n    engine.train_batch()"]
    for body in none:
        assert _site(tmp_path, body)[0].collective == "", body


def test_a_torch_save_between_the_calls_is_found_and_said_as_a_resumed_process_replays_them(tmp_path, capsys):
    """Probe 16: a loop that counts its calls and saves the stage's weights with torch.save every 4 calls, resumed
    at step 8, saved step 8's weights over its checkpoint of step 4 as it replayed call 4, silently."""
    found = {
        ("import torch\nfor step in range(N):\n    engine.train_batch()\n    if step < 0:\n"
         "        torch.save({}, f'own-{step}.pt')"): "torch.save({}, f'own-{step}.pt')",
        ("from torch import save as keep\ndef checkpoint(step):\n    keep({}, 'own.pt')\nfor step in range(N):\n"
         "    engine.train_batch()\n    if step < 0:\n        checkpoint(step)"): "keep({}, 'own.pt')",
    }
    for body, call in found.items():
        site, script = _site(tmp_path, body)
        assert site.saves.startswith(f"{script}:") and site.saves.endswith(f" ({call})"), (body, site)
    none = ["import numpy as np\nfor _ in range(N):\n    engine.train_batch()\n    if N < 0:\n        np.save('a', 1)",
            "for _ in range(N):\n    engine.train_batch()\n    if N < 0:\n        engine.save_checkpoint('ckpt')"]
    for body in none:
        assert _site(tmp_path, body)[0].saves == "", body
    script = tmp_path / "resumed.py"
    script.write_text(ENGINE + "LOOP = Loop()\nLOOP.restored({}, {'global_steps': 2})\nengine = Engine(2)\n"
                      "import torch\nfor step in range(3):\n    engine.train_batch()\n    if step < 0:\n"
                      "        torch.save({}, 'own.pt')\n")
    runpy.run_path(str(script), run_name="__main__")
    err = capsys.readouterr().err
    assert (f"baft: warning: the loop at {script}:17 (for step in range(3)) calls torch.save between its calls, at "
            f"{script}:20 (torch.save({{}}, 'own.pt')): as it replays calls 1-2, what that saves of the model or the "
            f"optimizer is step 2's") in err, err


def test_a_call_in_no_loop(tmp_path):
    site, _ = _site(tmp_path, "engine.train_batch()")
    assert site is None


def test_the_site_names_the_innermost_loop(tmp_path):
    site, script = _site(tmp_path, COUNTS["nested ranges"])
    assert site.where == f"{script}:{STUB.count(chr(10)) + 2}" and site.text == "for i in range(N)", site


ENGINE = """
import sys
from types import SimpleNamespace
from baft.script.loop import Loop

class Engine:
    baft = SimpleNamespace(config=SimpleNamespace(loop="auto"))
    global_rank = 0
    def __init__(self, step):
        self.global_steps = step
    def train_batch(self):
        LOOP.decide(self, sys._getframe(1))
"""
PHASES = ENGINE + """
LOOP = Loop()
LOOP.restored(None, {"global_steps": STEP})  # a snapshot taken by a process whose loop did not count its calls
engine = Engine(STEP)
while engine.global_steps < 2:  # a warm-up phase, on the engine's step
    engine.train_batch()
    engine.global_steps += 1
for step in range(3):  # then a phase that counts its calls
    engine.train_batch()
"""


def test_a_phase_that_counts_its_calls_after_one_on_the_engines_step_is_said_and_cannot_resume(tmp_path, capfd):
    from baft.errors import BaftError

    script = tmp_path / "phases.py"
    script.write_text(PHASES.replace("STEP", "0"))
    runpy.run_path(str(script), run_name="__main__")  # a first run: warned as it enters the second phase
    err = capfd.readouterr().err
    assert (f"train_batch is called now from the loop at {script}:20 (for step in range(3)), which counts its calls, "
            f"after the loop at {script}:17 (while engine.global_steps < 2), which does not count") in err, err
    assert err.count("baft:") == 1, err  # once, not at every call
    script.write_text(PHASES.replace("STEP", "4"))  # resumed at step 4, past the warm-up: replays calls it has no record of
    with pytest.raises(BaftError, match=r"range\(3\)\) counts its calls to train_batch, and the snapshot of step 4 this "
                                        r"process resumes from holds no record of them"):
        runpy.run_path(str(script), run_name="__main__")


CARRIES = ENGINE + """        KEPT.append(LOOP.carried_values(self))  # as a snapshot of the step before captures them
        return [3.0, 1.0, 2.0][self.global_steps]

class Stateful:  # handed over: not carried by the loop
    pass

class Meter:
    def __init__(self):
        self.sum = 0.0

    def update(self, loss):
        self.sum += loss

LOOP, KEPT = Loop(), []
if RESTORED is not None:
    LOOP.restored(None, {"global_steps": STEP}, lambda: RESTORED)
engine = Engine(STEP)

total = 0.0

def note(loss):
    global total
    total = total + loss

def train():
    prev, losses = None, []
    made, held = id(losses), SimpleNamespace(meter=Meter())
    while engine.global_steps < 3:
        loss = engine.train_batch()
        if prev is not None and loss > prev:
            pass
        prev = loss
        losses.append(loss)
        note(loss)
        held.meter.update(loss)
        if len(losses) > 9 and sum(losses[-9:]) > 9:
            break
        engine.global_steps += 1
    return prev, losses, total, id(losses) == made, held.meter.sum
"""
AT_MODULE = """
best, handle = float("inf"), Stateful()
for _ in iter(int, 1):  # at module level, on the engine's step
    if engine.global_steps >= 3:
        break
    loss = engine.train_batch()
    best = min(best, loss)
    handle.seen = getattr(handle, "seen", 0) + 1
    engine.global_steps += 1
"""

WINDOW = """
import collections
recent = collections.deque(maxlen=2)
while engine.global_steps < 3:
    recent.append(engine.train_batch())
    if len(recent) == 2 and recent[-1] > sum(recent) / 2:
        pass
    engine.global_steps += 1
"""
EMA = """
import torch
model = torch.nn.Linear(2, 1, bias=False)
torch.nn.init.constant_(model.weight, 1.0)
ema = {n: p.detach().clone() for n, p in model.named_parameters()}
made = ema
while engine.global_steps < 3:
    loss = engine.train_batch()
    for n, p in model.named_parameters():
        ema[n].mul_(0.5).add_(p.detach() * loss, alpha=0.5)
    engine.global_steps += 1
"""


def test_the_values_a_loop_on_the_engines_step_carries_are_kept_and_put_back_at_its_first_call(tmp_path, capsys):
    """A function's local variables (rebound; a list refilled in place), a module's: a resumed process sets them at its
    loop's first call as the snapshot was taken (as the call of the next step started), so the code after the calls
    reads them as an uninterrupted run did."""
    script = tmp_path / "carries.py"

    def run(step, restored, body):
        script.write_text(CARRIES.replace("STEP", str(step)) + body)
        return runpy.run_path(str(script), run_name="__main__", init_globals={"RESTORED": restored})

    whole = run(0, None, "RESULT = train()\n")
    assert whole["RESULT"] == (2.0, [3.0, 1.0, 2.0], 6.0, True, 6.0)
    assert whole["KEPT"] == [{"prev": None, "losses": [], "total": 0.0, "held.meter.sum": 0.0},
                             {"prev": 3.0, "losses": [3.0], "total": 3.0, "held.meter.sum": 3.0},
                             {"prev": 1.0, "losses": [3.0, 1.0], "total": 4.0, "held.meter.sum": 4.0}]
    resumed = run(2, whole["KEPT"][2], "RESULT = train()\n")  # at step 2, as the call for step 3 started
    assert resumed["RESULT"] == whole["RESULT"], "the list refilled in place, the module's global set"
    out = capsys.readouterr().out
    assert f"the loop at {script}:" in out and "carries prev, losses, held.meter.sum, total from one iteration to the next: set as " \
                                               "they were at step 2" in out, out
    at_module = run(0, None, AT_MODULE)
    assert at_module["best"] == 1.0 and at_module["KEPT"][-1] == {"best": 1.0}
    # probe 26's g14: a window of the last losses in a deque made by a call was neither kept nor said
    whole = run(0, None, WINDOW)
    assert whole["KEPT"][2] == {"recent": collections.deque([3.0, 1.0], maxlen=2)}, whole["KEPT"]
    resumed = run(2, whole["KEPT"][2], WINDOW)["recent"]
    assert resumed == whole["recent"] == collections.deque([1.0, 2.0]) and resumed.maxlen == 2, resumed
    # probe 26's g7: an EMA of the weights in a dict of tensors the loop updates in place: resumed, made again from the
    # restored weights (relaunched), or with a step's update twice (in place), silently
    whole = run(0, None, EMA)
    assert torch.equal(whole["KEPT"][2]["ema"]["weight"], torch.tensor([[1.5, 1.5]])), whole["KEPT"]
    resumed = run(2, whole["KEPT"][2], EMA)
    assert torch.equal(resumed["ema"]["weight"], whole["ema"]["weight"]) and resumed["ema"] is resumed["made"]
    assert run(2, {"best": 1.0}, AT_MODULE)["best"] == 1.0, "the module's variable, set as the first call started"
    assert run(2, None, AT_MODULE)["best"] == 2.0, "not kept: started again from its first value"


PLATEAU = """
def make_plateau():
    best, bad = float("inf"), 0
    def on_step_end(loss):
        nonlocal best, bad
        if loss < best:
            best, bad = loss, 0
        else:
            bad += 1
        return bad
    return on_step_end

def main():
    on_step_end, bads = make_plateau(), []
    while engine.global_steps < 3:
        bads.append(on_step_end(engine.train_batch()))
        engine.global_steps += 1
    return bads
"""


def test_a_plateau_rules_state_in_a_closure_the_loop_calls_is_kept_and_put_back(tmp_path, capsys):
    """Probe 27's h6: a plateau rule as a closure keeping its state in ``nonlocal`` variables, made at module level or
    in the script's main function, called after each train_batch: resumed, its rule started from an empty state (the
    learning rate one decay behind), silently, relaunched and in place. Its cells are carried as a module's globals are,
    and said so."""
    script = tmp_path / "plateau.py"

    def run(step, restored, body):
        script.write_text(CARRIES.replace("STEP", str(step)) + PLATEAU + body)
        return runpy.run_path(str(script), run_name="__main__", init_globals={"RESTORED": restored})

    in_main = "RESULT = main()\n"
    at_module = ("on_step_end, RESULT = make_plateau(), []\nwhile engine.global_steps < 3:\n"
                 "    RESULT.append(on_step_end(engine.train_batch()))\n    engine.global_steps += 1\n")
    for body in (in_main, at_module):
        whole = run(0, None, body)
        assert whole["RESULT"] == [0, 0, 1] and whole["KEPT"][2] == {"on_step_end.best": 1.0, "on_step_end.bad": 0}, \
            whole["KEPT"]
        assert run(2, whole["KEPT"][2], body)["RESULT"][-1] == 1, "its rule as the uninterrupted run had it"
        assert "carries on_step_end.best, on_step_end.bad from one iteration to the next" in capsys.readouterr().out
    assert run(2, None, in_main)["RESULT"] == [0], "not kept: started again from its first value"


def test_a_carried_tensor_is_set_again_in_a_survivor():
    """A value the loop carries that holds a tensor (``prev = loss``, train_batch's loss; a closure's ``best``): a
    survivor in place, whose value is a tensor too, kept its latest one, refilled as an object's attributes are,
    instead of the restored one."""
    from baft.script import carry
    from baft.script.carry import Carried

    prev = torch.tensor(2.0)

    def on_step_end(loss):
        nonlocal prev
        prev = loss

    here = sys._getframe()
    for value_of in (Carried("x", "on_step_end", "prev", frame=here, cell=True),
                     Carried("x", "RESULT", frame=here, module_global=True)):
        globals()["RESULT"] = torch.tensor(2.0)
        carry.write(value_of, torch.tensor(1.0))
        assert carry.read(value_of).item() == 1.0, value_of


CLOSURE = ENGINE + """
LOOP, KEPT, SEEN = Loop(), [], []
if RESTORED is not None:
    LOOP.restored(None, {"global_steps": STEP}, lambda: RESTORED)

class Reading(Engine):  # its call reads the loss function given to it, as a pipeline's last stage does
    def train_batch(self):
        super().train_batch()
        KEPT.append(LOOP.carried_values(self))
        SEEN.append(self.losses[0]())

engine = Reading(STEP)

def main():
    weight = 1.0
    def loss_fn():
        return weight
    engine.losses = [loss_fn]
    while engine.global_steps < 3:
        engine.train_batch()
        engine.global_steps += 1
        if engine.global_steps == 1:
            weight = 0.5

main()
"""


def test_a_local_of_main_a_nested_loss_function_reads_is_put_back_at_the_first_call(tmp_path):
    """Probe 26 G9: main()'s ``weight``, set once by the loop and read by the loss function closing over it inside
    train_batch: a resumed process sets the closure's cell as the snapshot had it, which the loss reads."""
    script = tmp_path / "closure.py"
    script.write_text(CLOSURE.replace("STEP", "0"))
    whole = runpy.run_path(str(script), run_name="__main__", init_globals={"RESTORED": None})
    assert whole["SEEN"] == [1.0, 0.5, 0.5] and whole["KEPT"][2] == {"weight": 0.5}, whole["KEPT"]
    script.write_text(CLOSURE.replace("STEP", "2"))
    assert runpy.run_path(str(script), run_name="__main__", init_globals={"RESTORED": whole["KEPT"][2]})["SEEN"] == [0.5]


def test_a_carried_value_that_cannot_be_kept_is_said_once(tmp_path, capfd):
    """Data too large to copy at every snapshot, or read before the call: said once, by rank 0, at the first capture.
    Not an object of the script's own (made again as it first was), nor anything in a loop that counts its calls, whose
    replay computes it again."""
    header = PHASES.split("LOOP.restored")[0] + "engine = Engine(0)\nprev = None\n"
    script = tmp_path / "carried.py"

    def said(value, loop="while engine.global_steps < 3:\n", step="    engine.global_steps += 1\n"):
        script.write_text(header + loop + f"    loss = engine.train_batch() or {value}\n"
                          "    if prev is not None and loss is not prev:\n        pass\n"
                          "    prev = loss\n    LOOP.carried_values(engine)\n" + step)
        runpy.run_path(str(script), run_name="__main__")
        return capfd.readouterr().err

    err = said("list(range(20000))")
    assert err.count("baft:") == 1 and (f"carries a value of the script's own from one iteration to the next, "
                                        f"{script}:{header.count(chr(10)) + 5} (prev = loss), which no snapshot holds "
                                        f"(over 10000 items") in err, err
    assert said("object()") == "", "an object of the script's own"
    assert said("list(range(20000))", loop="for _ in range(3):\n", step="") == ""
    script.write_text(header.replace("prev = None", "meter = 0.0") + "while engine.global_steps < 3:\n"
                      "    meter = 0.9 * meter + 0.1 * (engine.train_batch() or 1.0)\n    LOOP.carried_values(engine)\n"
                      "    engine.global_steps += 1\n")
    runpy.run_path(str(script), run_name="__main__")
    assert "(the loop reads it before it calls train_batch" in capfd.readouterr().err
    # probe 26's g3: a count of the script's own read before the call (a warm-up by hand) was neither line: the count's
    # deferred to the carried value's, and that one to the count's
    script.write_text(header.replace("prev = None", "count = 0") + "while engine.global_steps < 3:\n"
                      "    lr = min(1.0, (count + 1) / 10)\n    engine.train_batch()\n    count += 1\n"
                      "    LOOP.carried_values(engine)\n    engine.global_steps += 1\n")
    runpy.run_path(str(script), run_name="__main__")
    err = capfd.readouterr().err
    assert err.count("baft:") == 1 and (f"adds to a count of the script's own, {script}:{header.count(chr(10)) + 4} "
                                        f"(count += 1), which no snapshot holds") in err, err
    # an EMA's list of tensors changed in place through the loop's variable, one over the limits: named, not dropped
    script.write_text(header.replace("prev = None", (
        "import torch\nclass EMA:\n    def __init__(self):\n        self.weights = [torch.zeros(1 << 17)]\n"
        "    def update(self):\n        for kept in self.weights:\n            kept.mul_(0.9)\nema = EMA()")) +
        "while engine.global_steps < 3:\n    engine.train_batch()\n    ema.update()\n    LOOP.carried_values(engine)\n"
        "    engine.global_steps += 1\n")
    runpy.run_path(str(script), run_name="__main__")
    err = capfd.readouterr().err
    assert err.count("carries a value") == 1 and "(kept.mul_(0.9)), which no snapshot holds (over 10000 items" in err


def test_an_attribute_the_loop_carries_and_a_snapshot_keeps_leaves_survivors_in_place(tmp_path):
    """Probe 26: a loop on the engine's step that counts in an object's attribute (``ts.seen += 8``) was said to carry it,
    set as it was at the restored step, and then to set state baft does not keep: every rank was replaced in place.
    Kept, it leaves survivors in place; in a loop that counts its calls (whose carried values no snapshot keeps: its
    replay computes them again), it does not. So for a setting a loss module outside the model holds, changed once
    (probe 26's G10, ``crit.delta = 0.1``): in a loop that counts its calls a survivor would train the steps since the
    restored one again with the new value."""
    header = PHASES.split("LOOP.restored")[0] + "engine = Engine(0)\nclass Seen:\n    def __init__(self):\n" \
                                                "        self.seen = 0\nts = Seen()\nimport torch\n" \
                                                "crit = torch.nn.HuberLoss(delta=1.0)\n"
    script = tmp_path / "seen.py"
    for changes, said in (("    ts.seen += 8\n    print(ts.seen)\n", "(ts.seen += 8) between its calls"),
                          ("    if engine.global_steps == 1:\n        crit.delta = 0.1\n", "(crit.delta = 0.1) between")):
        for loop, step, in_place in (("while engine.global_steps < 3:\n", "    engine.global_steps += 1\n", True),
                                     ("for _ in range(3):\n", "", False)):
            script.write_text(header + loop + "    engine.train_batch()\n" + changes + step)
            ran = runpy.run_path(str(script), run_name="__main__")
            why = ran["LOOP"].not_in_place
            assert (why == "") == in_place and (in_place or said in why), (loop, changes, why)


def test_the_loop_key_is_validated():
    from baft.config import parse_config
    from baft.errors import ConfigError

    assert parse_config({"baft": {}}).loop == "auto" and parse_config({"baft": {"loop": "calls"}}).loop == "calls"
    with pytest.raises(ConfigError, match=r"^baft\.loop: expected one of auto, calls, steps, got 'count'$"):
        parse_config({"baft": {"loop": "count"}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_history_goes_through_a_commit_record_exactly(dtype):
    """What a replayed call returns is what the call returned, bit for bit, through the commit record's JSON; and
    what the script's code after it read of the engine (its global_samples, its learning rates)."""
    history = History()
    losses = [torch.tensor(v, dtype=dtype) for v in (2.3456789, 1.0 / 3, 1e-7)]
    for step, (loss, samples) in enumerate(zip(losses, (4, 12, 18)), 1):  # a batch-size ramp: 4, then 8 a step
        history.record_train(step, loss, samples, lrs=[0.1 * step, 0.01 * step])
    history.record_eval(2, torch.tensor(0.123456789, dtype=dtype))
    history.record_eval(2, (torch.zeros(2), torch.ones(3)))  # logits too: a value baft cannot replay
    history.record_train(3, losses[2], samples=20, lrs=[0.5], applied=False, grad_norm=torch.tensor(2.5, dtype=dtype))
    history.record_train(4, (torch.zeros(1), torch.ones(1)), samples=28, lrs=[0.6, 0.06])  # not a number
    restored = History.from_items(json.loads(json.dumps(history.items())))
    assert [restored.value(step) for step in (1, 2, 3, 4, 5)] == [*(float(v) for v in losses), None, None]
    assert restored.dtypes == {"train": str(dtype)[6:], "eval": str(dtype)[6:], "grad_norm": str(dtype)[6:]}
    # was_step_applied() and get_global_grad_norm() as the script read them after each step (probe 14: a replayed
    # call left them as the restore had, False and None, where the uninterrupted run read True and the step's norm)
    assert [restored.applied_after(step) for step in (1, 2, 3, 4)] == [True, True, False, True]
    norm = restored.grad_norm_after(3, device="cpu")
    assert norm.dtype == dtype and torch.equal(norm, torch.tensor(2.5, dtype=dtype))
    assert restored.grad_norm_after(2, device="cpu") is None and not restored.kept_after(5)
    assert not History.from_items({**history.items(), "applied": [], "norms": []}).kept_after(1)
    # the engine's global_samples a replayed call leaves, as the step left it (a count of the calls times the
    # batch size gave 16 after step 2); where a history written before baft kept them does not say, that count
    assert [restored.samples_after(step, batch_size=8) for step in (1, 2, 3, 4, 5)] == [4, 12, 20, 28, 40]
    assert History.from_items({**history.items(), "samples": []}).samples_after(2, batch_size=8) == 16
    assert restored.lrs_after(2) == [0.2, 0.02] and restored.lrs_after(3)[0] == 0.5 and restored.lrs_after(5) == []
    assert restored.evals == {2: [float(torch.tensor(0.123456789, dtype=dtype)), None]}
    again = torch.tensor(restored.value(2), dtype=getattr(torch, restored.dtypes["train"]))
    assert again.dtype == dtype and torch.equal(again, losses[1])


def test_a_long_history_is_encoded_once_per_block_and_read_back_exactly():
    """A commit record holds the whole history with every snapshot: each block of steps is encoded once (as JSON
    floats, 100,000 steps took 130 ms a snapshot), and a step trained again drops the blocks after it."""
    history, steps = History(), 2 * Column.BLOCK + 5
    for step in range(1, steps + 1):
        history.record_train(step, torch.tensor(step / 7, dtype=torch.float32), samples=8 * step, lrs=[1 / step])
    first = history.items()
    assert len(history.train.blocks) == 2
    history.record_train(Column.BLOCK - 1, torch.tensor(-1.0), samples=-1, lrs=[-1.0])  # in place, far back
    assert len(history.train.blocks) == 0 and len(history.train.values) == Column.BLOCK - 1
    for step in range(Column.BLOCK, steps + 1):
        history.record_train(step, torch.tensor(step / 7, dtype=torch.float32), samples=8 * step, lrs=[1 / step])
    again = History.from_items(json.loads(json.dumps(history.items())))
    expected = [float(torch.tensor(step / 7, dtype=torch.float32)) for step in range(1, steps + 1)]
    expected[Column.BLOCK - 2] = -1.0
    assert [again.value(step) for step in range(1, steps + 1)] == expected
    assert again.lrs_after(steps) == [1 / steps] and again.samples_after(Column.BLOCK - 1, 8) == -1
    assert History.from_items(first).value(Column.BLOCK - 1) == float(torch.tensor((Column.BLOCK - 1) / 7))
    # a record written before baft packed the history: JSON lists, None for a value not replayable
    old = History.from_items({"train": [1.5, None], "evals": {}, "dtypes": {"train": "float32"}})
    assert (old.value(1), old.value(2), old.lrs_after(1), old.samples_after(2, 4)) == (1.5, None, [], 8)


def test_a_range_from_the_engines_step_is_a_fixed_number_of_calls_from_where_the_process_started(tmp_path):
    """Such a loop does not recover in place (a survivor's, started before the restored step, ends before its
    replacement's): :class:`~baft.script.loop.Loop` says why not, and a fault relaunches every rank."""
    fixed = {"range from the engine's step", "range of what is left", "a name from the engine's step",
             "count from the engine's step", "a list from the engine's step"}
    for name, body in {**COUNTS, **STEPS}.items():
        assert _site(tmp_path, body)[0].from_step is (name in fixed), name


def test_an_evaluation_a_replay_could_not_return_is_said_once_as_it_is_made(capsys):
    from types import SimpleNamespace

    from baft.script.loop import Loop

    loop, engine = Loop(), SimpleNamespace(global_steps=3, global_rank=0)
    loop.decided = loop.counts_calls = True  # (an evaluation before the loop is read is said once it is)
    loop.record_eval(engine, torch.tensor(0.5))
    assert capsys.readouterr().err == ""
    loop.record_eval(engine, (torch.zeros(2), torch.ones(3)))
    loop.record_eval(engine, (torch.zeros(2), torch.ones(3)))
    said = capsys.readouterr().err
    assert said.count("baft: eval_batch returned tuple at step 3, not a scalar (return_logits=True?)") == 1, said


def test_an_evaluation_that_returned_none_is_replayed_as_none(capsys):
    """``eval_batch(..., bcast_loss=False)`` returns None on every stage but the last (probe 12: such a stage said
    "returned NoneType ... (return_logits=True?)" as it was made, and a process resumed in a loop that counts its calls
    stopped at its first replayed evaluation): nothing is said, and a replay there returns None; a None recorded on
    another stage (a survivor's record, in place) is not replayed as this stage's value."""
    from types import SimpleNamespace

    from baft.errors import BaftError
    from baft.script.loop import Loop

    loop, engine = Loop(), SimpleNamespace(global_steps=0, global_rank=0, device="cpu")
    loop.record_eval(engine, None)  # an evaluation before the first call
    engine.global_steps = 2
    loop.record_eval(engine, torch.tensor(0.5))
    loop.record_eval(engine, None)
    assert capsys.readouterr().err == ""
    resumed = Loop()
    resumed.restored(json.loads(json.dumps(loop.history.items())), {"global_steps": 1})
    resumed.to_replay = resumed.evaluated_until = 3
    assert resumed.replays_evaluations and resumed.replay_eval(engine, returns_none=True) is None
    resumed.called(), resumed.called()
    assert float(resumed.replay_eval(engine)) == 0.5
    with pytest.raises(BaftError, match="eval_batch call 2 after step 2 returned nothing baft recorded"):
        resumed.replay_eval(engine)


def test_a_batch_size_the_script_changes_has_every_rank_replaced_in_place_said_once_first_reason_kept(
        monkeypatch, capsys):
    """``set_train_batch_size`` (a batch-size ramp): a survivor's new engine would train at the configured size, so a
    fault replaces every rank; the reason is kept as the one record and said once, by rank 0, where recovery in place
    is on. A later reason is neither kept nor said."""
    from types import SimpleNamespace

    from deepspeed.runtime.pipe.engine import PipelineEngine

    from baft.config import GENERATION_ENV, STORE_ENV
    from baft.pipeline import engine as baft_engine
    from baft.script.loop import Loop

    loop = Loop()
    monkeypatch.setattr(baft_engine, "THIS_PROCESS", loop)
    monkeypatch.setenv(STORE_ENV, "127.0.0.1:1")
    monkeypatch.setenv(GENERATION_ENV, "0")
    sizes = []
    monkeypatch.setattr(PipelineEngine, "set_train_batch_size", lambda self, size: sizes.append(size))
    # no DeepSpeed engine: the override alone
    engine = baft_engine.BaftPipelineEngine.__new__(baft_engine.BaftPipelineEngine)
    engine.global_rank, engine.baft, engine.train_batch_size = 0, SimpleNamespace(data_position=None), lambda: 8
    engine.set_train_batch_size(8)  # the size it has: nothing to say
    assert (loop.not_in_place, capsys.readouterr().err) == ("", "")
    engine.set_train_batch_size(16)
    engine.set_train_batch_size(32)
    loop.no_survivors(engine, "a later reason", "Not said")
    said = capsys.readouterr().err
    why = ("the script changed the engine's batch size (set_train_batch_size): a survivor's new engine would train "
           "the steps since the restored one at the configured size")
    assert loop.not_in_place == why and sizes == [8, 16, 32]
    assert said.count(f"baft: on a fault every rank is replaced, not only the killed one: {why}. ") == 1, said
    assert "later" not in said


@pytest.mark.slow
def test_a_loop_that_sets_state_baft_does_not_keep_has_every_rank_replaced_in_place(tmp_path):
    """tests/scripts/curriculum.py sets its data's difficulty before each step (after a warm-up loop too), or gives
    each call a new iterator: a survivor trained step 4 again, inside its call for step 5, at step 5's difficulty or
    from step 5's iterator, silently. Every rank is replaced instead, as said at start."""
    script = Path(__file__).parent / "scripts" / "curriculum.py"
    fault = ["--in-place", "--fault", "rank=1,step=5,phase=backward"]
    runs = {}
    for name, extra, shape in (("reference", [], "attribute"), ("attribute", fault, "attribute"),
                               ("warm-up", fault, "warm-up"), ("per-call", fault, "per-call")):
        proc = subprocess.run([sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", "1",
                               "--run-dir", str(tmp_path / name), *extra, "--", str(script), shape],
                              capture_output=True, text=True, env=launch_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (tmp_path / name / "output.log").read_text()
    printed = {name: dict(re.findall(r"^\[0\] step (\d+) loss (\S+)$", log, re.M)) for name, log in runs.items()}
    assert len(printed["reference"]) == 8
    why = {"attribute": r"its loop sets \S+curriculum.py:\d+ \(data.active = min\(8, 2 \+ engine.global_steps\)\) "
                        r"between its calls to train_batch, which baft does not keep",
           "per-call": r"train_batch reads another iterator than at its last call \(one made for each call\?\)"}
    why["warm-up"] = why["attribute"]  # the second loop's, read at its first call (the first loop's alone, before)
    for name in ("attribute", "warm-up", "per-call"):
        assert printed[name] == printed["reference"], name
        said = re.findall(rf"^\[0\] baft: on a fault every rank is replaced, not only the killed one: {why[name]}",
                          runs[name], re.M)
        assert len(said) == 1, (name, said)
        record = json.loads((tmp_path / name / "recovery.jsonl").read_text())
        assert (record["kind"], record["restored_step"]) == ("in place", 3), name
        assert re.search(rf"rank 0 lost a peer and cannot recover in place \({why[name]}", runs[name]), name


def test_a_loop_that_stops_while_it_replays_its_calls_fails_the_process_saying_why():
    """Probe 8: an early stop counting evaluations without improvement in its client_state read the restored step's
    best loss during the replay, stopped at replayed call 4 of 9 and ended 0, the run five steps short. Ending
    there is an error now; having replayed them all, or not counting its calls, is no error."""
    from baft.script.loop import Loop

    def left(counts: bool, calls: int) -> str:
        loop = Loop()
        loop.counts_calls, loop.to_replay, loop.calls = counts, 9, calls
        return loop.left_in_replay()

    assert left(True, 9) == left(False, 4) == left(True, 0) == ""
    why = left(True, 4)
    assert why == ("the loop stopped at its call 4 of the 9 it replayed up to the restored step: its code between the "
                   "calls read what the restore had set (a count in client_state?), not what it was at that call, so "
                   "the run would end short of the uninterrupted one. Loop on the engine's step (while "
                   "engine.global_steps < N), which replays nothing")
    ending = ("import atexit\nfrom baft.script.loop import THIS_PROCESS\nfrom baft.plugin import _not_mid_replay\n"
              "atexit.register(_not_mid_replay)\nTHIS_PROCESS.counts_calls, THIS_PROCESS.to_replay, THIS_PROCESS.calls"
              " = True, 9, 4\nprint('the script ends')\n")
    done = subprocess.run([sys.executable, "-c", ending], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "the script ends" in done.stdout, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("baft: error:")] == [f"baft: error: {why}"]


def test_a_replay_says_the_generators_its_loop_drew_from_otherwise_than_the_uninterrupted_run_and_no_others():
    """Probe 22: minGPT's callback samples from torch's generator every few steps, which dropout draws from too.
    Resumed at a step after which the loop drew nothing, the replay's samples at the earlier steps came from the
    generator as the script had seeded it, not as the uninterrupted run's training had left it, and nothing said so (it
    was said only where the loop drew after the restored step too). A draw the replay makes as the uninterrupted run
    did is not said: python's, which the training leaves alone; torch's where the loop seeds it from the step before
    each call (said at every resume where the replay's end was compared with the states the restored step's dropout
    left, h26); nor a generator the replay does not draw from, nor the draws before the first call, made as then."""
    import random

    from baft.script.rng import rng_states
    from baft.snapshot.resumed_iteration import RngRestore
    from baft.snapshot.state import capture_rng

    def said(before, restored: int) -> list[str]:
        """What the replay of ``restored`` calls says, of a loop that runs ``before(step)`` before each call, under
        dropout: the uninterrupted run's snapshot of that step taken as the policy takes it (its iteration's start,
        its end, the next one's start), then the replay."""
        random.seed(0)
        torch.manual_seed(0)
        for step in range(restored):
            before(step)
            start = rng_states()
            torch.rand(3)  # the training's dropout
            end = rng_states()
        before(restored)
        items = capture_rng(end, start)
        restore = RngRestore(items["rng"], items.get("rng_between"), started=items.get("rng_started"))
        random.seed(0)
        torch.manual_seed(0)
        for step in range(restored):
            before(step)
            if step == 0:
                restore.replay_started()
        return restore.between_steps(replayed=True)

    def sample(step):  # minGPT's, with python's draw of a learning-rate jitter
        random.random()
        if step % 3 == 0:
            torch.multinomial(torch.ones(8), 2)

    def seeded(step):
        torch.manual_seed(step)
        torch.rand(())  # after its seed: as then

    assert said(sample, 4) == ["torch"]  # drew at step 3, after the training's draws of steps 1-3 the replay misses
    assert said(sample, 5) == ["torch"]  # and after the restored step too
    assert said(sample, 3) == []  # drew before the first call alone, as then
    assert said(torch.manual_seed, 4) == []
    assert said(seeded, 4) == []
    assert said(lambda step: None, 4) == []
