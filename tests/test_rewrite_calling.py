"""The rewritten function is called as the original is: keywords, defaults, Python flags,
static arguments, under `jax.jit` and `jax.grad`; and its arguments are checked as Python's.

The property test draws a program (`ikbo_jax.testing.programs`), a way of calling it and the
values of two Python arguments that change what it computes.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from ikbo_jax import rewrite
from ikbo_jax.rewrite import selectors
from ikbo_jax.testing import programs
from ikbo_jax.testing.rewrite_check import assert_same_up_to_order

U, B = 3, 10
IDS = jnp.array([2, 0, 1, 2, 2, 0, 1, 1, 0, 2], jnp.int32)


def _normal(seed, *shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def model(user, cand_to_user, cand, w, *, training=False, scale=1.0, bias=None):
  """A tower whose Python flag picks a branch, as `nn.Dropout(deterministic=...)` users write."""
  x = jax.nn.relu(user[cand_to_user] @ w) * cand
  if training:  # Python control flow: the flag must not be traced
    x = x - jnp.mean(x, axis=0)
  if bias is not None:
    x = x + bias
  return scale * x


ARGS = dict(user=_normal(0, U, 8), cand_to_user=IDS, cand=_normal(1, B, 5), w=_normal(2, 8, 5))


@pytest.mark.parametrize("training", [False, True])
def test_keywords_defaults_and_a_python_flag(training):
  fast = rewrite.rewrite(model, mapping="cand_to_user", users="user")
  want = model(**ARGS, training=training)
  np.testing.assert_allclose(fast(**ARGS, training=training), want, rtol=1e-6)
  positional = [ARGS[k] for k in ("user", "cand_to_user", "cand", "w")]
  np.testing.assert_allclose(fast(*positional[:2], cand=ARGS["cand"], w=ARGS["w"],
                                  training=training), want, rtol=1e-6)
  report = rewrite.explain(model, *positional, mapping=1, users=0,
                           kwargs=dict(training=training))
  assert report.count("at_users") >= 1, str(report)


def test_under_jit_with_static_arguments_and_grad():
  fast = rewrite.rewrite(model, mapping="cand_to_user", users="user")
  jitted = jax.jit(fast, static_argnames=("training",))
  np.testing.assert_allclose(jitted(**ARGS, training=True, scale=2.0),
                             model(**ARGS, training=True, scale=2.0), rtol=1e-6)

  def loss(f, user, w):
    return jnp.sum(f(user, IDS, ARGS["cand"], w=w, training=True, scale=0.5) ** 2)

  got = jax.jit(jax.grad(lambda u, w: loss(fast, u, w), argnums=(0, 1)))(ARGS["user"], ARGS["w"])
  want = jax.grad(lambda u, w: loss(model, u, w), argnums=(0, 1))(ARGS["user"], ARGS["w"])
  for g, h in zip(got, want):
    np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)


def test_keyword_only_arrays_are_traced_and_selected_by_name():
  bias = _normal(3, B, 5)
  fast = rewrite.rewrite(model, mapping="cand_to_user", users="user", candidates=("cand", "bias"))
  np.testing.assert_allclose(fast(**ARGS, bias=bias), model(**ARGS, bias=bias), rtol=1e-6)
  # Traced, not held constant: one trace under jit serves every bias.
  jitted = jax.jit(fast)
  for k in range(2):
    np.testing.assert_allclose(jitted(**ARGS, bias=bias + k), model(**ARGS, bias=bias + k),
                               rtol=1e-6)


def test_static_argnums_hold_an_array_read_by_python():
  def repeat_rows(user, ids, cand, counts):
    x = jnp.repeat(user, np.asarray(counts), axis=0, total_repeat_length=int(np.sum(counts)))
    return x[: cand.shape[0]] * cand + jnp.sum(user[ids], axis=1, keepdims=True)

  counts = np.array([4, 3, 3])
  args = (_normal(0, U, 5), IDS, _normal(1, B, 5), counts)
  fast = rewrite.rewrite(repeat_rows, mapping=1, users=0, static_argnums=3)
  np.testing.assert_allclose(fast(*args), repeat_rows(*args), rtol=1e-6)


def test_arguments_are_checked_as_python_checks_them():
  fast = rewrite.rewrite(model, mapping="cand_to_user", users="user")
  with pytest.raises(TypeError, match="missing a required argument: 'w'"):
    fast(ARGS["user"], IDS, ARGS["cand"])
  with pytest.raises(TypeError, match="unexpected keyword argument 'dropout'"):
    fast(**ARGS, dropout=0.1)
  with pytest.raises(TypeError, match="multiple values for argument 'user'"):
    fast(ARGS["user"], IDS, ARGS["cand"], ARGS["w"], user=ARGS["user"])
  for bad in (dict(static_argnums=-1), dict(static_argnums="training"),
              dict(static_argnames=3), dict(static_argnums=True)):
    with pytest.raises(TypeError, match="static_argn"):
      rewrite.rewrite(model, mapping="cand_to_user", users="user", **bad)


def test_the_old_leaf_paths_still_works_and_warns():
  with pytest.warns(DeprecationWarning, match="use rewrite.arguments.bind"):
    leaves, paths = selectors.leaf_paths(model, tuple(ARGS.values()))
  assert len(leaves) == 4 and paths[1] == ("1", "cand_to_user")


@seed(int(os.environ.get("IKBO_REWRITE_SEED", "0")))
@settings(max_examples=int(os.environ.get("IKBO_REWRITE_EXAMPLES", "12")), deadline=None,
          derandomize="IKBO_REWRITE_SEED" not in os.environ, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs.programs(), st.sampled_from(["positional", "keywords", "mixed"]),
       st.booleans(), st.sampled_from([1.0, 0.5, -2]), st.booleans())
def test_any_program_called_any_way_equals_the_original(program, style, centred, scale, jit):
  steps, (user, cand, batch, params) = program
  inner = programs.build(steps)

  def fn(user, cand, batch, params, *, centred=False, scale=1.0):
    cand_rows, user_rows = inner(user, cand, batch, params)
    if centred:
      cand_rows = cand_rows - jnp.mean(cand_rows, axis=0)
    return scale * cand_rows, user_rows

  values = dict(user=user, cand=cand, batch=batch, params=params)
  flags = dict(centred=centred, scale=scale)
  if style == "positional":
    args, kwargs = tuple(values.values()), flags
  elif style == "keywords":
    args, kwargs = (), {**values, **flags}
  else:
    args, kwargs = (user, cand), dict(batch=batch, params=params, **flags)
  fast = rewrite.rewrite(fn, **programs.WHERE)
  if jit:
    fast = jax.jit(fast, static_argnames=("centred", "scale"))
  tol = programs.tolerance(steps)
  got, want = fast(*args, **kwargs), fn(*args, **kwargs)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_same_up_to_order(g, w, rtol=tol, atol=tol, err_msg=f"{style} {flags} jit={jit}")


class _Tower(nnx.Module):
  """A candidate tower over broadcast user rows with batch statistics and dropout."""

  def __init__(self, rngs: nnx.Rngs):
    self.user_proj = nnx.Linear(8, 6, rngs=rngs)
    self.norm = nnx.BatchNorm(5, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(6 + 5, 1, rngs=rngs)

  def __call__(self, user, cand_to_user, cand):
    user_rows = jax.nn.relu(self.user_proj(user))[cand_to_user]
    x = jnp.concatenate([user_rows, self.drop(self.norm(cand))], axis=1)
    return self.out(x)[:, 0]


def test_a_training_loop_over_nnx_modules_matches_the_original_step_for_step():
  """BatchNorm's running statistics and Dropout's RNG stream advance as in the original:
  before, the rewritten forward dropped both updates and every step reused one mask."""
  def forward(model, user, cand_to_user, cand):
    return model(user, cand_to_user, cand)

  fast_forward = rewrite.rewrite(forward, mapping="cand_to_user", users="user")
  assert rewrite.explain(forward, _Tower(nnx.Rngs(0)), ARGS["user"], IDS, ARGS["cand"],
                         mapping="cand_to_user", users="user").count("split_dense") == 1

  def run(fwd):
    model = _Tower(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    labels = (jnp.arange(B) % 2).astype(jnp.float32)

    @nnx.jit
    def step(model, optimizer, user, cand):
      def loss_fn(model):
        logits = fwd(model, user, IDS, cand)
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    losses = [step(model, optimizer, ARGS["user"] + k, ARGS["cand"]) for k in range(4)]
    return losses, nnx.state(model)

  want_losses, want_state = run(forward)
  got_losses, got_state = run(fast_forward)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  assert len(set(np.asarray(want_losses).round(6))) == 4  # the steps differ: masks, stats
  for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(np.asarray(jax.random.key_data(got) if jnp.issubdtype(
        got.dtype, jax.dtypes.prng_key) else got), np.asarray(jax.random.key_data(want) if
        jnp.issubdtype(want.dtype, jax.dtypes.prng_key) else want), rtol=1e-5, atol=1e-6)


def test_python_values_of_nnx_objects_come_back_as_python_values():
  class Counted(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((8, 2)))
      self.calls = nnx.Variable(0)

    def __call__(self, user, ids):
      self.calls.set_value(self.calls.get_value() + 1)
      return user[ids] @ self.w

  module = Counted()
  fast = rewrite.rewrite(lambda m, user, ids: m(user, ids), mapping="ids", users="user")
  out = fast(module, ARGS["user"], IDS)
  np.testing.assert_allclose(out, ARGS["user"][IDS] @ jnp.ones((8, 2)), rtol=1e-6)
  assert type(module.calls.get_value()) is int and module.calls.get_value() == 1
