"""The automatic rewrite against the hand-written IKBO code: original vs rewritten vs IKBO.

    python -m benchmarks.rewrite --out benchmarks/results/rewrite_h200.json
    python -m benchmarks.rewrite --small --out /tmp/rewrite_small.json   # CPU, seconds

For models written the standard way (user rows copied with `x[cand_to_user]`),
each under `jax.jit`: the original function, `ikbo_jax.rewrite.rewrite` of it,
and the same model written by hand on the IKBO ops. Reports median times, the
speedups over the original, the fraction of the hand-written speedup the
rewrite reaches, how long the rewrite takes to trace, and each compiled program's
kernels (`--kernels-only` counts them at the benchmark shapes on any backend).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from benchmarks import common
from benchmarks.problems import ranking_batch
from ikbo_jax import CandidateIndex, linear_compression, rewrite, target_attention
from ikbo_jax.models import Ranker, RankerConfig, RankingBatch


def _normal(seed, shape, dtype):
  return (jax.random.normal(jax.random.key(seed), shape) / np.sqrt(shape[-1])).astype(dtype)


def _mapping(b, u):
  return jnp.asarray(np.random.default_rng(0).integers(0, u, b), jnp.int32)


def lce_case(b, u, m, n, k_user, k_cand, dtype):
  def original(e_user, ids, e_cand, w):
    return jnp.einsum("mk,bkn->bmn", w, jnp.concatenate([e_user[ids], e_cand], axis=1))

  def by_hand(e_user, ids, e_cand, w):
    index = CandidateIndex.from_mapping(ids, u)
    return linear_compression(w[:, :k_user], w[:, k_user:], e_user, e_cand, index)

  args = (_normal(0, (u, k_user, n), dtype), _mapping(b, u), _normal(1, (b, k_cand, n), dtype),
          _normal(2, (m, k_user + k_cand), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def attention_case(b, u, s, heads, head_dim, n_seed, dtype, kv_heads=None):
  """Target attention through the hook; with `kv_heads`, grouped queries over fewer K/V heads."""
  impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  kv_heads = kv_heads or heads

  def original(seq_k, seq_v, ids, q, lengths):
    return rewrite.attention(q, seq_k[ids], seq_v[ids], lengths[ids], implementation=impl)

  def by_hand(seq_k, seq_v, ids, q, lengths):
    k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (seq_k, seq_v))
    return target_attention(q, k, v, CandidateIndex.from_mapping(ids, u), kv_len=lengths)

  shape = (u, s, kv_heads, head_dim)
  lengths = jnp.asarray(np.random.default_rng(1).integers(s // 2, s + 1, u), jnp.int32)
  args = (_normal(0, shape, dtype), _normal(1, shape, dtype), _mapping(b, u),
          _normal(2, (b, n_seed, heads, head_dim), dtype), lengths)
  return original, by_hand, args, dict(mapping=2, users=(0, 1, 4))


def dlrm_case(b, u, f_user, f_cand, hidden, dtype):
  def original(user, ids, cand, w1, w2):
    return jax.nn.relu(jnp.concatenate([user[ids], cand], axis=1) @ w1) @ w2

  def by_hand(user, ids, cand, w1, w2):
    return jax.nn.relu((user @ w1[:f_user])[ids] + cand @ w1[f_user:]) @ w2

  args = (_normal(0, (u, f_user), dtype), _mapping(b, u), _normal(1, (b, f_cand), dtype),
          _normal(2, (f_user + f_cand, hidden), dtype), _normal(3, (hidden, 1), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def repeat_dlrm_case(u, ratio, f_user, f_cand, hidden, dtype):
  """The DLRM-style MLP with user rows repeated for a uniform ratio (`jnp.repeat`), no mapping."""
  b = u * ratio

  def original(user, ids, cand, w1, w2):
    del ids
    x = jnp.concatenate([jnp.repeat(user, ratio, axis=0), cand], axis=1)
    return jax.nn.relu(x @ w1) @ w2

  def by_hand(user, ids, cand, w1, w2):
    del ids
    return jax.nn.relu(jnp.repeat(user @ w1[:f_user], ratio, axis=0) + cand @ w1[f_user:]) @ w2

  args = (_normal(0, (u, f_user), dtype), _mapping(b, u), _normal(1, (b, f_cand), dtype),
          _normal(2, (f_user + f_cand, hidden), dtype), _normal(3, (hidden, 1), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def pairwise_case(b, u, n_user, n_cand, dim, hidden, dtype):
  """A DLRM pairwise dot interaction of user and candidate embeddings, then a dense layer."""
  n = n_user + n_cand
  rows, cols = np.triu_indices(n, 1)

  def original(e_user, ids, e_cand, w):
    x = jnp.concatenate([e_user[ids], e_cand], axis=1)  # [B, n, D]
    z = jnp.einsum("bid,bjd->bij", x, x)
    return jax.nn.relu(z[:, rows, cols] @ w)

  def by_hand(e_user, ids, e_cand, w):
    user_block = jnp.einsum("uid,ujd->uij", e_user, e_user)[ids]
    cross = jnp.einsum("bid,bjd->bij", e_user[ids], e_cand)
    cand_block = jnp.einsum("bid,bjd->bij", e_cand, e_cand)
    z = jnp.concatenate([jnp.concatenate([user_block, cross], axis=2),
                         jnp.concatenate([jnp.transpose(cross, (0, 2, 1)), cand_block], axis=2)],
                        axis=1)
    return jax.nn.relu(z[:, rows, cols] @ w)

  args = (_normal(0, (u, n_user, dim), dtype), _mapping(b, u),
          _normal(1, (b, n_cand, dim), dtype), _normal(2, (len(rows), hidden), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def tower_case(b, u, f_user, hidden, dtype):
  """A checkpointed user tower with `jax.nn.relu` (a custom_jvp) scored against candidates."""
  tower = lambda w1, w2: jax.checkpoint(lambda x: jax.nn.relu(x @ w1) @ w2)

  def original(user, ids, cand, w1, w2):
    return jnp.sum(tower(w1, w2)(user[ids]) * cand, axis=-1)

  def by_hand(user, ids, cand, w1, w2):
    return jnp.sum(tower(w1, w2)(user)[ids] * cand, axis=-1)

  args = (_normal(0, (u, f_user), dtype), _mapping(b, u), _normal(1, (b, hidden), dtype),
          _normal(2, (f_user, 4 * hidden), dtype), _normal(3, (4 * hidden, hidden), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def lce_take_case(b, u, m, n, k_user, k_cand, dtype):
  """Linear compression whose user rows come from `jnp.take` in its default (fill) mode."""
  _, by_hand, args, where = lce_case(b, u, m, n, k_user, k_cand, dtype)

  def original(e_user, ids, e_cand, w):
    rows = jnp.take(e_user, ids, axis=0)
    return jnp.einsum("mk,bkn->bmn", w, jnp.concatenate([rows, e_cand], axis=1))

  return original, by_hand, args, where


def scan_tower_case(b, u, f, layers, dtype):
  """A user tower of `layers` stacked layers under `lax.scan`, carried from the broadcast rows."""
  def tower(x, ws):
    return jax.lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, ws)[0]

  def original(user, ids, cand, ws):
    return jnp.sum(tower(user[ids], ws) * cand, axis=-1)

  def by_hand(user, ids, cand, ws):
    return jnp.sum(tower(user, ws)[ids] * cand, axis=-1)

  args = (_normal(0, (u, f), dtype), _mapping(b, u), _normal(1, (b, f), dtype),
          _normal(2, (layers, f, f), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def lookup_tower_case(b, u, f_user, hidden, dtype):
  """Per-candidate lookups of the user row (`vmap` of `dynamic_index_in_dim`), a checkpointed
  tower that saves a named activation (`checkpoint_name`), scored against candidates."""
  policy = jax.checkpoint_policies.save_only_these_names("hidden")

  def tower(x, w1, w2):
    body = lambda x: checkpoint_name(jax.nn.relu(x @ w1), "hidden") @ w2
    return jax.checkpoint(body, policy=policy)(x)

  def original(user, ids, cand, w1, w2):
    rows = jax.vmap(lambda i: jax.lax.dynamic_index_in_dim(user, i, keepdims=False))(ids)
    return jnp.sum(tower(rows, w1, w2) * cand, axis=-1)

  def by_hand(user, ids, cand, w1, w2):
    return jnp.sum(tower(user, w1, w2)[ids] * cand, axis=-1)

  args = (_normal(0, (u, f_user), dtype), _mapping(b, u), _normal(1, (b, hidden), dtype),
          _normal(2, (f_user, 4 * hidden), dtype), _normal(3, (4 * hidden, hidden), dtype))
  return original, by_hand, args, dict(mapping=1, users=(0,))


def ranker_case(config, b, ratio):
  model = Ranker(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  batch = ranking_batch(config, max(1, round(b / ratio)), b)

  def as_batch(user_dense, history, history_len, ids, cand_items, cand_dense):
    return RankingBatch(user_dense, history, history_len, ids, cand_items, cand_dense,
                        jnp.zeros(ids.shape, jnp.float32))

  original = lambda state, *a: nnx.merge(graphdef, state).standard(as_batch(*a))
  by_hand = lambda state, *a: nnx.merge(graphdef, state)(as_batch(*a))
  args = (state, batch.user_dense, batch.history, batch.history_len, batch.cand_to_user,
          batch.cand_items, batch.cand_dense)
  return original, by_hand, args, dict(mapping=4, users=(1, 2, 3),
                                       candidates=(5, 6))


_NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})


def kernels(text: str) -> int:
  """Instructions of a compiled program's entry computation (`text`, its HLO) that launch
  work (fusions, library calls, copies): on a GPU, about its kernel launches."""
  entry = text[text.index("\nENTRY"):].split("\n}")[0]
  ops = [re.search(r"\s([a-z][\w-]*)\(", line.split(" = ", 1)[1])
         for line in entry.splitlines()[1:] if " = " in line]
  ops = [m.group(1) for m in ops if m]
  return sum(op not in _NOT_KERNELS for op in ops)


def measure(name, case, iterations, timed=True, hlo_dir=None) -> dict:
  original, by_hand, args, where = case
  start = time.perf_counter()
  report = rewrite.explain(original, *args, **where)
  trace_s = time.perf_counter() - start
  fns = dict(original=original, rewritten=rewrite.rewrite(original, **where), ikbo=by_hand)
  row = dict(trace_seconds=trace_s, changes=str(report).splitlines()[0])
  # Each variant compiled once: its HLO gives the kernel count, the executable is timed.
  compiled = {label: jax.jit(fn).lower(*args).compile() for label, fn in fns.items()}
  for label, executable in compiled.items():
    text = executable.as_text()
    row[label] = dict(kernels=kernels(text))
    if hlo_dir:
      (pathlib.Path(hlo_dir) / f"{name}.{label}.hlo.txt").write_text(text)
  if not timed:
    print(f"{name}: kernels " + ", ".join(f"{k} {row[k]['kernels']}" for k in fns), flush=True)
    return row
  for label, executable in compiled.items():
    ms, timer = common.median_ms(executable, *args, iterations=iterations)
    row[label].update(ms=ms, timer=timer)
  want = compiled["original"](*args).astype(jnp.float32)
  got = compiled["rewritten"](*args).astype(jnp.float32)
  row["rewritten_relative_error"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  base = row["original"]["ms"]
  row["speedup_rewritten"] = base / row["rewritten"]["ms"]
  row["speedup_ikbo"] = base / row["ikbo"]["ms"]
  row["fraction_of_ikbo_speedup"] = row["speedup_rewritten"] / row["speedup_ikbo"]
  print(f"{name}: " + ", ".join(f"{k} {row[k]['ms']:.3f} ms" for k in fns)
        + f"; rewritten {row['speedup_rewritten']:.2f}x, by hand {row['speedup_ikbo']:.2f}x; "
        f"trace {trace_s:.2f} s; rel. error {row['rewritten_relative_error']:.1e}; "
        f"{row['changes']}", flush=True)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--cases", nargs="+", default=None, help="these cases only (default all)")
  parser.add_argument("--kernels-only", action="store_true",
                      help="compile and count each variant's kernels, time nothing")
  parser.add_argument("--hlo-dir", help="write each variant's compiled HLO here (to read where "
                      "a rewritten program's kernels differ from the hand-written one's)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.hlo_dir:
    pathlib.Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
  if args.small:
    dtype, config = jnp.float32, RankerConfig()
    cases = dict(lce=lce_case(256, 4, 32, 16, 48, 40, dtype),
                 target_attention=attention_case(128, 4, 64, 2, 16, 4, dtype),
                 dlrm=dlrm_case(256, 4, 64, 16, 32, dtype),
                 ranker=ranker_case(config, 128, 16),
                 repeat_dlrm=repeat_dlrm_case(4, 64, 64, 16, 32, dtype),
                 pairwise=pairwise_case(256, 4, 4, 6, 16, 32, dtype),
                 gqa_attention=attention_case(128, 4, 64, 4, 16, 4, dtype, kv_heads=2),
                 tower=tower_case(256, 4, 64, 32, dtype),
                 lce_take=lce_take_case(256, 4, 32, 16, 48, 40, dtype),
                 scan_tower=scan_tower_case(256, 4, 64, 4, dtype),
                 lookup_tower=lookup_tower_case(256, 4, 64, 32, dtype))
  else:
    dtype = jnp.bfloat16
    cases = dict(lce=lce_case(1024, 15, 433, 256, 1178, 866, dtype),
                 target_attention=attention_case(2048, 32, 1024, 2, 128, 64, dtype),
                 dlrm=dlrm_case(1024, 15, 2048, 512, 1024, dtype),
                 ranker=ranker_case(RankerConfig.benchmark(), 1024, 70),
                 repeat_dlrm=repeat_dlrm_case(15, 70, 2048, 512, 1024, dtype),
                 pairwise=pairwise_case(1024, 15, 16, 16, 128, 1024, dtype),
                 gqa_attention=attention_case(2048, 32, 1024, 4, 128, 64, dtype, kv_heads=2),
                 tower=tower_case(1024, 15, 2048, 512, dtype),
                 lce_take=lce_take_case(1024, 15, 433, 256, 1178, 866, dtype),
                 scan_tower=scan_tower_case(1024, 15, 1024, 4, dtype),
                 lookup_tower=lookup_tower_case(1024, 15, 2048, 512, dtype))
  results = {name: measure(name, case, args.iterations, not args.kernels_only, args.hlo_dir)
             for name, case in cases.items() if args.cases is None or name in args.cases}
  common.write_json(args.out, dict(**common.metadata(), dtype=jnp.dtype(dtype).name,
                                   iterations=0 if args.kernels_only else args.iterations,
                                   cases=results))


if __name__ == "__main__":
  main()
