"""Mesh and partition rules, in one place.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters and optimizer state sharded),
``expert`` (expert parallel: a MoE layer's experts split over it, and data parallel for everything else),
``tensor`` (Megatron-style tensor parallel). Rules are keyed by the parameter's leaf name, so the same rules
serve master params, their optimizer moments (optax keeps trees of the same structure) and quantized weights.
They come from the parameter schema (``fp8jax.model.schema``: each parameter's axes); for the dense decoder:

  wq, wk, wv, w_gate, w_up (out, in):  out over tensor, in over fsdp  (column parallel)
  wo, w_down              (out, in):   out over fsdp,  in over tensor (row parallel)
  embed, lm_head          (V, D):      V over tensor,  D over fsdp
  expert_gate/up/down     (E, out, in): E over expert, then as the dense ones (fp8jax.model.moe_parallel)
  norms, scalars, FP8 scales:          replicated
A dimension that a mesh axis does not divide stays unsharded on that axis (so tiny models work on any mesh).
Batches are sharded over (data, fsdp, expert) on their first dimension. A mesh built by hand may leave out axes of
size 1 (e.g. ``Mesh(devices, ("data", "fsdp", "tensor"))``): rules naming a missing axis leave that dimension whole.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax.model import schema

AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the axes that shard a batch's first (token / sequence) dimension
_RULES = schema.SHARDING_RULES  # leaf name -> mesh axis per dimension (fp8jax.model.schema)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """Mesh from the config's ``mesh`` group; one size may be -1 (all remaining devices), an axis left out is 1."""
  devices = list(devices if devices is not None else jax.devices())
  unknown = sorted(set(mesh_cfg) - set(AXES))
  if unknown:
    raise ValueError(f"mesh: unknown axes {unknown} (the mesh axes are {AXES})")
  sizes = {a: int(mesh_cfg[a]) if a in mesh_cfg else 1 for a in AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"mesh: at most one of {AXES} may be -1, got {sizes}")
  known = int(np.prod([s for s in sizes.values() if s != -1]))
  if free:
    if len(devices) % known:
      raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes {sizes}")
    sizes[free[0]] = len(devices) // known
  total = int(np.prod(list(sizes.values())))
  if total != len(devices):
    raise ValueError(f"mesh: {sizes} needs {total} devices, {len(devices)} are available (set mesh.* in the config)")
  return Mesh(np.asarray(devices).reshape([sizes[a] for a in AXES]), AXES)


def _leaf_name(path) -> str:
  for k in reversed(path):
    name = getattr(k, "key", getattr(k, "name", None))
    if isinstance(name, str) and name not in ("q", "scale", "w", "mu", "nu", "base"):  # base: a LoRAWeight's
      return name
  return ""


def _is_scale(path) -> bool:
  return any(getattr(k, "name", None) == "scale" for k in path)


def spec_for(path, shape, mesh: Mesh) -> P:
  """PartitionSpec of one leaf (see module docstring)."""
  rule = _RULES.get(_leaf_name(path))
  if rule is None or len(shape) != len(rule) or _is_scale(path):
    return P()
  return P(*[ax if ax in mesh.shape and shape[i] % mesh.shape[ax] == 0 else None for i, ax in enumerate(rule)])


def tree_shardings(tree, mesh: Mesh):
  """NamedShardings for every leaf of a pytree of arrays or ShapeDtypeStructs."""
  return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, spec_for(p, x.shape, mesh)), tree)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The batch axes ``mesh`` has (a hand-built mesh may lack some)."""
  return tuple(a for a in BATCH_AXES if a in mesh.shape)


def expert_axis_size(mesh: Mesh | None) -> int:
  """How many ways ``mesh`` splits a MoE layer's experts (1: no expert parallelism)."""
  return 1 if mesh is None else int(mesh.shape.get("expert", 1))


def multi_device(mesh: Mesh | None) -> bool:
  """Whether ``mesh`` spans more than one device (where opaque kernels need ``shard_map`` and layouts that hold whole
  arrays stop being per-device ones)."""
  return mesh is not None and mesh.size > 1


def split_batch_axes(mesh: Mesh | None, m: int) -> tuple[str, ...] | None:
  """The batch axes of ``mesh`` that split an (m, ...) array's first dim across devices, or None (no mesh, one
  device, no batch axis larger than 1, or m not divisible): where opaque kernels run per device (``shard_map``)."""
  if not multi_device(mesh):
    return None
  axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  if not axes or m % math.prod(mesh.shape[a] for a in axes):
    return None
  return axes


def tensor_axis(mesh: Mesh | None) -> str | None:
  """``"tensor"`` when ``mesh`` splits it over more than one device, else None."""
  return "tensor" if mesh is not None and mesh.shape.get("tensor", 1) > 1 else None


def per_device(fn, mesh: Mesh, in_specs, out_specs):
  """``fn`` on each device's blocks (``shard_map``): how opaque kernels (Pallas custom calls, which XLA's SPMD
  partitioner would run on gathered operands) run on a mesh. ``in_specs`` / ``out_specs`` say which mesh axes split
  each operand's dimensions; the caller's operands are resharded to them as needed."""
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)


def ordered_sum(x, axis: str):
  """Sum of ``x`` over mesh axis ``axis`` (inside ``per_device``) in rank order: gather, then add left to right.

  An all-reduce (``psum``) leaves the summation order to the collective library, which picks its algorithm (ring,
  tree, ...) by message size: the same partials could then round differently for a decode step and for a training
  batch. Summed in a fixed order, a row's result depends on its partials only, so a tensor-parallel GEMM stays batch
  invariant (the sampler's rows are the trainer's). Over 2 ranks it moves the same bytes as an all-reduce."""
  parts = jax.lax.all_gather(x, axis)
  out = parts[0]
  for i in range(1, parts.shape[0]):
    out = out + parts[i]
  return out


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  return NamedSharding(mesh, P(batch_axes(mesh), *([None] * (ndim - 1))))


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  """Places a dict of host arrays, first dim over (data, fsdp, expert); the first dim must divide by that size."""
  n = math.prod(mesh.shape[a] for a in batch_axes(mesh))
  out = {}
  for k, v in batch.items():
    if v.shape[0] % n:
      raise ValueError(f"batch field {k!r} has {v.shape[0]} rows, not divisible by data*fsdp*expert={n}")
    out[k] = jax.device_put(v, batch_sharding(mesh, v.ndim))
  return out
