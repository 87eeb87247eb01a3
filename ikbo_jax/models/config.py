"""`RankerConfig`: every size of the reference ranking model, with a CPU default and the benchmark preset."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankerConfig:
  """The sizes of `Ranker`; the defaults train in seconds on a CPU.

  Attributes:
    num_items: item vocabulary, shared by the behaviour history and the candidates.
    embed_dim: D, the width of every embedding, of the attention and of the
      compressed embeddings (linear compression's N).
    num_heads: attention heads (head size `embed_dim // num_heads`; the Mosaic
      GPU kernels take 64 or 128).
    max_history: S, the longest behaviour history (the static sequence length).
    query_tokens: the candidate's query tokens in target attention (n_seed).
    user_dense: dense profile features per user.
    cand_dense: dense statistics per candidate.
    user_dense_tokens: embeddings the user's dense features are projected to.
    cand_dense_tokens: embeddings the candidate's dense features are projected to.
    compressed: M, the embeddings linear compression produces.
    tower: hidden sizes of the MLP tower over the compressed embeddings.
    causal: whether the history's self-attention is causal.
    dtype: compute dtype; parameters stay float32.
    group_dense: dense features per candidate group (ad group, campaign): 0
      (the default) builds no group level; otherwise requests carry groups,
      each candidate belongs to one, and linear compression stacks the group's
      embeddings between the user's and the candidate's, computed once per group
      (`ikbo_jax.nn.TwoLevelLinearCompression`).
    group_dense_tokens: embeddings the group's dense features are projected to.
  """

  num_items: int = 500
  embed_dim: int = 32
  num_heads: int = 2
  max_history: int = 32
  query_tokens: int = 2
  user_dense: int = 8
  cand_dense: int = 4
  user_dense_tokens: int = 4
  cand_dense_tokens: int = 2
  compressed: int = 16
  tower: tuple[int, ...] = (64, 32)
  causal: bool = True
  dtype: str = "float32"
  group_dense: int = 0
  group_dense_tokens: int = 2

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "tower":
        if not all(isinstance(h, int) and h > 0 for h in value):
          raise ValueError(f"tower must be positive ints, got {value!r}")
      elif field.name == "group_dense":
        if not (isinstance(value, int) and value >= 0):
          raise ValueError(f"group_dense must be an int >= 0 (0: no group level), got {value!r}")
      elif field.type == "int" and not (isinstance(value, int) and value > 0):
        raise ValueError(f"{field.name} must be a positive int, got {value!r}")
    if self.embed_dim % self.num_heads:
      raise ValueError(f"embed_dim ({self.embed_dim}) must be divisible by num_heads "
                       f"({self.num_heads})")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

  @property
  def user_tokens(self) -> int:
    """K_user: the user's dense-feature embeddings and its pooled history."""
    return self.user_dense_tokens + 1

  @property
  def has_groups(self) -> bool:
    """Whether the model has a group level (`group_dense > 0`)."""
    return self.group_dense > 0

  @property
  def group_tokens(self) -> int:
    """K_group: the group's dense-feature embeddings (0 without a group level)."""
    return self.group_dense_tokens if self.has_groups else 0

  @property
  def cand_tokens(self) -> int:
    """K_cand: the item embedding, the dense-feature embeddings and the attention output."""
    return 1 + self.cand_dense_tokens + self.query_tokens

  @classmethod
  def benchmark(cls) -> RankerConfig:
    """The benchmark shape: S = 1024, heads of 128 (two), 64 query tokens, bfloat16."""
    return cls(num_items=100_000, embed_dim=256, num_heads=2, max_history=1024,
               query_tokens=64, user_dense=256, cand_dense=64, user_dense_tokens=63,
               cand_dense_tokens=63, compressed=128, tower=(1024, 256), dtype="bfloat16")


  def with_groups(self, group_dense: int = 8, group_dense_tokens: int = 2) -> RankerConfig:
    """This config with a group level of the given sizes."""
    return dataclasses.replace(self, group_dense=group_dense,
                               group_dense_tokens=group_dense_tokens)


PRESETS = {"small": RankerConfig, "benchmark": RankerConfig.benchmark}
