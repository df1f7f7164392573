"""The Flax layers compute exactly fp8jax.ops.linear (+ the bias on its FP32 output) and train through it."""

import fp8jax

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp8jax import ops, quant, recipes
from fp8jax.flax import FP8Dense, FP8Linear


def _ref(x, w_out_in, bias=None, fp8=True):
  """The layer's promised math from the op: GEMM on the (out, in) weight, FP32 bias add, one rounding to BF16."""
  w = quant.FP8Weight(w_out_in) if fp8 else w_out_in
  if bias is None:
    return ops.linear(x, w)
  y = ops.linear(x, w, ops.LinearConfig(out_dtype="float32"))
  return (y + bias.astype(jnp.float32)).astype(jnp.bfloat16)


def test_nnx_linear_in_out_layout_with_bias_equals_op_and_has_gradients():
  layer = FP8Linear(256, 128, rngs=nnx.Rngs(0))
  assert layer.kernel[...].shape == (256, 128) and layer.bias[...].shape == (128,)
  layer.bias[...] = jax.random.normal(jax.random.key(3), (128,))
  x = jax.random.normal(jax.random.key(1), (4, 256), jnp.bfloat16)
  np.testing.assert_array_equal(layer(x), _ref(x, layer.kernel[...].T, layer.bias[...]))
  g = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(layer)
  assert g.kernel[...].shape == (256, 128) and g.kernel[...].dtype == jnp.float32
  assert float(jnp.abs(g.kernel[...]).max()) > 0 and float(jnp.abs(g.bias[...]).max()) > 0


def test_nnx_linear_out_in_layout_without_bias_is_the_op():
  layer = FP8Linear(256, 128, rngs=nnx.Rngs(0), use_bias=False, kernel_layout="out_in")
  x = jax.random.normal(jax.random.key(1), (4, 256), jnp.bfloat16)
  assert layer.kernel[...].shape == (128, 256) and layer.bias is None
  np.testing.assert_array_equal(layer(x), ops.linear(x, quant.FP8Weight(layer.kernel[...])))


def test_linen_dense_fp8_and_bf16_modes():
  x = jax.random.normal(jax.random.key(2), (3, 128), jnp.bfloat16)
  fp8, bf16 = FP8Dense(256), FP8Dense(256, recipe=recipes.Recipe(mode="bf16"))
  params = fp8.init(jax.random.key(0), x)
  k, b = params["params"]["kernel"], params["params"]["bias"]
  assert k.shape == (128, 256) and b.shape == (256,)
  params = jax.tree.map(lambda a: a, params)
  params["params"]["bias"] = jnp.linspace(-1, 1, 256)
  b = params["params"]["bias"]
  np.testing.assert_array_equal(fp8jax.jit(fp8.apply)(params, x), _ref(x, k.T, b))
  np.testing.assert_array_equal(bf16.apply(params, x), _ref(x, k.T, b, fp8=False))


def test_layout_is_checked():
  with pytest.raises(ValueError, match="kernel_layout"):
    FP8Linear(128, 128, rngs=nnx.Rngs(0), kernel_layout="io")
