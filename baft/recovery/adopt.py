"""Adoption: a job that already checkpoints with DeepSpeed starts under baft from its newest checkpoint.

On the first start under baft (no snapshot of the run anywhere), ``baft.adopt`` names the
job's DeepSpeed checkpoint directory; :func:`adopt` loads its newest checkpoint with
DeepSpeed's own ``load_checkpoint`` (weights, fp32 masters, optimizer state, LR scheduler,
step counters), and baft snapshots from there on. Once baft has snapshots, a restart
resumes from them, never again from the adopted checkpoint.

A checkpoint written by baft's ``deepspeed`` policy carries the small items too (RNG, data
position) and continues bit for bit. One written by another script does not: the RNG and
the data position are then the script's to restore, and baft says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from baft.errors import BaftError
from baft.recovery.record import Restored
from baft.snapshot import state
from baft.snapshot.baselines import ITEMS_KEY, own_items


def adopt(engine, directory: str, data_iterator=None, log: Callable[[str], None] = print) -> Restored:
    """Load the newest DeepSpeed checkpoint in ``directory`` into ``engine``; what was restored.

    A directory without a checkpoint is an error: the job asked to continue from it, and
    training from step 0 instead would drop its progress without a word.
    """
    if not (Path(directory) / "latest").is_file():
        raise BaftError(f"baft.adopt: {directory} holds no DeepSpeed checkpoint (no 'latest' file); name the "
                        f"directory given to save_checkpoint, or remove the key to start from step 0")
    try:
        path, client_state = engine.load_checkpoint(directory)
    except Exception as err:  # DeepSpeed's own loader: its failure is the user's to see, in one line
        raise BaftError(f"baft.adopt: DeepSpeed's load_checkpoint failed on {directory} ({type(err).__name__}: "
                        f"{err}); with bf16 and ZeRO stage 0, DeepSpeed 0.19 cannot load its own checkpoints "
                        f"(deepspeedai/DeepSpeed#7786)") from err
    if path is None:
        raise BaftError(f"baft.adopt: DeepSpeed could not load the checkpoint in {directory}")
    saved = (client_state or {}).get(ITEMS_KEY)
    rng = None
    if saved is not None:
        rng = state.restore_items(engine, own_items(engine, saved), data_iterator)
    else:
        log(f"adopted {path}, written without baft: its weights, optimizer and scheduler are restored; the RNG "
            f"and the data position are the script's to restore (from its client_state)")
    return Restored(engine.global_steps, "disk", 1, rng=rng)
