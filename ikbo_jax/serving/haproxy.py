"""Serving replicas behind HAProxy: one port, each user's requests to one replica.

A replica is a whole server (`python -m ikbo_jax.serving`: its own model,
batcher and user-state cache). HAProxy (Debian's `haproxy` package; an
existing balancer, not ours) spreads `POST /score` over them by a hash of the
`X-User-Id` header, consistent hashing so that a replica's removal moves only
its own users: each user's requests meet the same cache, so its hit rate does
not fall with the number of replicas. A request without the header goes
round robin. `user_id` is the header a client sends: a digest of the request's
user-side inputs, the same bytes the cache keys on.

The configuration checks each replica's `/health/ready` every
`check_interval_ms` (a replica still compiling, draining after SIGTERM or gone
gets no new requests), and sends a request again to another replica where the
first could not be reached, closed the connection unanswered, or answered 503
(`retry-on`; `POST /score` computes a pure function of its body, so sending it
twice is safe).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.serving.user_cache import user_key

USER_HEADER = "X-User-Id"


def user_id(request: Request) -> str:
  """The `X-User-Id` of a request: a digest of its user-side inputs as the model reads them
  (float32 profile, int32 history: the bytes `user_cache.user_key` keys the cache on)."""
  canonical = Request(np.asarray(request.user_dense, np.float32),
                      np.asarray(request.history, np.int32), request.cand_items,
                      request.cand_dense)
  return hashlib.blake2b(user_key(canonical), digest_size=8).hexdigest()


def config(backends: Sequence[tuple[str, int]], port: int, *, host: str = "127.0.0.1",
           max_connections: int = 4096, check_interval_ms: int = 500,
           timeout_ms: int = 30_000, buffer_bytes: int = 256 * 1024) -> str:
  """An HAProxy configuration that listens on `host:port` in front of `backends` (host, port).

  A body of up to `buffer_bytes` (HAProxy's buffer per connection; 26 KB is a
  msgpack request of ~70 candidates) is buffered whole before it is sent, so it
  can be sent again; a larger one is streamed and not retried.
  """
  if not backends:
    raise ValueError("backends is empty: give at least one (host, port)")
  servers = "\n".join(
      f"  server replica{i} {h}:{p} check inter {check_interval_ms} fall 2 rise 1 "
      f"maxconn {max_connections}" for i, (h, p) in enumerate(backends))
  return f"""global
  maxconn {max_connections * 2}
  tune.bufsize {buffer_bytes}

defaults
  mode http
  option http-keep-alive
  timeout connect 1s
  timeout client {timeout_ms}ms
  timeout server {timeout_ms}ms
  timeout http-request {timeout_ms}ms
  timeout http-keep-alive 5s

frontend score
  bind {host}:{port}
  http-request wait-for-body time {timeout_ms}ms
  default_backend replicas

backend replicas
  balance hdr({USER_HEADER})
  hash-type consistent
  option httpchk GET /health/ready
  http-check expect status 200
  option redispatch 1
  retries 2
  retry-on conn-failure empty-response response-timeout 503
{servers}
"""
