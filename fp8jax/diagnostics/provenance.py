"""Where a measured figure came from: the record every script's JSON starts with (docs cite command, date, GPU and
versions for each figure).

  ``provenance(command=None, packages=())`` -> dict with
    ``command``       what produced the figure (default: ``python`` + this process's argv, the script's path
                      relative to the working directory)
    ``date``          UTC, ISO 8601 to the second
    ``device``        the first JAX device's kind (``NVIDIA H100 80GB HBM3``, ``cpu``), ``device_count``, ``platform``
    ``cpu``           the host CPU's model name (XLA:CPU rounds differently on different CPUs)
    ``python``, ``jax``, ``jaxlib``
    ``versions``      the installed versions of ``packages`` (e.g. ``("torch", "transformers")``); a package that is
                      not installed reads ``None``
    ``git_commit``    the repository's HEAD, with ``-dirty`` when tracked files differ from it; ``None`` where the
                      source is not a git checkout (e.g. a copy of the working tree)

Imports only jax and the standard library, so a small script can use it without the trainer.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_name() -> str:
  """The host CPU's model name from /proc/cpuinfo (else what ``platform`` says)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def git_commit(repo: str = _REPO) -> str | None:
  """``repo``'s HEAD commit, ``-dirty`` appended when tracked files differ from it; None without git or a checkout."""
  def git(*args):
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=20,
                          stdin=subprocess.DEVNULL, check=False)
  try:
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
      return None
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return None
  return head.stdout.strip() + ("-dirty" if dirty else "")


def default_command() -> str:
  script = sys.argv[0] if sys.argv and sys.argv[0] else "python"
  if os.path.isfile(script):
    script = os.path.relpath(script, os.getcwd())
  return " ".join(["python", script, *sys.argv[1:]])


def provenance(command: str | None = None, packages: Sequence[str] = ()) -> dict:
  """The record described in the module docstring (creates JAX's backend if it does not exist yet)."""
  import jax  # noqa: PLC0415  (kept local: the helpers above need no JAX)

  devices = jax.devices()
  dev = devices[0]
  return {"command": command if command is not None else default_command(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": getattr(dev, "device_kind", dev.platform), "device_count": len(devices), "platform": dev.platform,
          "cpu": cpu_name(), "python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": package_version("jaxlib"), "versions": {p: package_version(p) for p in packages},
          "git_commit": git_commit()}
