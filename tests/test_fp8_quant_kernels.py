"""Activation-quantization kernels (``pallas_kernels.fp8_quant``) against the quantizer (``fp8jax.quant``): bitwise.

The kernels call the quantizer's own functions, so any difference is a kernel bug (tiling, masking, padding,
transposition, dtype). CPU (CI): interpret mode on fresh random data with every kind of special value (zeros, FP32
denormals, NaN, +-inf, huge and tiny groups), ragged M and K, BF16 and FP32 inputs, both scale modes; lowering for
the ``cuda`` platform (Pallas -> Triton IR for an abstract H200). GPU (``-m gpu``, sm_90): the compiled kernels on
the Llama-3.1-8B activation shapes, bit for bit, and ``fp8jax.ops.linear`` through them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops, quant

from fp8jax import backends
from pallas_kernels import fp8_quant
from pallas_kernels.lowering import lower_for_h200

requires_hopper = pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 (Hopper) GPU")


def _activations(seed: int, m: int, k: int, dtype) -> jax.Array:
  """Fresh random rows with magnitudes from 1e-30 to 1e30 per 1x128 group and planted special values."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-70, 70, (m, -(-k // 128)))).repeat(128, axis=1)[:, :k]
  flat = x.reshape(-1)
  idx = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
  flat[idx[:3]] = np.nan
  flat[idx[3:5]] = np.inf
  flat[idx[5:7]] = -np.inf
  flat[idx[7:9]] = 0.0
  flat[idx[9:]] = 1e-40  # an FP32 denormal
  x = flat.reshape(m, k)
  x[0, :min(k, 128)] = 0.0  # an all-zero group
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _assert_bitwise(got, want):
  (q, s), (rq, rs) = got, want
  assert q.shape == rq.shape and q.dtype == rq.dtype, (q.shape, q.dtype, rq.shape, rq.dtype)
  assert s.shape == rs.shape and s.dtype == rs.dtype, (s.shape, s.dtype, rs.shape, rs.dtype)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(rq).view(np.uint8))


# ------------------------------------------------------------------------------------------------------------------
# CPU: interpret mode
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k", [(1, 128), (37, 256), (130, 384)])
def test_interpret_quantize_act_scales_t_bitwise(m, k):
  """``scales_t``: the same codes, the scales written transposed (K/128, M) for the GEMM kernel."""
  x = _activations(m * 7 + k, m, k, jnp.bfloat16)
  q, s_t = fp8_quant.quantize_act(x, interpret=True, scales_t=True)
  rq, rs = quant.quantize_act(x)
  _assert_bitwise((q, s_t.T), (rq, rs))
  with pytest.raises(ValueError, match="2-D"):
    fp8_quant.quantize_act(x.reshape(1, m, k), interpret=True, scales_t=True)


@pytest.mark.parametrize("m,k", [(1, 128), (37, 256), (64, 384), (130, 128)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32scale", "pow2scale"])
def test_interpret_quantize_act_bitwise(m, k, dtype, pow2):
  x = _activations(m * 1000 + k, m, k, dtype)
  _assert_bitwise(fp8_quant.quantize_act(x, pow2, interpret=True), quant.quantize_act(x, pow2))


@pytest.mark.parametrize("m,k", [(1, 128), (37, 96), (130, 256), (256, 48)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32scale", "pow2scale"])
def test_interpret_quantize_act_t_bitwise(m, k, dtype, pow2):
  x = _activations(m * 1000 + k + 1, m, k, dtype)
  _assert_bitwise(fp8_quant.quantize_act_t(x, pow2, interpret=True), quant.quantize_act_t(x, pow2))


def test_interpret_leading_dims_and_block_options():
  x = _activations(7, 3 * 20, 256, jnp.bfloat16).reshape(3, 20, 256)
  want = quant.quantize_act(x)
  for bm, nw in ((8, 4), (64, 8)):
    _assert_bitwise(fp8_quant.quantize_act(x, block_m=bm, num_warps=nw, interpret=True), want)
  x2 = x.reshape(60, 256)
  _assert_bitwise(fp8_quant.quantize_act_t(x2, block_k=64, interpret=True), quant.quantize_act_t(x2))


def test_bad_shapes_say_what_is_wrong():
  with pytest.raises(ValueError, match=r"multiple of 128"):
    fp8_quant.quantize_act(jnp.ones((4, 200), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match=r"2-D"):
    fp8_quant.quantize_act_t(jnp.ones((2, 4, 128), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match=r"M must be >= 1"):
    fp8_quant.quantize_act_t(jnp.ones((0, 128), jnp.bfloat16), interpret=True)


# ------------------------------------------------------------------------------------------------------------------
# CPU: lowering for cuda
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [fp8_quant.quantize_act, fp8_quant.quantize_act_t], ids=lambda f: f.__name__)
@pytest.mark.parametrize("m,k", [(1, 4096), (8192, 14336), (200, 4096), (65536, 14336)])
def test_lowers_for_cuda(fn, m, k):
  txt = lower_for_h200(functools.partial(fn, pow2=False), jax.ShapeDtypeStruct((m, k), jnp.bfloat16))
  assert "triton" in txt


# ------------------------------------------------------------------------------------------------------------------
# GPU (H200)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("m", [1, 130, 8192])
@pytest.mark.parametrize("k", [4096, 14336])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32scale", "pow2scale"])
def test_gpu_kernels_bitwise_llama_shapes(m, k, pow2):
  x = _activations(m + k, m, k, jnp.bfloat16)
  _assert_bitwise(fp8_quant.quantize_act(x, pow2), jax.jit(quant.quantize_act, static_argnums=1)(x, pow2))
  _assert_bitwise(fp8_quant.quantize_act_t(x, pow2), jax.jit(quant.quantize_act_t, static_argnums=1)(x, pow2))
  q, s_t = fp8_quant.quantize_act(x, pow2, scales_t=True)
  _assert_bitwise((q, s_t.T), jax.jit(quant.quantize_act, static_argnums=1)(x, pow2))


@pytest.mark.gpu
@requires_hopper
def test_gpu_linear_pallas_equals_xla_quantization():
  """linear's forward and backward on the pallas backend use the kernels; the quantized operands are the same
  bits as the XLA quantizer's, so the forward matches a pallas-GEMM forward fed by the XLA quantizer exactly."""
  x = jax.random.normal(jax.random.key(1), (256, 512), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (384, 512), jnp.float32) * 0.05
  qw = quant.quantize_weight(w)
  cfg = ops.LinearConfig(backend="pallas")
  got = jax.jit(lambda x: ops.linear(x, qw, cfg))(x)
  xq, xs = quant.quantize_act(x)
  want = jax.jit(lambda: ops.fp8_gemm(xq, xs, qw.q, qw.scale, jnp.bfloat16, "pallas"))()
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # the sampler's decode form: the weight's scales laid out for the kernel once (ops.with_kernel_scales)
  laid = ops.with_kernel_scales({"w": qw}, cfg)["w"]
  assert laid.kernel_scale is not None
  got = jax.jit(lambda x, w: ops.linear(x, w, cfg))(x, laid)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
