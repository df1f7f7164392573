"""Hugging Face checkpoints in and out: config, safetensors weights, tokenizer; BF16 and block-FP8 export.

Import (a local HF directory; nothing is downloaded):
  ``load_config(dir) -> ModelConfig``    config.json of a LlamaForCausalLM (plain or "llama3" RoPE), Qwen2ForCausalLM
                                         (Qwen2 / Qwen2.5: q/k/v biases, no sliding window), Qwen3ForCausalLM,
                                         Qwen3MoeForCausalLM (Qwen3-30B-A3B and the like) or DeepseekV3ForCausalLM
                                         (Moonlight-16B-A3B, DeepSeek-V3: MLA, noaux_tc MoE, YaRN; model_type
                                         "deepseek_v3"; its multi-token-prediction layers are skipped on load).
  ``load_params(dir, cfg, dtype=, shardings=)``  safetensors (single file or sharded through the index), read one
                                         tensor at a time and placed directly with its target sharding, so an 8B
                                         model never has two full copies in host memory. Block-FP8 checkpoints
                                         (``weight_scale_inv`` next to an E4M3 ``weight``) load as master weights
                                         that fp8jax's quantizer maps back to exactly the stored codes and scales
                                         (``block_fp8_master``), so export -> import -> export is exact.
                                         MoE experts are one tensor per expert on disk (``mlp.experts.{e}.gate_proj``,
                                         what save_pretrained and the Hub checkpoints hold), stacked into the schema's
                                         (E, out, in) leaves on load and cut back into experts on export.
  ``load_tokenizer(dir) -> Tokenizer``   tokenizer.json + tokenizer_config.json through ``tokenizers`` and jinja2,
                                         rendering chat templates the way transformers does.
Export:
  ``export_bf16(params, cfg, out_dir, tokenizer_dir=)``  config + BF16 safetensors (+ index) + tokenizer files.
  ``export_fp8(params, cfg, recipe, out_dir, tokenizer_dir=)``  block-FP8 in the DeepSeek-V3 / vLLM convention:
      E4M3 ``weight`` (out, in) + FP32 ``weight_scale_inv`` (ceil(out/128), ceil(in/128)), dequant = q * s, made by
      ``recipes.quantize_params`` — the very call the sampler runs on, so what is served is what was sampled.
      Layers with a dimension that is not a multiple of 128 are written in BF16 unless ``ragged_fp8=True``:
      transformers 5.17 misreads their ceil-sized scale grid (refuses it, or reads 144x96 as 72x96 blocks).
Pickle (``pytorch_model*.bin``) checkpoints are refused: loading them runs arbitrary code.

Every bad input raises with one message naming the file and the key: names, shapes and dtypes (floating point
only) before any weight is read; a truncated file when its header is read; NaN/inf values when the tensor is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8jax import quant, recipes
from fp8jax.model import llama, schema
from fp8jax.model.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}
# Files a tokenizer may consist of (copied verbatim on export when present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "added_tokens.json", "generation_config.json")

# fp8jax layer param -> HF module inside "model.layers.{i}." (a linear's tensor is "<module>.weight").
HF_LAYER_MODULES = schema.HF_LAYER_MODULES  # fp8jax key -> transformers module (fp8jax.model.schema)
HF_TOP_MODULES = schema.HF_TOP_MODULES
# Tensors some checkpoints carry that are not parameters (recomputed buffers); skipped on load.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFCheckpointError(ValueError):
  """A Hugging Face directory fp8jax cannot load as asked (the message names the file and the key)."""


# ------------------------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: file not found")
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise HFCheckpointError(f"{path}: not valid JSON ({e})") from e


def _architecture(c: dict, path: str) -> str:
  archs = c.get("architectures") or []
  known = [a for a in archs if a in ARCHITECTURES]
  if known:
    return known[0]
  if not archs and c.get("model_type") in ARCHITECTURES.values():
    return {v: k for k, v in ARCHITECTURES.items()}[c["model_type"]]
  raise HFCheckpointError(f"{path}: key 'architectures' = {archs or c.get('model_type')!r} is not supported "
                          f"(fp8jax loads {sorted(ARCHITECTURES)})")


def _rope(c: dict, path: str, yarn_ok: bool = False) -> tuple[float, tuple | None, tuple | None]:
  """(rope_theta, ModelConfig.rope_scaling, ModelConfig.rope_yarn) from transformers-5 ``rope_parameters`` or
  legacy ``rope_scaling``. YaRN only where ``yarn_ok`` (DeepSeek-V3: fp8jax applies its attention factor in MLA)."""
  if c.get("rope_parameters"):
    key, rp = "rope_parameters", dict(c["rope_parameters"])
  else:
    key, rp = "rope_scaling", dict(c.get("rope_scaling") or {})
  theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
  rope_type = rp.get("rope_type", rp.get("type", "default"))
  if rope_type in ("default", None):
    return theta, None, None
  if rope_type == "yarn" and yarn_ok:
    return theta, None, _yarn(rp, key, path)
  if rope_type != "llama3":
    raise HFCheckpointError(f"{path}: key '{key}.rope_type' = {rope_type!r} is not supported "
                            f"(fp8jax supports 'default' and 'llama3'" + (", and 'yarn' for DeepSeek-V3)" if yarn_ok
                                                                          else ")"))
  try:
    scaling = (float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"]),
               int(rp["original_max_position_embeddings"]))
  except KeyError as e:
    raise HFCheckpointError(f"{path}: key '{key}.{e.args[0]}' is missing (needed by rope_type 'llama3')") from None
  return theta, scaling, None


def _yarn(rp: dict, key: str, path: str) -> tuple:
  """ModelConfig.rope_yarn from an HF "yarn" rope dict (transformers' ``_compute_yarn_parameters`` keys)."""
  for k in ("factor", "original_max_position_embeddings"):
    if rp.get(k) is None:
      raise HFCheckpointError(f"{path}: key '{key}.{k}' is missing (needed by rope_type 'yarn')")
  if rp.get("attention_factor") is not None:
    raise HFCheckpointError(f"{path}: key '{key}.attention_factor' = {rp['attention_factor']!r} is not supported "
                            f"(fp8jax derives YaRN's attention factor from factor, mscale and mscale_all_dim)")
  if rp.get("truncate", True) is not True:
    raise HFCheckpointError(f"{path}: key '{key}.truncate' = {rp['truncate']!r} is not supported (fp8jax: true)")
  if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
    raise HFCheckpointError(f"{path}: key '{key}.partial_rotary_factor' = {rp['partial_rotary_factor']!r} is not "
                            f"supported (fp8jax: 1.0)")
  return (float(rp["factor"]), int(rp["original_max_position_embeddings"]), float(rp.get("beta_fast") or 32),
          float(rp.get("beta_slow") or 1), float(rp.get("mscale") or 0.0), float(rp.get("mscale_all_dim") or 0.0))


# transformers 5.17 DeepseekV3Config defaults, used where a config.json leaves a key out (as transformers does).
_DEEPSEEK_V3_DEFAULTS = {"n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
                         "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                         "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_interleave": True,
                         "moe_intermediate_size": 2048}
# Keys of DeepSeek checkpoints' own config (modeling_deepseek.py) that transformers ignores; fp8jax implements one
# value of each and refuses others rather than silently computing another model.
_DEEPSEEK_V3_FIXED = (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1))


def _deepseek_v3(c: dict, path: str, n_layers: int) -> dict:
  """The MLA and MoE fields of ModelConfig from a DeepseekV3 config.json."""
  for key, ok in _DEEPSEEK_V3_FIXED:
    if key in c and c[key] not in (ok, None):
      raise HFCheckpointError(f"{path}: key '{key}' = {c[key]!r} is not supported (fp8jax implements {ok!r})")
  g = lambda k: c[k] if c.get(k) is not None else _DEEPSEEK_V3_DEFAULTS[k]  # noqa: E731
  n_exp = c.get("n_routed_experts", c.get("num_local_experts"))
  nope, rope = int(g("qk_nope_head_dim")), int(g("qk_rope_head_dim"))
  for key in ("n_group", "topk_group"):
    if key in c and c[key] is None:
      raise HFCheckpointError(f"{path}: key '{key}' = None is not supported (noaux_tc routing needs an integer)")
  q_lora = c["q_lora_rank"] if "q_lora_rank" in c else _DEEPSEEK_V3_DEFAULTS["q_lora_rank"]  # null: no q LoRA
  return dict(
      head_dim=nope + rope, kv_lora_rank=int(g("kv_lora_rank")), q_lora_rank=int(q_lora or 0),
      qk_nope_head_dim=nope, qk_rope_head_dim=rope,
      v_head_dim=int(g("v_head_dim")), rope_interleave=bool(g("rope_interleave")),
      n_experts=int(n_exp if n_exp is not None else _DEEPSEEK_V3_DEFAULTS["n_routed_experts"]),
      n_experts_per_tok=int(g("num_experts_per_tok")), moe_ffn_dim=int(g("moe_intermediate_size")),
      norm_topk_prob=bool(g("norm_topk_prob")), moe_router="sigmoid", n_group=int(g("n_group")),
      topk_group=int(g("topk_group")), routed_scaling_factor=float(g("routed_scaling_factor")),
      n_shared_experts=int(g("n_shared_experts")),
      # DeepseekV3DecoderLayer: layer i is MoE iff i >= first_k_dense_replace
      mlp_only_layers=tuple(range(min(int(g("first_k_dense_replace")), n_layers))))


def load_config(hf_dir: str, *, dtype: str = "bfloat16", max_seq_len: int | None = None) -> ModelConfig:
  """config.json of a local HF directory -> ModelConfig (``dtype``: compute dtype of the fp8jax model)."""
  path = os.path.join(hf_dir, CONFIG_FILE)
  c = _read_json(path)
  arch = _architecture(c, path)
  family = ARCHITECTURES[arch]
  # Qwen2 always has q/k/v biases (transformers ignores an attention_bias key there); elsewhere attention_bias would
  # also bias o_proj, which fp8jax does not implement.
  why = {"use_sliding_window": "; fp8jax has no sliding-window attention: every layer attends to all earlier tokens"}
  for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                  ("use_sliding_window", False)):
    if key == "attention_bias" and family == "qwen2":
      continue
    if key in c and c[key] not in (ok, None):
      raise HFCheckpointError(f"{path}: key '{key}' = {c[key]!r} is not supported (fp8jax needs {ok!r}"
                              f"{why.get(key, '')})")

  qc = c.get("quantization_config")
  if qc and not (qc.get("quant_method") == "fp8" and list(qc.get("weight_block_size") or []) == [128, 128]):
    raise HFCheckpointError(f"{path}: key 'quantization_config' = {qc!r} is not supported (fp8jax reads BF16/FP32 "
                            f"checkpoints and block-FP8 ones with quant_method 'fp8', weight_block_size [128, 128])")

  def need(key):
    if key not in c:
      raise HFCheckpointError(f"{path}: key '{key}' is missing")
    return c[key]

  n_heads = int(need("num_attention_heads"))
  dim = int(need("hidden_size"))
  theta, scaling, yarn = _rope(c, path, yarn_ok=family == "deepseek_v3")
  moe = {"rope_yarn": yarn} if yarn else {}
  n_layers = int(need("num_hidden_layers"))
  if family == "deepseek_v3":
    moe.update(_deepseek_v3(c, path, n_layers))
  if family == "qwen3_moe":
    # transformers 5 writes the expert count as num_local_experts (num_experts is its alias); the Hub's num_experts.
    n_exp = c.get("num_experts", c.get("num_local_experts"))
    if n_exp is None:
      raise HFCheckpointError(f"{path}: key 'num_experts' is missing (nor is 'num_local_experts' there)")
    moe = dict(n_experts=int(n_exp), n_experts_per_tok=int(need("num_experts_per_tok")),
               moe_ffn_dim=int(need("moe_intermediate_size")),
               # transformers' Qwen3MoeConfig defaults: no renormalization, every layer sparse, no dense-only layers
               norm_topk_prob=bool(c.get("norm_topk_prob", False)),
               decoder_sparse_step=int(c.get("decoder_sparse_step", 1)),
               mlp_only_layers=tuple(c.get("mlp_only_layers") or ()))
  try:
    return ModelConfig(
        vocab_size=int(need("vocab_size")), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        **({} if family == "deepseek_v3" else {"head_dim": int(c.get("head_dim") or dim // n_heads)}),
        ffn_dim=int(need("intermediate_size")), norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"), attn_bias=family == "qwen2",
        max_seq_len=int(max_seq_len or c.get("max_position_embeddings", 8192)), dtype=dtype, **moe)
  except ValueError as e:  # ModelConfig's check, named by its field: say which file it came from
    raise HFCheckpointError(f"{path}: {e}") from None


def _hf_architecture(cfg: ModelConfig) -> str:
  if cfg.is_mla:
    k = len(cfg.mlp_only_layers)
    if (not cfg.n_experts or cfg.moe_router != "sigmoid" or cfg.mlp_only_layers != tuple(range(k))
        or cfg.decoder_sparse_step != 1):
      raise HFCheckpointError(
          f"export: an MLA model is a DeepseekV3ForCausalLM, which needs model.n_experts > 0, model.moe_router="
          f"'sigmoid', model.mlp_only_layers = (0, .., k-1) (first_k_dense_replace) and model.decoder_sparse_step=1;"
          f" got {cfg.n_experts}, {cfg.moe_router!r}, {cfg.mlp_only_layers}, {cfg.decoder_sparse_step}")
    return "DeepseekV3ForCausalLM"
  if cfg.moe_router != "softmax" or cfg.n_shared_experts:
    raise HFCheckpointError("export: model.moe_router='sigmoid' / model.n_shared_experts without MLA has no HF "
                            "architecture in fp8jax (DeepseekV3ForCausalLM has MLA)")
  if cfg.n_experts and not cfg.qk_norm:
    raise HFCheckpointError(f"export: model.n_experts={cfg.n_experts} with model.qk_norm=False has no HF "
                            f"architecture (Qwen3MoeForCausalLM always has q/k norms)")
  if cfg.attn_bias:
    if cfg.qk_norm or cfg.n_experts:
      raise HFCheckpointError(f"export: model.attn_bias=True with model.qk_norm={cfg.qk_norm}, model.n_experts="
                              f"{cfg.n_experts} has no HF architecture in fp8jax (Qwen2ForCausalLM: q/k/v biases, "
                              f"dense, no q/k norms)")
    return "Qwen2ForCausalLM"
  return "Qwen3MoeForCausalLM" if cfg.n_experts else "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def hf_config_dict(cfg: ModelConfig, *, extra: dict | None = None) -> dict:
  """ModelConfig -> an HF config.json dict (LlamaForCausalLM, Qwen2ForCausalLM when cfg.attn_bias, Qwen3ForCausalLM
  when cfg.qk_norm, or Qwen3MoeForCausalLM when cfg.n_experts)."""
  arch = _hf_architecture(cfg)
  if arch == "DeepseekV3ForCausalLM":
    return {**_deepseek_v3_config_dict(cfg), **(extra or {})}
  qwen, moe = cfg.qk_norm or cfg.attn_bias, cfg.n_experts > 0
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  legacy_scaling = None
  if cfg.rope_scaling is not None:
    f, lo, hi, ctx = cfg.rope_scaling
    legacy_scaling = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
                      "original_max_position_embeddings": ctx}
    rope = {**legacy_scaling, "rope_theta": cfg.rope_theta}
  d = {
      "architectures": [arch], "model_type": ARCHITECTURES[arch],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
      # Qwen2ForCausalLM has q/k/v biases whatever attention_bias says (transformers and vLLM do not read it there);
      # True says so to a reader, and fp8jax's load_config reads the architecture.
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attn_bias,
      # transformers >= 5 reads rope_parameters; older transformers and serving engines read the legacy keys.
      "rope_parameters": rope, "rope_theta": cfg.rope_theta, "rope_scaling": legacy_scaling,
      "dtype": "bfloat16", "torch_dtype": "bfloat16", "use_cache": True,
  }
  if moe:
    d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
             num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
             moe_intermediate_size=cfg.moe_ffn_dim, norm_topk_prob=cfg.norm_topk_prob,
             decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
             output_router_logits=False)
  elif qwen:
    d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
             layer_types=["full_attention"] * cfg.n_layers)
  else:
    d.update(mlp_bias=False)
  d.update(extra or {})
  return d


def _deepseek_v3_config_dict(cfg: ModelConfig) -> dict:
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_yarn is not None:
    f, ctx, fast, slow, ms, ms_all = cfg.rope_yarn
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": f, "original_max_position_embeddings": ctx,
            "beta_fast": fast, "beta_slow": slow, "mscale": ms, "mscale_all_dim": ms_all}
  return {
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "moe_intermediate_size": cfg.moe_ffn_dim,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "n_shared_experts": cfg.n_shared_experts, "n_routed_experts": cfg.n_experts,
      "routed_scaling_factor": cfg.routed_scaling_factor, "kv_lora_rank": cfg.kv_lora_rank,
      "q_lora_rank": cfg.q_lora_rank or None, "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "v_head_dim": cfg.v_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim, "head_dim": cfg.qk_rope_head_dim,
      "n_group": cfg.n_group, "topk_group": cfg.topk_group, "num_experts_per_tok": cfg.n_experts_per_tok,
      "first_k_dense_replace": len(cfg.mlp_only_layers), "norm_topk_prob": cfg.norm_topk_prob,
      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
      "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "rope_interleave": cfg.rope_interleave, "attention_bias": False,
      # transformers >= 5 reads rope_parameters; older transformers and serving engines the legacy keys
      "rope_parameters": rope, "rope_theta": cfg.rope_theta,
      "rope_scaling": None if cfg.rope_yarn is None else {k: v for k, v in rope.items() if k != "rope_theta"},
      "dtype": "bfloat16", "torch_dtype": "bfloat16", "use_cache": True,
  }


# ------------------------------------------------------------------------------------------------------------------
# Weights in
# ------------------------------------------------------------------------------------------------------------------


def hf_param_names(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
  """fp8jax path ("layers/3/wq", "embed") -> (HF tensor name, shape) of every tensor on disk, in params order.

  A stacked row (MoE experts, ``schema.Param.stacked``) is one tensor per expert on disk: its entries' paths end
  with the expert index ("layers/0/expert_gate/5" -> "model.layers.0.mlp.experts.5.gate_proj.weight", ``_parts``)
  and their shapes are one expert's.
  """
  out = {}

  def add(path: str, prefix: str, row: schema.Param):
    for e, (mod, shape) in enumerate(row.hf_tensors(cfg)):
      out[f"{path}/{e}" if row.stacked else path] = (f"{prefix}{mod}.{row.tensor}", shape)

  top = {p.key: p for p in schema.TOP if p.present(cfg, None)}
  add("embed", "", top.pop("embed"))
  for i in range(cfg.n_layers):
    for row in schema.LAYER:
      if row.present(cfg, i):
        add(f"layers/{i}/{row.key}", f"model.layers.{i}.", row)
  for key, row in top.items():
    add(key, "", row)
  return out


def _parts(path: str) -> tuple[str, str, int | None]:
  """"layers/0/expert_gate/5" -> ("layers/0/expert_gate", "expert_gate", 5): the leaf's path, its schema key and
  the expert index (None for a whole leaf)."""
  head, _, last = path.rpartition("/")
  if last.isdigit() and head.rpartition("/")[2] in schema.BY_KEY:
    return head, head.rpartition("/")[2], int(last)
  return path, last, None


def _leaf(tree, leaf_path: str):
  """The node of a params-shaped tree (params, shardings) at a leaf path ("layers/3/wq")."""
  node = tree
  for part in leaf_path.split("/"):
    node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
  return node


def _weight_files(hf_dir: str) -> tuple[str, dict[str, str] | None]:
  """(the file that lists the tensors, weight_map from the index or None for a single file)."""
  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index):
    wm = _read_json(index).get("weight_map")
    if not isinstance(wm, dict) or not wm:
      raise HFCheckpointError(f"{index}: key 'weight_map' is missing or empty")
    return index, wm
  single = os.path.join(hf_dir, SINGLE_FILE)
  if os.path.isfile(single):
    return single, None
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f"{hf_dir}: directory not found")
  bins = sorted(f for f in os.listdir(hf_dir) if f.endswith(".bin"))
  if bins:
    raise HFCheckpointError(f"{hf_dir}: only pickle weights found ({', '.join(bins)}); fp8jax loads safetensors "
                            f"only (pickle can run code). Re-save with save_pretrained(..., safe_serialization=True)")
  raise FileNotFoundError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _scan_tensors(hf_dir: str) -> tuple[str, dict[str, tuple[str, tuple[int, ...], str]]]:
  """Reads only the safetensors headers: HF name -> (file path, shape, safetensors dtype)."""
  listing, weight_map = _weight_files(hf_dir)
  files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
  found = {}
  for fname in files:
    path = os.path.join(hf_dir, fname)
    if not os.path.isfile(path):
      key = next(k for k, v in weight_map.items() if v == fname)
      raise FileNotFoundError(f"{path}: file not found (listed in {listing} for key '{key}')")
    with _open_safetensors(path) as f:
      for key in f.keys():
        sl = f.get_slice(key)
        found[key] = (path, tuple(sl.get_shape()), sl.get_dtype())
  if weight_map:
    for key, fname in weight_map.items():
      if key not in found:
        raise HFCheckpointError(f"{os.path.join(hf_dir, fname)}: key '{key}' listed in {listing} is not in the file")
  return listing, found


def _open_safetensors(path: str):
  """``safe_open`` whose errors (truncated file, bad header) name the file."""
  from safetensors import SafetensorError, safe_open  # noqa: PLC0415

  try:
    return safe_open(path, framework="np")
  except (SafetensorError, OSError) as e:
    raise HFCheckpointError(f"{path}: not a readable safetensors file ({e}); a truncated or interrupted download? "
                            f"Download it again") from None


# safetensors dtypes numpy cannot name (safetensors' numpy backend fails on them): read through ml_dtypes.
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
# What a weight may be stored as: floating point, or E4M3 codes with a weight_scale_inv (block FP8).
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_SCALE_DTYPES = ("F32", "BF16", "F16")


def _get_tensor(f, path: str, key: str, st_dtype: str) -> np.ndarray:
  """One tensor from an open safetensors file as a numpy array (FP8 through the file's header and a memmap)."""
  if st_dtype not in _RAW_DTYPES:
    return f.get_tensor(key)
  with open(path, "rb") as fh:
    n = int.from_bytes(fh.read(8), "little")
    meta = json.loads(fh.read(n))[key]
  start, end = meta["data_offsets"]
  if os.path.getsize(path) < 8 + n + end:
    raise HFCheckpointError(f"{path}: tensor '{key}' ends at byte {8 + n + end} but the file has "
                            f"{os.path.getsize(path)} (truncated); download it again")
  mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n + start, shape=(end - start,))
  return np.array(mm).view(_RAW_DTYPES[st_dtype]).reshape(meta["shape"])


def _check_finite(arr: np.ndarray, path: str, key: str):
  bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
  if bad:
    first = np.unravel_index(int(np.argmin(np.isfinite(arr).reshape(-1))), arr.shape)
    raise HFCheckpointError(f"{path}: tensor '{key}' has {bad} non-finite values (NaN/inf) of {arr.size}, the first "
                            f"at index {tuple(int(i) for i in first)}: the checkpoint is broken")


def _block_dequant_np(q_NxK: np.ndarray, s_NbxKb: np.ndarray) -> np.ndarray:
  n, k = q_NxK.shape
  s = np.repeat(np.repeat(s_NbxKb.astype(np.float32), quant.BLOCK, 0), quant.BLOCK, 1)[:n, :k]
  return q_NxK.astype(np.float32) * s


def _scale_np(amax: np.ndarray, pow2: bool) -> np.ndarray:
  """``quant._scale_from_amax`` in NumPy FP32 (the same IEEE operations, so the same bits)."""
  s = np.maximum(amax.astype(np.float32), np.float32(quant.AMAX_FLOOR)) * np.float32(quant.INV_E4M3_MAX)
  if pow2:
    bits = s.view(np.uint32)
    s = ((bits + np.uint32(0x7FFFFF)) & np.uint32(0xFF800000)).view(np.float32)
  return s


def block_fp8_master(q_NxK: np.ndarray, s_NbxKb: np.ndarray, *, pow2: bool = False, max_ulps: int = 8
                     ) -> tuple[np.ndarray, int]:
  """FP32 master weights that ``quant.quantize_weight(w, pow2)`` maps back to exactly ``(q, s)``, where possible.

  ``q * s`` requantizes to the same codes, but its block amax ``max|q| * s`` (one FP32 rounding) times fl(1/448)
  can land one ulp away from ``s`` (``quantize_weight(dequantize(quantize_weight(w)))`` is not ``quantize_weight
  (w)``: measured, 14-47 scales per tiny model). So in each such block the elements of largest |q| are moved by at
  most ``max_ulps`` FP32 ulps to the nearest value whose scale is ``s`` and whose code is unchanged (the block
  ``s`` was computed from had one). Returns ``(w, blocks that could not be matched)``: nonzero only for scales
  fp8jax's quantizer cannot produce (another tool's convention, e.g. amax / 448 by true division), which then
  requantize within an ulp. The caller checks the result against the real quantizer.
  """
  n, k = q_NxK.shape
  nb, kb = s_NbxKb.shape
  s = s_NbxKb.astype(np.float32)
  wp = np.zeros((nb * quant.BLOCK, kb * quant.BLOCK), np.float32)
  wp[:n, :k] = _block_dequant_np(q_NxK, s)
  w4 = wp.reshape(nb, quant.BLOCK, kb, quant.BLOCK)  # a view: edits reach wp
  amax = np.abs(w4).max(axis=(1, 3))
  todo = (_scale_np(amax, pow2) != s) & np.isfinite(amax) & (amax > 0)
  target = amax.copy()
  inv = np.float32(1.0) / s

  def e4m3_bits(a):
    return np.clip(a * inv, -quant.E4M3_MAX, quant.E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)

  code = e4m3_bits(amax)
  up, down = amax.copy(), amax.copy()
  for _ in range(max_ulps):  # nearest first: +d, then -d ulps
    up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
    for a in (up, down):
      ok = todo & (_scale_np(a, pow2) == s) & (e4m3_bits(a) == code)
      target = np.where(ok, a, target)
      todo &= ~ok
  move = target != amax
  if move.any():
    top = (np.abs(w4) == amax[:, None, :, None]) & move[:, None, :, None]
    w4[...] = np.where(top, np.copysign(np.broadcast_to(target[:, None, :, None], w4.shape), w4), w4)
  return wp[:n, :k].copy(), int(todo.sum())


def _sharding_for(shardings, path: str):
  if shardings is None:
    return None
  if callable(shardings):
    return shardings(path)
  return _leaf(shardings, path)


def load_params(hf_dir: str, cfg: ModelConfig, *, dtype=jnp.float32,
                shardings: Any | Callable[[str], Any] | None = None, pow2_scales: bool = False) -> dict:
  """HF safetensors -> fp8jax params (every leaf ``dtype``).

  ``shardings``: None (default device), a pytree with the params' structure, or a callable
  ``path -> sharding`` ("layers/3/wq"); each tensor goes straight from its file to ``jax.device_put`` with it.
  Checks every name, shape and dtype in the safetensors headers first; then reads one tensor at a time, refusing
  NaN/inf values. Block-FP8 tensors become ``block_fp8_master`` weights: with ``dtype`` float32 they requantize
  (``quant.quantize_weight(w, pow2_scales)``, the recipe's setting) to exactly the stored codes and scales, which
  is checked; blocks that cannot be matched (another tool's scale convention) are reported in a warning.
  """
  listing, found = _scan_tensors(hf_dir)
  wanted = hf_param_names(cfg)
  hf_to_path = {hf: path for path, (hf, _) in wanted.items()}
  scales = {k for k in found if k.endswith(".weight_scale_inv") and k[:-len("_scale_inv")] in hf_to_path}
  skipped = {k for k in found if k.endswith(_IGNORED_SUFFIXES)}
  if cfg.tie_embeddings and "lm_head.weight" in found:
    skipped.add("lm_head.weight")  # tied: the head is the embedding; some exporters write both
    log.warning("%s: 'lm_head.weight' ignored because tie_word_embeddings is true", found["lm_head.weight"][0])
  skipped |= _mtp_tensors(hf_dir, cfg, found)
  _check_experts(cfg, found, listing, os.path.join(hf_dir, CONFIG_FILE))
  for path, (hf, _) in wanted.items():
    if hf not in found:
      raise HFCheckpointError(f"{listing}: tensor '{hf}' is missing (fp8jax param {path})")
  unexpected = sorted(set(found) - set(hf_to_path) - scales - skipped)
  if unexpected:
    raise HFCheckpointError(f"{found[unexpected[0]][0]}: unexpected tensor '{unexpected[0]}'"
                            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
  for path, (hf, shape) in wanted.items():
    file, got, _ = found[hf]
    if got != shape:
      raise HFCheckpointError(f"{file}: tensor '{hf}' has shape {got}, config.json implies {shape} "
                              f"(fp8jax param {path})")
    sk = hf + "_scale_inv"
    if sk in found:
      want_s = tuple(quant.num_blocks(d) for d in shape)
      if found[sk][1] != want_s:
        raise HFCheckpointError(f"{found[sk][0]}: tensor '{sk}' has shape {found[sk][1]}, block-FP8 needs {want_s}")
      if found[sk][2] not in _SCALE_DTYPES:
        raise HFCheckpointError(f"{found[sk][0]}: tensor '{sk}' has dtype {found[sk][2]}; scales must be one of "
                                f"{_SCALE_DTYPES}")
    st_dtype = found[hf][2]
    if not (st_dtype in _FLOAT_DTYPES or (st_dtype == "F8_E4M3" and sk in found)):
      what = f"dtype {st_dtype}" + (f" without a '{sk}'" if st_dtype.startswith("F8") else "")
      raise HFCheckpointError(
          f"{file}: tensor '{hf}' has {what}; fp8jax loads floating-point weights ({', '.join(_FLOAT_DTYPES)}) and "
          f"block-FP8 ones (F8_E4M3 + weight_scale_inv), not integer or other quantized formats (fp8jax param {path})")

  np_dtype = jnp.dtype(dtype)
  by_file: dict[str, list[str]] = {}
  for hf in hf_to_path:
    by_file.setdefault(found[hf][0], []).append(hf)
  leaves: dict[str, jax.Array] = {}
  # Stacked rows (MoE experts): one host buffer per leaf, filled expert by expert (the experts of a layer may sit
  # in different shards), placed once complete; shards hold consecutive layers, so few buffers are open at once.
  stacks: dict[str, tuple[np.ndarray, set[int]]] = {}

  def place(leaf_path: str, arr: np.ndarray):
    sharding = _sharding_for(shardings, leaf_path)
    leaves[leaf_path] = jax.device_put(arr, sharding) if sharding is not None else jnp.asarray(arr)

  for file, keys in by_file.items():
    with _open_safetensors(file) as f:
      for hf in keys:
        arr = _get_tensor(f, file, hf, found[hf][2])
        sk = hf + "_scale_inv"
        if sk in scales:
          with _open_safetensors(found[sk][0]) as g:
            s = _get_tensor(g, found[sk][0], sk, found[sk][2])
          _check_finite(s, found[sk][0], sk)
          arr = _load_block_fp8(arr, s, file, hf, pow2_scales, exact=np_dtype == jnp.float32)
        _check_finite(arr, file, hf)
        leaf_path, key, expert = _parts(hf_to_path[hf])
        if expert is None:
          place(leaf_path, arr.astype(np_dtype, copy=False))
        else:
          buf, done = stacks.setdefault(leaf_path, (np.empty(schema.BY_KEY[key].shape(cfg), np_dtype), set()))
          buf[expert] = arr
          done.add(expert)
          if len(done) == buf.shape[0]:
            place(leaf_path, buf)
            del stacks[leaf_path]
        del arr
  params = {name: leaves[name] for name in ("embed", "final_norm", "lm_head") if name in leaves}
  params["layers"] = [{name: leaves[f"layers/{i}/{name}"] for name in layer}
                      for i, layer in enumerate(llama.param_shapes(cfg)["layers"])]
  return params


def _mtp_tensors(hf_dir: str, cfg: ModelConfig, found: dict) -> set[str]:
  """DeepSeek-V3 checkpoints append ``num_nextn_predict_layers`` multi-token-prediction layers after the decoder
  (model.layers.61 of DeepSeek-V3); transformers' DeepseekV3ForCausalLM does not build them and neither does fp8jax."""
  path = os.path.join(hf_dir, CONFIG_FILE)
  c = _read_json(path) if os.path.isfile(path) else {}
  n = int(c.get("num_nextn_predict_layers") or 0) if c.get("model_type") == "deepseek_v3" else 0
  prefixes = tuple(f"model.layers.{j}." for j in range(cfg.n_layers, cfg.n_layers + n))
  mtp = {k for k in found if k.startswith(prefixes)} if prefixes else set()
  if mtp:
    log.warning("%s: %d tensors of the %d multi-token-prediction layer(s) (model.layers.%d..) ignored", path, len(mtp),
                n, cfg.n_layers)
  return mtp


def _check_experts(cfg: ModelConfig, found: dict, listing: str, config_path: str):
  """Every stacked row of a MoE layer has exactly experts 0..n_experts-1 on disk, one tensor each."""
  want = set(range(cfg.n_experts))
  for i in range(cfg.n_layers):
    for row in (r for r in schema.LAYER if r.stacked and r.present(cfg, i)):
      template = f"model.layers.{i}.{row.hf}.weight"
      pattern = re.compile(re.escape(template).replace(re.escape(schema.EXPERT), r"(\d+)") + "$")
      have = {int(m.group(1)) for m in map(pattern.match, found) if m}
      if have == want:
        continue
      name = lambda e: template.replace(schema.EXPERT, str(e))  # noqa: E731
      if not have:
        stack = f"model.layers.{i}.{row.hf_stack}."
        other = sorted(k for k in found if k.startswith(stack))
        raise HFCheckpointError(
            f"{listing}: tensor '{name(0)}' is missing (fp8jax param layers/{i}/{row.key}/0)" + (
                f"; found '{other[0]}' instead: experts fused into one tensor (transformers' in-memory layout) are "
                f"not a checkpoint format fp8jax reads; save_pretrained writes one tensor per expert" if other else ""))
      if have - want or have == set(range(len(have))):  # another expert count, not a gap
        first = name(min(have - want)) if have - want else name(len(have))
        raise HFCheckpointError(
            f"{listing}: layer {i} has {len(have)} experts in '{template}' (indices {min(have)}..{max(have)}) but "
            f"{config_path} says num_experts={cfg.n_experts}: tensor '{first}' is "
            f"{'unexpected' if have - want else 'missing'}")
      e = min(want - have)
      raise HFCheckpointError(f"{listing}: tensor '{name(e)}' is missing (fp8jax param layers/{i}/{row.key}/{e})")


def _load_block_fp8(q: np.ndarray, s: np.ndarray, file: str, key: str, pow2: bool, exact: bool) -> np.ndarray:
  """Master weights of one block-FP8 tensor; checks that the quantizer reproduces (q, s) (see block_fp8_master)."""
  _check_finite(q.astype(np.float32), file, key)
  w, unmatched = block_fp8_master(q, s, pow2=pow2)
  if exact:
    got = quant.quantize_weight(jnp.asarray(w), pow2)
    same_s = np.asarray(got.scale) == s.astype(np.float32)
    same_q = np.asarray(got.q).view(np.uint8) == q.view(np.uint8)
    if not (same_s.all() and same_q.all()):
      log.warning("%s: tensor '%s': %d of %d scales and %d of %d codes are not reproduced exactly by fp8jax's "
                  "quantizer (pow2_scales=%s; a scale convention of another tool?): requantizing moves them by "
                  "about an ulp", file, key, int((~same_s).sum()), same_s.size, int((~same_q).sum()), same_q.size,
                  pow2)
  elif unmatched:
    log.warning("%s: tensor '%s': %d blocks cannot be matched exactly", file, key, unmatched)
  return w


# ------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------------


def _token_str(t) -> str | None:
  return t.get("content") if isinstance(t, dict) else t


def _eos_list(v) -> list[int]:
  if v is None:
    return []
  return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]


class Tokenizer:
  """A local HF tokenizer (``tokenizers`` backend) with its chat template and every eos id the model may emit."""

  def __init__(self, hf_dir: str):
    from tokenizers import Tokenizer as _Tok  # noqa: PLC0415

    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: file not found (fp8jax reads fast-tokenizer JSON files only)")
    self._tok = _Tok.from_file(path)
    tc_path = os.path.join(hf_dir, "tokenizer_config.json")
    tc = _read_json(tc_path) if os.path.isfile(tc_path) else {}
    stm_path = os.path.join(hf_dir, "special_tokens_map.json")
    stm = _read_json(stm_path) if os.path.isfile(stm_path) else {}
    self.special_tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
      t = _token_str(tc.get(name)) or _token_str(stm.get(name))
      if t is not None:
        self.special_tokens[name] = t
    self.chat_template = self._find_template(hf_dir, tc)
    eos = []
    if "eos_token" in self.special_tokens and self.token_to_id(self.special_tokens["eos_token"]) is not None:
      eos.append(self.token_to_id(self.special_tokens["eos_token"]))
    for fname in ("generation_config.json", CONFIG_FILE):
      p = os.path.join(hf_dir, fname)
      if os.path.isfile(p):
        eos += _eos_list(_read_json(p).get("eos_token_id"))
    self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
    self.bos_id = self.token_to_id(self.special_tokens.get("bos_token"))
    self.pad_id = self.token_to_id(self.special_tokens.get("pad_token"))

  @staticmethod
  def _find_template(hf_dir, tc) -> str | None:
    t = tc.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
      t = {d["name"]: d["template"] for d in t}.get("default")
    jinja_path = os.path.join(hf_dir, "chat_template.jinja")
    if t is None and os.path.isfile(jinja_path):
      with open(jinja_path) as f:
        t = f.read()
    json_path = os.path.join(hf_dir, "chat_template.json")
    if t is None and os.path.isfile(json_path):
      t = _read_json(json_path).get("chat_template")
    return t

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str | None) -> int | None:
    return None if token is None else self._tok.token_to_id(token)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
    """The chat template rendered as transformers renders it (same jinja2 environment and globals)."""
    if self.chat_template is None:
      raise HFCheckpointError("tokenizer has no chat template (tokenizer_config.json key 'chat_template' or "
                              "chat_template.jinja)")
    return _compile_template(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                          **kwargs):
    text = self.render_chat(messages, add_generation_prompt, **kwargs)
    # The template writes the special tokens itself (bos included), so none are added here (as in transformers).
    return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile_template(template: str):
  import datetime  # noqa: PLC0415

  import jinja2  # noqa: PLC0415
  import jinja2.ext  # noqa: PLC0415
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def load_tokenizer(hf_dir: str) -> Tokenizer:
  return Tokenizer(hf_dir)


# ------------------------------------------------------------------------------------------------------------------
# Weights out
# ------------------------------------------------------------------------------------------------------------------

_ST_DTYPE_BYTES = {np.dtype(ml_dtypes.bfloat16): 2, np.dtype(ml_dtypes.float8_e4m3fn): 1, np.dtype(np.float32): 4}


@dataclasses.dataclass
class _Out:
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  get: Callable[[], np.ndarray]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * _ST_DTYPE_BYTES[self.dtype]


def _out(name: str, x, expert: int | None, dtype) -> _Out:
  """One tensor to write: ``x``, or expert ``expert`` of a stacked ``x``, cut and cast only when written (so an
  export never holds a second copy of the experts in device memory)."""
  def get():
    y = jnp.asarray(x) if expert is None else jnp.asarray(x)[expert]
    return np.asarray(jax.device_get(y.astype(dtype)))
  return _Out(name, tuple(x.shape if expert is None else x.shape[1:]), np.dtype(dtype), get)


def _param_items(params: dict, cfg: ModelConfig):
  """(leaf path, HF module name, leaf, expert index or None, schema row) in HF order; a stacked leaf gives one item
  per expert (the whole leaf each time: ``_out`` cuts it). The tensor is ``f"{module}.{row.tensor}"``."""
  for path, (hf, _) in hf_param_names(cfg).items():
    leaf_path, key, expert = _parts(path)
    row = schema.BY_KEY[key]
    yield leaf_path, hf[:-len("." + row.tensor)], _leaf(params, leaf_path), expert, row


def _write_safetensors(out_dir: str, tensors: list[_Out], max_shard_bytes: int):
  from safetensors.numpy import save_file  # noqa: PLC0415

  shards, cur, size = [], [], 0
  for t in tensors:
    if cur and size + t.nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(t)
    size += t.nbytes
  shards.append(cur)
  total = sum(t.nbytes for t in tensors)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    arrays = {}
    for t in shard:  # one shard in host memory at a time
      a = t.get()
      if a.shape != t.shape or a.dtype != t.dtype:
        raise AssertionError(f"export: {t.name} is {a.shape} {a.dtype}, expected {t.shape} {t.dtype}")
      arrays[t.name] = a
      weight_map[t.name] = fname
    save_file(arrays, os.path.join(out_dir, fname), metadata={"format": "pt"})
    del arrays
  if len(shards) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _copy_tokenizer_and_ids(tokenizer_dir: str | None, out_dir: str) -> dict:
  """Copies tokenizer files; returns the special token ids of the source config.json to carry over."""
  if tokenizer_dir is None:
    return {}
  for fname in TOKENIZER_FILES:
    src = os.path.join(tokenizer_dir, fname)
    if os.path.isfile(src):
      shutil.copyfile(src, os.path.join(out_dir, fname))
  src_cfg = os.path.join(tokenizer_dir, CONFIG_FILE)
  if not os.path.isfile(src_cfg):
    return {}
  c = _read_json(src_cfg)
  return {k: c[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in c}


def _write_config(out_dir: str, d: dict):
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(d, f, indent=2)


def _check_params(params: dict, cfg: ModelConfig):
  """The config has an HF architecture and every leaf it implies is there with its shape (a stacked leaf whole)."""
  _hf_architecture(cfg)
  for path, (hf, _) in hf_param_names(cfg).items():
    leaf_path, key, expert = _parts(path)
    if expert is not None and expert > 0:  # the stacked leaf was checked with expert 0
      continue
    try:
      node = _leaf(params, leaf_path)
    except (KeyError, IndexError):
      raise HFCheckpointError(f"export: params have no '{leaf_path}' (needed for '{hf}')") from None
    shape = tuple(schema.BY_KEY[key].shape(cfg))
    if tuple(node.shape) != shape:
      raise HFCheckpointError(f"export: params '{leaf_path}' has shape {tuple(node.shape)}, config implies {shape}")


def export_bf16(params: dict, cfg: ModelConfig, out_dir: str, tokenizer_dir: str | None = None, *,
                max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes an HF directory (config.json, BF16 safetensors, index when sharded, tokenizer files)."""
  _check_params(params, cfg)
  os.makedirs(out_dir, exist_ok=True)
  ids = _copy_tokenizer_and_ids(tokenizer_dir, out_dir)
  config = hf_config_dict(cfg, extra=ids)
  tensors = [_out(f"{mod}.{row.tensor}", w, e, jnp.dtype(row.hf_dtype))
             for _, mod, w, e, row in _param_items(params, cfg)]
  _write_safetensors(out_dir, tensors, max_shard_bytes)
  _write_config(out_dir, config)


def export_fp8(params: dict, cfg: ModelConfig, recipe: recipes.Recipe, out_dir: str,
               tokenizer_dir: str | None = None, *, max_shard_bytes: int = 5 * 2**30,
               ragged_fp8: bool = False) -> dict:
  """Writes a block-FP8 HF directory (DeepSeek-V3 / vLLM convention); returns its ``quantization_config``.

  The FP8 tensors are ``recipes.quantize_params(params, recipe)`` — the sampler's own weights, bit for bit.
  Linear layers the recipe keeps (and the output head unless ``recipe.quantize_lm_head``) are written in BF16
  and listed in ``modules_to_not_convert``; embeddings and norms are always BF16.
  A weight with a dimension that is not a multiple of 128 has a ragged last scale tile; the convention's ceil-sized
  scale grid is what fp8jax writes and reads, but transformers 5.17 misreads it (refuses to load, or silently
  reads a 144x96 weight as 72x96 blocks: logits off by 0.34 on a tiny model). Such layers are therefore written in
  BF16 (their master weights) and listed in ``modules_to_not_convert``, with a warning, unless ``ragged_fp8``.

  MoE layers: each expert's matrices are written like a dense linear's (``mlp.experts.{e}.gate_proj.weight`` E4M3 +
  its ``weight_scale_inv``, the slices of the stacked QWeight); the router stays BF16 (never a recipe linear). The
  experts of a layer are one module to transformers (FP8Experts) and vLLM (FusedMoE), all FP8 or all BF16: a layer
  whose experts are kept BF16 is listed once, as ``model.layers.{i}.mlp.experts``; a recipe that keeps some of a
  layer's expert projections and quantizes others is refused (no consumer loads it).
  """
  if recipe.mode != "fp8":
    raise HFCheckpointError(f"export_fp8 needs a recipe with mode='fp8', got mode={recipe.mode!r}")
  _check_params(params, cfg)
  qparams = recipes.quantize_params(params, recipe)

  def as_fp8(w) -> bool:  # whether a quantized leaf is written as FP8 (ragged ones are not, unless ragged_fp8)
    return isinstance(w, quant.QWeight) and (ragged_fp8 or not any(d % quant.BLOCK for d in w.q.shape[-2:]))

  for i, layer in enumerate(qparams["layers"]):
    fp8 = {r.key: as_fp8(layer[r.key]) for r in schema.LAYER if r.stacked and r.key in layer}
    if len(set(fp8.values())) > 1:
      raise HFCheckpointError(f"export_fp8: layer {i}'s experts would be part FP8, part BF16 ({fp8}): transformers "
                              f"and vLLM load a layer's experts as one module; keep all of them or none "
                              f"(recipe keep_patterns / keep_first_n / keep_last_n)")
  os.makedirs(out_dir, exist_ok=True)
  ids = _copy_tokenizer_and_ids(tokenizer_dir, out_dir)
  tensors, not_converted, ragged = [], [], []
  for (path, mod, w, e, row), (_, _, master, _, _) in zip(_param_items(qparams, cfg), _param_items(params, cfg)):
    if isinstance(w, quant.QWeight) and not as_fp8(w):
      if e is None:
        ragged.append(f"{mod} {tuple(w.q.shape)}")
      elif e == 0:  # a stacked leaf once, named by its template
        ragged.append(f"model.layers.{path.split('/')[1]}.{row.hf} {tuple(w.q.shape)}")
      w = master
    if isinstance(w, quant.QWeight):
      tensors.append(_out(mod + ".weight", w.q, e, jnp.float8_e4m3fn))
      tensors.append(_out(mod + ".weight_scale_inv", w.scale, e, jnp.float32))
    else:
      kept = mod if not row.stacked else f"model.layers.{path.split('/')[1]}.{row.hf_stack}"
      if row.is_hf_linear and kept not in not_converted:  # a linear kept BF16 (lm_head, MLA's kv_b included)
        not_converted.append(kept)
      tensors.append(_out(f"{mod}.{row.tensor}", w, e, jnp.dtype(row.hf_dtype)))
  if ragged:
    log.warning("export_fp8: %d weights have a dimension that is not a multiple of %d and are written in BF16 "
                "(transformers misreads ragged scale grids; ragged_fp8=True keeps them FP8): %s", len(ragged),
                quant.BLOCK, ", ".join(ragged))
  if cfg.tie_embeddings:
    not_converted.append("lm_head")  # tied to the BF16 embedding: transformers must not make it an FP8Linear
  _warn_mixed_fused(not_converted, cfg)
  qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [quant.BLOCK, quant.BLOCK], "modules_to_not_convert": not_converted}
  config = hf_config_dict(cfg, extra={**ids, "quantization_config": qc})
  _write_safetensors(out_dir, tensors, max_shard_bytes)
  _write_config(out_dir, config)
  return qc


def _warn_mixed_fused(not_converted: list[str], cfg: ModelConfig):
  """vLLM fuses q/k/v and gate/up into one GEMM, which cannot mix FP8 and BF16 parts: warn about such recipes."""
  kept = set(not_converted)
  for i in range(cfg.n_layers):
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
      flags = {f"model.layers.{i}.{m}" in kept for m in group}
      if len(flags) > 1:
        log.warning("export_fp8: layer %d has %s partly FP8, partly BF16; vLLM fuses these and will refuse it",
                    i, "/".join(m.rsplit(".", 1)[-1] for m in group))


# ------------------------------------------------------------------------------------------------------------------
# Tiny local models (tests and demos; needs the test extras torch + transformers)
# ------------------------------------------------------------------------------------------------------------------

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_TINY_SPECIALS = ["<unk>", "<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                  "<|end_header_id|>"]
_TINY_TEXT = [
    "The quick brown fox jumps over the lazy dog.", "What is two plus two? Two plus two is four.",
    "A tiny model learns nothing, but its numbers must still match.", "Solve for x: 3 x + 5 = 20, so x = 5.",
    "Reinforcement learning from verifiable rewards.", "Hello, world! How are you today?",
    "system\n\nuser\n\nassistant\n\n", "You are a helpful assistant.\n\nWhat is 2+2?",
]


def make_tiny_tokenizer(out_dir: str, vocab_size: int = 200) -> dict[str, int]:
  """Trains a tiny BPE tokenizer on a few sentences; writes tokenizer.json + tokenizer_config.json. -> special ids."""
  from tokenizers import Tokenizer as _Tok  # noqa: PLC0415
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415

  tok = _Tok(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.train_from_iterator(_TINY_TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_TINY_SPECIALS,
                                                          show_progress=False))
  ids = {t: tok.token_to_id(t) for t in _TINY_SPECIALS}
  bos = "<|begin_of_text|>"
  tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                     special_tokens=[(bos, ids[bos])])
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|eot_id|>",
               "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 512,
               "chat_template": TINY_CHAT_TEMPLATE}, f, indent=2)
  return ids


def make_tiny_hf_dir(out_dir: str, arch: str = "llama", *, seed: int = 0, n_layers: int = 2, dim: int = 256,
                     ffn_dim: int = 512, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 64,
                     vocab_size: int = 256, tie: bool | None = None, init_std: float = 0.02, n_experts: int = 4,
                     n_experts_per_tok: int = 2, moe_ffn_dim: int = 128, mlp_only_layers: tuple[int, ...] = ()) -> str:
  """A random Llama-3 (llama3 RoPE scaling), Qwen2 (q/k/v biases, random like the weights), Qwen3 or Qwen3-MoE
  ("qwen3_moe": the ``n_experts`` .. ``mlp_only_layers`` arguments, top-k renormalized) HF directory saved by
  transformers, with a tiny tokenizer."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  ids = make_tiny_tokenizer(out_dir)
  common = dict(vocab_size=vocab_size, hidden_size=dim, intermediate_size=ffn_dim, num_hidden_layers=n_layers,
                num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
                max_position_embeddings=512, initializer_range=init_std, bos_token_id=ids["<|begin_of_text|>"],
                eos_token_id=ids["<|eot_id|>"], pad_token_id=ids["<pad>"])
  if arch == "llama":
    c = transformers.LlamaConfig(
        **common, tie_word_embeddings=bool(tie), rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cls = transformers.LlamaForCausalLM
  elif arch == "qwen2":
    c = transformers.Qwen2Config(**common, tie_word_embeddings=bool(tie), rms_norm_eps=1e-6, use_sliding_window=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cls = transformers.Qwen2ForCausalLM
  elif arch == "qwen3":
    c = transformers.Qwen3Config(**common, tie_word_embeddings=True if tie is None else tie, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cls = transformers.Qwen3ForCausalLM
  elif arch == "qwen3_moe":
    c = transformers.Qwen3MoeConfig(**common, tie_word_embeddings=bool(tie), rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                    num_experts=n_experts, num_experts_per_tok=n_experts_per_tok,
                                    moe_intermediate_size=moe_ffn_dim, norm_topk_prob=True,
                                    mlp_only_layers=list(mlp_only_layers))
    cls = transformers.Qwen3MoeForCausalLM
  else:
    raise ValueError(f"make_tiny_hf_dir: arch must be 'llama', 'qwen2', 'qwen3' or 'qwen3_moe', got {arch!r}")
  torch.manual_seed(seed)
  model = cls(c)
  with torch.no_grad():  # norms start at ones, biases and routers at zeros: randomize them so a swap would show
    for name, p in model.named_parameters():
      if name.endswith(".bias"):  # Qwen2's q/k/v biases: of both signs, larger than the projections' outputs
        p.copy_(0.5 * torch.randn_like(p))
      elif p.ndim == 1:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith(".mlp.gate.weight"):  # the router: its logits must separate the experts
        p.copy_(0.5 * torch.randn_like(p))
  model.save_pretrained(out_dir, safe_serialization=True)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|eot_id|>"], ids["<|end_of_text|>"]],
               "pad_token_id": ids["<pad>"]}, f, indent=2)
  return out_dir
