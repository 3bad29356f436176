"""What-if at cluster scale: the timeline and planner driven by published hardware figures.

- ``scenario``  the input: :class:`~baft.simulate.scenario.Scenario` (a job and its hardware),
  its validation, the bundled presets, scenario files and ``--set`` overrides
- ``model``     the formulas: a scenario through the timeline and planner to each policy's
  period, overhead and time lost (``simulate_scenario``, ``run``)
- ``tables``    the result as rich tables and plain text (``render``)
- ``measured``  the model against a bubble map ``baft profile`` measured
- ``units``     seconds, bytes, counts and bandwidths as the notes and tables write them
- ``__main__``  ``python -m baft.simulate``

Imports ``pipeline`` and ``snapshot`` (the same timeline and planner a measured run uses);
nothing imports it but ``cli``.
"""
