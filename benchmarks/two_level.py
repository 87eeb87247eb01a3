"""Two-level linear compression (user -> group -> item) against one level and no IKBO.

    python -m benchmarks.two_level --out benchmarks/results/two_level_h100.json

At B items, G groups and U users, per (G, U), median CUPTI kernel time of:

- `materialized`: both levels copied to the items, one GEMM over K_user + K_group + K_item;
- `one_level_group_copied`: what today's one-level op allows, the group level copied to the
  items (in the timing) and concatenated to the item stack, the user level by index;
  `one_level_group_copied_pre`: the same with the copy made outside the timing;
- `two_level` (the default implementation) and `two_level_xla`;
- the floors: `floor_item_gemm` (the item GEMM alone, cuBLAS through XLA; also through
  torch where it is installed) and `floor_own_gemms` (the item, group and user GEMMs,
  each timed alone, summed).

Forward and forward + backward (`fwd_bwd`, one cotangent for all). Then attention over
the user's history (S_user = 1024) and the group's (S_group = 256), one softmax: two-level
(one launch on the Mosaic GPU kernel; `two_level_two_launches`, one launch per region and their
merge, as before) against one level over per-group histories built by copying each user's history to its
groups (copy timed, and made beforehand), with each program's allocated memory. `--small`
runs tiny shapes on any backend (CI keeps the script working).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from ikbo_jax import (TwoLevelIndex, linear_compression, target_attention,
                      two_level_linear_compression, two_level_target_attention)
from ikbo_jax.ops.target_attention import default_implementation
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.ops.two_level_target_attention import _two_launches

WIDTHS = dict(k_user=1178, k_group=512, k_item=866, m=433, n=256)
SMALL_WIDTHS = dict(k_user=24, k_group=16, k_item=20, m=12, n=8)


def problem(num_items, num_groups, num_users, widths, dtype, seed=0):
  rng = np.random.default_rng(seed)
  item_to_group = np.sort(rng.integers(0, num_groups, num_items))
  item_to_group[:num_groups] = np.arange(min(num_groups, num_items))
  group_to_user = np.sort(rng.integers(0, num_users, num_groups))
  index = TwoLevelIndex.from_mappings(np.sort(item_to_group), group_to_user, num_users)
  keys = jax.random.split(jax.random.key(seed), 6)
  ks = (widths["k_user"], widths["k_group"], widths["k_item"])
  m, n = widths["m"], widths["n"]
  shapes = [(m, k) for k in ks] + [(r, k, n) for r, k in
                                    zip((num_users, num_groups, num_items), ks)]
  args = tuple((jax.random.normal(key, s) / np.sqrt(s[-1] if len(s) == 2 else 1)).astype(dtype)
               for key, s in zip(keys, shapes))
  return args, index


def _one_level_group_copied(w_user, w_group, w_item, e_user, e_group, e_item, index):
  e_item = jnp.concatenate([e_group[index.items.cand_to_user], e_item], axis=1)
  return linear_compression(w_user, jnp.concatenate([w_group, w_item], axis=1), e_user, e_item,
                            index.item_to_user)


def variants(args, index):
  w_user, w_group, w_item, e_user, e_group, e_item = args
  einsum = jax.jit(lambda w, e: jnp.einsum("mk,bkn->bmn", w, e))
  op = lambda impl: jax.jit(functools.partial(two_level_linear_compression, implementation=impl))
  copied_pre = jnp.concatenate([e_group[index.items.cand_to_user], e_item], axis=1)
  one_level = jax.jit(lambda wu, wg, wi, eu, ei: linear_compression(
      wu, jnp.concatenate([wg, wi], axis=1), eu, ei, index.item_to_user))
  return {
      "materialized": (op("xla_materialized"), (*args, index)),
      "one_level_group_copied": (jax.jit(_one_level_group_copied), (*args, index)),
      "one_level_group_copied_pre": (one_level, (w_user, w_group, w_item, e_user, copied_pre)),
      "two_level": (op(None), (*args, index)),
      "two_level_xla": (op("xla"), (*args, index)),
      "floor_item_gemm": (einsum, (w_item, e_item)),
      "floor_group_gemm": (einsum, (w_group, e_group)),
      "floor_user_gemm": (einsum, (w_user, e_user)),
  }


def fwd_bwd_variants(args, index, cotangent):
  def step(fn, *a):
    out, vjp = jax.vjp(fn, *a)  # the output kept alive: the op is linear in each operand
    return out, vjp(cotangent)
  two = lambda impl: lambda *a: two_level_linear_compression(*a, index, implementation=impl)
  return {
      "materialized": jax.jit(functools.partial(step, two("xla_materialized"))),
      "one_level_group_copied": jax.jit(functools.partial(
          step, lambda *a: _one_level_group_copied(*a, index))),
      "two_level": jax.jit(functools.partial(step, two(None))),
  }


def _torch_item_gemm_ms(w_item, e_item, iterations: int) -> float | None:
  """The item GEMM through torch (cuBLAS), where torch and a GPU are there."""
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  w = torch.randn(tuple(w_item.shape), dtype=torch.bfloat16, device="cuda")
  e = torch.randn(tuple(e_item.shape), dtype=torch.bfloat16, device="cuda")
  times = []
  for _ in range(iterations + 3):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.matmul(w, e)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
  return float(np.median(times[3:]))


def _flops(name, b, g, u, w) -> float:
  full = w["k_user"] + w["k_group"] + w["k_item"]
  per = 2 * w["m"] * w["n"]
  return per * {
      "materialized": b * full,
      "one_level_group_copied": b * (w["k_group"] + w["k_item"]) + u * w["k_user"],
      "one_level_group_copied_pre": b * (w["k_group"] + w["k_item"]) + u * w["k_user"],
      "floor_item_gemm": b * w["k_item"], "floor_group_gemm": g * w["k_group"],
      "floor_user_gemm": u * w["k_user"],
  }.get(name, b * w["k_item"] + g * w["k_group"] + u * w["k_user"])


def _progress(what: str, start: float) -> None:
  print(f"  {what} ({time.perf_counter() - start:.0f} s)", flush=True)


def run_point(b, g, u, widths, dtype, ceilings, iterations):
  start = time.perf_counter()
  args, index = problem(b, g, u, widths, dtype)
  rows = {}
  for name, (fn, operands) in variants(args, index).items():
    ms, timer = common.median_ms(fn, *operands, iterations=iterations)
    _progress(f"{name}: {ms:.3f} ms", start)
    rows[name] = dict(ms=ms, timer=timer, **common.rates(
        ms, _flops(name, b, g, u, widths), 0.0, ceilings))
  rows["floor_own_gemms"] = dict(ms=sum(rows[f"floor_{x}_gemm"]["ms"]
                                        for x in ("item", "group", "user")))
  torch_ms = _torch_item_gemm_ms(args[2], args[5], iterations)
  if torch_ms is not None:
    rows["floor_item_gemm_torch"] = dict(ms=torch_ms)
  two = rows["two_level"]["ms"]
  ref = two_level_linear_compression(*args, index, implementation="xla_materialized")
  got = two_level_linear_compression(*args, index)
  return dict(
      rows=rows,
      speedup_vs_one_level_group_copied=rows["one_level_group_copied"]["ms"] / two,
      speedup_vs_one_level_copy_untimed=rows["one_level_group_copied_pre"]["ms"] / two,
      speedup_vs_materialized=rows["materialized"]["ms"] / two,
      ratio_to_own_gemms_floor=two / rows["floor_own_gemms"]["ms"],
      rel_diff_vs_materialized=float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                     / jnp.linalg.norm(ref.astype(jnp.float32))))


def fwd_bwd_point(b, g, u, widths, dtype, iterations) -> dict:
  """Forward + backward of each variant (compiling the backwards takes the longest: last)."""
  start = time.perf_counter()
  args, index = problem(b, g, u, widths, dtype)
  cotangent = jax.random.normal(jax.random.key(7), (b, widths["m"], widths["n"]), dtype)
  fwd_bwd = {}
  for name, fn in fwd_bwd_variants(args, index, cotangent).items():
    fwd_bwd[name] = common.median_ms(fn, *args, iterations=iterations)[0]
    _progress(f"fwd_bwd {name}: {fwd_bwd[name]:.3f} ms", start)
  return dict(fwd_bwd_ms=fwd_bwd, fwd_bwd_speedup_vs_one_level_group_copied=(
      fwd_bwd["one_level_group_copied"] / fwd_bwd["two_level"]))


ATTENTION = dict(s_user=1024, s_group=256, t=64, heads=2, head_dim=128)
SMALL_ATTENTION = dict(s_user=16, s_group=8, t=2, heads=1, head_dim=64)


def _memory_mb(fn, *args) -> float:
  """The compiled program's temporary and output bytes (what it allocates), in MB."""
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return (stats.temp_size_in_bytes + stats.output_size_in_bytes) / 1e6 if stats else float("nan")


def attention_point(b, g, u, shape, dtype, iterations):
  """Two-level attention against one level over per-group histories (the user's history and
  the group's, copied together per group), the copy timed and not."""
  _, index = problem(b, g, u, dict(SMALL_WIDTHS), dtype)
  keys = jax.random.split(jax.random.key(3), 5)
  t, h, d = shape["t"], shape["heads"], shape["head_dim"]
  q = jax.random.normal(keys[0], (b, t, h, d), dtype)
  k_user, v_user = (jax.random.normal(k, (u, shape["s_user"], h, d), dtype) for k in keys[1:3])
  k_group, v_group = (jax.random.normal(k, (g, shape["s_group"], h, d), dtype) for k in keys[3:5])
  group_to_user = index.groups.cand_to_user

  def per_group(k_user, k_group):
    return jnp.concatenate([k_user[group_to_user], k_group], axis=1)

  two = lambda *a: two_level_target_attention(*a, index)
  params = Params(scale=1 / np.sqrt(d), masked=False, return_lse=False)
  full = lambda n, s: jnp.full((n,), s, jnp.int32)
  two_launches = lambda *a: _two_launches(params, *a, index, full(u, shape["s_user"]),
                                          full(g, shape["s_group"]),
                                          implementation=default_implementation(dtype, d))[0]
  copied = lambda q, ku, vu, kg, vg: target_attention(q, per_group(ku, kg), per_group(vu, vg),
                                                      index.items)
  pre = lambda q, k, v: target_attention(q, k, v, index.items)
  args = (q, k_user, v_user, k_group, v_group)
  built = (q, per_group(k_user, k_group), per_group(v_user, v_group))
  rows = {name: dict(ms=common.median_ms(jax.jit(fn), *a, iterations=iterations)[0],
                     memory_mb=_memory_mb(fn, *a))
          for name, fn, a in (("two_level", two, args), ("two_level_two_launches", two_launches, args),
                              ("one_level_per_group", copied, args),
                              ("one_level_per_group_pre", pre, built))}
  rows["per_group_histories_mb"] = 2 * built[1].nbytes / 1e6
  return dict(rows=rows, speedup_vs_copy_untimed=rows["one_level_per_group_pre"]["ms"]
              / rows["two_level"]["ms"],
              speedup_vs_copy_timed=rows["one_level_per_group"]["ms"] / rows["two_level"]["ms"])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="tiny shapes, any backend")
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--points", nargs="+", default=None, metavar="G,U",
                      help="these (G, U) points, in this order (default: the issue's target "
                      "point G=128,U=16 first, then the rest of G in {32,128,512} x U in {4,16,64})")
  parser.add_argument("--forward-only", action="store_true",
                      help="skip the forward + backward rows (their compiling dominates a "
                      "point's time): the whole grid's forward and attention in one call")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  widths = SMALL_WIDTHS if args.small else WIDTHS
  items = 64 if args.small else 2048
  if args.points:
    points = [tuple(int(x) for x in p.split(",")) for p in args.points]
  elif args.small:
    points = [(8, 2)]
  else:
    points = [(128, 16)] + [(g, u) for g in (32, 128, 512) for u in (4, 16, 64)
                            if (g, u) != (128, 16)]
  ceilings = common.measure_ceilings()
  payload = dict(**common.metadata(), dtype=jnp.dtype(dtype).name, ceilings=ceilings,
                 items=items, widths=widths, points={})
  for g, u in points:
    point = run_point(items, g, u, widths, dtype, ceilings, args.iterations)
    payload["points"][f"G={g},U={u}"] = point
    common.write_json(args.out, payload)  # each result as it comes
    point["attention"] = attention_point(items, g, u, SMALL_ATTENTION if args.small else ATTENTION,
                                         dtype, args.iterations)
    common.write_json(args.out, payload)
    if not args.forward_only:
      point.update(fwd_bwd_point(items, g, u, widths, dtype, args.iterations))
      common.write_json(args.out, payload)
    backward = ("" if args.forward_only else
                f"; fwd+bwd x{point['fwd_bwd_speedup_vs_one_level_group_copied']:.2f}")
    print(f"G={g} U={u}: two_level {point['rows']['two_level']['ms']:.3f} ms, "
          f"x{point['speedup_vs_one_level_group_copied']:.2f} vs one level with the group "
          f"copied (x{point['speedup_vs_one_level_copy_untimed']:.2f} copy untimed), "
          f"{point['ratio_to_own_gemms_floor']:.2f}x its GEMMs' floor{backward}; attention "
          f"x{point['attention']['speedup_vs_copy_untimed']:.2f} vs per-group histories "
          f"(x{point['attention']['speedup_vs_copy_timed']:.2f} with the copy)", flush=True)


if __name__ == "__main__":
  main()
