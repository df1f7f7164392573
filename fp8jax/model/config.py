"""ModelConfig: the one conversion point from a config group to what model code sees."""

from __future__ import annotations

import dataclasses
from typing import Any

from fp8jax.config_utils import dataclass_from_group
from fp8jax.quant import BLOCK


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-3.x / Qwen3 decoder, dense or with Qwen3-MoE layers. Linear weights are stored (out, in), like PyTorch
  and HF checkpoints.

  MoE (transformers' Qwen3MoeForCausalLM): with ``n_experts > 0`` layer i is a mixture-of-experts layer unless
  ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; it routes each token to ``n_experts_per_tok``
  of ``n_experts`` SwiGLU experts of width ``moe_ffn_dim`` (softmax over all experts, top-k, renormalized when
  ``norm_topk_prob``). Dense layers keep ``ffn_dim``.
  """

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
  norm_backend: str = "auto"  # RMSNorm: "auto" (the fixed-tile Pallas kernel on a CUDA GPU, else the reference) | ...
  n_experts: int = 0  # 0: every layer dense
  n_experts_per_tok: int = 0
  moe_ffn_dim: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
    for key in ("attn_backend", "norm_backend"):
      if getattr(self, key) not in ("auto", "xla", "pallas"):
        raise ValueError(f"model.{key} must be 'auto', 'xla' or 'pallas', got {getattr(self, key)!r}")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
    if self.n_experts < 0:
      raise ValueError(f"model.n_experts must be >= 0, got {self.n_experts}")
    if self.n_experts:
      if not 1 <= self.n_experts_per_tok <= self.n_experts:
        raise ValueError(f"model.n_experts_per_tok={self.n_experts_per_tok} must be in [1, model.n_experts="
                         f"{self.n_experts}]")
      if self.moe_ffn_dim <= 0:
        raise ValueError(f"model.moe_ffn_dim must be > 0 with model.n_experts={self.n_experts}, got {self.moe_ffn_dim}")
      if self.decoder_sparse_step < 1:
        raise ValueError(f"model.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
      bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
      if bad:
        raise ValueError(f"model.mlp_only_layers={self.mlp_only_layers}: {bad} not in [0, {self.n_layers})")

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer ``i`` is a mixture-of-experts layer (transformers' Qwen3MoeDecoderLayer rule)."""
    return self.n_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

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
    if self.n_experts:
      dims["moe_ffn_dim"] = self.moe_ffn_dim
    return [f"model.{k}={v}" for k, v in dims.items() if v % BLOCK]

  @classmethod
  def from_config(cls, c: Any) -> "ModelConfig":
    return dataclass_from_group(cls, c, "model")
