"""Training the reference ranking model: optax, orbax checkpoints, a progress bar, AUC."""

from typing import TYPE_CHECKING

from ikbo_jax import _lazy

__all__ = ["TrainConfig", "Trainer"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    "TrainConfig": "ikbo_jax.training.trainer", "Trainer": "ikbo_jax.training.trainer"})

if TYPE_CHECKING:
  from ikbo_jax.training.trainer import TrainConfig, Trainer
