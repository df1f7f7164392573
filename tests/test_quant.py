"""The quantizer against independent references (NumPy + ml_dtypes, torch.float8_e4m3fn) and its error bounds."""

import fp8jax  # noqa: F401  (sets XLA flags before JAX starts)

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8jax import quant
from fp8jax import recipes

SETTINGS = settings(max_examples=40, deadline=None)


def np_quantize_groups(x_GxB: np.ndarray, pow2=False):
  """Independent reference: rows of ``x_GxB`` are the quantization groups (float64 amax, ml_dtypes cast)."""
  x = np.asarray(x_GxB, np.float64)
  finite = np.where(np.isfinite(x), np.abs(x), 0.0)
  amax = np.maximum(finite.max(axis=1, keepdims=True), quant.AMAX_FLOOR)
  scale = (amax.astype(np.float32) * (np.float32(1) / np.float32(448.0))).astype(np.float32)
  if pow2:
    scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    y = np.clip(x.astype(np.float32) * (np.float32(1) / scale), -448, 448)
  y = np.where(np.isfinite(x), y, np.nan)
  return y.astype(ml_dtypes.float8_e4m3fn), scale[:, 0]


def magnitudes():
  """Floats spanning tiny (incl. FP32 denormals), normal and huge magnitudes, mixed within one block."""
  exps = st.integers(-45, 30)
  mant = st.floats(-2, 2, allow_nan=False, width=32)
  return st.builds(lambda m, e: np.float32(m * 10.0**e), mant, exps)


@st.composite
def act_arrays(draw):
  rows = draw(st.integers(1, 5))
  kb = draw(st.integers(1, 3))
  return draw(hnp.arrays(np.float32, (rows, kb * 128), elements=magnitudes()))


def bits(a):
  return np.asarray(a).view(np.uint8)


@SETTINGS
@given(act_arrays(), st.booleans())
def test_activation_matches_numpy_reference(x, pow2):
  q, s = quant.quantize_act(jnp.asarray(x), pow2=pow2)
  rq, rs = np_quantize_groups(x.reshape(-1, 128), pow2)
  np.testing.assert_array_equal(np.asarray(s).reshape(-1), rs)
  np.testing.assert_array_equal(bits(q).reshape(-1, 128), bits(rq))


@SETTINGS
@given(act_arrays(), st.booleans())
def test_roundtrip_within_e4m3_bound(x, pow2):
  q, s = quant.quantize_act(jnp.asarray(x), pow2=pow2)
  deq = np.asarray(quant.dequantize_act(q, s))
  s_el = np.repeat(np.asarray(s), 128, axis=-1)
  bound = np.asarray(quant.roundtrip_bound(jnp.asarray(x), jnp.asarray(s_el)))
  assert np.all(np.abs(deq - x) <= bound)


@SETTINGS
@given(act_arrays())
def test_pow2_scales_are_powers_of_two_and_never_overflow(x):
  q, s = quant.quantize_act(jnp.asarray(x), pow2=True)
  m, _ = np.frexp(np.asarray(s))
  assert np.all(m == 0.5)
  s_el = np.repeat(np.asarray(s), 128, axis=-1)
  assert np.all(np.abs(x / s_el) <= 448.0)  # no value needed clipping
  assert np.all(np.isfinite(np.asarray(q, np.float32)))


def test_matches_torch_float8_cast():
  x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * np.float32(3.0)
  q, s = quant.quantize_act(jnp.asarray(x))
  s_el = np.repeat(np.asarray(s), 128, axis=-1)
  tq = (torch.from_numpy(x) * (1 / torch.from_numpy(s_el))).clamp(-448, 448).to(torch.float8_e4m3fn)
  np.testing.assert_array_equal(bits(q), tq.view(torch.uint8).numpy())


def test_to_e4m3_matches_direct_cast_at_every_rounding_boundary():
  """to_e4m3 (bit-pattern rounding) vs a direct single-rounding FP32 -> E4M3 cast (ml_dtypes).

  Every FP32 sign/exponent and every value of mantissa bits 12-22 (which hold E4M3's 3 kept bits and the round/tie
  bits below them), with the low 12 bits set to 0, 1, 0x7FF, 0x800, 0x801 and 0xFFF: ties, just-below/above-tie and
  carries into the exponent, in all binades (E4M3 subnormals, normals, clipped, inf/NaN). ~6.3M values. (An
  exhaustive run over all 2**32 patterns, also 0 mismatches, takes ~50 s: see docs/history.md.)
  """
  high = np.arange(1 << 20, dtype=np.uint32) << 12
  low = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)
  x = (high[:, None] | low[None, :]).ravel().view(np.float32)
  got = np.asarray(jax.jit(quant.to_e4m3)(x))
  finite = np.isfinite(x)
  want = np.clip(x[finite], -448, 448).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(bits(got[finite]), bits(want))
  assert np.isnan(got[~finite].astype(np.float32)).all()


def test_zero_block_is_exact_zero_and_nonfinite_never_hidden():
  x = np.zeros((2, 256), np.float32)
  x[1, :128] = np.linspace(-3, 3, 128)
  x[1, 5], x[1, 6], x[1, 7] = np.nan, np.inf, -np.inf
  q, s = quant.quantize_act(jnp.asarray(x))
  deq = np.asarray(quant.dequantize_act(q, s))
  assert np.all(deq[0] == 0) and np.all(deq[1, 128:] == 0)
  assert np.all(np.isnan(deq[1, 5:8]))  # NaN stays NaN; +-inf (no E4M3 encoding) becomes NaN, never finite
  finite = np.isfinite(x[1, :128])
  assert np.asarray(s)[1, 0] == np.float32(3.0) * (np.float32(1) / np.float32(448.0))  # amax ignores the non-finite values
  assert np.all(np.abs(deq[1, :128][finite] - x[1, :128][finite]) <= 3.0 * 2**-4)


def test_weight_tiles_and_ragged_shapes_match_reference():
  rng = np.random.default_rng(1)
  w = (rng.standard_normal((200, 300)) * np.exp(rng.uniform(-5, 5, (200, 1)))).astype(np.float32)
  qw = quant.quantize_weight(jnp.asarray(w))
  assert qw.q.shape == (200, 300) and qw.scale.shape == (2, 3)
  wp = np.zeros((256, 384), np.float32)
  wp[:200, :300] = w
  tiles = wp.reshape(2, 128, 3, 128).transpose(0, 2, 1, 3).reshape(6, 128 * 128)
  rq, rs = np_quantize_groups(tiles)
  np.testing.assert_array_equal(np.asarray(qw.scale).reshape(-1), rs)
  rq = rq.reshape(2, 3, 128, 128).transpose(0, 2, 1, 3).reshape(256, 384)[:200, :300]
  np.testing.assert_array_equal(bits(qw.q), bits(rq))
  deq = np.asarray(qw.dequantize())
  bound = np.asarray(quant.roundtrip_bound(jnp.asarray(w), quant.expand_weight_scale(qw.scale, 200, 300)))
  assert np.all(np.abs(deq - w) <= bound)


def test_transposed_quantization_groups_tokens():
  x = jax.random.normal(jax.random.key(0), (130, 256), jnp.bfloat16)
  q, s = quant.quantize_act_t(x)
  assert q.shape == (256, 256) and s.shape == (256, 2)  # tokens zero-padded 130 -> 256
  rq, rs = quant.quantize_act(jnp.pad(x.T, ((0, 0), (0, 126))))
  np.testing.assert_array_equal(bits(q), bits(rq))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))


def test_bad_shapes_name_the_shape():
  with pytest.raises(ValueError, match=r"\(4, 100\).*multiple of 128"):
    quant.quantize_act(jnp.ones((4, 100)))
  assert quant.pad_k(jnp.ones((4, 100))).shape == (4, 128)


def _params():
  layer = {n: jnp.ones((128, 128)) for n in recipes.LINEAR_NAMES} | {"attn_norm": jnp.ones(128), "mlp_norm": jnp.ones(128)}
  return {"embed": jnp.ones((256, 128)), "layers": [dict(layer) for _ in range(4)], "final_norm": jnp.ones(128),
          "lm_head": jnp.ones((256, 128))}


def test_quantize_params_recipe_selection():
  p = _params()
  r = recipes.Recipe(keep_first_n=1, keep_last_n=1, keep_patterns=("layers/*/w_down",))
  qp = recipes.quantize_params(p, r)
  for i, layer in enumerate(qp["layers"]):
    for name, w in layer.items():
      fp8 = name in recipes.LINEAR_NAMES and i in (1, 2) and name != "w_down"
      assert isinstance(w, quant.QWeight) == fp8, (i, name)
      if not fp8:
        assert w is p["layers"][i][name]  # kept layers are the master arrays themselves
  for name in ("embed", "lm_head", "final_norm"):
    assert not isinstance(qp[name], quant.QWeight)
  assert not any(isinstance(w, quant.QWeight)
                 for w in jax.tree.leaves(recipes.quantize_params(p, recipes.Recipe(mode="bf16")), is_leaf=quant.is_fp8_leaf))


def test_mark_fp8_wraps_master_weights_and_keeps_quantized_ones():
  p, r = _params(), recipes.Recipe(keep_last_n=1)
  marked = recipes.mark_fp8(p, r)
  assert isinstance(marked["layers"][0]["wq"], quant.FP8Weight) and marked["layers"][0]["wq"].w is p["layers"][0]["wq"]
  assert not isinstance(marked["layers"][3]["wq"], quant.FP8Weight)
  qp = recipes.quantize_params(p, r)
  assert recipes.mark_fp8(qp, r)["layers"][0]["wq"] is qp["layers"][0]["wq"]


def test_recipe_rejects_bad_values():
  with pytest.raises(ValueError, match="fp8.mode"):
    recipes.Recipe(mode="fp4")
  with pytest.raises(ValueError, match="unknown fp8 config keys"):
    recipes.Recipe.from_config({"mode": "fp8", "kv_cach": "fp8"})


def test_fp8_rollout_recipe_has_two_sides_and_refuses_one_sided_use():
  r = recipes.Recipe(mode="fp8_rollout", kv_cache="fp8", keep_first_n=1)
  assert r.sampler_side() == recipes.Recipe(mode="fp8", kv_cache="fp8", keep_first_n=1)
  assert r.trainer_side() == recipes.Recipe(mode="bf16", kv_cache="bf16", keep_first_n=1)
  for one in (recipes.Recipe(), recipes.Recipe(mode="bf16")):
    assert one.sampler_side() is one and one.trainer_side() is one
  for fn in (recipes.quantize_params, recipes.mark_fp8):
    with pytest.raises(ValueError, match="fp8.mode='fp8_rollout'.*sampler_side"):
      fn(_params(), r)
