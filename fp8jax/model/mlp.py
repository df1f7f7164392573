"""The dense SwiGLU MLP block: w_down(silu(w_gate x) * w_up x)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax import ops
from fp8jax.model import fuse
from fp8jax.model.schema import PARALLEL


def mlp(p, x, lcfg, prefix: str = "w_"):
  """``prefix``: "w_" (w_gate, w_up, w_down: a dense layer) or "shared_" (DeepSeek-V3's shared experts)."""
  gate, up, down = prefix + "gate", prefix + "up", prefix + "down"
  g, u = fuse.project(p, x, (gate, up), None, lcfg)
  return ops.linear(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u, p[down], lcfg, PARALLEL[down])
