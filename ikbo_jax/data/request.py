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
    cand_groups: `int[n]`, each candidate's group (ad group, campaign) as an
      index into `group_dense`: required by a model with a group level
      (`RankerConfig.group_dense > 0`), refused by one without.
    group_dense: `float[g, group_dense]`, the request's groups' features,
      `1 <= g <= n`; a group may have no candidates.
  """

  user_dense: np.ndarray
  history: np.ndarray
  cand_items: np.ndarray
  cand_dense: np.ndarray
  labels: np.ndarray | None = None
  cand_groups: np.ndarray | None = None
  group_dense: np.ndarray | None = None

  @functools.cached_property  # asked several times per request on the serving path
  def num_candidates(self) -> int:
    return int(np.shape(self.cand_items)[0]) if np.ndim(self.cand_items) == 1 else 0

  @property
  def num_groups(self) -> int:
    """The request's groups (0 without a group level)."""
    return 0 if self.group_dense is None or np.ndim(self.group_dense) < 1 else int(
        np.shape(self.group_dense)[0])

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
    cand_groups, group_dense = self._validated_groups(config, n)
    return Request(user_dense, history, cand_items, cand_dense, labels, cand_groups,
                   group_dense)

  def _validated_groups(self, config: RankerConfig, n: int):
    if not config.has_groups:
      if self.cand_groups is not None or self.group_dense is not None:
        raise RequestError("cand_groups and group_dense must be absent: the model has no group "
                           "level (RankerConfig.group_dense=0)")
      return None, None
    for name in ("cand_groups", "group_dense"):
      if getattr(self, name) is None:
        raise RequestError(f"{name} is missing: the model has a group level "
                           f"(group_dense={config.group_dense})")
    dense = _array("group_dense", self.group_dense)
    g = dense.shape[0] if dense.ndim == 2 else -1
    if not 1 <= g <= n:
      raise RequestError(f"group_dense must have shape [g, {config.group_dense}] with 1 <= g <= "
                         f"{n} (the candidates), got {dense.shape}")
    group_dense = _floats("group_dense", dense, (g, config.group_dense))
    cand_groups = _array("cand_groups", self.cand_groups)
    if cand_groups.shape != (n,) or cand_groups.dtype.kind not in "iu":
      raise RequestError(f"cand_groups must be int[{n}] (one group per candidate), got "
                         f"{cand_groups.dtype}{list(cand_groups.shape)}")
    if cand_groups.min() < 0 or cand_groups.max() >= g:
      bad = (cand_groups < 0) | (cand_groups >= g)
      raise RequestError(f"cand_groups holds group indices {cand_groups[bad][:5].tolist()} out "
                         f"of range: they index group_dense's {g} rows")
    return cand_groups.astype(np.int32), group_dense


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
