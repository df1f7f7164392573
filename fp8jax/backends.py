"""The backend switch every op uses (GEMMs, attention, RMSNorm): 'auto' | 'xla' | 'pallas' -> what runs, and why.

"xla" is an op's plain-jnp reference (exact, runs anywhere), "pallas" its kernel (Hopper / CUDA GPUs), "auto" the kernel
where it runs these operands and the reference elsewhere. Every choice is logged once and kept in this process's
report (``backend_report``), and ``kernel_fallbacks`` counts the reasons an 'auto' op ran its reference on a machine
that has its kernel's GPU, which the trainer puts in every metrics row: a change of numerics is never silent.
"""

from __future__ import annotations

import logging

import jax

log = logging.getLogger("fp8jax.ops")

_REPORT: dict[str, str] = {}  # "requested->chosen" (prefixed by the op family) -> the reasons seen
BACKENDS = ("auto", "xla", "pallas")


def gpu_available() -> bool:
  """Whether this process's first JAX device is a CUDA GPU (where the Pallas Triton kernels run)."""
  try:
    return jax.local_devices()[0].platform == "gpu"
  except RuntimeError:
    return False


def hopper_available() -> bool:
  """Whether this process's first JAX device is an sm_90 (Hopper) GPU, where the Pallas FP8 kernels run."""
  try:
    dev = jax.local_devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def choose_backend(requested: str, *, what: str, config_key: str, probe, prefix: str = "") -> str:
  """The one backend switch (GEMMs, attention): 'auto' | 'xla' | 'pallas' -> 'pallas' or 'xla'.

  ``probe()`` -> (True, why) where the kernels run these operands here, else (False, why). 'auto' takes the kernels
  when they run, 'pallas' raises where they do not; each outcome is logged once and listed by ``backend_report``.
  """
  if requested not in BACKENDS:
    raise ValueError(f"unknown {what} backend {requested!r} ({config_key}: expected one of {BACKENDS})")
  ok, why = (False, "requested") if requested == "xla" else probe()
  if requested == "pallas" and not ok:
    raise RuntimeError(f"{config_key}='pallas' cannot run here: {why}; use 'xla' or 'auto'")
  chosen = "pallas" if ok else "xla"
  key = f"{prefix}{requested}->{chosen}"
  if why not in _REPORT.get(key, "").split("; "):  # every distinct reason is kept: a fallback for one shape is not
    _REPORT[key] = why if key not in _REPORT else f"{_REPORT[key]}; {why}"  # hidden by an earlier choice
    log.warning("fp8jax: %s backend %r resolved to %r (%s)", what, requested, chosen, why)
  return chosen


NO_GPU_REASONS = ("no CUDA GPU", "no sm_90 GPU")  # 'auto' on a machine without the kernels' GPU: not a fallback


def kernel_fallbacks() -> int:
  """How many distinct reasons sent an 'auto' backend to the plain-jnp reference on a machine that has the GPU its
  kernels need (operands they do not take, kernels that would not import): 0 when every op ran its kernel, or when
  there is no such GPU. The trainer's metrics carry it (``kernel_fallbacks``), so a change of numerics is visible
  there as well as in the log and ``backend_report``."""
  return sum(why not in NO_GPU_REASONS for key, whys in _REPORT.items() if key.endswith("auto->xla")
             for why in whys.split("; "))


def backend_report() -> dict[str, str]:
  """Which GEMM and attention backends were resolved in this process, and why (for metrics and logs).

  Keys are ``requested->chosen`` for the FP8 GEMMs, ``bf16:requested->chosen`` for the BF16-mode GEMMs and
  ``attention:requested->chosen`` for attention."""
  return dict(_REPORT)
