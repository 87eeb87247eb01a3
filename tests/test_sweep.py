"""The sweep and the error rule themselves: they can fail, and they run on a CPU."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ikbo_jax.testing import error_rule, sweep


def _outputs(seed=0, rows=50, cols=64):
  rng = np.random.default_rng(seed)
  f32 = rng.normal(size=(rows, cols))
  same = f32 + rng.normal(size=f32.shape) * 4e-3  # bfloat16-sized rounding
  return f32, same


def test_rule_passes_an_output_as_good_as_the_reference():
  f32, same = _outputs()
  out = f32 + np.random.default_rng(1).normal(size=f32.shape) * 5e-3
  assert error_rule.compare("out", out, same, f32, jnp.bfloat16).ok


def test_rule_catches_one_wrong_row_that_the_global_norm_averages_away():
  f32, same = _outputs(rows=2000)
  out = same.copy()
  out[17] *= 0.9  # one candidate's row 10% off: 0.2% of the global norm
  comparison = error_rule.compare("out", out, same, f32, jnp.bfloat16)
  assert comparison.kernel_err <= 2 * comparison.reference_err + comparison.floor
  assert not comparison.ok and comparison.worst_row == 17


def test_rule_catches_misplaced_non_finite_values():
  f32, same = _outputs()
  out = same.copy()
  out[3, 5] = np.nan
  assert not error_rule.compare("out", out, same, f32, jnp.bfloat16).finite_pattern_ok
  f32[4, :] = -np.inf  # where the truth is -inf (an empty history's lse), so must the output be
  same[4, :] = out[4, :] = -np.inf
  out[3, 5] = same[3, 5]
  assert error_rule.compare("out", out, same, f32, jnp.bfloat16).ok


def test_rule_judges_near_zero_rows_on_the_tensor_scale():
  """A row whose true value is ~0 (e.g. dq of a one-key history) gets rounding noise only."""
  f32, same = _outputs()
  f32[0] = same[0] = 0.0
  out = same.copy()
  out[0] = 1e-6
  assert error_rule.compare("dq", out, same, f32, jnp.bfloat16).ok


def test_draws_cover_the_promised_space():
  lce = [sweep.draw_linear_compression_case(s) for s in range(300)]
  att = [sweep.draw_attention_case(s) for s in range(300)]
  assert {c.n for c in lce} >= {1, 64, 65, 256}
  assert min(c.m for c in lce) == 1 and max(c.k_cand for c in lce) > 500
  assert any(c.mapping.num_candidates >= 500 * c.mapping.num_users for c in lce)  # ratio
  assert any(c.mapping.num_empty for c in lce) and any(c.mapping.sorted for c in lce)
  assert {c.dtype for c in lce} == set(sweep.DTYPES)
  lengths = {n for c in att for n in c.kv_len}
  assert {0, 1, 127, 128, 129} <= lengths
  assert {1, 64, 512} <= {c.n_seed for c in att} and max(c.seq_len for c in att) >= 4000
  assert {16, 48, 64, 96, 128} <= {c.head_dim for c in att}


def test_two_level_draws_cover_the_promised_space():
  cases = [sweep.draw_two_level_linear_compression_case(s) for s in range(300)]
  maps = [c.mapping for c in cases]
  assert any(m.num_groups == 1 for m in maps) and any(m.num_groups == m.num_items for m in maps)
  assert any(m.num_items >= 500 * m.num_groups for m in maps)  # items per group
  assert any(m.num_groups >= 500 * m.num_users for m in maps)  # groups per user
  assert any(m.empty_groups for m in maps) and any(m.users_without_groups for m in maps)
  assert any(m.sorted for m in maps) and {c.dtype for c in cases} == set(sweep.DTYPES)
  assert {1, 433} <= {c.m for c in cases} and 512 in {c.k_group for c in cases}


# The two-level ops' CPU cases are in test_two_level*.py (shapes these draws shrink to one item).
@pytest.mark.parametrize("op", [op for op in sweep.OPS if not op.startswith("two_level")])
@pytest.mark.parametrize("seed", [0])
def test_cpu_sweep_of_the_xla_implementations(op, seed):
  results = sweep.run_case(sweep.draw_case(op, seed, size=0.002))
  assert results
  assert all(r.ok for r in results), "\n".join(r.describe() for r in results)


def test_sweep_fails_a_wrong_implementation(monkeypatch):
  """The sweep is only worth its passes if it fails a wrong kernel: perturb one candidate."""
  from ikbo_jax.ops import linear_compression_xla
  case = sweep.draw_case("linear_compression", 3, size=0.002)
  case = dataclasses.replace(case, mapping=dataclasses.replace(case.mapping, num_candidates=40))
  decomposed = linear_compression_xla.decomposed
  monkeypatch.setattr(linear_compression_xla, "decomposed",
                      lambda *a, **k: decomposed(*a, **k).at[7].multiply(1.1))
  results = {r.implementation: r for r in sweep.run_case(case)}
  assert not results["xla"].ok and results["xla_materialized"].ok


def test_the_old_name_of_the_mosaic_gpu_backward_path_still_works_and_warns():
  with pytest.warns(DeprecationWarning, match="'mosaic_gpu'"):
    assert sweep.HOPPER_BACKWARD == "mosaic_gpu"
  with pytest.raises(AttributeError):
    sweep.NO_SUCH_NAME


def test_attention_draws_peaked_softmaxes_and_cases_without_an_lse_cotangent():
  cases = [sweep.draw_attention_case(s) for s in range(200)]
  assert {c.peak for c in cases} == {0.0, *sweep.PEAKS}
  assert 0.15 < np.mean([c.peak > 0 for c in cases]) < 0.45
  assert 0.15 < np.mean([not c.lse_cotangent for c in cases]) < 0.45
  assert all(sweep.draw_attention_case(s, True).lse_cotangent for s in range(50))
