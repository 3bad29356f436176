"""What-if at cluster scale: the timeline and planner driven by published hardware figures.

``python -m baft.simulate`` runs it. Imports ``pipeline`` and ``snapshot`` (the same
timeline and planner a measured run uses); nothing imports it but ``cli``.
"""
