"""The engine side of `benchmarks/pytriton_front.py`: Triton Inference Server through PyTriton.

    <pytriton's python> benchmarks/pytriton_model.py --port P --spec SPEC.json

Triton's C++ HTTP front and dynamic batcher, and PyTriton's Python model behind
them, serving what the library's server serves with `--device-stub`: each
request's msgpack body (the same bytes a client sends to `POST /score`) is one
BYTES element of input `request`; the dynamic batcher groups up to
`max_batch_size` of them; the model decodes them, groups them greedily into
the smallest bucket that holds them, packs each group into one flat buffer of
the bucket's layout (allocated once per thread and bucket, as
`serving.transfer.HostBuffers` does), waits the bucket's device time behind the
groups before it (one device queue, as `serving.stub.DeviceStub` does), and
answers each request's scores (a candidate's item id over the item count) as
one BYTES element of output `scores`, float32 little-endian.

Why a stand-in, not the library's stub: PyTriton 0.7 needs NumPy < 2 (under
NumPy 2 its bytes tensors arrive corrupt in the model and its outputs empty),
and jax 0.11 needs NumPy >= 2.1, so this runs in an interpreter of its own that
has neither jax nor the library; it needs numpy, msgspec and nvidia-pytriton.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import msgspec
import numpy as np

_FIELDS = ("user_dense", "history", "cand_items", "cand_dense")


class StandIn:
  """Decode, pack, wait the device time, answer: the host work of the library's stub."""

  def __init__(self, spec: dict):
    self.buckets = sorted(tuple(b) for b in spec["buckets"])  # (candidates, users, history, ms)
    self.user_dense, self.cand_dense = spec["user_dense"], spec["cand_dense"]
    self.num_items = spec["num_items"]
    self._local, self._lock, self._free_at = threading.local(), threading.Lock(), 0.0

  def __call__(self, request: np.ndarray) -> dict[str, np.ndarray]:
    requests = [self._decode(row[0]) for row in request]
    answers, group, candidates = [], [], 0
    largest = self.buckets[-1]
    for r in requests:
      n = len(r["cand_items"])
      if group and (candidates + n > largest[0] or len(group) == largest[1]):
        answers += self._run(group, candidates)
        group, candidates = [], 0
      group.append(r)
      candidates += n
    answers += self._run(group, candidates)
    return {"scores": np.array([[a] for a in answers], dtype=object)}

  def _decode(self, body: bytes) -> dict[str, np.ndarray]:
    decoded = msgspec.msgpack.decode(body)
    return {f: np.frombuffer(decoded[f]["data"], decoded[f]["dtype"]).reshape(decoded[f]["shape"])
            for f in _FIELDS}

  def _run(self, group: list[dict], candidates: int) -> list[bytes]:
    bucket = next(b for b in self.buckets if b[0] >= candidates and b[1] >= len(group))
    self._pack(group, bucket)
    with self._lock:
      done = max(time.perf_counter(), self._free_at) + bucket[3] / 1e3
      self._free_at = done
    if (wait := done - time.perf_counter()) > 0:
      time.sleep(wait)
    return [(r["cand_items"] / self.num_items).astype("<f4").tobytes() for r in group]

  def _pack(self, group: list[dict], bucket: tuple) -> np.ndarray:
    """`group` packed into this thread's flat buffer of `bucket`: the buffer."""
    buffers = self._local.__dict__.setdefault("buffers", {})
    if bucket not in buffers:
      buffers[bucket] = self._views(*bucket[:3])
    flat, views = buffers[bucket]
    for view in views.values():
      view[...] = 0
    views["cand_to_user"][...] = bucket[1]
    start = 0
    for u, r in enumerate(group):
      n, h = len(r["cand_items"]), len(r["history"])
      views["user_dense"][u] = r["user_dense"]
      views["history"][u, :h] = r["history"]
      views["history_len"][u] = h
      views["cand_to_user"][start:start + n] = u
      views["cand_items"][start:start + n] = r["cand_items"]
      views["cand_dense"][start:start + n] = r["cand_dense"]
      start += n
    return flat

  def _views(self, candidates: int, users: int, history: int
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    shapes = dict(user_dense=(users, self.user_dense), history=(users, history),
                  history_len=(users,), cand_to_user=(candidates,), cand_items=(candidates,),
                  cand_dense=(candidates, self.cand_dense))
    flat = np.zeros(sum(int(np.prod(s)) for s in shapes.values()), np.int32)
    views, start = {}, 0
    for name, shape in shapes.items():
      view = flat[start:start + int(np.prod(shape))].reshape(shape)
      views[name] = view.view(np.float32) if name.endswith("dense") else view
      start += view.size
    return flat, views


def main() -> None:
  # Here, not at the top: `StandIn` is importable (and tested) without PyTriton.
  from pytriton.decorators import batch
  from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
  from pytriton.triton import Triton, TritonConfig

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--port", type=int, required=True, help="HTTP; gRPC and metrics take +1, +2")
  parser.add_argument("--spec", required=True, help="JSON: buckets, sizes, instances, batching")
  args = parser.parse_args()
  with open(args.spec) as f:
    spec = json.load(f)
  config = TritonConfig(http_port=args.port, grpc_port=args.port + 1,
                        metrics_port=args.port + 2, log_verbose=0)
  with Triton(config=config) as triton:
    # A callable per model instance (Triton's instance count: batches in flight at once),
    # all of one stand-in: one device queue.
    stand_in = StandIn(spec)
    infer = [batch(stand_in) for _ in range(spec["instances"])]
    triton.bind(model_name=spec["model"], infer_func=infer,
                inputs=[Tensor(name="request", dtype=bytes, shape=(1,))],
                outputs=[Tensor(name="scores", dtype=bytes, shape=(1,))],
                config=ModelConfig(max_batch_size=spec["max_batch_size"], batcher=DynamicBatcher(
                    max_queue_delay_microseconds=spec["max_queue_delay_us"])))
    triton.serve()


if __name__ == "__main__":
  main()
