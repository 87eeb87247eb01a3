"""A reference ranking model built on the IKBO layers, and its standard twin."""

from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.config import PRESETS, RankerConfig
from ikbo_jax.models.checkpoint import load_ranker
from ikbo_jax.models.ranker import Ranker
from ikbo_jax.models.scoring import Build, masked_loss, masked_loss_terms, scores

__all__ = ["PRESETS", "Build", "Ranker", "RankerConfig", "RankingBatch", "load_ranker",
           "masked_loss", "masked_loss_terms", "scores"]
