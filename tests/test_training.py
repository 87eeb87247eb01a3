"""Training: the loss falls and AUC rises on the synthetic stream; checkpoints resume exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.data import Request, RequestError, files
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import RankerConfig, load_ranker
from ikbo_jax.training import Divergence, TrainConfig, Trainer, __main__ as train_command

CONFIG = RankerConfig()


def test_training_learns_the_hidden_rule():
  gen = ClickGenerator(CONFIG, seed=0)
  held_out = gen.requests(200, start=10**9)
  trainer = Trainer(CONFIG, TrainConfig(steps=150), gen.request)
  before = trainer.evaluate(held_out)
  losses = trainer.fit(150, progress=False)
  after = trainer.evaluate(held_out)
  assert np.mean(losses[-20:]) < np.mean(losses[:20]) - 0.05
  assert before["auc"] < 0.6 < 0.7 < after["auc"], (before, after)


def test_resumed_run_takes_the_same_next_step(tmp_path):
  source = ClickGenerator(CONFIG, seed=1).request
  first = Trainer(CONFIG, TrainConfig(steps=10), source)
  first.fit(3, progress=False)
  first.save(tmp_path)
  saved_cursor = first.cursor
  next_loss = first.step()

  resumed = Trainer(CONFIG, TrainConfig(steps=10), source, seed=7)  # other initial weights
  assert resumed.restore(tmp_path) == 3 and resumed.cursor == saved_cursor
  assert resumed.step() == pytest.approx(next_loss, rel=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(first.model)), jax.tree.leaves(nnx.state(resumed.model))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  served = load_ranker(CONFIG, tmp_path)  # what `python -m ikbo_jax.serving` restores
  assert resumed.restore(tmp_path, step=3) == 3
  for a, b in zip(jax.tree.leaves(nnx.state(served)), jax.tree.leaves(nnx.state(resumed.model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_without_a_checkpoint_says_so(tmp_path):
  trainer = Trainer(CONFIG, TrainConfig(steps=2), ClickGenerator(CONFIG, seed=0).request)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    trainer.restore(tmp_path / "empty")


def test_parquet_round_trip_and_training_from_files(tmp_path):
  gen = ClickGenerator(CONFIG, seed=2)
  requests = gen.requests(40)
  files.write_requests(requests[:30], tmp_path / "train.parquet")
  files.write_requests(requests[30:], tmp_path / "eval.parquet")
  back = files.read_requests(tmp_path / "train.parquet", CONFIG)
  for a, b in zip(requests, back):
    for field in dataclasses.fields(Request):
      np.testing.assert_array_equal(getattr(a, field.name), getattr(b, field.name))
  report = train_command.main(["--steps", "4", "--train-file", str(tmp_path / "train.parquet"),
                               "--eval-file", str(tmp_path / "eval.parquet"), "--no-progress",
                               "--checkpoint-dir", str(tmp_path / "ckpt")])
  assert report["steps"] == 4 and 0 <= report["auc_after"] <= 1
  resumed = train_command.main(["--steps", "6", "--train-file", str(tmp_path / "train.parquet"),
                                "--eval-file", str(tmp_path / "eval.parquet"), "--no-progress",
                                "--checkpoint-dir", str(tmp_path / "ckpt")])
  assert resumed["steps"] == 6


def test_a_bad_training_request_is_named():
  good = ClickGenerator(CONFIG, seed=0).request
  bad = lambda i: dataclasses.replace(good(i), cand_items=np.array([CONFIG.num_items] * 3),
                                      cand_dense=np.zeros((3, CONFIG.cand_dense))) if i == 2 else good(i)
  trainer = Trainer(CONFIG, TrainConfig(steps=2), bad)
  with pytest.raises(RequestError, match=r"request 2: cand_items holds unknown item ids \[500"):
    trainer.step()


def test_divergence_stops_the_run_naming_the_step_and_never_applies_a_non_finite_update():
  """Learning rate 1000: the loss became NaN at every step and the run went on to crash in AUC."""
  gen = ClickGenerator(CONFIG, seed=0)
  trainer = Trainer(CONFIG, TrainConfig(steps=40, learning_rate=1000.0), gen.request)
  with pytest.raises(Divergence, match=r"step \d+ \(requests from \d+\) gave a non-finite "
                                       r"loss .* the last checkpoint is none"):
    trainer.fit(40, progress=False)
  params = jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in params)
  report = trainer.evaluate(gen.requests(20, start=10**9))  # no crash on a diverged model
  assert report["candidates"] > 0


def test_a_poisoned_batch_is_skipped_and_counted_up_to_the_bound():
  gen = ClickGenerator(CONFIG, seed=0)

  def source(i):
    request = gen.request(i)
    if i == 5:  # finite, valid, and enough to overflow the loss
      return dataclasses.replace(request, user_dense=np.full_like(request.user_dense, 3e38))
    return request

  trainer = Trainer(CONFIG, TrainConfig(steps=6, max_skipped_steps=2), source)
  losses = trainer.fit(6, progress=False)
  assert trainer.skipped_steps == 1 and not np.isfinite(losses).all()
  params = jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in params)
