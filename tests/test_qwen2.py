"""Qwen2ForCausalLM (Qwen2 / Qwen2.5): Llama with biases on the q/k/v projections, tied or untied head.

Tiny random Qwen2 checkpoints made by transformers (nonzero biases, hidden sizes that are not multiples of 128),
against transformers as the reference: config and tensor names, BF16 logits, BF16 and block-FP8 export round trips,
the sampler's log-probs against the trainer's, the bias inside ``ops.linear`` (one rounding, FP32 master == BF16
copy), the fused q/k/v projection with its biases, and the configs fp8jax refuses. CPU only, nothing downloaded.
"""

import fp8jax  # noqa: F401  (before any JAX computation)

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import hf, ops, quant, recipes
from fp8jax import sampler as smp
from fp8jax.diagnostics import one_engine
from fp8jax.model import fuse, llama
from fp8jax.model.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import compare_torch  # noqa: E402
from test_hf import _assert_within_bf16_noise, _tokens as _hf_tokens, _torch_logits  # noqa: E402

BF16 = recipes.Recipe(mode="bf16", gemm_backend="xla")
FP8 = recipes.Recipe(mode="fp8", gemm_backend="xla")
# Both hidden sizes are ragged (not multiples of 128): 192 with q 192 / kv 64, and SmolLM2-135M's 576 (9 heads of 64,
# 3 KV heads: q 576 / kv 192, ffn 1536), so every FP8 projection has a zero-padded last block.
MODELS = {"tied": dict(tie=True, seed=11, n_layers=2, dim=192, ffn_dim=320, n_heads=3, n_kv_heads=1),
          "untied": dict(tie=False, seed=12, n_layers=1, dim=576, ffn_dim=1536, n_heads=9, n_kv_heads=3)}
BIASES = ("bq", "bk", "bv")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("qwen2")
  return {k: hf.make_tiny_hf_dir(str(root / k), "qwen2", head_dim=64, **kw) for k, kw in MODELS.items()}


@pytest.fixture(scope="module")
def loaded(dirs):
  out = {}
  for k, d in dirs.items():
    cfg = hf.load_config(d)
    out[k] = (cfg, hf.load_params(d, cfg))
  return out


def _tokens(vocab, seed=0):
  return _hf_tokens(vocab, t=40, seed=seed)


def _no_biases(params):
  return {**params, "layers": [{k: (jnp.zeros_like(v) if k in BIASES else v) for k, v in p.items()}
                               for p in params["layers"]]}


def _bits(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ------------------------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_config_and_names_are_transformers_own(dirs, tie):
  """load_config reads a Qwen2 config.json (biases on, no QK-norm, rope_theta and the head from it), and the schema's
  HF names and shapes, biases included, are exactly transformers' Qwen2ForCausalLM state dict."""
  c = hf.load_config(dirs["tied" if tie else "untied"])
  m = MODELS["tied" if tie else "untied"]
  assert c.attn_bias and not c.qk_norm and c.tie_embeddings == tie and c.rope_theta == 1e6 and c.norm_eps == 1e-6
  assert (c.dim, c.ffn_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
      m["dim"], m["ffn_dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], 64)
  kw = dict(vocab_size=160, hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1, head_dim=64, tie_word_embeddings=tie)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
  theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
  if tie:
    theirs.pop("lm_head.weight", None)  # the tied head is the embedding
  cfg = ModelConfig(vocab_size=160, dim=192, n_layers=2, n_heads=3, n_kv_heads=1, head_dim=64, ffn_dim=320,
                    tie_embeddings=tie, attn_bias=True)
  ours = dict(hf.hf_param_names(cfg).values())
  assert ours == theirs
  assert sum(k.endswith(".bias") for k in ours) == 3 * 2  # q, k, v of each layer; no o_proj / MLP bias


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_bf16_logits_match_transformers(which, dirs, loaded):
  """fp8jax (BF16 recipe) vs transformers in float32 on the same Qwen2 checkpoint.

  Bound (the reasoning of tests/test_hf.py's Llama/Qwen3 test): BF16 keeps 8 significant bits (u = 2**-9); every
  linear rounds its operands and output to BF16 and the residual stream is BF16, so the logits carry a few u of
  their RMS. Measured rather than trusted: transformers run in bfloat16 against float32 on the same checkpoint is
  the yardstick, and fp8jax must be within 1.5x of it (max and mean |diff|), within 2**-4 x max|logit| (~32 u),
  with >= 95% top-1 agreement and mean KL < 1e-4. The q/k/v biases (std 0.5, larger than the projections'
  outputs) must matter: the same model with them zeroed is off by more than 10x the bound's measured diff, so a
  dropped or misplaced bias cannot pass. Measured (dim 192): max|dl| ~ 0.007 (torch-bf16 ~ 0.008), max|logit| ~ 1.1.
  """
  cfg, params = loaded[which]
  toks = _tokens(cfg.vocab_size)
  got, _ = compare_torch.fp8jax_outputs(params, cfg, toks, BF16)
  s, ref = _assert_within_bf16_noise(dirs[which], toks, got)
  unbiased = compare_torch.logit_stats(ref, compare_torch.fp8jax_outputs(_no_biases(params), cfg, toks, BF16)[0])
  assert unbiased["max_abs"] > 10 * s["max_abs"], (unbiased, s)


def test_fp8_logits_close_to_transformers(dirs, loaded):
  """FP8 recipe (every projection block FP8 with a ragged last block; biases BF16) vs transformers float32: the
  loose sanity bound of tests/test_hf.py (FP8 keeps 3 mantissa bits to BF16's 7: ~16x BF16's error)."""
  cfg, params = loaded["tied"]
  toks = _tokens(cfg.vocab_size)
  s = compare_torch.logit_stats(_torch_logits(dirs["tied"], toks), compare_torch.fp8jax_outputs(params, cfg, toks,
                                                                                                 FP8)[0])
  assert s["kl_mean"] < 5e-3 and s["top1"] >= 0.8, s


# ------------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------------


def _header(path):
  with open(path, "rb") as f:  # raw header: dtype strings exactly as written
    n = int.from_bytes(f.read(8), "little")
    return {k: (v["dtype"], v["shape"]) for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_export_bf16_roundtrip(which, dirs, loaded, tmp_path):
  """The BF16 export is a Qwen2 checkpoint: config.json says Qwen2ForCausalLM / qwen2 with attention biases, the
  head tied as before and no sliding window, and reads back to the same ModelConfig; transformers' bfloat16 logits
  on it equal (bitwise) those on the source checkpoint, which they would not if a bias were missing (transformers
  would initialize it) or written to the wrong projection; fp8jax reads the biases back as their BF16 rounding."""
  cfg, params = loaded[which]
  out = str(tmp_path / "bf16")
  hf.export_bf16(params, cfg, out, tokenizer_dir=dirs[which])
  c = json.load(open(os.path.join(out, "config.json")))
  assert c["architectures"] == ["Qwen2ForCausalLM"] and c["model_type"] == "qwen2", c
  assert c["attention_bias"] is True and c["tie_word_embeddings"] is (which == "tied"), c
  assert c["use_sliding_window"] is False and c["rope_parameters"]["rope_theta"] == 1e6, c
  assert hf.load_config(out) == cfg
  header = _header(os.path.join(out, "model.safetensors"))
  for i in range(cfg.n_layers):
    for proj, n in (("q_proj", cfg.q_dim), ("k_proj", cfg.kv_dim), ("v_proj", cfg.kv_dim)):
      assert header[f"model.layers.{i}.self_attn.{proj}.bias"] == ("BF16", [n])
  assert ("lm_head.weight" in header) is (which == "untied")
  toks = _tokens(cfg.vocab_size, seed=1)
  np.testing.assert_array_equal(_torch_logits(out, toks, torch.bfloat16), _torch_logits(dirs[which], toks,
                                                                                         torch.bfloat16))
  back = hf.load_params(out, cfg)
  for lb, lp in zip(back["layers"], params["layers"]):
    for b in BIASES:
      np.testing.assert_array_equal(np.asarray(lb[b]), np.asarray(lp[b].astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_export_fp8_roundtrip(which, loaded, tmp_path):
  """Block-FP8 export (``ragged_fp8``: every projection FP8, ragged last blocks included) -> import gives the same
  QWeights bitwise, the biases BF16 in the file (never FP8, no weight_scale_inv) and back as the master's BF16
  rounding; so the sampler's weights made from the reloaded checkpoint are bitwise those made from the original."""
  cfg, params = loaded[which]
  out = str(tmp_path / "fp8")
  qc = hf.export_fp8(params, cfg, FP8, out, ragged_fp8=True)
  assert qc["modules_to_not_convert"] == ["lm_head"], qc  # untied: a BF16 head; tied: the BF16 embedding
  c = json.load(open(os.path.join(out, "config.json")))
  assert c["architectures"] == ["Qwen2ForCausalLM"] and c["attention_bias"] is True
  assert c["tie_word_embeddings"] is (which == "tied")
  header = _header(os.path.join(out, "model.safetensors"))
  bias_names = [k for k in header if k.endswith(".bias")]
  assert len(bias_names) == 3 * cfg.n_layers and all(header[k][0] == "BF16" for k in bias_names), header
  assert not any(k.endswith(".bias_scale_inv") for k in header)
  assert header["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"
  back = hf.load_params(out, hf.load_config(out))
  q0, q1 = recipes.quantize_params(params, FP8), recipes.quantize_params(back, FP8)
  qw0 = [x for x in jax.tree.leaves(q0, is_leaf=quant.is_fp8_leaf) if isinstance(x, quant.QWeight)]
  qw1 = [x for x in jax.tree.leaves(q1, is_leaf=quant.is_fp8_leaf) if isinstance(x, quant.QWeight)]
  assert len(qw0) == len(qw1) == 7 * cfg.n_layers
  for a, b in zip(qw0, qw1):
    np.testing.assert_array_equal(_bits(a.q), _bits(b.q))
    np.testing.assert_array_equal(_bits(a.scale), _bits(b.scale))
  for lb, lp in zip(back["layers"], params["layers"]):
    for b in BIASES:
      np.testing.assert_array_equal(np.asarray(lb[b]), np.asarray(lp[b].astype(jnp.bfloat16), np.float32))
  s0, s1 = smp.prepare_params(params, FP8), smp.prepare_params(back, FP8)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(_bits(a), _bits(b)), s0, s1)


# ------------------------------------------------------------------------------------------------------------------
# One engine: the sampler's log-probs are the trainer's
# ------------------------------------------------------------------------------------------------------------------


def test_sampler_logprobs_equal_trainer_bitwise(loaded):
  """On the tied ragged Qwen2 checkpoint (FP32 masters with nonzero biases), the sampler's log-probs (BF16 copies of
  the biases, QWeight projections, FP8 paged KV cache) equal the trainer's forward (FP8Weight masters, FP32 biases,
  the same K/V quantization) bit for bit: the promise of tests/test_one_engine.py (its CPU test runs the same
  recipe), through ``one_engine.sampler_vs_trainer``."""
  cfg, params = loaded["tied"]
  prompts = [np.random.default_rng(i).integers(0, cfg.vocab_size, size=5 + 4 * i).tolist() for i in range(3)]
  m = one_engine.sampler_vs_trainer(cfg, one_engine.promised_recipes()["fp8+kv"], prompts, slots=4, samples=2,
                                    max_new=6, bucket=16, master=params)
  assert m["tokens"] == len(prompts) * 2 * 6
  assert m["token_mult_prob_error"] == 1.0 and m["bitwise_equal_frac"] == 1.0, m


# ------------------------------------------------------------------------------------------------------------------
# The bias in ops.linear, and in the fused q/k/v projection
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "qweight"])
def test_linear_bias_is_one_rounding_and_dtype_blind(kind):
  """``linear(x, w, bias=b)`` is the GEMM's FP32 accumulator plus the BF16-rounded bias, rounded once: within half a
  BF16 ulp (plus FP32 rounding) of the exact sum, for every element, whereas rounding the GEMM to BF16 first
  breaks that bound somewhere (the test tells the two apart). An FP32 bias and its BF16 copy give the same bits
  (the trainer's master vs the sampler's weights). The bias's gradient is the column sum of the cotangent."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 192)), jnp.bfloat16)
  w32 = jnp.asarray(0.05 * rng.standard_normal((320, 192)), jnp.float32)
  b32 = jnp.asarray(rng.standard_normal(320), jnp.float32)
  lcfg = ops.LinearConfig(backend="xla")
  w = {"bf16": w32, "fp8_master": quant.FP8Weight(w32), "qweight": quant.quantize_weight(w32)}[kind]
  y = np.asarray(ops.linear(x, w, lcfg, bias=b32), np.float64)
  acc = np.asarray(ops.linear(x, w, ops.LinearConfig(backend="xla", out_dtype="float32")), np.float64)
  exact = acc + np.asarray(b32.astype(jnp.bfloat16), np.float64)
  # Half a BF16 ulp at the binade of the result (8 significant bits: 2**(e - 8) for |v| in [2**e, 2**(e+1))), plus
  # the FP32 add's own rounding (2**-24 relative).
  e = np.frexp(np.maximum(np.abs(exact), np.abs(y)))[1] - 1
  bound = np.ldexp(1.0, e - 8) + 2.0**-24 * np.abs(exact)
  assert np.all(np.abs(y - exact) <= bound), float(np.max(np.abs(y - exact) / bound))
  twice = np.asarray((ops.linear(x, w, lcfg).astype(jnp.float32) + b32.astype(jnp.bfloat16).astype(jnp.float32))
                     .astype(jnp.bfloat16), np.float64)
  assert np.any(np.abs(twice - exact) > bound)  # rounding the GEMM to BF16 before the add: two roundings
  np.testing.assert_array_equal(_bits(ops.linear(x, w, lcfg, bias=b32)),
                                _bits(ops.linear(x, w, lcfg, bias=b32.astype(jnp.bfloat16))))
  assert ops.linear(x, w, lcfg, bias=b32).dtype == jnp.bfloat16
  np.testing.assert_array_equal(_bits(ops.linear(x, w, lcfg)), _bits(ops.linear(x, w, lcfg, bias=None)))
  dy = jnp.asarray(rng.standard_normal((64, 320)), jnp.bfloat16)
  db = jax.grad(lambda b: jnp.sum(ops.linear(x, w, lcfg, bias=b).astype(jnp.float32) * dy))(b32)
  np.testing.assert_allclose(np.asarray(db), np.asarray(dy, np.float32).sum(0), rtol=2**-8, atol=1e-3)
  with pytest.raises(ValueError, match=r"linear: bias must be \(N,\) = \(320,\) for weight \(320, 192\).*got shape "
                                       r"\(192,\)"):
    ops.linear(x, w, lcfg, bias=b32[:192])


def test_fused_qkv_carries_the_biases(monkeypatch):
  """Where q/k/v fuse into one GEMM (the sampler on Hopper), their biases are concatenated alike ("bq+bk+bv") and
  added inside the fused ``ops.linear``; the forward on fused params agrees with the separate projections (to FP32
  rounding on XLA:CPU, whose blocking follows N; bitwise on Hopper, tests/test_fuse.py), and a layer that holds the
  fused weight with separate biases is refused rather than run without them."""
  monkeypatch.setattr(fuse, "_on_kernels", lambda w, lcfg: True)  # ``fusable`` as on a Hopper GPU
  cfg = ModelConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=128, ffn_dim=384,
                    attn_bias=True)
  master = llama.init_params(cfg, seed=3, std=0.1)
  keys = iter(jax.random.split(jax.random.key(4), 3 * cfg.n_layers))
  master["layers"] = [{k: (0.5 * jax.random.normal(next(keys), v.shape) if k in BIASES else v) for k, v in p.items()}
                      for p in master["layers"]]
  p = smp.prepare_params(master, recipes.Recipe(mode="bf16"))  # the bias path is the same for QWeight groups
  lin = ops.LinearConfig()
  f = fuse.fuse_layers(p, lin)
  for lp, lf in zip(p["layers"], f["layers"]):
    assert not set(BIASES) & set(lf) and "wq+wk+wv" in lf
    np.testing.assert_array_equal(_bits(lf["bq+bk+bv"]), _bits(jnp.concatenate([lp[b] for b in BIASES])))
  toks = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  fwd = jax.jit(lambda params: llama.forward(params, toks, cfg)[0])
  sep, fused = (np.asarray(fwd(q), np.float32) for q in (p, f))
  unbiased = np.asarray(fwd(_no_biases(p)), np.float32)
  np.testing.assert_allclose(fused, sep, atol=0.02, rtol=0.02)
  assert np.max(np.abs(unbiased - sep)) > 0.5  # the biases move the hidden states by O(1): the check above sees them
  bad = {**f["layers"][0], **{b: p["layers"][0][b] for b in BIASES}}
  del bad["bq+bk+bv"]
  with pytest.raises(ValueError, match=r"fused weight 'wq\+wk\+wv' but its biases \('bq', 'bk', 'bv'\) apart"):
    fuse.project(bad, jnp.ones((3, cfg.dim), jnp.bfloat16), ("wq", "wk", "wv"), (cfg.q_dim, cfg.kv_dim, cfg.kv_dim),
                 lin)


# ------------------------------------------------------------------------------------------------------------------
# Refused configurations
# ------------------------------------------------------------------------------------------------------------------


def _config_only(tmp_path, **c) -> str:
  d = tmp_path / "cfg"
  d.mkdir()
  json.dump(c, open(d / "config.json", "w"))
  return str(d)


def test_sliding_window_and_other_biases_refused(dirs, tmp_path):
  """use_sliding_window=True (fp8jax attends over every earlier token) is refused naming the key; Llama's
  attention_bias (which biases o_proj too) stays refused; attn_bias has no MLA form, and no HF architecture with
  QK-norm."""
  d = str(tmp_path / "sw")
  shutil.copytree(dirs["tied"], d)
  c = json.load(open(os.path.join(d, "config.json")))
  c.update(use_sliding_window=True, sliding_window=16)
  json.dump(c, open(os.path.join(d, "config.json"), "w"))
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: key 'use_sliding_window' = True is not supported "
                                                 r"\(fp8jax needs False; fp8jax has no sliding-window attention"):
    hf.load_config(d)
  llama_dir = _config_only(tmp_path, architectures=["LlamaForCausalLM"], attention_bias=True, hidden_size=64,
                           num_attention_heads=2, num_hidden_layers=1, vocab_size=32, intermediate_size=128)
  with pytest.raises(hf.HFCheckpointError, match=r"key 'attention_bias' = True is not supported"):
    hf.load_config(llama_dir)
  with pytest.raises(ValueError, match=r"model\.attn_bias .* needs GQA attention, got MLA"):
    ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=96, ffn_dim=128,
                kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, attn_bias=True)
  cfg = ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=128,
                    attn_bias=True, qk_norm=True)
  with pytest.raises(hf.HFCheckpointError, match=r"model\.attn_bias=True with model\.qk_norm=True.*no HF "
                                                 r"architecture"):
    hf.hf_config_dict(cfg)
