"""DeepSeek-V3 / Moonlight (issue 19): multi-head latent attention, the DeepSeek-V3 MoE, the latent KV cache and
HF import/export, against transformers' DeepseekV3ForCausalLM.

The HF models are tiny random DeepseekV3ForCausalLM built by transformers and written with save_pretrained into a
temporary directory (nothing is downloaded). Their dims are chosen so that the awkward cases of the real model
occur: kv_a's kv_lora_rank + qk_rope_head_dim = 128 + 32 = 160 outputs (Moonlight: 512 + 64 = 576) and o_proj's
n_heads x v_head_dim = 192 inputs are not multiples of 128, v_head_dim (48) differs from the q/k head dim (96),
YaRN with mscale != mscale_all_dim (so both the cos/sin attention factor and the softmax mscale are not 1), groups
of experts with the correction bias randomized (so noaux_tc's group limit and bias change the choice). CPU only.
"""

import copy
import functools
import json
import os
import shutil

import fp8jax  # noqa: F401  (before any JAX computation)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8jax import hf, recipes
from fp8jax.model import llama, mla, moe, schema
from fp8jax.model.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import _st  # noqa: E402  (tests/ is on sys.path under pytest)

V, D, H, L = 256, 256, 4, 2
E, K_TOP, F_MOE, F_DENSE = 8, 2, 64, 384
RANK, ROPE, NOPE, VD, QLORA = 128, 32, 64, 48, 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
# variant -> (q_lora_rank, rope_parameters, first_k_dense_replace)
VARIANTS = {"qlora_yarn_moe": (QLORA, YARN, 1), "plain_rope_moe": (None, {"rope_type": "default",
                                                                          "rope_theta": 10000.0}, 1),
            "dense_mla": (QLORA, YARN, L)}
BF16 = recipes.Recipe(mode="bf16", gemm_backend="xla")
FP8 = recipes.Recipe(mode="fp8", gemm_backend="xla")
WEIGHTS = "model.safetensors"


def make_hf_model(q_lora_rank, rope_parameters, first_k_dense_replace, seed=0):
  c = transformers.DeepseekV3Config(
      vocab_size=V, hidden_size=D, intermediate_size=F_DENSE, moe_intermediate_size=F_MOE, num_hidden_layers=L,
      num_attention_heads=H, num_key_value_heads=H, n_shared_experts=1, n_routed_experts=E,
      routed_scaling_factor=2.5, kv_lora_rank=RANK, q_lora_rank=q_lora_rank, qk_rope_head_dim=ROPE,
      v_head_dim=VD, qk_nope_head_dim=NOPE, n_group=4, topk_group=2, num_experts_per_tok=K_TOP,
      first_k_dense_replace=first_k_dense_replace, max_position_embeddings=256, rope_parameters=rope_parameters,
      initializer_range=0.05, rms_norm_eps=1e-5, tie_word_embeddings=False)
  torch.manual_seed(seed)
  m = transformers.DeepseekV3ForCausalLM(c).eval()
  with torch.no_grad():  # norms start at ones, routers and the bias at zeros: randomize them so a swap would show
    for name, p in m.named_parameters():
      if p.ndim == 1:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("mlp.gate.weight"):
        p.copy_(0.5 * torch.randn_like(p))
    for name, b in m.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn_like(b))
  return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """variant -> (torch model, HF dir, fp8jax config, fp8jax params)."""
  out = {}
  for name, args in VARIANTS.items():
    m = make_hf_model(*args)
    d = str(tmp_path_factory.mktemp(name))
    m.save_pretrained(d)
    cfg = hf.load_config(d)
    out[name] = (m, d, cfg, hf.load_params(d, cfg))
  return out


def _tokens(b=2, t=32, seed=0):
  return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


def _torch_logits(hf_dir, toks, dtype=torch.float32):
  """transformers' logits of a saved model. Loaded, not cast with .to(dtype): a cast would round the RoPE inv_freq
  and the router's e_score_correction_bias buffers to BF16 too, which from_pretrained keeps FP32."""
  m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
  with torch.no_grad():
    return m(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()


@functools.cache
def _logits_fn(cfg: ModelConfig):
  return fp8jax.jit(lambda p, t: llama.logits(p, llama.forward(p, t, cfg)[0], cfg))


def _logits(params, cfg, toks):
  return np.asarray(_logits_fn(cfg)(params, toks))


# ------------------------------------------------------------------------------------------------------------------
# Config and schema
# ------------------------------------------------------------------------------------------------------------------


def test_config_and_schema(models):
  _, d, cfg, params = models["qlora_yarn_moe"]
  assert cfg == ModelConfig(
      vocab_size=V, dim=D, n_layers=L, n_heads=H, n_kv_heads=H, head_dim=NOPE + ROPE, ffn_dim=F_DENSE,
      norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, n_experts=E, n_experts_per_tok=K_TOP, moe_ffn_dim=F_MOE,
      norm_topk_prob=True, mlp_only_layers=(0,), moe_router="sigmoid", n_group=4, topk_group=2,
      routed_scaling_factor=2.5, n_shared_experts=1, kv_lora_rank=RANK, q_lora_rank=QLORA, qk_nope_head_dim=NOPE,
      qk_rope_head_dim=ROPE, v_head_dim=VD, rope_interleave=True, rope_yarn=(4.0, 64, 32.0, 1.0, 1.0, 0.8))
  assert models["plain_rope_moe"][2].q_lora_rank == 0 and models["plain_rope_moe"][2].rope_yarn is None
  # what save_pretrained wrote is exactly the schema's names and shapes (router bias included, FP32 on disk)
  header = _st(os.path.join(d, WEIGHTS))
  assert {k: tuple(v["shape"]) for k, v in header.items()} == dict(hf.hf_param_names(cfg).values())
  assert header["model.layers.1.mlp.gate.e_score_correction_bias"]["shape"] == [E]
  m = models["qlora_yarn_moe"][0]
  np.testing.assert_array_equal(np.asarray(params["layers"][1]["router_bias"]),
                                m.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
  assert {"wkv_a", "wkv_b", "kv_a_norm", "wq_a", "wq_b", "q_a_norm"} <= set(params["layers"][0])
  assert "wq" in models["plain_rope_moe"][3]["layers"][0] and "wk" not in params["layers"][0]
  assert "wkv_b" not in recipes.LINEAR_NAMES and {"wkv_a", "wq_a", "wq_b", "shared_gate"} <= set(recipes.LINEAR_NAMES)
  assert "router_bias" not in recipes.LINEAR_NAMES
  # the FP8 recipe quantizes the ragged kv_a (160 x 256: a zero-padded last row tile) and o_proj (256 x 192)
  qp = recipes.quantize_params(params, FP8)
  assert qp["layers"][0]["wkv_a"].scale.shape == (2, 2) and qp["layers"][0]["wo"].scale.shape == (2, 2)
  assert "kv_lora_rank + qk_rope_head_dim=160" in " ".join(cfg.fp8_shape_problems())


# ------------------------------------------------------------------------------------------------------------------
# Logits vs transformers
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_logits_match_transformers(models, variant):
  """fp8jax's BF16 recipe vs transformers in float32, measured against BF16's own noise: transformers in bfloat16
  on the same weights (fp8jax's GEMMs take BF16 operands, so FP32 agreement is not on offer).

  fp8jax runs MLA absorbed (W_UK folded into q, W_UV after attention) where transformers expands K and V: equal in
  exact arithmetic, different BF16 roundings. Bounds: mean |error| <= 1.5x the yardstick's, top-1 agreement within
  3 of 64 tokens of the yardstick's; max |error| <= 1.5x the yardstick's max where no routing exists (dense_mla),
  else max(1.5x the yardstick's, 1/8 max |logit|): a token whose k-th and (k+1)-th expert nearly tie may pick
  another expert under BF16 rounding in either implementation (tests/test_moe.py). Measured (2026-12-01):
  err mean 0.009-0.016 vs yardstick 0.009-0.018, max 0.05-1.37 vs 0.05-1.40."""
  _, d, cfg, params = models[variant]
  toks = _tokens()
  ref, tbf = _torch_logits(d, toks), _torch_logits(d, toks, torch.bfloat16)
  got = _logits(params, cfg, toks)
  err, yard = np.abs(got - ref), np.abs(tbf - ref)
  assert err.mean() <= 1.5 * yard.mean() + 1e-6, (err.mean(), yard.mean())
  routed = variant != "dense_mla"
  assert err.max() <= max(1.5 * yard.max(), 0.125 * np.abs(ref).max() if routed else 0), (err.max(), yard.max())
  top1 = lambda x: np.mean(x.argmax(-1) == ref.argmax(-1))  # noqa: E731
  assert top1(got) >= min(0.95, top1(tbf)) - 0.05, (top1(got), top1(tbf))


@pytest.mark.parametrize("variant,bound", [("dense_mla", 0.15), ("qlora_yarn_moe", 0.25)])
def test_fp8_close_to_bf16_and_one_engine(models, variant, bound):
  """The FP8 recipe (every recipe linear FP8, the ragged kv_a and o_proj included; router and kv_b BF16) stays near
  BF16, and its training (FP8Weight) and sampling (QWeight) forms give the same bits.

  Bounds on the relative Frobenius error of the centred logits, as tests/test_model.py's (0.1 for its dense model):
  0.15 without routing, as MLA's query runs two FP8 GEMMs in series (q_a, q_b) before the scores; 0.25 with the
  noaux_tc MoE, whose group limit and bias flip more choices between near-tied experts than a plain top-k (measured
  2026-12-01: 0.117 and 0.179; keeping the MLA projections BF16 as the Moonlight recipe does: 0.099 and 0.126)."""
  _, _, cfg, params = models[variant]
  toks = _tokens(seed=1)
  lb = _logits(params, cfg, toks)
  l8 = _logits(recipes.mark_fp8(params, FP8), cfg, toks)
  lq = _logits(recipes.quantize_params(params, FP8), cfg, toks)
  np.testing.assert_array_equal(l8, lq)
  c = lambda x: x - x.mean(-1, keepdims=True)  # noqa: E731
  rel = np.linalg.norm(c(l8) - c(lb)) / np.linalg.norm(c(lb))
  assert 0 < rel < bound, rel


def test_router_matches_transformers(models):
  """noaux_tc routing (sigmoid, correction bias, group limit, renormalization, scaling) == DeepseekV3TopkRouter on
  BF16-representable inputs: the same experts for every token, the same weights to FP32 rounding."""
  m, _, cfg, params = models["qlora_yarn_moe"]
  gate = m.model.layers[1].mlp.gate
  x = jnp.asarray(np.random.default_rng(3).normal(size=(256, D)), jnp.bfloat16)
  p = {"router": params["layers"][1]["router"].astype(jnp.bfloat16), "router_bias": params["layers"][1]["router_bias"]}
  w, ids, probs = moe.route(p, x, cfg, fp8jax.ops.LinearConfig(out_dtype="bfloat16"))
  g = copy.deepcopy(gate)
  with torch.no_grad():
    g.weight.copy_(torch.as_tensor(np.asarray(p["router"], np.float32)))
    _, tw, ti = g(torch.as_tensor(np.asarray(x, np.float32)))
  order = np.argsort(ti.numpy(), -1)
  ti_s, tw_s = np.take_along_axis(ti.numpy(), order, -1), np.take_along_axis(tw.numpy(), order, -1)
  order = np.argsort(np.asarray(ids), -1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1), ti_s)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), tw_s, rtol=1e-5)
  assert w.dtype == jnp.float32 and np.allclose(np.asarray(probs).sum(-1), 1, atol=1e-5)
  # the group limit and the bias matter here: without them some tokens would choose other experts
  free = np.argsort(-(jax.nn.sigmoid(x.astype(jnp.float32) @ p["router"].astype(jnp.float32).T)), -1)[:, :K_TOP]
  assert not np.array_equal(np.sort(np.asarray(free), -1), ti_s)


def test_gradients_reach_mla_and_experts_not_the_bias(models):
  _, _, cfg, params = models["qlora_yarn_moe"]
  toks = _tokens(seed=2)

  def loss(p):
    lp, _, _ = llama.next_token_logprobs(p, toks, cfg)
    return -jnp.mean(lp)

  g = jax.jit(jax.grad(loss))(recipes.mark_fp8(params, FP8))
  g0, g1 = g["layers"][0], g["layers"][1]
  for key in ("wq_a", "wq_b", "q_a_norm", "wkv_a", "kv_a_norm", "wkv_b", "wo"):
    arr = np.asarray(getattr(g0[key], "w", g0[key]))
    assert np.all(np.isfinite(arr)) and np.abs(arr).max() > 0, key
  for key in ("router", "expert_gate", "shared_down"):
    assert np.abs(np.asarray(getattr(g1[key], "w", g1[key]))).max() > 0, key
  assert np.all(np.asarray(g1["router_bias"]) == 0)  # a load-balancing buffer, not trained by the loss


def test_weight_decay_leaves_the_router_bias_alone(models):
  """The router bias is a buffer (zero gradient, above): AdamW's decay must not shrink it either. schema.decay_mask
  excludes it; a dense model needs no mask at all."""
  from fp8jax.rl import learner  # noqa: PLC0415

  _, _, cfg, params = models["qlora_yarn_moe"]
  mask = schema.decay_mask(cfg)
  assert mask["layers"][1]["router_bias"] is False and mask["layers"][1]["router"] is True
  assert schema.decay_mask(ModelConfig(vocab_size=128, dim=128, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64,
                                       ffn_dim=256)) is None
  grads = jax.tree.map(jnp.ones_like, params)
  grads["layers"][1]["router_bias"] = jnp.zeros_like(params["layers"][1]["router_bias"])
  oc = learner.OptimConfig(lr=1e-2, weight_decay=0.1)
  bias = params["layers"][1]["router_bias"]
  assert np.abs(np.asarray(bias)).max() > 0  # the imported checkpoint's bias, not zeros
  for m, kept in ((mask, True), (None, False)):
    tx, _ = learner.make_optimizer(oc, 10, m)
    new = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    assert np.array_equal(np.asarray(new["layers"][1]["router_bias"]), np.asarray(bias)) == kept
    assert not np.array_equal(np.asarray(new["layers"][1]["router"]), np.asarray(params["layers"][1]["router"]))


# ------------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------------


def test_export_bf16_reloads_in_transformers(models, tmp_path):
  """The BF16 export is the checkpoint in BF16 (the router bias FP32, as transformers keeps it): transformers'
  logits equal (bitwise) the source model run in bf16, and fp8jax reads it back to the same config and params."""
  _, src, cfg, params = models["qlora_yarn_moe"]
  out = str(tmp_path / "bf16")
  hf.export_bf16(params, cfg, out)
  header = _st(os.path.join(out, WEIGHTS))
  assert header.keys() == _st(os.path.join(src, WEIGHTS)).keys()
  assert header["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
  toks = _tokens(seed=1)
  np.testing.assert_array_equal(_torch_logits(out, toks, torch.bfloat16), _torch_logits(src, toks, torch.bfloat16))
  assert hf.load_config(out) == cfg
  back = hf.load_params(out, cfg)
  want = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
  want["layers"][1]["router_bias"] = params["layers"][1]["router_bias"]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, want)


@pytest.mark.parametrize("ragged_fp8", [False, True])
def test_export_fp8_convention(models, tmp_path, ragged_fp8):
  """Block-FP8 export: the aligned recipe linears (layer 0's dense MLP here) E4M3 + weight_scale_inv; the ragged ones
  (kv_a's 160 = 128 + 32 outputs, o_proj's 192 inputs, the tiny model's 64-wide q LoRA and experts) BF16 and listed
  in modules_to_not_convert (transformers misreads ragged scale grids) unless ragged_fp8; kv_b is listed always (an
  nn.Linear to transformers, never FP8 in fp8jax); the router bias stays FP32. Reading the directory back
  requantizes to exactly the same codes and scales, ragged blocks included (fp8jax reads its ceil-sized grids)."""
  _, _, cfg, params = models["qlora_yarn_moe"]
  out = str(tmp_path / "fp8")
  qc = hf.export_fp8(params, cfg, FP8, out, ragged_fp8=ragged_fp8)
  kept = set(qc["modules_to_not_convert"])
  ragged = {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"}
  for i in range(L):
    assert f"model.layers.{i}.self_attn.kv_b_proj" in kept
    assert all((f"model.layers.{i}.{m}" in kept) == (not ragged_fp8) for m in ragged), kept
  assert ("model.layers.1.mlp.experts" in kept) == (not ragged_fp8)
  header = {k: (v["dtype"], tuple(v["shape"])) for k, v in _st(os.path.join(out, WEIGHTS)).items()}
  assert header["model.layers.0.mlp.gate_proj.weight"] == ("F8_E4M3", (F_DENSE, D))
  assert header["model.layers.0.mlp.gate_proj.weight_scale_inv"] == ("F32", (3, 2))
  kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
  assert header[kv_a] == (("F8_E4M3" if ragged_fp8 else "BF16"), (RANK + ROPE, D))
  if ragged_fp8:
    assert header[kv_a + "_scale_inv"] == ("F32", (2, 2))  # ceil(160 / 128) x ceil(256 / 128)
  assert header["model.layers.1.mlp.gate.e_score_correction_bias"] == ("F32", (E,))
  assert header["model.layers.0.self_attn.kv_b_proj.weight"][0] == "BF16"
  qparams = recipes.quantize_params(params, FP8)
  back = recipes.quantize_params(hf.load_params(out, hf.load_config(out)), FP8)
  for layer, key in ((0, "w_gate"), (0, "wkv_a"), (1, "shared_up"), (1, "expert_down")):
    a, b = back["layers"][layer][key], qparams["layers"][layer][key]
    if ragged_fp8 or key == "w_gate":
      np.testing.assert_array_equal(np.asarray(a.q).view(np.uint8), np.asarray(b.q).view(np.uint8))
      np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
  np.testing.assert_array_equal(np.asarray(back["layers"][1]["router_bias"]),
                                np.asarray(params["layers"][1]["router_bias"]))


# ------------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value,match", [
    ("topk_method", "greedy", r"key 'topk_method' = 'greedy' is not supported"),
    ("scoring_func", "softmax", r"key 'scoring_func' = 'softmax' is not supported"),
    ("rope_parameters", dict(YARN, attention_factor=1.2), r"key 'rope_parameters.attention_factor'"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, r"'rope_parameters.rope_type'"),
    ("n_group", 3, r"config.json: model.n_group=3 must be >= 1 and divide model.n_experts=8"),
])
def test_bad_config_names_the_key(models, tmp_path, key, value, match):
  src = models["qlora_yarn_moe"][1]
  d = tmp_path / "m"
  shutil.copytree(src, d)
  c = json.load(open(d / "config.json"))
  c[key] = value
  json.dump(c, open(d / "config.json", "w"))
  with pytest.raises(hf.HFCheckpointError, match=match):
    hf.load_config(str(d))


def test_model_config_errors_name_the_key():
  base = dict(vocab_size=V, dim=D, n_layers=2, n_heads=H, n_kv_heads=H, head_dim=96, ffn_dim=256, kv_lora_rank=RANK,
              qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VD)
  ModelConfig(**base)
  with pytest.raises(ValueError, match=r"model\.head_dim=64 must be qk_nope_head_dim \+ qk_rope_head_dim = 96"):
    ModelConfig(**dict(base, head_dim=64))
  with pytest.raises(ValueError, match=r"model\.n_kv_heads=2 must equal model\.n_heads=4"):
    ModelConfig(**dict(base, n_kv_heads=2))
  with pytest.raises(ValueError, match=r"model\.rope_yarn is implemented for MLA only"):
    ModelConfig(vocab_size=V, dim=D, n_layers=2, n_heads=H, n_kv_heads=H, head_dim=64, ffn_dim=256,
                rope_yarn=(4.0, 64, 32.0, 1.0, 1.0, 1.0))
  with pytest.raises(ValueError, match=r"model\.topk_group=3 must be in \[1, model\.n_group=2\]"):
    ModelConfig(**base, n_experts=8, n_experts_per_tok=2, moe_ffn_dim=64, moe_router="sigmoid", n_group=2,
                topk_group=3)
  with pytest.raises(ValueError, match=r"model\.moe_router must be"):
    ModelConfig(**base, n_experts=8, n_experts_per_tok=2, moe_ffn_dim=64, moe_router="topk")
  assert mla.softmax_scale(ModelConfig(**base)) == pytest.approx(96 ** -0.5)


# ------------------------------------------------------------------------------------------------------------------
# The Moonlight recipes
# ------------------------------------------------------------------------------------------------------------------

# moonshotai/Moonlight-16B-A3B's config.json (the keys fp8jax reads, as the Hub has them; transformers 4.x names)
MOONLIGHT_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0, "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
    "num_nextn_predict_layers": 0}


def _moonlight_count(c: dict) -> int:
  """Parameters of a DeepseekV3 config by hand (no q LoRA), the router bias included."""
  d, h, r = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
  qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
  attn = (h * qk * d + (r + c["qk_rope_head_dim"]) * d + r + h * (c["qk_nope_head_dim"] + c["v_head_dim"]) * r
          + d * h * c["v_head_dim"] + 2 * d)  # q, kv_a, kv_a_norm, kv_b, o, the two layer norms
  e, f = c["n_routed_experts"], c["moe_intermediate_size"]
  moe_mlp = e * d + e + 3 * e * f * d + 3 * c["n_shared_experts"] * f * d  # router, bias, experts, shared
  k = c["first_k_dense_replace"]
  n_l = c["num_hidden_layers"]
  return 2 * c["vocab_size"] * d + d + n_l * attn + k * 3 * d * c["intermediate_size"] + (n_l - k) * moe_mlp


def test_moonlight_recipes_are_the_real_model(tmp_path):
  """Both recipes' model is Moonlight-16B-A3B's Hub config.json (read by hf.load_config), with the parameter count
  of the HF config arithmetic (15,960,110,208) and of transformers' DeepseekV3ForCausalLM built from the config
  fp8jax exports (meta device; its router bias is a buffer); NeMo RL's GRPO settings; MLA projections kept BF16."""
  import dataclasses  # noqa: PLC0415

  from configs import moonlight16b_bf16, moonlight16b_fp8  # noqa: PLC0415

  c8, cb = moonlight16b_fp8.get_config(), moonlight16b_bf16.get_config()
  assert (c8.fp8.mode, c8.fp8.gemm_backend, cb.fp8.mode, cb.fp8.kv_cache) == ("fp8", "auto", "bf16", "bf16")
  assert c8.model == cb.model and c8.grpo == cb.grpo
  assert (c8.grpo.num_prompts, c8.grpo.num_generations, c8.grpo.kl_beta, c8.optim.lr) == (32, 16, 0.04, 1e-6)
  cfg = ModelConfig.from_config(c8.model)
  os.makedirs(tmp_path / "hub")
  json.dump(MOONLIGHT_HUB, open(tmp_path / "hub" / "config.json", "w"))
  assert dataclasses.replace(cfg, remat=False) == hf.load_config(str(tmp_path / "hub"), max_seq_len=cfg.max_seq_len)
  assert schema.num_params(cfg) == _moonlight_count(MOONLIGHT_HUB) == 15_960_110_208
  os.makedirs(tmp_path / "ours")
  json.dump(hf.hf_config_dict(cfg), open(tmp_path / "ours" / "config.json", "w"))
  with torch.device("meta"):
    m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "ours"))
  biases = sum(b.numel() for n, b in m.named_buffers() if n.endswith("e_score_correction_bias"))
  assert sum(p.numel() for p in m.parameters()) + biases == schema.num_params(cfg)
  recipe = recipes.Recipe.from_config(c8.fp8)
  sel = {k: recipe.selects(f"layers/3/{k}", 3, cfg.n_layers) for k in ("wq", "wkv_a", "wo", "expert_gate",
                                                                        "shared_up")}
  assert sel == {"wq": False, "wkv_a": False, "wo": True, "expert_gate": True, "shared_up": True}
  assert cfg.kv_cache_layout == (1, 576, False)  # 512 + 64 per token and layer; the expanded K, V: 16 x (192 + 128) = 5120
