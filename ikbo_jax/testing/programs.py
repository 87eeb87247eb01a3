"""Random ranking programs for differential testing of the rewrite (`hypothesis` strategies).

A program is a short list of steps over two pools of values: user rows
`[U, F]` and candidate rows `[B, F]`. Steps are the patterns the rewrite
claims and the ones it must leave alone: gathers of user rows by the mapping
and by clamped, shifted, clipped, filled or repeated indices (and a one-hot
product), elementwise ops including `custom_jvp` activations and user-defined
custom rules (a straight-through estimator, a gradient clipper, a rule that is
not row-wise), dense layers, reductions, reshapes and transposes, squeezes and
casts, concatenations with candidate features before a dense layer, pairwise
products of stacks, work on stacked fields (a factorization machine, field
weights, reductions across fields), linear compression, attention through the marker (with
grouped queries), nested `jit`, `checkpoint`, `cond`, `vmap` and `scan` (over
rows, and over stacked layers carrying a value, alone or mixed with another),
and a user value used both at U and broadcast. Inputs have exact zeros (cold-start
users, zero biases) and ties; mappings are sorted or shuffled, with users
without candidates, one user, and B = U. The rows of users without candidates
may hold zeros, NaN or Inf (a padding user), which the original never reads,
and ops whose value or derivative is not finite at zero (`log`, an L2 norm)
find them; some candidates may carry a padding id of U or -1.

`programs()` draws `(fn, args)`; `fn(user, cand, batch, params)` takes the
mapping and the user sequence inside the `batch` dict, so the rewrite's
pytree selectors are exercised too (`WHERE`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from ikbo_jax import rewrite

F, S, HEADS = 8, 6, 2
WHERE = dict(mapping="batch.ids", users=("user", "batch.seq", "batch.lengths"),
             candidates="cand")


@jax.custom_jvp
def straight_through(x):
  return jnp.round(x * 4) / 4


@straight_through.defjvp
def _straight_through_jvp(primals, tangents):
  return straight_through(primals[0]), tangents[0]


@jax.custom_jvp
def batch_scaled(x):
  """A rule that is not row-wise: the tangent is scaled by the mean over the batch axis."""
  return jnp.sin(x)


@batch_scaled.defjvp
def _batch_scaled_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return jnp.sin(x), jnp.cos(x) * t * jnp.mean(x, axis=0, keepdims=True)


@jax.custom_vjp
def clip_gradient(x):
  return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

def _film(x):
  """FiLM on a value's own halves: `jnp.split` into a scale and a shift, each of F / 2."""
  scale, shift = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([scale * shift, shift + scale], axis=-1)


UNARY = {
    "relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
    "abs": jnp.abs, "square": jnp.square, "straight_through": straight_through,
    "clip_gradient": clip_gradient, "batch_scaled": batch_scaled, "silu": jax.nn.silu,
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "log_softmax": lambda x: jax.nn.log_softmax(x, axis=-1),
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1, keepdims=True) - x,
    "stop_gradient": lambda x: jax.lax.stop_gradient(x) * x,
    "film": _film,
    "log_abs": lambda x: jnp.log(jnp.abs(x)),
    "l2norm": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
}
BINARY = {"add": jnp.add, "mul": jnp.multiply, "max": jnp.maximum,
          "where": lambda a, b: jnp.where(a > 0, a, b)}


def _index(kind: str, user, ids, k: int):
  """User rows for each candidate, gathered the way `kind` names."""
  u = user.shape[0]
  if kind == "getitem":
    return user[ids]
  if kind == "take_clip":
    return jnp.take(user, ids, axis=0, mode="clip")
  if kind == "take_clamped":
    return jnp.take(user, jnp.clip(ids, 0, u - 1), axis=0)
  if kind == "take_fill":
    return jnp.take(user, ids, axis=0)
  if kind == "minimum":
    return user[jnp.minimum(ids, k % u)]
  if kind == "shifted":
    return user[(ids + 1) % u]
  if kind == "one_hot":
    return jax.nn.one_hot(ids, u, dtype=user.dtype) @ user
  if kind == "squeeze_cast":
    return jnp.squeeze(user[ids][:, None, :], 1).astype(jnp.bfloat16).astype(jnp.float32)
  if kind == "take_along":  # an index as wide as the rows: each element reads its own row
    wide = jnp.broadcast_to(ids[:, None], (ids.shape[0], user.shape[1]))
    return jnp.take_along_axis(user, wide, axis=0)
  if kind == "repeat":  # a uniform ratio, ignoring the mapping
    return jnp.repeat(user, ids.shape[0] // u, axis=0)
  raise ValueError(kind)


INDEX_KINDS = ("getitem", "take_clip", "take_clamped", "take_fill", "minimum", "shifted",
               "one_hot", "squeeze_cast", "take_along", "repeat")


@dataclasses.dataclass(frozen=True)
class Step:
  op: str
  pool: str  # "u" or "b": where its input comes from
  a: int  # indices into the pool (taken modulo its size)
  b: int
  option: str = ""
  wrap: str = ""  # "", "jit", "checkpoint", "vmap"


def _dense(params, k, x):
  return x @ params["w"][k % 3] + params["bias"][k % 3]


def _apply(step: Step, x, y, params, cand, batch):
  """One step on `x` (and `y`, of the same pool)."""
  op = step.op
  if op == "unary":
    return UNARY[step.option](x)
  if op == "binary":
    return BINARY[step.option](x, y)
  if op == "dense":
    return _dense(params, step.a, x)
  if op == "rownorm":
    return x / (1 + jnp.sum(x * x, axis=-1, keepdims=True))
  if op == "shape":
    n = x.shape[0]
    return jnp.transpose(x.reshape(n, 2, F // 2), (0, 2, 1)).reshape(n, F)
  if op == "concat_dense":
    return jnp.concatenate([x, cand], axis=1) @ params["w_concat"]
  if op == "pairwise":
    stack = jnp.stack([x, y, cand], axis=1)  # [B, 3, F]
    return jnp.einsum("bif,bjf->bij", stack, stack).reshape(-1, 9) @ params["w_pairs"]
  if op == "fields":
    return _fields(step.option, x, y, cand, params)
  if op == "compress":
    stack = jnp.concatenate([x[:, None], cand[:, None]], axis=1)  # [B, 2, F]
    return jnp.sum(jnp.einsum("mk,bkn->bmn", params["w_compress"], stack), axis=1)
  if op == "cond":
    return jax.lax.cond(params["gate"] > 0, UNARY[step.option], jnp.cos, x)
  if op == "scan":
    return _scan(step, x, y, params)
  raise ValueError(op)


def _fields(option: str, x, y, cand, params):
  """Work on stacked fields `[B, 3, F]` (or `[B, F, 3]`): a factorization machine, field
  weights and a squeeze, per-field projections with attention across fields, a max across
  fields."""
  if option == "fm":
    stack = jnp.stack([x, y, cand], axis=1)
    total = jnp.sum(stack, axis=1)
    return 0.5 * (total * total - jnp.sum(jnp.square(stack), axis=1))
  if option == "weighted":  # per-field weights, a squeeze along the features (FiBiNET)
    stack = jnp.concatenate([x[:, None], y[:, None], cand[:, None]], axis=1)
    weighted = stack * params["w_fields"][None, :, None]
    return jnp.mean(weighted, axis=-1) @ params["w_pairs"][:3] + jnp.sum(weighted, axis=1)
  if option == "project":  # per-field projections and attention across fields (AutoInt)
    stack = jnp.stack([x, y, cand], axis=1)
    q, k = stack @ params["w"][0], stack @ params["w"][1]
    weights = jax.nn.softmax(jnp.einsum("bif,bjf->bij", q, k), axis=-1)
    return jnp.einsum("bij,bjf->bif", weights, stack @ params["w"][2]).sum(axis=1)
  if option == "max":  # stacked along the last axis
    stack = jnp.stack([x, jnp.tanh(y), cand], axis=-1)
    return jnp.max(stack, axis=-1) - jnp.min(stack * 0.5, axis=-1)
  raise ValueError(option)


def _scan(step: Step, x, y, params):
  """A scan over `x`'s rows, a stack of layers carrying `x`, or layers that mix `y` into it."""
  if step.option == "rows":
    return jax.lax.scan(lambda c, row: (c + row, c * row), jnp.zeros(F), x)[1]
  # The carries keep their dtype (a float64 replay, `tools/rewrite_triage.py`, mixes dtypes).
  if step.option == "layers":
    def layer(h, w):
      h = jnp.tanh(h @ w).astype(h.dtype)
      return h, jnp.sum(h, axis=-1)
    h, sums = jax.lax.scan(layer, x, params["w"], reverse=step.b % 2 == 1)
    return h + jnp.mean(sums, axis=0)[:, None]
  return jax.lax.scan(lambda h, w: ((h @ w + y).astype(h.dtype), None), x, params["w"])[0]


def _attention(step: Step, params, cand, batch):
  idx = batch["ids"]
  seq = _index(step.option, batch["seq"].reshape(batch["seq"].shape[0], -1), idx, step.a)
  seq = seq.reshape(-1, S, HEADS, F // HEADS)
  lengths = batch["lengths"][jnp.clip(idx, 0, batch["lengths"].shape[0] - 1)]
  q = (cand @ params["w_query"]).reshape(-1, 1, HEADS, F // HEADS)
  k, v = (seq[:, :, :1], seq[:, :, 1:]) if step.b % 2 else (seq, seq * 0.5)
  return rewrite.attention(q, k, v, lengths).reshape(-1, F)


def build(steps: tuple[Step, ...]):
  """The program of `steps`: `fn(user, cand, batch, params) -> (cand rows, user rows)`."""

  def fn(user, cand, batch, params):
    pools = {"u": [user], "b": [cand]}
    for step in steps:
      if step.op == "gather":
        pools["b"].append(_index(step.option, pools["u"][step.a % len(pools["u"])],
                                 batch["ids"], step.b))
        continue
      if step.op == "attention":
        pools["b"].append(_attention(step, params, cand, batch))
        continue
      if step.op == "both":  # a user value used at U and broadcast
        x = _dense(params, step.a, pools["u"][step.a % len(pools["u"])])
        pools["u"].append(x)
        pools["b"].append(x[batch["ids"]] + jnp.mean(x, axis=0))
        continue
      pool = pools[step.pool]
      x, y = pool[step.a % len(pool)], pool[step.b % len(pool)]
      apply = lambda x, y: _apply(step, x, y, params, cand, batch)
      if step.wrap == "jit":
        apply = jax.jit(apply)
      elif step.wrap == "checkpoint":
        apply = jax.checkpoint(apply)
      elif step.wrap == "vmap" and step.op in ("unary", "binary", "dense", "rownorm"):
        apply = jax.vmap(lambda x, y: _apply(step, x[None], y[None], params, cand[:1],
                                             batch)[0])
      pool.append(apply(x, y))
    return sum(pools["b"][1:], jnp.zeros_like(cand)), pools["u"][-1]

  return fn


SCANS = ("rows", "layers", "mixing")
_STEPS = ("gather", "gather", "unary", "unary", "binary", "dense", "rownorm", "shape",
          "concat_dense", "pairwise", "compress", "attention", "both", "cond", "scan", "fields")
FIELDS = ("fm", "weighted", "project", "max")


@st.composite
def steps(draw):
  out = [Step("gather", "u", 0, 0, draw(st.sampled_from(INDEX_KINDS)))]
  for _ in range(draw(st.integers(0, 5))):
    op = draw(st.sampled_from(_STEPS))
    pool = "b" if op in ("concat_dense", "pairwise", "compress", "fields") else draw(
        st.sampled_from("ub"))
    option = (draw(st.sampled_from(sorted(UNARY))) if op in ("unary", "cond") else
              draw(st.sampled_from(sorted(BINARY))) if op == "binary" else
              draw(st.sampled_from(INDEX_KINDS)) if op in ("gather", "attention") else
              draw(st.sampled_from(SCANS)) if op == "scan" else
              draw(st.sampled_from(FIELDS)) if op == "fields" else "")
    wrap = draw(st.sampled_from(("", "", "", "jit", "checkpoint", "vmap")))
    out.append(Step(op, pool, draw(st.integers(0, 7)), draw(st.integers(0, 7)), option, wrap))
  return tuple(out)


@st.composite
def inputs(draw):
  """`(user, cand, batch, params)` with exact zeros, ties and a random mapping."""
  num_users = draw(st.sampled_from((1, 2, 3, 5)))
  ratio = draw(st.sampled_from((1, 2, 3)))
  num_candidates = num_users * ratio if draw(st.booleans()) else draw(st.sampled_from((4, 7)))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  live = rng.permutation(num_users)[:max(1, num_users - draw(st.integers(0, 1)))]
  ids = np.sort(rng.choice(live, num_candidates)) if draw(st.booleans()) else rng.choice(
      live, num_candidates)
  padding_id = draw(st.sampled_from((None, None, num_users, -1)))
  if padding_id is not None and num_candidates > 1:
    ids[-1] = padding_id  # a padding candidate past the live ones
  unused = np.setdiff1d(np.arange(num_users), live)
  unused_value = draw(st.sampled_from((None, 0.0, np.nan, np.inf)))
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)

  def padding_rows(x):
    """Rows of users without candidates (what no candidate of the original reads)."""
    if unused_value is not None and len(unused):
      x = x.copy()
      x[unused] = unused_value
    return x

  def with_zeros_and_ties(x):
    x = np.where(rng.random(x.shape) < 0.15, 0.0, x)  # exact zeros
    if x.ndim >= 2 and rng.random() < 0.5:
      x[rng.integers(x.shape[0])] = 0.0  # a cold-start row
    return np.where(rng.random(x.shape) < 0.2, np.round(x * 2) / 2, x).astype(np.float32)

  zero_bias = draw(st.booleans())
  params = {"w": normal(3, F, F) / np.sqrt(F), "bias": (0 if zero_bias else 1) * normal(3, F),
            "w_concat": normal(2 * F, F) / 4, "w_pairs": normal(9, F) / 3,
            "w_compress": normal(3, 2), "w_query": normal(F, F) / 3,
            "w_fields": normal(3),
            "gate": np.float32(rng.standard_normal())}
  batch = {"ids": jnp.asarray(ids, jnp.int32),
           "seq": jnp.asarray(padding_rows(with_zeros_and_ties(normal(num_users, S, F)))),
           "lengths": jnp.asarray(rng.integers(0, S + 1, num_users), jnp.int32)}
  args = (jnp.asarray(padding_rows(with_zeros_and_ties(normal(num_users, F)))),
          jnp.asarray(with_zeros_and_ties(normal(num_candidates, F))), batch,
          jax.tree.map(jnp.asarray, params))
  return args


def tolerance(program_steps) -> float:
  """The relative tolerance for a program: float32 rounding, or bfloat16's for one that casts.

  A moved op sums the cotangents of its user rows before it instead of after it
  (the transposed gather moves with it): the same in real arithmetic, rounded
  differently, and a cast to bfloat16 rounds the sum instead of its terms.
  """
  return 2.0**-7 if any(s.option == "squeeze_cast" for s in program_steps) else 1e-4


@st.composite
def programs(draw):
  """`(steps, args)`: a random program (see `build`) and inputs for it."""
  program_steps, args = draw(steps()), draw(inputs())
  if any(s.option == "repeat" for s in program_steps) and (
      args[1].shape[0] % args[0].shape[0]):
    program_steps = tuple(dataclasses.replace(s, option="getitem") if s.option == "repeat"
                          else s for s in program_steps)
  return program_steps, args
