"""fp8jax.one_engine's checks: the sampler's arithmetic vs the trainer's, whole and block by block.

CPU: XLA:CPU's row reductions round by ~1 ulp differently with the row count, so the bound is 1 + 1e-5 (as in
test_sampler). GPU (sm_90, the Pallas GEMM and attention kernels): the design promises bits for the FP8 recipes."""

import fp8jax  # noqa: F401  (first: XLA flags)

import numpy as np
import pytest

from fp8jax import one_engine, ops

CFG = one_engine.model_config(256, 2, 512)
PROMPTS = [np.random.default_rng(i).integers(0, 512, size=8 + 5 * i).tolist() for i in range(4)]


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8+kv"])
def test_blocks_agree_cpu(recipe):
  rows = one_engine.block_divergence(CFG, one_engine.recipes()[recipe], rows=4, length=24)
  names = [r["tensor"] for r in rows]
  # every block of both layers is compared, in call order, and the head last
  assert names[:5] == ["norm[0]", "attention[0]", "norm[1]", "mlp[0]", "residual[0]"], names
  assert names[-2:] == ["norm[4]", "head log-prob"], names
  for r in rows:  # log-probs within the sampler test's 1e-5; BF16 activations within ~1 BF16 ulp of their scale
    assert r["max_abs_diff"] <= (1e-5 if r["tensor"] == "head log-prob" else 2 ** -7 * r["max_abs"]), r


def test_sampler_vs_trainer_cpu():
  m = one_engine.sampler_vs_trainer(CFG, one_engine.recipes()["fp8+kv"], PROMPTS, slots=4, samples=2, max_new=8)
  assert m["tokens"] == len(PROMPTS) * 2 * 8
  assert 1.0 <= m["token_mult_prob_error"] <= 1 + 1e-5, m


@pytest.mark.gpu
@pytest.mark.skipif(not ops.hopper_available(), reason="needs an sm_90 GPU (the Pallas kernels)")
@pytest.mark.parametrize("recipe,quantize_lm_head", [("fp8", False), ("fp8", True), ("fp8+kv", False),
                                                     ("fp8+kv", True), ("bf16", False)])
def test_blocks_bitwise_gpu(recipe, quantize_lm_head):
  """Every block's decode rows, and the head's log-prob, are bitwise the training rows."""
  rows = one_engine.block_divergence(one_engine.model_config(1024, 2, 32768),
                                     one_engine.recipes(quantize_lm_head)[recipe], rows=64, length=64)
  bad = [r for r in rows if r["rows_bitwise"] < 1]
  assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not ops.hopper_available(), reason="needs an sm_90 GPU (the Pallas kernels)")
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8+kv"])
def test_sampler_vs_trainer_exact_gpu(recipe):
  """The issue's promise at a small workload: token_mult_prob_error exactly 1.0, every log-prob bitwise."""
  cfg = one_engine.model_config(1024, 2, 32768)
  prompts = [np.random.default_rng(i).integers(0, 32768, size=8 + 3 * i).tolist() for i in range(16)]
  m = one_engine.sampler_vs_trainer(cfg, one_engine.recipes()[recipe], prompts, slots=32, samples=2, max_new=32)
  assert m["token_mult_prob_error"] == 1.0 and m["bitwise_equal_frac"] == 1.0, m
