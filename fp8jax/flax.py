"""Flax adapters: drop-in FP8 linear layers for your own Flax models (nnx and linen).

Both store the kernel like PyTorch / HF, (out_features, in_features), and call ``fp8jax.ops.linear``: in FP8 mode the
weight is quantized to 128x128 blocks and the activations to 1x128 groups inside the op (custom VJP: FP8 dgrad and
wgrad, FP32 gradient for the kernel); in BF16 mode it is a BF16 matmul. Compile your steps with ``fp8jax.jit``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from fp8jax import ops, quant
from fp8jax import recipes

_INIT = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)  # kernel is (out, in)


def _apply(x, kernel, recipe: recipes.Recipe, out_dtype: str):
  recipe.check_one_side("fp8jax.flax layers")
  w = quant.FP8Weight(kernel) if recipe.mode == "fp8" else kernel
  return ops.linear(x, w, ops.LinearConfig.from_recipe(recipe, out_dtype=out_dtype))


class FP8Linear(nnx.Module):
  """``y = x @ kernel.T`` with block-FP8 GEMMs (nnx)."""

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, recipe: recipes.Recipe = recipes.Recipe(),
               param_dtype=jnp.float32, out_dtype: str = "bfloat16"):
    self.kernel = nnx.Param(_INIT(rngs.params(), (out_features, in_features), param_dtype))
    self.recipe, self.out_dtype = recipe, out_dtype

  def __call__(self, x):
    return _apply(x, self.kernel[...], self.recipe, self.out_dtype)


class FP8Dense(nn.Module):
  """``y = x @ kernel.T`` with block-FP8 GEMMs (linen)."""

  features: int
  recipe: recipes.Recipe = recipes.Recipe()
  param_dtype: jnp.dtype = jnp.float32
  out_dtype: str = "bfloat16"

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", _INIT, (self.features, x.shape[-1]), self.param_dtype)
    return _apply(x, kernel, self.recipe, self.out_dtype)
