"""The model's checkpoint format: parameters under their own item, apart from any optimizer.

A checkpoint is an orbax `CheckpointManager` step holding named items. The
model layer owns one of them, `PARAMS` (the `Ranker`'s state as a pure dict);
training adds its own (the optimizer, its cursor) beside it. Serving reads the
parameters alone, so it never builds an optimizer (Flax's checkpointing guide
keeps model state apart from the training loop the same way).
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ikbo_jax.models.config import RankerConfig
from ikbo_jax.models.ranker import Ranker

PARAMS = "params"


def manager(directory: str | os.PathLike, max_to_keep: int = 3) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(os.path.abspath(directory),
                               options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


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


def step_to_restore(checkpoints: ocp.CheckpointManager, step: int | None, directory) -> int:
  """`step`, or the latest step under `directory`; a FileNotFoundError when there is none."""
  step = checkpoints.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  return step


def load_ranker(config: RankerConfig, directory: str | os.PathLike,
                step: int | None = None) -> Ranker:
  """The `Ranker` of the latest (or `step`'s) checkpoint under `directory`; parameters only."""
  model = Ranker(config, rngs=nnx.Rngs(0))
  with manager(directory) as checkpoints:
    step = step_to_restore(checkpoints, step, directory)
    restored = checkpoints.restore(step, args=ocp.args.Composite(
        **{PARAMS: restore_args(model)}))
  update(model, restored[PARAMS])
  return model
