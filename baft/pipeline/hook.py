"""What a hook of a protected engine hears: callbacks around each instruction of ``train_batch``
(:mod:`baft.pipeline.hooks` calls them). Importing this module loads neither torch nor DeepSpeed."""

from __future__ import annotations

import threading
from typing import Callable, Optional


class InstructionHook:
    """Callbacks around one ``train_batch``. All methods are optional no-ops."""

    def iteration_start(self, engine) -> None: ...

    def before(self, engine, index: int, cmd) -> None: ...

    def after(self, engine, index: int, cmd) -> None: ...

    def iteration_end(self, engine) -> None: ...

    def close(self) -> None:
        """Stop any work still running and release resources (at process exit)."""

    def bubble(self, engine, index: int, cmd) -> Optional[Callable[[threading.Event], None]]:
        """Work to run while this receive (or the optimizer step's collective) waits: called with an event
        set when the data has landed."""
        return None

    def waited(self, engine, index: int, seconds: float) -> None:
        """The optimizer step at ``index`` waited ``seconds`` in its collectives for the other stages."""
