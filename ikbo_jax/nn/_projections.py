"""Parameter conventions shared by the modules: the default kernel init, multi-head projections."""

from __future__ import annotations

import functools
from typing import Callable

from flax import nnx
from flax.nnx.nn import initializers

default_kernel_init = initializers.lecun_normal()


def head_projections(num_heads: int, qkv_features: int, *, dtype, param_dtype,
                     kernel_init: nnx.Initializer, bias_init: nnx.Initializer, use_bias: bool,
                     rngs: nnx.Rngs) -> tuple[int, Callable, Callable]:
  """`(head_dim, to_heads, from_heads)`.

  `to_heads(in_features)` builds a projection `[..., in_features] -> [...,
  num_heads, head_dim]`; `from_heads(out_features)` one back from the heads.
  """
  if qkv_features % num_heads:
    raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                     f"({num_heads})")
  heads = (num_heads, qkv_features // num_heads)
  projection = functools.partial(
      nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
      bias_init=bias_init, use_bias=use_bias, rngs=rngs)
  return (heads[1], lambda in_features: projection(in_features, heads),
          lambda out_features: projection(heads, out_features, axis=(-2, -1)))
