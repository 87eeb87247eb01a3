"""A reference ranking model built on the IKBO layers, and its standard twin."""

from typing import TYPE_CHECKING

from ikbo_jax import _lazy

__all__ = ["PRESETS", "Build", "Ranker", "RankerConfig", "RankingBatch", "load_ranker",
           "masked_loss", "masked_loss_terms", "scores"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    "PRESETS": "ikbo_jax.models.config",
    "RankerConfig": "ikbo_jax.models.config",
    "Build": "ikbo_jax.models.builds",
    "Ranker": "ikbo_jax.models.ranker",
    "RankingBatch": "ikbo_jax.models.batch",
    "load_ranker": "ikbo_jax.models.checkpoint",
    "masked_loss": "ikbo_jax.models.scoring",
    "masked_loss_terms": "ikbo_jax.models.scoring",
    "scores": "ikbo_jax.models.scoring",
})

if TYPE_CHECKING:
  from ikbo_jax.models.batch import RankingBatch
  from ikbo_jax.models.builds import Build
  from ikbo_jax.models.checkpoint import load_ranker
  from ikbo_jax.models.config import PRESETS, RankerConfig
  from ikbo_jax.models.ranker import Ranker
  from ikbo_jax.models.scoring import masked_loss, masked_loss_terms, scores
