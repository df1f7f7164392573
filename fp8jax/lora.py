"""LoRA on a frozen block-FP8 (or BF16) base, inside the one engine.

A LoRA run trains two small matrices per targeted linear, ``a`` (r, K) and ``b`` (N, r), and never the base weight
``W`` (N, K) (Hu et al. 2021, "LoRA", sec. 4): the layer computes ``x W^T + (alpha / r) (x a^T) b^T``. Here ``W`` is
the recipe's form of the base, quantized once: a block-FP8 ``quant.QWeight`` (fp8.mode="fp8") or a BF16 array
(fp8.mode="bf16"), so the base of Llama-3.1-8B takes ~8 GB of FP8 codes and no FP32 or BF16 master at all.

The op (``lora_linear``; ``ops.linear`` dispatches a ``LoRAWeight`` to it, so no model code changes) is the same
function in the sampler and the trainer, so sampler == trainer holds for LoRA runs as for full fine-tuning. Its
numerics, fixed here and nowhere else:

  y_base = linear(x, W)                       the base's own GEMM (FP8 or BF16 mode), rounded to out_dtype (BF16)
  h      = bf16( bf16(x) . bf16(a)^T )         BF16-mode linear: BF16 operands, FP32 accumulation, rounded to BF16
  d      = f32( h . bf16(b)^T )                BF16-mode linear, FP32 accumulator kept
  y      = out_dtype( f32(y_base) + f32(alpha / r) * d )   the add in FP32, one rounding

The adapters are FP32 masters in the trainer (like every trained weight of fp8jax: Adam updates of ~1e-5 would
vanish in BF16) and BF16 copies in the sampler; both reach the GEMMs as the same BF16 values. Both low-rank GEMMs are
``ops.linear`` BF16-mode calls (batch-invariant on every backend), so a row's result never depends on the batch.
With b = 0 (the init) d is exactly 0 and y is the base's output bit for bit (up to the sign of a zero): step 0 is
exactly the base model. Gradients: the base's dgrad runs ``ops``' frozen-weight VJP (no weight gradient is ever
formed for the base), and autodiff of the two BF16 linears gives da, db and the low-rank part of dx.

Dropout is refused (``lora.dropout`` must be 0): in RL the old-policy log-probs are the sampler's, and a dropout
mask in the trainer's forward would make the two engines compute different functions.

Trees. The trainer's trained params are the adapters alone, ``{"layers": [{"wq": {"a": (r, K), "b": (N, r)}, ...}]}``
(FP32); ``attach(base, adapters, lcfg)`` puts them into the frozen base's tree as ``LoRAWeight`` leaves, which is
what the model function runs. The KL reference of a LoRA run is the base itself (adapters off): no second model.

Export: ``export_peft`` writes PEFT's format (``adapter_model.safetensors`` + ``adapter_config.json``, loadable by
``peft.PeftModel.from_pretrained`` onto the transformers model of the base); ``export_merged`` writes the base with
``alpha / r * b @ a`` merged in, through ``fp8jax.hf``'s BF16 or block-FP8 exporter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import quant
from fp8jax.model import schema

# The linears LoRA may target: dense GQA attention and the SwiGLU MLP of every decoder layer (the schema's keys).
# MLA's projections and MoE experts are not supported (their weights are not plain (N, K) dense GEMMs of one layer).
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# PEFT's files (peft.utils.constants SAFETENSORS_WEIGHTS_NAME / CONFIG_NAME).
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """The config's ``lora`` group (``rank`` 0: no LoRA, full fine-tuning). ``seed``: the adapters' init seed (the
  config's top-level ``seed``, not a key of the group)."""

  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = TARGETS
  dropout: float = 0.0
  seed: int = 0

  def __post_init__(self):
    if isinstance(self.targets, str):
      raise ValueError(f"lora.targets must be a tuple of linear names from {TARGETS}, got the string "
                       f"{self.targets!r}")
    object.__setattr__(self, "targets", tuple(self.targets))
    if not isinstance(self.rank, (int, np.integer)) or isinstance(self.rank, bool) or self.rank < 0:
      raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 0 (0 turns LoRA off)")
    if not self.enabled:
      return
    if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"lora.alpha={self.alpha!r} must be a finite number > 0 (the adapters are scaled by "
                       f"alpha / rank)")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ValueError(f"lora.targets={self.targets!r} must be distinct names from {TARGETS} (the dense attention "
                       f"and MLP linears of the parameter schema), at least one; unknown: {unknown}")
    if self.dropout != 0.0:
      raise ValueError(f"lora.dropout={self.dropout!r}: only 0.0 is supported: in RL the old-policy log-probs are "
                       f"the sampler's, and dropout in the trainer's forward would make the two engines compute "
                       f"different functions")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """alpha / r, as PEFT's LoRA (use_rslora=False)."""
    return float(self.alpha) / self.rank

  @classmethod
  def from_config(cls, c) -> "LoRAConfig":
    """From a run config (its ``lora`` group, absent: off); unknown keys raise naming them."""
    from fp8jax.config_utils import dataclass_from_group  # noqa: PLC0415

    group = dict(c.get("lora") or {})
    if "seed" in group:
      raise ValueError("unknown lora config keys: ['seed'] (the adapters' init seed is the config's top-level seed)")
    return dataclass_from_group(cls, {**group, "seed": int(c.get("seed", 0))}, "lora")

  def check_model(self, cfg) -> None:
    """Raises, naming ``lora.targets``, when a target is in no decoder layer of ``cfg`` (e.g. MLA attention, or an
    MLP target in a model whose every layer is MoE)."""
    if not self.enabled:
      return
    missing = [t for t in self.targets if not any(t in schema.layer_shapes(cfg, i) for i in range(cfg.n_layers))]
    if missing:
      raise ValueError(f"lora.targets: {missing} are in no decoder layer of this model (MLA projections and MoE "
                       f"experts are not LoRA targets); choose from the layers' dense linears")

  def meta(self) -> dict:
    """What a checkpoint or export records of this config."""
    return {"rank": self.rank, "alpha": float(self.alpha), "targets": list(self.targets)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeight:
  """A linear's frozen base plus its adapters: ``base`` a ``quant.QWeight`` (FP8) or an (N, K) array (BF16 mode),
  ``a`` (r, K), ``b`` (N, r) (FP32 masters in the trainer, BF16 in the sampler), ``scale`` alpha / r (static)."""

  base: Any
  a: jax.Array
  b: jax.Array
  scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

  @property
  def shape(self):
    return self.base.shape


def lora_linear(x: jax.Array, w: LoRAWeight, cfg, parallel: str | None = None, *, bias=None) -> jax.Array:
  """``linear(x, base) + scale (x a^T) b^T`` with the numerics of the module docstring; ``ops.linear`` calls it for a
  ``LoRAWeight`` (``parallel`` and ``bias`` apply to the base's GEMM; the low-rank GEMMs run gathered)."""
  from fp8jax import ops  # noqa: PLC0415 (ops dispatches here: imported at call time, no import circle)

  r = w.a.shape[0]
  if w.a.shape != (r, w.base.shape[1]) or w.b.shape != (w.base.shape[0], r):
    raise ValueError(f"lora_linear: adapters a {tuple(w.a.shape)} and b {tuple(w.b.shape)} do not fit base "
                     f"{tuple(w.base.shape)} (stored (N, K)): a must be (r, K), b (N, r)")
  y = ops.linear(x, w.base, cfg, parallel, **({} if bias is None else {"bias": bias}))
  h = ops.linear(x, w.a, dataclasses.replace(cfg, out_dtype="bfloat16"))
  d = ops.linear(h, w.b, dataclasses.replace(cfg, out_dtype="float32"))
  return (y.astype(jnp.float32) + jnp.float32(w.scale) * d).astype(cfg.out_dtype)


def lora_linear_reference(x, base_NxK, a_RxK, b_NxR, scale: float, base_out_dtype=jnp.bfloat16):
  """The op in plain jnp for BF16-mode bases (tests): the same roundings, ``jnp.dot`` with FP32 accumulation."""
  f32, bf16 = jnp.float32, jnp.bfloat16
  dot = lambda u, v: jnp.dot(u.astype(bf16), v.astype(bf16).T, preferred_element_type=f32)  # noqa: E731
  y = dot(x, base_NxK).astype(base_out_dtype)
  h = dot(x, a_RxK).astype(bf16)
  return (y.astype(f32) + f32(scale) * dot(h, b_NxR)).astype(base_out_dtype)


# ------------------------------------------------------------------------------------------------------------------
# Trees: adapters, the base, attaching the one to the other
# ------------------------------------------------------------------------------------------------------------------


def _targets_of(cfg, lcfg: LoRAConfig, layer: int) -> dict[str, tuple[int, int]]:
  shapes = schema.layer_shapes(cfg, layer)
  return {t: shapes[t] for t in lcfg.targets if t in shapes}


def adapter_shapes(cfg, lcfg: LoRAConfig) -> dict:
  """The adapters' tree as FP32 ShapeDtypeStructs (restore targets, the memory plan)."""
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  return {"layers": [{t: {"a": sd(lcfg.rank, k), "b": sd(n, lcfg.rank)} for t, (n, k) in _targets_of(cfg, lcfg, i)
                      .items()} for i in range(cfg.n_layers)]}


def init_adapters(cfg, lcfg: LoRAConfig) -> dict:
  """FP32 adapters at the start of a LoRA run: ``b`` = 0 (so the model is exactly the base), ``a`` drawn from
  U(-1/sqrt(K), 1/sqrt(K)): the bound of PyTorch's ``kaiming_uniform_(a=sqrt(5))``, which PEFT uses for lora_A
  (gain sqrt(2 / (1 + 5)) times sqrt(3 / fan_in)). Keyed by (seed, layer, target), so it does not depend on which
  other layers or targets exist."""
  key = jax.random.key(lcfg.seed)
  out = []
  for i in range(cfg.n_layers):
    layer = {}
    for t, (n, k) in _targets_of(cfg, lcfg, i).items():
      kk = jax.random.fold_in(jax.random.fold_in(key, i), TARGETS.index(t))
      bound = 1.0 / math.sqrt(k)
      layer[t] = {"a": jax.random.uniform(kk, (lcfg.rank, k), jnp.float32, -bound, bound),
                  "b": jnp.zeros((n, lcfg.rank), jnp.float32)}
    out.append(layer)
  return {"layers": out}


def attach(base: dict, adapters: dict, lcfg: LoRAConfig) -> dict:
  """The model's weights: ``base`` (fp8jax's params tree in the recipe's frozen form) with each adapted linear a
  ``LoRAWeight``. No array is copied (the tree holds the same buffers)."""
  if len(adapters["layers"]) != len(base["layers"]):
    raise ValueError(f"lora.attach: {len(adapters['layers'])} adapter layers for a base of {len(base['layers'])}")
  layers = []
  for i, (p, ad) in enumerate(zip(base["layers"], adapters["layers"])):
    missing = sorted(set(ad) - set(p))
    if missing:
      raise ValueError(f"lora.attach: layer {i} has adapters for {missing}, which its base lacks")
    layers.append({**p, **{t: LoRAWeight(p[t], v["a"], v["b"], lcfg.scale) for t, v in ad.items()}})
  return {**base, "layers": type(base["layers"])(layers)}


to_bf16 = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))


def _is_lora(x) -> bool:
  return isinstance(x, LoRAWeight)


def has_adapters(weights) -> bool:
  """Whether a weights tree holds ``LoRAWeight`` leaves (attached adapters)."""
  return any(_is_lora(x) for x in jax.tree.leaves(weights, is_leaf=_is_lora))


def sampling_weights(weights: dict, cast=to_bf16) -> dict:
  """The sampler's form of attached weights: every adapter cast to BF16 (the values the op's GEMMs read from the
  FP32 masters anyway; one jitted cast of the adapters alone, ``cast``), the base as it is: already the sampler's
  form, shared with the trainer, never requantized or copied. (``cast`` on shapes: the memory plan's.)"""
  leaves, treedef = jax.tree.flatten(weights, is_leaf=_is_lora)
  cast = iter(cast([(x.a, x.b) for x in leaves if _is_lora(x)]))
  out = []
  for x in leaves:
    if _is_lora(x):
      a, b = next(cast)
      x = dataclasses.replace(x, a=a, b=b)
    out.append(x)
  return jax.tree.unflatten(treedef, out)


@jax.jit
def _leaf_checksum(x):
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  u = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32).ravel()
  w = jnp.arange(u.shape[0], dtype=jnp.uint32) % jnp.uint32(65521) + jnp.uint32(1)  # position-weighted
  return jnp.sum(u * w, dtype=jnp.uint32)  # integer sums mod 2^32: exact in any order


def checksum(tree) -> str:
  """A fingerprint of every bit of ``tree`` (its arrays; computed on the device, one integer per leaf fetched):
  names the base a LoRA checkpoint belongs to, so a resume onto another base is refused."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = jax.device_get([_leaf_checksum(x) for _, x in leaves])
  h = hashlib.sha256()
  for (path, x), s in zip(leaves, sums):
    h.update(f"{jax.tree_util.keystr(path)}:{tuple(x.shape)}:{jnp.dtype(x.dtype).name}:{int(s)};".encode())
  return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------------------
# Export: PEFT adapters, merged models
# ------------------------------------------------------------------------------------------------------------------


def _hf_module(t: str) -> str:
  return schema.HF_LAYER_MODULES[t]  # "self_attn.q_proj"


def peft_config(lcfg: LoRAConfig, base_model_name_or_path: str | None) -> dict:
  """PEFT's ``adapter_config.json`` for these adapters (target modules by their transformers names)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": float(lcfg.alpha),
          "target_modules": sorted(_hf_module(t).rsplit(".", 1)[-1] for t in lcfg.targets),
          "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
          "base_model_name_or_path": base_model_name_or_path}


def export_peft(adapters: dict, lcfg: LoRAConfig, out_dir: str, base_model_name_or_path: str | None = None) -> dict:
  """Writes ``adapter_model.safetensors`` (BF16: the values the op computes with) and ``adapter_config.json`` in
  PEFT's layout (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (r, K), ``lora_B`` (N, r)),
  loadable by ``peft.PeftModel.from_pretrained`` onto the transformers model of the base. Returns the config."""
  from safetensors.numpy import save_file  # noqa: PLC0415

  os.makedirs(out_dir, exist_ok=True)
  tensors = {}
  for i, layer in enumerate(adapters["layers"]):
    for t, ad in layer.items():
      prefix = f"base_model.model.model.layers.{i}.{_hf_module(t)}"
      for name, x in (("lora_A", ad["a"]), ("lora_B", ad["b"])):
        tensors[f"{prefix}.{name}.weight"] = np.asarray(jax.device_get(jnp.asarray(x, jnp.bfloat16)))
  save_file(tensors, os.path.join(out_dir, PEFT_WEIGHTS), metadata={"format": "pt"})
  config = peft_config(lcfg, base_model_name_or_path)
  with open(os.path.join(out_dir, PEFT_CONFIG), "w") as f:
    json.dump(config, f, indent=2)
  return config


def merged_params(base: dict, adapters: dict, lcfg: LoRAConfig) -> dict:
  """FP32 params of the merged model: each adapted weight ``dequant(base) + scale * bf16(b) @ bf16(a)`` (the BF16
  values the op uses, the product in FP32); every other QWeight dequantized, the rest as it is in FP32."""
  f32 = jnp.float32

  def dense(w):
    return w.dequantize(f32) if isinstance(w, quant.QWeight) else jnp.asarray(w, f32)

  merge = jax.jit(lambda w, a, b: dense(w) + f32(lcfg.scale) * jnp.dot(
      b.astype(jnp.bfloat16).astype(f32), a.astype(jnp.bfloat16).astype(f32), precision="highest"))
  layers = []
  for p, ad in zip(base["layers"], adapters["layers"]):
    layers.append({k: merge(w, ad[k]["a"], ad[k]["b"]) if k in ad else jax.tree.map(dense, w, is_leaf=quant.is_fp8_leaf)
                   for k, w in p.items()})
  rest = {k: jax.tree.map(dense, v, is_leaf=quant.is_fp8_leaf) for k, v in base.items() if k != "layers"}
  return {**rest, "layers": layers}


def export_merged(base: dict, adapters: dict, lcfg: LoRAConfig, cfg, out_dir: str, *, fmt: str = "bf16",
                  recipe=None, tokenizer_dir: str | None = None):
  """Writes the merged model as an HF directory: ``fmt`` "bf16" (``hf.export_bf16``) or "fp8" (``hf.export_fp8``
  with ``recipe``: the merged weights requantized to block FP8)."""
  from fp8jax import hf, recipes  # noqa: PLC0415

  if fmt not in ("bf16", "fp8"):
    raise ValueError(f"export_merged: fmt must be 'bf16' or 'fp8', got {fmt!r}")
  params = merged_params(base, adapters, lcfg)
  if fmt == "bf16":
    return hf.export_bf16(params, cfg, out_dir, tokenizer_dir)
  return hf.export_fp8(params, cfg, recipe or recipes.Recipe(mode="fp8"), out_dir, tokenizer_dir)
