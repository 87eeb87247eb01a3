"""Serving the ranking model: shape buckets compiled at start-up, a request batcher, HTTP, load."""

from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.buckets import Bucket, BucketedModel, default_buckets
from ikbo_jax.serving.devices import DeviceSet
from ikbo_jax.serving.scorer import Scorer

__all__ = ["Batcher", "BatchingConfig", "Bucket", "BucketedModel", "DeviceSet", "Scorer",
           "default_buckets"]
