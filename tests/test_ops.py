"""fp8 linear: forward and gradients against the dequantize-then-FP32 reference, and FP8 vs BF16 bounds."""

import fp8jax

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops, quant

from fp8jax import backends
from pallas_kernels import fp8_gemm
import child_process  # tests/child_process.py

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


@pytest.fixture
def bf16_kernel_interpreted(monkeypatch):
  """BF16 mode's "pallas" path with the Mosaic kernel's BF16 mode in interpret mode (a CPU stand-in for the H200);
  backend "xla" still resolves to the XLA path."""
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415
  monkeypatch.setattr(ops, "resolve_bf16_backend", lambda requested: "xla" if requested == "xla" else "pallas")
  monkeypatch.setattr(ops, "_pallas_bf16_gemm", lambda: functools.partial(fp8_gemm_mgpu.bf16_gemm, interpret=True))


# BF16 mode, kernel path vs XLA path (relative Frobenius error): forward with FP32 output <= 1e-6 (FP32 sums of the
# same exact products); BF16 outputs, dx and dw <= 5e-3: both paths round them to BF16 (2^-9 relative each, so a
# differently ordered FP32 sum can round the other way), and with an FP32 output the kernel path also rounds dy.
BF16_PATH_BOUND = 5e-3


@cpu_only
@pytest.mark.parametrize("m,k,n,out_dtype", [(5, 200, 72, "float32"), (130, 256, 128, "bfloat16")])
def test_bf16_kernel_path_and_its_vjp_match_the_xla_path(bf16_kernel_interpreted, m, k, n, out_dtype):
  """The kernel path (N and K zero-padded where they are not multiples of 128) and its custom VJP (dgrad and wgrad
  on the kernel) against the XLA path and its autodiff, dtypes included."""
  x, w, dy = rand(20, (m, k)), rand(21, (n, k), 0.05), rand(22, (m, n), 1.0, jnp.dtype(out_dtype))
  cfg = ops.LinearConfig(out_dtype=out_dtype)
  y, vjp = jax.vjp(lambda x, w: ops.linear(x, w, cfg), x, w)
  y_ref, vjp_ref = jax.vjp(lambda x, w: ops.linear(x, w, dataclasses.replace(cfg, backend="xla")), x, w)
  assert y.dtype == y_ref.dtype == jnp.dtype(out_dtype) and y.shape == (m, n)
  assert rel(y, y_ref) <= (1e-6 if out_dtype == "float32" else BF16_PATH_BOUND)
  for g, g_ref, like in zip(vjp(dy), vjp_ref(dy), (x, w)):
    assert g.dtype == like.dtype and g.shape == like.shape
    assert rel(g, g_ref) <= BF16_PATH_BOUND


@cpu_only
def test_fp8_kernel_path_with_scales_laid_out_once(monkeypatch):
  """The "pallas" FP8 forward (the Mosaic kernel and the quantizer kernel in interpret mode): the quantizer writes
  A's scales transposed for the GEMM, and ``with_kernel_scales`` lays B's out once (the sampler's decode); both
  give the plain path's bits, and the XLA path's result up to FP32 summation order. Off the kernels the params pass
  through untouched."""
  from pallas_kernels import fp8_gemm_mgpu, fp8_quant  # noqa: PLC0415
  qw = quant.quantize_weight(rand(31, (256, 256), 0.05))
  params = {"w": qw, "norm": jnp.ones((256,))}
  assert ops.with_kernel_scales(params, ops.LinearConfig()) is params
  x = rand(30, (70, 256), 1.0, jnp.bfloat16)
  cfg = ops.LinearConfig(out_dtype="float32")
  want = jax.jit(lambda x: ops.linear(x, qw, dataclasses.replace(cfg, backend="xla")))(x)

  class Quant:
    quantize_act = functools.partial(fp8_quant.quantize_act, interpret=True)

  monkeypatch.setattr(ops, "resolve_backend", lambda requested: "pallas")
  monkeypatch.setattr(ops, "_pallas_gemm", lambda: functools.partial(fp8_gemm_mgpu.fp8_gemm, interpret=True))
  monkeypatch.setattr(ops, "_pallas_quant", lambda: Quant)
  laid = ops.with_kernel_scales(params, cfg)
  assert laid["norm"] is params["norm"] and laid["w"].kernel_scale.shape == (2, 64)
  plain = jax.jit(lambda x, w: ops.linear(x, w, cfg))(x, qw)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: ops.linear(x, w, cfg))(x, laid["w"])),
                                np.asarray(plain))
  assert rel(plain, want) <= 1e-6


@cpu_only
class _RefQuant:
  """The quantizer kernels' calls on the XLA quantizer (same values; the scales in the layout the call asks for)."""

  @staticmethod
  def quantize_act(x, pow2=False, scales_t=False):
    q, s = quant.quantize_act(x, pow2)
    return q, (s.T if scales_t else s)

  @staticmethod
  def quantize_act_t(x, pow2=False):
    return quant.quantize_act_t(x, pow2)


def test_pallas_path_pads_a_ragged_output_width(monkeypatch):
  """The Hopper GEMM takes whole 128-row tiles of B; a width that is not a multiple of 128 (SmolLM2's hidden 576:
  w_down's N, the wgrad's N = K) is zero-padded and sliced, so forward, dgrad and wgrad are bitwise the reference's.
  The stand-in kernel refuses ragged N, as the Hopper kernel does."""
  x = jax.random.normal(jax.random.key(0), (5, 320), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (576, 320), jnp.float32) * 0.05
  loss = lambda x, w: jnp.sum(ops.linear(x, quant.FP8Weight(w)).astype(jnp.float32) ** 2)  # noqa: E731
  want = (ops.linear(x, quant.FP8Weight(w)), *jax.grad(loss, argnums=(0, 1))(x, w))
  seen = []

  def strict_gemm(a_q, a_s, b_q, b_s, *, out_dtype, a_scales_t=False, b_scales_kernel=None):
    assert b_q.shape[0] % 128 == 0, b_q.shape
    seen.append(b_q.shape)
    return fp8_gemm.fp8_gemm_reference(a_q, a_s.T if a_scales_t else a_s, b_q, b_s, out_dtype=out_dtype)

  monkeypatch.setattr(ops, "resolve_backend", lambda requested: "pallas")
  monkeypatch.setattr(ops, "_pallas_gemm", lambda: strict_gemm)
  monkeypatch.setattr(ops, "_pallas_quant", lambda: _RefQuant)
  got = (ops.linear(x, quant.FP8Weight(w)), *jax.grad(loss, argnums=(0, 1))(x, w))
  assert (640, 384) in seen and len(seen) >= 3, seen  # forward (N 576 -> 640) and the wgrad / dgrad calls
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bf16_backend_choice_is_visible_and_pallas_refuses_without_gpu():
  """BF16 mode follows fp8.gemm_backend through the same switch, listed as bf16:requested->chosen."""
  x, w = jnp.ones((2, 128)), jnp.ones((128, 128))
  ops.linear(x, w)
  assert "bf16:auto->xla" in backends.backend_report()
  with pytest.raises(RuntimeError, match=r"fp8.gemm_backend='pallas' cannot run here: no sm_90 GPU"):
    ops.linear(x, w, ops.LinearConfig(backend="pallas"))


@pytest.mark.gpu
@pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("out_dtype,k,n", [
    ("float32", 4096, 32768),
    ("bfloat16", 4096, 6144),
    ("float32", 200, 72)])
def test_gpu_bf16_linear_runs_the_kernel(out_dtype, k, n):
  """On sm_90 'auto' runs the BF16 kernel: rows bitwise the same at M = 1, 7, 64 as inside M = 2048, the forward
  bitwise the kernel's, and the kernel VJP within BF16_PATH_BOUND of the XLA path's autodiff."""
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415
  x, w = rand(23, (2048, k), 1.0, jnp.bfloat16), rand(24, (n, k), 0.05)
  cfg = ops.LinearConfig(out_dtype=out_dtype)
  g = fp8jax.jit(lambda x, w: ops.linear(x, w, cfg))  # w an argument: a closed-over w is an executable constant
  f = lambda x: g(x, w)
  full = np.asarray(f(x))
  assert "bf16:auto->pallas" in backends.backend_report()
  for lo, hi in ((0, 1), (1000, 1007), (1984, 2048)):
    np.testing.assert_array_equal(np.asarray(f(x[lo:hi])), full[lo:hi], err_msg=f"rows {lo}:{hi}")
  if k % 128 == 0 and n % 128 == 0:
    kern = fp8_gemm_mgpu.bf16_gemm(x, w.astype(jnp.bfloat16), out_dtype=jnp.dtype(out_dtype))
    np.testing.assert_array_equal(np.asarray(kern), full)
  xs, dy = x[:512], rand(25, (512, n), 1.0, jnp.dtype(out_dtype))
  _, vjp = jax.vjp(lambda x, w: ops.linear(x, w, cfg), xs, w)
  _, vjp_ref = jax.vjp(lambda x, w: ops.linear(x, w, dataclasses.replace(cfg, backend="xla")), xs, w)
  for g, g_ref in zip(vjp(dy), vjp_ref(dy)):
    assert rel(g, g_ref) <= BF16_PATH_BOUND


@cpu_only
def test_backend_choice_is_visible_and_pallas_refuses_without_gpu():
  assert ops.resolve_backend("auto") == "xla"
  assert "auto->xla" in backends.backend_report()
  with pytest.raises(RuntimeError, match="gemm_backend='pallas' cannot run here"):
    ops.resolve_backend("pallas")


def test_kernel_fallbacks_count_reasons_where_a_gpu_was_there(monkeypatch):
  """A reference fallback on a machine with the kernels' GPU (an operand they do not take) counts; 'auto' choosing the
  reference for want of a GPU, a requested 'xla' and the kernels themselves do not; a reason counts once."""
  monkeypatch.setattr(backends, "_REPORT", {})
  probes = [(False, "no CUDA GPU"), (True, "CUDA GPU"), (False, "fallback to the reference: head_dim 96"),
            (False, "fallback to the reference: head_dim 96"), (False, "pallas kernels unavailable (ImportError)")]
  for ok, why in probes:
    backends.choose_backend("auto", what="attention", config_key="model.attn_backend", probe=lambda: (ok, why),
                       prefix="attention:")
  backends.choose_backend("xla", what="attention", config_key="model.attn_backend", probe=None, prefix="attention:")
  assert backends.kernel_fallbacks() == 2, backends.backend_report()


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
import functools
FAKE = {fake}  # 4 fake CPU devices with interpret-mode stand-ins, else all local GPUs with the Hopper kernels
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fp8jax import ops, quant
import kernel_standins

devices = np.asarray(jax.devices())
if FAKE:
  kernel_standins.install()  # interpret-mode kernels in place of the Hopper ones (tests/kernel_standins.py)
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
  fb = lambda x, w: jnp.sum(ops.linear(x, w, cfg).astype(jnp.float32) * g)  # BF16 mode (plain weight)
  yb = jax.jit(lambda x, w: ops.linear(x, w, cfg))(x, w)
  dxb, dwb = jax.jit(jax.grad(fb, argnums=(0, 1)))(x, w)
  return ([np.asarray(a, np.float32) for a in (y, dx, dw, yq, yb, dxb, dwb)],
          str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)) + str(jax.make_jaxpr(jax.grad(fb, argnums=(0, 1)))(x, w)))

one, _ = run(ops.LinearConfig(backend="pallas"), x, w)
xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None)))
ws = jax.device_put(w, NamedSharding(mesh, P(None, "fsdp")))
many, jaxpr = run(ops.LinearConfig(backend="pallas", mesh=mesh), xs, ws)
same = lambda i: bool((one[i] == many[i]).all())
rel = lambda i: float(np.abs(one[i] - many[i]).max() / np.abs(one[i]).max())
out = dict(y=same(0), dx=same(1), yq=same(3), dw_rel=rel(2), y_bf16=same(4), dx_bf16=same(5), dw_bf16_rel=rel(6),
           shard_maps=jaxpr.count("shard_map"), psum=jaxpr.count("psum"))
report(out)
"""


def _check_per_device(fake: bool):
  """Runs PER_DEVICE_SCRIPT: forward, dgrad and the quantized-weight forward under shard_map must be bitwise the
  single-device rows, in FP8 and BF16 mode; wgrad sums per-device partial dW (psum), equal up to FP32 summation
  order (BF16 mode: then rounded to BF16, so up to one BF16 rounding, 2^-8 relative to the largest entry)."""
  out = child_process.run(PER_DEVICE_SCRIPT.format(fake=fake), devices=4 if fake else None, timeout=600)
  assert out["y"] and out["dx"] and out["yq"] and out["y_bf16"] and out["dx_bf16"], out
  assert out["shard_maps"] >= 6 and out["psum"] >= 2, out  # forward, dgrad, wgrad each per device, in both modes
  assert out["dw_rel"] <= 1e-5 and out["dw_bf16_rel"] <= 2.0**-8, out


@cpu_only
def test_pallas_path_runs_per_device_on_a_mesh():
  """On a 4-device mesh (rows over data x fsdp) the pallas path runs under shard_map (interpret-mode kernels)."""
  _check_per_device(fake=True)


TP_SCRIPT = r"""
import functools
FAKE = {fake}  # 4 fake CPU devices (fsdp 2 x tensor 2) with interpret-mode stand-ins, else local GPUs, tensor 2
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fp8jax import ops, quant
from fp8jax.model import schema
import kernel_standins

devices = np.asarray(jax.devices())
if FAKE:
  kernel_standins.install()  # interpret-mode kernels in place of the Hopper ones (tests/kernel_standins.py)
mesh = Mesh(devices[:4].reshape(1, 2, 2) if len(devices) >= 4 else devices[:2].reshape(1, 1, 2),
            ("data", "fsdp", "tensor"))
m = 256
out = {{}}
for style, (n, k), axes in (("column", (512, 256), schema.COLUMN), ("row", (256, 512), schema.ROW)):
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (n, k), jnp.float32) * 0.05
  g = jax.random.normal(jax.random.key(2), (m, n), jnp.float32)
  for mode, wrap in (("fp8", quant.FP8Weight), ("bf16", lambda w: w)):
    def run(cfg, x, w):
      lin = lambda x, w: ops.linear(x, wrap(w), cfg, style)
      y = jax.jit(lin)(x, w)
      dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(lin(x, w).astype(jnp.float32) * g), argnums=(0, 1)))(x, w)
      small = jax.jit(lin)(x[:3], w)  # a decode-sized batch: 3 rows do not divide over the row axes
      return [np.asarray(a, np.float32) for a in (y, dx, dw, small)], str(jax.make_jaxpr(lin)(x, w))
    one, _ = run(ops.LinearConfig(backend="pallas"), x, w)
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), "tensor" if style == "row" else None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(*axes)))
    many, jaxpr = run(ops.LinearConfig(backend="pallas", mesh=mesh), xs, ws)
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
    out[style + "_" + mode] = dict(
        y_bitwise=bool((many[0] == one[0]).all()), dx_bitwise=bool((many[1] == one[1]).all()),
        y_rel=rel(many[0], one[0]), dx_rel=rel(many[1], one[1]), dw_rel=rel(many[2], one[2]),
        decode_rows_bitwise=bool((many[3] == many[0][:3]).all()), all_gathers=jaxpr.count("all_gather"),
        shard_maps=jaxpr.count("shard_map"))
report(out)
"""


def _check_tensor_parallel(fake: bool):
  """TP_SCRIPT: column- and row-parallel linears (FP8 and BF16 mode) on a mesh with a tensor axis vs one device.

  Where a shard computes whole output elements the result is bitwise the single device's (column forward, row
  dgrad). Where a contraction is split over the tensor axis (row forward, column dgrad) the shards' FP32 partial
  sums are added in rank order, then rounded once to BF16: within one BF16 rounding (2^-8 relative to the largest
  entry) of one device; wgrad (partials over tokens) within FP32 summation order (FP8 mode) or one BF16 rounding.
  In every case a decode-sized batch (3 rows) gives bitwise the rows of the 256-row batch: the sampler's rows are
  the trainer's also under tensor parallelism."""
  out = child_process.run(TP_SCRIPT.format(fake=fake), devices=4 if fake else None, timeout=600)
  for mode in ("fp8", "bf16"):
    col, row = out["column_" + mode], out["row_" + mode]
    assert col["y_bitwise"] and row["dx_bitwise"], out
    assert col["dx_rel"] <= 2.0**-8 and row["y_rel"] <= 2.0**-8, out
    for r in (col, row):
      assert r["decode_rows_bitwise"] and r["shard_maps"] >= 1, out
      assert r["dw_rel"] <= (1e-5 if mode == "fp8" else 2.0**-8), out
    assert row["all_gathers"] >= 1 and col["all_gathers"] == 0, out  # the ordered sum of the row-parallel forward


@cpu_only
def test_tensor_parallel_linear_on_fake_devices():
  _check_tensor_parallel(fake=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (backends.hopper_available() and len(jax.devices()) >= 2), reason="needs >= 2 Hopper GPUs")
def test_gpu_tensor_parallel_linear():
  _check_tensor_parallel(fake=False)


class _StubMesh:
  """Stands in for a jax Mesh in ``_placement`` (which reads only ``size`` and ``shape``)."""

  def __init__(self, **shape):
    self.shape = shape
    self.size = int(np.prod(list(shape.values())))


def test_placement_rows_that_divide_and_aligned_tensor_shards(monkeypatch):
  rows4 = _StubMesh(data=2, fsdp=2, tensor=1)
  monkeypatch.setattr(ops, "resolve_backend", lambda requested: requested)
  place = lambda m, mesh, backend="pallas", parallel=None, n=512, k=512: ops._placement(
      ops.LinearConfig(backend=backend, mesh=mesh, parallel=parallel), m, n, k)
  assert place(512, rows4) == ops._Placement(rows4, ("data", "fsdp"), None, None)
  assert place(130, rows4) is None  # 130 rows over 4 devices
  assert place(512, rows4, backend="xla") is None  # XLA partitions its own ops
  assert place(512, None) is None  # no mesh
  assert place(512, _StubMesh(data=1, fsdp=1, tensor=1)) is None
  tp4 = _StubMesh(data=1, fsdp=1, tensor=4)
  assert place(512, tp4) is None  # not a tensor-parallel layer: gathered
  assert place(512, tp4, parallel="column") == ops._Placement(tp4, None, "tensor", "column")
  assert place(3, tp4, parallel="row") == ops._Placement(tp4, None, "tensor", "row")  # independent of the rows
  assert place(512, tp4, parallel="column", n=384) is None  # 384 = 3 blocks over 4 shards: gathered (logged)
  assert place(512, tp4, parallel="row", k=640) is None
  fsdp8 = _StubMesh(data=1, fsdp=8, tensor=1)
  assert place(1024, fsdp8) == ops._Placement(fsdp8, ("fsdp",), None, None)
  with pytest.raises(ValueError, match="parallel must be one of"):
    ops.linear(jnp.ones((2, 128)), jnp.ones((128, 128)), parallel="colum")


@pytest.mark.gpu
@pytest.mark.skipif(not (backends.hopper_available() and len(jax.devices()) >= 2), reason="needs >= 2 Hopper GPUs")
def test_gpu_pallas_path_per_device_on_real_gpus():
  """The per-device path on real GPUs with the real Hopper kernels: rows over an fsdp axis of all local GPUs."""
  _check_per_device(fake=False)
