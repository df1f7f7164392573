"""Block-scaled FP8 GEMM kernel (Mosaic GPU for sm_90) and its BF16 mode against their plain-jnp references; the
CPU tests' Triton stand-in for it (tests/triton_gemm_standin.py) against the same reference.

CPU (CI): the kernels in interpret mode on fresh random data (ragged M included), and lowering for the ``cuda``
platform (the whole Pallas -> Mosaic GPU lowering).
GPU (``-m gpu``, skipped without an sm_90 GPU): kernel vs reference on all Llama-3.1-8B shapes, bitwise batch
invariance, the wgrad (1x128 x 1x128) variant; BF16 mode on the lm_head and linear shapes (its bounds: BF16 section).

Error bounds (relative Frobenius norm ||out - ref|| / ||ref|| on the same quantized operands):
* interpret mode, FP32 output: <= 1e-6 (the same FP32 block math, only summation order inside a block differs);
* GPU, FP32 output: <= 1e-3 (FP8 wgmma accumulates a 128-wide block with reduced internal precision before the
  FP32 promotion; DeepSeek-V3 sec. 3.3.2 measures ~14 bits);
* BF16 output: <= 5e-3 (one BF16 rounding of each element, 2**-9 relative, plus the above).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import backends

from pallas_kernels import fp8_gemm_mgpu as mgpu
from pallas_kernels.fp8_gemm import bf16_gemm_reference, fp8_gemm_reference
from pallas_kernels.lowering import lower_for_h200

import triton_gemm_standin as tgemm  # tests/: the CPU tests' stand-in for the Hopper kernel

LLAMA_8B_SHAPES = {  # name: (K, N) of C = A . B^T with B stored (N, K)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}


def _operands(seed: int, m: int, n: int, k: int, row_scales: bool = False):
  """Fresh random E4M3 operands (normal values: all exponents used) and positive FP32 scales."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  a_q = (3 * jax.random.normal(k1, (m, k))).astype(jnp.float8_e4m3fn)
  b_q = (3 * jax.random.normal(k2, (n, k))).astype(jnp.float8_e4m3fn)
  a_s = jnp.exp2(jax.random.uniform(k3, (m, k // 128), minval=-8, maxval=-2))
  b_s = jnp.exp2(jax.random.uniform(k4, (n if row_scales else n // 128, k // 128), minval=-8, maxval=-2))
  return a_q, a_s, b_q, b_s


def _rel_err(out, ref) -> float:
  out = jnp.asarray(out, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


requires_hopper = pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 (Hopper) GPU")


# ------------------------------------------------------------------------------------------------------------------
# CPU: interpret mode
# ------------------------------------------------------------------------------------------------------------------

MGPU_CASES = [  # (m, n, k, row_scales, config or None, out_dtype)
    (1, 256, 256, False, None, jnp.float32),
    (7, 256, 384, True, None, jnp.float32),
    (130, 256, 256, False, mgpu.TuningConfig(split="m", wg_n=64, max_concurrent_steps=2), jnp.float32),
    (64, 512, 256, False, mgpu.TuningConfig(split="n", wg_n=128, max_concurrent_steps=3), jnp.bfloat16),
    (130, 256, 512, False, mgpu.TuningConfig(split="m", wg_n=64, max_concurrent_steps=2, k_blocks=2), jnp.float32),
    (70, 256, 512, True, mgpu.TuningConfig(split="n", wg_n=32, max_concurrent_steps=2, k_blocks=2), jnp.float32),
    # 2-CTA clusters sharing A by TMA multicast (the interpreter emulates the cluster and the multicast)
    (130, 512, 256, False, mgpu.TuningConfig(split="m", wg_n=64, max_concurrent_steps=2, cluster_n=True),
     jnp.float32),
    (70, 512, 512, True, mgpu.TuningConfig(split="n", wg_n=32, max_concurrent_steps=2, k_blocks=2, cluster_n=True),
     jnp.bfloat16),
]


@pytest.mark.parametrize("m,n,k,row_scales,cfg,out_dtype", MGPU_CASES)
def test_mgpu_interpret_matches_reference(m, n, k, row_scales, cfg, out_dtype):
  ops = _operands(m * 1000 + n + k, m, n, k, row_scales)
  out = mgpu.fp8_gemm(*ops, out_dtype=out_dtype, config=cfg, interpret=True)
  assert out.shape == (m, n) and out.dtype == out_dtype
  ref = fp8_gemm_reference(*ops, out_dtype=jnp.float32)
  assert _rel_err(out, ref) <= (1e-6 if out_dtype == jnp.float32 else 5e-3)


def test_mgpu_interpret_rows_do_not_depend_on_m():
  """Interpret-mode twin of the GPU batch-invariance test (ragged M, a different tile config per M).

  On CPU the emulated wgmma is an XLA dot whose summation order depends on its shape, so the operands here are
  small integers with power-of-two scales: every sum is exact, and equality checks row placement and padding.
  Bitwise invariance of the real hardware math is tested on the GPU.
  """
  k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
  a_q = jax.random.randint(k1, (130, 256), -8, 9).astype(jnp.float8_e4m3fn)
  b_q = jax.random.randint(k2, (256, 256), -8, 9).astype(jnp.float8_e4m3fn)
  a_s = jnp.exp2(jax.random.randint(k3, (130, 2), -4, 4).astype(jnp.float32))
  b_s = jnp.exp2(jax.random.randint(k4, (2, 2), -4, 4).astype(jnp.float32))
  full = mgpu.fp8_gemm(a_q, a_s, b_q, b_s, out_dtype=jnp.float32, interpret=True)
  np.testing.assert_array_equal(np.asarray(full), np.asarray(fp8_gemm_reference(a_q, a_s, b_q, b_s, jnp.float32)))
  part = mgpu.fp8_gemm(a_q[100:107], a_s[100:107], b_q, b_s, out_dtype=jnp.float32, interpret=True,
                       config=mgpu.TuningConfig(split="n", wg_n=32))
  np.testing.assert_array_equal(np.asarray(part), np.asarray(full[100:107]))


def test_mgpu_interpret_scales_in_kernel_layout_bitwise():
  """A's scales given transposed (``a_scales_t``, as the quantizer kernel writes them) and B's in the kernel's layout
  (``kernel_b_scales``, as ``ops.with_kernel_scales`` makes them): the same result bit for bit; a B layout that does
  not match the tile scales is refused."""
  a_q, a_s, b_q, b_s = _operands(5, 70, 256, 384)
  want = np.asarray(mgpu.fp8_gemm(a_q, a_s, b_q, b_s, out_dtype=jnp.float32, interpret=True))
  got = mgpu.fp8_gemm(a_q, a_s.T, b_q, b_s, out_dtype=jnp.float32, interpret=True, a_scales_t=True,
                      b_scales_kernel=mgpu.kernel_b_scales(b_s))
  np.testing.assert_array_equal(np.asarray(got), want)
  with pytest.raises(ValueError, match="b_scales_kernel"):
    mgpu.fp8_gemm(a_q, a_s, b_q, b_s, out_dtype=jnp.float32, interpret=True, b_scales_kernel=b_s)


@pytest.mark.parametrize("m,n,k,row_scales", [(7, 256, 384, False), (130, 256, 256, True)])
def test_triton_interpret_matches_reference(m, n, k, row_scales):
  ops = _operands(m + n + k, m, n, k, row_scales)
  out = tgemm.fp8_gemm(*ops, out_dtype=jnp.float32, interpret=True)
  assert out.shape == (m, n)
  assert _rel_err(out, fp8_gemm_reference(*ops, out_dtype=jnp.float32)) <= 1e-6


@pytest.mark.parametrize("fn", [mgpu.fp8_gemm, tgemm.fp8_gemm], ids=["mgpu", "triton"])
def test_bad_shapes_raise(fn):
  a_q, a_s, b_q, b_s = _operands(0, 8, 256, 256)
  with pytest.raises(ValueError, match="multiple of 128"):
    fn(a_q, a_s, b_q[:200], b_s, out_dtype=jnp.bfloat16)  # N = 200
  with pytest.raises(ValueError, match="multiple of 128"):
    fn(a_q[:, :200], a_s, b_q[:, :200], b_s, out_dtype=jnp.bfloat16)  # K = 200
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fn(a_q.astype(jnp.bfloat16), a_s, b_q, b_s, out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="scale"):
    fn(a_q, a_s[:, :1], b_q, b_s, out_dtype=jnp.bfloat16)


def test_tuning_config_validates():
  with pytest.raises(ValueError, match="wg_n"):
    mgpu.TuningConfig(wg_n=96)
  with pytest.raises(ValueError, match="split"):
    mgpu.TuningConfig(split="k")
  with pytest.raises(ValueError, match="k_blocks"):
    mgpu.TuningConfig(k_blocks=4)
  with pytest.raises(ValueError, match="num_wgs"):
    mgpu.TuningConfig(split="n", num_wgs=3)


@pytest.mark.parametrize("m", [1, 64, 256, 8192, 65536])
def test_config_per_shape_class(m):
  """Small M gets 64-row CTAs (no padding to 128); every config tiles N exactly."""
  for k, n in LLAMA_8B_SHAPES.values():
    cfg = mgpu.choose_config(m, n, k, num_sms=132)
    assert n % cfg.cta_n == 0
    if m <= 64:
      assert cfg.cta_m == 64


def test_clusters_only_where_measured_faster():
  """2-CTA clusters for large-M forward/dgrad GEMMs, not for wgrad (row scales) or decode; odd tile columns drop
  them."""
  for k, n in LLAMA_8B_SHAPES.values():
    assert mgpu.choose_config(8192, n, k, num_sms=132).cluster_n
    assert not mgpu.choose_config(8192, n, k, num_sms=132, row_scales=True).cluster_n
    assert not mgpu.choose_config(64, n, k, num_sms=132).cluster_n
  cfg = mgpu.TuningConfig("m", 128, 2, cluster_n=True)
  planned, _, grid = mgpu._plan(cfg, 1024, 384, 256, jnp.bfloat16, False, 132)  # 3 tile columns
  assert not planned.cluster_n and grid == 24
  planned, _, grid = mgpu._plan(cfg, 1024, 512, 256, jnp.bfloat16, False, 132)  # 4 columns: 16 clusters of 2 CTAs
  assert planned.cluster_n and grid == 16


# ------------------------------------------------------------------------------------------------------------------
# CPU: lowering for the cuda platform (catches layout / dtype / SMEM-transform errors without a GPU)
# ------------------------------------------------------------------------------------------------------------------


def _abstract_args(m, n, k, row_scales):
  return (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
          jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((n if row_scales else n // 128, k // 128), jnp.float32))


@pytest.mark.parametrize("m", [1, 64, 256, 8192, 65536])  # decode ... 64k-token batches
def test_mgpu_lowers_for_cuda_llama_shapes(m):
  for k, n in LLAMA_8B_SHAPES.values():
    f = functools.partial(mgpu.fp8_gemm, out_dtype=jnp.bfloat16, num_sms=132)
    assert "mosaic_gpu" in lower_for_h200(f, *_abstract_args(m, n, k, False))


@pytest.mark.parametrize("cfg", [
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=6),
    mgpu.TuningConfig(split="n", wg_n=16, max_concurrent_steps=8),
    mgpu.TuningConfig(split="n", wg_n=64, grid_minor_dim="m", grid_tile_width=4),
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=2, k_blocks=2, cross_tile=True),
    mgpu.TuningConfig(split="n", wg_n=32, max_concurrent_steps=4, k_blocks=2),
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=4, cross_tile=True, num_wgs=3),
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=2, k_blocks=2, cross_tile=True, cluster_n=True),
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=4, cross_tile=True, num_wgs=3, cluster_n=True),
], ids=str)
@pytest.mark.parametrize("row_scales,out_dtype", [(False, jnp.float32), (True, jnp.float32), (True, jnp.bfloat16)])
def test_mgpu_lowers_for_cuda_configs(cfg, row_scales, out_dtype):
  f = functools.partial(mgpu.fp8_gemm, out_dtype=out_dtype, config=cfg, num_sms=132)
  assert "mosaic_gpu" in lower_for_h200(f, *_abstract_args(200, 512, 1024, row_scales))


# ------------------------------------------------------------------------------------------------------------------
# GPU (H200): the real kernels
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("name", list(LLAMA_8B_SHAPES))
@pytest.mark.parametrize("m", [1, 130, 1024])
def test_gpu_mgpu_matches_reference_llama_shapes(name, m):
  k, n = LLAMA_8B_SHAPES[name]
  ops = _operands(zlib.crc32(f"{name}/{m}".encode()) % 1000, m, n, k)  # the same seed in every process
  ref = fp8_gemm_reference(*ops, out_dtype=jnp.float32)
  out32 = mgpu.fp8_gemm(*ops, out_dtype=jnp.float32)
  assert _rel_err(out32, ref) <= 1e-3
  out16 = mgpu.fp8_gemm(*ops, out_dtype=jnp.bfloat16)
  assert out16.dtype == jnp.bfloat16 and _rel_err(out16, ref) <= 5e-3
  assert bool(jnp.all(jnp.isfinite(out16)))


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("name", ["gate_up", "lm_head"])
def test_gpu_mgpu_three_consumer_warpgroups(name):
  """The large-M, large-N default (192-row CTAs, 3 consumer warpgroups): reference and bits of a 2-WG config."""
  k, n = LLAMA_8B_SHAPES[name]
  m = 2048
  assert mgpu.choose_config(m, n, k).num_wgs == 3
  ops = _operands(11, m, n, k)
  out = mgpu.fp8_gemm(*ops, out_dtype=jnp.float32)
  assert _rel_err(out, fp8_gemm_reference(*ops, out_dtype=jnp.float32)) <= 1e-3
  two = mgpu.fp8_gemm(*ops, out_dtype=jnp.float32, config=mgpu.TuningConfig("m", 128, 2, k_blocks=2))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(two))


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 8192), (4096, 14336, 8192)])
def test_gpu_mgpu_wgrad_row_scales(m, n, k):
  ops = _operands(m + n, m, n, k, row_scales=True)
  out = mgpu.fp8_gemm(*ops, out_dtype=jnp.float32)
  assert _rel_err(out, fp8_gemm_reference(*ops, out_dtype=jnp.float32)) <= 1e-3


def _invariance_configs():
  T = mgpu.TuningConfig
  return ([None] + [T(split=s, wg_n=w) for s in ("m", "n") for w in (16, 32, 64, 128)]
          + [T("m", 128, 2, k_blocks=2), T("n", 32, 4, k_blocks=2), T("m", 128, 4, cross_tile=True),
             T("m", 128, 2, k_blocks=2, cross_tile=True), T("m", 128, 4, cross_tile=True, num_wgs=3),
             T("m", 128, 2, k_blocks=2, cross_tile=True, cluster_n=True), T("n", 32, 4, cluster_n=True),
             T("m", 128, 4, cross_tile=True, num_wgs=3, cluster_n=True)])


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("row_scales,out_dtype", [(False, jnp.bfloat16), (True, jnp.float32)])
def test_gpu_mgpu_batch_invariance_bitwise(row_scales, out_dtype):
  """A row of C is bitwise the same for every M, every position in A, and every tile config."""
  k, n = LLAMA_8B_SHAPES["qkv"]
  big_m = 8192
  a_q, a_s, b_q, b_s = _operands(7, big_m, n, k, row_scales)
  full = np.asarray(mgpu.fp8_gemm(a_q, a_s, b_q, b_s, out_dtype=out_dtype))
  for m, start in ((1, 0), (1, 4097), (7, 123), (64, 64), (130, 1000), (256, 7936), (2000, 3)):
    part = mgpu.fp8_gemm(a_q[start:start + m], a_s[start:start + m], b_q, b_s, out_dtype=out_dtype)
    np.testing.assert_array_equal(np.asarray(part), full[start:start + m], err_msg=f"M={m} start={start}")
  perm = np.random.default_rng(0).permutation(big_m)[:300]
  moved = mgpu.fp8_gemm(a_q[perm], a_s[perm], b_q, b_s, out_dtype=out_dtype)
  np.testing.assert_array_equal(np.asarray(moved), full[perm], err_msg="rows moved within A")
  for cfg in _invariance_configs():  # 16 SMs: cross_tile configs get >= 2 tiles per CTA
    out = mgpu.fp8_gemm(a_q[:512], a_s[:512], b_q, b_s, out_dtype=out_dtype, config=cfg, num_sms=16)
    np.testing.assert_array_equal(np.asarray(out), full[:512], err_msg=f"config {cfg}")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("m", [1, 256])
def test_gpu_mgpu_scales_in_kernel_layout_bitwise(m):
  """The decode path's operands (A's scales transposed, B's laid out beforehand): bitwise the plain call."""
  k, n = LLAMA_8B_SHAPES["qkv"]
  a_q, a_s, b_q, b_s = _operands(m + 3, m, n, k)
  want = np.asarray(mgpu.fp8_gemm(a_q, a_s, b_q, b_s))
  got = mgpu.fp8_gemm(a_q, a_s.T, b_q, b_s, a_scales_t=True, b_scales_kernel=mgpu.kernel_b_scales(b_s))
  np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))


# ------------------------------------------------------------------------------------------------------------------
# BF16 mode of the Mosaic kernel (bf16_gemm): CPU twins, then the GPU
# ------------------------------------------------------------------------------------------------------------------
#
# Bounds (relative Frobenius norm against bf16_gemm_reference, an FP32 dot of the same BF16 values):
# * interpret mode, FP32 output: <= 1e-6 (FP32 sums of the same exact products, in another order);
# * GPU, FP32 output: <= (K / 16) * 2^-23. Each k16 wgmma adds into the FP32 accumulator; allowing each of the K/16
#   steps one FP32 ulp of error in the same direction (a tensor core that truncates) bounds the drift, and the
#   reference's own error is far below it. K = 4096: 3.1e-5; K = 14336: 1.1e-4;
# * BF16 output: <= 5e-3 (one BF16 rounding of each element, 2^-9 relative, plus the above).

BF16_SHAPES = {  # name: (K, N) of the lm_head-like and Llama-3.1-8B linear GEMMs the BF16 configs are chosen for
    "lm_head": (4096, 128256),
    "lm_head_32k": (4096, 32768),
    "lm_head_32k_k1024": (1024, 32768),
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
BF16_MS = [1, 7, 64, 256, 1024, 2048, 8192, 32768]


def _bf16_out(name: str):
  """The lm_head writes FP32 logits, the linears BF16 activations (as fp8jax.ops.linear calls them)."""
  return jnp.float32 if name.startswith("lm_head") else jnp.bfloat16


def _shipped_bf16_configs() -> dict:
  """Every config choose_bf16_config returns over the shape grid (both output dtypes) -> one (M, shape) using it."""
  out = {}
  for m in BF16_MS:
    for name, (k, n) in BF16_SHAPES.items():
      for od in (jnp.float32, jnp.bfloat16):
        out.setdefault(mgpu.choose_bf16_config(m, n, k, 132, od), (m, name, od))
  return out


def _bf16_operands(seed: int, m: int, n: int, k: int):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16),
          (0.05 * jax.random.normal(k2, (n, k), jnp.float32)).astype(jnp.bfloat16))


BF16_CASES = [  # (m, n, k, config or None, out_dtype); the interpreter runs 2 consumer warpgroups (see _resolve)
    (1, 256, 256, None, jnp.float32),
    (7, 256, 384, None, jnp.bfloat16),
    (130, 256, 256, mgpu.TuningConfig(split="m", wg_n=64, max_concurrent_steps=2), jnp.float32),
    (64, 512, 256, mgpu.TuningConfig(split="n", wg_n=128, max_concurrent_steps=3), jnp.bfloat16),
    (130, 256, 512, mgpu.TuningConfig(split="m", wg_n=64, max_concurrent_steps=2, k_blocks=2), jnp.float32),
    (70, 512, 256, mgpu.TuningConfig(split="n", wg_n=32, max_concurrent_steps=2, cluster_n=True), jnp.float32),
]


@pytest.mark.parametrize("m,n,k,cfg,out_dtype", BF16_CASES)
def test_bf16_interpret_matches_reference(m, n, k, cfg, out_dtype):
  a, b = _bf16_operands(m + n + k, m, n, k)
  out = mgpu.bf16_gemm(a, b, out_dtype=out_dtype, config=cfg, interpret=True)
  assert out.shape == (m, n) and out.dtype == out_dtype
  assert _rel_err(out, bf16_gemm_reference(a, b)) <= (1e-6 if out_dtype == jnp.float32 else 5e-3)


def test_bf16_interpret_rows_do_not_depend_on_m():
  """Interpret-mode twin of the GPU batch-invariance test: small integers, so every sum is exact on CPU too and
  equality checks row placement, M padding and another config's tiling (bits of the hardware math: GPU test)."""
  k1, k2 = jax.random.split(jax.random.key(12))
  a = jax.random.randint(k1, (130, 256), -8, 9).astype(jnp.bfloat16)
  b = jax.random.randint(k2, (256, 256), -8, 9).astype(jnp.bfloat16)
  full = mgpu.bf16_gemm(a, b, out_dtype=jnp.float32, interpret=True)
  np.testing.assert_array_equal(np.asarray(full), np.asarray(bf16_gemm_reference(a, b)))
  part = mgpu.bf16_gemm(a[100:107], b, out_dtype=jnp.float32, interpret=True,
                        config=mgpu.TuningConfig(split="n", wg_n=32, k_blocks=2))
  np.testing.assert_array_equal(np.asarray(part), np.asarray(full[100:107]))


def test_bf16_bad_shapes_raise():
  a, b = _bf16_operands(0, 8, 256, 256)
  with pytest.raises(ValueError, match=r"N = 200 and K = 256 .*multiples of 128"):
    mgpu.bf16_gemm(a, b[:200])
  with pytest.raises(ValueError, match=r"N = 256 and K = 200 .*multiples of 128"):
    mgpu.bf16_gemm(a[:, :200], b[:, :200])
  with pytest.raises(ValueError, match="contraction dims differ"):
    mgpu.bf16_gemm(a, b[:, :128])
  with pytest.raises(ValueError, match="A must be bfloat16, got float32"):
    mgpu.bf16_gemm(a.astype(jnp.float32), b)
  with pytest.raises(ValueError, match="out_dtype"):
    mgpu.bf16_gemm(a, b, out_dtype=jnp.float16)
  with pytest.raises(ValueError, match="bfloat16"):
    bf16_gemm_reference(a, b.astype(jnp.float32))


@pytest.mark.parametrize("m", BF16_MS)
def test_bf16_config_per_shape_class(m):
  """Every BF16 pick tiles N exactly, keeps decode CTAs 64 rows high, and (as planned for its shape and output
  dtype) keeps a ring of >= 4 stages, which is what its docstring's SMEM arithmetic promises."""
  for name, (k, n) in BF16_SHAPES.items():
    for od in (jnp.float32, jnp.bfloat16):
      cfg = mgpu.choose_bf16_config(m, n, k, 132, od)
      assert n % cfg.cta_n == 0
      assert cfg.cta_m == 64 or m > 64
      planned = mgpu._plan(cfg, m, n, k, od, False, 132, jnp.bfloat16)[0]
      assert planned.max_concurrent_steps >= 4, (m, name, od, planned)
      assert not (planned.num_wgs == 3 and od == jnp.float32)


@pytest.mark.parametrize("m", [1, 64, 256, 8192, 32768])
def test_bf16_lowers_for_cuda_shapes(m):
  """The whole Pallas -> Mosaic GPU lowering of the chosen config for every lm_head / linear shape."""
  for name, (k, n) in BF16_SHAPES.items():
    f = functools.partial(mgpu.bf16_gemm, out_dtype=_bf16_out(name), num_sms=132)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16))
    assert "mosaic_gpu" in lower_for_h200(f, *args)


@pytest.mark.parametrize("cfg", list(_shipped_bf16_configs()) + [
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=2, k_blocks=2, cross_tile=True),
    mgpu.TuningConfig(split="n", wg_n=128, max_concurrent_steps=4),
    mgpu.TuningConfig(split="m", wg_n=128, max_concurrent_steps=4, cross_tile=True, num_wgs=3, cluster_n=True),
], ids=str)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_lowers_for_cuda_configs(cfg, out_dtype):
  """Each shipped config (and the extra ones the GPU invariance test runs), both output dtypes."""
  f = functools.partial(mgpu.bf16_gemm, out_dtype=out_dtype, config=cfg, num_sms=132)
  args = (jax.ShapeDtypeStruct((200, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16))
  assert "mosaic_gpu" in lower_for_h200(f, *args)


def _bf16_bound(k: int) -> float:
  return k / 16 * 2.0**-23


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("name", list(BF16_SHAPES))
@pytest.mark.parametrize("m", [1, 130, 1024])
def test_gpu_bf16_matches_reference(name, m):
  k, n = BF16_SHAPES[name]
  a, b = _bf16_operands(m + list(BF16_SHAPES).index(name), m, n, k)
  ref = bf16_gemm_reference(a, b)
  out32 = mgpu.bf16_gemm(a, b, out_dtype=jnp.float32)
  assert _rel_err(out32, ref) <= _bf16_bound(k)
  out16 = mgpu.bf16_gemm(a, b, out_dtype=jnp.bfloat16)
  assert out16.dtype == jnp.bfloat16 and _rel_err(out16, ref) <= 5e-3
  np.testing.assert_array_equal(np.asarray(out16), np.asarray(out32.astype(jnp.bfloat16)))  # one rounding, RNE


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("name", ["lm_head", "qkv", "gate_up"])
def test_gpu_bf16_batch_invariance_bitwise(name):
  """Rows of C at M = 1, 7, 64, 256 (each with its own chosen config) are bitwise the same rows inside M = 8192."""
  k, n = BF16_SHAPES[name]
  od = _bf16_out(name)
  a, b = _bf16_operands(7, 8192, n, k)
  full = np.asarray(mgpu.bf16_gemm(a, b, out_dtype=od))
  for m, start in ((1, 0), (1, 4097), (7, 123), (64, 64), (256, 7936), (256, 1001)):
    part = mgpu.bf16_gemm(a[start:start + m], b, out_dtype=od)
    np.testing.assert_array_equal(np.asarray(part), full[start:start + m], err_msg=f"M={m} start={start}")
  perm = np.random.default_rng(0).permutation(8192)[:300]
  np.testing.assert_array_equal(np.asarray(mgpu.bf16_gemm(a[perm], b, out_dtype=od)), full[perm],
                                err_msg="rows moved within A")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_bf16_configs_bitwise(out_dtype):
  """Every shipped config, and the other schedules, gives the same bits (16 SMs: cross_tile CTAs get >= 2 tiles)."""
  k, n = BF16_SHAPES["qkv"]
  a, b = _bf16_operands(8, 512, n, k)
  first = np.asarray(mgpu.bf16_gemm(a, b, out_dtype=out_dtype))
  T = mgpu.TuningConfig
  others = [T(split=s, wg_n=w) for s in ("m", "n") for w in (16, 32, 64, 128)] + [
      T("m", 128, 2, k_blocks=2, cross_tile=True), T("n", 32, 4, k_blocks=2, cluster_n=True),
      T("m", 128, 4, cross_tile=True, num_wgs=3), T("m", 128, 4, cross_tile=True, num_wgs=3, cluster_n=True)]
  for cfg in list(_shipped_bf16_configs()) + others:
    out = mgpu.bf16_gemm(a, b, out_dtype=out_dtype, config=cfg, num_sms=16)
    np.testing.assert_array_equal(np.asarray(out), first, err_msg=f"config {cfg}")
