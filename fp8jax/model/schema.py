"""The parameter schema: every parameter of the decoder written once, with everything the code derives from it.

A row (``Param``) gives a parameter's key, its shape as a function of the ``ModelConfig``, the mesh axis each of its
dimensions is sharded over, its Hugging Face module, whether it is a linear weight (stored (out, in), the operand
of ``ops.linear``, selectable by the FP8 recipe) and how it is initialized. From these rows come

  * ``param_shapes`` (init, checkpoints, HF import/export): ``model.param_shapes``;
  * ``LINEAR_NAMES`` (what ``recipes.quantize_params`` and the trainer's FP8 forward may quantize);
  * ``SHARDING_RULES`` (``fp8jax.sharding``: master weights, optimizer moments and quantized weights alike);
  * ``HF_LAYER_MODULES`` / ``HF_TOP_MODULES`` and ``Param.hf_tensors`` (``fp8jax.hf``: the transformers names,
    ``.weight`` appended; a stacked expert row is one tensor per expert on disk).

A new block (MoE experts, MLA) adds rows here; no other module spells the layout. This module imports nothing
from fp8jax (``quant`` and ``sharding`` import it), and takes the config only as an argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
  from fp8jax.model.config import ModelConfig

# Mesh axes of fp8jax.sharding (kept as strings here so this module stays import-free).
TENSOR, FSDP, EXPERTS = "tensor", "fsdp", "expert"
COLUMN = (TENSOR, FSDP)  # (out, in): output features over tensor, input over fsdp (column parallel)
ROW = (FSDP, TENSOR)  # (out, in): output over fsdp, input features over tensor (row parallel)
REPLICATED = None

INITS = ("ones", "zeros", "normal", "normal_residual")
EXPERT = "{e}"  # in a stacked row's HF module: the expert index


@dataclasses.dataclass(frozen=True)
class Param:
  """One parameter. ``axes``: a mesh axis (or None) per dimension, or ``REPLICATED``. ``init``: "ones" (norm
  weights), "normal" (N(0, std)) or "normal_residual" (N(0, std / sqrt(2 L)): projections that write into the
  residual stream). ``present(cfg, layer)``: whether a config has this parameter (e.g. q_norm only with qk_norm;
  the expert weights only in MoE layers); ``layer`` is None for the rows outside the layers. ``stacked``: the
  leading dimension indexes experts; HF checkpoints store one tensor per expert, named by ``hf`` with ``{e}``
  replaced by the index (``hf_tensors``). ``tensor``: the tensor's name inside its HF module ("weight", or e.g.
  DeepSeek's router buffer "e_score_correction_bias"); ``hf_dtype``: what an export writes it as when it is not
  FP8 (BF16, or FP32 where the checkpoint keeps FP32). ``hf_linear``: the HF module is an ``nn.Linear`` although
  fp8jax never quantizes it (MLA's kv_b), so a block-FP8 export must name it in ``modules_to_not_convert``.
  ``trainable=False``: a buffer the model stops the gradient of (DeepSeek's router bias); the optimizer must leave it
  as it is (no weight decay: ``decay_mask``)."""

  key: str
  shape: Callable[[ModelConfig], tuple[int, ...]]
  axes: tuple[str | None, ...] | None
  hf: str
  linear: bool = False
  init: str = "normal"
  present: Callable[[ModelConfig, int | None], bool] = lambda cfg, layer: True
  stacked: bool = False
  tensor: str = "weight"
  hf_dtype: str = "bfloat16"
  hf_linear: bool | None = None  # the HF module is an nn.Linear (default: ``linear``); export_fp8 lists kept ones
  trainable: bool = True

  def __post_init__(self):
    if self.init not in INITS:
      raise ValueError(f"schema: {self.key}: init={self.init!r} is not one of {INITS}")
    if self.stacked != (EXPERT in self.hf):
      raise ValueError(f"schema: {self.key}: hf={self.hf!r} must contain {EXPERT!r} exactly when stacked=True")
    if self.linear and self.tensor != "weight":
      raise ValueError(f"schema: {self.key}: a linear row's tensor is 'weight' (its scales: 'weight_scale_inv')")

  def hf_tensors(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF module, shape) of each tensor this parameter is stored as on disk: itself, or for a stacked row one
    tensor per expert (index e of the leading dimension), as transformers' ``save_pretrained`` writes them."""
    shape = tuple(self.shape(cfg))
    if not self.stacked:
      return [(self.hf, shape)]
    return [(self.hf.replace(EXPERT, str(e)), shape[1:]) for e in range(shape[0])]

  @property
  def is_hf_linear(self) -> bool:
    return self.linear if self.hf_linear is None else self.hf_linear

  @property
  def hf_stack(self) -> str:
    """The HF module holding all experts of a stacked row ("mlp.experts": transformers' fused experts module)."""
    if not self.stacked:
      raise ValueError(f"schema: {self.key} is not a stacked (per-expert) parameter")
    return self.hf.split("." + EXPERT)[0]


def _vec(dim: str) -> Callable[[ModelConfig], tuple[int, ...]]:
  return lambda c: (getattr(c, dim),)


def _mat(out: str, inp: str) -> Callable[[ModelConfig], tuple[int, ...]]:
  return lambda c: (getattr(c, out), getattr(c, inp))


def _experts(out: str, inp: str) -> Callable[[ModelConfig], tuple[int, ...]]:
  return lambda c: (c.n_experts, getattr(c, out), getattr(c, inp))


def _has_qk_norm(c: ModelConfig, layer) -> bool:
  return c.qk_norm


def _gqa(c: ModelConfig, layer) -> bool:
  return not c.is_mla


def _attn_bias(c: ModelConfig, layer) -> bool:
  return c.attn_bias and not c.is_mla


def _mla(c: ModelConfig, layer) -> bool:
  return c.is_mla


def _one_q_proj(c: ModelConfig, layer) -> bool:  # GQA's q_proj, or MLA's without a q LoRA (same name and shape)
  return not c.q_lora_rank


def _q_lora(c: ModelConfig, layer) -> bool:
  return c.is_mla and c.q_lora_rank > 0


def _dense_mlp(c: ModelConfig, layer: int) -> bool:
  return not c.is_moe_layer(layer)


def _moe(c: ModelConfig, layer: int) -> bool:
  return c.is_moe_layer(layer)


def _moe_sigmoid(c: ModelConfig, layer: int) -> bool:
  return c.is_moe_layer(layer) and c.moe_router == "sigmoid"


def _shared_experts(c: ModelConfig, layer: int) -> bool:
  return c.is_moe_layer(layer) and c.n_shared_experts > 0


def _dims(*terms) -> Callable[[ModelConfig], int]:
  """A sum of config dims / products: _dims("kv_lora_rank", "qk_rope_head_dim") -> kv_lora_rank + qk_rope_head_dim."""
  def get(c, t):
    return getattr(c, t) if isinstance(t, str) else math.prod(getattr(c, x) for x in t)
  return lambda c: sum(get(c, t) for t in terms)


def _shape(*dims) -> Callable[[ModelConfig], tuple[int, ...]]:
  return lambda c: tuple(d(c) if callable(d) else getattr(c, d) for d in dims)


def _untied(c: ModelConfig, layer) -> bool:
  return not c.tie_embeddings


# One decoder layer (``params["layers"][i]``): GQA attention and the dense SwiGLU MLP (Llama-3.x, Qwen3 dense).
LAYER: tuple[Param, ...] = (
    Param("attn_norm", _vec("dim"), REPLICATED, "input_layernorm", init="ones"),
    Param("wq", _mat("q_dim", "dim"), COLUMN, "self_attn.q_proj", linear=True, present=_one_q_proj),
    Param("wk", _mat("kv_dim", "dim"), COLUMN, "self_attn.k_proj", linear=True, present=_gqa),
    Param("wv", _mat("kv_dim", "dim"), COLUMN, "self_attn.v_proj", linear=True, present=_gqa),
    # Qwen2's q/k/v biases: the "bias" tensor of the projection's HF module, added by ``ops.linear(..., bias=)`` to
    # the FP32 accumulator. 1-D and no linear weight, so no recipe quantizes them (BF16 in every export); split over
    # tensor like their projection's output features.
    Param("bq", _vec("q_dim"), (TENSOR,), "self_attn.q_proj", init="zeros", present=_attn_bias, tensor="bias"),
    Param("bk", _vec("kv_dim"), (TENSOR,), "self_attn.k_proj", init="zeros", present=_attn_bias, tensor="bias"),
    Param("bv", _vec("kv_dim"), (TENSOR,), "self_attn.v_proj", init="zeros", present=_attn_bias, tensor="bias"),
    # MLA (DeepSeek-V3, fp8jax.model.mla). wkv_a's 576 = 512 + 64 outputs are not a multiple of 128: FP8 quantizes
    # it with a ragged last row tile (zero-padded, as quant does for every ragged weight), and export_fp8 writes it
    # BF16 unless ragged_fp8. wkv_b is no recipe linear: decode and training both run the absorbed form, where its
    # K half multiplies q per head over qk_nope_head_dim and its V half the latent output per head
    # (``ops.grouped_linear`` over heads, BF16), not the (out, in) GEMM the FP8 recipe quantizes; NeMo RL's
    # Moonlight recipe keeps the MLA projections BF16 anyway.
    Param("wq_a", _shape("q_lora_rank", "dim"), (None, FSDP), "self_attn.q_a_proj", linear=True, present=_q_lora),
    Param("q_a_norm", _vec("q_lora_rank"), REPLICATED, "self_attn.q_a_layernorm", init="ones", present=_q_lora),
    Param("wq_b", _shape("q_dim", "q_lora_rank"), COLUMN, "self_attn.q_b_proj", linear=True, present=_q_lora),
    Param("wkv_a", _shape(_dims("kv_lora_rank", "qk_rope_head_dim"), "dim"), (None, FSDP),
          "self_attn.kv_a_proj_with_mqa", linear=True, present=_mla),
    Param("kv_a_norm", _vec("kv_lora_rank"), REPLICATED, "self_attn.kv_a_layernorm", init="ones", present=_mla),
    Param("wkv_b", _shape(_dims(("n_heads", "qk_nope_head_dim"), ("n_heads", "v_head_dim")), "kv_lora_rank"),
          (TENSOR, None), "self_attn.kv_b_proj", present=_mla, hf_linear=True),
    Param("wo", _mat("dim", "attn_out_dim"), ROW, "self_attn.o_proj", linear=True, init="normal_residual"),
    Param("q_norm", _vec("head_dim"), REPLICATED, "self_attn.q_norm", init="ones", present=_has_qk_norm),
    Param("k_norm", _vec("head_dim"), REPLICATED, "self_attn.k_norm", init="ones", present=_has_qk_norm),
    Param("mlp_norm", _vec("dim"), REPLICATED, "post_attention_layernorm", init="ones"),
    Param("w_gate", _mat("ffn_dim", "dim"), COLUMN, "mlp.gate_proj", linear=True, present=_dense_mlp),
    Param("w_up", _mat("ffn_dim", "dim"), COLUMN, "mlp.up_proj", linear=True, present=_dense_mlp),
    Param("w_down", _mat("dim", "ffn_dim"), ROW, "mlp.down_proj", linear=True, init="normal_residual",
          present=_dense_mlp),
    # Qwen3-MoE layers: the router stays BF16 (not a recipe linear: NeMo RL never quantizes it), experts block FP8.
    Param("router", _mat("n_experts", "dim"), REPLICATED, "mlp.gate", present=_moe),
    Param("expert_gate", _experts("moe_ffn_dim", "dim"), (EXPERTS, *COLUMN), "mlp.experts.{e}.gate_proj", linear=True,
          present=_moe, stacked=True),
    Param("expert_up", _experts("moe_ffn_dim", "dim"), (EXPERTS, *COLUMN), "mlp.experts.{e}.up_proj", linear=True,
          present=_moe, stacked=True),
    Param("expert_down", _experts("dim", "moe_ffn_dim"), (EXPERTS, *ROW), "mlp.experts.{e}.down_proj", linear=True,
          init="normal_residual", present=_moe, stacked=True),
    # DeepSeek-V3 MoE: the router's expert-choice bias (a buffer, FP32 in HF checkpoints; not trained by gradient:
    # the model stops its gradient) and the shared experts (one SwiGLU MLP that every token passes).
    Param("router_bias", _vec("n_experts"), REPLICATED, "mlp.gate", init="zeros", present=_moe_sigmoid,
          tensor="e_score_correction_bias", hf_dtype="float32", trainable=False),
    Param("shared_gate", _mat("shared_ffn_dim", "dim"), COLUMN, "mlp.shared_experts.gate_proj", linear=True,
          present=_shared_experts),
    Param("shared_up", _mat("shared_ffn_dim", "dim"), COLUMN, "mlp.shared_experts.up_proj", linear=True,
          present=_shared_experts),
    Param("shared_down", _mat("dim", "shared_ffn_dim"), ROW, "mlp.shared_experts.down_proj", linear=True,
          init="normal_residual", present=_shared_experts),
)

# Outside the layers. lm_head is a linear weight too, but the recipe selects it on its own (Recipe.quantize_lm_head).
TOP: tuple[Param, ...] = (
    Param("embed", _mat("vocab_size", "dim"), COLUMN, "model.embed_tokens"),
    Param("final_norm", _vec("dim"), REPLICATED, "model.norm", init="ones"),
    Param("lm_head", _mat("vocab_size", "dim"), COLUMN, "lm_head", linear=True, present=_untied),
)

BY_KEY: dict[str, Param] = {p.key: p for p in (*LAYER, *TOP)}
if len(BY_KEY) != len(LAYER) + len(TOP):
  raise ValueError("schema: parameter keys must be unique across LAYER and TOP")

LINEAR_NAMES: tuple[str, ...] = tuple(p.key for p in LAYER if p.linear)
SHARDING_RULES: dict[str, tuple[str | None, ...]] = {p.key: p.axes for p in BY_KEY.values() if p.axes}
HF_LAYER_MODULES: dict[str, str] = {p.key: p.hf for p in LAYER}
HF_TOP_MODULES: dict[str, str] = {p.key: p.hf for p in TOP}
# The bias row of a layer linear (same HF module, tensor "bias"): wq -> bq, wk -> bk, wv -> bv.
BIAS_OF: dict[str, str] = {w.key: b.key for b in LAYER if b.tensor == "bias" for w in LAYER
                           if w.linear and w.hf == b.hf}
# Tensor-parallel style of each 2-D layer linear (``ops.linear(..., parallel=)``), from its axes: output features over
# tensor -> "column", input features over tensor -> "row".
PARALLEL: dict[str, str] = {p.key: {COLUMN: "column", ROW: "row"}[p.axes] for p in LAYER
                            if p.linear and p.axes in (COLUMN, ROW)}


def layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
  return {p.key: tuple(p.shape(cfg)) for p in LAYER if p.present(cfg, layer)}


def param_shapes(cfg: ModelConfig) -> dict:
  """Shapes of every parameter: the params pytree with shape tuples as leaves."""
  top = {p.key: tuple(p.shape(cfg)) for p in TOP if p.present(cfg, None)}
  return {"embed": top.pop("embed"), "layers": [layer_shapes(cfg, i) for i in range(cfg.n_layers)], **top}


def decay_mask(cfg: ModelConfig) -> dict | None:
  """The params pytree of bools, False for the buffers (``trainable=False``) weight decay must not shrink; None when
  every parameter of ``cfg`` is trainable (the optimizer then needs no mask, and its state keeps its plain form)."""
  top = {p.key: p.trainable for p in TOP if p.present(cfg, None)}
  layers = [{p.key: p.trainable for p in LAYER if p.present(cfg, i)} for i in range(cfg.n_layers)]
  if all(top.values()) and all(v for layer in layers for v in layer.values()):
    return None
  return {"embed": top.pop("embed"), "layers": layers, **top}


def num_params(cfg: ModelConfig) -> int:
  """Parameter count (embedding and, if untied, the output head included; all experts counted)."""
  top = sum(math.prod(p.shape(cfg)) for p in TOP if p.present(cfg, None))
  return top + sum(math.prod(s) for i in range(cfg.n_layers) for s in layer_shapes(cfg, i).values())
