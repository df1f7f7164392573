"""Runs a test's code in a child Python process with its own number of devices, and returns what it reports.

XLA fixes the number of fake CPU devices when JAX starts its backend, so a test that needs a 4- or 8-device mesh on
CI's CPU runs that part in a child process. The child gets the suite's environment (tests/conftest.py: its XLA
flags and the shared persistent compilation cache) with ``--xla_force_host_platform_device_count=N`` appended, and a
script run by ``run`` starts with the repository and tests/ on sys.path, fp8jax imported before jax (its XLA
settings, fp8jax.configure_xla) and a ``report(obj)`` that hands one JSON object back to the test.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPT_LEVEL_0 = "--xla_backend_optimization_level=0"  # the suite's XLA:CPU compile setting (tests/conftest.py)

_PRELUDE = f"""import json, os, sys
sys.path[:0] = [{REPO!r}, {os.path.join(REPO, "tests")!r}]
import fp8jax
fp8jax.configure_xla()


def report(obj):
  print("RESULT" + json.dumps(obj))

"""


def env(devices: int | None = None, optimized: bool = False, **extra: str) -> dict:
  """The environment of a child process: this one's, with ``devices`` fake CPU devices (None: the machine's own
  devices, e.g. its GPUs) and ``extra`` variables. ``optimized``: without the suite's LLVM optimization level 0
  (tests/conftest.py), for a child that computes more than it compiles."""
  flags = os.environ.get("XLA_FLAGS", "")
  if optimized:
    flags = " ".join(f for f in flags.split() if f != OPT_LEVEL_0)
  if devices is not None:
    flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  return dict(os.environ, XLA_FLAGS=flags, **extra)


def run(script: str, devices: int | None, timeout: int = 900, optimized: bool = False) -> dict:
  """Runs ``script`` (after the prelude above) with ``devices`` fake CPU devices (``optimized``: see ``env``);
  returns the object it reported. A child that fails fails the test with the end of its stderr."""
  res = subprocess.run([sys.executable, "-c", _PRELUDE + script], cwd=REPO, env=env(devices, optimized),
                       capture_output=True, text=True, timeout=timeout)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "RESULT" in res.stdout, f"the child reported nothing; its stdout ends: {res.stdout[-1000:]}"
  return json.loads(res.stdout.split("RESULT")[-1])
