"""The ``baft`` command and what it prints and draws.

- ``main``     the command: profile, show, plan, train, manager, inspect, report, simulate, compare
- ``train``    a run under baft on one node: managers, warm server, torchrun, what the run keeps at its end
- ``preflight`` what ``train`` checks of a script's launch before it starts anything
- ``runlog``   the ranks' output: into the run's log, onto the screen, and why a launch failed
- ``options``  the options and one-line error handling the commands share
- ``show``     bubble maps, plans and traced runs as tables
- ``figures``  the same as timelines (PNG): instructions, bubbles, copies, the stall
- ``report``   where the time of every recovery went, as a table and a bar chart
- ``compare``  launches :mod:`baft.benchmark` (snapshot policies side by side on one engine) and summarizes it
- ``demo``     the whole product on the example in one command
- ``launch``   starting ranks through torchrun, one launch per run directory
- ``torchrun`` torchrun as ``launch`` runs it, less three costs of its rendezvous at every restart
- ``text``     rich tables as plain text, for screens and log files alike

The top layer: may import everything; nothing imports it but experiments.
"""
