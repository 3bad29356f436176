"""Options and error handling the ``baft`` commands share."""

from __future__ import annotations

import functools
import sys

import click

from baft.config import EXECUTORS, LEFTOVERS
from baft.errors import BaftError

EXAMPLE_OPTIONS = [
    click.option("--stages", default=2, show_default=True, help="Pipeline stages (processes per replica)."),
    click.option("--data-parallel", "dp", default=1, show_default=True, help="Data-parallel replicas of every stage."),
    click.option("--micro-batches", default=8, show_default=True, help="Micro-batches per iteration."),
    click.option("--micro-batch-size", default=2, show_default=True, help="Sequences per micro-batch."),
    click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(["1f1b", "gpipe"])),
    click.option("--seq", default=128, show_default=True, help="Tokens per sequence."),
    click.option("--d-model", default=384, show_default=True),
    click.option("--layers", default=8, show_default=True),
    click.option("--heads", default=6, show_default=True),
    click.option("--vocab", default=4096, show_default=True),
    click.option("--precision", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]),
                 help="bf16: DeepSpeed's bf16 mode (bf16 weights, fp32 master weights and Adam moments); "
                      "fp16 needs a GPU."),
    click.option("--partition", default="compute", show_default=True, type=click.Choice(["compute", "parameters"]),
                 help="Balance the stages by estimated compute or by parameter count."),
    click.option("--zero-stage", default=0, show_default=True, type=click.IntRange(0, 1),
                 help="ZeRO stage 1 partitions the optimizer state over data-parallel replicas."),
]


def example_options(fn):
    for option in reversed(EXAMPLE_OPTIONS):
        fn = option(fn)
    return fn


EXECUTOR_OPTIONS = [
    click.option("--executor", default="auto", show_default=True, type=click.Choice(EXECUTORS),
                 help="How baft copies in a bubble (the example's baft.executor)."),
    click.option("--leftovers", default="fence", show_default=True, type=click.Choice(LEFTOVERS),
                 help="Stream executor: queue the chunks no bubble holds at the fence before the optimizer "
                      "step, or at the iteration's start, beside the compute (baft.leftovers)."),
]


def executor_options(fn):
    for option in reversed(EXECUTOR_OPTIONS):
        fn = option(fn)
    return fn


def user_errors(fn):
    """Print a BaftError as one line and exit 2, instead of a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaftError as err:
            click.echo(f"baft: error: {err}", err=True)
            sys.exit(2)
    return wrapper
