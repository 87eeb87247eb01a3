"""`Trainer`: steps, evaluation and checkpoints of a `Ranker` on a stream of requests.

A request source is any `source(i) -> Request` (a `ClickGenerator`'s
`request`, or a list of requests read from files). Each step takes requests
from a cursor while they fit the step's static shape (`num_users` user and
`num_candidates` candidate slots), so the compiled step never changes shape
and no candidate is dropped. A checkpoint holds the model, the optimizer and
the cursor: a run restored from step `k` takes the same step `k + 1` as the
run that saved it.

Divergence: an update whose loss or gradients are not finite is never applied
(`optax.apply_if_finite`); the trainer counts such steps and raises
`Divergence` naming the step, its requests and the last checkpoint once more
than `TrainConfig.max_skipped_steps` occurred (default none). It checks the
steps' flags every `log_every` steps, so the host never waits on a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from sklearn.metrics import roc_auc_score
from tqdm.auto import tqdm

from ikbo_jax.data import Request, RequestError, pack_requests
from ikbo_jax.models import Build, Ranker, RankerConfig, RankingBatch, masked_loss, scores
from ikbo_jax.models import checkpoint

Source = Callable[[int], Request]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Attributes:
    num_users: user slots per step (requests at most).
    num_candidates: candidate slots per step.
    learning_rate: peak learning rate (AdamW, cosine decay over `steps`).
    steps: the schedule's length.
    weight_decay: AdamW's decay.
    build: which forward pass trains (`Build`, or its name); same parameters either way.
    max_skipped_steps: steps with a non-finite loss or gradient skipped (not applied)
      before the run stops with `Divergence`.
    num_groups: group slots per step for a model with a group level (default
      `num_candidates`, which every step's groups fit).
  """

  num_users: int = 16
  num_candidates: int = 256
  learning_rate: float = 3e-3
  steps: int = 300
  weight_decay: float = 1e-4
  build: Build = Build.IKBO
  max_skipped_steps: int = 0
  num_groups: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "build", Build.parse(self.build))
    for name in ("num_users", "num_candidates", "steps"):
      if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
        raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
    if self.num_groups is not None and not (isinstance(self.num_groups, int)
                                            and self.num_groups > 0):
      raise ValueError(f"num_groups must be a positive int or None, got {self.num_groups!r}")
    if not (isinstance(self.max_skipped_steps, int) and self.max_skipped_steps >= 0):
      raise ValueError(f"max_skipped_steps must be an int >= 0, got {self.max_skipped_steps!r}")


class Divergence(RuntimeError):
  """Training produced non-finite losses or gradients more often than allowed."""


# apply_if_finite gives up skipping after this many non-finite steps in a row: never.
_ALWAYS_SKIP = 2**31 - 1


@nnx.jit(static_argnames="build")
def _train_step(model: Ranker, optimizer: nnx.Optimizer, batch: RankingBatch, build: Build):
  """`(loss, finite)`: the update is applied only where the loss and gradients are finite."""
  loss, grads = nnx.value_and_grad(lambda m: masked_loss(scores(m, batch, build), batch))(model)
  with jax.named_scope("optimizer"):
    optimizer.update(model, grads)
  with jax.named_scope("finite_check"):
    finite = jnp.isfinite(loss) & jax.tree.reduce(
        lambda ok, g: ok & jnp.all(jnp.isfinite(g)), grads, jnp.bool_(True))
  return loss, finite


@nnx.jit(static_argnames="build")
def _eval_step(model: Ranker, batch: RankingBatch, build: Build):
  return jax.nn.sigmoid(scores(model, batch, build))


class Trainer:
  """Trains `Ranker(model_config)` on `source` with `train_config`.

  Example:

  >>> from ikbo_jax.data.synthetic import ClickGenerator
  >>> from ikbo_jax.models import RankerConfig
  >>> from ikbo_jax.training import TrainConfig, Trainer
  >>> config = RankerConfig()
  >>> trainer = Trainer(config, TrainConfig(steps=2), ClickGenerator(config, seed=0).request)
  >>> losses = [trainer.step() for _ in range(2)]
  >>> trainer.step_count, trainer.cursor > 0
  (2, True)
  """

  def __init__(self, model_config: RankerConfig, train_config: TrainConfig, source: Source, *,
               seed: int = 0):
    self.model_config, self.train_config, self.source = model_config, train_config, source
    self.model = Ranker(model_config, rngs=nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, train_config.learning_rate, min(50, train_config.steps // 10 + 1),
        train_config.steps)
    self.optimizer = nnx.Optimizer(
        self.model, optax.apply_if_finite(
            optax.adamw(schedule, weight_decay=train_config.weight_decay), _ALWAYS_SKIP),
        wrt=nnx.Param)
    self.cursor = 0  # the next request of `source`
    self.step_count = 0
    self.skipped_steps = 0  # non-finite steps, not applied
    self.last_saved: tuple[int, str] | None = None  # (step, directory) of the newest sealed save
    self._unchecked: list = []  # (step, first request, finite flag) not yet looked at
    self._managers: dict[str, ocp.CheckpointManager] = {}  # by directory, for async saves
    self._pending: tuple[str, int] | None = None  # a save not yet sealed

  def next_batch(self) -> tuple[RankingBatch, int]:
    """The next step's batch from the cursor on, and how many candidates it holds."""
    t = self.train_config
    taken, total, groups = [], 0, 0
    group_slots = t.num_groups or t.num_candidates
    while len(taken) < t.num_users:
      try:
        request = self.source(self.cursor + len(taken)).validated(self.model_config)
      except RequestError as e:
        raise RequestError(f"request {self.cursor + len(taken)}: {e}") from None
      if request.num_candidates > t.num_candidates:
        raise RequestError(f"request {self.cursor + len(taken)} has {request.num_candidates} "
                           f"candidates; a step holds num_candidates={t.num_candidates}")
      if request.num_groups > group_slots:
        raise RequestError(f"request {self.cursor + len(taken)} has {request.num_groups} "
                           f"groups; a step holds num_groups={group_slots}")
      if (total + request.num_candidates > t.num_candidates
          or groups + request.num_groups > group_slots):
        break
      taken.append(request)
      total += request.num_candidates
      groups += request.num_groups
    self.cursor += len(taken)
    batch = pack_requests(taken, self.model_config, num_users=t.num_users,
                          num_candidates=t.num_candidates, num_groups=t.num_groups)
    return batch, total

  def step(self) -> float:
    """One optimizer step; returns its loss (`Divergence` past the skip bound)."""
    loss = float(self._step()[0])
    self.check_divergence()
    return loss

  def _step(self) -> tuple[jax.Array, int]:
    """One optimizer step, not waited for: its loss and how many candidates it took."""
    first_request = self.cursor
    batch, count = self.next_batch()
    loss, finite = _train_step(self.model, self.optimizer, batch, self.train_config.build)
    self.step_count += 1
    self._unchecked.append((self.step_count, first_request, finite))
    return loss, count

  def check_divergence(self) -> None:
    """Counts the non-finite steps since the last check; `Divergence` past the bound."""
    unchecked, self._unchecked = self._unchecked, []
    for step, first_request, finite in unchecked:
      if bool(finite):
        continue
      self.skipped_steps += 1
      if self.skipped_steps > self.train_config.max_skipped_steps:
        raise Divergence(
            f"step {step} (requests from {first_request}) gave a non-finite loss or gradient "
            f"({self.skipped_steps} such steps, max_skipped_steps="
            f"{self.train_config.max_skipped_steps}); no non-finite update was applied; the "
            f"last checkpoint is {describe_save(self.last_saved)}")

  def fit(self, steps: int, *, progress: bool = True, log_every: int = 10,
          after_step: Callable[[], bool] | None = None) -> list[float]:
    """`steps` steps under a progress bar (loss, candidates/s); returns the losses.

    The first step compiles: it runs before the bar starts (with a line saying
    so and how long it took), so the bar's rate and time estimate are the
    steady state's. `after_step()` runs after each step (periodic saves); the
    run stops early when it returns True.
    """
    if steps <= 0:
      return []
    start = time.perf_counter()
    if progress:
      print(f"compiling the training step ({self.train_config.build} build)...", flush=True)
    first, _ = self._step()
    losses = [float(first)]
    self.check_divergence()
    if progress:
      print(f"  compiled and ran step 1 in {time.perf_counter() - start:.1f} s", flush=True)
    if after_step is not None and after_step():
      return losses
    bar = tqdm(range(1, steps), initial=1, total=steps, disable=not progress, unit="step",
               desc=f"train ({self.train_config.build})")
    start, seen = time.perf_counter(), 0
    for _ in bar:
      loss, count = self._step()
      losses.append(loss)
      seen += count
      if len(losses) % log_every == 0 or len(losses) == steps:
        losses[-1] = float(losses[-1])  # waits for the step: the rate is honest
        self.check_divergence()
        bar.set_postfix(loss=f"{losses[-1]:.4f}",
                        cands_per_s=f"{seen / (time.perf_counter() - start):.0f}")
      if after_step is not None and after_step():
        break
    bar.close()
    return [float(x) for x in losses]

  def evaluate(self, requests: list[Request]) -> dict:
    """AUC and mean loss over `requests` (each scored once; labels required)."""
    t, preds, labels = self.train_config, [], []
    requests = [r.validated(self.model_config) for r in requests]
    if any(r.labels is None for r in requests):
      raise ValueError("evaluation requests need labels")
    for start in range(0, len(requests), t.num_users):
      chunk = requests[start:start + t.num_users]
      # One request per slot may still overflow the candidate slots: pack what fits.
      while chunk:
        fit = _fitting_prefix(chunk, t.num_candidates, t.num_groups)
        batch = pack_requests(chunk[:fit], self.model_config, num_users=t.num_users,
                              num_candidates=t.num_candidates, num_groups=t.num_groups)
        n = int(np.sum(batch.candidate_mask()))
        preds.append(np.asarray(_eval_step(self.model, batch, t.build))[:n])
        labels.append(batch.labels[:n])
        chunk = chunk[fit:]
    preds, labels = np.concatenate(preds), np.concatenate(labels)
    if not np.isfinite(preds).all():  # a diverged model: reported, not a crash
      return dict(auc=float("nan"), loss=float("nan"), candidates=int(labels.size),
                  click_rate=float(labels.mean()),
                  non_finite_scores=int((~np.isfinite(preds)).sum()))
    eps = 1e-7
    loss = -np.mean(labels * np.log(preds + eps) + (1 - labels) * np.log(1 - preds + eps))
    return dict(auc=float(roc_auc_score(labels, preds)), loss=float(loss),
                candidates=int(labels.size), click_rate=float(labels.mean()))

  def save(self, directory: str | os.PathLike, *, wait: bool = True) -> None:
    """Checkpoints the parameters, the optimizer and the cursor at this step (orbax).

    With `wait=False` the files are written in the background while training
    goes on; a step is trusted (sealed with its checksums) once its files are
    complete, which `seal_finished_save` checks. A new save first waits for the
    previous one.
    """
    directory = os.path.abspath(directory)
    if directory not in self._managers:
      self._managers[directory] = checkpoint.manager(directory)
    self.seal_finished_save(wait=True)
    if checkpoint.step_dir(directory, self.step_count).exists():
      # orbax would skip a step that exists, and its old files would be sealed as this save.
      checkpoint.set_aside(directory, self.step_count,
                           f"replaced by a new save of step {self.step_count}")
      self._managers[directory].reload()
    self._managers[directory].save(self.step_count, args=ocp.args.Composite(
        **{checkpoint.PARAMS: checkpoint.save_args(self.model)},
        optimizer=checkpoint.save_args(self.optimizer),
        meta=ocp.args.JsonSave(dict(cursor=self.cursor, step=self.step_count,
                                    schedule_steps=self.train_config.steps,
                                    build=str(self.train_config.build)))))
    self._pending = (directory, self.step_count)
    if wait:
      self.seal_finished_save(wait=True)

  def seal_finished_save(self, wait: bool = False) -> None:
    """Seals the last save if its files are complete (or, with `wait`, once they are).

    A save that failed (a full or read-only disk, a file size limit) raises
    `CheckpointError` naming the step and the cause, once, after what it left
    behind is removed (`checkpoint.discard_unsealed`); `last_saved` stays the
    last good step.
    """
    if self._pending is None:
      return
    directory, step = self._pending
    manager = self._managers[directory]
    if not wait and manager.is_saving_in_progress():
      return
    self._pending = None  # settled now, whatever follows: a failure is reported once
    try:
      manager.wait_until_finished()  # re-raises what the background write raised
      manager.check_for_errors()
      if not checkpoint.step_dir(directory, step).is_dir():
        raise OSError("its files were not written")
      checkpoint.seal(directory, step)
    except Exception as e:  # orbax raises ValueError, OSError or RuntimeError alike
      checkpoint.discard_unsealed(directory, step)
      cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise checkpoint.CheckpointError(
          f"saving step {step} under {directory} failed: {cause[:300]}") from None
    self.last_saved = (step, directory)

  def close(self) -> None:
    """Waits for a save in flight, seals it and closes the checkpoint managers."""
    try:
      self.seal_finished_save(wait=True)
    finally:
      for manager in self._managers.values():
        with contextlib.suppress(Exception):  # a manager whose save failed may fail to close
          manager.close()
      self._managers.clear()

  def state_bytes(self) -> int:
    """Bytes of one checkpoint's arrays (the parameters and the optimizer)."""
    leaves = jax.tree.leaves((nnx.state(self.model), nnx.state(self.optimizer)))
    return int(sum(x.nbytes for x in leaves if hasattr(x, "nbytes")))

  def restore(self, directory: str | os.PathLike, step: int | None = None) -> int:
    """Restores the newest checkpoint that verifies and restores (or `step`'s); returns its step.

    Newer ones that do not are skipped with a warning and moved aside for good
    (`models.checkpoint.restore_newest`); `CheckpointError` if none is good.
    """
    def restore(step):
      restored = manager.restore(step, args=ocp.args.Composite(
          **{checkpoint.PARAMS: checkpoint.restore_args(self.model)},
          optimizer=checkpoint.restore_args(self.optimizer), meta=ocp.args.JsonRestore()))
      meta = restored["meta"]
      if not all(isinstance(meta.get(k), int) and meta[k] >= 0 for k in ("cursor", "step")):
        raise checkpoint.CheckpointError(
            f"its cursor and step must be ints >= 0, got {meta.get('cursor')!r} and "
            f"{meta.get('step')!r}")
      if meta["step"] != step:
        raise checkpoint.CheckpointError(f"its metadata names step {meta['step']}, not {step}")
      return restored

    with checkpoint.manager(directory) as manager:
      step, restored = checkpoint.restore_newest(manager, directory, restore, step,
                                                 set_aside_failures=True)
    meta = restored["meta"]
    checkpoint.update(self.model, restored[checkpoint.PARAMS])
    checkpoint.update(self.optimizer, restored["optimizer"])
    self.cursor, self.step_count = meta["cursor"], meta["step"]
    self.last_saved = (step, os.path.abspath(directory))
    return step


def describe_save(saved: tuple[int, str] | None) -> str:
  """`Trainer.last_saved` in words."""
  return "none" if saved is None else f"step {saved[0]} under {saved[1]}"


def _fitting_prefix(requests: list[Request], num_candidates: int,
                    num_groups: int | None = None) -> int:
  """How many of `requests`, from the first, fit one batch's candidate (and group) slots."""
  total = np.cumsum([r.num_candidates for r in requests])
  fit = int(np.searchsorted(total, num_candidates, side="right"))
  groups = np.cumsum([r.num_groups for r in requests])
  fit = min(fit, int(np.searchsorted(groups, num_groups or num_candidates, side="right")))
  if fit == 0:
    raise RequestError(f"a request has {requests[0].num_candidates} candidates and "
                       f"{requests[0].num_groups} groups; a batch holds num_candidates="
                       f"{num_candidates} and num_groups={num_groups or num_candidates}")
  return fit
