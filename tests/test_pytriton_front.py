"""The PyTriton comparison does the library's host work: the same packing, the same answers.

`benchmarks/pytriton_model.py` runs under an interpreter without jax, so its stand-in for
the device stub re-implements decoding and packing with NumPy; these tests hold it to the
library's `HostBuffers.pack` byte for byte, and the Triton endpoint's bodies and answers
to the binary tensor protocol's layout. PyTriton itself is not needed.
"""

import json
import struct

import numpy as np
import pytest

from benchmarks.pytriton_front import TritonEndpoint
from benchmarks.pytriton_model import StandIn
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import bodies, http_load
from ikbo_jax.serving.buckets import Bucket
from ikbo_jax.serving.transfer import FlatLayout, HostBuffers


@pytest.fixture(scope="module")
def config():
  return PRESETS["small"]()


def _stand_in(config, buckets):
  return StandIn(dict(buckets=[(b.num_candidates, b.num_users, b.history_slots, 0.0)
                               for b in buckets], user_dense=config.user_dense,
                      cand_dense=config.cand_dense, num_items=config.num_items))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_stand_in_packs_as_the_library_does(config, seed):
  buckets = [Bucket(24, 2, config.max_history), Bucket(64, 4, config.max_history)]
  requests = [r.validated(config) for r in
              ClickGenerator(config, seed=seed, mean_candidates=8, max_candidates=16).requests(4)]
  stand_in = _stand_in(config, buckets)
  host = HostBuffers(config, {b: FlatLayout.of(config, b.num_users, b.num_candidates,
                                               b.history_slots) for b in buckets})
  decoded = [stand_in._decode(bodies.encode(r, bodies.MSGPACK)) for r in requests]
  for group in (requests, requests[:1]):  # a buffer reused: a smaller batch after a larger
    bucket = buckets[-1]
    mine = stand_in._pack(decoded[:len(group)], (bucket.num_candidates, bucket.num_users,
                                                 bucket.history_slots, 0.0))
    np.testing.assert_array_equal(mine, host.pack(group, bucket))


def test_the_stand_in_answers_each_request_its_own_scores(config):
  requests = ClickGenerator(config, seed=2, mean_candidates=8, max_candidates=16).requests(9)
  stand_in = _stand_in(config, [Bucket(32, 2, config.max_history)])
  rows = np.array([[bodies.encode(r, bodies.MSGPACK)] for r in requests], dtype=object)
  answers = stand_in(rows)["scores"]  # nine requests: several groups of at most two
  for r, (answer,) in zip(requests, answers):
    want = (np.asarray(r.cand_items) / config.num_items).astype(np.float32)
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4"), want)


def test_the_triton_endpoint_speaks_the_binary_tensor_protocol(config):
  request = ClickGenerator(config, seed=3, mean_candidates=8).requests(1)[0]
  body, headers = TritonEndpoint().encode(request, bodies.MSGPACK)
  head_size = int(headers["inference-header-content-length"])
  head = json.loads(body[:head_size])
  (size,) = struct.unpack_from("<I", body, head_size)
  assert head["inputs"][0]["parameters"]["binary_data_size"] == 4 + size == len(body) - head_size
  assert body[head_size + 4:] == bodies.encode(request, bodies.MSGPACK)
  scores = np.arange(5, dtype="<f4")
  answer_head = b'{"outputs": []}'
  answer = answer_head + struct.pack("<I", scores.nbytes) + scores.tobytes()
  got = TritonEndpoint().scores(answer, {"inference-header-content-length": str(len(answer_head))})
  np.testing.assert_array_equal(got, scores)
  for cut in (answer[:len(answer_head) + 2], answer[:-1]):  # a wrong answer, not a crash
    with pytest.raises(ValueError):
      TritonEndpoint().scores(cut, {"inference-header-content-length": str(len(answer_head))})
  assert http_load.Endpoint().scores(b'{"scores": [0.5, 1.0]}', {}).tolist() == [0.5, 1.0]
