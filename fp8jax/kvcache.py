"""KV cache for the sampler (BF16 or FP8 E4M3), and the K/V quantization the trainer shares with it.

Layout: per decoder layer, ``k`` and ``v`` are (slots, length, n_kv_heads, head_dim); slot ``j`` of a row holds
the key/value of the token at position ``j`` (post-RoPE keys). A query at position ``p`` attends slots ``j <= p``.
The length is the requested ``max_len`` rounded up to the attention op's key block (``padded_len``: 128 for the GPU
kernels, 16 for the CPU reference), so attention reads whole blocks without a padded copy of the cache; the sampler
still stops sequences at its max_len.

MLA (``fp8jax.model.mla``): one latent per token and layer, (slots, length, 1, kv_lora_rank + qk_rope_head_dim) in
``k``, and no ``v`` (an empty list): the absorbed attention reads the latent as keys and its first kv_lora_rank dims
as values. An FP8 latent cache has one scale per layer (``k_scale_L``), applied to the scores and the output.

FP8 cache: one FP32 scale per layer for K and one for V (per-tensor, as vLLM's FP8 KV cache). On write the values
are quantized with ``quantize_kv``; attention reads the E4M3 codes (upcast exactly to BF16) and multiplies the
FP32 scores / outputs by the per-layer scale after the dots. When the rollout uses an FP8 cache, the training forward
turns K/V into the same codes with ``kv_codes`` (same scales, straight-through gradient), so sampler and trainer run
the same attention math on the same numbers.

Scale statistic (documented contract, used by the RL loop): ``scale = margin * amax / 448`` where ``amax`` is the
largest |K| (resp. |V|) of that layer seen in the last calibration pass (the previous training step's forward, or
a BF16 prefill of the prompts before the first training step) and ``margin`` (config ``rollout.kv_scale_margin``,
default 1.25) leaves headroom for values larger than those seen; larger values saturate at +-448 * scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax import quant
from pallas_kernels.attention import key_block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: list  # per layer (B, S, Hkv, hd), bf16 or float8_e4m3fn
  v: list  # the same, or [] for an MLA latent cache
  k_scale_L: jax.Array  # (L,) FP32; ones for a BF16 cache
  v_scale_L: jax.Array

  @property
  def is_fp8(self) -> bool:
    return self.k[0].dtype == quant.FP8_DTYPE

  @property
  def max_len(self) -> int:
    """Allocated positions per slot (``padded_len`` of the requested length)."""
    return self.k[0].shape[1]

  @property
  def slots(self) -> int:
    return self.k[0].shape[0]


def padded_len(max_len: int) -> int:
  """The cache length allocated for ``max_len`` positions: a whole number of attention key blocks."""
  block = key_block()
  return -(-max_len // block) * block


def cache_bytes(n_layers: int, slots: int, max_len: int, n_kv_heads: int, head_dim: int, fp8: bool,
                values: bool = True) -> int:
  return (1 + values) * n_layers * slots * padded_len(max_len) * n_kv_heads * head_dim * (1 if fp8 else 2)


def init_cache(n_layers: int, slots: int, max_len: int, n_kv_heads: int, head_dim: int, *, fp8: bool,
               k_scale_L=None, v_scale_L=None, dtype=jnp.bfloat16, values: bool = True) -> KVCache:
  """``values=False``: keys only (MLA's latent cache, ``ModelConfig.kv_cache_layout``)."""
  dt = quant.FP8_DTYPE if fp8 else dtype
  shape = (slots, padded_len(max_len), n_kv_heads, head_dim)
  ones = jnp.ones((n_layers,), jnp.float32)
  return KVCache(k=[jnp.zeros(shape, dt) for _ in range(n_layers)],
                 v=[jnp.zeros(shape, dt) for _ in range(n_layers if values else 0)],
                 k_scale_L=ones if k_scale_L is None else jnp.array(k_scale_L, jnp.float32, copy=True),
                 v_scale_L=ones if v_scale_L is None else jnp.array(v_scale_L, jnp.float32, copy=True))


def scales_from_amax(amax_L: jax.Array, margin: float) -> jax.Array:
  """Per-layer FP8 KV scale from an observed amax (see module docstring)."""
  return jnp.maximum(margin * amax_L.astype(jnp.float32), quant.AMAX_FLOOR) * jnp.float32(quant.INV_E4M3_MAX)


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
  return quant.to_e4m3(x.astype(jnp.float32) * quant.reciprocal(scale))


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  return (q.astype(jnp.float32) * scale).astype(dtype)


@jax.custom_vjp
def kv_codes(x: jax.Array, scale: jax.Array) -> jax.Array:
  """The E4M3 codes of quantize_kv(x, scale) as x's dtype (exact), with a straight-through gradient (g / scale).

  Attention multiplies the scores / outputs by ``scale`` after the dots, so the forward equals attention over the
  FP8 cache's values and the backward is the identity through the quantization.
  """
  return quantize_kv(x, scale).astype(x.dtype)


def _codes_fwd(x, scale):
  return kv_codes(x, scale), scale


def _codes_bwd(scale, g):
  return (g.astype(jnp.float32) * quant.reciprocal(scale)).astype(g.dtype), jnp.zeros_like(scale)


kv_codes.defvjp(_codes_fwd, _codes_bwd)


def store(cache_BxSxHxD: jax.Array, new_BxTxHxD: jax.Array, scale, positions_BxT: jax.Array) -> jax.Array:
  """``write`` of the new entries as the cache holds them: E4M3 codes of ``quantize_kv(new, scale)`` for an FP8
  cache (``scale`` its layer's scale), the values themselves for a BF16 one (``scale`` None)."""
  return write(cache_BxSxHxD, new_BxTxHxD if scale is None else quantize_kv(new_BxTxHxD, scale), positions_BxT)


def write(cache_BxSxHxD: jax.Array, new_BxTxHxD: jax.Array, positions_BxT: jax.Array) -> jax.Array:
  """Writes each row's new entries at their positions (positions >= max_len are dropped)."""
  b_idx = jnp.arange(new_BxTxHxD.shape[0])[:, None]
  return cache_BxSxHxD.at[b_idx, positions_BxT].set(new_BxTxHxD.astype(cache_BxSxHxD.dtype), mode="drop")
