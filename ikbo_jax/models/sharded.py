"""The ranker data-parallel over a mesh axis: each device scores whole users with their candidates.

A `RankingBatch` is split by request with `ikbo_jax.sharding.plan_shards` into
`num_shards` equal blocks along every leading axis, each block a complete batch
with its own mapping. Under `jax.shard_map` over the data axis each device
runs the IKBO build (its kernels included) on its block: the forward needs no
collective, and training adds only the all-reduce of the loss and of the
gradients of the replicated parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.sharding import ShardPlan, plan_shards
from ikbo_jax.models.scoring import masked_loss_terms


@dataclasses.dataclass(frozen=True)
class ShardedBatch:
  """A batch in the shard layout, and how to bring its scores back.

  Attributes:
    batch: `num_shards` blocks of `plan.users_per_shard` users and
      `plan.candidates_per_shard` candidates, each block a batch of its own.
    plan: where every user and candidate went (the source batch's padding
      candidates are left out).
  """

  batch: RankingBatch
  plan: ShardPlan

  def restore(self, scores) -> np.ndarray:
    """`scores` in the shard layout -> the source batch's real candidates' scores, in order."""
    return self.plan.restore(scores)


def shard_batch(batch: RankingBatch, num_shards: int, *, users_per_shard: int | None = None,
                candidates_per_shard: int | None = None) -> ShardedBatch:
  """Splits `batch` by user over `num_shards` blocks, balancing candidates (`plan_shards`)."""
  real = np.flatnonzero(np.asarray(batch.candidate_mask()))
  plan = plan_shards(np.asarray(batch.cand_to_user)[real], batch.num_users, num_shards,
                     users_per_shard=users_per_shard,
                     candidates_per_shard=candidates_per_shard)
  cands = lambda x: plan.candidates(np.asarray(x)[real])
  sharded = RankingBatch(
      user_dense=plan.users(batch.user_dense), history=plan.users(batch.history),
      history_len=plan.users(batch.history_len), cand_to_user=plan.local_cand_to_user,
      cand_items=cands(batch.cand_items), cand_dense=cands(batch.cand_dense),
      labels=cands(batch.labels))
  return ShardedBatch(sharded, plan)


def place(batch: RankingBatch, mesh: Mesh, axis: str = "data") -> RankingBatch:
  """Puts each block of a sharded batch on its device along `axis` of `mesh`."""
  return jax.device_put(batch, NamedSharding(mesh, P(axis)))


def sharded_scores(graphdef: nnx.GraphDef, mesh: Mesh, axis: str = "data"):
  """`f(state, batch) -> logits` of the IKBO build, one shard of `batch` per device of `axis`.

  `state` (from `nnx.split(model)`) is replicated; `batch` is in the shard layout.
  """
  def per_shard(state, batch):
    return nnx.merge(graphdef, state)(batch)

  return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(axis)),
                               out_specs=P(axis)))


def sharded_loss(graphdef: nnx.GraphDef, mesh: Mesh, axis: str = "data"):
  """`f(state, batch) -> loss`: mean cross-entropy over every shard's real candidates.

  Each shard sums its losses and counts its candidates; one all-reduce of the two
  gives the batch mean, so the gradient is that of the unsharded loss.
  """
  def per_shard(state, batch):
    total, count = masked_loss_terms(nnx.merge(graphdef, state)(batch), batch)
    return jax.lax.psum(total, axis), jax.lax.psum(count, axis)

  terms = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P()))

  def loss(state, batch):
    total, count = terms(state, batch)
    return total / jnp.maximum(count, 1)

  return loss

