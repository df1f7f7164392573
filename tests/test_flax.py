"""The Flax adapters compute exactly fp8jax.ops.linear and train through it."""

import fp8jax

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8jax import ops, quant
from fp8jax import recipes
from fp8jax.flax import FP8Dense, FP8Linear


def test_nnx_linear_equals_op_and_has_gradients():
  layer = FP8Linear(256, 128, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 256), jnp.bfloat16)
  np.testing.assert_array_equal(layer(x), ops.linear(x, quant.FP8Weight(layer.kernel[...])))
  assert layer.kernel[...].shape == (128, 256)
  g = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(layer)
  assert g.kernel[...].dtype == jnp.float32 and float(jnp.abs(g.kernel[...]).max()) > 0


def test_linen_dense_fp8_and_bf16_modes():
  x = jax.random.normal(jax.random.key(2), (3, 128), jnp.bfloat16)
  fp8, bf16 = FP8Dense(256), FP8Dense(256, recipe=recipes.Recipe(mode="bf16"))
  params = fp8.init(jax.random.key(0), x)
  k = params["params"]["kernel"]
  np.testing.assert_array_equal(fp8jax.jit(fp8.apply)(params, x), ops.linear(x, quant.FP8Weight(k)))
  np.testing.assert_array_equal(bf16.apply(params, x), ops.linear(x, k))
