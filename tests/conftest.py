"""Imported by pytest before any test module: fp8jax must come before jax so its XLA flags apply (fp8jax/__init__).

On CPU, XLA's persistent compilation cache is switched on for the session, in a fresh temporary directory (so
nothing leaks between runs): the trainer tests build several RLTrainers with the same shapes, and each new one
compiles the same programs again (seen: 38 s for the first tiny trainer's warm start, validation and one step, 7.6 s
for the second). A cached executable is the very binary XLA compiled, so bitwise tests are unaffected.
FP8JAX_TEST_NO_XLA_CACHE=1 turns it off.

Not on GPUs: there the cache buys little and writing an entry serializes and compresses the whole executable,
constants included. Seen on the H200 (2026-12-01): a test whose jitted function closed over a 512 MiB weight spent
190 s in ``compilation_cache.put_executable_and_time`` (faulthandler's stack), which had been reported as a kernel
hang.
"""

import atexit
import os
import shutil
import tempfile

import fp8jax  # noqa: F401
import jax

if not os.environ.get("FP8JAX_TEST_NO_XLA_CACHE") and jax.default_backend() == "cpu":
  _CACHE_DIR = tempfile.mkdtemp(prefix="fp8jax-test-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
