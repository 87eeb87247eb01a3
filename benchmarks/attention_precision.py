"""Target attention's gradient precision where the softmax is (nearly) one-hot, against float64.

    python -m benchmarks.attention_precision --out attention_precision_h100.json

Each case's inputs are drawn in float32 and rounded to bfloat16; the truth is
float64 NumPy on those rounded values (`float64_reference`). Every path's
gradients are measured as `||g - g64|| / max(||g64||, 0.01 * the largest
true gradient's norm)`: one-key rows have `dq = dk = 0` exactly, so a
gradient is judged against the scale of the others. Paths: every public
implementation this device runs. (Run on the kernels before the exact `delta`,
with `delta` replaced by a float64 one, it showed where the precision went:
`docs/results.md`.)
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from ikbo_jax import CandidateIndex, target_attention


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  num_users: int
  num_candidates: int
  n_seed: int
  seq_len: int
  heads: int
  head_dim: int
  kv_len: tuple[int, ...] | str  # per user, or "0or1"
  peak: float = 0.0  # > 0: key 0 of each user aligned with its queries (logit ~ peak^2 sqrt(D))


CASES = (
    Case("S1_kvlen_0or1", 37, 513, 3, 1, 2, 64, "0or1"),
    Case("one_user_kvlen1_S2048", 1, 1024, 64, 2048, 2, 128, (1,)),
    Case("U4_one_kvlen1_S3001", 4, 96, 64, 3001, 2, 128, (1, 3001, 1700, 2500)),
    Case("peaked_0.9", 8, 256, 64, 512, 2, 128, (512,) * 8, peak=0.9),
    Case("peaked_1.1", 8, 256, 64, 512, 2, 128, (512,) * 8, peak=1.1),
)
SMALL_CASES = (
    Case("S1_kvlen_0or1", 5, 40, 3, 1, 2, 64, "0or1"),
    Case("peaked_1.1", 2, 8, 16, 128, 1, 64, (128, 100), peak=1.1),
)


def draw(case: Case, seed: int = 0):
  """`(q, k, v, d_out, cand_to_user, kv_len)` in bfloat16 (ids and lengths int32)."""
  rng = np.random.default_rng(seed)
  b, u, t, s, h, d = (case.num_candidates, case.num_users, case.n_seed, case.seq_len,
                      case.heads, case.head_dim)
  c2u = rng.permutation(np.arange(b) % u).astype(np.int32)
  q = rng.standard_normal((b, t, h, d))
  k, v = rng.standard_normal((u, s, h, d)), rng.standard_normal((u, s, h, d))
  if case.peak:
    direction = rng.standard_normal((u, h, d))
    q += case.peak * direction[c2u][:, None]
    k[:, 0] = case.peak * direction
  kv_len = (rng.integers(0, 2, u) if case.kv_len == "0or1" else np.asarray(case.kv_len))
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16))
  return (bf16(q), bf16(k), bf16(v), bf16(rng.standard_normal((b, t, h, d))), c2u,
          kv_len.astype(np.int32))


def float64_reference(q, k, v, d_out, c2u, kv_len, scale):
  """`(out, dq, dk, dv)` in float64, user by user over each user's valid keys."""
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  out, dq = np.zeros_like(q), np.zeros_like(q)
  dk, dv = np.zeros_like(k), np.zeros_like(v)
  for user in range(k.shape[0]):
    cands, length = np.flatnonzero(c2u == user), int(kv_len[user])
    if not len(cands) or not length:
      continue
    qu, gu = q[cands], d_out[cands]  # [n, T, H, D]
    ku, vu = k[user, :length], v[user, :length]  # [L, H, D]
    logits = np.einsum("nthd,lhd->nhtl", qu, ku) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[cands] = np.einsum("nhtl,lhd->nthd", p, vu)
    dp = np.einsum("nthd,lhd->nhtl", gu, vu)
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    dq[cands] = scale * np.einsum("nhtl,lhd->nthd", ds, ku)
    dk[user, :length] = scale * np.einsum("nhtl,nthd->lhd", ds, qu)
    dv[user, :length] = np.einsum("nhtl,nthd->lhd", p, gu)
  return out, dq, dk, dv


def errors(grads, truth) -> dict:
  floor = 0.01 * max(np.linalg.norm(g) for g in truth)
  return {name: float(np.linalg.norm(np.asarray(g, np.float64) - t)
                      / max(np.linalg.norm(t), floor))
          for name, g, t in zip(("dq", "dk", "dv"), grads, truth)}


def paths(index, kv_len, interpret: bool):
  """`name -> fn(q, k, v) -> out` for every implementation this device runs."""
  kernels = ("triton", "mosaic_gpu") if not interpret else ("triton",)
  run = lambda impl: lambda q, k, v: target_attention(
      q, k, v, index, kv_len=kv_len, implementation=impl,
      interpret=interpret and impl in kernels)
  return {impl: run(impl) for impl in ("xla_materialized", "xla") + kernels}


def measure(case: Case, interpret: bool) -> dict:
  q, k, v, d_out, c2u, kv_len = draw(case)
  scale = 1 / np.sqrt(case.head_dim)
  truth = float64_reference(q, k, v, d_out, c2u, kv_len, scale)
  index = CandidateIndex.from_mapping(jnp.asarray(c2u), case.num_users)
  args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  cotangent = jnp.asarray(d_out, jnp.bfloat16)
  row = dict(case=dataclasses.asdict(case), paths={})

  def grads(fn):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cotangent)

  for name, fn in paths(index, jnp.asarray(kv_len), interpret).items():
    try:
      out, g = jax.jit(lambda: grads(fn))()
    except Exception as e:  # a path that fails to compile or run is reported, not fatal
      row["paths"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      continue
    out64 = np.asarray(out, np.float64)
    row["paths"][name] = dict(
        out=float(np.linalg.norm(out64 - truth[0]) / max(np.linalg.norm(truth[0]), 1e-30)),
        **errors(g, truth[1:]))
  print(case.name, {n: {k: round(x, 5) if isinstance(x, float) else x for k, x in e.items()}
                    for n, e in row["paths"].items()}, flush=True)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="CPU-sized cases, Triton interpreted")
  args = parser.parse_args()
  interpret = args.small or jax.default_backend() != "gpu"
  rows = []
  for case in (SMALL_CASES if args.small else CASES):
    rows.append(measure(case, interpret))
    common.write_json(args.out, dict(**common.metadata(), what=__doc__.split("\n")[0],
                                     cases=rows))


if __name__ == "__main__":
  main()
