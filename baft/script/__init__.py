"""Your script's own training loop: what baft reads of it and keeps with every snapshot, so a resumed run goes on as
the uninterrupted one did.

- ``loop``         a loop that counts its calls to ``train_batch``: replayed after a restore, kept in step in place
- ``loop_source``  the loops around a call to ``train_batch``, read from the script's source
- ``history``      what such a loop's calls returned at each step, saved with every snapshot
- ``carry``        the values of its own a loop on the engine's step carries from one iteration to the next
- ``rng``          every random generator a step draws from: its state, and as JSON
- ``schedulers``   the learning-rate schedulers a script makes on the engine's optimizer itself

The bottom layer: imports nothing of baft but the base modules (``errors``, ``jsonfile``, ``config``).
"""
