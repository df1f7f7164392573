"""Shared pieces of the decoder blocks: RMSNorm and rotary position embeddings (HF conventions)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8jax.model.config import ModelConfig

# Rows with max |x| above this are rescaled before mean(x^2): below it, x^2 <= 2**96 and a sum of up to 2**32 of them
# stays below FP32's max (2**128).
_RMS_SAFE_AMAX = 2.0**48


def rms_norm(x, w, eps):
  """HF LlamaRMSNorm: normalize in FP32, cast back, then scale.

  mean(x^2) overflows FP32 once |x| passes ~1e19 (the hidden state then becomes 0; seen with a diverging learning
  rate), so a row whose max |x| exceeds ``_RMS_SAFE_AMAX`` is first multiplied by a power of two ``s`` that brings
  it into [0.5, 1) (exact), and normalized as ``xs * rsqrt(mean(xs^2) + eps s^2)``, the same value. Every other row
  has ``s = 1``, where each operation, and so the result, is bitwise the plain formula. Non-finite rows keep s = 1.
  """
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
  _, exp = jnp.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1)
  scale = jnp.where((amax > _RMS_SAFE_AMAX) & jnp.isfinite(amax),
                    jnp.ldexp(jnp.float32(1.0), -jnp.minimum(exp, 126)), jnp.float32(1.0))  # 2**-126: normal
  xs = x32 * scale
  y = xs * jax.lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + eps * (scale * scale))
  return w.astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """RoPE inverse frequencies, with Llama-3 scaling (HF rope_type "llama3") when cfg.rope_scaling is set."""
  hd = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  if cfg.rope_scaling is None:
    return inv
  factor, low, high, old_ctx = cfg.rope_scaling
  wavelen = 2 * math.pi / inv
  low_wl, high_wl = old_ctx / low, old_ctx / high
  scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
  smooth = (old_ctx / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_wl) & (wavelen <= low_wl)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxHxD, positions_BxT, inv_freq):
  """Rotate-half RoPE (the HF convention: first and second halves of head_dim form the pairs)."""
  ang = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # (B, T, hd/2)
  emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x_BxTxHxD.dtype), jnp.sin(emb).astype(x_BxTxHxD.dtype)
  x1, x2 = jnp.split(x_BxTxHxD, 2, axis=-1)
  return x_BxTxHxD * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
