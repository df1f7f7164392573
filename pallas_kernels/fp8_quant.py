"""Activation quantization kernels (Pallas, Triton backend): one pass over BF16/FP32 activations -> E4M3 + scales.

Reference: ``fp8jax.quant.quantize_act`` / ``quantize_act_t`` (the quantizer). The kernel bodies and the quantizer
call the same ``pallas_kernels.core`` functions (``finite_amax``, ``scale_from_amax``, ``reciprocal``, ``to_e4m3``),
so the numerics are the quantizer's
by construction (compiled: ``to_e4m3``'s native-cast form, the one XLA uses on CUDA too; interpret mode: its exact
FP32 rounding, the CPU form), and the GPU tests check the outputs bit for bit against the XLA quantizer.

Why a kernel (measured on the H200, docs/history.md): XLA's fusions of the quantizer ran at ~1.4 TB/s for
``quantize_act`` and ~0.4 TB/s for ``quantize_act_t`` (it materializes the transpose), so the four activation
quantizations of a Llama-8B layer forward cost 16.7% of its four FP8 GEMMs. These kernels load each block once,
reduce the 1x128 groups in registers and write E4M3 + FP32 scales: 2.2x (``quantize_act``, 3.0-3.3 TB/s) and
5.6-5.9x (``quantize_act_t``, 2.4-2.5 TB/s) faster, 7.5% of the GEMM time.

* ``quantize_act(x_MxK)``: 1x128 groups along K; one program per (block_m x 128) block.
* ``quantize_act_t(x_MxK) -> (q_KxMp, scale_KxMb)``: the weight-gradient layout (groups along tokens). Each program
  loads a (128 x block_k) block, transposes it in registers/SMEM and quantizes the transposed rows, so the
  transpose costs no extra pass over memory.

Default block sizes (64 rows; 64 features for the transposed kernel; 4 warps) are the fastest of a sweep on the
H200 (``scripts/bench_gemm.py --quant``).

Why the Pallas Triton backend: a memory-bound elementwise kernel with per-row reductions is what Triton lowers well,
the kernel runs in interpret mode on CPU so CI checks this exact body, and the quantizer's functions lower as they
are (no extra package: jax-triton is not in the H200 image, and a raw ``triton.jit`` kernel cannot run on CPU).
Shapes: M >= 1 any (padded to the block height when ragged), K a multiple of 128 (the quantizer's own error
otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import core

BLOCK = core.BLOCK


def _quantize_rows(x, pow2: bool, native_cast: bool):
  """(rows, 128) values -> (E4M3 (rows, 128), FP32 scale (rows, 1)): the quantizer's math on one tile."""
  x = x.astype(jnp.float32)
  scale = core.scale_from_amax(core.finite_amax(x, -1), pow2)
  q = core.to_e4m3(x * core.reciprocal(scale)[:, None], native_cast=native_cast)
  return q, scale[:, None]


def _act_kernel(x_ref, q_ref, s_ref, *, pow2: bool, native_cast: bool, scales_t: bool):
  q, s = _quantize_rows(x_ref[...], pow2, native_cast)
  q_ref[...] = q
  s_ref[...] = s.reshape(s_ref.shape) if scales_t else s


def _act_t_kernel(x_ref, q_ref, s_ref, *, pow2: bool, native_cast: bool):
  q_ref[...], s_ref[...] = _quantize_rows(x_ref[...].T, pow2, native_cast)


def _check_2d(x, name: str):
  if x.ndim != 2:
    raise ValueError(f"{name} takes a 2-D (tokens, features) array, got shape {tuple(x.shape)}")
  if x.shape[0] == 0:
    raise ValueError(f"{name}: M must be >= 1, got shape {tuple(x.shape)}")


@functools.partial(jax.jit, static_argnames=("pow2", "block_m", "num_warps", "interpret", "scales_t"))
def quantize_act(x: jax.Array, pow2: bool = False, *, block_m: int = 64, num_warps: int = 4,
                 interpret: bool = False, scales_t: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x_...xK -> (q_...xK, scale_...xKb)``, bitwise equal to ``fp8jax.quant.quantize_act``.

  ``scales_t`` (2-D x only): the scales come transposed, (Kb, M), the layout the Hopper GEMM kernel reads
  (``fp8_gemm_mgpu.fp8_gemm(a_scales_t=True)``), written so by the kernel: no transpose op after it."""
  *lead, k = x.shape
  if scales_t and x.ndim != 2:
    raise ValueError(f"quantize_act(scales_t=True) takes a 2-D (tokens, features) array, got {tuple(x.shape)}")
  core.check_multiple(k, f"activation contraction dim (shape {tuple(x.shape)}, last axis)")
  x2 = x.reshape(-1, k)
  _check_2d(x2, "quantize_act kernel")
  m = x2.shape[0]
  bm = min(block_m, pl.next_power_of_2(m))
  xp = core.pad_k(x2, 0, bm)
  mp, kb = xp.shape[0], k // BLOCK
  if scales_t:
    s_shape, s_spec = (kb, mp), pl.BlockSpec((1, bm), lambda i, j: (j, i))
  else:
    s_shape, s_spec = (mp, kb), pl.BlockSpec((bm, 1), lambda i, j: (i, j))
  q, s = pl.pallas_call(
      functools.partial(_act_kernel, pow2=pow2, native_cast=not interpret, scales_t=scales_t),
      out_shape=(jax.ShapeDtypeStruct((mp, k), core.FP8_DTYPE), jax.ShapeDtypeStruct(s_shape, jnp.float32)),
      grid=(mp // bm, kb),
      in_specs=[pl.BlockSpec((bm, BLOCK), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((bm, BLOCK), lambda i, j: (i, j)), s_spec],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
  )(xp)
  if scales_t:
    return q[:m], s[:, :m]
  return q[:m].reshape(x.shape), s[:m].reshape(*lead, kb)


@functools.partial(jax.jit, static_argnames=("pow2", "block_k", "num_warps", "interpret"))
def quantize_act_t(x_MxK: jax.Array, pow2: bool = False, *, block_k: int = 64, num_warps: int = 4,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x_MxK -> (q_KxMp, scale_KxMb)``, bitwise equal to ``fp8jax.quant.quantize_act_t`` (M zero-padded to 128)."""
  _check_2d(x_MxK, "quantize_act_t kernel")
  k = x_MxK.shape[1]
  bk = min(block_k, pl.next_power_of_2(k))
  xp = core.pad_k(core.pad_k(x_MxK, 0), 1, bk)  # ragged K: the padded feature rows are sliced off again
  mp, kp = xp.shape
  q, s = pl.pallas_call(
      functools.partial(_act_t_kernel, pow2=pow2, native_cast=not interpret),
      out_shape=(jax.ShapeDtypeStruct((kp, mp), core.FP8_DTYPE),
                 jax.ShapeDtypeStruct((kp, mp // BLOCK), jnp.float32)),
      grid=(mp // BLOCK, kp // bk),
      in_specs=[pl.BlockSpec((BLOCK, bk), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((bk, BLOCK), lambda i, j: (j, i)), pl.BlockSpec((bk, 1), lambda i, j: (j, i))],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
  )(xp)
  return (q[:k], s[:k]) if kp != k else (q, s)
