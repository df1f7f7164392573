"""The Qwen3-MoE block (fp8jax.model.moe) against transformers' Qwen3MoeForCausalLM, and its one-engine properties.

The torch model is built in memory with random weights (a few experts, one dense layer via mlp_only_layers), saved
with save_pretrained and read by fp8jax's importer (fp8jax.hf; tests/test_hf_moe.py tests it on its own). CPU only.
"""

import copy
import dataclasses

import fp8jax  # noqa: F401  (before any JAX computation)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import backends, hf, ops, recipes
from fp8jax.model import llama, moe, schema
from fp8jax.model.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

E, K_TOP, D, F_MOE, F_DENSE, V, L = 8, 2, 256, 128, 256, 192, 3
CFG = ModelConfig(vocab_size=V, dim=D, n_layers=L, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=F_DENSE,
                  norm_eps=1e-6, rope_theta=1e6, qk_norm=True, n_experts=E, n_experts_per_tok=K_TOP,
                  moe_ffn_dim=F_MOE, norm_topk_prob=True, mlp_only_layers=(1,))
BF16 = recipes.Recipe(mode="bf16", gemm_backend="xla")
FP8 = recipes.Recipe(mode="fp8", gemm_backend="xla")


@pytest.fixture(scope="module")
def torch_model():
  c = transformers.Qwen3MoeConfig(
      vocab_size=V, hidden_size=D, intermediate_size=F_DENSE, moe_intermediate_size=F_MOE, num_hidden_layers=L,
      num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=E, num_experts_per_tok=K_TOP,
      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, initializer_range=0.05)
  torch.manual_seed(0)
  m = transformers.Qwen3MoeForCausalLM(c).eval()
  with torch.no_grad():  # norms start at ones and the router at zeros: randomize both so a swap would show
    for name, p in m.named_parameters():
      if p.ndim == 1:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("mlp.gate.weight"):
        p.copy_(0.5 * torch.randn_like(p))
  return m


@pytest.fixture(scope="module")
def params(torch_model, tmp_path_factory):
  d = str(tmp_path_factory.mktemp("moe_hf"))
  torch_model.save_pretrained(d)
  assert dataclasses.replace(hf.load_config(d), max_seq_len=CFG.max_seq_len) == CFG  # the same model, read back
  return hf.load_params(d, CFG)


def _tokens(b=2, t=24, seed=0):
  return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


@fp8jax.jit
def _logits(p, toks):
  h, _, aux = llama.forward(p, toks, CFG)
  return llama.logits(p, h, CFG), aux


def _torch_logits(m, toks, dtype):
  m = copy.deepcopy(m).to(dtype)  # a copy: casting the shared model to BF16 and back would round its weights
  with torch.no_grad():
    out = m(torch.as_tensor(toks, dtype=torch.long), output_router_logits=True)
  return out.logits.float().numpy(), float(out.aux_loss)


def test_schema_of_a_moe_config():
  shapes = schema.param_shapes(CFG)
  assert [("router" in s, "w_gate" in s) for s in shapes["layers"]] == [(True, False), (False, True), (True, False)]
  assert shapes["layers"][0]["expert_gate"] == (E, F_MOE, D) and shapes["layers"][0]["expert_down"] == (E, D, F_MOE)
  assert "router" not in recipes.LINEAR_NAMES and {"expert_gate", "expert_up", "expert_down"} <= set(recipes.LINEAR_NAMES)
  dense = 2 * V * D + D
  attn = 2 * D * 256 + 2 * D * 128 + 2 * 64 + 2 * D
  expect = dense + L * attn + 2 * (E * D + 3 * E * F_MOE * D) + 3 * D * F_DENSE
  assert schema.num_params(CFG) == expect


def test_bf16_logits_match_transformers(torch_model, params):
  """BF16 recipe vs transformers in float32, measured against BF16's own noise (transformers in bfloat16).

  Routing adds a hazard dense layers lack: a token whose k-th and (k+1)-th router probabilities nearly tie may pick
  another expert under BF16 rounding (in either implementation), so the bound is on the mean error relative to the
  BF16 yardstick (1.5x) and on top-1 agreement; the max error is bounded only loosely (1/8 of max |logit|).
  """
  toks = _tokens()
  ref, aux_ref = _torch_logits(torch_model, toks, torch.float32)
  tbf, _ = _torch_logits(torch_model, toks, torch.bfloat16)
  got, aux = _logits(params, toks)
  got = np.asarray(got)
  err, yard = np.abs(got - ref), np.abs(tbf - ref)
  assert err.mean() <= 1.5 * yard.mean() + 1e-6, (err.mean(), yard.mean())
  assert err.max() <= 0.125 * np.abs(ref).max(), (err.max(), np.abs(ref).max())
  assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.95
  # the routing statistics give transformers' Switch load-balancing loss
  lb = float(moe.load_balancing_loss(list(aux.router), E))
  assert abs(lb - aux_ref) <= 0.02 * aux_ref, (lb, aux_ref)
  assert len(aux.router) == 2 and aux.router[0].expert_ids_BxTxK.shape == (2, 24, K_TOP)


def test_fp8_close_to_bf16_and_one_engine(params):
  """FP8 experts (block FP8, router BF16) stay near BF16; the training (FP8Weight) and sampling (QWeight) forms of
  the FP8 model give the same bits."""
  toks = _tokens(seed=1)
  lb, _ = _logits(params, toks)
  l8, _ = _logits(recipes.mark_fp8(params, FP8), toks)
  lq, _ = _logits(recipes.quantize_params(params, FP8), toks)
  np.testing.assert_array_equal(np.asarray(l8), np.asarray(lq))
  lb_c = np.asarray(lb) - np.asarray(lb).mean(-1, keepdims=True)
  l8_c = np.asarray(l8) - np.asarray(l8).mean(-1, keepdims=True)
  rel = np.linalg.norm(l8_c - lb_c) / np.linalg.norm(lb_c)
  assert 0 < rel < 0.15, rel  # the dense model's bound (tests/test_model.py) plus routing flips
  assert isinstance(recipes.quantize_params(params, FP8)["layers"][0]["router"], jax.Array)  # router kept BF16


def test_rows_do_not_depend_on_the_rest_of_the_batch(params):
  """Sorting tokens by expert mixes the batch; a sequence's outputs must not depend on its neighbours (the sampler
  decodes rows in batches that the trainer never sees)."""
  qp = recipes.quantize_params(params, FP8)
  toks = _tokens(b=32, t=16, seed=2)  # 512 tokens: as many as training routes (XLA:CPU compiles per row count)
  full, _ = _logits(qp, toks)
  alone, _ = _logits(qp, toks[2:3])
  np.testing.assert_array_equal(np.asarray(full)[2:3], np.asarray(alone))


def test_routing_rows_do_not_depend_on_the_token_count(params):
  """A decode step routes a few rows, training hundreds: each token's probabilities, choice and weights must be the
  same bits either way. (With jax.nn.softmax, XLA:CPU rounded the same row differently among 4 rows than among 512:
  the exp fused after the row max compiles per shape; moe._softmax has no reduce.) And they are the softmax."""
  p = params["layers"][0]
  x = jnp.asarray(np.random.default_rng(6).standard_normal((512, D)), jnp.bfloat16)
  route = fp8jax.jit(lambda x: moe.route(p, x, CFG, ops.LinearConfig()))
  full = jax.tree.map(np.asarray, route(x))
  for m in (1, 4, 100):
    for name, got, want in zip(("weights", "experts", "probabilities"), route(x[:m]), full):
      np.testing.assert_array_equal(np.asarray(got), want[:m], err_msg=f"{name}, {m} rows")
  logits = ops.linear(x, p["router"], ops.LinearConfig()).astype(jnp.float32)
  np.testing.assert_allclose(full[2], np.asarray(jax.nn.softmax(logits, axis=-1)), rtol=2e-6, atol=1e-7)


def test_gradients_reach_router_and_experts(params):
  toks = _tokens(seed=3)

  def loss(p):
    h, _, aux = llama.forward(p, toks, CFG)
    lp = jax.nn.log_softmax(llama.logits(p, h, CFG)[:, :-1], axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1))
    return nll + 0.01 * moe.load_balancing_loss(list(aux.router), E)

  g = fp8jax.jit(jax.grad(loss))(recipes.mark_fp8(params, FP8))
  g0 = g["layers"][0]
  for key in ("router", "expert_gate", "expert_up", "expert_down", "wq"):
    arr = np.asarray(getattr(g0[key], "w", g0[key]))
    assert np.all(np.isfinite(arr)) and np.abs(arr).max() > 0, key


def test_config_errors_name_the_key():
  base = dict(vocab_size=V, dim=D, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256)
  with pytest.raises(ValueError, match=r"model\.n_experts_per_tok=3 must be in \[1, model\.n_experts=2\]"):
    ModelConfig(**base, n_experts=2, n_experts_per_tok=3, moe_ffn_dim=128)
  with pytest.raises(ValueError, match=r"model\.moe_ffn_dim must be > 0"):
    ModelConfig(**base, n_experts=2, n_experts_per_tok=1)
  with pytest.raises(ValueError, match=r"model\.mlp_only_layers=\(5,\)"):
    ModelConfig(**base, n_experts=2, n_experts_per_tok=1, moe_ffn_dim=128, mlp_only_layers=(5,))


def _sampler_vs_trainer(params, rec, kv):
  """The mismatch metrics of the sampler's log-probs against the trainer's on a few prompts (2 samples each)."""
  from fp8jax import sampler as smp  # noqa: PLC0415
  from fp8jax.rl import grpo  # noqa: PLC0415

  prompts = [[5, 17, 33, 2, 9], [100, 3, 64, 64, 7, 8, 21, 90, 11], list(range(40, 54))]
  sp = smp.SamplingParams(temperature=0.8, max_new_tokens=10, seed=0)
  s = smp.Sampler(CFG, smp.SamplerConfig(slots=4, max_len=32, kv_cache=kv, decode_chunk=4))
  sparams = smp.prepare_params(params, rec)
  scales = s.calibrate_kv_scales(sparams, prompts, margin=1.25) if kv == "fp8" else None
  ro = s.generate(sparams, prompts, sp, n=2, kv_scales=scales)
  seq, mask, old = ro.sequences()
  train = fp8jax.jit(lambda p, t, sc: llama.next_token_logprobs(p, t, CFG, temperature=sp.temperature,
                                                                kv_scales=sc)[0])
  lp = train(recipes.mark_fp8(params, rec), jnp.asarray(seq), scales)
  return grpo.mismatch_metrics(jnp.asarray(old), lp, jnp.asarray(mask))


@pytest.mark.parametrize("recipe,kv", [("fp8", "bf16"), ("fp8", "fp8"), ("bf16", "bf16")])
def test_sampler_logprobs_equal_trainer_logprobs(params, recipe, kv):
  """One engine with MoE layers: the sampler's log-probs (QWeight experts, KV cache, decode batches that mix
  sequences) are the trainer's (FP8Weight, full sequences) on CPU, bit for bit, with a BF16 or an FP8 KV cache.
  (BF16 experts were an xfail until 2026-12-02: an FP32-ulp row difference upstream, from XLA:CPU's whole-array
  RMSNorm and head reductions, flipped a router near-tie; both now run in fixed row tiles on CPU.)"""
  m = _sampler_vs_trainer(params, FP8 if recipe == "fp8" else BF16, kv)
  assert float(m["nonfinite_tokens"]) == 0 and float(m["max_abs_logp_diff"]) == 0.0, m
  assert float(m["token_mult_prob_error"]) == 1.0, m


@pytest.mark.gpu
@pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 (Hopper) GPU")
def test_gpu_moe_on_the_kernels(params):
  """The MoE model on the Hopper kernels (grouped FP8 GEMM on the tile layout, whose unused tiles hold unspecified
  rows; "auto" resolves every backend to the kernels): a MoE block near the XLA GEMMs' on the tokens routed alike,
  finite logits and expert gradients."""
  toks = _tokens(seed=4)
  qp = recipes.quantize_params(params, FP8)
  # The kernels accumulate in another order than XLA's GEMMs, so a BF16 router logit can round the other way and flip
  # a near-tie; downstream of a flip the token's output is another expert mix (seen on the H200: the whole-model
  # logits 0.064 apart, and only 0.23 of positions with no flip in their causal past). So the values are compared per
  # MoE block on one input, token by token where both paths chose the same experts; the model runs end to end.
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 64, D)), jnp.bfloat16)
  block = fp8jax.jit(lambda p, x, lcfg: moe.moe(p, x, CFG, lcfg), static_argnums=2)
  (yk, sk), (yr, sr) = (jax.tree.map(np.asarray, block(qp["layers"][0], x, ops.LinearConfig(backend=b)))
                        for b in ("pallas", "xla"))
  same = np.all(sk.expert_ids_BxTxK == sr.expert_ids_BxTxK, axis=-1)
  assert same.mean() >= 0.8, f"the same experts for only {same.mean():.2f} of tokens"
  yk, yr = yk.astype(np.float32)[same], yr.astype(np.float32)[same]
  assert np.isfinite(yk).all() and np.linalg.norm(yk - yr) / np.linalg.norm(yr) < 0.01, same.mean()

  fwd = fp8jax.jit(lambda p, t, lcfg: llama.logits(p, llama.forward(p, t, CFG, lcfg)[0], CFG, lcfg),
                   static_argnums=2)
  lk = np.asarray(fwd(qp, toks, ops.LinearConfig(backend="pallas")), np.float32)
  assert np.isfinite(lk).all() and lk.std() > 0

  def loss(p):
    h, _, _ = llama.forward(p, toks, CFG)
    lp = jax.nn.log_softmax(llama.logits(p, h, CFG)[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1))

  g = fp8jax.jit(jax.grad(loss))(recipes.mark_fp8(params, FP8))["layers"][0]
  for key in ("expert_gate", "expert_up", "expert_down"):
    arr = np.asarray(g[key].w)
    assert np.all(np.isfinite(arr)) and np.abs(arr).max() > 0, key


@pytest.mark.gpu
@pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.xfail(strict=True, reason="H200, 2026-12-02: max |dlp| 9.5e-7 (token_mult_prob_error 1.0000002). Not MoE: "
                   "dense models are 1 ulp off alike when the decode step runs few rows (8 slots: off with or without "
                   "refills; 32 slots: exact, 2026-12-03); here 4 slots. Exact on CPU (docs/performance.md)")
def test_gpu_moe_sampler_equals_trainer(params):
  m = _sampler_vs_trainer(params, FP8, "fp8")
  assert float(m["nonfinite_tokens"]) == 0 and float(m["max_abs_logp_diff"]) == 0.0, m
