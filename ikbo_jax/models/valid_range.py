"""The dense features a `Ranker` can take without its arithmetic overflowing.

Features of 1e19 used to be scored: the tower's first LayerNorm squares activations of
about that size, the squares overflow float32 (and bfloat16, whose range is the same), the
normalized values collapse to zero, and every logit came out the same (every score 0.5).
No answer computed that way is the model's, so inputs that can reach it are refused.

The bound follows a dense feature through the linear maps between it and the squares,
each bounded by its largest absolute row sum (the norm of a map on the largest entry):
the feature's linear layer (`user_dense`, `cand_dense`), the compression weights of its
tokens, the tower's first layer. The LayerNorm after it sums `fan_out` squares; they stay
below a quarter of the dtype's largest value when every activation is at most
`sqrt(max / (4 fan_out))`. Half of that is left to the other inputs of those layers (item
embeddings, the history's attention, biases), which no dense feature scales. The bound is
sound (every feature within it keeps every square finite), not tight: at the small preset's
initialization it is about 3e15 (9e12 at the benchmark preset's), while the model first
fails near 1e19.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ikbo_jax.models.ranker import Ranker


def _row_norm(kernel) -> float:
  """max over outputs of the summed |weights| into it (`kernel` is `[in, out]`)."""
  return float(np.abs(np.asarray(kernel, np.float64)).sum(axis=0).max())


def max_abs_dense_feature(model: Ranker) -> float:
  """The largest `|x|` of a `user_dense` or `cand_dense` entry the model computes soundly."""
  c = model.config
  tower_in = model.tower.layers[0]
  fan_out = tower_in.kernel[...].shape[1]
  largest = float(jnp.finfo(c.dtype).max)  # NumPy's finfo knows no bfloat16
  room = 0.5 * np.sqrt(largest / (4 * fan_out))
  # The tokens' columns in the compression weights ([M, K]): the user's dense tokens come
  # first; a candidate's follow its item embedding.
  w_user = np.asarray(model.compress.w_user[...], np.float64)[:, :c.user_dense_tokens]
  w_cand = np.asarray(model.compress.w_cand[...], np.float64)[:, 1:1 + c.cand_dense_tokens]
  gain = (_row_norm(model.user_dense.kernel[...]) * np.abs(w_user).sum(axis=1).max()
          + _row_norm(model.cand_dense.kernel[...]) * np.abs(w_cand).sum(axis=1).max())
  return float(room / (gain * _row_norm(tower_in.kernel[...])))
