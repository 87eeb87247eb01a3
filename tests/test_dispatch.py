"""Backend resolution and flags: `implementation=None` picks only a backend that runs the inputs."""

import jax.numpy as jnp
import pytest

from ikbo_jax import linear_compression, platform, self_target_attention, target_attention
from ikbo_jax.ops import (
    linear_compression as lce_op, self_target_attention as self_target_op, target_attention as
    target_op)
from ikbo_jax.testing.problems import attention_inputs


# Defect: implementation=None chose Triton for inputs it cannot run (D = 48, 96).
@pytest.fixture
def on_hopper(monkeypatch):
  monkeypatch.setattr(platform, "default_platform", lambda: "gpu")
  monkeypatch.setattr(platform, "is_hopper", lambda: True)


@pytest.mark.parametrize("dtype, head_dim, expected", [
    ("bfloat16", 128, "mosaic_gpu"), ("bfloat16", 96, "xla"), ("float32", 48, "xla"),
    ("float32", 64, "triton"), ("float16", 32, "triton"), ("bfloat16", 512, "xla")])
def test_default_only_picks_an_implementation_that_supports_the_inputs(on_hopper, dtype,
                                                                       head_dim, expected):
  assert target_op.default_implementation(dtype, head_dim) == expected
  self_target_expected = "mosaic_gpu" if expected == "mosaic_gpu" else "xla"
  assert self_target_op.default_implementation(dtype, head_dim) == self_target_expected


def test_default_linear_compression_per_dtype(on_hopper):
  assert lce_op.default_implementation(jnp.bfloat16) == "mosaic_gpu"
  assert lce_op.default_implementation(jnp.float32) == "xla"


def test_named_implementation_that_cannot_run_the_inputs_raises_before_tracing(on_hopper):
  (q, k, v), index = attention_inputs(d=48, dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"implementation='triton' supports head dims .* got D=48"):
    target_attention(q, k, v, index, implementation="triton")
  with pytest.raises(TypeError, match="implementation='mosaic_gpu' supports bfloat16 and float16"):
    target_attention(q, k, v, index, implementation="mosaic_gpu")


def test_flags_must_be_bools():
  (q, k, v), index = attention_inputs()
  with pytest.raises(TypeError, match="checked must be a Python bool, got 'yes'"):
    target_attention(q, k, v, index, checked="yes")
  with pytest.raises(TypeError, match="causal must be a Python bool, got 'yes'"):
    self_target_attention(k, q, k, v, index, causal="yes")
  with pytest.raises(TypeError, match="interpret must be a Python bool"):
    linear_compression(*[jnp.ones(s) for s in ((2, 3), (2, 4), (3, 3, 5), (6, 4, 5))], index,
                       interpret=1)
