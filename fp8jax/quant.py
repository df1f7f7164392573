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

Numerics (the contract in DESIGN.md):

* ``scale = max(amax, AMAX_FLOOR) * fp32(1/448)`` in FP32 (the reciprocal, see INV_E4M3_MAX), amax over the finite values of the block; the floor makes an
  all-zero block quantize to exact zeros. With ``pow2=True`` the scale is rounded *up* to a power of two
  (``2**ceil(log2(amax/448))``, as E8M0 scale formats do), so ``|x / scale| <= 448`` still holds.
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
import fnmatch
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.config_utils import dataclass_from_group
from fp8jax.model import schema

FP8_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128


def num_blocks(d: int) -> int:
  """128-blocks covering d (ceil(d / 128))."""
  return -(-d // BLOCK)


KV_CACHE_KINDS = ("bf16", "fp8")  # fp8.kv_cache (and the SamplerConfig the trainer builds from it)
# Below this amax a block is treated as all-zero (its values quantize to +-0 or tiny subnormals).
AMAX_FLOOR = 1e-30
# scale = amax * INV_E4M3_MAX. XLA rewrites a division by a constant into a multiplication by its FP32 reciprocal,
# so we define the scale that way everywhere (XLA, Pallas kernels, NumPy references) to get the same bits.
INV_E4M3_MAX = float(np.float32(1.0) / np.float32(E4M3_MAX))


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


def _scale_from_amax(amax: jax.Array, pow2: bool) -> jax.Array:
  amax = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR)
  scale = amax * jnp.float32(INV_E4M3_MAX)
  if pow2:
    # Round up to a power of two on the bit pattern: a nonzero mantissa carries into the exponent, then the
    # mantissa is cleared (scale is a positive normal FP32 number here, far below 2**127).
    bits = lax.bitcast_convert_type(scale, jnp.uint32)
    scale = lax.bitcast_convert_type((bits + jnp.uint32(0x7FFFFF)) & jnp.uint32(0xFF800000), jnp.float32)
  return scale


def _finite_amax(x_blocks: jax.Array, axes) -> jax.Array:
  x = x_blocks.astype(jnp.float32)
  return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axes)


def reciprocal(scale: jax.Array) -> jax.Array:
  """1 / scale in FP32. Values are quantized as ``x * reciprocal(scale)``, never ``x / scale``.

  XLA's algebraic simplifier rewrites ``x / broadcast(s)`` into ``x * broadcast(1 / s)`` in some fusions and not
  in others, which changes the rounding of midpoint values (seen: -25.000002 vs -25.0 -> E4M3 -26 vs -24 between
  two compilations of the same K/V quantization). Writing the multiplication ourselves makes every program (and
  every kernel and NumPy reference) compute the same bits.
  """
  return jnp.float32(1.0) / scale.astype(jnp.float32)


def to_e4m3(x_scaled: jax.Array, *, native_cast: bool | None = None) -> jax.Array:
  """Clip to +-448 and round to E4M3 (nearest even); non-finite -> NaN.

  Two implementations with the same bits, picked by platform (``native_cast=None``: the hardware cast when the
  program is lowered for CUDA, the exact FP32 rounding elsewhere; ``True`` / ``False`` force one, e.g. inside a
  Pallas kernel body, where ``lax.platform_dependent`` does not lower):

  * exact FP32 rounding, then a cast that only changes the storage type. A plain FP32 -> FP8 convert is not safe to
    rely on everywhere: XLA:CPU lowers some FP8 converts through FP16, a double rounding that disagrees with the
    direct cast on rare midpoint values. Normal E4M3 range (|x| >= 2**-6): E4M3 keeps 3 of FP32's 23 mantissa bits,
    so the low 20 bits are rounded off on the bit pattern (add 0x7FFFF plus the lowest kept bit, then mask: round to
    nearest even; a carry moves into the exponent as it should). Subnormals (|x| < 2**-6) have the fixed step 2**-9:
    ``round(x * 512) / 512``, exact. About a dozen integer ops per element.
  * native: the clipped FP32 value cast directly (sm_90: ``cvt.rn.satfinite.e4m3x2.f32``, one rounding to nearest
    even, two elements per instruction), which keeps the quantization kernels memory-bound.

  Both are checked against an independent single-rounding reference (ml_dtypes) over all 2**32 FP32 bit patterns:
  the exact rounding on CPU and the H200, the native cast on the H200 through XLA and through a Pallas Triton
  kernel (``scripts/check_e4m3_exhaustive.py``, docs/benchmarks.md); the CI test checks every rounding boundary.
  """
  x = jnp.clip(x_scaled.astype(jnp.float32), -E4M3_MAX, E4M3_MAX)

  def exact():
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + (jnp.uint32(0x7FFFF) + ((bits >> 20) & jnp.uint32(1)))) & jnp.uint32(0xFFF00000)
    normal = lax.bitcast_convert_type(bits, jnp.float32)
    subnormal = jnp.round(x * jnp.float32(512.0)) * jnp.float32(1.0 / 512.0)
    return jnp.where(jnp.abs(x) < jnp.float32(2.0**-6), subnormal, normal)

  if native_cast is None:
    y = lax.platform_dependent(cuda=lambda: x, default=exact)
  else:
    y = x if native_cast else exact()
  return jnp.where(jnp.isfinite(x_scaled), y, jnp.nan).astype(FP8_DTYPE)


def _check_multiple(dim: int, what: str):
  if dim % BLOCK:
    raise ValueError(f"{what} = {dim} must be a multiple of {BLOCK} for 1x{BLOCK} FP8 groups "
                     f"(pad it with fp8jax.quant.pad_k, which adds zeros)")


def pad_k(x: jax.Array, axis: int = -1, multiple: int = BLOCK) -> jax.Array:
  """Zero-pads ``axis`` to a multiple of ``multiple`` (128 by default; zeros contribute exactly nothing to a dot
  product)."""
  axis = axis % x.ndim
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def quantize_act(x: jax.Array, pow2: bool = False) -> tuple[jax.Array, jax.Array]:
  """1x128 groups along the last axis: ``x_...xK -> (q_...xK, scale_...xKb)``."""
  *lead, k = x.shape
  _check_multiple(k, f"activation contraction dim (shape {tuple(x.shape)}, last axis)")
  xb = x.reshape(*lead, k // BLOCK, BLOCK)
  scale = _scale_from_amax(_finite_amax(xb, -1), pow2)
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
  *lead, n, k = w_NxK.shape
  nb, kb = num_blocks(n), num_blocks(k)
  wp = pad_k(pad_k(w_NxK, -1), -2).astype(jnp.float32)
  tiles = wp.reshape(*lead, nb, BLOCK, kb, BLOCK)
  scale = _scale_from_amax(_finite_amax(tiles, (-3, -1)), pow2)
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


# ------------------------------------------------------------------------------------------------------------------
# Recipes: which parameters become FP8.
# ------------------------------------------------------------------------------------------------------------------


MODES = ("fp8", "bf16", "fp8_rollout")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a model's linear layers are quantized. Built from the config's ``fp8`` group by ``Recipe.from_config``.

  mode: "fp8" (block FP8 GEMMs in the sampler and the trainer: one engine), "bf16" (no quantization; same call
    sites), or "fp8_rollout" (FP8 in generation only, NeMo RL's two-engine setup: the sampler runs block-FP8 weights
    requantized from the BF16 policy after every step, and the FP8 KV cache if kv_cache="fp8"; the trainer runs BF16,
    K/V unquantized). A "fp8_rollout" recipe is not used directly: ``sampler_side()`` / ``trainer_side()`` give the
    one-sided recipe each engine runs, with the same model function and quantizer as the other modes.
  keep_first_n / keep_last_n: decoder layers kept in BF16 at either end (NeMo RL's recipe allows this).
  keep_patterns: fnmatch patterns over parameter paths ("layers/3/wo", "*/w_down") kept in BF16.
  pow2_scales: round scales up to powers of two.
  kv_cache: "bf16" or "fp8" (rollout KV cache; training applies the same K/V quantization when "fp8").
  gemm_backend: "auto" (Pallas kernel on sm_90, XLA reference elsewhere), "xla" or "pallas".
  Embeddings, norms and the output head are never quantized (``lm_head`` can be opted in with quantize_lm_head).
  """

  mode: str = "fp8"
  keep_first_n: int = 0
  keep_last_n: int = 0
  keep_patterns: tuple[str, ...] = ()
  pow2_scales: bool = False
  kv_cache: str = "bf16"
  gemm_backend: str = "auto"
  quantize_lm_head: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"fp8.mode must be one of {MODES}, got {self.mode!r}")
    if self.kv_cache not in KV_CACHE_KINDS:
      raise ValueError(f"fp8.kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
    if self.gemm_backend not in ("auto", "xla", "pallas"):
      raise ValueError(f"fp8.gemm_backend must be 'auto', 'xla' or 'pallas', got {self.gemm_backend!r}")
    if self.keep_first_n < 0 or self.keep_last_n < 0:
      raise ValueError("fp8.keep_first_n and fp8.keep_last_n must be >= 0")

  @classmethod
  def from_config(cls, c: Any) -> "Recipe":
    return dataclass_from_group(cls, c, "fp8")

  def sampler_side(self) -> "Recipe":
    """The recipe the sampler runs: FP8 weights for "fp8_rollout", else this recipe."""
    return dataclasses.replace(self, mode="fp8") if self.mode == "fp8_rollout" else self

  def trainer_side(self) -> "Recipe":
    """The recipe the trainer runs: BF16 GEMMs and unquantized K/V for "fp8_rollout", else this recipe."""
    return dataclasses.replace(self, mode="bf16", kv_cache="bf16") if self.mode == "fp8_rollout" else self

  def check_one_side(self, what: str) -> None:
    """Raises for a two-sided ("fp8_rollout") recipe where one engine's recipe is needed."""
    if self.mode == "fp8_rollout":
      raise ValueError(f"{what}: fp8.mode='fp8_rollout' quantizes the sampler's weights only; pick the engine's "
                       f"recipe with Recipe.sampler_side() or Recipe.trainer_side() first")

  def selects(self, path: str, layer: int | None, num_layers: int) -> bool:
    """Whether the linear weight at ``path`` (in decoder layer ``layer``, or None) is quantized to FP8."""
    self.check_one_side("Recipe.selects (quantize_params / mark_fp8)")
    if self.mode != "fp8":
      return False
    if layer is not None and (layer < self.keep_first_n or layer >= num_layers - self.keep_last_n):
      return False
    return not any(fnmatch.fnmatchcase(path, p) for p in self.keep_patterns)


# Linear weights of the model (the names used in fp8jax.model params); everything else stays BF16/FP32.
LINEAR_NAMES = schema.LINEAR_NAMES  # the layer weights the recipe may quantize (lm_head: Recipe.quantize_lm_head)


def _walk_linear(params: dict, recipe: Recipe, fn):
  """Applies ``fn(w)`` to every linear weight ``recipe`` selects; returns a new tree with the same structure."""
  layers = params["layers"]
  out = dict(params)
  out["layers"] = [
      {name: (fn(w) if name in LINEAR_NAMES and recipe.selects(f"layers/{i}/{name}", i, len(layers)) else w)
       for name, w in layer.items()}
      for i, layer in enumerate(layers)
  ]
  if "lm_head" in params and recipe.quantize_lm_head and recipe.selects("lm_head", None, len(layers)):
    out["lm_head"] = fn(params["lm_head"])
  return out


def quantize_params(params: dict, recipe: Recipe) -> dict:
  """Master params -> the same tree with every selected linear weight replaced by a ``QWeight``.

  This is what the sampler, the reference policy and the FP8 export run on; the trainer's forward quantizes the
  same weights with the same ``quantize_weight`` inside ``fp8jax.ops.linear`` (see ``mark_fp8``), so both agree.
  """
  return _walk_linear(params, recipe, lambda w: quantize_weight(w, recipe.pow2_scales))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight:
  """A master weight that ``fp8jax.ops.linear`` quantizes on the fly (training: its gradient reaches ``w``)."""

  w: jax.Array

  @property
  def shape(self):
    return self.w.shape


def mark_fp8(params: dict, recipe: Recipe) -> dict:
  """Master params -> tree where each selected linear weight is wrapped in ``FP8Weight`` (differentiable).

  Weights that are already ``QWeight`` (from ``quantize_params``) stay as they are.
  """
  return _walk_linear(params, recipe, lambda w: w if isinstance(w, QWeight) else FP8Weight(w))


def is_fp8_leaf(x) -> bool:
  return isinstance(x, (QWeight, FP8Weight))
