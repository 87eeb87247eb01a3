"""Parameters cast once: hoisted exactly where every use is one cast, and the program unchanged."""

import dataclasses

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import strategies as st

from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig, scores
from ikbo_jax.serving import Bucket, BucketedModel
from ikbo_jax.serving.precast import hoist_casts

# How a generated program reads a parameter: cast (two ways), as it is, or cast inside a
# nested program (a use the hoisting does not look into).
_USES = {
    "bfloat16": lambda p: p.astype(jnp.bfloat16).astype(jnp.float32),
    "float16": lambda p: p.astype(jnp.float16).astype(jnp.float32),
    "raw": lambda p: p,
    "nested": lambda p: jax.jit(lambda q: q.astype(jnp.bfloat16))(p).astype(jnp.float32),
}


@st.composite
def _programs(draw):
  """Per parameter: its uses (possibly none) and whether it is also an output."""
  count = draw(st.integers(1, 4))
  return [(draw(st.lists(st.sampled_from(sorted(_USES)), max_size=3)), draw(st.booleans()))
          for _ in range(count)]


def _program(spec):
  def fn(params, x):
    out = x
    for p, (uses, _) in zip(params, spec):
      for use in uses:
        out = out * 0.5 + _USES[use](p)
    return out, [p for p, (_, is_output) in zip(params, spec) if is_output]
  return fn


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(spec=_programs(), seed=st.integers(0, 2**16))
# The edges, always tried: two casts of one kind, two kinds, a cast and a plain read, a cast
# of an output, a cast inside a nested program.
@hypothesis.example(spec=[(["bfloat16", "bfloat16"], False)], seed=0)
@hypothesis.example(spec=[(["bfloat16", "float16"], False)], seed=0)
@hypothesis.example(spec=[(["float16", "raw"], False), (["bfloat16"], False)], seed=0)
@hypothesis.example(spec=[(["bfloat16"], True)], seed=0)
@hypothesis.example(spec=[(["nested", "bfloat16"], False)], seed=0)
def test_a_cast_is_hoisted_exactly_where_every_use_is_that_cast(spec, seed):
  rng = np.random.default_rng(seed)
  params = [jnp.asarray(rng.normal(size=3), jnp.float32) for _ in spec]
  x = jnp.asarray(rng.normal(size=3), jnp.float32)
  fn = _program(spec)
  hoisted = hoist_casts(fn, params, x)
  expected = [bool(uses) and len(set(uses)) == 1 and uses[0] in ("bfloat16", "float16")
              and not is_output for uses, is_output in spec]
  assert [c is not None for c in hoisted.casts] == expected
  prepared = hoisted.prepare(params)
  for leaf, cast, (uses, _) in zip(prepared, hoisted.casts, spec):
    assert leaf.dtype == (jnp.float32 if cast is None else jnp.dtype(uses[0]))
  want, got = jax.jit(fn)(params, x), jax.jit(hoisted.fn)(prepared, x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), want, got)


def test_a_cast_shared_by_programs_is_made_once():
  fn = lambda p, x: x + p["w"].astype(jnp.bfloat16)
  params, cache = {"w": jnp.ones(4)}, {}
  first = hoist_casts(fn, params, jnp.ones(4, jnp.bfloat16)).prepare(params, cache)
  second = hoist_casts(fn, params, jnp.ones((2, 4), jnp.bfloat16)).prepare(params, cache)
  assert first[0] is second[0] and len(cache) == 1


def test_the_bfloat16_ranker_is_served_with_its_casts_hoisted_and_the_same_scores():
  config = dataclasses.replace(RankerConfig(), dtype="bfloat16")
  model = Ranker(config, rngs=nnx.Rngs(0))
  bucket = Bucket(64, 4, config.max_history)
  served = BucketedModel(model, [bucket])
  requests = [r.validated(config) for r in ClickGenerator(config, seed=2).requests(3)]
  fn, flat = served.device_call(requests)
  # Every parameter of this model is read only in bfloat16: all are held cast.
  params = fn.args[0]
  assert params and all(p.dtype == jnp.bfloat16 for p in params)
  graphdef, state = nnx.split(model)
  layout = served._layouts[bucket]
  unhoisted = jax.jit(lambda state, flat: jax.nn.sigmoid(
      scores(nnx.merge(graphdef, state), layout.unflatten(flat), served.build)))
  want = np.asarray(unhoisted(state, flat))
  np.testing.assert_allclose(np.asarray(fn(flat)), want, rtol=0, atol=1e-6)
  got = np.concatenate(served(requests))
  np.testing.assert_allclose(got, want[:len(got)], rtol=0, atol=1e-6)
