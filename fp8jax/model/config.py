"""ModelConfig: the one conversion point from a config group to what model code sees."""

from __future__ import annotations

import dataclasses
from typing import Any

from fp8jax.config_utils import dataclass_from_group
from pallas_kernels.core import BLOCK


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-3.x / Qwen3 / DeepSeek-V3 decoder, dense or with MoE layers. Linear weights are stored (out, in), like
  PyTorch and HF checkpoints.

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
  attn_bias: bool = False  # Qwen2: biases on the q/k/v projections (none on o_proj or the MLP); GQA only
  max_seq_len: int = 8192
  dtype: str = "bfloat16"  # activation / compute dtype; master params are float32
  remat: bool = False  # rematerialize each decoder layer in the backward pass
  # fp8jax.attention: "auto" (Pallas kernels on a CUDA GPU, else the reference), "xla" or "pallas"
  attn_backend: str = "auto"
  norm_backend: str = "auto"  # RMSNorm: "auto" (the fixed-tile Pallas kernel on a CUDA GPU, else the reference) | ...
  n_experts: int = 0  # 0: every layer dense
  n_experts_per_tok: int = 0
  moe_ffn_dim: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  # DeepSeek-V3 MoE (moe_router="sigmoid"); "softmax" is Qwen3-MoE's router
  moe_router: str = "softmax"
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank = 0: GQA
  kv_lora_rank: int = 0
  q_lora_rank: int = 0  # 0: q_proj (D -> H x head_dim) instead of q_a_proj / q_a_layernorm / q_b_proj
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False  # DeepSeek: RoPE pairs are adjacent dims (2i, 2i+1), not (i, i + d/2)
  # YaRN (HF rope_type "yarn"): (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
  # mscale_all_dim), or None. Exclusive with rope_scaling.
  rope_yarn: tuple[float, int, float, float, float, float] | None = None

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
    for key in ("attn_backend", "norm_backend"):
      if getattr(self, key) not in ("auto", "xla", "pallas"):
        raise ValueError(f"model.{key} must be 'auto', 'xla' or 'pallas', got {getattr(self, key)!r}")
    if self.rope_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} (qk_rope_head_dim with MLA) must be even (RoPE rotates "
                       f"pairs)")
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
    if self.moe_router not in ("softmax", "sigmoid"):
      raise ValueError(f"model.moe_router must be 'softmax' (Qwen3-MoE) or 'sigmoid' (DeepSeek-V3 noaux_tc), got "
                       f"{self.moe_router!r}")
    if self.moe_router == "sigmoid" and self.n_experts:
      if self.n_group < 1 or self.n_experts % self.n_group:
        raise ValueError(f"model.n_group={self.n_group} must be >= 1 and divide model.n_experts={self.n_experts}")
      if not 1 <= self.topk_group <= self.n_group:
        raise ValueError(f"model.topk_group={self.topk_group} must be in [1, model.n_group={self.n_group}]")
      if self.n_group > 1 and self.n_experts // self.n_group < 2:
        raise ValueError(f"model.n_group={self.n_group}: groups of {self.n_experts // self.n_group} expert; "
                         f"group scores sum each group's top 2, so a group needs >= 2 experts")
      if self.n_experts_per_tok > self.topk_group * (self.n_experts // self.n_group):
        raise ValueError(f"model.n_experts_per_tok={self.n_experts_per_tok} exceeds the experts of "
                         f"model.topk_group={self.topk_group} groups")
    elif self.n_group != 1 or self.topk_group != 1 or self.routed_scaling_factor != 1.0:
      raise ValueError("model.n_group, model.topk_group and model.routed_scaling_factor apply to "
                       "model.moe_router='sigmoid' with model.n_experts > 0 only")
    if self.n_shared_experts < 0 or (self.n_shared_experts and not self.n_experts):
      raise ValueError(f"model.n_shared_experts={self.n_shared_experts} needs model.n_experts > 0 (and >= 0)")
    if self.rope_yarn is not None:
      object.__setattr__(self, "rope_yarn", tuple(self.rope_yarn))
      if len(self.rope_yarn) != 6 or self.rope_scaling is not None:
        raise ValueError(f"model.rope_yarn={self.rope_yarn} must be (factor, original_max_position_embeddings, "
                         f"beta_fast, beta_slow, mscale, mscale_all_dim), and model.rope_scaling None")
      if not self.kv_lora_rank:
        raise ValueError("model.rope_yarn is implemented for MLA only (model.kv_lora_rank > 0), where its attention "
                         "factor and softmax mscale are applied")
    if self.attn_bias and self.kv_lora_rank:
      raise ValueError(f"model.attn_bias (Qwen2's q/k/v biases) needs GQA attention, got MLA (model.kv_lora_rank="
                       f"{self.kv_lora_rank})")
    if self.kv_lora_rank:
      self._check_mla()
    elif any((self.q_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)):
      raise ValueError("model.q_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim are MLA dims: they "
                       "need model.kv_lora_rank > 0")

  def _check_mla(self):
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0 with model.kv_lora_rank={self.kv_lora_rank} (MLA)")
    if self.q_lora_rank < 0:
      raise ValueError(f"model.q_lora_rank must be >= 0 (0: no q LoRA), got {self.q_lora_rank}")
    if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
      raise ValueError(f"model.head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                       f"{self.qk_nope_head_dim + self.qk_rope_head_dim} with MLA (the q/k head dim)")
    if self.n_kv_heads != self.n_heads:
      raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads} with MLA")
    if self.qk_norm:
      raise ValueError("model.qk_norm has no meaning with MLA (model.kv_lora_rank > 0)")

  @property
  def is_mla(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def rope_dim(self) -> int:
    """The dims RoPE rotates per head: all of head_dim, or MLA's qk_rope_head_dim."""
    return self.qk_rope_head_dim if self.is_mla else self.head_dim

  @property
  def attn_out_dim(self) -> int:
    """The input width of o_proj: n_heads x (v_head_dim with MLA, else head_dim)."""
    return self.n_heads * (self.v_head_dim if self.is_mla else self.head_dim)

  @property
  def shared_ffn_dim(self) -> int:
    return self.n_shared_experts * self.moe_ffn_dim

  @property
  def latent_dim(self) -> int:
    """MLA: values cached per token and layer (the normalized KV latent and the shared RoPE key)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def kv_cache_layout(self) -> tuple[int, int, bool]:
    """(heads, head dim, whether V is cached apart from K) of the sampler's cache: GQA (n_kv_heads, head_dim, True),
    MLA one latent "head" of latent_dim that serves as K and, its first kv_lora_rank dims, as V."""
    return (1, self.latent_dim, False) if self.is_mla else (self.n_kv_heads, self.head_dim, True)

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
    if self.is_mla:
      del dims["kv_dim (n_kv_heads*head_dim)"]
      dims.update({"kv_lora_rank + qk_rope_head_dim": self.latent_dim, "kv_lora_rank": self.kv_lora_rank,
                   "o_proj in (n_heads*v_head_dim)": self.attn_out_dim})
      if self.q_lora_rank:
        dims["q_lora_rank"] = self.q_lora_rank
    return [f"model.{k}={v}" for k, v in dims.items() if v % BLOCK]

  @classmethod
  def from_config(cls, c: Any) -> "ModelConfig":
    return dataclass_from_group(cls, c, "model")
