"""The ``baft`` command and what it prints and draws.

- ``main``     the command: profile, show, plan, train, manager, inspect, report, simulate, compare, demo
- ``show``     bubble maps and plans as tables and timelines
- ``report``   where the time of every recovery went, as a table and a bar chart
- ``compare``  snapshot policies measured side by side on one engine
- ``launch``   starting ranks through torchrun
- ``machine``  which machine a measurement ran on

The top layer: may import everything; nothing imports it but experiments.
"""
