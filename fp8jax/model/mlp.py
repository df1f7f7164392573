"""The dense SwiGLU MLP block: w_down(silu(w_gate x) * w_up x)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax import ops
from fp8jax.model.schema import PARALLEL


def mlp(p, x, lcfg):
  gate = ops.linear(x, p["w_gate"], lcfg, PARALLEL["w_gate"])
  up = ops.linear(x, p["w_up"], lcfg, PARALLEL["w_up"])
  return ops.linear(jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up, p["w_down"], lcfg, PARALLEL["w_down"])
