"""Requests, their packing into static shapes, a synthetic click stream and a Parquet format."""

from ikbo_jax.data.packing import pack_requests
from ikbo_jax.data.request import Request, RequestError

__all__ = ["Request", "RequestError", "pack_requests"]
