"""Splitting batches by request (`ikbo_jax.sharding`), and the sharded ops and ranker on 8
simulated devices (tests/multidevice, in a subprocess: the device count is fixed at jax's start)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from ikbo_jax.sharding import plan_shards

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_plan_keeps_users_whole_and_balances_candidates():
  rng = np.random.default_rng(0)
  counts = rng.integers(1, 40, 37)
  ids = rng.permutation(np.repeat(np.arange(37), counts))
  plan = plan_shards(ids, 37, 4)
  local = plan.local_cand_to_user.reshape(4, -1)
  sources = plan.cand_source.reshape(4, -1)
  users = plan.user_source.reshape(4, -1)
  for shard in range(4):
    real = sources[shard] >= 0
    # Each candidate's user sits in the same shard, at the local slot its id names.
    np.testing.assert_array_equal(users[shard][local[shard][real]], ids[sources[shard][real]])
    assert (local[shard][~real] == plan.users_per_shard).all()
  loads = (sources >= 0).sum(axis=1)
  assert loads.max() <= 4 / 3 * counts.sum() / 4 + counts.max()
  np.testing.assert_array_equal(plan.restore(plan.candidates(ids)), ids)
  assert sorted(plan.user_source[plan.user_source >= 0]) == list(range(37))


def test_plan_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r"cand_to_user must lie in \[0, num_users=3\), got ids in"):
    plan_shards(np.array([0, 3]), 3, 2)
  with pytest.raises(ValueError, match="num_shards must be a positive int, got 0"):
    plan_shards(np.array([0, 1]), 3, 0)
  with pytest.raises(ValueError, match="users_per_shard=1 x num_shards=2 slots cannot hold"):
    plan_shards(np.array([0, 1, 2]), 3, 2, users_per_shard=1)
  with pytest.raises(ValueError, match="candidates_per_shard=1 is too few"):
    plan_shards(np.array([0, 0, 1]), 2, 2, candidates_per_shard=1)
  with pytest.raises(ValueError, match="cand_to_user must be a 1-D int array"):
    plan_shards(np.zeros((2, 2), np.int32), 3, 2)


def test_sharded_ops_and_ranker_on_eight_simulated_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/multidevice/check_sharding.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  assert "\n4 passed" in result.stdout, result.stdout[-2000:]
