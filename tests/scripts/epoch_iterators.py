"""A counting loop that takes a new iterator of its loader each epoch (``it = iter(loader)`` inside ``for epoch in
range(3)``), resumed inside an epoch and at an epoch's end by tests/test_epoch_iterators.py; or, with a third
argument ``repeating``, DeepSpeed's RepeatingLoader of the loader (it takes those iterators as each epoch ends) as the
data iterator, in a loop on the engine's step (``plain``: of torch's own DataLoader, not given to baft.initialize;
``plain-epochs``: the counting loop over such a loader; ``found``: over torchdata's, not given either (``found-shuffled``: shuffled by its own sampler);
``deepspeed-io``: of DeepSpeed's own, made by the engine
baft.initialize returned; ``plain-after``: a shuffled torch DataLoader made after baft.initialize, an iter() of it
each epoch, the loop drawing from torch's generator between its steps: its own steps); with ``generator``, each
epoch a generator of the script's over the loader (``for batch in loader: yield batch``); with ``forever``, one such
generator across epochs (``while True: for batch in loader: yield batch``) in a loop on the engine's step
(``forever-after-iter``: made after an ``iter()`` of the loader the script never reads). Arguments: the policy
(baft), the loader's workers (0), the loop. Either loop prints the same steps."""

import random
import sys

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import baft


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 20  # 5 steps an epoch: 2 micro-batches of 2

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, x.sin().sum(dim=0, keepdim=True)


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
random.seed(0)  # (the state digests compare every generator)
np.random.seed(0)
model = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 16, 1)],
                       num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
# torch's sampler, not torchdata's: each epoch's order drawn from a generator of its own, which no loader state holds
loader = StatefulDataLoader(Samples(), batch_size=2, drop_last=True,
                            sampler=torch.utils.data.RandomSampler(Samples(), generator=torch.Generator().manual_seed(3)),
                            num_workers=int(sys.argv[2]) if len(sys.argv) > 2 else 0,
                            generator=torch.Generator().manual_seed(4))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                       "warmup_num_steps": 12}},
          "baft": {"policy": sys.argv[1] if len(sys.argv) > 1 else "baft", "period": 1}}


def report(loss) -> None:
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} loss {float(loss)!r} lr {engine.get_lr()[0]!r}", flush=True)


if sys.argv[3:] in (["forever"], ["forever-after-iter"]):  # one generator of the script's across epochs, in a loop on the
    # engine's step; with forever-after-iter, made after an iter() of the loader the script keeps and never reads
    def forever():
        while True:
            for x, y in loader:
                yield x, y

    engine, *_ = baft.initialize(model=model, config=config, data_iterator=loader)
    unread = iter(loader) if sys.argv[3:] == ["forever-after-iter"] else None
    data = forever()
    while engine.global_steps < 3 * len(loader) // 2:
        report(engine.train_batch(data_iter=data))
elif sys.argv[3:] == ["repeating"]:
    data = RepeatingLoader(loader)  # its first iterator taken before baft.initialize restores the loader
    engine, *_ = baft.initialize(model=model, config=config, data_iterator=data)
    while engine.global_steps < 3 * len(loader) // 2:
        report(engine.train_batch(data_iter=data))
elif sys.argv[3:] == ["deepspeed-io"]:  # DeepSpeed's own loader over the same sampler: made after baft.initialize
    engine, *_ = baft.initialize(model=model, config=config)
    data = iter(RepeatingLoader(engine.deepspeed_io(Samples(), data_sampler=loader.sampler, pin_memory=False,
                                                    num_local_io_workers=loader.num_workers)))
    while engine.global_steps < 3 * len(loader) // 2:
        report(engine.train_batch(data_iter=data))
elif sys.argv[3:] == ["plain"]:  # torch's own loader over the same sampler, not given to baft.initialize
    plain = torch.utils.data.DataLoader(Samples(), batch_size=2, drop_last=True, sampler=loader.sampler,
                                        num_workers=loader.num_workers, generator=torch.Generator().manual_seed(4))
    data = iter(RepeatingLoader(plain))  # DeepSpeedExamples' shape
    engine, *_ = baft.initialize(model=model, config=config)
    while engine.global_steps < 3 * len(loader) // 2:
        report(engine.train_batch(data_iter=data))
elif sys.argv[3:] == ["plain-after"]:  # torch's own loader made after baft.initialize, its order drawn from torch's
    # generator, an iter() of it each epoch in a loop on the engine's step that draws from torch's between its steps
    engine, *_ = baft.initialize(model=model, config=config)
    plain = torch.utils.data.DataLoader(Samples(), batch_size=2, drop_last=True, shuffle=True,
                                        num_workers=loader.num_workers)
    batches = iter(plain)
    while engine.global_steps < 3 * len(loader) // 2:
        if engine.global_steps and engine.global_steps % (len(plain) // 2) == 0:
            batches = iter(plain)
        noise = torch.rand(1)
        report(engine.train_batch(data_iter=batches))
else:
    def generator():  # with ``generator``: a generator of the script's over the loader, its iter() at the first read
        for x, y in loader:
            yield x, y

    if sys.argv[3:] == ["plain-epochs"]:  # torch's own loader over the same sampler, not given to baft.initialize
        loader = torch.utils.data.DataLoader(Samples(), batch_size=2, drop_last=True, sampler=loader.sampler,
                                             num_workers=loader.num_workers, generator=torch.Generator().manual_seed(4))
        engine, *_ = baft.initialize(model=model, config=config)
    elif sys.argv[3:] == ["found"]:  # torchdata's loader, not given to baft.initialize: found as the loop first reads
        engine, *_ = baft.initialize(model=model, config=config)
    elif sys.argv[3:] == ["found-shuffled"]:  # so, shuffled by torchdata's own sampler (which keeps its state)
        loader = StatefulDataLoader(Samples(), batch_size=2, drop_last=True, shuffle=True, num_workers=loader.num_workers,
                                    generator=torch.Generator().manual_seed(3))
        engine, *_ = baft.initialize(model=model, config=config)
    else:
        engine, *_ = baft.initialize(model=model, config=config, data_iterator=loader)
    for epoch in range(3):
        batches = generator() if sys.argv[3:] == ["generator"] else iter(loader)
        for _ in range(len(loader) // 2):
            report(engine.train_batch(data_iter=batches))
