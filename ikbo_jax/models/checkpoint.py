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


def save_args(model: nnx.Module):
  """The orbax save argument of `model`'s parameters (the `PARAMS` item)."""
  return ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model)))


def restore_args(model: nnx.Module):
  """The orbax restore argument for `model`'s parameters: its shapes and dtypes."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(nnx.state(model)))
  return ocp.args.StandardRestore(abstract)


def update(model: nnx.Module, restored) -> None:
  """Puts restored parameters (a pure dict) into `model`."""
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(model, state)


def load_ranker(config: RankerConfig, directory: str | os.PathLike,
                step: int | None = None) -> Ranker:
  """The `Ranker` of the latest (or `step`'s) checkpoint under `directory`; parameters only."""
  model = Ranker(config, rngs=nnx.Rngs(0))
  with manager(directory) as checkpoints:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory}")
    restored = checkpoints.restore(step, args=ocp.args.Composite(
        **{PARAMS: restore_args(model)}))
  update(model, restored[PARAMS])
  return model
