"""`Ranker`: a reference CTR ranking model, one set of parameters run two ways.

`Ranker.__call__` is the IKBO build: everything computed from user inputs runs
once per user, at batch U, and the interaction layers (`ikbo_jax.nn`) read it
by index. `Ranker.standard` is the way ranking models are usually written:
the user inputs are copied to the candidate batch with `x[cand_to_user]`
first and every layer runs at batch B, on plain Flax layers and
`jax.nn.dot_product_attention` (through `ikbo_jax.ops.marked_attention`, the hook
by which `ikbo_jax.rewrite` can turn this build into the IKBO one). Both read the same parameters, so they give
the same scores and the same gradients; only the cost differs.

Each part runs under a named scope (`user_embeddings`, `candidate_embeddings`,
`group_embeddings`, `sequence`, `pooling`, `linear_compression`, `tower`) that
XLA keeps in its instructions' `op_name`: a profile says which part a kernel
serves, in either build and in the backward pass (`transpose(jvp(tower))`).

The model: item-id embeddings for the behaviour history and the candidates,
projected dense features on both sides, self-attention over the history
whose keys and values the candidates' query tokens also attend to
(`UserSequenceBlock`), a pooled history, linear compression of the stacked
user and candidate embeddings (`LinearCompression`) and an MLP tower to one
click logit per candidate. With a group level (`RankerConfig.group_dense > 0`),
each candidate belongs to a group of its request (an ad group, a campaign): the
group's projected features join the stack between the user's and the
candidate's, computed once per group (`TwoLevelLinearCompression`) in the IKBO
build and copied to the candidates in the standard one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ikbo_jax.index import CandidateIndex
from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.config import RankerConfig
from ikbo_jax.nn import LinearCompression, TwoLevelLinearCompression, UserSequenceBlock
from ikbo_jax.ops.marked_attention import attention as marked_attention
from ikbo_jax.ops.target_attention import target_attention


@struct.dataclass
class UserState:
  """What scoring a user's candidates reads of the user: the output of `Ranker.user_state`.

  Attributes:
    keys: `[U, S, H, D]` the sequence block's keys over the history.
    values: `[U, S, H, D]` its values.
    history_len: `int32[U]` valid history lengths.
    e_user: `[U, K_user, N]` the user embeddings linear compression stacks.
  """

  keys: jax.Array
  values: jax.Array
  history_len: jax.Array
  e_user: jax.Array


class Ranker(nnx.Module):
  """One click logit per candidate from a `RankingBatch`.

  Args:
    config: the sizes.
    rngs: random number generators (parameter init).

  Example:

  >>> import numpy as np
  >>> from flax import nnx
  >>> from ikbo_jax.data import pack_requests
  >>> from ikbo_jax.data.synthetic import ClickGenerator
  >>> from ikbo_jax.models import Ranker, RankerConfig
  >>> config = RankerConfig()
  >>> model = Ranker(config, rngs=nnx.Rngs(0))
  >>> requests = ClickGenerator(config, seed=0).requests(3)
  >>> batch = pack_requests(requests, config, num_users=4, num_candidates=64)
  >>> scores = model(batch)           # IKBO build
  >>> scores.shape
  (64,)
  >>> bool(np.allclose(scores, model.standard(batch), atol=1e-4))  # same parameters
  True
  """

  def __init__(self, config: RankerConfig, *, rngs: nnx.Rngs):
    c, dtype = config, jnp.dtype(config.dtype)
    self.config = config
    self.items = nnx.Embed(c.num_items, c.embed_dim, dtype=dtype, rngs=rngs)
    linear = lambda i, o: nnx.Linear(i, o, dtype=dtype, rngs=rngs)
    self.user_dense = linear(c.user_dense, c.user_dense_tokens * c.embed_dim)
    self.cand_dense = linear(c.cand_dense, c.cand_dense_tokens * c.embed_dim)
    self.queries = linear(c.embed_dim, c.query_tokens * c.embed_dim)
    self.sequence = UserSequenceBlock(c.num_heads, c.embed_dim, causal=c.causal, dtype=dtype,
                                      rngs=rngs)
    if c.has_groups:
      self.group_dense = linear(c.group_dense, c.group_dense_tokens * c.embed_dim)
      self.compress = TwoLevelLinearCompression(c.user_tokens, c.group_tokens, c.cand_tokens,
                                                c.compressed, dtype=dtype, rngs=rngs)
    else:
      self.compress = LinearCompression(c.user_tokens, c.cand_tokens, c.compressed, dtype=dtype,
                                        rngs=rngs)
    sizes = (c.compressed * c.embed_dim, *c.tower)
    # Each hidden layer is normalized before its activation: Adam moves every weight of a
    # layer by about the learning rate at once, so a layer over the wide compressed input
    # (32768 features at the benchmark size) would shift its outputs by lr * |x|_1 per step
    # and the logits would blow up within a few steps.
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
      layers += [linear(fan_in, fan_out), nnx.LayerNorm(fan_out, dtype=dtype, rngs=rngs),
                 jax.nn.relu]
    self.tower = nnx.Sequential(*layers, linear(sizes[-1], 1))

  def __call__(self, batch: RankingBatch) -> jax.Array:
    """The IKBO build: `float32[B]` logits (meaningless at padding candidates)."""
    index = batch.index()
    seq, user_tokens = self._user_embeddings(batch.history, batch.user_dense)  # batch U
    item, cand_tokens, queries = self._candidate_embeddings(batch.cand_items, batch.cand_dense)
    with jax.named_scope("sequence"):
      new_seq, cand_repr = self.sequence(seq, queries, index, kv_len=batch.history_len)
    pooled = _masked_mean(seq + new_seq, batch.history_len)
    e_group = None
    if self.config.has_groups:
      _require_groups(batch)
      e_group = self._group_embeddings(batch.group_dense)  # batch G
    with jax.named_scope("linear_compression"):  # the stacks' copies are this part's cost
      e_user = jnp.concatenate([user_tokens, pooled[:, None]], axis=1)
      e_cand = jnp.concatenate([item[:, None], cand_tokens, cand_repr], axis=1)
      if e_group is None:
        compressed = self.compress(e_user, e_cand, index)
      else:
        compressed = self.compress(e_user, e_group, e_cand, batch.two_level_index())
    return self._logits(compressed)

  def user_state(self, history: jax.Array, user_dense: jax.Array,
                 history_len: jax.Array) -> UserState:
    """The user side alone: what scoring candidates reads of their users, at batch U.

    With `score_candidates`, the IKBO build in two parts, so that a user's
    state can be kept and read by later requests. The self-attention runs on
    its own here (the IKBO build fuses it with the candidates' attention), so
    the two parts match `__call__` to rounding, not bit for bit. A model with a
    group level has no such split yet: this raises a `ValueError`.
    """
    _no_group_level(self.config, "user_state")
    seq, user_tokens = self._user_embeddings(history, user_dense)
    k, v, pooled = self._self_attended(seq, history_len)
    return UserState(keys=k, values=v, history_len=history_len,
                     e_user=jnp.concatenate([user_tokens, pooled[:, None]], axis=1))

  def score_candidates(self, state: UserState, cand_items: jax.Array, cand_dense: jax.Array,
                       index: CandidateIndex) -> jax.Array:
    """The candidate side: `float32[B]` logits of candidates read against `state` by index.

    `index` maps each candidate to a row of `state` (`num_users` = its rows).
    A model with a group level raises a `ValueError` (see `user_state`).
    """
    _no_group_level(self.config, "score_candidates")
    item, cand_tokens, queries = self._candidate_embeddings(cand_items, cand_dense)
    block = self.sequence
    with jax.named_scope("sequence"):
      attended = block.cand_out(target_attention(block.cand_query(queries), state.keys,
                                                 state.values, index, kv_len=state.history_len))
    with jax.named_scope("linear_compression"):
      e_cand = jnp.concatenate([item[:, None], cand_tokens, attended], axis=1)
      compressed = self.compress(state.e_user, e_cand, index)
    return self._logits(compressed)

  def standard(self, batch: RankingBatch) -> jax.Array:
    """The standard build: user inputs copied to the candidate batch, then every layer at B."""
    ids = batch.index().clamped_cand_to_user
    copy = lambda user_input: jnp.take(user_input, ids, axis=0)  # `x[cand_to_user]`
    history_len = copy(batch.history_len)
    seq, user_tokens = self._user_embeddings(copy(batch.history), copy(batch.user_dense))
    item, cand_tokens, queries = self._candidate_embeddings(batch.cand_items, batch.cand_dense)
    k, v, pooled = self._self_attended(seq, history_len)
    block = self.sequence
    with jax.named_scope("sequence"):
      cand_repr = block.cand_out(_attention(block.cand_query(queries), k, v, history_len,
                                            causal=False))
    group_tokens, weights = [], [self.compress.w_user[...]]
    if self.config.has_groups:
      _require_groups(batch)
      group_ids = jnp.clip(batch.item_to_group, 0, batch.group_to_user.shape[0] - 1)
      group_tokens = [self._group_embeddings(jnp.take(batch.group_dense, group_ids, axis=0))]
      weights += [self.compress.w_group[...], self.compress.w_item[...]]
    else:
      weights.append(self.compress.w_cand[...])
    # `nnx.Linear(K_user [+ K_group] + K_cand -> M)` over the stacking axis, one joint weight.
    with jax.named_scope("linear_compression"):
      stack = jnp.concatenate([user_tokens, pooled[:, None], *group_tokens, item[:, None],
                               cand_tokens, cand_repr], axis=1)
      weight = jnp.concatenate(weights, axis=1)
      compressed = jnp.einsum("mk,bkn->bmn", weight.astype(stack.dtype), stack)
    return self._logits(compressed)

  @jax.named_scope("sequence")
  def _self_attended(self, seq, history_len):
    """The history's self-attention on its own: its keys, values and the pooled sequence."""
    block = self.sequence
    k, v = block.key(seq), block.value(seq)
    new_seq = block.user_out(_attention(block.user_query(seq), k, v, history_len,
                                        causal=self.config.causal))
    return k, v, _masked_mean(seq + new_seq, history_len)

  @jax.named_scope("user_embeddings")
  def _user_embeddings(self, history, user_dense):
    c = self.config
    tokens = self.user_dense(user_dense).reshape(-1, c.user_dense_tokens, c.embed_dim)
    return self.items(history), tokens

  @jax.named_scope("group_embeddings")
  def _group_embeddings(self, group_dense):
    c = self.config
    return self.group_dense(group_dense).reshape(-1, c.group_dense_tokens, c.embed_dim)

  @jax.named_scope("candidate_embeddings")
  def _candidate_embeddings(self, cand_items, cand_dense):
    c = self.config
    item = self.items(cand_items)
    tokens = self.cand_dense(cand_dense).reshape(-1, c.cand_dense_tokens, c.embed_dim)
    queries = self.queries(item).reshape(-1, c.query_tokens, c.embed_dim)
    return item, tokens, queries

  @jax.named_scope("tower")
  def _logits(self, compressed: jax.Array) -> jax.Array:
    return self.tower(compressed.reshape(compressed.shape[0], -1))[:, 0].astype(jnp.float32)


def _require_groups(batch: RankingBatch) -> None:
  if not batch.has_groups:
    raise ValueError("the model has a group level (RankerConfig.group_dense > 0) but the batch "
                     "has none: pack it with this config (item_to_group, group_to_user and "
                     "group_dense are None)")


def _no_group_level(config: RankerConfig, method: str) -> None:
  if config.has_groups:
    raise ValueError(f"Ranker.{method} splits the one-level model only; this model has a group "
                     f"level (group_dense={config.group_dense}): score whole batches with "
                     "Ranker.__call__")


@jax.named_scope("pooling")
def _masked_mean(x: jax.Array, length: jax.Array) -> jax.Array:
  """`x [N, S, D]` averaged over positions `< length[n]` (zeros where `length == 0`)."""
  valid = jnp.arange(x.shape[1])[None, :] < length[:, None]
  # A matrix-vector product per row, not a sum over the middle axis: on an H100, XLA fused
  # that sum (few rows, S long) into the stacking's concatenate and ran it at ~70 GB/s (0.12
  # ms for 8 MB at the benchmark size). The select keeps padding positions out whatever they
  # hold (0 * inf would not); the weights are exact, the sums float32 either way.
  total = jnp.einsum("ns,nsd->nd", valid.astype(x.dtype), jnp.where(valid[..., None], x, 0),
                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return (total / jnp.maximum(length, 1)[:, None]).astype(x.dtype)


def _attention(q, k, v, length, *, causal: bool):
  """`jax.nn.dot_product_attention` over keys `< length`; rows with no key are zero.

  On a GPU, in 16 bits, it runs on cuDNN's fused attention where cuDNN takes the
  shapes (even lengths, head size a multiple of 8 up to 256): the strongest
  attention the standard build can call. Elsewhere XLA's. It goes through
  `ikbo_jax.rewrite.attention`, which computes exactly that and lets the
  automatic rewrite recognize it.
  """
  head_dim, lengths = q.shape[-1], (q.shape[1], k.shape[1])
  cudnn = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
           and head_dim % 8 == 0 and head_dim <= 256 and all(n % 2 == 0 for n in lengths))
  return marked_attention(q, k, v, length, causal=causal,
                          implementation="cudnn" if cudnn else "xla").astype(q.dtype)
