"""`Batcher`: concurrent requests grouped into batches that fit a compiled bucket.

The knobs are those of TF-Serving's and Triton's dynamic batchers: a batch
holds at most `max_batch_requests` requests, and the first request of a batch
waits at most `batch_timeout_ms` for others to join, but only while another
batch is with the model: when the model is idle, waiting would only add to the
request's latency, so the batch takes what is queued and goes (a lone request
costs one call, not a call and the timeout), and a batch waiting for more goes
as soon as the batch before it is done. A batch closes early
when the next request would not fit the largest bucket; that request opens the
next batch. Up to `max_in_flight` batches are with the model at once (Triton's
instance count), so the host packs the next batch while the device runs the
last one; a batch forms while it waits for a free slot. Each request is
validated before it is queued: a bad one gets its own `RequestError` and never
reaches a batch, so the other requests are unaffected. A request with more
candidates than the largest bucket holds is split into pieces (the same user,
consecutive candidates) and its scores are joined in order; a history longer
than the model takes is refused.

Profiling: a request may bring a `StageClock` (`serving.stages`); its batch's
stages (the queue, the hop to a model thread, and the model's own: pack,
launch or transfer and execution, the copy back) and the hop back to the
awaiting coroutine are marked on it. Requests without one cost nothing more.

Admission: a request is refused with `Overloaded` (HTTP 429) when the queue
would then hold more than `max_queued` requests or `max_queued_candidates`
candidates, counted before it is split. Every request has a deadline (its own,
or `default_timeout_ms` from its arrival); one still queued at its deadline is
answered with `DeadlineExceeded` (HTTP 503) and never computed, so under any
offered load the requests that are computed are the ones still worth answering.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from ikbo_jax.data import Request, RequestError
from ikbo_jax.serving.buckets import Bucket
from ikbo_jax.serving.scorer import Scorer
from ikbo_jax.serving.stages import StageClock


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
  """Attributes:
    max_batch_requests: most requests in one batch (TF-Serving's max_batch_size); default
      the user slots of the largest bucket.
    batch_timeout_ms: longest wait of a batch's first request for more (max queue delay)
      while another batch is with the model; with the model idle a batch goes at once.
    max_queued: requests waiting beyond this are refused at once (back-pressure).
    max_queued_candidates: candidates waiting beyond this are refused at once.
    max_in_flight: batches with the model at once, each on its own host thread.
    default_timeout_ms: a request's deadline, from its arrival, unless it brings its own.
  """

  max_batch_requests: int | None = None
  batch_timeout_ms: float = 2.0
  max_queued: int = 4096
  max_queued_candidates: int = 65536
  max_in_flight: int = 2
  default_timeout_ms: float = 1000.0

  def __post_init__(self):
    if self.max_batch_requests is not None and not (
        isinstance(self.max_batch_requests, int) and self.max_batch_requests > 0):
      raise ValueError(f"max_batch_requests must be a positive int, got {self.max_batch_requests!r}")
    if not self.batch_timeout_ms >= 0:
      raise ValueError(f"batch_timeout_ms must be >= 0, got {self.batch_timeout_ms!r}")
    if not self.default_timeout_ms > 0:
      raise ValueError(f"default_timeout_ms must be > 0, got {self.default_timeout_ms!r}")
    for name in ("max_queued", "max_queued_candidates", "max_in_flight"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value > 0):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class Overloaded(RuntimeError):
  """The queue is at its bound: the request was refused before it was queued; retry later."""


class DeadlineExceeded(RuntimeError):
  """The request's deadline passed while it was queued; it was never computed."""


@dataclasses.dataclass
class _Pending:
  request: Request
  future: asyncio.Future
  deadline: float  # the event loop's clock
  clock: StageClock | None = None


class Batcher:
  """Scores requests through `model`, batching the ones that arrive together.

  Use as an async context manager (it runs a batching task and `max_in_flight` model threads):

  >>> import asyncio
  >>> from flax import nnx
  >>> from ikbo_jax.data.synthetic import ClickGenerator
  >>> from ikbo_jax.models import Ranker, RankerConfig
  >>> from ikbo_jax.serving import Batcher, Bucket, BucketedModel
  >>> config = RankerConfig()
  >>> model = BucketedModel(Ranker(config, rngs=nnx.Rngs(0)), [Bucket(64, 4, 32)])
  >>> async def serve(requests):
  ...   async with Batcher(model) as batcher:
  ...     return await asyncio.gather(*(batcher.score(r) for r in requests))
  >>> requests = ClickGenerator(config, seed=0).requests(6)
  >>> scores = asyncio.run(serve(requests))
  >>> [len(s) for s in scores] == [r.num_candidates for r in requests]
  True
  """

  def __init__(self, model: Scorer, config: BatchingConfig = BatchingConfig(),
               on_batch: Callable[[Sequence[Request], Bucket | None, float], None] | None = None):
    """`on_batch(requests, bucket, seconds)` hears of each batch the model ran (metrics)."""
    if config.max_batch_requests is None:
      config = dataclasses.replace(config, max_batch_requests=model.largest.num_users)
    if config.max_batch_requests > model.largest.num_users:
      raise ValueError(f"max_batch_requests={config.max_batch_requests} exceeds the user slots "
                       f"of the largest bucket, {model.largest}")
    self.model, self.config, self._on_batch = model, config, on_batch
    self.batches_run = 0
    self.refused = self.timed_out = 0  # requests answered Overloaded / DeadlineExceeded
    self.queued_candidates = 0
    self._queue: collections.deque[_Pending] = collections.deque()
    self._arrived = asyncio.Event()
    self._task: asyncio.Task | None = None
    self._threads = concurrent.futures.ThreadPoolExecutor(config.max_in_flight,
                                                          thread_name_prefix="ikbo-model")
    self._free_slots = asyncio.Semaphore(config.max_in_flight)
    self._in_flight: set[asyncio.Task] = set()
    self._running = 0  # batches with the model (a task still answering its callers is not)
    self._seconds_per_candidate = 0.0  # model time, a moving average over recent batches

  async def __aenter__(self) -> Batcher:
    self._task = asyncio.create_task(self._run())
    return self

  async def __aexit__(self, *exc) -> None:
    self._task.cancel()
    try:
      await self._task
    except asyncio.CancelledError:
      pass
    await asyncio.gather(*self._in_flight)  # batches already with the model finish
    for pending in self._queue:
      if not pending.future.done():
        pending.future.set_exception(RuntimeError("the batcher stopped"))
    self._threads.shutdown(wait=True)

  @property
  def queued_requests(self) -> int:
    return len(self._queue)

  @property
  def expected_wait_ms(self) -> float:
    """How long a request arriving now would likely wait for the model: the queued
    candidates at the recent batches' model time per candidate, over the batches that run
    at once (0 before the first batch)."""
    return (1e3 * self.queued_candidates * self._seconds_per_candidate
            / self.config.max_in_flight)

  async def score(self, request: Request, timeout_ms: float | None = None,
                  clock: StageClock | None = None, *, checked: bool = False) -> np.ndarray:
    """The request's click probabilities in its candidate order.

    Raises `RequestError` if the request is bad, `Overloaded` if the queue is at
    its bound, `DeadlineExceeded` if it was still queued `timeout_ms` (default
    `config.default_timeout_ms`) after it arrived. `clock` gets the request's
    stages from its queueing to its answer (its first piece's, if it is split).
    `checked` says the request is already `check_request`'s answer for this model
    (the model process's requests, checked by the HTTP process that read them).
    """
    if self._task is None or self._task.done():
      raise RuntimeError("the batcher is not running: use `async with Batcher(...)`")
    largest = self.model.largest
    if not checked:
      request = check_request(request, self.model.config,
                              getattr(self.model, "max_abs_feature", math.inf), largest)
    if timeout_ms is not None and not timeout_ms > 0:
      raise RequestError(f"the timeout must be > 0 ms, got {timeout_ms!r}")
    pieces = _split(request, largest.num_candidates)
    config = self.config
    if (len(self._queue) + len(pieces) > config.max_queued
        or self.queued_candidates + request.num_candidates > config.max_queued_candidates):
      self.refused += 1
      raise Overloaded(f"the queue is full ({len(self._queue)} requests, "
                       f"{self.queued_candidates} candidates; bounds {config.max_queued} and "
                       f"{config.max_queued_candidates}); retry later")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (timeout_ms or config.default_timeout_ms) / 1e3
    if clock is not None:
      clock.mark("validate")
    if len(pieces) == 1:
      scores = await self._enqueue(request, deadline, clock)
    else:
      futures = [self._enqueue(piece, deadline, clock if i == 0 else None)
                 for i, piece in enumerate(pieces)]
      try:
        scores = np.concatenate(await asyncio.gather(*futures))
      finally:
        for future in futures:  # a failed piece cancels the rest (cancelled ones are skipped)
          future.cancel()
    if clock is not None:
      clock.mark("answer")
    return scores

  def _enqueue(self, request: Request, deadline: float,
               clock: StageClock | None = None) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    self._queue.append(_Pending(request, future, deadline, clock))
    self.queued_candidates += request.num_candidates
    self._arrived.set()
    return future

  def _pop(self) -> _Pending:
    pending = self._queue.popleft()
    self.queued_candidates -= pending.request.num_candidates
    return pending

  async def _next_request(self, timeout: float | None, *,
                          until_idle: bool = False) -> _Pending | None:
    """The next queued request that is still wanted; expired ones are answered on the way.

    None after `timeout` seconds with none queued or, with `until_idle`, once no
    batch is with the model.
    """
    now = asyncio.get_running_loop().time
    while True:
      while not self._queue:
        if until_idle and not self._running:
          return None
        self._arrived.clear()
        try:
          await asyncio.wait_for(self._arrived.wait(), timeout)
        except TimeoutError:
          return None
      pending = self._pop()
      if pending.future.done():  # cancelled by its caller
        continue
      if now() < pending.deadline:
        return pending
      self._expire(pending)

  def _expire(self, pending: _Pending) -> None:
    self.timed_out += 1
    pending.future.set_exception(DeadlineExceeded(
        "the request's deadline passed while it was queued; it was not computed"))

  async def _run(self) -> None:
    loop = asyncio.get_running_loop()
    while True:
      await self._free_slots.acquire()  # while none is free, the queue keeps filling
      batch = [await self._next_request(None)]
      size = _BatchSize.of(batch[0].request)
      # A batch waits for others only while another is with the model: an idle model's
      # wait would delay this batch and help none.
      deadline = loop.time() + self.config.batch_timeout_ms / 1e3
      while len(batch) < self.config.max_batch_requests:
        pending = await self._next_request(max(deadline - loop.time(), 0), until_idle=True)
        if pending is None:
          break
        grown = size.plus(pending.request)
        if not grown.fits_some(self.model.buckets):
          self._queue.appendleft(pending)  # opens the next batch
          self.queued_candidates += pending.request.num_candidates
          break
        batch.append(pending)
        size = grown
      # The batch waited for a slot and for others: its requests' deadlines may have passed.
      now = loop.time()
      live = []
      for p in batch:
        if p.future.done():
          continue
        if now >= p.deadline:
          self._expire(p)
        else:
          live.append(p)
      if not live:
        self._free_slots.release()
        continue
      for p in live:
        if p.clock is not None:
          p.clock.mark("queue")
      self._running += 1
      task = asyncio.create_task(self._score(live))
      self._in_flight.add(task)
      task.add_done_callback(self._in_flight.discard)

  async def _score(self, batch: list[_Pending]) -> None:
    """Runs one batch on a model thread and answers its requests; frees its slot."""
    requests = [p.request for p in batch]
    loop = asyncio.get_running_loop()
    marks = None if all(p.clock is None for p in batch) else []
    try:
      start = loop.time()
      scores = await loop.run_in_executor(self._threads, self._call_model, requests, marks)
      seconds = loop.time() - start
      per_candidate = seconds / max(1, sum(r.num_candidates for r in requests))
      self._seconds_per_candidate = (per_candidate if not self.batches_run else
                                     0.8 * self._seconds_per_candidate + 0.2 * per_candidate)
      if self._on_batch is not None:
        self._on_batch(requests, self.model.bucket_for(requests), seconds)
    except Exception as e:  # a failure of the batch reaches each of its callers
      for p in batch:
        if not p.future.done():
          p.future.set_exception(e)
      return
    finally:
      self._running -= 1
      if not self._running:
        self._arrived.set()  # a batch waiting for more goes now (`_next_request`)
      self._free_slots.release()
    self.batches_run += 1
    for p, s in zip(batch, scores):
      if p.clock is not None:
        p.clock.extend(marks)
      if not p.future.done():
        p.future.set_result(s)

  def _call_model(self, requests: list[Request], marks: list | None) -> list[np.ndarray]:
    """The model's call on a model thread; with `marks`, its stages marked there."""
    if marks is None:
      return self.model(requests)
    marks.append(("thread", time.perf_counter()))
    staged = getattr(self.model, "staged", None)
    if staged is None:  # a model with no stages of its own is one stage
      scores = self.model(requests)
      marks.append(("model", time.perf_counter()))
      return scores
    return staged(requests, marks)


@dataclasses.dataclass(frozen=True)
class _BatchSize:
  """What a batch needs of a bucket, kept as the batch grows (not summed again per request)."""

  users: int
  candidates: int
  history: int

  @classmethod
  def of(cls, request: Request) -> _BatchSize:
    return cls(1, request.num_candidates, len(request.history))

  def plus(self, request: Request) -> _BatchSize:
    return _BatchSize(self.users + 1, self.candidates + request.num_candidates,
                      max(self.history, len(request.history)))

  def fits_some(self, buckets: Sequence[Bucket]) -> bool:
    return any(b.holds(self.users, self.candidates, self.history) for b in buckets)


def _split(request: Request, max_candidates: int) -> list[Request]:
  """`request` as pieces of at most `max_candidates` candidates each, in order."""
  if request.num_candidates <= max_candidates:
    return [request]
  return [dataclasses.replace(
      request, cand_items=request.cand_items[i:i + max_candidates],
      cand_dense=request.cand_dense[i:i + max_candidates],
      labels=None if request.labels is None else request.labels[i:i + max_candidates])
          for i in range(0, request.num_candidates, max_candidates)]


def check_request(request: Request, config, max_abs_feature: float, largest: Bucket) -> Request:
  """`request` validated against the model (`Request.validated`), its dense features within
  `max_abs_feature` and its history within `largest`'s slots, or a `RequestError`."""
  request = request.validated(config)
  _check_feature_range(request, max_abs_feature)
  if len(request.history) > largest.history_slots:
    raise RequestError(f"history has {len(request.history)} items; the largest bucket takes "
                       f"{largest.history_slots}")
  return request


def _check_feature_range(request: Request, bound: float) -> None:
  """Refuses dense features past `bound`, where the model's arithmetic may overflow.

  A scorer says its bound as `max_abs_feature` (`models.valid_range`); none means no bound.
  """
  for name in ("user_dense", "cand_dense"):
    values = np.abs(getattr(request, name))
    if values.size and values.max() > bound:
      at = tuple(int(i) for i in np.unravel_index(int(values.argmax()), values.shape))
      raise RequestError(
          f"{name}{list(at)} = {float(getattr(request, name)[at]):g} is outside the model's "
          f"valid range |x| <= {bound:.3g} (past it, its arithmetic can overflow and every "
          "score would be the same)")
