"""fp8jax: end-to-end FP8 RL post-training of LLMs in JAX, with one engine for rollouts and training.

Numerics: XLA must not skip BF16 roundings. With ``xla_allow_excess_precision`` on (XLA's default), a fusion may
keep a BF16 intermediate in FP32, and XLA fuses the sampler's decode step differently from the trainer's
full-sequence forward, so the two would compute slightly different numbers for the same token. fp8jax therefore
  * compiles its own entry points with ``fp8jax.jit`` (``jax.jit`` + ``COMPILER_OPTIONS``), whatever the import
    order, and
  * adds ``--xla_allow_excess_precision=false`` to XLA_FLAGS when imported before JAX, so user code that embeds
    fp8jax layers in its own ``jax.jit`` gets the same behaviour. (XLA reads XLA_FLAGS when JAX is imported: if
    JAX came first, a warning says so; use ``fp8jax.jit`` for your own steps then.)
"""

import functools as _functools
import logging as _logging
import os as _os
import sys as _sys

COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
_FLAG = "--xla_allow_excess_precision=false"

if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
  if "jax" in _sys.modules:
    _logging.getLogger(__name__).warning(
        "fp8jax was imported after jax, so %s is not in effect for jax.jit outside fp8jax; wrap your own steps "
        "with fp8jax.jit (or import fp8jax first) so sampler and trainer round alike.", _FLAG)
  _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


def jit(fun=None, **kwargs):
  """``jax.jit`` with fp8jax's compiler options (no excess precision); usable as ``@jit`` or ``partial(jit, ...)``."""
  import jax  # noqa: PLC0415

  if fun is None:
    return _functools.partial(jit, **kwargs)
  opts = dict(COMPILER_OPTIONS, **kwargs.pop("compiler_options", {}))
  return jax.jit(fun, compiler_options=opts, **kwargs)


__version__ = "0.1.0"
