"""The dense SwiGLU MLP block: w_down(silu(w_gate x) * w_up x)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax import ops


def mlp(p, x, lcfg):
  gate = ops.linear(x, p["w_gate"], lcfg)
  up = ops.linear(x, p["w_up"], lcfg)
  return ops.linear(jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up, p["w_down"], lcfg)
