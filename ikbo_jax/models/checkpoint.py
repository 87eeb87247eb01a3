"""The model's checkpoint format: parameters under their own item, apart from any optimizer.

A checkpoint is an orbax `CheckpointManager` step holding named items. The
model layer owns one of them, `PARAMS` (the `Ranker`'s state as a pure dict);
training adds its own (the optimizer, its cursor) beside it. Serving reads the
parameters alone, so it never builds an optimizer (Flax's checkpointing guide
keeps model state apart from the training loop the same way).

Integrity: once a step is written, `seal` records the step's number and the
SHA-256 of every file in it (`integrity.json`); `verify` recomputes them and
checks that the directory holds the step it is named for (a swapped or
renamed directory does not). Whoever restores, training or serving, takes the
newest step that verifies and restores (`restore_newest`), warns about every
newer one that does not, and fails naming the files when none does: a flipped
byte is never restored silently. A step without a seal is not trusted.

A step that failed is never trusted again: training moves it aside (under
`rejected/`, with the reason) before anything is saved at its number, so a
later save of the same step writes new files instead of finding the old ones
(orbax skips a step that exists) and sealing them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
import warnings
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ikbo_jax.models.config import RankerConfig
from ikbo_jax.models.ranker import Ranker

PARAMS = "params"
SEAL = "integrity.json"
REJECTED = "rejected"  # steps that failed verification or a restore, each with its reason


class CheckpointError(RuntimeError):
  """No checkpoint under a directory verifies; the message names what failed."""


KEPT = 3  # checkpoints a directory keeps (a fourth is written before the oldest goes)


def manager(directory: str | os.PathLike, max_to_keep: int = KEPT) -> ocp.CheckpointManager:
  """An orbax manager of `directory`; it removes the temporary files of saves that died."""
  return ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, cleanup_tmp_directories=True))


def save_args(obj):
  """The orbax save argument of an NNX object's state (a module's parameters, an optimizer)."""
  return ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(obj)))


def restore_args(obj):
  """The orbax restore argument for an NNX object's state: its shapes and dtypes."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(nnx.state(obj)))
  return ocp.args.StandardRestore(abstract)


def update(obj, restored) -> None:
  """Puts a restored state (a pure dict) into the NNX object it was saved from."""
  state = nnx.state(obj)
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(obj, state)


def _digests(step_dir: pathlib.Path) -> dict[str, str]:
  return {str(f.relative_to(step_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
          for f in sorted(step_dir.rglob("*")) if f.is_file() and f.name != SEAL}


def step_dir(directory, step: int) -> pathlib.Path:
  return pathlib.Path(os.path.abspath(directory)) / str(step)


def seal(directory, step: int) -> None:
  """Records the step's number and the checksums of its files, once they are all written.

  The seal is written whole or not at all (a temporary file renamed), so a disk that fills
  while it is written leaves the step unsealed, never sealed with a truncated record.
  """
  path = step_dir(directory, step)
  record = json.dumps(dict(step=step, files=_digests(path)), indent=0)
  partial = path / (SEAL + ".partial")
  try:
    partial.write_text(record)
    os.replace(partial, path / SEAL)
  finally:
    partial.unlink(missing_ok=True)


def discard_unsealed(directory, step: int) -> None:
  """Removes what a save of `step` that failed left behind: its unsealed files, orbax's tmp.

  A sealed step is never touched: only one whose save or seal did not finish, which no
  restore would trust, and which holds the room a full disk needs back.
  """
  path = step_dir(directory, step)
  for partial in path.parent.glob(f"{step}.orbax-checkpoint-tmp*"):
    shutil.rmtree(partial, ignore_errors=True)
  if path.is_dir() and not (path / SEAL).exists():
    shutil.rmtree(path, ignore_errors=True)


def verify(directory, step: int) -> str | None:
  """None if step `step` is intact, else what is wrong with it (naming the file)."""
  path = step_dir(directory, step)
  try:
    sealed = json.loads((path / SEAL).read_text())
  except FileNotFoundError:
    return f"{path} has no {SEAL} (a save that did not finish)"
  except (OSError, ValueError) as e:
    return f"{path / SEAL} is unreadable: {e}"
  if not isinstance(sealed, dict):
    return f"{path / SEAL} is not a seal"
  if "files" in sealed:
    if sealed.get("step") != step:
      return f"{path} holds step {sealed.get('step')!r} by its {SEAL}, not step {step}"
    sealed = sealed["files"]  # seals written before 2026-12-06 hold the digests alone
  actual = _digests(path)
  for name in sorted(set(sealed) | set(actual)):
    if sealed.get(name) != actual.get(name):
      state = "missing" if name not in actual else "changed" if name in sealed else "unexpected"
      return f"{path / name} is {state} since the step was saved"
  return None


def set_aside(directory, step: int, reason: str) -> pathlib.Path:
  """Moves step `step` under `rejected/` (out of orbax's sight) with why; returns where."""
  source = step_dir(directory, step)
  target = source.parent / REJECTED / f"{step}-{time.time_ns()}"  # a step may fail twice
  target.parent.mkdir(exist_ok=True)
  source.rename(target)
  (target / "reason.txt").write_text(reason + "\n")
  return target


def restore_newest(checkpoints: ocp.CheckpointManager, directory, restore: Callable,
                   step: int | None = None, set_aside_failures: bool = False):
  """`(step, restore(step))` of the newest step that verifies and restores.

  Warns of each newer one that does not (a sealed step can still fail to
  restore: written by another version, or damaged in a way its seal did not
  see), and with `set_aside_failures` moves each such step aside for good. With
  `step`, that one only. A `FileNotFoundError` when there is no checkpoint, a
  `CheckpointError` naming every failure when none is good.
  """
  steps = sorted(checkpoints.all_steps(), reverse=True) if step is None else [step]
  if not steps:
    rejected = pathlib.Path(os.path.abspath(directory)) / REJECTED
    count = len(list(rejected.iterdir())) if rejected.is_dir() else 0
    raise FileNotFoundError(f"no checkpoint under {directory}" + (
        f" ({count} set aside under {rejected}, each with its reason)" if count else ""))
  failures = []
  for candidate in steps:
    problem = verify(directory, candidate)
    if problem is None:
      try:
        restored = restore(candidate)
      except Exception as e:  # whatever the library raised: this step is not good
        problem = (f"{step_dir(directory, candidate)} does not restore: "
                   f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
      else:
        for failure in failures:
          warnings.warn(f"skipping a checkpoint: {failure}", stacklevel=2)
        return candidate, restored
    if set_aside_failures:
      problem += f" (moved to {set_aside(directory, candidate, problem)})"
    failures.append(problem)
  raise CheckpointError(f"no checkpoint under {directory} verifies: " + "; ".join(failures))


def load_ranker(config: RankerConfig, directory: str | os.PathLike,
                step: int | None = None) -> Ranker:
  """The `Ranker` of the newest verified (or `step`'s) checkpoint under `directory`; parameters only.

  Raises `CheckpointError` when no checkpoint verifies.
  """
  model = Ranker(config, rngs=nnx.Rngs(0))
  with manager(directory) as checkpoints:
    _, restored = restore_newest(checkpoints, directory, lambda s: checkpoints.restore(
        s, args=ocp.args.Composite(**{PARAMS: restore_args(model)})), step)
  update(model, restored[PARAMS])
  return model
