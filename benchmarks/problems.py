"""Inputs and baselines the benchmark scripts share (public here, so no script imports another's)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common, shapes
from ikbo_jax import CandidateIndex
from ikbo_jax._padding import pad_to_multiple
from ikbo_jax.models import Ranker, RankerConfig, RankingBatch
from ikbo_jax.models.scoring import scores
from ikbo_jax.serving.precast import jit_hoisted
from ikbo_jax.training import trainer


def linear_compression_problem(num_candidates, num_users, m, n, k_user, k_cand, dtype, seed=0):
  """`([w_user, w_cand, e_user, e_cand], index)` with a random unsorted mapping."""
  rng = np.random.default_rng(seed)
  index = CandidateIndex.from_mapping(
      jnp.asarray(rng.integers(0, num_users, num_candidates), jnp.int32), num_users)
  keys = jax.random.split(jax.random.key(seed), 4)
  sizes = [(m, k_user), (m, k_cand), (num_users, k_user, n), (num_candidates, k_cand, n)]
  args = [jax.random.normal(k, s, jnp.float32).astype(dtype) * 0.05 for k, s in zip(keys, sizes)]
  return args, index


def pad_k(x):
  """Pads the stacking (K) axis to a multiple of 8, as an aligned upstream layout would be."""
  return pad_to_multiple(x, 1, 8)


def self_target_inputs(shape, seq_len, dtype):
  """`((q_user, q_cand, k, v), index, cotangents)`: uniform counts, shuffled mapping."""
  u, b, h, d, t = (shape[key] for key in ("num_users", "num_candidates", "heads", "head_dim",
                                          "n_seed"))
  keys = jax.random.split(jax.random.key(seq_len), 6)
  normal = lambda key, s: jax.random.normal(key, s, jnp.float32).astype(dtype)
  q_user, k, v = (normal(key, (u, seq_len, h, d)) for key in keys[:3])
  q_cand = normal(keys[3], (b, t, h, d))
  ids = np.random.default_rng(seq_len).permutation(np.repeat(np.arange(u), b // u))
  index = CandidateIndex.from_mapping(jnp.asarray(ids, jnp.int32), u)
  cotangents = (jax.random.normal(keys[4], q_user.shape), jax.random.normal(keys[5], q_cand.shape))
  return (q_user, q_cand, k, v), index, cotangents


def ranking_batch(config: RankerConfig, num_users: int, num_candidates: int,
                  seed: int = 0, items_per_group: int = 8) -> RankingBatch:
  """Users with histories of S/2..S items and candidates split evenly between them.

  With a group level, each user's candidates are split evenly into groups of
  about `items_per_group` (at least one group per user).
  """
  rng = np.random.default_rng(seed)
  s = config.max_history
  cand_to_user = np.sort(np.arange(num_candidates) % num_users).astype(np.int32)
  groups = {}
  if config.has_groups:
    per_user = max(1, round(num_candidates / num_users / items_per_group))
    counts = np.bincount(cand_to_user, minlength=num_users)
    rank = np.arange(num_candidates) - np.concatenate([[0], np.cumsum(counts)])[cand_to_user]
    groups = dict(
        item_to_group=(cand_to_user * per_user + rank * per_user // counts[cand_to_user]
                       ).astype(np.int32),
        group_to_user=np.repeat(np.arange(num_users), per_user).astype(np.int32),
        group_dense=rng.normal(size=(num_users * per_user, config.group_dense)
                               ).astype(np.float32))
  return RankingBatch(
      user_dense=rng.normal(size=(num_users, config.user_dense)).astype(np.float32),
      history=rng.integers(0, config.num_items, (num_users, s), dtype=np.int32),
      history_len=rng.integers(s // 2, s + 1, num_users, dtype=np.int32),
      cand_to_user=cand_to_user,
      cand_items=rng.integers(0, config.num_items, num_candidates, dtype=np.int32),
      cand_dense=rng.normal(size=(num_candidates, config.cand_dense)).astype(np.float32),
      labels=(rng.random(num_candidates) < 0.3).astype(np.float32), **groups)


def cudnn(q, k, v, causal=False):
  """cuDNN's fused attention through JAX: the strongest attention baseline."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def attention_sweep_parser(seq_lens, backward_seq_lens) -> argparse.ArgumentParser:
  """The command line shared by the attention sweeps."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="tiny shapes, any backend")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--seq-lens", type=int, nargs="*", default=seq_lens)
  parser.add_argument("--backward-seq-lens", type=int, nargs="*", default=backward_seq_lens)
  return parser


def attention_sweep_setup(small: bool):
  """`(on_gpu, dtype, shape, ceilings)`: bf16 at the published shape on a GPU, else float32."""
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  shape = shapes.ATTENTION_SMALL if small else shapes.ATTENTION
  return on_gpu, dtype, shape, common.measure_ceilings()


def functional_step(graphdef, build):
  """The trainer's step as a function of the state that returns the updated state.

  The timer jits what it measures; a step that returned only its loss would let
  XLA drop the backward pass and the update, whose results nothing would read.
  """
  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = trainer._train_step(model, optimizer, batch, build)
    return loss, nnx.state((model, optimizer))
  return step


def served_forward(model: Ranker, batch: RankingBatch, build: str = "ikbo"):
  """`(jitted, leaves)`: the forward as the server runs it, `jitted(leaves, batch)`.

  The parameters a program only reads cast are cast once, ahead of the calls
  (`ikbo_jax.serving.precast`), as the serving buckets hold them.
  """
  graphdef, state = nnx.split(model)
  return jit_hoisted(lambda state, batch: scores(nnx.merge(graphdef, state), batch, build),
                     state, batch)
