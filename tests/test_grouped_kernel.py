"""The grouped (MoE) mode of the Mosaic GPU FP8 kernel (``fp8_gemm_mgpu.grouped_fp8_gemm``) against
``grouped_gemm.grouped_gemm_reference`` and against the dense kernel, group by group.

CPU (CI): interpret mode (2 consumer warpgroups; the interpreter deadlocked with 3) on small shapes with ragged,
empty and single groups and rows past the groups, and lowering for the ``cuda`` platform at the Qwen3-30B-A3B
expert shapes. GPU (``-m gpu``, sm_90 only): the real kernel vs the reference, and each group's rows bitwise the dense
kernel's rows for that expert alone, for several configs (the invariance contract in ``grouped_fp8_gemm_tiles``).

Bounds are those of tests/test_fp8_gemm_kernels.py (same quantized operands): interpret FP32 <= 1e-6, GPU FP32
<= 1e-3, BF16 out <= 5e-3. Bitwise checks on CPU use small integers with power-of-two scales (every sum exact: the
emulated wgmma is an XLA dot whose summation order depends on its shape); on the GPU any operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops
from pallas_kernels import fp8_gemm_mgpu as mgpu
from pallas_kernels import grouped_gemm
from pallas_kernels.fp8_gemm import fp8_gemm_reference

T = mgpu.TuningConfig
requires_hopper = pytest.mark.skipif(not ops.hopper_available(), reason="needs an sm_90 (Hopper) GPU")

# Qwen3-30B-A3B experts (configs/qwen3_30b_a3b_fp8.py): dim 2048, moe_ffn_dim 768, 128 experts, top-8.
QWEN3_MOE = {"gate_up": (768, 2048), "down": (2048, 768)}  # name: (N, K) of C = A . W_e^T; dgrad swaps them
QWEN3_E = 128


def _operands(seed, m, e, n, k, exact=False):
  """E4M3 A (m, k) + 1x128 scales, stacked B (e, n, k) + 128x128 tile scales; ``exact``: small integers and
  power-of-two scales, so that every FP32 sum is exact."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  if exact:
    a_q = jax.random.randint(k1, (m, k), -8, 9).astype(jnp.float8_e4m3fn)
    b_q = jax.random.randint(k2, (e, n, k), -8, 9).astype(jnp.float8_e4m3fn)
    a_s = jnp.exp2(jax.random.randint(k3, (m, k // 128), -4, 4).astype(jnp.float32))
    b_s = jnp.exp2(jax.random.randint(k4, (e, n // 128, k // 128), -4, 4).astype(jnp.float32))
  else:
    a_q = (3 * jax.random.normal(k1, (m, k))).astype(jnp.float8_e4m3fn)
    b_q = (3 * jax.random.normal(k2, (e, n, k))).astype(jnp.float8_e4m3fn)
    a_s = jnp.exp2(jax.random.uniform(k3, (m, k // 128), minval=-8, maxval=-2))
    b_s = jnp.exp2(jax.random.uniform(k4, (e, n // 128, k // 128), minval=-8, maxval=-2))
  return a_q, a_s, b_q, b_s


def _rel_err(out, ref) -> float:
  out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def _groups(sizes):
  off = np.concatenate([[0], np.cumsum(sizes)])
  return [(e, slice(off[e], off[e + 1])) for e in range(len(sizes)) if sizes[e]]


# ------------------------------------------------------------------------------------------------------------------
# CPU: interpret mode
# ------------------------------------------------------------------------------------------------------------------

# (M, sizes): ragged groups over and under 128 rows, an empty group in the middle and at the ends, one group
# holding every row, and rows past sum(sizes) (zeros).
INTERPRET_CASES = [
    (300, (130, 0, 1, 140)),
    (256, (0, 256, 0)),
    (200, (0, 0, 70)),
    (1, (1, 0)),
]
INTERPRET_CONFIGS = [None, T("m", 64, 2), T("n", 32, 2, k_blocks=2), T("m", 128, 2, cluster_n=True)]


@pytest.mark.parametrize("m,sizes", INTERPRET_CASES)
def test_interpret_bitwise_reference_and_dense_per_group(m, sizes):
  """Exact operands: the kernel's rows are bitwise the grouped reference, and each group's rows bitwise the dense
  kernel (interpret) on those rows with that expert's weight."""
  e, n, k = len(sizes), 256, 256
  a_q, a_s, b_q, b_s = _operands(m + 7 * e, m, e, n, k, exact=True)
  sizes_E = jnp.asarray(sizes, jnp.int32)
  out = mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=jnp.float32, interpret=True)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  ref = grouped_gemm.grouped_gemm_reference(a_q, a_s, b_q, b_s, sizes_E, jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  for g, rows in _groups(sizes):
    dense = mgpu.fp8_gemm(a_q[rows], a_s[rows], b_q[g], b_s[g], out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[rows]), np.asarray(dense), err_msg=f"group {g}")
  tail = np.asarray(out[sum(sizes):])
  assert not tail.any()  # rows past the groups
  assert np.asarray(out[:1]).any() or sizes[0] == 0


@pytest.mark.parametrize("cfg", INTERPRET_CONFIGS, ids=str)
def test_interpret_configs_bitwise(cfg):
  m, sizes, n, k = 300, (130, 0, 1, 140), 256, 512
  a_q, a_s, b_q, b_s = _operands(5, m, len(sizes), n, k, exact=True)
  sizes_E = jnp.asarray(sizes, jnp.int32)
  out = mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=jnp.float32, config=cfg, interpret=True)
  ref = grouped_gemm.grouped_gemm_reference(a_q, a_s, b_q, b_s, sizes_E, jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_interpret_random_operands_within_bound(out_dtype):
  m, sizes, n, k = 260, (3, 129, 0, 100), 384, 256
  a_q, a_s, b_q, b_s = _operands(9, m, len(sizes), n, k)
  sizes_E = jnp.asarray(sizes, jnp.int32)
  out = mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=out_dtype, interpret=True)
  assert out.dtype == out_dtype
  ref = grouped_gemm.grouped_gemm_reference(a_q, a_s, b_q, b_s, sizes_E, jnp.float32)
  assert _rel_err(out, ref) <= (1e-6 if out_dtype == jnp.float32 else 5e-3)
  assert not np.asarray(out[sum(sizes):], np.float32).any()


def test_interpret_tiles_and_traced_sizes():
  """One compilation serves any group sizes (a jit over traced sizes); the tile-level op skips unused tiles."""
  m, e, n, k = 200, 3, 256, 256
  a_q, a_s, b_q, b_s = _operands(3, m, e, n, k, exact=True)
  f = jax.jit(functools.partial(mgpu.grouped_fp8_gemm, out_dtype=jnp.float32, interpret=True))
  for sizes in ((200, 0, 0), (64, 64, 72), (10, 0, 20)):
    sizes_E = jnp.asarray(sizes, jnp.int32)
    ref = grouped_gemm.grouped_gemm_reference(a_q, a_s, b_q, b_s, sizes_E, jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(a_q, a_s, b_q, b_s, sizes_E)), np.asarray(ref), err_msg=str(sizes))
  assert f._cache_size() == 1
  aq_t, as_t, _, tile_expert = grouped_gemm.tile_operands(a_q, a_s, jnp.asarray((10, 0, 20), jnp.int32), e)
  out_t = mgpu.grouped_fp8_gemm_tiles(aq_t, as_t, b_q, b_s, tile_expert, out_dtype=jnp.float32, interpret=True)
  assert out_t.shape == (aq_t.shape[0], n)
  np.testing.assert_array_equal(np.asarray(out_t[:10]), np.asarray(fp8_gemm_reference(
      a_q[:10], a_s[:10], b_q[0], b_s[0], jnp.float32)))
  np.testing.assert_array_equal(np.asarray(out_t[128:148]), np.asarray(fp8_gemm_reference(
      a_q[10:30], a_s[10:30], b_q[2], b_s[2], jnp.float32)))


def test_errors_name_shapes():
  a_q, a_s, b_q, b_s = _operands(0, 8, 2, 256, 256)
  sizes = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="no row-scale"):  # 1x128 (wgrad) scales are not a grouped mode
    mgpu.grouped_fp8_gemm(a_q, a_s, b_q, jnp.ones((2, 256, 2)), sizes)
  with pytest.raises(ValueError, match=r"stacked \(E, N, K\)"):
    mgpu.grouped_fp8_gemm(a_q, a_s, b_q[0], b_s[0], sizes)
  with pytest.raises(ValueError, match="must divide 128"):
    mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes, config=T("m", 128, 4, num_wgs=3))
  with pytest.raises(ValueError, match="one integer expert id per 128-row tile"):
    mgpu.grouped_fp8_gemm_tiles(jnp.zeros((256, 256), jnp.float8_e4m3fn), jnp.ones((256, 2)), b_q, b_s,
                                jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="multiple of 128"):
    mgpu.grouped_fp8_gemm(a_q, a_s, b_q[:, :200], b_s, sizes)


def test_tile_buffer_size_and_no_rows():
  """Decode-sized M pays for min(E, M) padding tiles, not E; no rows launch nothing."""
  assert grouped_gemm.padded_rows(1, QWEN3_E) == 256 and grouped_gemm.padded_rows(64, QWEN3_E) == 128 + 64 * 128
  assert grouped_gemm.padded_rows(65536, QWEN3_E) == 65536 + 128 * 128
  a_q, a_s, b_q, b_s = _operands(0, 0, 2, 256, 256)
  out = mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, jnp.zeros((2,), jnp.int32))
  assert out.shape == (0, 256) and out.dtype == jnp.bfloat16


def test_default_config_skips_unused_tiles_and_fits_tiles():
  for m in (256, 8192, 65536):
    for n, k in QWEN3_MOE.values():
      cfg = mgpu._grouped_config(None, grouped_gemm.padded_rows(m, QWEN3_E), n, k, 132)
      assert 128 % cfg.cta_m == 0 and n % cfg.cta_n == 0 and not cfg.cross_tile


# ------------------------------------------------------------------------------------------------------------------
# CPU: lowering for the cuda platform at the Qwen3-30B-A3B expert shapes
# ------------------------------------------------------------------------------------------------------------------


def _abstract(m, e, n, k):
  S = jax.ShapeDtypeStruct
  return (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), jnp.float32), S((e, n, k), jnp.float8_e4m3fn),
          S((e, n // 128, k // 128), jnp.float32), S((e,), jnp.int32))


def _lower_cuda(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m", [1, 256, 8192, 32768])  # decode ... 4096 tokens x top-8 routed rows
@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_lowers_for_cuda_qwen3_moe_shapes(m, name):
  n, k = QWEN3_MOE[name]
  f = functools.partial(mgpu.grouped_fp8_gemm, out_dtype=jnp.bfloat16, num_sms=132)
  assert "mosaic_gpu" in _lower_cuda(f, *_abstract(m, QWEN3_E, n, k))


GPU_CONFIGS = [T("m", 128, 2, k_blocks=2), T("m", 128, 4), T("n", 64, 4), T("n", 32, 4, k_blocks=2),
               T("m", 64, 4), T("m", 128, 2, k_blocks=2, cluster_n=True),
               T("m", 128, 2, k_blocks=2, cross_tile=True), T("m", 128, 2, k_blocks=2, cross_tile=True, cluster_n=True)]


@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda_configs(cfg, out_dtype):
  f = functools.partial(mgpu.grouped_fp8_gemm, out_dtype=out_dtype, config=cfg, num_sms=16)
  assert "mosaic_gpu" in _lower_cuda(f, *_abstract(2048, 16, 768, 2048))


# ------------------------------------------------------------------------------------------------------------------
# GPU (H200): the real kernel
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("name", list(QWEN3_MOE))
@pytest.mark.parametrize("tokens,skew", [(64, 1.2), (1024, 0.0), (1024, 1.2)])
def test_gpu_matches_reference_and_dense_per_group(name, tokens, skew):
  n, k = QWEN3_MOE[name]
  sizes = grouped_gemm.routing_sizes(tokens, 8, QWEN3_E, skew)
  m = int(sizes.sum())
  a_q, a_s, b_q, b_s = _operands(tokens + n, m, QWEN3_E, n, k)
  sizes_E = jnp.asarray(sizes)
  ref = grouped_gemm.grouped_gemm_reference(a_q, a_s, b_q, b_s, sizes_E, jnp.float32)
  out32 = mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=jnp.float32)
  assert _rel_err(out32, ref) <= 1e-3
  out16 = np.asarray(mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=jnp.bfloat16))
  assert _rel_err(out16, ref) <= 5e-3 and np.isfinite(out16.astype(np.float32)).all()
  groups = _groups(sizes)
  picked = {0, len(groups) // 2, len(groups) - 1, int(np.argmax([r.stop - r.start for _, r in groups])),
            int(np.argmin([r.stop - r.start for _, r in groups]))}  # (each distinct M compiles the dense kernel)
  for g, rows in (groups[i] for i in sorted(picked)):  # the invariance contract: bitwise the dense kernel's rows
    dense = mgpu.fp8_gemm(a_q[rows], a_s[rows], b_q[g], b_s[g], out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(out16[rows], np.asarray(dense), err_msg=f"group {g} ({sizes[g]} rows)")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_configs_bitwise(out_dtype):
  """Every config (skipping or computing unused tiles, clusters, cross-tile pipelines) gives the same bits, and the
  rows do not depend on the other groups: group 3 alone (others empty) is bitwise group 3 in the full routing."""
  n, k = QWEN3_MOE["gate_up"]
  e = 16
  sizes = grouped_gemm.routing_sizes(256, 8, e, 1.2, seed=1)
  m = int(sizes.sum())
  a_q, a_s, b_q, b_s = _operands(17, m, e, n, k)
  sizes_E = jnp.asarray(sizes)
  first = np.asarray(mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=out_dtype))
  for cfg in GPU_CONFIGS:  # 16 SMs: cross-tile CTAs get >= 2 tiles
    out = mgpu.grouped_fp8_gemm(a_q, a_s, b_q, b_s, sizes_E, out_dtype=out_dtype, config=cfg, num_sms=16)
    np.testing.assert_array_equal(np.asarray(out), first, err_msg=f"config {cfg}")
  g, rows = _groups(sizes)[3]
  alone = np.zeros(e, np.int32)
  alone[g] = sizes[g]
  out = mgpu.grouped_fp8_gemm(a_q[rows], a_s[rows], b_q, b_s, jnp.asarray(alone), out_dtype=out_dtype)
  np.testing.assert_array_equal(np.asarray(out), first[rows])


# ------------------------------------------------------------------------------------------------------------------
# BF16 mode (the BF16 recipe's experts): grouped_bf16_gemm_tiles
# ------------------------------------------------------------------------------------------------------------------


def _bf16_tiles(seed, sizes, n, k, exact=False):
  """BF16 rows moved to the tile layout, stacked BF16 experts, the tile map and each group's source rows."""
  m = int(sum(sizes)) + 5  # rows past the groups
  k1, k2 = jax.random.split(jax.random.key(seed))
  if exact:  # small integers: every FP32 sum exact, whatever order the interpreter's dot picks
    a = jax.random.randint(k1, (m, k), -8, 9).astype(jnp.bfloat16)
    b = jax.random.randint(k2, (len(sizes), n, k), -8, 9).astype(jnp.bfloat16)
  else:
    a = jax.random.normal(k1, (m, k), jnp.bfloat16)
    b = (0.05 * jax.random.normal(k2, (len(sizes), n, k))).astype(jnp.bfloat16)
  sizes_E = jnp.asarray(sizes, jnp.int32)
  dest, tile_expert = grouped_gemm.layout(sizes_E, m)
  a_t = grouped_gemm.to_tiles(a, dest, grouped_gemm.padded_rows(m, len(sizes)))
  return a, b, a_t, dest, tile_expert


@pytest.mark.parametrize("sizes", [(130, 0, 1, 140), (0, 0, 70)])
def test_interpret_bf16_bitwise_reference_and_dense_per_group(sizes):
  n, k = 256, 256
  a, b, a_t, dest, tile_expert = _bf16_tiles(len(sizes), sizes, n, k, exact=True)
  out = grouped_gemm.from_tiles(mgpu.grouped_bf16_gemm_tiles(a_t, b, tile_expert, interpret=True), dest)
  ref = grouped_gemm.from_tiles(grouped_gemm.dot_tiles_reference(a_t, b, tile_expert), dest)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  for g, rows in _groups(sizes):
    dense = mgpu.bf16_gemm(a[rows], b[g], out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[rows]), np.asarray(dense), err_msg=f"group {g}")


def test_bf16_grouped_errors_name_shapes():
  a, b, a_t, _, tile_expert = _bf16_tiles(0, (10, 20), 256, 256)
  with pytest.raises(ValueError, match=r"B must be stacked \(E, N, K\)"):
    mgpu.grouped_bf16_gemm_tiles(a_t, b[0], tile_expert, interpret=True)
  with pytest.raises(ValueError, match="multiple of 128 rows"):
    mgpu.grouped_bf16_gemm_tiles(a_t[:100], b, tile_expert, interpret=True)
  with pytest.raises(ValueError, match="must be bfloat16"):
    mgpu.grouped_bf16_gemm_tiles(a_t.astype(jnp.float32), b, tile_expert, interpret=True)


@pytest.mark.parametrize("m", [256, 32768])
@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_bf16_lowers_for_cuda_qwen3_moe_shapes(m, name):
  n, k = QWEN3_MOE[name]
  p = grouped_gemm.padded_rows(m, QWEN3_E)
  args = (jax.ShapeDtypeStruct((p, k), jnp.bfloat16), jax.ShapeDtypeStruct((QWEN3_E, n, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((p // 128,), jnp.int32))
  f = functools.partial(mgpu.grouped_bf16_gemm_tiles, out_dtype=jnp.float32, num_sms=132)
  assert "mosaic_gpu" in _lower_cuda(f, *args)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_gpu_bf16_matches_reference_and_dense_per_group(name):
  """The real kernel in BF16 mode: near the XLA reference, and each group's rows bitwise the dense BF16 kernel's."""
  n, k = QWEN3_MOE[name]
  sizes = tuple(int(s) for s in grouped_gemm.routing_sizes(512, 8, 32, 1.2, seed=2))
  a, b, a_t, dest, tile_expert = _bf16_tiles(3, sizes, n, k)
  out = np.asarray(grouped_gemm.from_tiles(mgpu.grouped_bf16_gemm_tiles(a_t, b, tile_expert), dest))
  ref = grouped_gemm.from_tiles(grouped_gemm.dot_tiles_reference(a_t, b, tile_expert), dest)
  assert _rel_err(out, ref) <= 1e-5
  groups = _groups(sizes)
  for g, rows in (groups[i] for i in sorted({0, len(groups) // 2, len(groups) - 1})):
    dense = mgpu.bf16_gemm(a[rows], b[g], out_dtype=jnp.float32)
    np.testing.assert_array_equal(out[rows], np.asarray(dense), err_msg=f"group {g} ({sizes[g]} rows)")
