"""Lowering a kernel's call for an H200 on a machine without a GPU: the CPU tests' ``cuda`` lowering checks and
``scripts/triton_resources.py`` use this, so the abstract device is spelled once.

The Pallas Triton lowering reads the target's device kind (compute capability) from the current mesh; an abstract
mesh of one abstract H200 gives it one without a GPU. Mosaic GPU kernels lower the same way.
"""

from __future__ import annotations

import contextlib

import jax

H200_KIND, H200_SMS = "NVIDIA H200", 132


@contextlib.contextmanager
def abstract_h200():
  """Traces and lowerings inside see one abstract H200 (its device kind, 132 SMs)."""
  dev = jax.sharding.AbstractDevice(device_kind=H200_KIND, num_cores=H200_SMS, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=dev)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def lower_for_h200(fn, *args) -> str:
  """The StableHLO text of ``jax.jit(fn)`` over ``args`` (arrays or jax.ShapeDtypeStruct) lowered for CUDA on an
  abstract H200: the kernels appear in it as their Triton / Mosaic GPU custom calls."""
  with abstract_h200():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
