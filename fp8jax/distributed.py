"""Multi-process (multi-host) runs: ``jax.distributed`` from the environment, and which process writes files.

One process per host (or per GPU), all running the same ``scripts/train.py`` command. Set on every process:

  JAX_COORDINATOR_ADDRESS  host:port of process 0 (reachable from every process)
  JAX_NUM_PROCESSES        how many processes
  JAX_PROCESS_ID           this process's index, 0 .. JAX_NUM_PROCESSES - 1

(or FP8JAX_DISTRIBUTED=auto to let ``jax.distributed.initialize()`` read a cluster's own variables: SLURM, Open
MPI, ...). The mesh then spans every process's devices (``jax.devices()``). Every process computes the same
host-side data (prompts, rewards: they are pure functions of the seed and the step, and the rollouts come back
replicated), so batches are placed from identical host arrays. Only process 0 writes metrics, plots and checkpoint
manifests and holds the run directory's lock; orbax writes each process's shards of a checkpoint itself.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_from_env(environ=None) -> bool:
  """Starts ``jax.distributed`` when the environment asks for it (module docstring); returns whether it did.

  Must run before anything touches a JAX device. Partial or malformed settings raise ValueError naming the
  variable. On CPU, cross-process collectives go through gloo."""
  env = os.environ if environ is None else environ
  auto = env.get("FP8JAX_DISTRIBUTED", "") == "auto"
  given = {k: env.get(k) for k in ENV if env.get(k)}
  if not given and not auto:
    return False
  kw = {}
  if not auto or given:
    missing = [k for k in ENV if k not in given]
    if missing:
      raise ValueError(f"multi-process run: {', '.join(missing)} not set (have {sorted(given)}); set all of {ENV} "
                       f"on every process, or FP8JAX_DISTRIBUTED=auto on a cluster jax detects")
    ints = {}
    for k in ENV[1:]:
      try:
        ints[k] = int(given[k])
      except ValueError:
        raise ValueError(f"{k}={given[k]!r} is not an integer") from None
    n, i = ints["JAX_NUM_PROCESSES"], ints["JAX_PROCESS_ID"]
    if n < 1 or not 0 <= i < n:
      raise ValueError(f"JAX_PROCESS_ID={i} must be in [0, JAX_NUM_PROCESSES={n})")
    kw = dict(coordinator_address=given["JAX_COORDINATOR_ADDRESS"], num_processes=n, process_id=i)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
  jax.distributed.initialize(**kw)
  log.warning("fp8jax: process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
              jax.local_device_count(), jax.device_count())
  persistent_cache_guard(jax.default_backend(), jax.process_count())
  return True


def persistent_cache_guard(backend: str, process_count: int) -> bool:
  """Turns JAX's persistent compilation cache off for a multi-process run on CPU, with a warning; returns whether
  it did. Such a run aborts once the cache holds its programs (seen with jax 0.11.2: the same 2-process
  ``scripts/train.py`` command run twice with one JAX_COMPILATION_CACHE_DIR stops in the warm start's first
  cross-process gather with gloo's "Received data size doesn't match expected size"; with the cache off it runs and
  resumes). The cache only saves compile time: turning it off changes no result. Other backends keep it."""
  if backend != "cpu" or process_count < 2:
    return False
  if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
    return False
  log.warning("fp8jax: JAX's persistent compilation cache (%s) is off for this %d-process CPU run: with cached "
              "programs the processes' gloo collectives stop matching (fp8jax.distributed.persistent_cache_guard)",
              jax.config.jax_compilation_cache_dir, process_count)
  jax.config.update("jax_enable_compilation_cache", False)
  return True


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0; always true in a single-process run)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process got here (no-op in a single-process run)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415

    multihost_utils.sync_global_devices(name)
