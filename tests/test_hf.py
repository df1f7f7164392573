"""fp8jax.hf against transformers on tiny random Llama-3 (llama3 RoPE scaling) and Qwen3 models built locally.

Nothing is downloaded: the models are made by transformers (random init, save_pretrained with safetensors) and the
tokenizer is a tiny BPE trained on a few sentences (fp8jax.hf.make_tiny_hf_dir). CPU only.
"""

import json
import os
import shutil
import sys

import fp8jax  # noqa: F401  (before any JAX computation)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8jax import hf, ops, quant
from fp8jax import recipes
from fp8jax.model import layers, llama
from fp8jax.model.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import compare_torch  # noqa: E402

ARCHS = ("llama", "qwen3")
BF16 = recipes.Recipe(mode="bf16", gemm_backend="xla")
FP8 = recipes.Recipe(mode="fp8", gemm_backend="xla")
MSGS = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2? Solve for x."}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {a: hf.make_tiny_hf_dir(str(root / a), a, seed=i) for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def loaded(dirs):
  out = {}
  for a, d in dirs.items():
    cfg = hf.load_config(d)
    out[a] = (cfg, hf.load_params(d, cfg))
  return out


def _tokens(vocab, b=2, t=48, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


def _torch_logits(hf_dir, tokens, dtype=torch.float32):
  m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
  with torch.no_grad():
    return m(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _assert_within_bf16_noise(hf_dir, toks, got) -> tuple[dict, np.ndarray]:
  """fp8jax's BF16-recipe logits ``got`` vs transformers float32 on ``hf_dir``: within 1.5x of transformers' own
  bfloat16-vs-float32 difference (max and mean |diff|), within 2**-4 x max|logit|, top-1 >= 95%, mean KL < 1e-4
  (the bound's derivation: test_bf16_logits_match_transformers). Returns fp8jax's stats and the float32 logits."""
  ref = _torch_logits(hf_dir, toks)
  tbf = _torch_logits(hf_dir, toks, torch.bfloat16)
  s, yard = compare_torch.logit_stats(ref, got), compare_torch.logit_stats(ref, tbf)
  assert s["max_abs"] <= 1.5 * yard["max_abs"] and s["mean_abs"] <= 1.5 * yard["mean_abs"], (s, yard)
  assert s["max_abs"] <= 2**-4 * np.abs(ref).max(), s
  assert s["top1"] >= 0.95 and s["kl_mean"] < 1e-4, s
  return s, ref


def _ids(x):  # transformers 5 may return a BatchEncoding from apply_chat_template(tokenize=True)
  return list(x["input_ids"] if hasattr(x, "keys") else x)


# ------------------------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------------------------


def test_config(dirs):
  c = hf.load_config(dirs["llama"])
  assert (c.dim, c.ffn_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
      256, 512, 2, 4, 2, 64, 256)
  assert c.rope_scaling == (8.0, 1.0, 4.0, 64) and c.rope_theta == 500000.0 and c.norm_eps == 1e-5
  assert not c.qk_norm and not c.tie_embeddings
  q = hf.load_config(dirs["qwen3"])
  assert q.qk_norm and q.tie_embeddings and q.rope_scaling is None and q.rope_theta == 1e6 and q.norm_eps == 1e-6


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen3", True), ("qwen3", False)])
def test_schema_names_and_shapes_are_transformers_own(arch, tie):
  """The parameter schema's HF names and shapes (fp8jax.model.schema) are exactly transformers' state dict."""
  kw = dict(vocab_size=160, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, tie_word_embeddings=tie)
  c = transformers.LlamaConfig(**kw) if arch == "llama" else transformers.Qwen3Config(**kw)
  model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen3ForCausalLM)(c)
  theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
  if tie:
    theirs.pop("lm_head.weight", None)  # the tied head is the embedding (not a tensor of its own on disk)
  cfg = ModelConfig(vocab_size=160, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192,
                    tie_embeddings=tie, qk_norm=arch == "qwen3")
  ours = dict(hf.hf_param_names(cfg).values())
  assert ours == theirs


def test_legacy_rope_scaling_keys(dirs, tmp_path):
  """transformers < 5 writes rope_scaling + rope_theta instead of rope_parameters."""
  shutil.copytree(dirs["llama"], tmp_path / "m")
  c = json.load(open(tmp_path / "m" / "config.json"))
  rp = c.pop("rope_parameters")
  c["rope_theta"] = rp.pop("rope_theta")
  c["rope_scaling"] = rp
  json.dump(c, open(tmp_path / "m" / "config.json", "w"))
  assert hf.load_config(str(tmp_path / "m")) == hf.load_config(dirs["llama"])


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_match_transformers(arch, dirs, loaded):
  """fp8jax (BF16 recipe: bf16 weights/activations, fp32 accumulation) vs transformers in float32.

  Tolerance, derived: BF16 keeps 8 significant bits (unit roundoff u = 2**-9). Every linear rounds its weights and
  output to BF16 and the residual stream is BF16, so each of the ~10 roundings per layer adds a relative error up
  to u; they are independent, so the logits' error is a few u relative to their RMS, and the largest of ~25k
  entries about 4.5 sigma of that. Rather than trust that estimate, the test measures BF16 noise on the same
  checkpoint — transformers run in bfloat16 vs float32 — and requires fp8jax to be within 1.5x of it (max and mean
  |diff|), plus an absolute bound of 2**-4 x max|logit| (~ 32 u: an order above the estimate) and >= 95% top-1.
  Measured (2 layers): fp8jax max|dl| ~ 0.014, torch-bf16 ~ 0.015, max|logit| ~ 1.5.
  """
  cfg, params = loaded[arch]
  toks = _tokens(cfg.vocab_size)
  got, hs = compare_torch.fp8jax_outputs(params, cfg, toks, BF16)
  _assert_within_bf16_noise(dirs[arch], toks, got)
  # The residual stream forward returns (as compare_torch reads it): embeddings first, its last state the one the
  # final norm turns into forward's hidden, exactly.
  lcfg = ops.LinearConfig.from_recipe(BF16)
  hidden = jax.jit(lambda p, t: llama.forward(p, t, cfg, lcfg)[0])(params, toks)
  stream = jax.jit(lambda p, t: llama.forward(p, t, cfg, lcfg, residuals=True)[2].residuals)(params, toks)
  assert len(stream) == cfg.n_layers + 1 and len(hs) == cfg.n_layers + 1
  np.testing.assert_array_equal(np.asarray(stream[0]), np.asarray(params["embed"].astype(cfg.dtype)[toks]))
  normed = jax.jit(lambda p, x: layers.rms_norm(x, p["final_norm"], cfg.norm_eps))(params, stream[-1])
  np.testing.assert_array_equal(np.asarray(hidden, np.float32), np.asarray(normed, np.float32))


def test_fp8_logits_close_to_transformers(dirs, loaded):
  """FP8 recipe vs transformers float32: a loose sanity bound (FP8 error is ~16x BF16's: 3 vs 7 mantissa bits)."""
  cfg, params = loaded["llama"]
  toks = _tokens(cfg.vocab_size)
  s = compare_torch.logit_stats(_torch_logits(dirs["llama"], toks),
                                compare_torch.fp8jax_outputs(params, cfg, toks, FP8)[0])
  assert s["kl_mean"] < 5e-3 and s["top1"] >= 0.8, s


def test_tokenizer_matches_transformers(dirs):
  d = dirs["llama"]
  ours, theirs = hf.load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
  for text in ["What is two plus two?", "Hello, world! Solve for x: 3 x + 5 = 20.", "unseen wörds ✓"]:
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"])
  for gen in (False, True):
    assert ours.apply_chat_template(MSGS, add_generation_prompt=gen) == _ids(
        theirs.apply_chat_template(MSGS, add_generation_prompt=gen, tokenize=True))
    assert ours.apply_chat_template(MSGS, add_generation_prompt=gen, tokenize=False) == \
        theirs.apply_chat_template(MSGS, add_generation_prompt=gen, tokenize=False)
  # eos: the tokenizer's eos first, then generation_config.json's list, then config.json's (deduplicated)
  eot, eot2 = theirs.convert_tokens_to_ids("<|eot_id|>"), theirs.convert_tokens_to_ids("<|end_of_text|>")
  assert ours.eos_ids == (eot, eot2) and ours.bos_id == theirs.bos_token_id


def test_sharded_load_with_shardings(dirs, loaded, tmp_path):
  """Index + several shards, shardings given as a pytree and as a callable: same params."""
  cfg, params = loaded["llama"]
  out = str(tmp_path / "sharded")
  hf.export_bf16(params, cfg, out, dirs["llama"], max_shard_bytes=300_000)
  assert os.path.isfile(os.path.join(out, hf.INDEX_FILE))
  assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 2
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  a = hf.load_params(out, cfg, shardings=jax.tree.map(lambda _: dev, params))
  b = hf.load_params(out, cfg, dtype=jnp.bfloat16, shardings=lambda path: dev)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(b))
  jax.tree.map(lambda x, y, p: np.testing.assert_array_equal(x, np.asarray(y, np.float32))
               or np.testing.assert_array_equal(x, np.asarray(p.astype(jnp.bfloat16), np.float32)), a, b, params)


# ------------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_export_bf16_reloads_in_transformers(arch, dirs, loaded, tmp_path):
  """The export is the checkpoint in BF16: transformers' logits equal (bitwise) the source model run in bf16."""
  cfg, params = loaded[arch]
  out = str(tmp_path / "bf16")
  hf.export_bf16(params, cfg, out, tokenizer_dir=dirs[arch])
  for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert os.path.isfile(os.path.join(out, f)), f
  toks = _tokens(cfg.vocab_size, seed=1)
  np.testing.assert_array_equal(_torch_logits(out, toks, torch.bfloat16), _torch_logits(dirs[arch], toks,
                                                                                         torch.bfloat16))
  assert hf.load_config(out) == cfg
  assert transformers.AutoTokenizer.from_pretrained(out)("Hello")["input_ids"] == hf.load_tokenizer(
      dirs[arch]).encode("Hello")


def _st(path):
  with open(path, "rb") as f:  # raw header: dtype strings exactly as written
    n = int.from_bytes(f.read(8), "little")
    return {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


@pytest.mark.parametrize("arch,recipe", [("llama", recipes.Recipe(mode="fp8", keep_first_n=1)),
                                         ("qwen3", recipes.Recipe(mode="fp8", pow2_scales=True))])
def test_export_fp8_convention(arch, recipe, loaded, tmp_path):
  cfg, params = loaded[arch]
  out = str(tmp_path / "fp8")
  hf.export_fp8(params, cfg, recipe, out)
  qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
  kept_layers = [0] if recipe.keep_first_n else []
  expect_kept = [f"model.layers.{i}.{hf.HF_LAYER_MODULES[n]}" for i in kept_layers for n in recipes.LINEAR_NAMES
                 if n in params["layers"][i]]  # the dense layer's linears (LINEAR_NAMES also lists MoE experts)
  assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": expect_kept + ["lm_head"]}
  header = _st(os.path.join(out, "model.safetensors"))
  qparams = recipes.quantize_params(params, recipe)  # what the sampler runs on
  expected = {}
  for path, (name, shape) in hf.hf_param_names(cfg).items():
    mod = name[:-len(".weight")]
    w = qparams
    for part in path.split("/"):
      w = w[int(part)] if isinstance(w, list) else w[part]
    if isinstance(w, quant.QWeight):
      expected[name] = ("F8_E4M3", list(shape))
      expected[mod + ".weight_scale_inv"] = ("F32", [-(-shape[0] // 128), -(-shape[1] // 128)])
    else:
      expected[name] = ("BF16", list(shape))
  assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == expected
  # Dequantized export == fp8jax's FP8 weights, exactly (and q, scale bitwise).
  with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
    for i, layer in enumerate(qparams["layers"]):
      for n in (n for n in recipes.LINEAR_NAMES if n in layer):
        mod = f"model.layers.{i}.{hf.HF_LAYER_MODULES[n]}"
        if not isinstance(layer[n], quant.QWeight):
          assert mod in qc["modules_to_not_convert"]
          continue
        q = hf._get_tensor(f, os.path.join(out, "model.safetensors"), mod + ".weight", "F8_E4M3")
        s = f.get_tensor(mod + ".weight_scale_inv")
        assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
        np.testing.assert_array_equal(q.view(np.uint8), np.asarray(layer[n].q).view(np.uint8))
        np.testing.assert_array_equal(s, np.asarray(layer[n].scale))
        np.testing.assert_array_equal(hf._block_dequant_np(q, s), np.asarray(layer[n].dequantize()))
  # fp8jax reads the FP8 directory back to master weights that requantize to exactly these codes and scales:
  # the dequantized weights, except that in some blocks the largest elements move by a few FP32 ulps so that the
  # block's scale comes out the same (hf.block_fp8_master; tests/test_hf_io.py checks the full round trip).
  back = hf.load_params(out, hf.load_config(out), pow2_scales=recipe.pow2_scales)
  w_back, qw = np.asarray(back["layers"][1]["w_up"]), qparams["layers"][1]["w_up"]
  again = quant.quantize_weight(jnp.asarray(w_back), recipe.pow2_scales)
  np.testing.assert_array_equal(np.asarray(again.q).view(np.uint8), np.asarray(qw.q).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(again.scale), np.asarray(qw.scale))
  np.testing.assert_allclose(w_back, np.asarray(qw.dequantize()), rtol=8 * 2.0**-23, atol=0)


def test_export_fp8_loads_in_transformers(loaded, tmp_path):
  """transformers' fine-grained FP8 path. On CPU (no GPU) transformers does not run FP8 GEMMs: it dequantizes the
  checkpoint at load time (q * weight_scale_inv) — so this checks that it parses our config and tensors and that its
  dequantized weights are exactly fp8jax's. It needs `accelerate`, which is not in fp8jax's dependencies: skipped
  without it. The real FP8Linear path needs a GPU with compute capability >= 8.9."""
  pytest.importorskip("accelerate")
  cfg, params = loaded["llama"]
  out = str(tmp_path / "fp8")
  hf.export_fp8(params, cfg, FP8, out)
  m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  qparams = recipes.quantize_params(params, FP8)
  for i, layer in enumerate(qparams["layers"]):
    np.testing.assert_array_equal(m.model.layers[i].mlp.down_proj.weight.detach().numpy(),
                                  np.asarray(layer["w_down"].dequantize()))
    np.testing.assert_array_equal(m.model.layers[i].self_attn.q_proj.weight.detach().numpy(),
                                  np.asarray(layer["wq"].dequantize()))


def test_block_fp8_linear_matches_torch_block_math(loaded):
  r = compare_torch.compare_block_linear(m=32, w_NxK=np.asarray(loaded["llama"][1]["layers"][0]["w_up"]))
  assert r["weight_q_bitwise"] and r["act_q_bitwise"], r
  assert r["weight_scale_max_ulp"] <= 1 and r["act_scale_max_ulp"] <= 1, r  # XLA: amax * fl(1/448)
  assert r["max_rel"] < 1e-5, r  # same products; only the FP32 summation order inside a 128-block differs


def test_compare_torch_with_a_hidden_size_not_a_multiple_of_128(tmp_path, capsys, monkeypatch):
  """scripts/compare_torch.py --hf_dir on dim=192: every row runs (the block-linear check pads K as ops.linear
  does; it used to raise in quantize_act), and when a later row fails the rows computed so far are printed."""
  d = hf.make_tiny_hf_dir(str(tmp_path / "m"), "llama", n_layers=1, dim=192, ffn_dim=320, n_heads=3, n_kv_heads=1,
                          head_dim=64)
  r = compare_torch.compare(d, batch=1, seq=16, torch_bf16=False)
  bl = r["block_linear"]
  assert bl["shape"] == "x 64x192 . w 320x192^T" and bl["weight_q_bitwise"] and bl["act_q_bitwise"], bl
  assert bl["max_rel"] < 1e-5, bl
  assert r["fp8jax-bf16"]["logits"]["top1"] >= 0.9 and r["fp8jax-fp8"]["logits"]["kl_mean"] < 5e-3, r
  boom = RuntimeError("block linear failed")
  monkeypatch.setattr(compare_torch, "compare_block_linear", lambda **kw: (_ for _ in ()).throw(boom))
  with pytest.raises(RuntimeError, match="block linear failed"):
    compare_torch.main(["--hf_dir", d, "--batch", "1", "--seq", "16", "--no_torch_bf16"])
  out = capsys.readouterr().out
  assert "the rows computed so far" in out and "fp8jax-bf16" in out and "fp8jax-fp8" in out


def test_convert_roundtrip(dirs, tmp_path):
  import convert  # noqa: PLC0415  (scripts/convert.py)

  ck = str(tmp_path / "ckpt")
  convert.main(["--from_hf", dirs["qwen3"], "--to_ckpt", ck])
  convert.main(["--from_ckpt", ck, "--to_hf", str(tmp_path / "out"), "--format", "bf16"])
  toks = _tokens(256, seed=2)
  np.testing.assert_array_equal(_torch_logits(str(tmp_path / "out"), toks, torch.bfloat16),
                                _torch_logits(dirs["qwen3"], toks, torch.bfloat16))


# ------------------------------------------------------------------------------------------------------------------
# Bad inputs: one clear message naming the file and the key
# ------------------------------------------------------------------------------------------------------------------


def _copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def _edit_config(d, **kv):
  p = os.path.join(d, "config.json")
  c = json.load(open(p))
  c.update(kv)
  json.dump(c, open(p, "w"))


def _rewrite_weights(d, fn):
  from safetensors.numpy import save_file  # noqa: PLC0415

  p = os.path.join(d, "model.safetensors")
  with safe_open(p, "np") as f:
    t = {k: f.get_tensor(k) for k in f.keys()}
  fn(t)
  save_file(t, p, metadata={"format": "pt"})


def test_missing_config(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"config\.json: file not found"):
    hf.load_config(str(tmp_path))


def test_missing_weights_file(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  os.remove(os.path.join(d, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
    hf.load_params(d, hf.load_config(d))


def test_missing_shard(dirs, loaded, tmp_path):
  cfg, params = loaded["llama"]
  out = str(tmp_path / "sh")
  hf.export_bf16(params, cfg, out, max_shard_bytes=300_000)
  os.remove(os.path.join(out, next(f for f in os.listdir(out) if f.startswith("model-00002-of-"))))
  with pytest.raises(FileNotFoundError, match=r"model-00002-of-\d+\.safetensors: file not found \(listed in .*"
                                              r"index\.json for key 'model\."):
    hf.load_params(out, cfg)


def test_missing_tensor(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  _rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(hf.HFCheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj"
                                                 r"\.weight' is missing \(fp8jax param layers/1/w_up\)"):
    hf.load_params(d, hf.load_config(d))


def test_unexpected_tensor(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  _rewrite_weights(d, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)))
  with pytest.raises(hf.HFCheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp"
                                                 r"\.extra\.weight'"):
    hf.load_params(d, hf.load_config(d))


def test_shape_mismatch(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  _edit_config(d, intermediate_size=384)
  with pytest.raises(hf.HFCheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj"
                                                 r"\.weight' has shape \(512, 256\), config\.json implies \(384, 256\)"):
    hf.load_params(d, hf.load_config(d))


def test_unsupported_architecture(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral")
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: key 'architectures' = \['MistralForCausalLM'\] "
                                                 r"is not supported"):
    hf.load_config(d)


def test_unsupported_rope_type(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: key 'rope_parameters\.rope_type' = 'yarn' "
                                                 r"is not supported"):
    hf.load_config(d)


def test_bin_only(dirs, tmp_path):
  d = _copy(dirs["llama"], tmp_path / "m")
  os.remove(os.path.join(d, "model.safetensors"))
  open(os.path.join(d, "pytorch_model.bin"), "wb").close()
  with pytest.raises(hf.HFCheckpointError, match=r"only pickle weights found \(pytorch_model\.bin\); fp8jax loads "
                                                 r"safetensors only"):
    hf.load_params(d, hf.load_config(d))
