"""A llama.cpp GGUF file (architecture ``llama``) -> a Hugging Face directory fp8jax and transformers load.

  ``convert(gguf_path, out_dir, license_note=None) -> dict``  writes into ``out_dir`` (which must exist):
      config.json             LlamaForCausalLM; every field from the GGUF metadata (``llama.*`` keys, ids of the
                              ``tokenizer.ggml.*`` keys); tie_word_embeddings when the file has no output.weight
      model.safetensors       BF16, every tensor dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0,
                              Q4_0/1, Q5_0/1, the K-quants, ...: whatever gguf-py dequantizes), written one tensor
                              at a time (model-0000i-of-0000n.safetensors + index above ``max_shard_bytes``)
      tokenizer.json          byte-level BPE (``tokenizer.ggml.model`` "gpt2") from the GGUF's tokens and merges,
                              with the pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre``; control tokens
                              (token_type 3) are special added tokens, user-defined ones (4) plain added tokens
      tokenizer_config.json   chat_template (``tokenizer.chat_template``), bos/eos/pad/unk tokens, add_bos/eos
      generation_config.json  bos/eos/pad ids (eos: ``tokenizer.ggml.eos_token_id``, plus eot/eom where given)
      LICENSE                 ``license_note`` (or a note made from ``general.license``)
  returns a summary (files, tensor types, seconds).

The one transformation beyond dequantizing: llama.cpp's HF -> GGUF converter reorders the rows of every head of
``attn_q`` and ``attn_k`` for its rotary embedding, which rotates adjacent pairs (x[2i], x[2i+1]) where
transformers rotates halves (x[i], x[i + d/2]). Within a head of d rows, GGUF row ``2 i + j`` (j in {0, 1}) holds
HF row ``j d/2 + i``; ``_unpermute_heads`` puts the rows back (attn_q with the query head count, attn_k with the
key/value head count).

Every problem raises ``GGUFError`` naming the file: not a GGUF, truncated, another architecture, a metadata key
missing, a tensor name or quantization type this converter does not know, a shape the metadata contradicts.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# llama.cpp tensor name -> HF tensor name (blk.{i}. -> model.layers.{i}.)
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# tokenizer.ggml.pre -> whether llama.cpp splits every digit off before its GPT-2 regex (llama-vocab.cpp: the
# "\p{N}" expression in front for these pre-types; the GPT-2 regex alone for the second group).
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_PRE_GPT2 = {"gpt-2", "mpt", "olmo", "jais"}

# GGUF token_type values (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


class GGUFError(ValueError):
  """A GGUF file this converter cannot turn into an HF directory (the message names the file)."""


# ------------------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------------------


def open_gguf(path: str):
  """gguf.GGUFReader over ``path``, with a truncated or malformed file reported as a GGUFError naming it."""
  import gguf  # noqa: PLC0415

  if not os.path.isfile(path):
    raise GGUFError(f"{path}: file not found")
  size = os.path.getsize(path)
  try:
    reader = gguf.GGUFReader(path, "r")
  except Exception as e:  # noqa: BLE001  (struct/numpy/value errors of a short or corrupt header)
    raise GGUFError(f"{path}: not a readable GGUF file ({size} bytes; {type(e).__name__}: {e}); truncated or "
                    f"corrupt?") from e
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size or int(t.data.nbytes) != int(t.n_bytes):
      raise GGUFError(f"{path}: truncated: tensor '{t.name}' needs bytes up to {end}, the file has {size}")
  return reader


_MISSING = object()


def _meta(reader, key: str, path: str, default=_MISSING):
  f = reader.fields.get(key)
  if f is None:
    if default is _MISSING:
      raise GGUFError(f"{path}: metadata key '{key}' is missing")
    return default
  try:
    return f.contents()
  except Exception as e:  # noqa: BLE001
    raise GGUFError(f"{path}: metadata key '{key}' cannot be read ({type(e).__name__}: {e})") from e


def hf_tensor_name(name: str, path: str) -> str:
  """The transformers name of a llama.cpp tensor; anything else raises naming it."""
  if name in _TOP:
    return _TOP[name]
  m = _BLOCK_RE.fullmatch(name)
  if m and m.group(2) in _LAYER:
    return f"model.layers.{int(m.group(1))}.{_LAYER[m.group(2)]}.weight"
  raise GGUFError(f"{path}: tensor '{name}' is not one this converter knows (llama: token_embd, output_norm, "
                  f"output, blk.N.{{{', '.join(_LAYER)}}}; weights only)")


def _unpermute_heads(w: np.ndarray, n_heads: int) -> np.ndarray:
  """GGUF's pair-interleaved rows of each head (2 i + j) back to transformers' halves (j d/2 + i)."""
  rows = w.shape[0]
  if rows % n_heads or (rows // n_heads) % 2:
    raise ValueError(f"{rows} rows do not split into {n_heads} heads of an even size")
  d = rows // n_heads
  return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader, path: str) -> dict:
  """config.json of a LlamaForCausalLM from the GGUF metadata."""
  arch = _meta(reader, "general.architecture", path)
  if arch != "llama":
    raise GGUFError(f"{path}: general.architecture = {arch!r} is not supported (this converter reads 'llama')")
  g = lambda k, d=_MISSING: _meta(reader, f"llama.{k}", path, d)  # noqa: E731
  dim, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
  n_kv = int(g("attention.head_count_kv", n_heads))
  head_dim = int(g("attention.key_length", dim // n_heads))
  if int(g("attention.value_length", head_dim)) != head_dim:
    raise GGUFError(f"{path}: llama.attention.value_length != key_length is not supported")
  rot = int(g("rope.dimension_count", head_dim))
  if rot != head_dim:
    raise GGUFError(f"{path}: llama.rope.dimension_count = {rot} (partial rotary) is not supported; head_dim is "
                    f"{head_dim}")
  scaling = g("rope.scaling.type", "none")
  if scaling not in ("none", None, ""):
    raise GGUFError(f"{path}: llama.rope.scaling.type = {scaling!r} is not supported (plain RoPE only)")
  tokens = _meta(reader, "tokenizer.ggml.tokens", path, None)
  vocab = int(g("vocab_size", len(tokens) if tokens is not None else _MISSING))
  tied = not any(t.name == "output.weight" for t in reader.tensors)
  theta = _f32(g("rope.freq_base", 10000.0))
  c = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
      "hidden_size": dim, "intermediate_size": int(g("feed_forward_length")),
      "num_hidden_layers": int(g("block_count")), "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
      "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon")),
      "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
      "max_position_embeddings": int(g("context_length")), "tie_word_embeddings": tied,
      "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "dtype": "bfloat16",
  }
  for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
    v = _meta(reader, f"tokenizer.ggml.{key}", path, None)
    if v is not None:
      c[hf_key] = int(v)
  return c


def _f32(x) -> float:
  """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not 9.999999747378752e-06)."""
  return float(str(np.float32(x)))


def _expected_shape(hf_name: str, c: dict) -> tuple[int, ...]:
  dim, hd, ffn, v = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
  if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
    return (v, dim)
  if hf_name.endswith("norm.weight"):
    return (dim,)
  kind = hf_name.split(".")[-2]
  return {"q_proj": (c["num_attention_heads"] * hd, dim), "k_proj": (c["num_key_value_heads"] * hd, dim),
          "v_proj": (c["num_key_value_heads"] * hd, dim), "o_proj": (dim, c["num_attention_heads"] * hd),
          "gate_proj": (ffn, dim), "up_proj": (ffn, dim), "down_proj": (dim, ffn)}[kind]


def _dequantize(t, path: str, data) -> np.ndarray:
  from gguf import quants  # noqa: PLC0415

  try:
    return np.asarray(quants.dequantize(data, t.tensor_type), dtype=np.float32)
  except NotImplementedError as e:
    raise GGUFError(f"{path}: tensor '{t.name}' has type {t.tensor_type.name}, which gguf-py cannot dequantize "
                    f"({e})") from e


def check_dequantizable(t, path: str) -> None:
  """Dequantizes the first row of ``t`` (so an unknown type fails before anything is written)."""
  _dequantize(t, path, t.data.reshape(-1, t.data.shape[-1])[:1])


def dequantized(t, path: str, c: dict) -> np.ndarray:
  """One GGUF tensor as float32 in transformers' layout (q/k rows un-permuted)."""
  name = t.name
  w = _dequantize(t, path, t.data)
  shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 (the contiguous dim) first
  w = w.reshape(shape)
  if name.startswith("blk.") and ".attn_q." in name:
    w = _unpermute_heads(w, c["num_attention_heads"])
  elif name.startswith("blk.") and ".attn_k." in name:
    w = _unpermute_heads(w, c["num_key_value_heads"])
  return w


# ------------------------------------------------------------------------------------------------------------------
# Writing safetensors one tensor at a time
# ------------------------------------------------------------------------------------------------------------------


def _write_streamed_safetensors(file: str, items: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]):
  """A safetensors file of BF16 tensors whose header is written first and each tensor's bytes as it is made."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, _ in items:
    n = int(np.prod(shape, dtype=np.int64)) * BF16.itemsize
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
  hb = json.dumps(header, separators=(",", ":")).encode()
  hb += b" " * (-len(hb) % 8)
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for name, shape, get in items:
      a = get()
      if a.shape != tuple(shape) or a.dtype != BF16:
        raise AssertionError(f"{file}: {name} came out {a.shape} {a.dtype}, expected {shape} bfloat16")
      f.write(memoryview(np.ascontiguousarray(a).view(np.uint16)))  # bf16 bits, little-endian (x86/arm)
      del a


def _shards(items, max_shard_bytes: int) -> list[list]:
  shards, cur, size = [], [], 0
  for it in items:
    n = int(np.prod(it[1], dtype=np.int64)) * BF16.itemsize
    if cur and size + n > max_shard_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(it)
    size += n
  shards.append(cur)
  return shards


# ------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------------


def tokenizer_from_gguf(reader, path: str):
  """(tokenizers.Tokenizer, tokenizer_config dict, special ids) from the GGUF's ``tokenizer.*`` metadata."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415

  model = _meta(reader, "tokenizer.ggml.model", path)
  if model != "gpt2":
    raise GGUFError(f"{path}: tokenizer.ggml.model = {model!r} is not supported (this converter builds byte-level "
                    f"BPE tokenizers: 'gpt2')")
  pre = _meta(reader, "tokenizer.ggml.pre", path, "gpt-2")
  if pre not in _PRE_DIGITS | _PRE_GPT2:
    raise GGUFError(f"{path}: tokenizer.ggml.pre = {pre!r} is not supported (known: "
                    f"{sorted(_PRE_DIGITS | _PRE_GPT2)})")
  tokens = list(_meta(reader, "tokenizer.ggml.tokens", path))
  types = list(_meta(reader, "tokenizer.ggml.token_type", path, [_TOKEN_NORMAL] * len(tokens)))
  if len(types) != len(tokens):
    raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
  vocab = {}
  for i, tok in enumerate(tokens):
    if tok in vocab:
      raise GGUFError(f"{path}: tokenizer.ggml.tokens lists {tok!r} twice (ids {vocab[tok]} and {i})")
    vocab[tok] = i
  merges = []
  for k, m in enumerate(_meta(reader, "tokenizer.ggml.merges", path)):
    parts = m.split(" ")
    if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
      raise GGUFError(f"{path}: tokenizer.ggml.merges[{k}] = {m!r} is not two tokens of the vocabulary")
    merges.append((parts[0], parts[1]))

  tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                       if pre in _PRE_DIGITS else byte_level)
  tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
  special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
             if t == _TOKEN_CONTROL]
  user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
          if t == _TOKEN_USER_DEFINED]
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)

  ids = {}
  for key in ("bos", "eos", "unknown", "padding", "eot", "eom"):
    v = _meta(reader, f"tokenizer.ggml.{key}_token_id", path, None)
    if v is not None:
      if not 0 <= int(v) < len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.{key}_token_id = {v} is outside the {len(tokens)} tokens")
      ids[key] = int(v)
  add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", path, False))
  add_eos = bool(_meta(reader, "tokenizer.ggml.add_eos_token", path, False))
  for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
    if flag and key not in ids:
      raise GGUFError(f"{path}: tokenizer.ggml.add_{key}_token is set but tokenizer.ggml.{key}_token_id is missing")
  if add_bos or add_eos:
    b = [tokens[ids["bos"]]] if add_bos else []
    e = [tokens[ids["eos"]]] if add_eos else []
    single = " ".join(b + ["$A"] + e)
    pair = " ".join(b + ["$A"] + e + b + ["$B"] + e)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(tokens[ids[k]], ids[k]) for k in dict.fromkeys(
            (["bos"] if add_bos else []) + (["eos"] if add_eos else []))])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

  tc = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False}
  for key, hf_key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
    if key in ids:
      tc[hf_key] = tokens[ids[key]]
  ctx = _meta(reader, "llama.context_length", path, None)
  if ctx is not None:
    tc["model_max_length"] = int(ctx)
  template = _meta(reader, "tokenizer.chat_template", path, None)
  if template is not None:
    tc["chat_template"] = template
  return tok, tc, ids


# ------------------------------------------------------------------------------------------------------------------
# Converting
# ------------------------------------------------------------------------------------------------------------------


def convert(gguf_path: str, out_dir: str, *, license_note: str | None = None,
            max_shard_bytes: int = 5 * 2**30) -> dict:
  """Writes the HF directory of ``gguf_path`` into the existing ``out_dir``; returns a summary (see module doc)."""
  t0 = time.perf_counter()
  path = gguf_path
  reader = open_gguf(path)
  c = config_from_gguf(reader, path)
  tok, tc, ids = tokenizer_from_gguf(reader, path)
  if tok.get_vocab_size(with_added_tokens=True) != c["vocab_size"]:
    raise GGUFError(f"{path}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                    f"llama.vocab_size says {c['vocab_size']}")

  by_hf, types = {}, {}
  for t in reader.tensors:
    hf_name = hf_tensor_name(t.name, path)
    m = _BLOCK_RE.fullmatch(t.name)
    if m and int(m.group(1)) >= c["num_hidden_layers"]:
      raise GGUFError(f"{path}: tensor '{t.name}' is beyond llama.block_count = {c['num_hidden_layers']}")
    shape = tuple(int(s) for s in reversed(t.shape))
    want = _expected_shape(hf_name, c)
    if shape != want:
      raise GGUFError(f"{path}: tensor '{t.name}' has shape {shape}, the metadata implies {want}")
    if hf_name in by_hf:
      raise GGUFError(f"{path}: tensor '{t.name}' appears twice")
    check_dequantizable(t, path)
    by_hf[hf_name] = t
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
  needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
      f"model.layers.{i}.{m}.weight" for i in range(c["num_hidden_layers"]) for m in _LAYER.values()]
  missing = [n for n in needed if n not in by_hf]
  if missing:
    raise GGUFError(f"{path}: tensors missing for {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                    f"({len(missing)} in all)")

  def getter(t):
    def get():
      w = dequantized(t, path, c)
      if not np.isfinite(w).all():
        raise GGUFError(f"{path}: tensor '{t.name}' has NaN or inf values")
      return w.astype(BF16)
    return get

  items = [(n, _expected_shape(n, c), getter(by_hf[n])) for n in sorted(by_hf, key=_hf_order)]
  shards = _shards(items, max_shard_bytes)
  files = []
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    _write_streamed_safetensors(os.path.join(out_dir, fname), shard)
    files.append(fname)
    weight_map.update({n: fname for n, _, _ in shard})
  if len(shards) > 1:
    total = sum(int(np.prod(s, dtype=np.int64)) * BF16.itemsize for _, s, _ in items)
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    files.append("model.safetensors.index.json")

  _write_json(os.path.join(out_dir, "config.json"), c)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  _write_json(os.path.join(out_dir, "tokenizer_config.json"), tc)
  eos = [ids["eos"]] if "eos" in ids else []
  eos += [ids[k] for k in ("eot", "eom") if k in ids and ids[k] not in eos]
  gen = {k: v for k, v in (("bos_token_id", ids.get("bos")), ("pad_token_id", ids.get("padding"))) if v is not None}
  if eos:
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
  _write_json(os.path.join(out_dir, "generation_config.json"), gen)
  if license_note is None:
    name = _meta(reader, "general.name", path, "this model")
    lic = _meta(reader, "general.license", path, "not stated in the GGUF metadata")
    license_note = (f"{name}: license {lic} (GGUF metadata general.license). Converted to this directory from "
                    f"{os.path.basename(path)} by fp8jax.gguf_convert.\n")
  with open(os.path.join(out_dir, "LICENSE"), "w") as f:
    f.write(license_note)
  files += ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE"]
  return {"files": files, "tensors": len(items), "tensor_types": types,
          "general.name": _meta(reader, "general.name", path, None), "seconds": round(time.perf_counter() - t0, 2)}


def _hf_order(name: str):
  m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
  return (1, int(m.group(1)), m.group(2)) if m else ((0, 0, name) if "embed" in name else (2, 0, name))


def _write_json(file: str, d: dict):
  with open(file, "w") as f:
    json.dump(d, f, indent=2, ensure_ascii=False)
    f.write("\n")
