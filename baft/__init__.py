"""baft: bubble-aware fault tolerance for pipeline-parallel training on DeepSpeed."""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize`` with baft attached; see :func:`baft.plugin.initialize`."""
    from baft.plugin import initialize as _initialize

    return _initialize(*args, **kwargs)
