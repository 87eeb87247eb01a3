"""An existing serving engine against this library's server: the same trace, the same device stub.

    python -m benchmarks.pytriton_front --python /path/to/pytriton-env/bin/python --out F.json

The engine is NVIDIA's Triton Inference Server through PyTriton (its C++
HTTP front and dynamic batcher, a Python model behind them), run by
`benchmarks/pytriton_model.py` under `--python`, an interpreter with
`nvidia-pytriton`, numpy < 2 and msgspec (why another interpreter: that file's
docstring). Both fronts serve the device stub's times (`--stub`, default the
benchmark preset's on an H100) with the same buckets, the same greedy grouping
into them and the same packing into one flat buffer, on the same Zipf trace of
returning users with ~70 candidates a request, the same msgpack body per
request (inside Triton's binary tensor protocol for the engine), from the same
client processes. Each front gets `lone` requests one at a time, then the
`http_front` ladder: the highest Poisson rate held at p99 <= `--budget-ms` with
no wrong answer or reset, and the server's CPU per answered request (its
process tree: Triton, its Python backend stubs and PyTriton's model process;
or this library's HTTP processes and model process).

Fronts: `pytriton`, and `ours:N` for this library's server with N HTTP
processes feeding its model process (`python -m ikbo_jax.serving
--device-stub`). Every front's row is written as it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import struct
import subprocess
import tempfile

import numpy as np

from benchmarks import common, http_ladder
from benchmarks.http_ladder import ladder, lone_requests, serving, trace
from benchmarks.serving_load import wait_ready
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import bodies, http_load
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.serving.stub import DeviceStub, stub_scores
from ikbo_jax.testing import loopback

MODEL = "ranker"


class TritonEndpoint(http_load.Endpoint):
  """Triton's KServe v2 inference API with its binary tensor extension: a request's msgpack
  body is the one BYTES element of input `request`; output `scores` is float32 bytes."""

  path = f"/v2/models/{MODEL}/infer"

  def encode(self, request, content_type: str) -> tuple[bytes, dict[str, str]]:
    element = bodies.encode(request, bodies.MSGPACK)
    data = struct.pack("<I", len(element)) + element  # a BYTES element: its length, its bytes
    head = json.dumps({
        "inputs": [{"name": "request", "shape": [1, 1], "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(data)}}],
        "outputs": [{"name": "scores", "parameters": {"binary_data": True}}]}).encode()
    return head + data, {"content-type": "application/octet-stream",
                         "inference-header-content-length": str(len(head))}

  def scores(self, answer: bytes, headers) -> np.ndarray:
    start = int(headers["inference-header-content-length"])
    if len(answer) < start + 4:
      raise ValueError(f"the answer's {len(answer)} bytes hold no output past its header")
    (size,) = struct.unpack_from("<I", answer, start)
    if size % 4 or len(answer) != start + 4 + size:
      raise ValueError(f"the output says {size} bytes of float32; the answer holds "
                       f"{len(answer) - start - 4}")
    return np.frombuffer(answer, "<f4", size // 4, start + 4)


@contextlib.contextmanager
def pytriton(python: str, spec: dict):
  """(urls, pids) of the engine serving `spec`, ready; stopped (SIGTERM) on leaving."""
  port = loopback.free_port()
  folder = tempfile.mkdtemp()
  path = os.path.join(folder, "spec.json")
  with open(path, "w") as f:
    json.dump(spec, f)
  # Triton's Python backend embeds the interpreter: it needs its shared libpython.
  libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var("
                                         "'LIBDIR'))"], capture_output=True, text=True,
                          check=True).stdout.strip()
  env = dict(os.environ, PYTHONPATH="",
             LD_LIBRARY_PATH=":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")])))
  log = tempfile.TemporaryFile()
  server = subprocess.Popen([python, os.path.join(os.path.dirname(__file__), "pytriton_model.py"),
                             "--port", str(port), "--spec", path],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
  url = f"http://127.0.0.1:{port}"
  try:
    wait_ready(url, server, log, 180, path=f"/v2/models/{MODEL}/ready")
    yield [url], [server.pid]
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=60)
    except subprocess.TimeoutExpired:
      server.kill()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--python", default=os.environ.get("IKBO_PYTRITON_PYTHON"),
                      help="an interpreter with nvidia-pytriton, numpy < 2 and msgspec")
  parser.add_argument("--fronts", nargs="+", default=["pytriton", "ours:1", "ours:2"])
  parser.add_argument("--stub", type=float, nargs=2, default=[0.232, 1.057],
                      metavar=("FIRST_MS", "LAST_MS"), help="the device stub's times")
  parser.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 1500, 2000,
                                                                 3000, 4000, 6000, 8000])
  parser.add_argument("--seconds-per-rate", type=float, default=5.0)
  parser.add_argument("--client-processes", type=int, default=1)
  parser.add_argument("--budget-ms", type=float, default=20.0)
  parser.add_argument("--mean-candidates", type=float, default=70.0)
  parser.add_argument("--max-batch-requests", type=int, default=32)
  parser.add_argument("--instances", type=int, default=2,
                      help="the engine's model instances (batches in flight), as ours' default")
  parser.add_argument("--lone", type=int, default=200)
  parser.add_argument("--pool", type=int, default=1000)
  parser.add_argument("--iterations", type=int, help="ignored (the scripts' common flag)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if "pytriton" in args.fronts and not args.python:
    parser.error("the pytriton front needs --python (or IKBO_PYTRITON_PYTHON)")
  config = PRESETS["benchmark"]()
  requests = trace(config, args.mean_candidates, args.pool)
  expected = [stub_scores(r, config) for r in requests]
  buckets = default_buckets(config, max_batch_requests=args.max_batch_requests,
                            mean_candidates=args.mean_candidates)
  stub = DeviceStub(config, buckets, tuple(args.stub))
  spec = dict(model=MODEL, user_dense=config.user_dense, cand_dense=config.cand_dense,
              num_items=config.num_items, instances=args.instances,
              max_batch_size=args.max_batch_requests, max_queue_delay_us=0,
              buckets=[(b.num_candidates, b.num_users, b.history_slots, stub.device_ms[b])
                       for b in stub.buckets])
  server_args = http_ladder.server_args(args.mean_candidates, 64, args.budget_ms,
                                        args.max_batch_requests, tuple(args.stub))
  payload = dict(**common.metadata(), preset="benchmark", budget_p99_ms=args.budget_ms,
                 mean_candidates=args.mean_candidates, client_processes=args.client_processes,
                 seconds_per_rate=args.seconds_per_rate, stub_ms=args.stub, engine_spec=spec,
                 server_args=server_args, host_cpus=os.cpu_count(), fronts={})
  for front in args.fronts:
    if front == "pytriton":
      endpoint, context = TritonEndpoint(), pytriton(args.python, spec)
    elif front.startswith("ours:"):
      endpoint = http_load.Endpoint()
      context = serving("benchmark", int(front[5:]), False, args.mean_candidates, server_args)
    else:
      parser.error(f"a front is pytriton or ours:N, got {front!r}")
    with context as (urls, pids):
      row = dict(lone=lone_requests(urls[0], requests, args.lone, endpoint))
      print(f"{front}: lone request p50 {row['lone']['p50_ms']:.2f} ms", flush=True)
      row["sustained_qps"], row["ladder"] = ladder(
          urls, pids, requests, expected, args.rates, args.seconds_per_rate,
          args.client_processes, args.budget_ms, 1e-6, endpoint=endpoint)
      print(f"{front}: sustained {row['sustained_qps']:.0f}/s", flush=True)
    payload["fronts"][front] = row
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
