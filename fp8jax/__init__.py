"""fp8jax: end-to-end FP8 RL post-training of LLMs in JAX, with one engine for rollouts and training.

Importing fp8jax sets the XLA flag ``--xla_allow_excess_precision=false`` (unless XLA_FLAGS already names it).
With excess precision allowed, XLA may skip the BF16 rounding of intermediates inside a fusion, and it fuses the
sampler's decode step differently from the trainer's full-sequence forward — so the two would compute slightly
different numbers for the same token. With the flag off, every BF16 value is rounded where the program says so,
and the sampler's log-probs equal the trainer's bit for bit (tests/test_model.py checks this). The flag must be
set before JAX creates its backends: import fp8jax before running any JAX computation.
"""

import os as _os

_FLAG = "--xla_allow_excess_precision=false"
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
  _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


def _check_flag_took_effect():
  import logging

  import jax._src.xla_bridge as xb  # noqa: PLC0415

  if getattr(xb, "_backends", None):
    logging.getLogger(__name__).warning(
        "fp8jax was imported after JAX initialized its backends, so %s may not apply; sampler and trainer "
        "log-probs can then differ by BF16 rounding. Import fp8jax first.", _FLAG)


_check_flag_took_effect()
__version__ = "0.1.0"
