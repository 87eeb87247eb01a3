"""Serving the ranking model: shape buckets compiled at start-up, a request batcher, HTTP, load."""

from typing import TYPE_CHECKING

from ikbo_jax import _lazy

__all__ = ["Batcher", "BatchingConfig", "Bucket", "BucketedModel", "DeviceSet", "Scorer",
           "default_buckets"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    "Batcher": "ikbo_jax.serving.batcher",
    "BatchingConfig": "ikbo_jax.serving.batcher",
    "Bucket": "ikbo_jax.serving.buckets",
    "BucketedModel": "ikbo_jax.serving.buckets",
    "default_buckets": "ikbo_jax.serving.buckets",
    "DeviceSet": "ikbo_jax.serving.devices",
    "Scorer": "ikbo_jax.serving.scorer",
})

if TYPE_CHECKING:
  from ikbo_jax.serving.batcher import Batcher, BatchingConfig
  from ikbo_jax.serving.buckets import Bucket, BucketedModel, default_buckets
  from ikbo_jax.serving.devices import DeviceSet
  from ikbo_jax.serving.scorer import Scorer
