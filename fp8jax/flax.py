"""Flax layers: drop-in FP8 linear layers for your own Flax models (nnx and linen).

``FP8Linear`` (nnx) and ``FP8Dense`` (linen) take the arguments of ``flax.nnx.Linear`` / ``flax.linen.Dense`` that
matter here and store their parameters the same way: ``kernel`` (in_features, out_features) and, with
``use_bias=True`` (the default, as in Flax), ``bias`` (out_features,). ``kernel_layout="out_in"`` stores the kernel
(out, in) instead, as PyTorch / HF checkpoints do (what ``fp8jax.ops.linear`` reads without a transpose).

Both call ``fp8jax.ops.linear``: in FP8 mode the kernel is quantized to 128x128 blocks and the activations to 1x128
groups inside the op (custom VJP: FP8 dgrad and wgrad, an FP32 gradient for the kernel); in BF16 mode it is a BF16
matmul. The bias is added to the GEMM's FP32 output, then the sum is rounded once to ``out_dtype``. Compile your
steps with ``fp8jax.jit`` (or call ``fp8jax.configure_xla()`` first) for fp8jax's rounding rules.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from fp8jax import ops, quant, recipes

KERNEL_LAYOUTS = ("in_out", "out_in")
_INIT = {"in_out": nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1),
         "out_in": nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)}


def _check(layout: str, recipe: recipes.Recipe):
  if layout not in KERNEL_LAYOUTS:
    raise ValueError(f"fp8jax.flax: kernel_layout must be one of {KERNEL_LAYOUTS}, got {layout!r}")
  recipe.check_one_side("fp8jax.flax layers")


def _shape(layout: str, in_features: int, out_features: int) -> tuple[int, int]:
  return (in_features, out_features) if layout == "in_out" else (out_features, in_features)


def _apply(x, kernel, bias, recipe: recipes.Recipe, out_dtype: str, layout: str):
  w = kernel.T if layout == "in_out" else kernel  # ops.linear reads (out, in)
  w = quant.FP8Weight(w) if recipe.mode == "fp8" else w
  if bias is None:
    return ops.linear(x, w, ops.LinearConfig.from_recipe(recipe, out_dtype=out_dtype))
  y = ops.linear(x, w, ops.LinearConfig.from_recipe(recipe, out_dtype="float32"))
  return (y + bias.astype(jnp.float32)).astype(out_dtype)


class FP8Linear(nnx.Module):
  """``y = x @ kernel + bias`` with block-FP8 GEMMs (nnx; module docstring for layouts and rounding)."""

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, use_bias: bool = True,
               recipe: recipes.Recipe = recipes.Recipe(), param_dtype=jnp.float32, out_dtype: str = "bfloat16",
               kernel_layout: str = "in_out"):
    _check(kernel_layout, recipe)
    shape = _shape(kernel_layout, in_features, out_features)
    self.kernel = nnx.Param(_INIT[kernel_layout](rngs.params(), shape, param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
    self.recipe, self.out_dtype, self.kernel_layout = recipe, out_dtype, kernel_layout

  def __call__(self, x):
    bias = None if self.bias is None else self.bias[...]
    return _apply(x, self.kernel[...], bias, self.recipe, self.out_dtype, self.kernel_layout)


class FP8Dense(nn.Module):
  """``y = x @ kernel + bias`` with block-FP8 GEMMs (linen; module docstring for layouts and rounding)."""

  features: int
  use_bias: bool = True
  recipe: recipes.Recipe = recipes.Recipe()
  param_dtype: jnp.dtype = jnp.float32
  out_dtype: str = "bfloat16"
  kernel_layout: str = "in_out"

  @nn.compact
  def __call__(self, x):
    _check(self.kernel_layout, self.recipe)
    shape = _shape(self.kernel_layout, x.shape[-1], self.features)
    kernel = self.param("kernel", _INIT[self.kernel_layout], shape, self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype) if self.use_bias \
        else None
    return _apply(x, kernel, bias, self.recipe, self.out_dtype, self.kernel_layout)
