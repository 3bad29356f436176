"""The pipeline and its bubbles: where each stage idles, measured and computed.

- ``hook``       what a hook hears around each instruction (no torch, no DeepSpeed)
- ``engine``     baft's engine: DeepSpeed's pipeline loop through an instruction map that calls
                 the hooks and runs their work inside the bubbles
- ``schedules``  GPipe and 1F1B as instruction generators (1F1B is DeepSpeed's own)
- ``timeline``   the analytic timeline: a schedule as a DAG, its bubbles from per-op costs
- ``profiler``   the measured timeline: every instruction timed on a real run
- ``merge``      every rank's timings merged into one bubble map, beside the analytic one
- ``bubblemap``  the bubble-map file both of them write

Beside the pipeline, what baft needs of the script's own training loop:

- ``loop``         a loop that counts its calls to ``train_batch``: replayed after a restore, kept in step in place
- ``loop_source``  the loops around a call to ``train_batch``, read from the script's source
- ``history``      what such a loop's calls returned at each step, saved with every snapshot
- ``carry``        the values of its own a loop on the engine's step carries from one iteration to the next
- ``rng``          every random generator a step draws from: its state, and as JSON
- ``schedulers``   the learning-rate schedulers a script makes on the engine's optimizer itself

The bottom layer: imports nothing of baft but the base modules (``errors``, ``jsonfile``,
``accelerator``, ``background``).
"""
