import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ikbo_jax.nn import TargetAttention
from ikbo_jax.testing.problems import random_index, rel_err


def test_parity_with_multi_head_attention_on_the_materialized_broadcast():
  rng = np.random.default_rng(0)
  index = random_index(rng, num_users=3, num_candidates=7, empty_users=1)
  attn = TargetAttention(num_heads=2, user_features=6, cand_features=12, qkv_features=16,
                         out_features=10, rngs=nnx.Rngs(0))
  mha = nnx.MultiHeadAttention(num_heads=2, in_features=12, qkv_features=16, out_features=10,
                               in_kv_features=6, decode=False, rngs=nnx.Rngs(1))
  nnx.update(mha, nnx.state(attn))  # the same weights, module for module
  keys = jax.random.split(jax.random.key(2), 2)
  cand_tokens = jax.random.normal(keys[0], (7, 5, 12))
  user_seq = jax.random.normal(keys[1], (3, 9, 6))
  kv_len = jnp.array([9, 2, 6])
  out = attn(user_seq, cand_tokens, index, kv_len=kv_len)

  ids = index.cand_to_user
  mask = (jnp.arange(9)[None, :] < kv_len[ids][:, None])[:, None, None, :]
  ref = mha(cand_tokens, user_seq[ids], mask=mask)  # the copy models make today
  assert out.shape == (7, 5, 10)
  assert rel_err(out, ref) < 1e-5


def test_gradients_reach_every_projection():
  index = random_index(np.random.default_rng(1), num_users=2, num_candidates=3)
  attn = TargetAttention(num_heads=2, user_features=8, rngs=nnx.Rngs(0))
  x, seq = jnp.ones((3, 2, 8)), jax.random.normal(jax.random.key(0), (2, 4, 8))
  grads = nnx.grad(lambda m: jnp.sum(m(seq, x + jnp.arange(8) * 0.1, index) ** 2))(attn)
  for name in ("query", "key", "value", "out"):
    assert float(jnp.abs(grads[name]["kernel"][...]).sum()) > 0, name


def test_interpret_kernel_path_matches_xla():
  """`interpret=` reaches the op: the module's Triton path runs under the Pallas interpreter."""
  index = random_index(np.random.default_rng(2), num_users=2, num_candidates=3)
  kernel = TargetAttention(2, 32, implementation="triton", interpret=True, rngs=nnx.Rngs(0))
  xla = TargetAttention(2, 32, implementation="xla", rngs=nnx.Rngs(0))  # the same weights
  seq, cands = jax.random.normal(jax.random.key(0), (2, 5, 32)), jnp.ones((3, 2, 32))
  assert rel_err(kernel(seq, cands, index), xla(seq, cands, index)) < 1e-5
