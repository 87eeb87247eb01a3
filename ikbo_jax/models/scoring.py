"""The two builds of a model as one type, their scores, and the training loss over a batch."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import optax

from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.ranker import Ranker


class Build(enum.StrEnum):
  """Which forward pass of a `Ranker` runs (the parameters are the same).

  `IKBO` passes the mapping to the IKBO layers (user side at batch U);
  `STANDARD` copies the user inputs to the candidate batch first. A `StrEnum`,
  so `Build("ikbo")` parses a command line and a build prints as its name.
  """

  IKBO = "ikbo"
  STANDARD = "standard"

  @classmethod
  def parse(cls, value: str | Build) -> Build:
    """`value` as a `Build`, or a ValueError naming the choices."""
    try:
      return cls(value)
    except ValueError:
      raise ValueError(f"build must be one of {[b.value for b in cls]}, got {value!r}") from None


def scores(model: Ranker, batch: RankingBatch, build: Build) -> jax.Array:
  """The click logits of `batch` under `build`."""
  return model(batch) if Build.parse(build) is Build.IKBO else model.standard(batch)


def masked_loss(logits: jax.Array, batch: RankingBatch) -> jax.Array:
  """Mean binary cross-entropy over the real candidates of `batch`."""
  total, count = masked_loss_terms(logits, batch)
  return total / jnp.maximum(count, 1)


def masked_loss_terms(logits: jax.Array, batch: RankingBatch) -> tuple[jax.Array, jax.Array]:
  """The summed binary cross-entropy over the real candidates of `batch`, and their count."""
  mask = batch.candidate_mask()
  losses = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
  return jnp.sum(jnp.where(mask, losses, 0)), jnp.sum(mask)
