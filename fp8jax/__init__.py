"""fp8jax: end-to-end FP8 RL post-training of LLMs in JAX, with one engine for rollouts and training.

Numerics: the sampler's decode step and the trainer's forward must round alike, though XLA compiles them as
different programs for different shapes. Two XLA options are switched off for that:
  * ``xla_allow_excess_precision`` (XLA's default: on): a fusion may keep a BF16 intermediate in FP32, and XLA fuses
    the decode step differently from the full-sequence forward;
  * ``xla_gpu_experimental_enable_fusion_autotuner`` (on by default; GPU only): XLA times candidate tilings of the
    fusions it emits with Triton, per program and shape, so a row reduction (the output head's row statistics) may
    get another tiling, hence another summation order, at N = slots than at N = tokens, and another one in the next
    process. Measured on the H200 (2026-12-02, 8B width, 128 slots, vocab 128256): 1-5 of 2048 sampled tokens one
    FP32 ulp off the trainer's log-prob with it, none without it, at the same decode and train-step speed
    (docs/benchmarks.md "Exact one engine").
fp8jax therefore
  * compiles its own entry points with ``fp8jax.jit`` (``jax.jit`` + ``COMPILER_OPTIONS``), whatever the import
    order, and
  * adds the same options to XLA_FLAGS when imported before JAX, so user code that embeds fp8jax layers in its own
    ``jax.jit`` gets the same behaviour. (XLA reads XLA_FLAGS when JAX is imported: if JAX came first, a warning
    says so; use ``fp8jax.jit`` for your own steps then.) Both are XLA flags of the pinned jaxlib (0.11.2); an
    unknown flag in XLA_FLAGS stops XLA at start-up, so a jaxlib that renames one says so at once.
"""

import functools as _functools
import logging as _logging
import os as _os
import sys as _sys

COMPILER_OPTIONS = {"xla_allow_excess_precision": False, "xla_gpu_experimental_enable_fusion_autotuner": False}


def _missing_flags(xla_flags: str) -> list[str]:
  """The ``--name=false`` flags of COMPILER_OPTIONS that ``xla_flags`` does not set (a user's own setting wins)."""
  return [f"--{name}={str(value).lower()}" for name, value in COMPILER_OPTIONS.items() if name not in xla_flags]


_missing = _missing_flags(_os.environ.get("XLA_FLAGS", ""))
if _missing:
  if "jax" in _sys.modules:
    _logging.getLogger(__name__).warning(
        "fp8jax was imported after jax, so %s is not in effect for jax.jit outside fp8jax; wrap your own steps "
        "with fp8jax.jit (or import fp8jax first) so sampler and trainer round alike.", " ".join(_missing))
  _os.environ["XLA_FLAGS"] = " ".join([_os.environ.get("XLA_FLAGS", ""), *_missing]).strip()


def jit(fun=None, **kwargs):
  """``jax.jit`` with fp8jax's compiler options (no excess precision); usable as ``@jit`` or ``partial(jit, ...)``."""
  import jax  # noqa: PLC0415

  if fun is None:
    return _functools.partial(jit, **kwargs)
  opts = dict(COMPILER_OPTIONS, **kwargs.pop("compiler_options", {}))
  return jax.jit(fun, compiler_options=opts, **kwargs)


__version__ = "0.1.0"
