"""ModelConfig: the one conversion point from a config group to what model code sees."""

from __future__ import annotations

import dataclasses
from typing import Any

from fp8jax.config_utils import dataclass_from_group
from fp8jax.quant import BLOCK


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-3.x / Qwen3-dense decoder. Linear weights are stored (out, in), like PyTorch and HF checkpoints."""

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  # Llama-3 frequency scaling (HF rope_scaling with rope_type "llama3"): (factor, low_freq_factor,
  # high_freq_factor, original_max_position_embeddings), or None for plain RoPE.
  rope_scaling: tuple[float, float, float, int] | None = None
  tie_embeddings: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  max_seq_len: int = 8192
  dtype: str = "bfloat16"  # activation / compute dtype; master params are float32
  remat: bool = False  # rematerialize each decoder layer in the backward pass
  attn_backend: str = "auto"  # fp8jax.attention: "auto" (Pallas kernels on a CUDA GPU, else the reference) | "xla" | "pallas"

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
    if self.attn_backend not in ("auto", "xla", "pallas"):
      raise ValueError(f"model.attn_backend must be 'auto', 'xla' or 'pallas', got {self.attn_backend!r}")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs)")

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  def fp8_shape_problems(self) -> list[str]:
    """Dimensions that FP8 GEMMs would have to zero-pad (not multiples of 128); empty when all are aligned."""
    dims = {"dim": self.dim, "ffn_dim": self.ffn_dim, "q_dim (n_heads*head_dim)": self.q_dim,
            "kv_dim (n_kv_heads*head_dim)": self.kv_dim}
    return [f"model.{k}={v}" for k, v in dims.items() if v % BLOCK]

  @classmethod
  def from_config(cls, c: Any) -> "ModelConfig":
    return dataclass_from_group(cls, c, "model")
