"""The softmax backward's `delta`, exact although the forward's output was rounded to 16 bits.

Every attention backward subtracts from `dp_j = d_out . v_j` the row's
`delta = sum_j p_j dp_j - d_lse`. FlashAttention takes it as
`delta0 = rowsum(out * d_out) - d_lse`, which needs no pass over the keys,
but `out` is rounded to 16 bits: `delta0` is off by about 2^-9 of `|dp|`.
Where the softmax is (nearly) one-hot, every `ds_j = p_j (dp_j - delta)` is
about that small or smaller (with one key, `ds = d_lse` exactly), so the
rounding would dominate dq and dk.

The dq kernels visit every key of a row anyway. With `ds0_j = p_j (dp_j - delta0)`
they also sum `rowsum(ds0)` and `pk = sum_j p_j k_j`; since the weights sum
to one, `rowsum(ds0) = sum_j p_j dp_j - delta0`, so `delta_error` gives
`delta - delta0` and then `ds_j = ds0_j - p_j * error` and
`dq = sum_j ds0_j k_j - error * pk`, exact to float32 rounding. The dq
kernels write `delta0 + error` for the dk/dv kernels.
"""


def delta_error(ds0_row_sums, d_lse):
  """`delta - delta0` of each row, from `rowsum(p * (dp - delta0))` and the lse's cotangent.

  A row without keys has `p = 0`: its error (`-d_lse`) multiplies nothing.
  """
  return ds0_row_sums - d_lse
