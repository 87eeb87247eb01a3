"""The scores of a model's build, and the training loss over a batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.builds import Build
from ikbo_jax.models.ranker import Ranker


def scores(model: Ranker, batch: RankingBatch, build: Build) -> jax.Array:
  """The click logits of `batch` under `build`."""
  return model(batch) if Build.parse(build) is Build.IKBO else model.standard(batch)


def masked_loss(logits: jax.Array, batch: RankingBatch) -> jax.Array:
  """Mean binary cross-entropy over the real candidates of `batch`."""
  total, count = masked_loss_terms(logits, batch)
  return total / jnp.maximum(count, 1)


@jax.named_scope("loss")
def masked_loss_terms(logits: jax.Array, batch: RankingBatch) -> tuple[jax.Array, jax.Array]:
  """The summed binary cross-entropy over the real candidates of `batch`, and their count."""
  mask = batch.candidate_mask()
  losses = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
  return jnp.sum(jnp.where(mask, losses, 0)), jnp.sum(mask)
