"""Training the reference ranking model: optax, orbax checkpoints, a progress bar, AUC."""

from ikbo_jax.training.trainer import TrainConfig, Trainer

__all__ = ["TrainConfig", "Trainer"]
