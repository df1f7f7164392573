"""Sampling a DeepSeek-V3-style model (MLA + noaux_tc MoE) over the latent KV cache (issue 19).

The sampler's cache holds kv_lora_rank + qk_rope_head_dim values per token and layer (``ModelConfig.
kv_cache_layout``); prefill and decode run the absorbed MLA (``fp8jax.model.mla``), as the trainer does, so the
properties of tests/test_sampler.py hold with the same bounds: greedy decode == argmax of repeated full forwards
(tokens exact, log-probs to 2e-6), and the sampler's log-probs == the trainer's (bit for bit)
with BF16 or FP8 weights and a BF16 or FP8 latent cache (one FP32 scale per layer). CPU, tiny random model.
"""

import fp8jax

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import quant
from fp8jax import recipes
from fp8jax import sampler as smp
from fp8jax.model import llama
from fp8jax.model.config import ModelConfig
from fp8jax.rl import grpo

# kv_lora_rank + qk_rope_head_dim = 96 + 32 = 128 cached values per token; layer 0 dense, layer 1 MoE
CFG = ModelConfig(vocab_size=128, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=96, ffn_dim=384,
                  kv_lora_rank=96, q_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=48,
                  rope_interleave=True, rope_yarn=(4.0, 64, 32.0, 1.0, 1.0, 0.8), n_experts=8, n_experts_per_tok=2,
                  moe_ffn_dim=64, norm_topk_prob=True, moe_router="sigmoid", n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, n_shared_experts=1, mlp_only_layers=(0,))
MAX_LEN = 48
RECIPES = {"bf16": recipes.Recipe(mode="bf16"), "fp8": recipes.Recipe()}
PROMPTS = [[5, 17, 33, 2, 9], [100, 3, 64, 64, 7, 8, 21, 90, 11], list(range(40, 54))]
GREEDY = smp.SamplingParams(greedy=True, max_new_tokens=10)
SP = smp.SamplingParams(temperature=0.8, top_k=64, top_p=0.95, max_new_tokens=12, stop_token_ids=(3, 7, 11), seed=0)


@pytest.fixture(scope="module")
def master():
  p = llama.init_params(CFG, seed=0, std=0.1)  # std 0.1: peaked logits, clear greedy margins (test_sampler.py)
  p["layers"][1]["router_bias"] = 0.05 * jax.random.normal(jax.random.key(1), (CFG.n_experts,))
  return p


@functools.cache
def sampler(kv: str) -> smp.Sampler:
  return smp.Sampler(CFG, smp.SamplerConfig(slots=4, max_len=MAX_LEN, kv_cache=kv, decode_chunk=4))


@fp8jax.jit
def _full_logits(params, tokens_BxL):
  h, _, _ = llama.forward(params, tokens_BxL, CFG)
  return llama.logits(params, h, CFG)


def test_latent_cache_layout(master):
  """One latent of kv_lora_rank + qk_rope_head_dim per token and layer, no separate V; FP8: E4M3 codes."""
  assert CFG.kv_cache_layout == (1, 128, False)
  p = smp.prepare_params(master, RECIPES["bf16"])
  for kv, dtype in (("bf16", jnp.bfloat16), ("fp8", quant.FP8_DTYPE)):
    s = sampler(kv)
    lay = s.layout(1, 16, 4)  # one prompt of 16 positions (1 page), 4 new tokens: 2 own pages per slot
    cache, _ = s._prefill(p, jnp.asarray([PROMPTS[0] + [0] * 11]), jnp.ones(2), jnp.ones(2), lay, kv)
    pages = 1 + s.scfg.slots * 2
    assert lay.n_pages == pages and cache.page_table.shape == (s.scfg.slots, 3)  # 48 positions = 3 blocks
    assert [c.shape for c in cache.k] == [(pages, 16, 1, 128)] * 2 and cache.v == [] and cache.k[0].dtype == dtype
    # layers x pages x 16 positions x 128 x (1 byte FP8 | 2 bytes BF16), no V
    assert s._pool_bytes(lay) == 2 * pages * 16 * 128 * (1 if kv == "fp8" else 2)


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_greedy_latent_decode_equals_argmax_of_full_forwards(master, recipe):
  p = smp.prepare_params(master, RECIPES[recipe])
  ro = sampler("bf16").generate(p, PROMPTS, GREEDY, n=1)
  lens = np.array([len(pr) for pr in PROMPTS])
  np.testing.assert_array_equal(ro.lengths, [GREEDY.max_new_tokens] * len(PROMPTS))
  seq = np.zeros((len(PROMPTS), MAX_LEN), np.int32)
  for i, pr in enumerate(PROMPTS):
    seq[i, :len(pr)] = pr
  rows = np.arange(len(PROMPTS))
  for step in range(GREEDY.max_new_tokens):
    lg = np.asarray(_full_logits(p, jnp.asarray(seq)))[rows, lens - 1 + step]
    tok = lg.argmax(-1)
    np.testing.assert_array_equal(ro.tokens[:, step], tok, err_msg=f"step {step}")
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(lg), -1))[rows, tok]
    np.testing.assert_allclose(ro.logprobs[:, step], lp, atol=2e-6, rtol=0)
    seq[rows, lens + step] = tok


@functools.cache
def _trainer_fn(with_scales: bool):
  if with_scales:
    return fp8jax.jit(lambda p, t, s: llama.next_token_logprobs(p, t, CFG, temperature=SP.temperature,
                                                                kv_scales=s)[0])
  return fp8jax.jit(lambda p, t: llama.next_token_logprobs(p, t, CFG, temperature=SP.temperature)[0])


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_sampler_logprobs_match_trainer(master, recipe, kv):
  """Bitwise equal log-probs between the latent-cache sampler and the trainer's full forward (mark_fp8
  master params); with an FP8 latent cache the trainer applies the same per-layer quantization (kv_scales)."""
  p = smp.prepare_params(master, RECIPES[recipe])
  s = sampler(kv)
  scales = s.calibrate_kv_scales(p, PROMPTS, margin=1.25) if kv == "fp8" else None
  ro = s.generate(p, PROMPTS, SP, n=2, kv_scales=scales)
  seq, mask, old = ro.sequences()
  tp = recipes.mark_fp8(master, RECIPES[recipe])
  fn = _trainer_fn(scales is not None)
  lp = fn(tp, jnp.asarray(seq), scales) if scales is not None else fn(tp, jnp.asarray(seq))
  m = {k: float(v) for k, v in grpo.mismatch_metrics(jnp.asarray(old), lp, jnp.asarray(mask)).items()}
  print(f"\n{recipe} weights, {kv} latent cache: {m}")
  assert m["nonfinite_tokens"] == 0 and mask.sum() > 20
  assert m["token_mult_prob_error"] == 1.0 and m["max_abs_logp_diff"] == 0.0, m
