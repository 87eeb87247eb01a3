"""Serving the ranking model: shape buckets compiled at start-up, a request batcher, HTTP, load."""

from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.buckets import Bucket, BucketedModel
from ikbo_jax.serving.devices import DeviceSet

__all__ = ["Batcher", "BatchingConfig", "Bucket", "BucketedModel", "DeviceSet"]
