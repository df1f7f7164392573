"""The MoE experts on a multi-device mesh: expert parallelism over the mesh's ``expert`` axis, bitwise one device.

Layout (``fp8jax.sharding``, ``schema``): the stacked expert weights (E, out, in) keep E over ``expert`` (their
other dimensions over tensor / fsdp like the dense weights, gathered for the step as FSDP does); for the expert part
the tokens are split over every mesh axis larger than 1 (data, fsdp, tensor, expert, in that order; padded to a
multiple). Per device, inside ``shard_map`` (``expert_rows``), with ``ep`` devices on the expert axis and E / ep
experts on each:

  1. **dispatch**: the expert group's tokens and their expert ids are all-gathered over ``expert`` (Megatron's
     "allgather" token dispatcher: at top-k with k >= ep it moves no more bytes than an all-to-all of the k
     assignments, and a token's row travels once, not k times);
  2. **experts**: each device runs its experts on the assignments routed to them through the one-device code
     (``experts.tile_plan``, ``experts.swiglu_tiles``). The gathered tokens are in the group's global order and the
     sort by expert is stable, so an expert's tile rows are the rows one device would give it, in the same order: its
     outputs, dgrad rows and (when ``expert`` is the only axis that splits tokens) its weight gradient are bitwise
     one device's. Other token axes add their partial weight gradients (``shard_map``'s psum), as any data
     parallel gradient;
  3. **return**: each assignment's output row goes back to the device owning its token (``to_owners``), where the
     caller combines the k slots in slot order as on one device. No partial sums cross devices: a token's slots
     added in another order would round otherwise.

The backward mirrors it: output cotangents go to the experts' devices (``from_owners``, the transpose of
``to_owners``), and each assignment's dgrad row goes back to its token's device (``to_owners`` again), where the k
slots are added in slot order in FP32 (``experts.sum_slots``), as one device's dispatch backward does.

The return is a ragged exchange (each device sends each other device the rows it computed for that device's
tokens). On GPU it is one ``lax.ragged_all_to_all``; XLA:CPU has no such op, so on CPU an all-gather of the send
buffers stands in (ep x the bytes; the same rows land in the same places: ``_ragged_exchange``). The plan (sizes
and offsets) is computed on every device from the group's gathered expert ids: no sizes are exchanged.
With ``ep`` = 1 (a mesh without expert parallelism) each device runs all experts on its own tokens, no exchange.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp8jax import ops, sharding
from fp8jax.model import experts
from fp8jax.model.config import ModelConfig
from pallas_kernels import grouped_gemm as grouped_ref

AXIS = "expert"
TOKEN_AXES = ("data", "fsdp", "tensor", "expert")  # expert last: an expert group's token blocks are contiguous
EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")


def _exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each assignment's row goes between the experts' devices and the tokens' devices (int32, per device).

  ``count[o, s]``: assignments of device o's tokens run on device s. As a sender (expert side) this device packs its
  rows in the gathered assignment order (``send_order``: its own first), which groups them by token owner; as a
  receiver (token side) its assignments arrive grouped by the device that ran them (``recv_order``)."""

  send_order: jax.Array  # (G,) gathered assignments, those run here first (in order)
  recv_order: jax.Array  # (A,) this device's assignments sorted by the device running them (padding last)
  recv_pos: jax.Array  # (A,) inverse of recv_order: where assignment a sits in the receive buffer
  count: jax.Array  # (ep, ep) [owner, runner]
  rank: jax.Array  # () this device's index on the expert axis


def make_plan(runner_G, n_local: int, ep: int) -> Plan:
  """``runner_G``: the device (index on the expert axis; ``ep`` for padding) running each of the group's gathered
  assignments, ``n_local`` of them per device, in owner order."""
  r = jax.lax.axis_index(AXIS)
  owner_G = jnp.arange(runner_G.shape[0], dtype=jnp.int32) // n_local
  count = jnp.zeros((ep, ep + 1), jnp.int32).at[owner_G, runner_G].add(1)[:, :ep]
  send_order = jnp.argsort(jnp.where(runner_G == r, 0, 1), stable=True).astype(jnp.int32)
  mine_runner = jax.lax.dynamic_slice_in_dim(runner_G, r * n_local, n_local)
  recv_order = jnp.argsort(mine_runner, stable=True).astype(jnp.int32)
  recv_pos = jnp.zeros_like(recv_order).at[recv_order].set(jnp.arange(n_local, dtype=jnp.int32))
  return Plan(send_order, recv_order, recv_pos, count, r)


def _ragged_exchange(operand, out_rows: int, input_offsets, send_sizes, output_offsets, recv_sizes, native: bool):
  """``lax.ragged_all_to_all`` over the expert axis into a zero buffer of ``out_rows`` rows (``native``: GPU); on
  CPU, which cannot run it, the same result from an all-gather of every device's operand and plan."""
  output = jnp.zeros((out_rows, *operand.shape[1:]), operand.dtype)
  if native:
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=AXIS)
  r = jax.lax.axis_index(AXIS)
  ops_all = jax.lax.all_gather(operand, AXIS)  # (ep, N, ...)
  in_off, sizes, out_off = (jax.lax.all_gather(v, AXIS)[:, r] for v in (input_offsets, send_sizes, output_offsets))
  j = jnp.arange(out_rows, dtype=jnp.int32)
  inside = (j[None] >= out_off[:, None]) & (j[None] < (out_off + sizes)[:, None])  # (ep sources, out_rows)
  src = jnp.argmax(inside, axis=0)
  row = jnp.clip(in_off[src] + j - out_off[src], 0, operand.shape[0] - 1)
  got = ops_all[src, row]
  return jnp.where(jnp.any(inside, axis=0).reshape(-1, *([1] * (operand.ndim - 1))), got, output)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def to_owners(rows_GxD, plan: Plan, native: bool):
  """Rows of the group's gathered assignments computed here (others ignored) -> this device's assignments' rows
  (A, D), each from the device that ran it (zeros for padding)."""
  runner = plan.count[:, plan.rank]  # rows this device ran, per owner
  send = jnp.take(rows_GxD, plan.send_order, axis=0)
  buf = _ragged_exchange(send, plan.recv_order.shape[0], _exclusive_cumsum(runner), runner,
                         _exclusive_cumsum(plan.count, axis=1)[:, plan.rank], plan.count[plan.rank], native)
  return jnp.take(buf, plan.recv_pos, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def from_owners(rows_AxD, plan: Plan, native: bool):
  """The transpose of ``to_owners``: this device's assignments' rows -> the devices that ran them, placed at the
  gathered assignment rows there (G, D) (zeros for rows run elsewhere)."""
  mine = plan.count[plan.rank]  # this device's assignments, per runner
  buf = jnp.take(rows_AxD, plan.recv_order, axis=0)
  send = _ragged_exchange(buf, plan.send_order.shape[0], _exclusive_cumsum(mine), mine,
                          _exclusive_cumsum(plan.count, axis=0)[plan.rank], plan.count[:, plan.rank], native)
  return jnp.zeros_like(send).at[plan.send_order].set(send)


def _no_plan_ct(plan):
  return jax.tree.map(lambda _: None, plan)


to_owners.defvjp(lambda rows, plan, native: (to_owners(rows, plan, native), plan),
                 lambda native, plan, ct: (from_owners(ct, plan, native), _no_plan_ct(plan)))
from_owners.defvjp(lambda rows, plan, native: (from_owners(rows, plan, native), plan),
                   lambda native, plan, ct: (to_owners(ct, plan, native), _no_plan_ct(plan)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dispatch(x_MxD, row_G, plan: Plan, p: int, k: int, native: bool):
  """This device's tokens -> the (p, D) tile buffer of its experts over the group's gathered tokens
  (``experts.dispatch`` over an all-gather). The gradient: each assignment's row back to its token's device, the k
  added in slot order."""
  x_all = jax.lax.all_gather(x_MxD, AXIS, tiled=True)
  return jnp.take(x_all, grouped_ref.source_rows(row_G, p) // k, axis=0, mode="fill", fill_value=0)


def _dispatch_fwd(x_MxD, row_G, plan, p, k, native):
  return _dispatch(x_MxD, row_G, plan, p, k, native), (row_G, plan, jnp.zeros((0,), x_MxD.dtype))


def _dispatch_bwd(p, k, native, res, ct_PxD):
  row_G, plan, tag = res
  rows = to_owners(jnp.take(ct_PxD, row_G, axis=0, mode="fill", fill_value=0), plan, native)  # (M k, D)
  per_slot = rows.astype(jnp.float32).reshape(-1, k, ct_PxD.shape[1])
  return experts.sum_slots(per_slot).astype(tag.dtype), None, _no_plan_ct(plan)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _device_rows(x_MxD, experts_Mxk, w, *, n_experts: int, ep: int, lcfg: ops.LinearConfig, native: bool):
  """One device's part (inside ``shard_map``): its tokens' assignments' rows (M k, D)."""
  if ep == 1:  # every expert here, only this device's tokens
    return experts.local_expert_rows(w, x_MxD, experts_Mxk, n_experts, lcfg)
  k = experts_Mxk.shape[1]
  n_local = n_experts // ep
  experts_G = jax.lax.all_gather(experts_Mxk, AXIS, tiled=True).reshape(-1)  # padding: n_experts
  runner_G = jnp.where(experts_G < n_experts, experts_G // n_local, ep).astype(jnp.int32)
  plan = make_plan(runner_G, experts_Mxk.size, ep)
  local_G = jnp.where(runner_G == plan.rank, experts_G - plan.rank * n_local, n_local)
  row_G, tile_expert, n_rows = experts.tile_plan(local_G, n_local)
  ys = experts.swiglu_tiles(w, _dispatch(x_MxD, row_G, plan, n_rows, k, native), tile_expert, lcfg)
  return to_owners(grouped_ref.from_tiles(ys, row_G), plan, native)


def token_axes(mesh) -> tuple[str, ...]:
  return tuple(a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1)


def expert_rows(p, x_MxD, experts_Mxk, cfg: ModelConfig, lcfg: ops.LinearConfig):
  """``moe.expert_rows`` on ``lcfg.mesh`` (multi-device): (M * k, D), bitwise the one-device rows."""
  mesh = lcfg.mesh
  ep = sharding.expert_axis_size(mesh)
  if cfg.n_experts % ep:
    raise ValueError(f"mesh.expert={ep} must divide model.n_experts={cfg.n_experts} (each device holds "
                     f"n_experts / expert of them)")
  axes = token_axes(mesh)
  m, k = experts_Mxk.shape
  n_dev = math.prod(mesh.shape[a] for a in axes)
  pad = -m % n_dev
  if pad:  # padding tokens: zero rows routed nowhere (expert id n_experts), sliced off below
    x_MxD = jnp.pad(x_MxD, ((0, pad), (0, 0)))
    experts_Mxk = jnp.pad(experts_Mxk, ((0, pad), (0, 0)), constant_values=cfg.n_experts)
  w = {name: p[name] for name in EXPERT_WEIGHTS}
  w_specs = jax.tree.map(lambda _: P(AXIS) if ep > 1 else P(), w)
  native = mesh.devices.flat[0].platform != "cpu"  # XLA:CPU has no ragged all-to-all
  fn = functools.partial(_device_rows, n_experts=cfg.n_experts, ep=ep, lcfg=dataclasses.replace(lcfg, mesh=None),
                         native=native)
  rows = sharding.per_device(fn, mesh, (P(axes), P(axes), w_specs), P(axes))(x_MxD, experts_Mxk, w)
  return rows[:m * k]
