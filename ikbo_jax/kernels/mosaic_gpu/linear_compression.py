"""Fused candidate GEMM of linear compression, Pallas Mosaic GPU backend (Hopper).

Computes `out[b] = A @ E[b] + user_res[cand_to_user[b]]` in one persistent,
warp-specialized launch. In the forward pass `A = W_cand` and `E = E_cand`; the
backward reuses the kernel without the user term for `dE_cand[b] = W_cand^T @
dOut[b]`.

One CTA per SM loops over output tiles `(b, m, n)`, `b` outermost so that the
CTAs running at one time share `E[b]` in L2. A producer warpgroup streams `A`
and `E[b]` K-tiles through shared memory with TMA; two consumer warpgroups run
WGMMA into float32 accumulators, side by side along M or N (`Config.split`). In
the epilogue each consumer adds its tile of `user_res[cand_to_user[b]]` to the
float32 accumulator before the single rounding. The user rows are loaded from
global memory straight into the WGMMA register layout, one chunk ahead (the
first during the K loop), so the epilogue does not stall on them; no shared
memory and no broadcast of `user_res` to the candidate batch is involved.

`single_launch_forward` also computes `user_res[u] = W_user @ E_user[u]` in the
same launch (the published "stage 4"): the user tiles are the first work items
of the persistent loop, so every CTA finishes its user tiles before it starts
on candidates. A consumer that finishes a user tile stores it in float32 and
increments one global semaphore. The first candidate tile of each CTA waits
until that count covers every user tile; the later ones need no wait, which
keeps the check off the consumers' critical path (a wait is an L2 round trip
and a fence; per tile it measured slower than two launches). The semaphore
starts at zero in every call (Pallas zero-fills the global scratch per
launch). Each CTA takes its items in increasing order and all user items
precede all candidate items, so user tiles never wait on anything: the launch
cannot deadlock as long as its `num_sms` CTAs are resident together, which one
CTA per SM guarantees. The interpreter has no global semaphores, so this
variant runs on the GPU only (CPU CI lowers it for an abstract H200).

Ragged M and the K tail rely on TMA bounds handling: loads past the end of a
dimension read zeros and stores past it are dropped, per dimension of the
`[B, M, N]` / `[B, K, N]` tensors, so one candidate's tile never touches its
neighbour's rows. The swizzled TMA tiles need the tiled dimensions of every
operand loaded through them to be multiples of the tile (8 rows, 64 columns),
hence `A` is padded by the caller (to `tile_k` columns), and `E` must have K a
multiple of 8 and N of 64. `user_res` is read with plain loads, so it is padded
to whole CTA tiles. The output is stored with a row tiling of 1, so M needs no
padding there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax._padding import round_up
from ikbo_jax.kernels.mosaic_gpu.common import (
    NUM_CONSUMERS, PRODUCER_REGISTERS, compiler_params, interpret_params,
    num_sms, pipeline_result, smem_transforms)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of one CTA: each consumer computes `tile_m x tile_n`.

  `split` says along which dimension the two consumers' tiles sit side by side
  ("m": they share the `E[b]` tile, "n": they share the `A` tile).
  """

  tile_m: int = 64
  tile_n: int = 256
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_n: int = 64
  split: Literal["m", "n"] = "m"

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (NUM_CONSUMERS if self.split == "m" else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (NUM_CONSUMERS if self.split == "n" else 1)

  def for_n(self, n: int) -> Config:
    """This config with the CTA's N extent shrunk to N rounded up to 64, when N is smaller."""
    cta_tile_n = min(self.cta_tile_n, round_up(n, 64 * NUM_CONSUMERS if self.split == "n" else 64))
    return dataclasses.replace(self, tile_n=cta_tile_n * self.tile_n // self.cta_tile_n)


class _UserGemm(NamedTuple):
  """Refs of the user GEMM computed inside the launch (single-launch forward only)."""

  a: jax.Array  # W_user [M_p, K_user_p]
  e: jax.Array  # E_user [U, K_user, N]
  tiles_done: jax.Array  # a global semaphore: consumers that stored their user tile


def _k_pipeline(config: Config, k: int, max_concurrent_steps: int, dtype):
  """The TMA -> WGMMA pipeline over the K tiles of one output tile."""
  in_transforms = smem_transforms(config.tile_k, dtype)
  spec = functools.partial(plgpu.BlockSpec, transforms=in_transforms)

  def build(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(pl.cdiv(k, config.tile_k),),
        memory_registers=PRODUCER_REGISTERS,
        in_specs=[spec((config.cta_tile_m, config.tile_k), lambda kk: (0, kk)),
                  spec((config.tile_k, config.cta_tile_n), lambda kk: (kk, 0))],
        wg_axis="wg",
        num_compute_wgs=NUM_CONSUMERS,
        max_concurrent_steps=max_concurrent_steps,
        compute_context=compute_context,
    )
  return build


class _TileAt(NamedTuple):
  """Where one output tile lies: its CTA tile indices and this consumer's slices of it."""

  mi: jax.Array
  ni: jax.Array
  first_cand_tile: jax.Array  # the CTA's first candidate tile (it waits for the user tiles)
  wg_m_slice: pl.Slice
  wg_n_slice: pl.Slice


@dataclasses.dataclass(frozen=True)
class _OutputTiles:
  """The persistent loop's work items, `(item, m, n)` output tiles, user items first.

  `wg_m`, `wg_n` are consumer `wg`'s offsets inside the CTA tile.
  """

  cand_to_user_gmem: jax.Array
  a_gmem: jax.Array
  e_gmem: jax.Array
  user_res_gmem: jax.Array | None
  out_gmem: jax.Array
  user: _UserGemm | None
  config: Config
  cand_pipeline: Callable
  user_pipeline: Callable
  pipeline_allocs: object
  out_smem: jax.Array
  wg: jax.Array  # this consumer warpgroup
  wg_m: jax.Array | int
  wg_n: jax.Array | int

  @property
  def num_users(self) -> int:
    return 0 if self.user is None else self.user.e.shape[0]

  @property
  def iters(self) -> tuple[int, int]:
    m, n = self.out_gmem.shape[1], self.e_gmem.shape[2]
    return pl.cdiv(m, self.config.cta_tile_m), pl.cdiv(n, self.config.cta_tile_n)

  def mma(self, _, a_smem, e_smem, acc_ref):
    config = self.config
    plgpu.wgmma(acc_ref, a_smem.at[pl.ds(self.wg_m, config.tile_m)],
                e_smem.at[:, pl.ds(self.wg_n, config.tile_n)])
    plgpu.wgmma_wait(0)
    return acc_ref

  def run(self, loop_info: plgpu.NDLoopInfo):
    """One output tile, by the kind of its item."""
    config, num_users = self.config, self.num_users
    m_iters, n_iters = self.iters
    item, mi, ni = loop_info.index
    # The CTA's first candidate tile: its step before was a user tile or none.
    # That tile waits (one polling thread, an acquire fence, a warpgroup
    # barrier) until every user tile is stored; later tiles need no wait.
    step = (item * m_iters + mi) * n_iters + ni
    num_user_steps = num_users * m_iters * n_iters
    first_cand_tile = (step >= num_user_steps) & (step - lax.axis_size("sm") < num_user_steps)
    at = _TileAt(mi, ni, first_cand_tile, pl.ds(mi * config.cta_tile_m + self.wg_m, config.tile_m),
                 pl.ds(ni * config.cta_tile_n + self.wg_n, config.tile_n))
    if self.user is None:
      self.cand_tile(item, at)
    else:
      pl.when(item < num_users)(lambda: self.user_tile(item, at))
      pl.when(item >= num_users)(lambda: self.cand_tile(item - num_users, at))

  def user_tile(self, u, at: _TileAt):
    """`user_res[u] = W_user @ E_user[u]`, stored in float32; then one signal."""
    config, user = self.config, self.user

    def compute_context(eval_pipeline):
      acc = pipeline_result(eval_pipeline, (config.tile_m, config.tile_n))
      self.user_res_gmem[u, at.wg_m_slice, at.wg_n_slice] = acc
      plgpu.semaphore_signal(user.tiles_done, 1, memory_scope="gpu")

    self.user_pipeline(self.mma, compute_context)(
        user.a.at[pl.ds(at.mi * config.cta_tile_m, config.cta_tile_m), :],
        user.e.at[u, :, pl.ds(at.ni * config.cta_tile_n, config.cta_tile_n)],
        allocations=self.pipeline_allocs)

  def cand_tile(self, b, at: _TileAt):
    """`out[b] = A @ E[b] (+ user_res[cand_to_user[b]])`, stored through shared memory."""
    config = self.config
    self.cand_pipeline(self.mma, functools.partial(self.cand_epilogue, b, at))(
        self.a_gmem.at[pl.ds(at.mi * config.cta_tile_m, config.cta_tile_m), :],
        self.e_gmem.at[b, :, pl.ds(at.ni * config.cta_tile_n, config.cta_tile_n)],
        allocations=self.pipeline_allocs)

  def cand_epilogue(self, b, at: _TileAt, eval_pipeline):
    config, wg = self.config, self.wg
    epi_tile_n, num_epi = config.epi_tile_n, config.tile_n // config.epi_tile_n
    user_tile_ref = None
    if self.user_res_gmem is not None:
      u = self.cand_to_user_gmem[b]
      if self.user is not None:
        m_iters, n_iters = self.iters
        num_user_signals = self.num_users * m_iters * n_iters * NUM_CONSUMERS
        pl.when(at.first_cand_tile)(lambda: plgpu.semaphore_wait(
            self.user.tiles_done, num_user_signals, decrement=False, memory_scope="gpu"))
      user_tile_ref = self.user_res_gmem.at[u, at.wg_m_slice, at.wg_n_slice]

    def load_user_chunk(epi):
      if user_tile_ref is None or epi == num_epi:
        return None
      return plgpu.load(user_tile_ref.at[:, pl.ds(epi * epi_tile_n, epi_tile_n)],
                        layout=plgpu.Layout.WGMMA, optimized=False)

    # Software-pipelined user loads: chunk 0 is in flight during the K loop
    # and each later chunk during the store of the one before, so the
    # epilogue does not wait on global memory latency.
    next_user_chunk = load_user_chunk(0)
    acc = pipeline_result(eval_pipeline, (config.tile_m, config.tile_n))
    for epi in range(num_epi):
      slot = epi % 2
      out_tile = acc[:, epi * epi_tile_n:(epi + 1) * epi_tile_n]
      if user_tile_ref is not None:
        user_chunk, next_user_chunk = next_user_chunk, load_user_chunk(epi + 1)
        out_tile += user_chunk
      # The slot's previous TMA store must have read it before we overwrite.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      self.out_smem[wg, slot] = out_tile.astype(self.out_gmem.dtype)
      plgpu.commit_smem()
      self.out_gmem_store(self.out_smem.at[wg, slot], b, at, epi)

  def out_gmem_store(self, src, b, at: _TileAt, epi: int):
    config = self.config
    col = at.ni * config.cta_tile_n + self.wg_n + epi * config.epi_tile_n
    plgpu.copy_smem_to_gmem(src, self.out_gmem.at[b, at.wg_m_slice,
                                                  pl.ds(col, config.epi_tile_n)])


def _body(cand_to_user_gmem, a_gmem, e_gmem, user_res_gmem, out_gmem, user: _UserGemm | None,
          *, config: Config):
  k = e_gmem.shape[1]
  # Both pipelines share one set of shared-memory slots, so they need the same depth.
  user_k = k if user is None else user.e.shape[1]
  depth = min(config.max_concurrent_steps, pl.cdiv(k, config.tile_k),
              pl.cdiv(user_k, config.tile_k))
  cand_pipeline = _k_pipeline(config, k, depth, e_gmem.dtype)
  user_pipeline = _k_pipeline(config, user_k, depth, e_gmem.dtype)
  ignore = lambda *_, **__: None
  epi_tile_n, out_dtype = config.epi_tile_n, out_gmem.dtype

  def scope(pipeline_allocs, out_smem):
    wg = lax.axis_index("wg")
    wg_m, wg_n = (wg * config.tile_m, 0) if config.split == "m" else (0, wg * config.tile_n)
    tiles = _OutputTiles(cand_to_user_gmem, a_gmem, e_gmem, user_res_gmem, out_gmem, user,
                         config, cand_pipeline, user_pipeline, pipeline_allocs, out_smem, wg,
                         wg_m, wg_n)
    m_iters, n_iters = tiles.iters
    plgpu.nd_loop((tiles.num_users + e_gmem.shape[0], m_iters, n_iters),
                  collective_axes="sm")(tiles.run)

  pl.run_scoped(
      scope,
      pipeline_allocs=cand_pipeline(ignore, ignore).get_allocations(a_gmem, e_gmem.at[0]),
      # Row tiling of 1: a tiling of 8 rows would require M % 8 == 0 in `out`.
      out_smem=plgpu.SMEM((NUM_CONSUMERS, 2, config.tile_m, epi_tile_n), out_dtype,
                          transforms=smem_transforms(epi_tile_n, out_dtype, rows=1)),
      collective_axes="wg",
  )
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(body, out_type, interpret: bool):
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(num_sms(interpret),),
      grid_names=("sm",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
      interpret=interpret_params(interpret),
      kernel_name="ikbo_linear_compression_mosaic_gpu",
  )


def _padded_out_type(num_cands: int, num_rows: int, n: int, dtype, config: Config):
  """The output buffer: at least one whole CTA tile in M and in N.

  A consumer whose tile starts at or past the end of a dimension only as long
  as its own tile (M or N of 64) had its TMA store land at the start of that
  dimension, over the other consumer's rows (H200: wrong results at N = 64).
  With a dimension at least one CTA tile long every store of that first tile
  lies inside the buffer; the padding is sliced off after the launch.
  """
  return jax.ShapeDtypeStruct(
      (num_cands, max(num_rows, config.cta_tile_m), max(n, config.cta_tile_n)), dtype)


def batched_gemm(a, e, user_res=None, cand_to_user=None, *, num_rows: int,
                 config: Config = Config(), interpret: bool = False):
  """`out[b] = a @ e[b] + user_res[cand_to_user[b]]` (or without the user term), rounded once.

  Args:
    a: `[M_p, K_a]`, `M_p >= num_rows` and `K_a >= K` multiples of 8, zero past K.
    e: `[B, K, N]`, bfloat16 or float16, K a multiple of 8, N of 64.
    user_res: None or `[U, M_u, N_u]` float32 with `M_u` and `N_u` whole CTA
      tiles (`config.cta_tile_m`, `config.cta_tile_n`).
    cand_to_user: `int32[B]` with values in `[0, U)`; needed with `user_res`.
    num_rows: M, the rows of the output.
    config: tile sizes.
    interpret: run under the Mosaic GPU interpreter (CPU testing).
  """
  num_cands, _, n = e.shape
  out_type = _padded_out_type(num_cands, num_rows, n, e.dtype, config)
  if user_res is None:
    body = lambda cand_to_user, a, e, out: _body(cand_to_user, a, e, None, out, None,
                                                 config=config)
    cand_to_user = jnp.zeros((1,), jnp.int32)  # unused; keeps one kernel signature
    return _launch(body, out_type, interpret)(cand_to_user, a, e)[:, :num_rows, :n]
  body = lambda cand_to_user, a, e, user_res, out: _body(cand_to_user, a, e, user_res, out, None,
                                                         config=config)
  return _launch(body, out_type, interpret)(cand_to_user, a, e, user_res)[:, :num_rows, :n]


def single_launch_forward(a_user, a_cand, e_user, e_cand, cand_to_user, *, num_rows: int,
                          config: Config = Config()):
  """`out[b] = a_cand @ e_cand[b] + a_user @ e_user[cand_to_user[b]]`, one launch, rounded once.

  Args:
    a_user, a_cand: `[M_p, K_p]` weights, as `a` of `batched_gemm`.
    e_user: `[U, K_user, N]`; `e_cand`: `[B, K_cand, N]`; both as `e` of `batched_gemm`.
    cand_to_user: `int32[B]` with values in `[0, U)`.
    num_rows: M, the rows of the output.
    config: tile sizes.

  Returns:
    `out [B, num_rows, N]` in `e_cand.dtype`.
  """
  num_users, _, n = e_user.shape
  num_cands = e_cand.shape[0]
  m_iters, n_iters = pl.cdiv(num_rows, config.cta_tile_m), pl.cdiv(n, config.cta_tile_n)

  def body(cand_to_user, a_cand, e_cand, a_user, e_user, out, user_res):
    tiles_done = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
    _body(cand_to_user, a_cand, e_cand, user_res, out, _UserGemm(a_user, e_user, tiles_done),
          config=config)

  out_type = (
      _padded_out_type(num_cands, num_rows, n, e_cand.dtype, config),
      # The user results live only inside the launch; float32 keeps the single rounding.
      jax.ShapeDtypeStruct((num_users, m_iters * config.cta_tile_m, n_iters * config.cta_tile_n),
                           jnp.float32))
  out, _ = _launch(body, out_type, interpret=False)(
      cand_to_user, a_cand, e_cand, a_user, e_user)
  return out[:, :num_rows, :n]
