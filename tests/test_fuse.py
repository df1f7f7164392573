"""Fused projections (fp8jax.model.fuse): when a group fuses, the fused layout, the model's forward on it, the
sampler's use of it; on Hopper the fused GEMM's columns bitwise the separate GEMMs'."""

import fp8jax  # noqa: F401  (first: XLA flags)

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops, quant

from fp8jax import backends
from fp8jax import recipes
from fp8jax import sampler as smp
from fp8jax.model import fuse, llama
from fp8jax.model.config import ModelConfig

# Widths that are whole 128-row blocks (q 512, k/v 256, ffn 384), as the fused kernels need.
CFG = ModelConfig(vocab_size=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, ffn_dim=384)
LIN = ops.LinearConfig()
RECIPES = {"bf16": recipes.Recipe(mode="bf16"), "fp8": recipes.Recipe()}


@pytest.fixture(scope="module")
def master():
  return llama.init_params(CFG, seed=3, std=0.1)


@pytest.fixture(scope="module")
def sparams(master):
  return {k: smp.prepare_params(master, r) for k, r in RECIPES.items()}


@pytest.fixture
def kernels_here(monkeypatch):
  """``fusable`` as on a Hopper GPU (the GEMMs on the Pallas kernels), on whatever machine runs the test; the GEMMs
  themselves run where they run (the reference on CPU)."""
  monkeypatch.setattr(fuse, "_on_kernels", lambda w, lcfg: True)


def test_nothing_fuses_off_the_kernels(sparams):
  """On XLA:CPU (the reference GEMMs: their blocking follows N) no group fuses and the sampler's params pass through
  untouched, unless the Hopper kernels run here."""
  expected = ops.resolve_backend("auto") == "pallas"
  for p in sparams.values():
    assert fuse.needs_fusing(p, LIN) == expected
    if not expected:
      assert smp.Sampler(CFG, smp.SamplerConfig()).fuse_projections(p) is p


def test_fusable_policy(sparams, master, kernels_here):
  layer = sparams["fp8"]["layers"][0]
  qkv = [layer[n] for n in ("wq", "wk", "wv")]
  assert fuse.fusable(qkv, LIN)
  assert fuse.fusable([sparams["bf16"]["layers"][0][n] for n in ("w_gate", "w_up")], LIN)
  # master weights quantized in the op, FP32 arrays, mixed kinds, rows not whole blocks, a multi-device mesh: no
  assert not fuse.fusable([quant.FP8Weight(master["layers"][0][n]) for n in ("wq", "wk")], LIN)
  assert not fuse.fusable([master["layers"][0][n] for n in ("wq", "wk")], LIN)
  assert not fuse.fusable([qkv[0], sparams["bf16"]["layers"][0]["wk"]], LIN)
  w = jnp.ones((192, CFG.dim), jnp.bfloat16)
  assert not fuse.fusable([w, w], LIN)
  assert not fuse.fusable(qkv, ops.LinearConfig(mesh=types.SimpleNamespace(size=2)))
  assert fuse.fusable(qkv, ops.LinearConfig(mesh=types.SimpleNamespace(size=1)))


def test_fused_layout(sparams, kernels_here):
  """Each layer's groups become one weight, rows in the group's order (FP8: codes and block scales alike); the rest
  of the tree is the same objects; fusing twice changes nothing."""
  p = sparams["fp8"]
  f = fuse.fuse_layers(p, LIN)
  assert f["embed"] is p["embed"] and f["lm_head"] is p["lm_head"]
  for lp, lf in zip(p["layers"], f["layers"]):
    assert set(lf) == (set(lp) - {"wq", "wk", "wv", "w_gate", "w_up"}) | {"wq+wk+wv", "w_gate+w_up"}
    assert lf["wo"] is lp["wo"] and lf["w_down"] is lp["w_down"]
    for names in (("wq", "wk", "wv"), ("w_gate", "w_up")):
      w = lf[fuse.fused_key(names)]
      np.testing.assert_array_equal(w.q, jnp.concatenate([lp[n].q for n in names]))
      np.testing.assert_array_equal(w.scale, jnp.concatenate([lp[n].scale for n in names]))
  assert not fuse.needs_fusing(f, LIN)
  assert fuse.fuse_layers(f, LIN)["layers"][0]["wq+wk+wv"] is f["layers"][0]["wq+wk+wv"]


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_forward_on_fused_params(sparams, recipe, kernels_here):
  """The model function on fused params computes the same projections: one GEMM split by columns. On XLA:CPU the
  fused GEMM's blocking may differ (N changed), so the hidden states agree to FP32 rounding of the GEMMs here; on
  Hopper they are bitwise (``test_gpu_fused_forward_bitwise``)."""
  p = sparams[recipe]
  toks = jax.random.randint(jax.random.key(1), (2, 24), 0, CFG.vocab_size)
  fwd = jax.jit(lambda params: llama.forward(params, toks, CFG)[0])
  sep, fused = fwd(p), fwd(fuse.fuse_layers(p, LIN))
  sep32, fused32 = (np.asarray(x, np.float32) for x in (sep, fused))
  assert np.all(np.isfinite(sep32)) and np.std(sep32) > 0.1
  # a wrong split (q/k/v or gate/up swapped, misplaced columns) moves the hidden states by O(1)
  np.testing.assert_allclose(fused32, sep32, atol=0.02, rtol=0.02)


def test_project_rejects_other_widths(sparams, kernels_here):
  f = fuse.fuse_layers(sparams["fp8"], LIN)
  x = jnp.ones((3, CFG.dim), jnp.bfloat16)
  with pytest.raises(ValueError, match="wq\\+wk\\+wv.*1024 output rows.*expects"):
    fuse.project(f["layers"][0], x, ("wq", "wk", "wv"), (512, 128, 256), LIN)


def test_sampler_fuses_once_and_generates(sparams, kernels_here):
  """The sampler fuses what it is given (once: fused params pass through) and decodes on the fused layout: greedy
  tokens equal those of the separate projections (margins of the std-0.1 init), log-probs to rounding."""
  p = sparams["fp8"]
  prompts = [[5, 17, 33, 2, 9], list(range(40, 54))]
  gp = smp.SamplingParams(greedy=True, max_new_tokens=8)
  fused = smp.Sampler(CFG, smp.SamplerConfig(slots=2, max_len=64, decode_chunk=4))
  sep = smp.Sampler(CFG, smp.SamplerConfig(slots=2, max_len=64, decode_chunk=4, fuse_projections=False))
  f = fused.fuse_projections(p)
  assert "wq+wk+wv" in f["layers"][0] and fused.fuse_projections(f) is f
  assert sep.fuse_projections(p) is p
  a, b = fused.generate(f, prompts, gp), sep.generate(p, prompts, gp)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 GPU (the invariant Pallas GEMMs)")
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_gpu_fused_forward_bitwise(recipe):
  """On Hopper the fused GEMMs' columns are the separate GEMMs' bit for bit: the forward (prefill-like and
  decode-like row counts) on fused params equals the forward on separate ones, at 8B widths of q/k/v and gate/up."""
  cfg = ModelConfig(vocab_size=1024, dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336)
  p = smp.prepare_params(llama.init_params(cfg, seed=5), RECIPES[recipe])
  assert fuse.needs_fusing(p, LIN)
  f = fuse.fuse_layers(p, LIN)
  for b, t in ((256, 1), (2, 384)):
    toks = jax.random.randint(jax.random.key(b), (b, t), 0, cfg.vocab_size)
    fwd = jax.jit(lambda params, toks=toks: llama.forward(params, toks, cfg)[0])
    np.testing.assert_array_equal(np.asarray(fwd(f), np.float32), np.asarray(fwd(p), np.float32))
