"""`Request`: one user and the candidates to score for it, validated against a model config."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ikbo_jax.models.config import RankerConfig


class RequestError(ValueError):
  """A request the model cannot score; the message names the field, the expected and the actual."""


@dataclasses.dataclass(frozen=True)
class Request:
  """One ranking request, host side (NumPy).

  Attributes:
    user_dense: `float[user_dense]` profile features.
    history: `int[L]` item ids of the behaviour history, most recent last, `L <= max_history`.
    cand_items: `int[n]` item ids of the candidates to score, `n >= 1`.
    cand_dense: `float[n, cand_dense]` candidate statistics.
    labels: optional `float[n]` clicks (training data).
  """

  user_dense: np.ndarray
  history: np.ndarray
  cand_items: np.ndarray
  cand_dense: np.ndarray
  labels: np.ndarray | None = None

  @functools.cached_property  # asked several times per request on the serving path
  def num_candidates(self) -> int:
    return int(np.shape(self.cand_items)[0]) if np.ndim(self.cand_items) == 1 else 0

  def validated(self, config: RankerConfig) -> Request:
    """This request with canonical dtypes, or a `RequestError` naming what is wrong."""
    user_dense = _floats("user_dense", self.user_dense, (config.user_dense,))
    history = _item_ids("history", self.history, config.num_items)
    if history.shape[0] > config.max_history:
      raise RequestError(f"history has {history.shape[0]} items; the model takes at most "
                         f"max_history={config.max_history}")
    cand_items = _item_ids("cand_items", self.cand_items, config.num_items)
    n = cand_items.shape[0]
    if n == 0:
      raise RequestError("cand_items is empty: a request needs at least one candidate")
    cand_dense = _floats("cand_dense", self.cand_dense, (n, config.cand_dense))
    labels = None if self.labels is None else _floats("labels", self.labels, (n,))
    return Request(user_dense, history, cand_items, cand_dense, labels)


def _array(name: str, value) -> np.ndarray:
  try:
    return np.asarray(value)
  except (TypeError, ValueError) as e:  # ragged nested lists
    raise RequestError(f"{name} is not a rectangular array: {e}") from None


def _floats(name: str, value, shape: tuple[int, ...]) -> np.ndarray:
  x = _array(name, value)
  if x.shape != shape:
    raise RequestError(f"{name} must have shape {shape}, got {x.shape}")
  if x.dtype.kind not in "fiu":  # floats and (unsigned) integers; not bool or complex
    raise RequestError(f"{name} must be numbers, got dtype {x.dtype}")
  x = x.astype(np.float32)
  if not np.isfinite(x).all():
    raise RequestError(f"{name} must be finite, got {int((~np.isfinite(x)).sum())} "
                       "non-finite values")
  return x


def _item_ids(name: str, value, num_items: int) -> np.ndarray:
  x = _array(name, value)
  if x.ndim != 1:
    raise RequestError(f"{name} must be a list of item ids (rank 1), got shape {x.shape}")
  if x.size == 0:
    return x.astype(np.int32)
  if x.dtype.kind not in "iu":
    raise RequestError(f"{name} must be integer item ids, got dtype {x.dtype}")
  if x.min() < 0 or x.max() >= num_items:
    bad = (x < 0) | (x >= num_items)
    raise RequestError(f"{name} holds unknown item ids {x[bad][:5].tolist()}: ids must lie in "
                       f"[0, num_items={num_items})")
  return x.astype(np.int32)
