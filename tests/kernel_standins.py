"""Interpret-mode stand-ins for the Hopper kernels, for the fake-CPU-device subprocess scripts of the tests.

The "pallas" path on CPU: the Triton FP8 GEMM (``triton_gemm_standin``) and the quantization kernels in interpret
mode stand in for the Mosaic GPU ones (the per-device / tensor-parallel logic under test does not depend on which
kernel runs). BF16 mode: the kernel's reference stands in (jax 0.11.2's Mosaic GPU interpreter fails under shard_map
on fake devices: "Barrier remains allocated"); tests/test_fp8_gemm_kernels.py checks the kernel against it.
"""

import functools

import triton_gemm_standin

from fp8jax import ops
from pallas_kernels import fp8_gemm, fp8_quant


class _Quant:
  quantize_act = functools.partial(fp8_quant.quantize_act, interpret=True)
  quantize_act_t = functools.partial(fp8_quant.quantize_act_t, interpret=True)


def _gemm(a_q, a_s, b_q, b_s, *, out_dtype, a_scales_t: bool = False, b_scales_kernel=None):
  """The Mosaic kernel's call (``a_scales_t``: A's scales come (K/128, M), as the quantizer kernel writes them for
  it; ``b_scales_kernel``: B's scales laid out for it) on the Triton kernel, which takes the plain layouts."""
  del b_scales_kernel  # the same values as b_s, laid out for the Mosaic kernel
  return triton_gemm_standin.fp8_gemm(a_q, a_s.T if a_scales_t else a_s, b_q, b_s, out_dtype=out_dtype, interpret=True)


def install(bf16: bool = True) -> None:
  ops.resolve_backend = lambda requested: "pallas"
  ops._pallas_gemm = lambda: _gemm
  ops._pallas_quant = lambda: _Quant
  if bf16:
    ops.resolve_bf16_backend = lambda requested: "pallas"
    ops._pallas_bf16_gemm = lambda: fp8_gemm.bf16_gemm_reference
