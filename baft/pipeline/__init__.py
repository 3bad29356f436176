"""The pipeline and its bubbles: where each stage idles, measured and computed.

- ``hook``       what a hook hears around each instruction (no torch, no DeepSpeed)
- ``engine``     baft's engine: DeepSpeed's pipeline loop through an instruction map that calls
                 the hooks and runs their work inside the bubbles
- ``schedules``  GPipe and 1F1B as instruction generators (1F1B is DeepSpeed's own)
- ``timeline``   the analytic timeline: a schedule as a DAG, its bubbles from per-op costs
- ``profiler``   the measured timeline: every instruction timed on a real run
- ``merge``      every rank's timings merged into one bubble map, beside the analytic one
- ``bubblemap``  the bubble-map file both of them write

What baft reads and keeps of the script's own training loop is ``baft.script``'s.

Imports nothing of baft but the base modules and ``baft.script``.
"""
