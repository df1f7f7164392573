"""Imported by pytest before any test module: fp8jax must come before jax so its XLA flags apply (fp8jax/__init__).

XLA's persistent compilation cache stays off (jax's default). It had been switched on here to save the trainer
tests' recompiles (38 s for the first tiny trainer, 7.6 s for the next), but with it on, XLA:CPU segfaulted three
times in test_trainer's MoE RL step (twice in ``compilation_cache.put_executable_and_time``, once in
``backend_compile_and_load`` under ``_compile_and_write_cache``, 2026-12-01) and the same test passed without it
(258 s); on the H200 writing an entry serialized and compressed a 512 MiB closed-over weight for 190 s, which had
been reported as a kernel hang. FP8JAX_TEST_XLA_CACHE=1 switches it on (in a fresh temporary directory).
"""

import atexit
import os
import shutil
import tempfile

import fp8jax  # noqa: F401
import jax

if os.environ.get("FP8JAX_TEST_XLA_CACHE"):
  _CACHE_DIR = tempfile.mkdtemp(prefix="fp8jax-test-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
