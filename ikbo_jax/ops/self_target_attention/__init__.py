"""Self + target attention: one folder, one op (`api.py` the public op, `xla.py`, `mosaic_gpu.py`)."""

from ikbo_jax.ops.self_target_attention.api import (
    BACKENDS, IMPLEMENTATIONS, Implementation, default_implementation, self_target_attention)

__all__ = ["BACKENDS", "IMPLEMENTATIONS", "Implementation", "default_implementation",
           "self_target_attention"]
