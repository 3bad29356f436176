"""baft: bubble-aware fault tolerance for pipeline-parallel training on DeepSpeed."""

__version__ = "0.1.0"
