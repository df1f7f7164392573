"""fp8jax.hf with Qwen3-MoE checkpoints: transformers' save_pretrained -> fp8jax -> export -> transformers.

The model is a tiny random Qwen3MoeForCausalLM made by transformers (2 layers, 8 experts top-2, layer 1 dense through
mlp_only_layers), saved with safetensors: one tensor per expert on disk (transformers 5 keeps the experts fused in
memory, gate_up_proj (E, 2F, D), and splits them again on save). Nothing is downloaded. CPU only.
"""

import json
import os
import re
import shutil

import fp8jax  # noqa: F401  (before any JAX computation)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import hf, quant
from fp8jax import recipes
from fp8jax.model import schema
from fp8jax.model.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from test_hf import _st, _tokens, _torch_logits  # noqa: E402  (tests/ is on sys.path under pytest)

E, K_TOP, D, F_MOE, F_DENSE, V = 8, 2, 256, 128, 256, 256
EXPECT = ModelConfig(vocab_size=V, dim=D, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=F_DENSE,
                     norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=512, n_experts=E,
                     n_experts_per_tok=K_TOP, moe_ffn_dim=F_MOE, norm_topk_prob=True, mlp_only_layers=(1,))
FP8 = recipes.Recipe(mode="fp8", gemm_backend="xla")
BF16 = recipes.Recipe(mode="bf16", gemm_backend="xla")
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  return hf.make_tiny_hf_dir(str(tmp_path_factory.mktemp("moe") / "m"), "qwen3_moe", n_layers=2, dim=D,
                             ffn_dim=F_DENSE, n_experts=E, n_experts_per_tok=K_TOP, moe_ffn_dim=F_MOE,
                             mlp_only_layers=(1,), init_std=0.05)


@pytest.fixture(scope="module")
def loaded(src):
  cfg = hf.load_config(src)
  return cfg, hf.load_params(src, cfg)


def _fp8jax_logits(params, cfg, toks, recipe):
  import compare_torch  # noqa: PLC0415  (scripts/, put on sys.path by test_hf)

  return compare_torch.fp8jax_outputs(params, cfg, toks, recipe)[0]


# ------------------------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------------------------


def test_config(src, tmp_path):
  assert hf.load_config(src) == EXPECT
  # transformers 5 writes the expert count as num_local_experts; the Hub's configs (transformers 4.51) num_experts
  c = json.load(open(os.path.join(src, "config.json")))
  assert c["num_local_experts"] == E and "num_experts" not in c
  d = shutil.copytree(src, tmp_path / "m")
  c["num_experts"] = c.pop("num_local_experts")
  json.dump(c, open(d / "config.json", "w"))
  assert hf.load_config(str(d)) == EXPECT


def test_on_disk_names_are_the_schema(src, loaded):
  """What save_pretrained wrote (per-expert tensors) is exactly hf_param_names: every name and shape."""
  cfg, params = loaded
  header = _st(os.path.join(src, WEIGHTS))
  assert {k: tuple(v["shape"]) for k, v in header.items()} == dict(hf.hf_param_names(cfg).values())
  assert "model.layers.0.mlp.experts.7.down_proj.weight" in header and "model.layers.1.mlp.gate_proj.weight" in header
  # the experts are stacked in expert order: slice e of the leaf is expert e's tensor on disk
  with safe_open(os.path.join(src, WEIGHTS), "np") as f:
    for key, mod in (("expert_gate", "gate_proj"), ("expert_up", "up_proj"), ("expert_down", "down_proj")):
      for e in (0, 5):
        np.testing.assert_array_equal(np.asarray(params["layers"][0][key][e]),
                                      f.get_tensor(f"model.layers.0.mlp.experts.{e}.{mod}.weight"))
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["router"]),
                                  f.get_tensor("model.layers.0.mlp.gate.weight"))
  assert set(params["layers"][1]) == set(schema.layer_shapes(cfg, 1)) and "w_gate" in params["layers"][1]


def test_bf16_logits_match_transformers(src, loaded):
  """fp8jax's BF16 recipe vs transformers float32, against BF16's own noise (transformers in bfloat16), as in
  tests/test_moe.py: a token whose k-th and (k+1)-th router probabilities nearly tie may pick another expert under
  BF16 rounding, so the mean error and top-1 agreement are bounded tightly, the max error only by the yardstick's
  own max (a flip both BF16 runs make: measured, one token at 0.88 in both, max|logit| 3.4) or 1/8 of max|logit|;
  top-1 agreement to within 3 of 64 tokens of the yardstick's (random tiny logits have near-tied maxima too)."""
  cfg, params = loaded
  toks = _tokens(V, t=32)
  ref, tbf = _torch_logits(src, toks), _torch_logits(src, toks, torch.bfloat16)
  got = _fp8jax_logits(params, cfg, toks, BF16)
  err, yard = np.abs(got - ref), np.abs(tbf - ref)
  assert err.mean() <= 1.5 * yard.mean() + 1e-6, (err.mean(), yard.mean())
  assert err.max() <= max(1.5 * yard.max(), 0.125 * np.abs(ref).max()), (err.max(), yard.max(), np.abs(ref).max())
  top1 = lambda x: np.mean(x.argmax(-1) == ref.argmax(-1))  # noqa: E731
  assert top1(got) >= min(0.95, top1(tbf)) - 0.05, (top1(got), top1(tbf))  # measured: 0.9375 both (60 of 64)


def test_sharded_load_places_each_stacked_leaf(loaded, tmp_path):
  """Experts split across shards (index + several files) and shardings as a callable: the same params."""
  cfg, params = loaded
  out = str(tmp_path / "sharded")
  hf.export_bf16(params, cfg, out, max_shard_bytes=200_000)
  wm = json.load(open(os.path.join(out, hf.INDEX_FILE)))["weight_map"]
  files = {wm[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(E)}
  assert len(files) > 1  # one stacked leaf read from several shards
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  asked = []
  back = hf.load_params(out, cfg, shardings=lambda path: asked.append(path) or dev)
  assert "layers/0/expert_gate" in asked and not any(re.search(r"expert_\w+/\d+$", p) for p in asked)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16),
                                                                                   np.float32)), back, params)


# ------------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------------


def test_export_bf16_reloads_in_transformers(src, loaded, tmp_path):
  """The export is the checkpoint in BF16: transformers' logits equal (bitwise) the source model run in bf16,
  and fp8jax reads it back to the same config and the same (BF16-rounded) params."""
  cfg, params = loaded
  out = str(tmp_path / "bf16")
  hf.export_bf16(params, cfg, out, tokenizer_dir=src)
  assert _st(os.path.join(out, WEIGHTS)).keys() == _st(os.path.join(src, WEIGHTS)).keys()
  toks = _tokens(V, seed=1)
  np.testing.assert_array_equal(_torch_logits(out, toks, torch.bfloat16), _torch_logits(src, toks, torch.bfloat16))
  assert hf.load_config(out) == cfg
  back = hf.load_params(out, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16),
                                                                                   np.float32)), back, params)


@pytest.mark.parametrize("recipe", [FP8, recipes.Recipe(mode="fp8", keep_first_n=1, pow2_scales=True)])
def test_export_fp8_convention(recipe, loaded, tmp_path):
  """Each expert's matrices are E4M3 + weight_scale_inv, bitwise the slices of the sampler's stacked QWeights; the
  router is BF16; a MoE layer kept BF16 is listed once as its experts module; fp8jax reads the directory back to
  weights that requantize to exactly the same codes and scales."""
  cfg, params = loaded
  out = str(tmp_path / "fp8")
  qc = hf.export_fp8(params, cfg, recipe, out)
  kept0 = [f"model.layers.0.self_attn.{m}_proj" for m in "qkvo"] + ["model.layers.0.mlp.experts"]
  assert qc["modules_to_not_convert"] == (kept0 if recipe.keep_first_n else []) + ["lm_head"]
  header = {k: (v["dtype"], tuple(v["shape"])) for k, v in _st(os.path.join(out, WEIGHTS)).items()}
  qparams = recipes.quantize_params(params, recipe)
  fp8_experts = not recipe.keep_first_n
  for e in range(E):
    for mod, shape in (("gate_proj", (F_MOE, D)), ("up_proj", (F_MOE, D)), ("down_proj", (D, F_MOE))):
      name = f"model.layers.0.mlp.experts.{e}.{mod}"
      if fp8_experts:
        assert header[name + ".weight"] == ("F8_E4M3", shape)
        assert header[name + ".weight_scale_inv"] == ("F32", (shape[0] // 128, shape[1] // 128))
      else:
        assert header[name + ".weight"] == ("BF16", shape) and name + ".weight_scale_inv" not in header
  assert header["model.layers.0.mlp.gate.weight"] == ("BF16", (E, D))
  assert header["model.layers.1.mlp.down_proj.weight"][0] == "F8_E4M3"  # the dense layer as before
  assert not any("experts" in k for k in header if k.startswith("model.layers.1."))
  if fp8_experts:
    path = os.path.join(out, WEIGHTS)
    with safe_open(path, "np") as f:
      for key, mod in (("expert_gate", "gate_proj"), ("expert_down", "down_proj")):
        qw = qparams["layers"][0][key]
        for e in (0, E - 1):
          q = hf._get_tensor(f, path, f"model.layers.0.mlp.experts.{e}.{mod}.weight", "F8_E4M3")
          np.testing.assert_array_equal(q.view(np.uint8), np.asarray(qw.q[e]).view(np.uint8))
          np.testing.assert_array_equal(f.get_tensor(f"model.layers.0.mlp.experts.{e}.{mod}.weight_scale_inv"),
                                        np.asarray(qw.scale[e]))
  back = recipes.quantize_params(hf.load_params(out, hf.load_config(out), pow2_scales=recipe.pow2_scales), recipe)
  for key in ("expert_gate", "expert_up", "expert_down", "w_up"):
    layer = 1 if key == "w_up" else 0
    a, b = back["layers"][layer][key], qparams["layers"][layer][key]
    if isinstance(b, quant.QWeight):
      np.testing.assert_array_equal(np.asarray(a.q).view(np.uint8), np.asarray(b.q).view(np.uint8))
      np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    else:  # kept BF16: the master weights rounded to BF16
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16), np.float32))


def test_export_fp8_loads_in_transformers(loaded, tmp_path):
  """transformers' fine-grained FP8 path reads the per-expert FP8 tensors (on CPU it dequantizes them at load,
  q * weight_scale_inv): its expert weights are exactly fp8jax's dequantized QWeights, and its logits are those of
  fp8jax's BF16 forward on the dequantized weights (activations unquantized), to BF16 noise measured as in
  test_bf16_logits_match_transformers (transformers in bfloat16 on the same directory). Needs
  `accelerate` (not an fp8jax dependency): skipped without it."""
  pytest.importorskip("accelerate")
  cfg, params = loaded
  out = str(tmp_path / "fp8")
  hf.export_fp8(params, cfg, FP8, out)
  m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  qparams = recipes.quantize_params(params, FP8)
  ex = m.model.layers[0].mlp.experts
  gate_up = np.concatenate([np.asarray(qparams["layers"][0][k].dequantize()) for k in ("expert_gate", "expert_up")],
                           axis=1)  # transformers' in-memory layout: gate_up_proj (E, 2F, D) = [gate; up]
  np.testing.assert_array_equal(ex.gate_up_proj.detach().numpy(), gate_up)
  np.testing.assert_array_equal(ex.down_proj.detach().numpy(),
                                np.asarray(qparams["layers"][0]["expert_down"].dequantize()))
  np.testing.assert_array_equal(m.model.layers[0].mlp.gate.weight.detach().numpy(),
                                np.asarray(params["layers"][0]["router"].astype(jnp.bfloat16), np.float32))
  deq = jax.tree.map(lambda w: w.dequantize() if isinstance(w, quant.QWeight) else w.astype(jnp.bfloat16), qparams,
                     is_leaf=lambda w: isinstance(w, quant.QWeight))
  toks = _tokens(V, t=32, seed=2)
  theirs, tbf = _torch_logits(out, toks), _torch_logits(out, toks, torch.bfloat16)
  ours = _fp8jax_logits(deq, cfg, toks, BF16)
  err, yard = np.abs(ours - theirs), np.abs(tbf - theirs)  # measured: mean 0.0087, mean |logit| 0.66
  assert err.mean() <= 1.5 * yard.mean(), (err.mean(), yard.mean())
  assert np.mean(ours.argmax(-1) == theirs.argmax(-1)) >= min(0.95, np.mean(tbf.argmax(-1) == theirs.argmax(-1))) - 0.05


def test_export_refuses_part_fp8_experts(loaded, tmp_path):
  cfg, params = loaded
  with pytest.raises(hf.HFCheckpointError, match=r"layer 0's experts would be part FP8, part BF16"):
    hf.export_fp8(params, cfg, recipes.Recipe(mode="fp8", keep_patterns=("*/expert_down",)), str(tmp_path / "x"))
  assert not os.path.exists(tmp_path / "x")  # refused before anything is written


# ------------------------------------------------------------------------------------------------------------------
# Bad checkpoints: one message naming the file and the tensor
# ------------------------------------------------------------------------------------------------------------------


def _broken(src, dst, edit_tensors=None, drop=(), **config):
  """A copy of ``src`` with its tensors edited, config keys dropped or set."""
  d = str(shutil.copytree(src, dst))
  if edit_tensors:
    p = os.path.join(d, WEIGHTS)
    with safe_open(p, "np") as f:
      t = {k: f.get_tensor(k) for k in f.keys()}
    edit_tensors(t)
    save_file(t, p, metadata={"format": "pt"})
  c = json.load(open(os.path.join(d, "config.json")))
  c.update(config)
  for k in drop:
    c.pop(k)
  json.dump(c, open(os.path.join(d, "config.json"), "w"))
  return d


def _load(d):
  return hf.load_params(d, hf.load_config(d))


def test_missing_expert_tensor(src, tmp_path):
  d = _broken(src, tmp_path / "m", lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
  with pytest.raises(hf.HFCheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.3\."
                                                 r"up_proj\.weight' is missing \(fp8jax param layers/0/expert_up/3\)"):
    _load(d)


@pytest.mark.parametrize("n,what", [(6, "unexpected"), (10, "missing")])
def test_wrong_number_of_experts(src, tmp_path, n, what):
  d = _broken(src, tmp_path / "m", num_local_experts=n)
  first = 6 if n < E else 8
  with pytest.raises(hf.HFCheckpointError, match=(
      rf"model\.safetensors: layer 0 has 8 experts in 'model\.layers\.0\.mlp\.experts\.\{{e\}}\.gate_proj\.weight' "
      rf"\(indices 0\.\.7\) but .*config\.json says num_experts={n}: tensor 'model\.layers\.0\.mlp\.experts\.{first}"
      rf"\.gate_proj\.weight' is {what}")):
    _load(d)


def test_fused_experts_are_named(src, tmp_path):
  """transformers' in-memory layout saved as is (gate_up_proj (E, 2F, D)): refused with the reason."""
  def fuse(t):
    for i in (0,):
      pre = f"model.layers.{i}.mlp.experts."
      t[pre + "gate_up_proj"] = np.stack([np.concatenate([t.pop(f"{pre}{e}.gate_proj.weight"),
                                                          t.pop(f"{pre}{e}.up_proj.weight")]) for e in range(E)])
      t[pre + "down_proj"] = np.stack([t.pop(f"{pre}{e}.down_proj.weight") for e in range(E)])
  d = _broken(src, tmp_path / "m", fuse)
  with pytest.raises(hf.HFCheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' is "
                                                 r"missing .*found 'model\.layers\.0\.mlp\.experts\.down_proj' "
                                                 r"instead: experts fused into one tensor"):
    _load(d)


def test_bad_moe_config_names_the_file(src, tmp_path):
  d = _broken(src, tmp_path / "a", num_experts_per_tok=9)
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: model\.n_experts_per_tok=9 must be in \[1, "
                                                 r"model\.n_experts=8\]"):
    hf.load_config(d)
  d = _broken(src, tmp_path / "b", drop=("moe_intermediate_size",))
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: key 'moe_intermediate_size' is missing"):
    hf.load_config(d)


def test_ragged_experts_are_written_bf16_as_one_module(tmp_path):
  """moe_ffn_dim not a multiple of 128: the experts' scale grids are ragged, which transformers misreads (see
  hf.export_fp8), so they are written BF16 and their layer's experts module is listed once; the dense attention
  stays FP8. No torch needed."""
  from fp8jax.model import llama  # noqa: PLC0415

  cfg = ModelConfig(vocab_size=256, dim=256, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=256,
                    qk_norm=True, n_experts=4, n_experts_per_tok=2, moe_ffn_dim=192)
  params = llama.init_params(cfg, seed=0)
  qc = hf.export_fp8(params, cfg, FP8, str(tmp_path))
  assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.experts", "lm_head"]
  header = _st(str(tmp_path / WEIGHTS))
  assert header["model.layers.0.mlp.experts.3.up_proj.weight"]["dtype"] == "BF16"
  assert header["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "F8_E4M3"
  back = hf.load_params(str(tmp_path), hf.load_config(str(tmp_path)))
  np.testing.assert_array_equal(np.asarray(back["layers"][0]["expert_up"]),
                                np.asarray(params["layers"][0]["expert_up"].astype(jnp.bfloat16), np.float32))


# ------------------------------------------------------------------------------------------------------------------
# The Qwen3-30B-A3B recipes
# ------------------------------------------------------------------------------------------------------------------

# The fields of Qwen/Qwen3-30B-A3B's config.json on the Hub (transformers 4.51 wrote it) that fix the architecture.
QWEN3_30B_A3B_HUB = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False, "max_position_embeddings": 40960,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_experts": 128, "num_experts_per_tok": 8}


def test_qwen3_30b_a3b_recipes_are_the_real_model(tmp_path):
  """Both recipes' model is the Hub's config.json (read by hf.load_config) and has the real model's parameter count:
  fp8jax's schema and transformers' Qwen3MoeForCausalLM (built from the config fp8jax exports, on the meta device)
  count the same 30,532,122,624. The FP8 recipe's GEMMs run where fp8.gemm_backend="auto" puts them (the Pallas
  kernels, grouped for the experts, on a Hopper GPU)."""
  import dataclasses  # noqa: PLC0415

  from configs import qwen3_30b_a3b_bf16, qwen3_30b_a3b_fp8  # noqa: PLC0415

  c8, cb = qwen3_30b_a3b_fp8.get_config(), qwen3_30b_a3b_bf16.get_config()
  assert (c8.fp8.mode, c8.fp8.gemm_backend, cb.fp8.mode, cb.fp8.kv_cache) == ("fp8", "auto", "bf16", "bf16")
  assert c8.model == cb.model and c8.grpo == cb.grpo
  cfg = ModelConfig.from_config(c8.model)
  os.makedirs(tmp_path / "hub")
  json.dump(QWEN3_30B_A3B_HUB, open(tmp_path / "hub" / "config.json", "w"))
  hub = hf.load_config(str(tmp_path / "hub"), max_seq_len=cfg.max_seq_len)
  assert dataclasses.replace(cfg, remat=False) == hub
  assert schema.num_params(cfg) == 30_532_122_624
  os.makedirs(tmp_path / "ours")
  json.dump(hf.hf_config_dict(cfg), open(tmp_path / "ours" / "config.json", "w"))
  with torch.device("meta"):
    m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "ours"))
  assert sum(p.numel() for p in m.parameters()) == schema.num_params(cfg)
  from fp8jax.rl import trainer as trainer_lib  # noqa: PLC0415

  with pytest.raises(FileNotFoundError, match="data.path"):  # the trainer takes the recipe, says what to download
    trainer_lib.RLTrainer(c8, str(tmp_path / "run"))
