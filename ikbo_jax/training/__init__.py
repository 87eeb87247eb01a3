"""Training the reference ranking model: optax, orbax checkpoints, a progress bar, AUC."""

from typing import TYPE_CHECKING

from ikbo_jax import _lazy

__all__ = ["Divergence", "TrainConfig", "Trainer"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    "Divergence": "ikbo_jax.training.trainer", "TrainConfig": "ikbo_jax.training.trainer",
    "Trainer": "ikbo_jax.training.trainer"})

if TYPE_CHECKING:
  from ikbo_jax.training.trainer import Divergence, TrainConfig, Trainer
