"""fp8 linear: forward and gradients against the dequantize-then-FP32 reference, and FP8 vs BF16 bounds."""

import fp8jax

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops, quant
from pallas_kernels import fp8_gemm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# These check the XLA path's own math (bitwise/1e-6 against the FP32 reference, its batch invariance) or need fake
# CPU devices. On a GPU, linear takes the Pallas path, which the GPU tests of test_fp8_gemm_kernels.py and
# test_fp8_quant_kernels.py check against the same references with the FP8-wgmma bound; and XLA:GPU's own dot is
# not batch invariant (cuBLAS picks algorithms per shape), which is why the GPU default is the Pallas kernel.
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU/XLA path (see comment)")


def rand(key, shape, scale=1.0, dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def dequant_reference(x_MxK, w_NxK):
  """Independent path: dequantize both operands to FP32 and matmul (same quantized values, other summation)."""
  xq, xs = quant.quantize_act(x_MxK)
  xd = quant.dequantize_act(xq, xs)
  wd = quant.quantize_weight(w_NxK).dequantize()
  return jnp.dot(xd, wd.T, precision=jax.lax.Precision.HIGHEST)


def assert_close_fp32(actual, ref, a, b):
  """|actual - ref| <= 2 * k * 2^-24 * (|a| @ |b|^T): two FP32 summations of the same k products (+ scale rounding)."""
  k = a.shape[-1]
  bound = 2 * (k + 2) * 2.0**-24 * jnp.dot(jnp.abs(a), jnp.abs(b).T, precision=jax.lax.Precision.HIGHEST)
  assert np.all(np.abs(np.asarray(actual, np.float64) - np.asarray(ref, np.float64)) <= np.asarray(bound) + 1e-30)


def dq_act(a):
  return quant.dequantize_act(*quant.quantize_act(a))


def test_block_gemm_reference_equals_dequantized_matmul():
  x, w = rand(0, (33, 384), 2.0), rand(1, (256, 384), 0.1)
  xq, xs = quant.quantize_act(x)
  qw = quant.quantize_weight(w)
  y = fp8_gemm.fp8_gemm_reference(xq, xs, qw.q, qw.scale, jnp.float32)
  assert_close_fp32(y, dequant_reference(x, w), dq_act(x), qw.dequantize())


@cpu_only
def test_block_gemm_reference_is_batch_invariant():
  x, w = rand(2, (64, 256)), rand(3, (384, 256), 0.05)
  xq, xs = quant.quantize_act(x)
  qw = quant.quantize_weight(w)
  f = fp8jax.jit(fp8_gemm.fp8_gemm_reference, static_argnums=4)
  full = f(xq, xs, qw.q, qw.scale, jnp.float32)
  for lo, hi in [(0, 1), (5, 8), (17, 64)]:
    np.testing.assert_array_equal(f(xq[lo:hi], xs[lo:hi], qw.q, qw.scale, jnp.float32), full[lo:hi])


@cpu_only
def test_forward_matches_reference_and_qweight_path_bitwise():
  x, w = rand(4, (2, 9, 256), 1.0, jnp.bfloat16), rand(5, (384, 256), 0.05)
  cfg = ops.LinearConfig(out_dtype="float32")
  y = ops.linear(x, quant.FP8Weight(w), cfg)
  x2 = x.reshape(18, 256)
  assert_close_fp32(y.reshape(18, 384), dequant_reference(x2, w), dq_act(x2), quant.quantize_weight(w).dequantize())
  np.testing.assert_array_equal(y, ops.linear(x, quant.quantize_weight(w), cfg))


def _grad_reference(x, w, dy):
  """jax.grad of the dequantize-then-matmul reference, with each GEMM's operands quantized like the op does."""
  wd = quant.quantize_weight(w).dequantize()
  ops_dx = (dq_act(dy), wd.T)
  ops_dw = (dq_act(quant.pad_k(dy.T)), dq_act(quant.pad_k(x.T)))
  dx = jnp.dot(ops_dx[0], ops_dx[1].T, precision=jax.lax.Precision.HIGHEST)
  dw = jnp.dot(ops_dw[0], ops_dw[1].T, precision=jax.lax.Precision.HIGHEST)
  return (dx, ops_dx), (dw, ops_dw)


@cpu_only
def test_gradients_match_reference():
  m, k, n = 256, 256, 384
  x, w, dy = rand(6, (m, k), 1.0), rand(7, (n, k), 0.05), rand(8, (m, n), 1e-3)
  cfg = ops.LinearConfig(out_dtype="float32")
  _, vjp = jax.vjp(lambda x, w: ops.linear(x, quant.FP8Weight(w), cfg), x, w)
  dx, dw = vjp(dy)
  (rdx, ox), (rdw, ow) = _grad_reference(x, w, dy)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert_close_fp32(dx, rdx, *ox)
  assert_close_fp32(dw, rdw, *ow)


@cpu_only
def test_gradients_with_ragged_tokens():
  """M not a multiple of 128: the wgrad GEMM zero-pads tokens, which must not change dW."""
  x, w, dy = rand(9, (70, 128)), rand(10, (128, 128), 0.05), rand(11, (70, 128))
  _, vjp = jax.vjp(lambda x, w: ops.linear(x, quant.FP8Weight(w), ops.LinearConfig(out_dtype="float32")), x, w)
  _, dw = vjp(dy)
  rdw, ow = _grad_reference(x, w, dy)[1]
  assert_close_fp32(dw, rdw, *ow)


# FP8 vs BF16: with 1x128 / 128x128 E4M3 scaling each operand carries <= 2^-4 relative error per element
# (module docs of fp8jax.quant); for random data the errors are independent, so the relative Frobenius error of a
# product is about sqrt(2) * 2^-4 / sqrt(3) ~ 0.05 at worst and ~0.03 typical. Documented bound: 0.06.
FP8_VS_BF16_REL_BOUND = 0.06


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_fp8_vs_bf16_within_documented_bound():
  x, w, dy = rand(12, (256, 512)), rand(13, (384, 512), 0.05), rand(14, (256, 384))
  f32 = ops.LinearConfig(out_dtype="float32")
  y8, vjp8 = jax.vjp(lambda x, w: ops.linear(x, quant.FP8Weight(w), f32), x, w)
  yb, vjpb = jax.vjp(lambda x, w: jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST), x, w)
  assert rel(y8, yb) < FP8_VS_BF16_REL_BOUND
  for g8, gb in zip(vjp8(dy), vjpb(dy)):
    assert rel(g8, gb) < FP8_VS_BF16_REL_BOUND


def test_bf16_mode_is_plain_matmul():
  x, w = rand(15, (8, 256), 1.0, jnp.bfloat16), rand(16, (128, 256), 0.05)
  y = ops.linear(x, w, ops.LinearConfig(out_dtype="float32"))
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32).T,
                precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)


@cpu_only
def test_backend_choice_is_visible_and_pallas_refuses_without_gpu():
  assert ops.resolve_backend("auto") == "xla"
  assert "auto->xla" in ops.backend_report()
  with pytest.raises(RuntimeError, match="gemm_backend='pallas' cannot run here"):
    ops.resolve_backend("pallas")


def test_shape_errors_name_shapes():
  with pytest.raises(ValueError, match=r"K=256 .*\(128, 128\)"):
    ops.linear(jnp.ones((2, 256)), jnp.ones((128, 128)))
  with pytest.raises(ValueError, match="multiple of 128"):
    fp8_gemm.fp8_gemm_reference(jnp.ones((2, 100), jnp.float8_e4m3fn), jnp.ones((2, 1)),
                                jnp.ones((128, 100), jnp.float8_e4m3fn), jnp.ones((1, 1)))



@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "qweight"])
def test_empty_batch_gives_empty_result_and_zero_gradient(kind):
  """M = 0 rows (e.g. an empty microbatch): the (0, N) result, not a division by zero in the 1x128 grouping."""
  w = rand(1, (256, 128), 0.05)
  wrap = {"bf16": lambda w: w, "fp8_master": quant.FP8Weight, "qweight": quant.quantize_weight}[kind]
  for x in (jnp.zeros((0, 128)), jnp.zeros((2, 0, 128))):
    y = ops.linear(x, wrap(w))
    assert y.shape == (*x.shape[:-1], 256) and y.dtype == jnp.bfloat16
  if kind == "fp8_master":
    g = jax.grad(lambda w: jnp.sum(ops.linear(jnp.zeros((0, 128)), quant.FP8Weight(w)).astype(jnp.float32)))(w)
    assert g.shape == w.shape and not np.any(np.asarray(g))


def test_bad_weight_rank_and_complex_inputs_are_refused():
  x = jnp.ones((2, 128))
  for w in (jnp.ones(()), jnp.ones((128,)), jnp.ones((2, 128, 128))):
    with pytest.raises(ValueError, match="weight must be 2-D.*" + re.escape(f"got shape {tuple(w.shape)}")):
      ops.linear(x, w)
  with pytest.raises(ValueError, match="contraction axis"):
    ops.linear(jnp.ones(()), jnp.ones((128, 128)))
  with pytest.raises(TypeError, match="complex"):
    ops.linear(x.astype(jnp.complex64), jnp.ones((128, 128)))
  with pytest.raises(TypeError, match="complex"):
    ops.linear(x, quant.FP8Weight(jnp.ones((128, 128), jnp.complex64)))


PER_DEVICE_SCRIPT = r"""
import os, sys, json, functools
FAKE = {fake}  # 4 fake CPU devices with interpret-mode stand-ins, else all local GPUs with the Hopper kernels
if FAKE:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, {repo!r})
import fp8jax, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fp8jax import ops, quant
from pallas_kernels import fp8_gemm_triton, fp8_quant

devices = np.asarray(jax.devices())
if FAKE:
  # The "pallas" path on CPU: the Triton GEMM and the quantization kernels in interpret mode stand in for the
  # Hopper kernels (the per-device logic under test does not depend on which kernel runs).
  ops.resolve_backend = lambda requested: "pallas"
  ops._pallas_gemm = lambda: functools.partial(fp8_gemm_triton.fp8_gemm, interpret=True)
  class Q:
    quantize_act = functools.partial(fp8_quant.quantize_act, interpret=True)
    quantize_act_t = functools.partial(fp8_quant.quantize_act_t, interpret=True)
  ops._pallas_quant = lambda: Q
  mesh = Mesh(devices.reshape(2, 2, 1), ("data", "fsdp", "tensor"))
else:
  mesh = Mesh(devices.reshape(1, -1, 1), ("data", "fsdp", "tensor"))
m = 128 * mesh.size  # 128 tokens per device
x = jax.random.normal(jax.random.key(0), (m, 256), jnp.float32).astype(jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (384, 256), jnp.float32) * 0.05
g = jax.random.normal(jax.random.key(2), (m, 384), jnp.float32)

def run(cfg, x, w):
  f = lambda x, w: jnp.sum(ops.linear(x, quant.FP8Weight(w), cfg).astype(jnp.float32) * g)
  y = jax.jit(lambda x, w: ops.linear(x, quant.FP8Weight(w), cfg))(x, w)
  dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
  yq = jax.jit(lambda x: ops.linear(x, quant.quantize_weight(w), cfg))(x)
  return [np.asarray(a, np.float32) for a in (y, dx, dw, yq)], str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))

one, _ = run(ops.LinearConfig(backend="pallas"), x, w)
xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None)))
ws = jax.device_put(w, NamedSharding(mesh, P(None, "fsdp")))
many, jaxpr = run(ops.LinearConfig(backend="pallas", mesh=mesh), xs, ws)
out = dict(y=bool((one[0] == many[0]).all()), dx=bool((one[1] == many[1]).all()), yq=bool((one[3] == many[3]).all()),
           dw_rel=float(np.abs(one[2] - many[2]).max() / np.abs(one[2]).max()),
           shard_maps=jaxpr.count("shard_map"), psum=("psum" in jaxpr))
print("RESULT" + json.dumps(out))
"""


def _check_per_device(fake: bool):
  """Runs PER_DEVICE_SCRIPT: forward, dgrad and the quantized-weight forward under shard_map must be bitwise the
  single-device rows; wgrad sums per-device partial dW (psum), equal up to FP32 summation order."""
  script = PER_DEVICE_SCRIPT.format(repo=REPO, fake=fake)
  res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.split("RESULT")[-1])
  assert out["y"] and out["dx"] and out["yq"], out
  assert out["shard_maps"] >= 3 and out["psum"], out  # forward, dgrad, wgrad each per device
  assert out["dw_rel"] <= 1e-5, out


@cpu_only
def test_pallas_path_runs_per_device_on_a_mesh():
  """On a 4-device mesh (rows over data x fsdp) the pallas path runs under shard_map (interpret-mode kernels)."""
  _check_per_device(fake=True)


class _StubMesh:
  """Stands in for a jax Mesh in ``_per_device`` (which reads only ``size`` and ``shape``)."""

  def __init__(self, **shape):
    self.shape = shape
    self.size = int(np.prod(list(shape.values())))


def test_per_device_only_for_pallas_rows_that_divide(monkeypatch):
  rows4 = _StubMesh(data=2, fsdp=2, tensor=1)
  monkeypatch.setattr(ops, "resolve_backend", lambda requested: requested)
  assert ops._per_device(ops.LinearConfig(backend="pallas", mesh=rows4), 512) == (rows4, ("data", "fsdp"))
  assert ops._per_device(ops.LinearConfig(backend="pallas", mesh=rows4), 130) is None  # 130 rows over 4 devices
  assert ops._per_device(ops.LinearConfig(backend="xla", mesh=rows4), 512) is None  # XLA partitions its own ops
  assert ops._per_device(ops.LinearConfig(backend="pallas"), 512) is None  # no mesh
  assert ops._per_device(ops.LinearConfig(backend="pallas", mesh=_StubMesh(data=1, fsdp=1, tensor=1)), 512) is None
  assert ops._per_device(ops.LinearConfig(backend="pallas", mesh=_StubMesh(data=1, fsdp=1, tensor=4)), 512) is None
  fsdp8 = _StubMesh(data=1, fsdp=8, tensor=1)
  assert ops._per_device(ops.LinearConfig(backend="pallas", mesh=fsdp8), 1024) == (fsdp8, ("fsdp",))


@pytest.mark.gpu
@pytest.mark.skipif(not (ops.hopper_available() and len(jax.devices()) >= 2), reason="needs >= 2 Hopper GPUs")
def test_gpu_pallas_path_per_device_on_real_gpus():
  """The per-device path on real GPUs with the real Hopper kernels: rows over an fsdp axis of all local GPUs."""
  _check_per_device(fake=False)
