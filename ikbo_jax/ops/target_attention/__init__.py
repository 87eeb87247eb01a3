"""Target attention: one folder, one op.

- `api.py`: the public `target_attention`, its validation and dispatch;
- `xla.py`: the XLA implementations (the semantics every kernel is tested against);
- `params.py`: the static parameters of a call, one frozen record;
- `vjp.py`: the kernel paths' `custom_vjp`, wired once over a backend's forward and backward;
- `triton.py`, `mosaic_gpu.py`: the kernel backends, each declaring what it supports.
"""

from ikbo_jax.ops.target_attention.api import (
    BACKENDS, IMPLEMENTATIONS, Implementation, check_args, default_implementation, prepare_kv_len,
    target_attention)

__all__ = ["BACKENDS", "IMPLEMENTATIONS", "Implementation", "check_args",
           "default_implementation", "prepare_kv_len", "target_attention"]
