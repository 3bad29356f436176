"""Example models that baft can profile and train without a user script.

- ``gpt``     a small GPT as a DeepSpeed ``PipelineModule``, with its synthetic data
- ``worker``  one rank of ``baft train --example gpt`` (``python -m baft.examples.worker``): build, restore, train
"""
