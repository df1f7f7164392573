"""The routed experts of a MoE layer on one device: assignments sorted into the grouped GEMMs' tile layout, the
experts' SwiGLU as three grouped GEMMs, and the rows back in assignment order. ``fp8jax.model.moe`` (routing and
combine) runs this directly on one device; ``fp8jax.model.moe_parallel`` runs it per device over a mesh."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax import ops
from pallas_kernels import grouped_gemm as grouped_ref


def sum_slots(y_MxkxD):
  """The k slots of each token added in slot order, as elementwise adds: a reduce's order may follow the shape (seen:
  decode != training), and a scatter-add's is not fixed at all."""
  out = y_MxkxD[:, 0]
  for slot in range(1, y_MxkxD.shape[1]):
    out = out + y_MxkxD[:, slot]
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dispatch(x_MxD, row_A, p: int, k: int):
  """Token rows -> the (p, D) tile buffer: assignment a = token * k + slot of token ``a // k`` goes to buffer row
  ``row_A[a]`` (zeros elsewhere). The gradient adds each token's k buffer rows in slot order, in FP32 (a fixed
  order on every backend, where a scatter-add's order is not)."""
  tok_P = grouped_ref.source_rows(row_A, p) // k  # M (past the last token: a zero row) where no assignment lands
  return jnp.take(x_MxD, tok_P, axis=0, mode="fill", fill_value=0)


def _dispatch_fwd(x_MxD, row_A, p, k):
  return dispatch(x_MxD, row_A, p, k), (row_A, jnp.zeros((0,), x_MxD.dtype))


def _dispatch_bwd(p, k, res, ct_PxD):
  row_A, tag = res
  per_slot = jnp.take(ct_PxD, row_A, axis=0).astype(jnp.float32).reshape(-1, k, ct_PxD.shape[1])
  return sum_slots(per_slot).astype(tag.dtype), None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def tile_plan(local_A, n_local: int):
  """The grouped GEMMs' tile layout for assignments whose expert, among the ``n_local`` run here, is ``local_A``
  (``n_local``: run elsewhere, or padding) -> (row_A: each assignment's buffer row, ``p`` for those not run here;
  tile_expert_T; p, the buffer's static row count). The assignments are sorted by expert with a stable sort, so an
  expert's rows keep the assignments' order: a function of the routing alone."""
  n_a = local_A.shape[0]
  order = jnp.argsort(local_A, stable=True)
  sizes_E = jnp.bincount(local_A, length=n_local + 1)[:n_local].astype(jnp.int32)
  dest_S, tile_expert = grouped_ref.layout(sizes_E, n_a)  # buffer row of the s-th sorted assignment
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n_a, dtype=order.dtype))
  return dest_S[inverse], tile_expert, grouped_ref.padded_rows(n_a, n_local)


def swiglu_tiles(p, xs_PxD, tile_expert_T, lcfg: ops.LinearConfig):
  """The experts' SwiGLU on rows in the tile layout: three grouped GEMMs (gate, up, down)."""
  gate = ops.grouped_linear_tiles(xs_PxD, p["expert_gate"], tile_expert_T, lcfg)
  up = ops.grouped_linear_tiles(xs_PxD, p["expert_up"], tile_expert_T, lcfg)
  h = jax.nn.silu(gate.astype(jnp.float32)).astype(xs_PxD.dtype) * up
  return ops.grouped_linear_tiles(h, p["expert_down"], tile_expert_T, lcfg)


def local_expert_rows(p, x_MxD, experts_Mxk, n_experts: int, lcfg: ops.LinearConfig):
  """``expert_rows`` with every expert here (one device, or one device's tokens under ``moe_parallel``)."""
  k = experts_Mxk.shape[1]
  row_A, tile_expert, n_rows = tile_plan(experts_Mxk.reshape(-1), n_experts)
  # The experts' rows live in the grouped GEMM's tile layout from dispatch to combine (one gather in, one out).
  ys = swiglu_tiles(p, dispatch(x_MxD, row_A, n_rows, k), tile_expert, lcfg)
  return grouped_ref.from_tiles(ys, row_A)
