"""The pipeline and its bubbles: where each stage idles, measured and computed.

- ``hooks``      engine hooks around every instruction of DeepSpeed's pipeline loop
- ``schedules``  GPipe and 1F1B as instruction generators (1F1B is DeepSpeed's own)
- ``timeline``   the analytic timeline: a schedule as a DAG, its bubbles from per-op costs
- ``profiler``   the measured timeline: every instruction timed on a real run, merged
- ``bubblemap``  the bubble-map file both of them write

The bottom layer: imports nothing of baft but ``errors`` and ``jsonfile``.
"""
