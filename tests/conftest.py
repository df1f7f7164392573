"""Imported by pytest before any test module: fp8jax must come before jax so its XLA flags apply (fp8jax/__init__).

XLA's persistent compilation cache stays off (jax's default). It had been switched on here to save the trainer
tests' recompiles (38 s for the first tiny trainer, 7.6 s for the next), but with it on, XLA:CPU segfaulted three
times in test_trainer's MoE RL step (twice in ``compilation_cache.put_executable_and_time``, once in
``backend_compile_and_load`` under ``_compile_and_write_cache``, 2026-12-01) and the same test passed without it
(258 s); on the H200 writing an entry serialized and compressed a 512 MiB closed-over weight for 190 s, which had
been reported as a kernel hang. FP8JAX_TEST_XLA_CACHE=1 switches it on (in a fresh temporary directory).

Those segfaults (and CI's exit 139 at test ~609 of 627 with the cache off) were most likely not the cache's: every
executable XLA:CPU compiles keeps ~3 memory mappings until jax drops it, one pytest process compiles thousands, and
Linux's vm.max_map_count is 65530; the full suite had 8.5k mappings after its first 90 tests, and an mmap that fails
inside LLVM's JIT crashes the process wherever it happens to be compiling. So the compiled executables (and jax's
other caches) are dropped after every test module, and after any test that leaves the process above
``_MAX_MAPS`` mappings.
"""

import atexit
import gc
import os
import shutil
import tempfile

import fp8jax  # noqa: F401
import jax
import pytest

if os.environ.get("FP8JAX_TEST_XLA_CACHE"):
  _CACHE_DIR = tempfile.mkdtemp(prefix="fp8jax-test-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_MAX_MAPS = 30_000  # half of Linux's default vm.max_map_count (65530)


def _map_count() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


def _drop_compiled():
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_after_each_module():
  yield
  _drop_compiled()


@pytest.fixture(autouse=True)
def _drop_compiled_when_near_the_map_limit():
  yield
  if _map_count() > _MAX_MAPS:
    _drop_compiled()
