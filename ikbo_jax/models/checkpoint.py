"""The model's checkpoint format: parameters under their own item, apart from any optimizer.

A checkpoint is an orbax `CheckpointManager` step holding named items. The
model layer owns one of them, `PARAMS` (the `Ranker`'s state as a pure dict);
training adds its own (the optimizer, its cursor) beside it. Serving reads the
parameters alone, so it never builds an optimizer (Flax's checkpointing guide
keeps model state apart from the training loop the same way).

Integrity: once a step is written, `seal` records the SHA-256 of every file in
it (`integrity.json`); `verify` recomputes them. Whoever restores, training or
serving, takes the newest step that verifies (`newest_good_step`), warns about every
newer one that does not, and fails naming the files when none does: a flipped
byte is never restored silently. A step without a seal is not trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import warnings

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ikbo_jax.models.config import RankerConfig
from ikbo_jax.models.ranker import Ranker

PARAMS = "params"
SEAL = "integrity.json"


class CheckpointError(RuntimeError):
  """No checkpoint under a directory verifies; the message names what failed."""


def manager(directory: str | os.PathLike, max_to_keep: int = 3) -> ocp.CheckpointManager:
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
  """Records the checksums of a finished step's files."""
  path = step_dir(directory, step)
  (path / SEAL).write_text(json.dumps(_digests(path), indent=0))


def verify(directory, step: int) -> str | None:
  """None if step `step` is intact, else what is wrong with it (naming the file)."""
  path = step_dir(directory, step)
  try:
    sealed = json.loads((path / SEAL).read_text())
  except FileNotFoundError:
    return f"{path} has no {SEAL} (a save that did not finish)"
  except (OSError, ValueError) as e:
    return f"{path / SEAL} is unreadable: {e}"
  actual = _digests(path)
  for name in sorted(set(sealed) | set(actual)):
    if sealed.get(name) != actual.get(name):
      state = "missing" if name not in actual else "changed" if name in sealed else "unexpected"
      return f"{path / name} is {state} since the step was saved"
  return None


def newest_good_step(checkpoints: ocp.CheckpointManager, directory,
                     step: int | None = None) -> int:
  """The newest step that verifies; warns of each newer one that does not.

  With `step`, that one (an error if it does not verify). A
  `FileNotFoundError` when there is no checkpoint, a `CheckpointError` naming
  every failure when none verifies.
  """
  steps = sorted(checkpoints.all_steps(), reverse=True) if step is None else [step]
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  failures = []
  for candidate in steps:
    problem = verify(directory, candidate)
    if problem is None:
      for failure in failures:
        warnings.warn(f"skipping a checkpoint that does not verify: {failure}", stacklevel=2)
      return candidate
    failures.append(problem)
  raise CheckpointError(f"no checkpoint under {directory} verifies: " + "; ".join(failures))


def load_ranker(config: RankerConfig, directory: str | os.PathLike,
                step: int | None = None) -> Ranker:
  """The `Ranker` of the newest verified (or `step`'s) checkpoint under `directory`; parameters only.

  Raises `CheckpointError` when no checkpoint verifies.
  """
  model = Ranker(config, rngs=nnx.Rngs(0))
  with manager(directory) as checkpoints:
    step = newest_good_step(checkpoints, directory, step)
    restored = checkpoints.restore(step, args=ocp.args.Composite(
        **{PARAMS: restore_args(model)}))
  update(model, restored[PARAMS])
  return model
