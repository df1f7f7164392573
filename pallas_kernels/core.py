"""The numerics every layer of fp8jax shares, with no dependency but jax: block size, E4M3 rounding, scales, and the
fixed-order sums.

``fp8jax`` (the quantizer ``fp8jax.quant``, the model, the ops) and the kernels in ``pallas_kernels`` both import
this module, and it imports neither: the kernels import nothing from ``fp8jax`` (tests/test_imports.py checks it).
What lives here is what the kernels and their plain-jnp references must compute identically:

* the format: E4M3 (``jnp.float8_e4m3fn``; finite max 448, no infinities), 128-wide blocks, FP32 scales;
* ``scale_from_amax`` / ``finite_amax`` / ``reciprocal`` / ``to_e4m3``: one quantization step's math (the contract
  is written out in ``fp8jax.quant``, which builds the quantizer from these);
* ``pairwise_sum`` / ``pairwise_max`` / ``invariant_sum`` / ``invariant_dot``: sums and dots whose rows do not depend
  on the number of rows (batch invariance on XLA:CPU, where XLA picks reduction orders and matmul blockings from the
  whole shape);
* ``segment_sum``: a scatter-add (rows summed per id) in a fixed order, where XLA:GPU's scatter adds with atomics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
# Below this amax a block is treated as all-zero (its values quantize to +-0 or tiny subnormals).
AMAX_FLOOR = 1e-30
# scale = amax * INV_E4M3_MAX. XLA rewrites a division by a constant into a multiplication by its FP32 reciprocal,
# so the scale is defined that way everywhere (XLA, Pallas kernels, NumPy references) to get the same bits.
INV_E4M3_MAX = float(np.float32(1.0) / np.float32(E4M3_MAX))


def num_blocks(d: int) -> int:
  """128-blocks covering d (ceil(d / 128))."""
  return -(-d // BLOCK)


def scale_from_amax(amax: jax.Array, pow2: bool) -> jax.Array:
  """``max(amax, AMAX_FLOOR) * fp32(1/448)`` in FP32; with ``pow2`` rounded up to a power of two."""
  amax = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR)
  scale = amax * jnp.float32(INV_E4M3_MAX)
  if pow2:
    # Round up to a power of two on the bit pattern: a nonzero mantissa carries into the exponent, then the
    # mantissa is cleared (scale is a positive normal FP32 number here, far below 2**127).
    bits = lax.bitcast_convert_type(scale, jnp.uint32)
    scale = lax.bitcast_convert_type((bits + jnp.uint32(0x7FFFFF)) & jnp.uint32(0xFF800000), jnp.float32)
  return scale


def finite_amax(x_blocks: jax.Array, axes) -> jax.Array:
  """Max of |x| over ``axes``, ignoring non-finite values (they become NaN codes, never hide in a scale)."""
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
  kernel (``scripts/check_e4m3_exhaustive.py``); the CI test checks every rounding boundary.
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


def check_multiple(dim: int, what: str):
  """Raises unless ``dim`` is a multiple of 128, naming ``what``."""
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


# ------------------------------------------------------------------------------------------------------------------
# Fixed-order sums and dots (batch invariance where XLA would choose the order by shape)
# ------------------------------------------------------------------------------------------------------------------

ROW_TILE = 16


def invariant_dot(a_MxK, b_NxK):
  """FP32-accumulated a . b^T whose rows do not depend on M (batch invariance, also on XLA:CPU).

  XLA:CPU picks its matmul blocking from all three dims, so the same row can round differently at another M
  (seen for bf16 (56, 512) x (512, 256) vs (28, 512)). On CPU we therefore run a batch of fixed-shape
  (ROW_TILE, K) x (K, N) products: every row goes through the same code whatever M is. Other platforms get a
  plain dot (on GPUs the Pallas kernels provide the invariance).
  """
  m, k = a_MxK.shape
  if jax.default_backend() != "cpu":
    return jnp.dot(a_MxK, b_NxK.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  mp = -(-m // ROW_TILE) * ROW_TILE
  a = jnp.pad(a_MxK, ((0, mp - m), (0, 0))).reshape(mp // ROW_TILE, ROW_TILE, k)
  out = jnp.einsum("itk,nk->itn", a, b_NxK, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return out.reshape(mp, -1)[:m]


@jax.custom_vjp
def pairwise_sum(x):
  """Sum over the last axis in one fixed order on every backend and for every shape: pairwise halving (zero-padded to
  a power of two), i.e. only elementwise adds, so no reduction emitter chooses the order. XLA:CPU's row reductions
  pick their vectorization from the whole shape, so ``jnp.sum`` of the same row can round differently among 128 rows
  than among 4096; the batch-invariant CPU paths (the RMSNorm and output-head references) sum with this instead.
  Its gradient is a sum's (the cotangent broadcast over the axis), not the transposed tree of slices."""
  return _pairwise_sum(x)


def _pairwise_sum(x):
  return _pairwise(x, jnp.add, 0)


def _pairwise(x, op, pad_value):
  n = x.shape[-1]
  width = 1 << max(0, (n - 1).bit_length())
  if width != n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)], constant_values=pad_value)
  while width > 1:
    width //= 2
    x = op(x[..., :width], x[..., width:])
  return x[..., 0]


pairwise_sum.defvjp(lambda x: (_pairwise_sum(x), x.shape), lambda shape, g: (jnp.broadcast_to(g[..., None], shape),))


def pairwise_max(x):
  """Max over the last axis as elementwise maxima (``pairwise_sum``'s halving): no reduce. The max itself is exact in
  any order, but XLA:CPU compiles an elementwise op fused after a row reduce per shape: ``exp(z - max(z))`` over
  the same row came out differently among 4 rows than among 512 (rows of 8 and of 128), and not after this max."""
  return _pairwise(x, jnp.maximum, -jnp.inf)


def invariant_sum(x):
  """Sum over the last axis whose rows do not depend on the row count: ``pairwise_sum`` on CPU (as ``invariant_dot``
  runs fixed tiles there), a plain ``jnp.sum`` elsewhere (on GPUs XLA's fusions, tiled alike at every N once the
  fusion autotuner is off: ``fp8jax.COMPILER_OPTIONS``)."""
  return pairwise_sum(x) if jax.default_backend() == "cpu" else jnp.sum(x, axis=-1)


def segment_sum(ids, rows, num_segments: int, dtype=jnp.float32):
  """``zeros((num_segments, D), dtype).at[ids].add(rows)`` with every sum in one fixed order, run to run.

  XLA:GPU runs a scatter-add with atomic adds, so rows that share an id are summed in whatever order the threads
  arrive: an embedding table's gradient (thousands of cotangents per common token) differed in its last bits on
  every call (H100, 2026-12-07: 0 of 10 repeats bitwise, at SmolLM2's and at Llama-3.1-8B's shapes), and so did
  every run's weights after the first step. Here the rows are sorted by id (a stable sort), each id's rows summed by
  a segmented scan (``lax.associative_scan``: a fixed tree of elementwise adds, no atomics), and each id's total
  written once by a scatter without duplicates. ``ids``: (N,) ints in [0, num_segments); ``rows``: (N, D), summed
  in ``dtype``. The error is a pairwise sum's (about log2 of an id's count roundings), not a left-to-right one's."""
  ids, rows = jnp.asarray(ids), jnp.asarray(rows)  # NumPy ids (a caller's constant) cannot be indexed by a tracer
  if ids.shape[0] == 0:
    return jnp.zeros((num_segments, rows.shape[-1]), dtype)
  order = jnp.argsort(ids, stable=True)
  sid = ids[order]
  x = rows[order].astype(dtype)
  new = sid[1:] != sid[:-1]
  first = jnp.concatenate([jnp.ones((1,), bool), new])  # a segment starts here
  last = jnp.concatenate([new, jnp.ones((1,), bool)])  # ... and ends here: its running sum is its total

  def combine(a, b):  # (starts, sums) of two adjacent spans: b's sums restart where b holds a segment start
    return a[0] | b[0], jnp.where(b[0][:, None], b[1], a[1] + b[1])

  _, running = lax.associative_scan(combine, (first, x))
  target = jnp.where(last, sid, num_segments)  # out of range: dropped
  return jnp.zeros((num_segments, x.shape[-1]), dtype).at[target].set(running, mode="drop")
