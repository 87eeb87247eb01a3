"""Prometheus metrics of one server (`prometheus-client`), served at `GET /metrics`.

Names follow Prometheus conventions (base units, `_total` counters):

- `ikbo_http_request_seconds{route, status}`: latency histogram per route and status;
- `ikbo_queue_requests`, `ikbo_queue_candidates`: what waits in the batcher now;
- `ikbo_batch_requests`, `ikbo_batch_candidates`: batch-size histograms;
- `ikbo_batches_total{bucket}`: batches per compiled bucket;
- `ikbo_batch_seconds`: the model call per batch (packing, transfer, device, fetch);
- `ikbo_refused_total{reason}`: requests answered without computing them
  (`overloaded`, `deadline`, `not_ready`, `client_closed`: the client left mid-body);
- with a user-state cache: `ikbo_cache_hits_total`, `ikbo_cache_misses_total`,
  `ikbo_cache_evictions_total`, `ikbo_cache_expirations_total`, and the gauges
  `ikbo_cache_entries`, `ikbo_cache_capacity`, `ikbo_cache_bytes` (the table's device memory).

Each server has its own registry, so several apps in one process (tests) do not collide.
A server of several processes (`serving.processes`) keeps its counters and histograms in
prometheus-client's multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set before any of its
processes imports prometheus-client), and a scrape of any of its HTTP processes adds up
every process's; the queue's and the cache's gauges and counts come from the model
process's last report.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import prometheus_client as prom
from prometheus_client import multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ikbo_jax.data import Request
from ikbo_jax.serving.buckets import Bucket

_LATENCY_BUCKETS = (.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1., 2., 5., 10.)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServingMetrics:
  """The metrics of one server, in their own registry."""

  def __init__(self):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.request_seconds = prom.Histogram(
        "ikbo_http_request_seconds", "HTTP request latency", ("route", "status"),
        buckets=_LATENCY_BUCKETS, registry=r)
    self.batch_requests = prom.Histogram("ikbo_batch_requests", "requests per batch",
                                         buckets=_SIZE_BUCKETS, registry=r)
    self.batch_candidates = prom.Histogram("ikbo_batch_candidates", "candidates per batch",
                                           buckets=_SIZE_BUCKETS, registry=r)
    self.batches = prom.Counter("ikbo_batches", "batches per compiled bucket", ("bucket",),
                                registry=r)
    self.batch_seconds = prom.Histogram("ikbo_batch_seconds", "model call time per batch",
                                        buckets=_LATENCY_BUCKETS, registry=r)
    self.refused = prom.Counter("ikbo_refused", "requests answered without computing them",
                                ("reason",), registry=r)

    self._children: dict[tuple, object] = {}
    self._watched: list[prom.registry.Collector] = []

  def observe_request(self, route: str, status: int, seconds: float) -> None:
    """One answered request's latency."""
    self._child(self.request_seconds, route, str(status)).observe(seconds)

  def count_refusal(self, reason: str) -> None:
    """One request answered without computing it, for `reason`."""
    self._child(self.refused, reason).inc()

  def _child(self, metric, *labels: str):
    """`metric.labels(*labels)`, looked up once per label set: on the hot path (every answer,
    every refusal under overload) `labels` cost as much as the observation."""
    key = (id(metric), labels)
    child = self._children.get(key)
    if child is None:
      child = self._children[key] = metric.labels(*labels)
    return child

  def watch_queue(self, requests: Callable[[], int], candidates: Callable[[], int]) -> None:
    """Reads the queue depths from the batcher at each scrape."""
    self._watch(_QueueCollector(requests, candidates))

  def watch_cache(self, report: Callable[[], dict | None]) -> None:
    """Reads the user-state cache's counts from `report()` (`CachedModel.report`) at each scrape."""
    self._watch(_CacheCollector(report))

  def _watch(self, collector) -> None:
    self._watched.append(collector)
    self.registry.register(collector)

  def observe_batch(self, requests: Sequence[Request], bucket: Bucket | None,
                    seconds: float) -> None:
    self.batch_requests.observe(len(requests))
    self.batch_candidates.observe(sum(r.num_candidates for r in requests))
    label = "none" if bucket is None else (
        f"{bucket.num_candidates}x{bucket.num_users}x{bucket.history_slots}")
    self.batches.labels(label).inc()
    self.batch_seconds.observe(seconds)

  def exposition(self) -> tuple[bytes, str]:
    """The text exposition format and its content type."""
    shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    registry = self.registry
    if shared:  # every process's counters and histograms, and this one's watched gauges
      registry = prom.CollectorRegistry()
      multiprocess.MultiProcessCollector(registry, path=shared)
      for collector in self._watched:
        registry.register(collector)
    return prom.generate_latest(registry), prom.CONTENT_TYPE_LATEST


class _QueueCollector(prom.registry.Collector):
  """The batcher's queue depths, read at scrape time."""

  def __init__(self, requests: Callable[[], int], candidates: Callable[[], int]):
    self._requests, self._candidates = requests, candidates

  def collect(self):
    yield GaugeMetricFamily("ikbo_queue_requests", "requests in the batcher's queue",
                            value=self._requests())
    yield GaugeMetricFamily("ikbo_queue_candidates", "candidates in the batcher's queue",
                            value=self._candidates())


class _CacheCollector(prom.registry.Collector):
  """The cache's own counts, read at scrape time (they are kept by the cache, not here)."""

  def __init__(self, report: Callable[[], dict]):
    self._report = report

  def collect(self):
    r = self._report()
    if r is None:  # not reported yet
      return
    for name in ("hits", "misses", "evictions", "expirations"):
      yield CounterMetricFamily(f"ikbo_cache_{name}", f"user-state cache {name}", value=r[name])
    yield GaugeMetricFamily("ikbo_cache_entries", "users in the cache", value=r["entries"])
    yield GaugeMetricFamily("ikbo_cache_capacity", "slots of the cache", value=r["capacity"])
    yield GaugeMetricFamily("ikbo_cache_bytes", "device memory of the cache's table",
                            value=r["table_bytes"])
