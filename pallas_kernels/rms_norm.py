"""RMSNorm over the last axis with a fixed tile per row (Pallas, Triton backend): a row's bits do not depend on how
many rows there are.

Why a kernel: XLA's row-reduction emitter chooses its strategy (threads per row, vectorization, how partial sums
meet) from the whole shape and the fusion around it, so the same row summed among 64 decode rows and among 4096
training rows can round differently in FP32; after the rsqrt and the cast to BF16 that shows in roughly one row in two
thousand (measured on the H200 with ``fp8jax.diagnostics.one_engine.block_divergence``, FP8 + FP8 KV: one MLP-norm row
of 1984 differed by one BF16 ulp, with both inputs bitwise equal). That is enough to make the sampler's log-probs
differ from the trainer's. Here every program normalizes ``rows_per_tile(D)`` rows (a function of D only) with the same
tile body, so each row is reduced by the same code in decode, prefill and training.

Numerics: ``rms_rows`` is the one definition, used by the plain-jnp reference (whole arrays) and by the kernel body
(one tile): HF's LlamaRMSNorm (normalize in FP32, cast, then scale by the weight), with a power-of-two prescale of
rows whose max |x| exceeds ``SAFE_AMAX`` so that mean(x^2) cannot overflow FP32 (exact; every other row has scale 1,
where each operation is the plain formula's). The scale is built from the exponent bits (no frexp), so the body
lowers to Triton as it is.

``add_rms_norm``: the residual add before a pre-norm fused into the same kernel (x + h written out and normalized in
one launch; the norm rows are ``rms_norm``'s of the sum, the same tile and body), which the model's decoder layers
use (``fp8jax.model.layers.add_rms_norm``).

Shapes: any D up to 16384 (``unsupported`` says why not otherwise; the caller then runs the reference and logs it);
any number of rows (padded with zero rows to the tile height). A width that is not a power of two (SmolLM2's 576,
Qwen2.5's 896 or 3584) runs on a tile of the next power of two (at least 64): zero columns pad it, which add nothing
to max |x| or to the sum of squares, and the mean divides by the true width. Such widths must not fall back to XLA's
reduction: its summation order follows the layout XLA picks for the whole program, and under ``jax.value_and_grad``
XLA stores the residual stream transposed (for the weight gradients' GEMMs) and sums the 576 columns as a column
reduction, so the train step's forward pass left the log-prob pass's bits (``scripts/check_grad_forward.py``: 84% of
a 1-layer BF16 SmolLM2's log-probs bitwise before this, 100% at every depth after). The kernel is one opaque call in
both programs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.core import invariant_sum

# Rows with max |x| above this are rescaled before mean(x^2): below it, x^2 <= 2**96 and a sum of up to 2**32 of them
# stays below FP32's max (2**128).
SAFE_AMAX = 2.0**48
TILE_ELEMS = 8192  # FP32 elements of x per program: 64 registers per thread at 4 warps
NUM_WARPS = 4


def rms_rows(x, w, eps: float, row_sum=None, width: int | None = None):
  """RMSNorm of each row of ``x`` (..., D) by ``w`` (D,) or (1, D), in x's dtype (module docstring). ``row_sum``:
  how mean(x^2)'s sum is taken (default ``jnp.sum``; the CPU path passes a fixed-order one). ``width``: the rows'
  true width when the last ``D - width`` columns are zero padding (the kernel's tile), else None (D)."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
  # amax = m * 2**e with m in [0.5, 1): e = exponent field - 126; scale = 2**-min(e, 126) (a normal number)
  field = lax.shift_right_logical(lax.bitcast_convert_type(amax, jnp.int32), jnp.int32(23))
  pow2 = lax.bitcast_convert_type(lax.shift_left(jnp.maximum(253 - field, 1), jnp.int32(23)), jnp.float32)
  scale = jnp.where((amax > SAFE_AMAX) & (amax < jnp.inf), pow2, jnp.float32(1.0))  # NaN / inf rows: scale 1
  xs = x32 * scale
  if row_sum is None and width in (None, x.shape[-1]):
    ms = jnp.mean(xs * xs, axis=-1, keepdims=True)
  else:
    ms = (jnp.sum(xs * xs, axis=-1) if row_sum is None else row_sum(xs * xs))[..., None] / (width or x.shape[-1])
  y = xs * lax.rsqrt(ms + eps * (scale * scale))
  # w * y in x's dtype, computed in FP32 and rounded once: the product of two BF16 values is exact in FP32, so these
  # are the bits of the BF16 product; but the weight's gradient (the sum over every row of cotangent * y) now adds
  # up in FP32. With BF16 products XLA summed it in BF16 (no excess precision: fp8jax.COMPILER_OPTIONS): over 8,192
  # rows, 0.9% of the largest entry off on XLA:CPU (tests/test_rms_norm.py).
  return (w.astype(x.dtype).astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def rms_norm_reference(x, w, eps: float):
  """Plain jnp over the whole array (the kernel's reference)."""
  return rms_rows(x, w, eps)


def rms_norm_invariant(x, w, eps: float):
  """``rms_rows`` whose rows do not depend on how many rows there are, also on XLA:CPU (the kernel's job on GPUs).

  XLA:CPU, too, picks how it reduces a row from the whole shape: the tiny default's trainer normalized one row of
  32 sequences differently (one BF16 ulp) when the batch had 128 sequences (2026-12-02). The sum of squares is
  therefore ``invariant_sum`` (on CPU pairwise, a fixed order for every shape; elsewhere the plain sum)."""
  return rms_rows(x, w, eps, row_sum=invariant_sum)


MAX_WIDTH = 16384


def tile_width(d: int) -> int:
  """The kernel tile's width for rows of width ``d``: the next power of two, at least 64 (zero columns pad the rest)."""
  return max(64, 1 << (d - 1).bit_length())


def rows_per_tile(d: int) -> int:
  return max(1, min(64, TILE_ELEMS // tile_width(d)))


def unsupported(x) -> str | None:
  """Why the kernel cannot normalize ``x``'s rows, or None."""
  d = x.shape[-1]
  if d < 1 or d > MAX_WIDTH:
    return f"RMSNorm width {d} (shape {tuple(x.shape)}) is outside the kernel's [1, {MAX_WIDTH}]"
  return None


def residual_add(x, h):
  """The residual stream's add ``x + h`` in x's dtype, written out: the FP32 sum of the two values rounded once to
  x's dtype. For BF16 that is the correctly rounded BF16 sum (the FP32 add of two BF16 values is exact unless their
  exponents differ by more than 16, and then the smaller one is far below half a BF16 ulp), i.e. what ``x + h``
  gives on every backend; the kernel and the reference path compute it the same way."""
  return (x.astype(jnp.float32) + h.astype(jnp.float32)).astype(x.dtype)


def add_rms_norm_reference(x, h, w, eps: float):
  """(x + h, RMSNorm(x + h)): the fused kernel's reference (whole arrays)."""
  s = residual_add(x, h)
  return s, rms_rows(s, w, eps)


def _kernel(x_ref, w_ref, o_ref, *, eps: float, width: int):
  o_ref[...] = rms_rows(x_ref[...], w_ref[...], eps, width=width)


def _add_kernel(x_ref, h_ref, w_ref, s_ref, o_ref, *, eps: float, width: int):
  s = residual_add(x_ref[...], h_ref[...])
  s_ref[...] = s
  o_ref[...] = rms_rows(s, w_ref[...], eps, width=width)  # _kernel's tile and body on the stored sum: the same bits


def _launch(kernel, rows: list, w, eps: float, n_out: int, interpret: bool, name: str):
  """One program per ``rows_per_tile(D)`` rows of the (..., D) arrays ``rows`` (zero rows pad the last tile, zero
  columns the tile's width, ``tile_width(D)``)."""
  x = rows[0]
  why = unsupported(x)
  if why is not None:
    raise ValueError(f"rms_norm kernel: {why}")
  *lead, d = x.shape
  m, r, dp = math.prod(lead), rows_per_tile(d), tile_width(d)
  mp = -(-max(m, 1) // r) * r
  args = [jnp.pad(a.reshape(-1, d), ((0, mp - m), (0, dp - d))) for a in rows]
  spec = pl.BlockSpec((r, dp), lambda i: (i, 0))
  outs = pl.pallas_call(
      functools.partial(kernel, eps=eps, width=d),
      out_shape=[jax.ShapeDtypeStruct((mp, dp), x.dtype)] * n_out,
      grid=(mp // r,),
      in_specs=[spec] * len(rows) + [pl.BlockSpec((1, dp), lambda i: (0, 0))],
      out_specs=[spec] * n_out,
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret, name=name,
  )(*args, jnp.pad(w.reshape(1, d), ((0, 0), (0, dp - d))))
  return [o[:m, :d].reshape(x.shape) for o in outs]


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x, w, eps: float, *, interpret: bool = False):
  """RMSNorm of ``x`` (..., D) by ``w`` (D,): the reference's math, one fixed tile per ``rows_per_tile(D)`` rows."""
  return _launch(_kernel, [x], w, eps, 1, interpret, "fp8jax_rms_norm")[0]


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, h, w, eps: float, *, interpret: bool = False):
  """(s, RMSNorm(s)) for s = x + h (``residual_add``), both (..., D) in x's dtype: the residual add fused into the
  norm's kernel (one launch instead of an XLA add and the norm). The norm's rows are ``rms_norm(s)``'s bits: the
  same tile and body run on the same sum."""
  if h.shape != x.shape or h.dtype != x.dtype:
    raise ValueError(f"add_rms_norm: x {x.shape} {x.dtype} and h {h.shape} {h.dtype} must match")
  s, y = _launch(_add_kernel, [x, h], w, eps, 2, interpret, "fp8jax_add_rms_norm")
  return s, y
