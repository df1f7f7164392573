"""Recipes: which weights of a parameter tree become FP8, and the two calls that apply one.

The quantizer (``fp8jax.quant``) says *how* a weight is quantized; a ``Recipe`` says *which* weights are, and whether
the sampler, the trainer or both run them in FP8. Two calls apply it to a tree:

* ``quantize_params(tree, recipe)`` -> every selected weight replaced by a ``QWeight`` (codes + tile scales): what the
  sampler, the frozen reference policy and the block-FP8 export run on.
* ``mark_fp8(tree, recipe)`` -> every selected weight wrapped in ``FP8Weight`` (the master weight, quantized inside
  ``fp8jax.ops.linear`` with the same ``quantize_weight``, so both forms give the same bits; the gradient reaches the
  master).

Which leaves are weights: on fp8jax's own model tree (``{"embed", "layers": [...], ...}``) the parameter schema's
linear weights (``fp8jax.model.schema.LINEAR_NAMES``; ``lm_head`` with ``quantize_lm_head``). On any other pytree
pass ``where``: a predicate ``where(path, leaf) -> bool`` or fnmatch patterns over the leaf's ``/``-joined path
(``"*/kernel"``, ``"encoder/*/dense/kernel"``). ``layout="in_out"`` says the selected weights are stored (in, out), as
Flax's ``Dense`` kernels are: they are transposed once to the (out, in) layout ``QWeight`` keeps, so
``fp8jax.linear(x, qw)`` computes ``x @ kernel``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from fp8jax import quant
from fp8jax.config_utils import dataclass_from_group
from fp8jax.model import schema

MODES = ("fp8", "bf16", "fp8_rollout")
KV_CACHE_KINDS = quant.KV_CACHE_KINDS
# Linear weights of fp8jax's model (the names used in its params); everything else stays BF16/FP32.
LINEAR_NAMES = schema.LINEAR_NAMES  # the layer weights the recipe may quantize (lm_head: Recipe.quantize_lm_head)
LAYOUTS = ("out_in", "in_out")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a model's linear layers are quantized. Built from the config's ``fp8`` group by ``Recipe.from_config``.

  mode: "fp8" (block FP8 GEMMs in the sampler and the trainer: one engine), "bf16" (no quantization; same call
    sites), or "fp8_rollout" (FP8 in generation only, NeMo RL's two-engine setup: the sampler runs block-FP8 weights
    requantized from the BF16 policy after every step, and the FP8 KV cache if kv_cache="fp8"; the trainer runs BF16,
    K/V unquantized). A "fp8_rollout" recipe is not used directly: ``sampler_side()`` / ``trainer_side()`` give the
    one-sided recipe each engine runs, with the same model function and quantizer as the other modes.
  keep_first_n / keep_last_n: decoder layers kept in BF16 at either end (NeMo RL's recipe allows this).
  keep_patterns: fnmatch patterns over parameter paths ("layers/3/wo", "*/w_down") kept in BF16.
  pow2_scales: round scales up to powers of two.
  kv_cache: "bf16" or "fp8" (rollout KV cache; training applies the same K/V quantization when "fp8").
  gemm_backend: "auto" (Pallas kernel on sm_90, XLA reference elsewhere), "xla" or "pallas".
  Embeddings, norms and the output head are never quantized (``lm_head`` can be opted in with quantize_lm_head).
  """

  mode: str = "fp8"
  keep_first_n: int = 0
  keep_last_n: int = 0
  keep_patterns: tuple[str, ...] = ()
  pow2_scales: bool = False
  kv_cache: str = "bf16"
  gemm_backend: str = "auto"
  quantize_lm_head: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"fp8.mode must be one of {MODES}, got {self.mode!r}")
    if self.kv_cache not in KV_CACHE_KINDS:
      raise ValueError(f"fp8.kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
    if self.gemm_backend not in ("auto", "xla", "pallas"):
      raise ValueError(f"fp8.gemm_backend must be 'auto', 'xla' or 'pallas', got {self.gemm_backend!r}")
    if self.keep_first_n < 0 or self.keep_last_n < 0:
      raise ValueError("fp8.keep_first_n and fp8.keep_last_n must be >= 0")
    if isinstance(self.keep_patterns, str):
      raise ValueError(f"fp8.keep_patterns must be a tuple of patterns, got the string {self.keep_patterns!r}")
    object.__setattr__(self, "keep_patterns", tuple(self.keep_patterns))

  @classmethod
  def from_config(cls, c: Any) -> "Recipe":
    return dataclass_from_group(cls, c, "fp8")

  def sampler_side(self) -> "Recipe":
    """The recipe the sampler runs: FP8 weights for "fp8_rollout", else this recipe."""
    return dataclasses.replace(self, mode="fp8") if self.mode == "fp8_rollout" else self

  def trainer_side(self) -> "Recipe":
    """The recipe the trainer runs: BF16 GEMMs and unquantized K/V for "fp8_rollout", else this recipe."""
    return dataclasses.replace(self, mode="bf16", kv_cache="bf16") if self.mode == "fp8_rollout" else self

  def check_one_side(self, what: str) -> None:
    """Raises for a two-sided ("fp8_rollout") recipe where one engine's recipe is needed."""
    if self.mode == "fp8_rollout":
      raise ValueError(f"{what}: fp8.mode='fp8_rollout' quantizes the sampler's weights only; pick the engine's "
                       f"recipe with Recipe.sampler_side() or Recipe.trainer_side() first")

  def selects(self, path: str, layer: int | None, num_layers: int) -> bool:
    """Whether the linear weight at ``path`` (in decoder layer ``layer``, or None) is quantized to FP8."""
    self.check_one_side("Recipe.selects (quantize_params / mark_fp8)")
    if self.mode != "fp8":
      return False
    if layer is not None and (layer < self.keep_first_n or layer >= num_layers - self.keep_last_n):
      return False
    return not any(fnmatch.fnmatchcase(path, p) for p in self.keep_patterns)


# ------------------------------------------------------------------------------------------------------------------
# Applying a recipe to a tree
# ------------------------------------------------------------------------------------------------------------------

Where = Callable[[str, Any], bool] | Sequence[str] | str | None
_LAYER_PATH = re.compile(r"^layers/(\d+)/")


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(path) -> str:
  """A ``jax.tree_util`` key path as ``a/b/0/c`` (the form ``keep_patterns`` and ``where`` patterns match)."""
  return "/".join(_key_name(k) for k in path)


def is_model_tree(tree) -> bool:
  """Whether ``tree`` is laid out like fp8jax's model params (a list of per-layer dicts under ``layers``; the full
  tree also has ``embed``, a stack of blocks alone does not)."""
  layers = tree.get("layers") if isinstance(tree, dict) else None
  return isinstance(layers, (list, tuple)) and all(isinstance(x, dict) for x in layers)


def _model_where(recipe: Recipe) -> Callable[[str, Any], bool]:
  def where(path: str, leaf) -> bool:
    if path == "lm_head":
      return recipe.quantize_lm_head
    m = _LAYER_PATH.match(path)
    return bool(m) and path[m.end():] in LINEAR_NAMES
  return where


def _as_predicate(where: Where, tree, recipe: Recipe) -> Callable[[str, Any], bool]:
  if where is None:
    if not is_model_tree(tree):
      keys = list(tree)[:6] if isinstance(tree, dict) else type(tree).__name__
      raise ValueError(f"quantize_params / mark_fp8: this tree is not fp8jax's model params ({{'layers': "
                       f"[{{...}}, ...], ...}}; got {keys}); say which leaves are weights with where= (fnmatch "
                       f"patterns over '/'-joined paths such as '*/kernel', or a predicate (path, leaf) -> bool)")
    return _model_where(recipe)
  if callable(where):
    return where
  patterns = (where,) if isinstance(where, str) else tuple(where)
  return lambda path, leaf: any(fnmatch.fnmatchcase(path, p) for p in patterns)


def _apply(tree, recipe: Recipe, where: Where, layout: str, fn, what: str):
  """``fn(w)`` on every weight ``where`` picks and ``recipe`` selects, (out, in) layout; the rest unchanged."""
  if layout not in LAYOUTS:
    raise ValueError(f"{what}: layout must be one of {LAYOUTS}, got {layout!r}")
  recipe.check_one_side(what)
  pick = _as_predicate(where, tree, recipe)
  num_layers = len(tree["layers"]) if is_model_tree(tree) else 0

  def visit(path, leaf):
    p = path_str(path)
    if not pick(p, leaf):
      return leaf
    m = _LAYER_PATH.match(p)
    layer = int(m.group(1)) if m and num_layers else None
    if not recipe.selects(p, layer, num_layers):
      return leaf
    if quant.is_fp8_leaf(leaf):
      return fn(leaf)
    if len(getattr(leaf, "shape", ())) < 2:
      raise ValueError(f"{what}: the leaf at {p!r} has shape {tuple(getattr(leaf, 'shape', ()))}; a weight is 2-D "
                       f"(or 3-D stacked experts); where= picked a bias or norm scale?")
    return fn(leaf.swapaxes(-1, -2) if layout == "in_out" else leaf)

  return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=quant.is_fp8_leaf)


def quantize_params(params, recipe: Recipe = Recipe(), where: Where = None, layout: str = "out_in"):
  """The tree with every selected weight replaced by a ``QWeight`` (module docstring: which leaves, ``where``,
  ``layout``). Weights that are already ``QWeight`` stay as they are.

  This is what the sampler, the reference policy and the FP8 export run on; the trainer's forward quantizes the
  same weights with the same ``quantize_weight`` inside ``fp8jax.ops.linear`` (see ``mark_fp8``), so both agree.
  """
  def q(w):
    if isinstance(w, quant.QWeight):
      return w
    return quant.quantize_weight(w.w if isinstance(w, quant.FP8Weight) else w, recipe.pow2_scales)
  return _apply(params, recipe, where, layout, q, "quantize_params")


def mark_fp8(params, recipe: Recipe = Recipe(), where: Where = None, layout: str = "out_in"):
  """The tree with every selected weight wrapped in ``FP8Weight`` (differentiable: ``ops.linear`` quantizes it).
  Weights that are already ``QWeight`` (from ``quantize_params``) or ``FP8Weight`` stay as they are. With
  ``layout="in_out"`` the wrapped master is the transposed kernel (its gradient comes back transposed too)."""
  return _apply(params, recipe, where, layout, lambda w: w if quant.is_fp8_leaf(w) else quant.FP8Weight(w),
                "mark_fp8")
