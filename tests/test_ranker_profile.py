"""The ranker's kernel profile: what the HLO reader counts, and every kernel of a step placed."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from benchmarks import hlo_cost, ranker_profile
from benchmarks.problems import functional_step, ranking_batch
from ikbo_jax.models import Ranker, RankerConfig

CEILINGS = dict(matmul_tflops=1.0, copy_tbps=1.0)


def _parsed(fn, *args) -> dict[str, hlo_cost.Instruction]:
  return hlo_cost.parse(jax.jit(fn).lower(*args).compile().as_text())


def test_a_products_flops_and_bytes_are_counted_once():
  a, b = jnp.ones((64, 32)), jnp.ones((32, 16))
  # The product, and the fusion around it where XLA made one: the kernel the profile names.
  products = [i for i in _parsed(lambda a, b: jnp.tanh(a @ b), a, b).values() if i.flops]
  assert {p.flops for p in products} == {2 * 64 * 32 * 16}
  assert all(p.bytes >= 4 * (64 * 32 + 32 * 16 + 64 * 16) for p in products)


def test_named_scopes_and_the_backward_reach_op_names():
  def loss(w, x):
    with jax.named_scope("tower"):
      return jnp.sum(jnp.tanh(x @ w))
  names = {i.op_name for i in _parsed(jax.grad(loss), jnp.ones((8, 8)), jnp.ones((4, 8))).values()}
  assert any("transpose(jvp(tower))" in n for n in names), names
  assert any("jvp(tower)" in n and "transpose" not in n for n in names), names


@pytest.mark.parametrize("dtype, itemsize", [("bf16", 2), ("f32", 4), ("pred", 1), ("s64", 8),
                                              ("f8e4m3fn", 1), ("c64", 8)])
def test_element_sizes(dtype, itemsize):
  assert hlo_cost._itemsize(dtype) == itemsize


def test_every_kernel_of_a_training_step_is_placed():
  config = RankerConfig()
  batch = ranking_batch(config, 8, 64, seed=1)
  model = Ranker(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))
  result = ranker_profile.profile(functional_step(graphdef, "ikbo"), (state, batch), 1, CEILINGS)
  assert result["matched_fraction"] == 1.0 and result["kernels_per_call"] > 0
  parts = {row["part"] for row in result["by_part"]}
  assert {"sequence", "linear_compression", "tower", "optimizer", "candidate_embeddings"} <= parts
  phases = {(row["part"], row["phase"]) for row in result["by_part_phase_kind"]}
  assert {("tower", "forward"), ("tower", "backward"), ("optimizer", "update")} <= phases
  assert sum(row["ms"] for row in result["by_part"]) == pytest.approx(result["kernel_ms"])
  assert all(0 <= row["floor_ms"] <= row["ms"] for row in result["kernels"])


def test_unmatched_kernels_are_named_by_what_they_run():
  assert ranker_profile.classify(None, "nvjet_sm90_tst_128x160") == dict(
      part="unmatched", phase="unknown", kind="gemm")


def test_the_script_writes_its_result_and_hlo(tmp_path):
  out = tmp_path / "profile.json"
  subprocess.run([sys.executable, "-m", "benchmarks.ranker_profile", "--small", "--iterations",
                  "1", "--parts", "inference", "--hlo-dir", str(tmp_path), "--out", str(out)],
                 check=True)
  result = json.loads(out.read_text())
  assert result["commit"] and result["inference"]["kernel_ms"] > 0
  assert (tmp_path / "ranker_inference.hlo.txt.gz").stat().st_size > 0
