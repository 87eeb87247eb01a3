"""One host-to-device transfer per batch: a packed batch as one flat `int32` buffer.

A `RankingBatch` is six arrays, and moving them one by one costs one transfer
(and its fixed latency) each. Every field is 4 bytes wide, so the host lays
them end to end in one `int32` buffer (float32 fields by their bits): requests
are packed straight into views of that buffer (`host_buffer`), which a model
thread allocates once per bucket and reuses, and the compiled executable
slices the fields apart again (`unflatten`, a few free ops inside `jit`).
Labels are not sent: serving scores, it does not train.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ikbo_jax.data import Request, pack_requests
from ikbo_jax.models import RankerConfig, RankingBatch

_FLOATS = ("user_dense", "cand_dense")


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where each field of a batch of one shape lies in the flat buffer.

  Every field is 4 bytes wide; `user_dense` and `cand_dense` are float32, the rest int32.
  """

  fields: tuple[tuple[str, tuple[int, ...]], ...]

  @classmethod
  def of(cls, config: RankerConfig, num_users: int, num_candidates: int,
         history_slots: int) -> FlatLayout:
    return cls((("user_dense", (num_users, config.user_dense)),
                ("history", (num_users, history_slots)),
                ("history_len", (num_users,)),
                ("cand_to_user", (num_candidates,)),
                ("cand_items", (num_candidates,)),
                ("cand_dense", (num_candidates, config.cand_dense))))

  @property
  def size(self) -> int:
    return sum(int(np.prod(shape)) for _, shape in self.fields)

  def host_views(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A new flat host buffer, and each field as a view of it (float32 fields by their bits)."""
    flat, views, start = np.zeros(self.size, np.int32), {}, 0
    for name, shape in self.fields:
      size = int(np.prod(shape))
      view = flat[start:start + size].reshape(shape)
      views[name] = view.view(np.float32) if name in _FLOATS else view
      start += size
    return flat, views

  def fields_of(self, flat: jax.Array) -> dict[str, jax.Array]:
    """Each field again, from the flat buffer (traced inside the executable)."""
    fields, start = {}, 0
    for name, shape in self.fields:
      size = int(np.prod(shape))
      x = lax.slice(flat, (start,), (start + size,)).reshape(shape)
      fields[name] = lax.bitcast_convert_type(x, jnp.float32) if name in _FLOATS else x
      start += size
    return fields

  def host_buffer(self) -> tuple[np.ndarray, RankingBatch]:
    """A new flat host buffer of a `RankingBatch` layout, and the batch as views to pack into.

    The views' labels are a scratch array of their own: labels are not sent.
    """
    flat, views = self.host_views()
    return flat, RankingBatch(**views, labels=np.zeros(views["cand_items"].shape, np.float32))

  def unflatten(self, flat: jax.Array) -> RankingBatch:
    """The `RankingBatch` again, from the flat buffer (traced inside the executable)."""
    fields = self.fields_of(flat)
    return RankingBatch(**fields, labels=jnp.zeros(fields["cand_items"].shape, jnp.float32))


class HostBuffers:
  """Each thread's flat host buffer per bucket, allocated once, and requests packed into it.

  A model thread's next call starts after its last one fetched its scores, so
  the device has read the buffer by then.
  """

  def __init__(self, config: RankerConfig, layouts: dict[Hashable, FlatLayout]):
    self._config, self._layouts = config, layouts
    self._local = threading.local()

  def pack(self, requests: Sequence[Request], bucket) -> np.ndarray:
    """`requests` packed into this thread's buffer of `bucket` (a key of `layouts` with
    `num_users`, `num_candidates` and `history_slots`): the flat buffer."""
    buffers = self._local.__dict__.setdefault("by_bucket", {})
    if bucket not in buffers:
      buffers[bucket] = self._layouts[bucket].host_buffer()
    flat, views = buffers[bucket]
    pack_requests(requests, self._config, num_users=bucket.num_users,
                  num_candidates=bucket.num_candidates, history_slots=bucket.history_slots,
                  out=views)
    return flat
