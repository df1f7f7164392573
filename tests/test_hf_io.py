"""fp8jax.hf without PyTorch: block-FP8 export -> import -> export is exact; ragged layers; broken files named.

Weights come from NumPy's generator (IEEE FP32 everywhere), so every check is exact on any CPU.
"""

import fp8jax

import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fp8jax import hf, quant
from fp8jax import recipes
from fp8jax.model import ModelConfig, llama

ALIGNED = ModelConfig(vocab_size=256, dim=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=384)
RAGGED = ModelConfig(vocab_size=256, dim=256, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=320)
FP8 = recipes.Recipe(mode="fp8", gemm_backend="xla")


def _params(cfg, seed=0):
  rng = np.random.default_rng(seed)
  shapes = llama.param_shapes(cfg)

  def leaf(shape):
    if len(shape) == 1:
      return jnp.asarray(1 + 0.1 * rng.standard_normal(shape), jnp.float32)
    # Rows of different magnitudes, so blocks get many different scales.
    x = rng.standard_normal(shape) * 0.02 * np.exp(rng.standard_normal((shape[0], 1)))
    return jnp.asarray(x, jnp.float32)
  return jax.tree.map(leaf, shapes, is_leaf=lambda x: isinstance(x, tuple))


def _qweights(qparams):
  return [x for x in jax.tree.leaves(qparams, is_leaf=quant.is_fp8_leaf) if isinstance(x, quant.QWeight)]


def _same_qweights(a, b):
  qa, qb = _qweights(a), _qweights(b)
  assert len(qa) == len(qb) > 0
  for x, y in zip(qa, qb):
    np.testing.assert_array_equal(np.asarray(x.q).view(np.uint8), np.asarray(y.q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(x.scale).view(np.uint32), np.asarray(y.scale).view(np.uint32))


def _raw(path):
  """Every tensor of a safetensors file as raw bytes (FP8 included), keyed by name."""
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    body = f.read()
  return {k: np.frombuffer(body[v["data_offsets"][0]:v["data_offsets"][1]], np.uint8)
          for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("cfg,recipe,ragged_fp8", [
    (ALIGNED, FP8, False),
    (ALIGNED, recipes.Recipe(mode="fp8", gemm_backend="xla", pow2_scales=True), False),
    (RAGGED, FP8, True),
])
def test_fp8_export_import_export_is_exact(tmp_path, caplog, cfg, recipe, ragged_fp8):
  params = _params(cfg)
  hf.export_fp8(params, cfg, recipe, str(tmp_path / "a"), ragged_fp8=ragged_fp8)
  with caplog.at_level(logging.WARNING, logger="fp8jax.hf"):
    loaded = hf.load_params(str(tmp_path / "a"), cfg, pow2_scales=recipe.pow2_scales)
  assert "not reproduced exactly" not in caplog.text
  # The loaded master weights requantize to the very codes and scales that were exported (what the sampler and the
  # trainer's forward then run on)...
  _same_qweights(recipes.quantize_params(params, recipe), recipes.quantize_params(loaded, recipe))
  # ...so exporting them again writes the same bytes, every tensor (the BF16 ones round-trip through FP32 exactly).
  hf.export_fp8(loaded, cfg, recipe, str(tmp_path / "b"), ragged_fp8=ragged_fp8)
  a, b = _raw(str(tmp_path / "a" / "model.safetensors")), _raw(str(tmp_path / "b" / "model.safetensors"))
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_plain_dequantization_would_not_be_exact():
  """Why block_fp8_master exists: q * s requantizes to other scales in some blocks (1 ulp), on this data."""
  w = _params(ALIGNED)["layers"][0]["w_up"]
  qw = quant.quantize_weight(w)
  q, s = np.asarray(qw.q), np.asarray(qw.scale)
  naive = quant.quantize_weight(jnp.asarray(hf._block_dequant_np(q, s)))
  assert np.any(np.asarray(naive.scale) != s)
  master, unmatched = hf.block_fp8_master(q, s)
  again = quant.quantize_weight(jnp.asarray(master))
  assert unmatched == 0
  np.testing.assert_array_equal(np.asarray(again.scale), s)
  np.testing.assert_array_equal(np.asarray(again.q).view(np.uint8), q.view(np.uint8))
  assert np.max(np.abs(master - hf._block_dequant_np(q, s))) <= 8 * np.spacing(np.abs(np.asarray(w)).max())


def test_ragged_layers_are_exported_bf16_unless_asked(tmp_path, caplog):
  params = _params(RAGGED)
  with caplog.at_level(logging.WARNING, logger="fp8jax.hf"):
    qc = hf.export_fp8(params, RAGGED, FP8, str(tmp_path / "d"))
  ragged = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}
  assert ragged <= set(qc["modules_to_not_convert"])
  assert "3 weights have a dimension that is not a multiple of 128" in caplog.text
  raw = _raw(str(tmp_path / "d" / "model.safetensors"))
  for m in ragged:
    assert m + ".weight_scale_inv" not in raw and raw[m + ".weight"].size == 2 * np.prod(
        llama.param_shapes(RAGGED)["layers"][0]["w_down"])  # BF16: 2 bytes per element
  assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in raw  # aligned layers stay FP8
  qc2 = hf.export_fp8(params, RAGGED, FP8, str(tmp_path / "e"), ragged_fp8=True)
  assert not ragged & set(qc2["modules_to_not_convert"])
  assert "model.layers.0.mlp.down_proj.weight_scale_inv" in _raw(str(tmp_path / "e" / "model.safetensors"))


# ------------------------------------------------------------------------------------------------------------------
# Broken files
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def bf16_dir(tmp_path):
  d = str(tmp_path / "m")
  hf.export_bf16(_params(ALIGNED), ALIGNED, d)
  return d


def test_truncated_safetensors_names_the_file(bf16_dir):
  path = os.path.join(bf16_dir, "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 1000)
  with pytest.raises(hf.HFCheckpointError, match=rf"{path}: not a readable safetensors file .*truncated"):
    hf.load_params(bf16_dir, ALIGNED)


def _rewrite(d, key, fn):
  path = os.path.join(d, "model.safetensors")
  t = load_file(path)
  t[key] = fn(t[key])
  save_file(t, path)
  return path


def test_integer_weights_are_refused(bf16_dir):
  key = "model.layers.1.mlp.up_proj.weight"
  path = _rewrite(bf16_dir, key, lambda x: np.zeros(x.shape, np.int8))
  with pytest.raises(hf.HFCheckpointError, match=rf"{path}: tensor '{key}' has dtype I8; fp8jax loads "
                     r"floating-point weights"):
    hf.load_params(bf16_dir, ALIGNED)


def test_fp8_weight_without_scales_is_refused(bf16_dir):
  key = "model.layers.0.self_attn.o_proj.weight"
  path = _rewrite(bf16_dir, key, lambda x: x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn))
  with pytest.raises(hf.HFCheckpointError, match=rf"{path}: tensor '{key}' has dtype F8_E4M3 without a "
                     rf"'{key}_scale_inv'"):
    hf.load_params(bf16_dir, ALIGNED)


def test_nonfinite_weights_are_reported(bf16_dir):
  key = "model.layers.0.mlp.down_proj.weight"

  def poison(x):
    x = x.astype(np.float32)
    x[3, 5], x[7, 0] = np.nan, np.inf
    return x.astype(ml_dtypes.bfloat16)
  path = _rewrite(bf16_dir, key, poison)
  with pytest.raises(hf.HFCheckpointError, match=rf"{path}: tensor '{key}' has 2 non-finite values \(NaN/inf\) of "
                     r"\d+, the first at index \(3, 5\)"):
    hf.load_params(bf16_dir, ALIGNED)
