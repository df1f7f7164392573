"""Interpret-mode stand-in for the Hopper FP8 GEMM in the CPU tests: a block-scaled FP8 GEMM ``C = A . B^T``
through the Pallas Triton backend. Not part of the library (nothing in ``fp8jax`` dispatches it) and never run on a
GPU: ``kernel_standins.install`` puts it in place of ``pallas_kernels.fp8_gemm_mgpu.fp8_gemm`` for the tests of the
"pallas" path on fake CPU devices, and tests/test_fp8_gemm_kernels.py checks it against
``pallas_kernels.fp8_gemm.fp8_gemm_reference``.

Same operands, math and signature as the Mosaic kernel (see ``pallas_kernels.fp8_gemm``). Per program: one
(block_m x block_n) tile of C; for each 128-wide K block in increasing order, an FP8 dot into a fresh FP32
accumulator, then ``acc += blk * (a_scale[m] * b_scale[n])`` (the numerics contract: per-block promotion, fixed K
order, no split-K, so rows are batch invariant). M is zero-padded to block_m. (Once a portable GPU fallback, measured
at ~320 TFLOP/s on the H200 at M = 8192 and never dispatched: docs/history.md.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp8_gemm import BLOCK, check_operands


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """block_m x block_n output tile per program (block_n divides 128 so one B tile scale covers it)."""

  block_m: int = 128
  block_n: int = 128
  num_warps: int = 8
  num_stages: int = 4

  def __post_init__(self):
    if self.block_m not in (16, 32, 64, 128):
      raise ValueError(f"TuningConfig.block_m must be 16, 32, 64 or 128, got {self.block_m}")
    if self.block_n not in (32, 64, 128):
      raise ValueError(f"TuningConfig.block_n must be 32, 64 or 128, got {self.block_n}")


def choose_config(m: int, n: int) -> TuningConfig:
  """Small M (decode): short tiles, narrower N for more programs; large M: 128x128."""
  del n
  if m <= 16:
    return TuningConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)
  if m <= 64:
    return TuningConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)
  return TuningConfig(block_m=128, block_n=128, num_warps=8, num_stages=4)


def _kernel(a_ref, as_ref, b_ref, bs_ref, o_ref, *, cfg: TuningConfig, k_blocks: int, row_scales: bool):
  bm, bn = cfg.block_m, cfg.block_n
  i, j = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(i * bm, bm)
  cols = pl.ds(j * bn, bn)

  def body(kb, acc):
    kk = pl.ds(pl.multiple_of(kb * BLOCK, BLOCK), BLOCK)
    a = a_ref[rows, kk]
    b = b_ref[cols, kk]
    blk = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    sa = as_ref[rows, kb]
    if row_scales:
      sb = bs_ref[cols, kb]
      scale = sa[:, None] * sb[None, :]
    else:
      sb = bs_ref[(j * bn) // BLOCK, kb]
      scale = jnp.broadcast_to((sa * sb)[:, None], (bm, bn))
    return acc + blk * scale

  acc = lax.fori_loop(0, k_blocks, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[rows, cols] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def fp8_gemm(a_q, a_s, b_q, b_s, *, out_dtype=jnp.bfloat16, config: TuningConfig | None = None,
             interpret: bool = False):
  """C = A . B^T with block-scaled E4M3 operands; returns (M, N) ``out_dtype``."""
  check_operands(a_q, a_s, b_q, b_s)
  (m, k), n = a_q.shape, b_q.shape[0]
  if n % BLOCK:
    raise ValueError(f"fp8_gemm (Triton): N = {n} (B {tuple(b_q.shape)}) must be a multiple of {BLOCK}")
  if m == 0:
    raise ValueError(f"fp8_gemm (Triton): M must be >= 1, got A {tuple(a_q.shape)}")
  cfg = config or choose_config(m, n)
  mp = -(-m // cfg.block_m) * cfg.block_m
  if mp != m:
    a_q = jnp.pad(a_q, ((0, mp - m), (0, 0)))
    a_s = jnp.pad(a_s, ((0, mp - m), (0, 0)))
  row_scales = b_s.shape[0] == n
  out = pl.pallas_call(
      functools.partial(_kernel, cfg=cfg, k_blocks=k // BLOCK, row_scales=row_scales),
      out_shape=jax.ShapeDtypeStruct((mp, n), jnp.dtype(out_dtype)),
      grid=(mp // cfg.block_m, n // cfg.block_n),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
  )(a_q, a_s.astype(jnp.float32), b_q, b_s.astype(jnp.float32))
  return out[:m] if mp != m else out
