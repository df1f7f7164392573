"""The FP8 quantizer: the only place in fp8jax where FP8 tensors are made.

Format: E4M3 (``jnp.float8_e4m3fn``; finite max 448, no infinities, one NaN encoding), FP32 scales.

Layouts (``K`` is always the contraction axis of the GEMM that consumes the tensor):

* Activations ``x_...xK``: one scale per 1x128 group along the last axis (K).
  ``quantize_act(x) -> (q_...xK, scale_...xKb)`` with ``Kb = K / 128``; K must be a multiple of 128
  (``pad_k`` pads with zeros, which add exactly nothing to a dot product).
* Weights ``w_NxK`` are stored like PyTorch / Hugging Face linear weights, ``(out, in)`` = (N, K), which is
  also the K-major "B" layout that Hopper FP8 wgmma needs. One scale per 128x128 tile:
  ``quantize_weight(w) -> QWeight(q_NxK, scale_NbxKb)`` with ``Nb = ceil(N/128)``, ``Kb = ceil(K/128)``;
  a ragged last tile is computed as if zero-padded (padding never changes a block's amax), and ``q`` keeps
  the unpadded (N, K) shape. This is exactly the DeepSeek-V3 / vLLM block-FP8 checkpoint convention:
  ``weight`` = q (out, in) E4M3, ``weight_scale_inv`` = scale (ceil(out/128), ceil(in/128)) FP32,
  dequantized weight = q * scale (broadcast over each tile).
* Transposed quantization for the weight-gradient GEMM (dW = dY^T X contracts over tokens):
  ``quantize_act_t(x_MxK) -> (q_KxM, scale_KxMb)``, i.e. 1x128 groups along the token axis, M zero-padded
  to a multiple of 128.

Numerics (the contract in docs/design.md):

* ``scale = max(amax, AMAX_FLOOR) * fp32(1/448)`` in FP32 (the reciprocal, see INV_E4M3_MAX), amax over the finite
  values of the block; the floor makes an all-zero block quantize to exact zeros. With ``pow2=True`` the scale is
  rounded *up* to a power of two (``2**ceil(log2(amax/448))``, as E8M0 scale formats do), so ``|x / scale| <= 448``
  still holds.
* ``q = cast_e4m3(clip(x * (1 / scale), -448, 448))``, round to nearest even (see ``reciprocal`` for why the
  reciprocal is explicit).
* Non-finite values are never hidden: NaN stays NaN, and +-inf becomes NaN too (E4M3fn has no infinity;
  saturating an overflow to a finite value would hide the bug that produced it). Finite neighbours of a
  non-finite value are quantized normally, because amax ignores non-finite values.
* Round trip: ``|x - dequant(q)| <= max(|x| * 2**-4, scale * 2**-10)`` per element (3 mantissa bits: half an
  ulp is 2**-4 of the value for normal E4M3 numbers; the subnormal step is 2**-9 * scale), plus FP32 rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import core
# The format and one quantization step's math live in the dependency-free core that the kernels share; re-exported
# here because this module is the quantizer's public face.
from pallas_kernels.core import (AMAX_FLOOR, BLOCK, E4M3_MAX, FP8_DTYPE, INV_E4M3_MAX,  # noqa: F401
                                 num_blocks, pad_k, reciprocal, to_e4m3)

KV_CACHE_KINDS = ("bf16", "fp8")  # fp8.kv_cache (and the SamplerConfig the trainer builds from it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
  """A 128x128 block-quantized weight: E4M3 ``q_NxK`` and FP32 ``scale_NbxKb`` (dequant = q * scale).

  ``kernel_scale``: None, or ``scale`` as the Hopper GEMM kernel reads it, made once for a loop that runs the same
  weight many times (``fp8jax.ops.with_kernel_scales``, the sampler's decode); the same values, so the same bits."""

  q: jax.Array
  scale: jax.Array
  kernel_scale: jax.Array | None = None

  @property
  def shape(self):
    return self.q.shape

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return dequantize_weight(self, dtype)


def quantize_act(x: jax.Array, pow2: bool = False) -> tuple[jax.Array, jax.Array]:
  """1x128 groups along the last axis: ``x_...xK -> (q_...xK, scale_...xKb)``."""
  *lead, k = x.shape
  core.check_multiple(k, f"activation contraction dim (shape {tuple(x.shape)}, last axis)")
  xb = x.reshape(*lead, k // BLOCK, BLOCK)
  scale = core.scale_from_amax(core.finite_amax(xb, -1), pow2)
  q = to_e4m3(xb.astype(jnp.float32) * reciprocal(scale)[..., None])
  return q.reshape(x.shape), scale


def quantize_act_t(x_MxK: jax.Array, pow2: bool = False) -> tuple[jax.Array, jax.Array]:
  """Transposed quantization for wgrad: ``x_MxK -> (q_KxMp, scale_KxMb)``, groups along tokens (M zero-padded)."""
  if x_MxK.ndim != 2:
    raise ValueError(f"quantize_act_t takes a 2-D (tokens, features) array, got shape {tuple(x_MxK.shape)}")
  return quantize_act(pad_k(x_MxK.T), pow2)


def dequantize_act(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  *lead, k = q.shape
  xb = q.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK) * scale[..., None]
  return xb.reshape(q.shape).astype(dtype)


def quantize_weight(w_NxK: jax.Array, pow2: bool = False) -> QWeight:
  """128x128 tiles: ``w_NxK -> QWeight(q_NxK, scale_NbxKb)``; leading dims (e.g. stacked experts) allowed."""
  if jnp.ndim(w_NxK) < 2:
    raise ValueError(f"quantize_weight: a weight is at least 2-D, stored (out, in) = (N, K) like a torch Linear's "
                     f"(leading dims: stacked experts), got shape {tuple(jnp.shape(w_NxK))}; 1-D parameters (biases, "
                     f"norm scales) stay unquantized")
  *lead, n, k = w_NxK.shape
  nb, kb = num_blocks(n), num_blocks(k)
  wp = pad_k(pad_k(w_NxK, -1), -2).astype(jnp.float32)
  tiles = wp.reshape(*lead, nb, BLOCK, kb, BLOCK)
  scale = core.scale_from_amax(core.finite_amax(tiles, (-3, -1)), pow2)
  q = to_e4m3(tiles * reciprocal(scale)[..., :, None, :, None]).reshape(wp.shape)
  return QWeight(q=q[..., :n, :k], scale=scale)


def expand_weight_scale(scale_NbxKb: jax.Array, n: int, k: int) -> jax.Array:
  """Per-element scale (N, K) of a 128x128-tiled weight."""
  s = jnp.repeat(jnp.repeat(scale_NbxKb, BLOCK, axis=-2), BLOCK, axis=-1)
  return s[..., :n, :k]


def dequantize_weight(w: QWeight, dtype=jnp.float32) -> jax.Array:
  *_, n, k = w.q.shape
  return (w.q.astype(jnp.float32) * expand_weight_scale(w.scale, n, k)).astype(dtype)


def roundtrip_bound(x: jax.Array, scale_per_elem: jax.Array) -> jax.Array:
  """Per-element error bound of quantize->dequantize (module docstring), with FP32 slack."""
  x = jnp.abs(x.astype(jnp.float32))
  return jnp.maximum(x * 2.0**-4, scale_per_elem * 2.0**-10) * (1 + 2.0**-20) + 1e-37


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight:
  """A master weight that ``fp8jax.ops.linear`` quantizes on the fly (training: its gradient reaches ``w``)."""

  w: jax.Array

  @property
  def shape(self):
    return self.w.shape


def is_fp8_leaf(x) -> bool:
  return isinstance(x, (QWeight, FP8Weight))
