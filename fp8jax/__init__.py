"""fp8jax: end-to-end FP8 RL post-training of LLMs in JAX, with one engine for rollouts and training.

The public surface for embedding fp8jax's FP8 layers in your own JAX code (docs/embedding.md runs through it):

  ``linear(x, w, cfg=LinearConfig())``  ``x . w^T``; block FP8 when ``w`` is a ``QWeight`` (frozen, quantized once)
                                         or an ``FP8Weight`` (a master weight quantized on the fly; its gradient
                                         reaches the master), BF16 when ``w`` is a plain array; ``w`` stored (out, in)
  ``attend(q, k, v, ...)``               causal GQA attention (BF16, or FP8 K/V codes with their scales)
  ``Recipe``                             which linears are FP8 and how (``fp8jax.recipes``)
  ``quantize_params(tree, recipe, where=..., layout=...)`` / ``mark_fp8(...)``
                                         a whole pytree's chosen weights as ``QWeight`` / ``FP8Weight``; ``where``:
                                         a predicate ``(path, leaf) -> bool`` or fnmatch patterns over "/"-joined paths
  ``quantize_weight``, ``QWeight``, ``FP8Weight``   the quantizer and its weight types (``fp8jax.quant``)
  ``jit``                                ``jax.jit`` with ``COMPILER_OPTIONS`` (below)
  ``configure_xla()`` / ``xla_flags()``  the same options for every ``jax.jit`` of the process, via XLA_FLAGS

The names resolve lazily: ``import fp8jax`` imports neither JAX nor anything else, and changes nothing in the process.

XLA settings. The sampler's decode step and the trainer's forward must round alike, though XLA compiles them as
different programs for different shapes. Two XLA options are switched off for that (``COMPILER_OPTIONS``):
  * ``xla_allow_excess_precision`` (XLA's default: on): a fusion may keep a BF16 intermediate in FP32, and XLA fuses
    the decode step differently from the full-sequence forward;
  * ``xla_gpu_experimental_enable_fusion_autotuner`` (default on; GPU only): XLA times candidate tilings of the
    fusions it emits, per program and shape, so a row reduction (the output head's row statistics) may get another
    tiling, hence another summation order, at N = slots than at N = tokens. Measured on an H200 (2026-12-02, 8B
    width): 1-5 of 2048 sampled tokens one FP32 ulp off the trainer's log-prob with it, none without it, at the same
    speed.
Every program fp8jax compiles itself goes through ``fp8jax.jit``, which passes these as per-program compiler
options: your own ``jax.jit`` programs are untouched. If you embed fp8jax layers in your own steps and want the same
rounding there, compile them with ``fp8jax.jit``, or call ``fp8jax.configure_xla()`` before JAX creates its backend
(it appends the flags to XLA_FLAGS, which then hold for every program of the process, yours included). fp8jax's
scripts (``scripts/train.py`` and the checkers and benchmarks) call it first thing.
"""

import functools as _functools
import importlib as _importlib
import logging as _logging
import os as _os
import sys as _sys

__version__ = "0.1.0"

COMPILER_OPTIONS = {"xla_allow_excess_precision": False, "xla_gpu_experimental_enable_fusion_autotuner": False}

# name -> (module, attribute): the public surface, imported on first use.
_EXPORTS = {
    "linear": ("fp8jax.ops", "linear"),
    "LinearConfig": ("fp8jax.ops", "LinearConfig"),
    "attend": ("fp8jax.attention", "attend"),
    "Recipe": ("fp8jax.recipes", "Recipe"),
    "quantize_params": ("fp8jax.recipes", "quantize_params"),
    "mark_fp8": ("fp8jax.recipes", "mark_fp8"),
    "quantize_weight": ("fp8jax.quant", "quantize_weight"),
    "dequantize_weight": ("fp8jax.quant", "dequantize_weight"),
    "QWeight": ("fp8jax.quant", "QWeight"),
    "FP8Weight": ("fp8jax.quant", "FP8Weight"),
    "backend_report": ("fp8jax.backends", "backend_report"),
}

__all__ = ["COMPILER_OPTIONS", "configure_xla", "jit", "xla_flags", "__version__", *_EXPORTS]


def __getattr__(name):
  if name in _EXPORTS:
    module, attr = _EXPORTS[name]
    value = getattr(_importlib.import_module(module), attr)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'fp8jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))


def xla_flags(current: str | None = None) -> list[str]:
  """The ``--name=false`` flags of COMPILER_OPTIONS that ``current`` (default: $XLA_FLAGS) does not set yet; a flag
  the user set, to either value, is left to the user."""
  current = _os.environ.get("XLA_FLAGS", "") if current is None else current
  return [f"--{name}={str(value).lower()}" for name, value in COMPILER_OPTIONS.items() if name not in current]


def configure_xla() -> list[str]:
  """Appends ``xla_flags()`` to XLA_FLAGS for this process, so that every ``jax.jit`` (yours too) compiles with
  COMPILER_OPTIONS; returns the flags added. XLA reads XLA_FLAGS when JAX creates its backend (the first
  computation or device query): called later, it changes nothing for this process and logs a warning that says so
  (use ``fp8jax.jit`` for your steps then). Both names are flags of the pinned jaxlib (0.11.2); an unknown flag
  in XLA_FLAGS stops XLA at start-up, so a jaxlib that renames one says so at once."""
  missing = xla_flags()
  if not missing:
    return []
  jax_mod = _sys.modules.get("jax")
  if jax_mod is not None:
    from jax._src import xla_bridge  # noqa: PLC0415

    if xla_bridge.backends_are_initialized():
      _logging.getLogger(__name__).warning(
          "fp8jax.configure_xla() was called after JAX created its backend, so %s is not in effect for jax.jit "
          "outside fp8jax; compile your own steps with fp8jax.jit so that they round as the sampler and trainer do.",
          " ".join(missing))
  _os.environ["XLA_FLAGS"] = " ".join([_os.environ.get("XLA_FLAGS", ""), *missing]).strip()
  return missing


def jit(fun=None, **kwargs):
  """``jax.jit`` with fp8jax's compiler options (no excess precision); usable as ``@jit`` or ``partial(jit, ...)``."""
  import jax  # noqa: PLC0415

  if fun is None:
    return _functools.partial(jit, **kwargs)
  opts = dict(COMPILER_OPTIONS, **kwargs.pop("compiler_options", {}))
  return jax.jit(fun, compiler_options=opts, **kwargs)
