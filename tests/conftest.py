"""Imported by pytest before any test module: fp8jax must come before jax so its XLA flags apply (fp8jax/__init__).

XLA's persistent compilation cache is on for the suite on machines without an NVIDIA GPU (CI), in one temporary
directory shared by the pytest-xdist workers and by the subprocesses the tests start (scripts/train.py,
scripts/parity.py, the sharded and multi-process runs: they get it through JAX_COMPILATION_CACHE_DIR). Most of the
suite's time is XLA:CPU compiling, and many tests build the same tiny trainer, each object tracing its own jitted
steps (so monkeypatches seen at trace time still see them) and compiling the same HLO again: with the cache those
compile once per run. The cache reuses XLA's compiled code for an identical program (same HLO, same XLA flags,
same devices), so it changes no result. FP8JAX_TEST_XLA_CACHE=0 switches it off; =1 switches it on with a GPU too
(on the H200 writing an entry once serialized a 512 MiB closed-over weight for 190 s, so GPU runs leave it off).

History: it had been on before (38 s for the first tiny trainer, 7.6 s for the next) and was switched off after
XLA:CPU segfaulted three times in test_trainer's MoE RL step (twice in ``compilation_cache.put_executable_and_time``,
once in ``backend_compile_and_load`` under ``_compile_and_write_cache``, 2026-12-01), before the cause below was
found and fixed.

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

import child_process  # tests/child_process.py (standard library only)
import fp8jax  # noqa: E402


def _no_gpu() -> bool:
  return shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0")


# Without a GPU (CI) the suite compiles XLA:CPU programs with LLVM's expensive optimization passes (the vectorizers,
# among others) off and at LLVM's optimization level 0: most of the suite's time is compiling. The first flag took
# ~18% off the compile-bound tests (tests/test_mla_sampler.py + the MoE sampler tests: 163 s -> 134 s on 2 cores,
# 2026-12-07) without changing a bit (the tiny config's 40-step warm start + 3 GRPO steps gave bitwise the same
# weights and metrics with and without it). The second took another 26% off (test_moe.py + test_mla_sampler.py +
# test_lora.py: 191 s -> 142 s, 2026-12-07), but it does change results in the last bits (the same check: the warm
# start's NLL 1.35123 vs 1.35340; most likely LLVM no longer contracts multiply-adds into FMAs), as another CPU
# would: the suite's assertions hold on any CPU (properties and documented bounds), and every bitwise comparison is
# between programs compiled with the same flags. The generated code runs ~4x slower, so the one compute-bound test,
# test_tiny_default_learns (the README's main job), runs in a child process at the default level
# (child_process.run(..., optimized=True)), as does the expert-parallel block test, whose router matmul over split
# tokens stopped being bitwise one device's at level 0 (its promise is for the code XLA:CPU builds by default).
# Subprocesses inherit the flags (the tests that set a device count append to XLA_FLAGS).
# FP8JAX_TEST_FAST_COMPILE=0 keeps XLA's defaults for the whole suite.
_FAST_COMPILE = ("--xla_llvm_disable_expensive_passes=true", child_process.OPT_LEVEL_0)
if _no_gpu() and os.environ.get("FP8JAX_TEST_FAST_COMPILE", "1") != "0":
  for _flag in _FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import pytest  # noqa: E402


def _xla_cache_wanted() -> bool:
  flag = os.environ.get("FP8JAX_TEST_XLA_CACHE")
  if flag is not None:
    return flag not in ("", "0")
  return _no_gpu()


if _xla_cache_wanted():
  # The first process (pytest, or its xdist controller) makes the directory; the workers and subprocesses inherit
  # the variable, so all of them share one cache; the process that made it removes it at exit.
  _CACHE_DIR = os.environ.get("FP8JAX_TEST_XLA_CACHE_DIR")
  if not _CACHE_DIR:
    _CACHE_DIR = tempfile.mkdtemp(prefix="fp8jax-test-xla-cache-")
    os.environ["FP8JAX_TEST_XLA_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  for _name, _value in (("jax_compilation_cache_dir", _CACHE_DIR), ("jax_persistent_cache_min_compile_time_secs", 0),
                        ("jax_persistent_cache_min_entry_size_bytes", 0)):
    os.environ[_name.upper()] = str(_value)  # for the subprocesses (jax reads JAX_* at import)
    jax.config.update(_name, _value)


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


# The longest tests (seconds in a full local run on 2 cores, 2026-12-07), started first.
# pytest-xdist's worksteal scheduler (xdist/scheduler/worksteal.py, check_schedule) sends each of the N idle workers
# one contiguous block of the collection at the start (the first len // N items to the first worker, and so on); a
# worker runs its block in order, and an idle worker later steals the second half of the longest queue, from its
# end. So a long test that sorts late (test_trainer.py) started late and ended the run alone, and a test queued
# behind a long one on its worker cannot be stolen. Here the long tests are spread over the blocks (the longest
# first, each to the block with the least of them so far) and put at the blocks' starts: each worker starts one of
# them at t=0. test_rerun_of_a_finished_run_says_so_and_summarizes_it is not listed any more: it runs
# small_config's programs, compiled by the in-process trainer tests before it when it keeps its place in the order.
_LONGEST = {
    "tests/test_trainer.py::test_tiny_default_learns": 337,
    "tests/test_distributed.py::test_two_process_run_equals_one_process_on_the_same_mesh": 241,
    "tests/test_sampler_parallel.py::test_data_parallel_rollouts_equal_one_device": 105,
    "tests/test_moe_parallel.py::test_grpo_step_with_expert_parallelism": 104,
    "tests/test_trainer.py::test_sharded_equals_unsharded_on_8_fake_devices": 98,
    "tests/test_trainer.py::test_moe_rl_step_with_and_without_the_load_balancing_loss": 78,
    "tests/test_parity.py::test_parity_smoke_runs_the_script_and_writes_json_and_png": 77,
    "tests/test_trainer.py::test_resume_gives_the_same_metrics": 63,
    "tests/test_moe_parallel.py::test_expert_parallel_block_is_one_device_bitwise": 41,
}


def _block_sizes(n: int, workers: int) -> list[int]:
  """The sizes of the blocks xdist's WorkStealingScheduling.check_schedule sends to ``workers`` idle workers."""
  sizes = []
  for i in range(workers):
    sizes.append(n // (workers - i))
    n -= sizes[-1]
  return sizes


def pytest_collection_modifyitems(config, items):
  """Moves the _LONGEST tests to the starts of the worksteal blocks (above); one process: to the front, longest
  first. Only the order changes: the same tests run."""
  del config
  longest = sorted((it for it in items if it.nodeid in _LONGEST), key=lambda it: -_LONGEST[it.nodeid])
  if not longest:
    return
  workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
  rest = [it for it in items if it.nodeid not in _LONGEST]
  blocks = [[] for _ in range(workers)]
  for it in longest:
    min(blocks, key=lambda b: sum(_LONGEST[x.nodeid] for x in b)).append(it)
  ordered = []
  for block, size in zip(blocks, _block_sizes(len(items), workers)):
    take = max(0, size - len(block))
    ordered += block + rest[:take]
    rest = rest[take:]
  items[:] = ordered + rest
