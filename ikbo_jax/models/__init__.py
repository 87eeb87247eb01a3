"""A reference ranking model built on the IKBO layers, and its standard twin."""

from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.config import PRESETS, RankerConfig
from ikbo_jax.models.ranker import Ranker

__all__ = ["PRESETS", "Ranker", "RankerConfig", "RankingBatch"]
