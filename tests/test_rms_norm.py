"""RMSNorm: the fixed-tile Pallas kernel (pallas_kernels.rms_norm) vs its plain-jnp reference, the reference vs HF's
formula, the model-side dispatch (fp8jax.model.layers.rms_norm) and its gradient; the same for the residual add
fused into the norm (``add_rms_norm``).

CPU (CI): interpret mode (the kernel body on CPU), lowering for ``cuda``; GPU (``-m gpu``): the compiled kernel and
its batch invariance (a row's bits among 1, 64 or 4096 rows)."""

import functools
import types

import fp8jax  # (first: XLA flags)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops

from fp8jax import backends
from fp8jax.model import layers
from pallas_kernels import rms_norm as kern
from pallas_kernels.lowering import lower_for_h200

EPS = 1e-5


def _rows(seed, m, d, dtype=jnp.bfloat16):
  """Random rows at magnitudes 1e-3 .. 1e3, one huge row (above SAFE_AMAX), one with NaN, one with inf, one zero."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, d)) * np.exp(rng.uniform(-7, 7, (m, 1)))
  if m >= 5:
    x[1] *= 1e20
    x[2, 3] = np.nan
    x[3, 0] = np.inf
    x[4] = 0.0
  w = 1 + 0.1 * rng.standard_normal(d)
  return jnp.asarray(x, jnp.float32).astype(dtype), jnp.asarray(w, jnp.float32)


def _hf_formula(x, w, eps):
  """HF LlamaRMSNorm with an frexp/ldexp prescale of rows above 2**48 (the model's formula before the kernel)."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
  _, e = jnp.frexp(amax)
  s = jnp.where((amax > 2.0**48) & jnp.isfinite(amax), jnp.ldexp(jnp.float32(1.0), -jnp.minimum(e, 126)), 1.0)
  xs = x32 * s
  y = xs * jax.lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + eps * (s * s))
  return w.astype(x.dtype) * y.astype(x.dtype)


def _close_bf16(got, want):
  """Equal NaN positions; elsewhere within one BF16 ulp (a few FP32 ulps): FP32 sums in another order."""
  g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
  ok = ~np.isnan(r)
  ulp = 2.0 ** -7 if got.dtype == jnp.bfloat16 else 2.0 ** -20  # FP32: a few roundings after the sum
  np.testing.assert_array_less(np.abs(g - r)[ok], ulp * np.maximum(np.abs(r[ok]), 1e-30) + 1e-30)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_reference_is_the_hf_formula_bitwise(dtype):
  x, w = _rows(0, 40, 256, dtype)
  np.testing.assert_array_equal(np.asarray(jax.jit(kern.rms_norm_reference, static_argnums=2)(x, w, EPS), np.float32),
                                np.asarray(jax.jit(_hf_formula, static_argnums=2)(x, w, EPS), np.float32))
  assert bool(jnp.all(jnp.isfinite(kern.rms_norm_reference(x, w, EPS)[1])))  # the huge row did not overflow


@pytest.mark.parametrize("m", [1, 7, 130])
@pytest.mark.parametrize("d", [64, 128, 1024, 48, 576])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_interpret_matches_reference(m, d, dtype):
  """Power-of-two widths and padded ones (48 on a 64-wide tile, SmolLM2's 576 on a 1024-wide one)."""
  x, w = _rows(m + d, m, d, dtype)
  got = kern.rms_norm(x, w, EPS, interpret=True)
  assert got.shape == x.shape and got.dtype == x.dtype
  _close_bf16(got, kern.rms_norm_reference(x, w, EPS))


def test_leading_axes_are_rows():
  x, w = _rows(3, 24, 128)
  x4 = x.reshape(2, 3, 4, 128)
  np.testing.assert_array_equal(np.asarray(kern.rms_norm(x4, w, EPS, interpret=True), np.float32),
                                np.asarray(kern.rms_norm(x, w, EPS, interpret=True), np.float32).reshape(x4.shape))


def test_padded_width_divides_by_the_true_width():
  """A 576-wide row on the 1024-wide tile is the reference's row, not that of the row with 448 zeros appended (whose
  mean(x^2) is 576/1024 of it): constant rows normalize to exactly w."""
  x = jnp.full((3, 576), 3.0, jnp.float32)
  w = jnp.linspace(0.5, 1.5, 576, dtype=jnp.float32)
  got = np.asarray(kern.rms_norm(x, w, 0.0, interpret=True))
  np.testing.assert_allclose(got, np.broadcast_to(np.asarray(w), got.shape), rtol=2e-7)
  assert kern.tile_width(576) == 1024 and kern.tile_width(48) == 64 and kern.tile_width(4096) == 4096


@pytest.mark.parametrize("d", [20000, 32768])
def test_unsupported_width_is_named(d):
  x = jnp.ones((2, d), jnp.bfloat16)
  assert str(d) in kern.unsupported(x)
  with pytest.raises(ValueError, match=f"RMSNorm width {d}"):
    kern.rms_norm(x, jnp.ones((d,)), EPS, interpret=True)


def test_dispatch_cpu_and_errors():
  x, w = _rows(4, 8, 128)
  np.testing.assert_array_equal(np.asarray(layers.rms_norm(x, w, EPS), np.float32),
                                np.asarray(kern.rms_norm_reference(x, w, EPS), np.float32))
  if not backends.gpu_available():
    with pytest.raises(RuntimeError, match="model.norm_backend='pallas' cannot run here"):
      layers.rms_norm(x, w, EPS, "pallas")
  with pytest.raises(ValueError, match="norm_backend"):
    layers.rms_norm(x, w, EPS, "cuda")
  with pytest.raises(ValueError, match="model.norm_backend"):
    from fp8jax.model import ModelConfig  # noqa: PLC0415
    ModelConfig(vocab_size=8, dim=64, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=64, ffn_dim=128,
                norm_backend="triton")


def test_kernel_path_gradient_is_the_reference_gradient(monkeypatch):
  """The model's kernel path (forced here, the kernel in interpret mode): values within one ulp of the reference,
  gradients those of the reference."""
  monkeypatch.setattr(backends, "gpu_available", lambda: True)
  monkeypatch.setattr(layers, "_norm_kernel", lambda: types.SimpleNamespace(
      rms_norm=functools.partial(kern.rms_norm, interpret=True)))
  x, w = _rows(5, 12, 128, jnp.float32)
  x = jnp.where(jnp.isfinite(x), x, 0.0)
  g = jax.random.normal(jax.random.key(0), x.shape)
  _close_bf16(layers.rms_norm(x, w, EPS, "pallas"), kern.rms_norm_reference(x, w, EPS))
  got = jax.grad(lambda x_, w_: jnp.sum(layers.rms_norm(x_, w_, EPS, "pallas") * g), argnums=(0, 1))(x, w)
  want = jax.grad(lambda x_, w_: jnp.sum(kern.rms_norm_reference(x_, w_, EPS) * g), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert "norm:pallas->pallas" in backends.backend_report()


@pytest.mark.parametrize("m", [1, 7, 130])
@pytest.mark.parametrize("d", [64, 1024, 576])
def test_add_interpret_is_the_sum_and_the_norm_of_the_sum_bitwise(m, d):
  """The fused residual add (interpret mode): s is x + h bit for bit, and its norm rows are the norm kernel's rows
  of s bit for bit (the same tile and body), for random rows incl. NaN / inf / huge / zero ones and leading axes."""
  x, w = _rows(m + 2 * d, m, d)
  h, _ = _rows(m + 3 * d, m, d)
  s, y = kern.add_rms_norm(x, h, w, EPS, interpret=True)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + h, np.float32))
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(kern.rms_norm(s, w, EPS, interpret=True), np.float32))
  s4, y4 = kern.add_rms_norm(x.reshape(1, m, 1, d), h.reshape(1, m, 1, d), w, EPS, interpret=True)
  np.testing.assert_array_equal(np.asarray(y4, np.float32).reshape(m, d), np.asarray(y, np.float32))
  with pytest.raises(ValueError, match="must match"):
    kern.add_rms_norm(x, h.astype(jnp.float32), w, EPS, interpret=True)


def test_add_rms_norm_dispatch_and_kernel_gradient(monkeypatch):
  """``layers.add_rms_norm``: on CPU the reference add then ``rms_norm`` (h None: x as it is); on the kernel path
  (forced, interpret mode) the same values, and the gradients of the reference's add + norm."""
  x, w = _rows(8, 12, 128, jnp.float32)
  x = jnp.where(jnp.isfinite(x), x, 0.0)
  h = jax.random.normal(jax.random.key(1), x.shape)
  s, y = layers.add_rms_norm(x, h, w, EPS)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(x + h))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(layers.rms_norm(x + h, w, EPS)))
  s0, y0 = layers.add_rms_norm(x, None, w, EPS)
  assert s0 is x and np.array_equal(np.asarray(y0), np.asarray(layers.rms_norm(x, w, EPS)))
  monkeypatch.setattr(backends, "gpu_available", lambda: True)
  monkeypatch.setattr(layers, "_norm_kernel", lambda: types.SimpleNamespace(
      rms_norm=functools.partial(kern.rms_norm, interpret=True),
      add_rms_norm=functools.partial(kern.add_rms_norm, interpret=True)))
  ks, ky = layers.add_rms_norm(x, h, w, EPS, "pallas")
  np.testing.assert_array_equal(np.asarray(ks), np.asarray(s))
  _close_bf16(ky, y)
  gs, gy = jax.random.normal(jax.random.key(2), x.shape), jax.random.normal(jax.random.key(3), x.shape)

  def loss(fn):
    return lambda x_, h_, w_: jnp.sum(fn(x_, h_, w_)[0] * gs) + jnp.sum(fn(x_, h_, w_)[1] * gy)

  got = jax.grad(loss(lambda *a: layers.add_rms_norm(*a, EPS, "pallas")), argnums=(0, 1, 2))(x, h, w)
  want = jax.grad(loss(lambda *a: kern.add_rms_norm_reference(*a, EPS)), argnums=(0, 1, 2))(x, h, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d", [128, 4096, 576])
def test_lowers_for_cuda(d):
  row, wt = jax.ShapeDtypeStruct((300, d), jnp.bfloat16), jax.ShapeDtypeStruct((d,), jnp.float32)
  assert "triton" in lower_for_h200(functools.partial(kern.rms_norm, eps=EPS), row, wt)
  assert "triton" in lower_for_h200(functools.partial(kern.add_rms_norm, eps=EPS), row, row, wt)


@pytest.mark.gpu
@pytest.mark.skipif(not backends.gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [128, 1024, 4096, 576, 896])
def test_gpu_matches_reference_and_rows_are_batch_invariant(d):
  x, w = _rows(d, 4096, d)
  full = kern.rms_norm(x, w, EPS)
  _close_bf16(full, jax.jit(kern.rms_norm_reference, static_argnums=2)(x, w, EPS))
  for m in (1, 64, 1000):
    idx = jnp.asarray(np.random.default_rng(m).choice(4096, m, replace=False))
    np.testing.assert_array_equal(np.asarray(kern.rms_norm(x[idx], w, EPS), np.float32),
                                  np.asarray(full[idx], np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not backends.gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [128, 4096, 576])
def test_gpu_add_is_the_sum_and_the_norm_of_the_sum_bitwise(d):
  """Compiled: the fused kernel's sum is x + h and its norm rows the norm kernel's rows of that sum, bit for bit, at
  decode and training row counts."""
  x, w = _rows(d + 1, 4096, d)
  h, _ = _rows(d + 2, 4096, d)
  for m in (1, 256, 4096):
    s, y = kern.add_rms_norm(x[:m], h[:m], w, EPS)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x[:m] + h[:m], np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(kern.rms_norm(s, w, EPS), np.float32))


def test_cpu_path_equals_the_reference_and_the_trainers_rows_do_not_follow_the_batch():
  """The CPU path (``rms_norm_invariant``, a fixed-order sum): the reference's values, and the tiny default's trainer
  log-probs of 32 sequences bitwise those rows of a 128-sequence batch, with and without FP8 KV scales (with
  whole-array XLA:CPU reductions one row of 32 differed for both cases here, by up to 5.2e-3, AMD EPYC 2026-12-02:
  the data decide which row lands near a rounding tie)."""
  x, w = _rows(5, 300, 256)
  _close_bf16(jax.jit(kern.rms_norm_invariant, static_argnums=2)(x, w, EPS), kern.rms_norm_reference(x, w, EPS))
  from configs import tiny_fp8  # noqa: PLC0415
  from fp8jax import kvcache, recipes  # noqa: PLC0415
  from fp8jax.model import ModelConfig, init_params, llama  # noqa: PLC0415

  c = tiny_fp8.get_config()
  cfg = ModelConfig.from_config(c.model)
  recipe = recipes.Recipe.from_config(c.fp8)
  lcfg = ops.LinearConfig.from_recipe(recipe)
  params = recipes.mark_fp8(init_params(cfg, seed=0), recipe)
  logp = fp8jax.jit(lambda p, t, kv: llama.next_token_logprobs(p, t, cfg, lcfg, kv_scales=kv)[0])
  for seed, fp8_kv in ((1, True), (2, False)):
    tokens = jax.random.randint(jax.random.key(seed), (128, 32), 0, cfg.vocab_size)
    kv = None
    if fp8_kv:
      aux = fp8jax.jit(lambda p, t: llama.forward(p, t, cfg, lcfg)[2])(params, tokens)
      kv = (kvcache.scales_from_amax(aux.k_amax_L, 1.25), kvcache.scales_from_amax(aux.v_amax_L, 1.25))
    np.testing.assert_array_equal(np.asarray(logp(params, tokens[:32], kv)), np.asarray(logp(params, tokens, kv))[:32])


def test_weight_gradient_sums_in_fp32():
  """The norm weight's gradient sums cotangent * y over every row. The product is formed in FP32 and rounded once to
  BF16 (the same bits as the BF16 product), so under fp8jax's compiler options (no excess precision) that sum runs in
  FP32: over 8,192 rows it is within one BF16 rounding of the float64 sum (the gradient passes the weight's BF16
  cast). With BF16 products XLA:CPU summed in BF16: 0.9% of the largest entry off."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8192, 64)), jnp.bfloat16)
  w = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
  g = jnp.asarray(1 + 0.01 * rng.standard_normal((8192, 64)), jnp.bfloat16)
  gw = fp8jax.jit(lambda x_, w_, c: jax.vjp(lambda ww: kern.rms_norm_invariant(x_, ww, EPS), w_)[1](c)[0])(x, w, g)
  y = np.asarray(fp8jax.jit(kern.rms_norm_invariant, static_argnums=2)(x, jnp.ones((64,), jnp.float32), EPS),
                 np.float64)
  want = np.sum(np.asarray(g, np.float64) * y, 0)
  assert np.max(np.abs(np.asarray(gw, np.float64) - want)) <= 2.0 ** -8 * np.abs(want).max()
