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

Forward and forward + backward (`fwd_bwd`, one cotangent for all). `--small` runs tiny
shapes on any backend (CI keeps the script working).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from ikbo_jax import TwoLevelIndex, linear_compression, two_level_linear_compression

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


def run_point(b, g, u, widths, dtype, ceilings, iterations):
  args, index = problem(b, g, u, widths, dtype)
  rows = {}
  for name, (fn, operands) in variants(args, index).items():
    ms, timer = common.median_ms(fn, *operands, iterations=iterations)
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
  cotangent = jax.random.normal(jax.random.key(7), ref.shape, ref.dtype)
  fwd_bwd = {name: common.median_ms(fn, *args, iterations=iterations)[0]
             for name, fn in fwd_bwd_variants(args, index, cotangent).items()}
  return dict(
      rows=rows, fwd_bwd_ms=fwd_bwd,
      speedup_vs_one_level_group_copied=rows["one_level_group_copied"]["ms"] / two,
      speedup_vs_one_level_copy_untimed=rows["one_level_group_copied_pre"]["ms"] / two,
      speedup_vs_materialized=rows["materialized"]["ms"] / two,
      ratio_to_own_gemms_floor=two / rows["floor_own_gemms"]["ms"],
      fwd_bwd_speedup_vs_one_level_group_copied=(
          fwd_bwd["one_level_group_copied"] / fwd_bwd["two_level"]),
      rel_diff_vs_materialized=float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                     / jnp.linalg.norm(ref.astype(jnp.float32))))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="tiny shapes, any backend")
  parser.add_argument("--iterations", type=int, default=30)
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  widths = SMALL_WIDTHS if args.small else WIDTHS
  items = 64 if args.small else 2048
  points = ([(8, 2), (16, 4)] if args.small else
            [(g, u) for g in (32, 128, 512) for u in (4, 16, 64)])
  ceilings = common.measure_ceilings()
  payload = dict(**common.metadata(), dtype=jnp.dtype(dtype).name, ceilings=ceilings,
                 items=items, widths=widths, points={})
  for g, u in points:
    point = run_point(items, g, u, widths, dtype, ceilings, args.iterations)
    payload["points"][f"G={g},U={u}"] = point
    common.write_json(args.out, payload)  # each result as it comes
    print(f"G={g} U={u}: two_level {point['rows']['two_level']['ms']:.3f} ms, "
          f"x{point['speedup_vs_one_level_group_copied']:.2f} vs one level with the group "
          f"copied (x{point['speedup_vs_one_level_copy_untimed']:.2f} copy untimed), "
          f"{point['ratio_to_own_gemms_floor']:.2f}x its GEMMs' floor; fwd+bwd "
          f"x{point['fwd_bwd_speedup_vs_one_level_group_copied']:.2f}", flush=True)


if __name__ == "__main__":
  main()
