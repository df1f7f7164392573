"""The dense SwiGLU MLP block: w_down(silu(w_gate x) * w_up x)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax import ops


def mlp(p, x, lcfg, prefix: str = "w_"):
  """``prefix``: "w_" (w_gate, w_up, w_down: a dense layer) or "shared_" (DeepSeek-V3's shared experts)."""
  gate = ops.linear(x, p[prefix + "gate"], lcfg)
  up = ops.linear(x, p[prefix + "up"], lcfg)
  return ops.linear(jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up, p[prefix + "down"], lcfg)
