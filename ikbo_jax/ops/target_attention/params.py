"""The static parameters of one target-attention call, in one frozen record."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Params:
  """What a backend needs to know besides the arrays; hashable, so it rides as a static argument.

  Attributes:
    scale: the logit scale.
    masked: the caller gave lengths, so K/V rows at or past them may be padding
      (any value, NaN included) that must never be read.
    return_lse: the caller wants the float32 log-sum-exp too.
    interpret: run the kernels under the Pallas interpreter (CPU tests).
  """

  scale: float
  masked: bool
  return_lse: bool
  interpret: bool = False
