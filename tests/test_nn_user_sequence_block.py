import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.nn import UserSequenceBlock
from ikbo_jax.testing.problems import random_index, rel_err


@pytest.mark.parametrize("causal", [False, True])
def test_parity_with_two_multi_head_attentions_on_the_materialized_broadcast(causal):
  rng = np.random.default_rng(0)
  index = random_index(rng, num_users=3, num_candidates=7, empty_users=1)
  block = UserSequenceBlock(num_heads=2, user_features=6, cand_features=12, qkv_features=16,
                            out_features=10, causal=causal, rngs=nnx.Rngs(0))
  mha = lambda in_features, seed: nnx.MultiHeadAttention(
      num_heads=2, in_features=in_features, qkv_features=16, out_features=10, in_kv_features=6,
      decode=False, rngs=nnx.Rngs(seed))
  self_mha, target_mha = mha(6, 1), mha(12, 2)
  # The same weights, the key/value projections shared by both attentions.
  for target, query, out in ((self_mha, block.user_query, block.user_out),
                             (target_mha, block.cand_query, block.cand_out)):
    for name, source in (("query", query), ("key", block.key), ("value", block.value),
                         ("out", out)):
      nnx.update(getattr(target, name), nnx.state(source))
  keys = jax.random.split(jax.random.key(2), 2)
  user_seq = jax.random.normal(keys[0], (3, 9, 6))
  cand_tokens = jax.random.normal(keys[1], (7, 5, 12))
  kv_len = jnp.array([9, 2, 6])
  new_seq, cand_repr = block(user_seq, cand_tokens, index, kv_len=kv_len)

  pos = jnp.arange(9)
  valid_key = pos[None, :] < kv_len[:, None]
  self_mask = valid_key[:, None, None, :] & valid_key[:, None, :, None]
  if causal:
    self_mask &= pos[None, :] <= pos[:, None]
  ref_seq = self_mha(user_seq, mask=self_mask)
  # MultiHeadAttention's padded query rows attend to nothing; the block defines
  # them as zero attention output, i.e. the output projection's bias alone.
  ref_seq = jnp.where(valid_key[..., None], ref_seq, block.user_out.bias[...])
  ids = index.cand_to_user
  ref_cand = target_mha(cand_tokens, user_seq[ids],  # the copy models make today
                        mask=valid_key[ids][:, None, None, :])
  assert new_seq.shape == (3, 9, 10) and cand_repr.shape == (7, 5, 10)
  assert rel_err(new_seq, ref_seq) < 1e-5
  assert rel_err(cand_repr, ref_cand) < 1e-5


def test_gradients_reach_every_projection():
  index = random_index(np.random.default_rng(1), num_users=2, num_candidates=3)
  block = UserSequenceBlock(num_heads=2, user_features=8, rngs=nnx.Rngs(0))
  seq = jax.random.normal(jax.random.key(0), (2, 4, 8))
  cands = jax.random.normal(jax.random.key(1), (3, 2, 8))

  def loss(m):
    new_seq, cand_repr = m(seq, cands, index)
    return jnp.sum(new_seq ** 2) + jnp.sum(cand_repr ** 2)

  grads = nnx.grad(loss)(block)
  for name in ("user_query", "cand_query", "key", "value", "user_out", "cand_out"):
    assert float(jnp.abs(grads[name]["kernel"][...]).sum()) > 0, name
