"""Orbax checkpoints of the RL run: the train state (one pytree: ``fp8jax.rl.learner.TrainState``, everything a
resumed run needs) + JSON metadata (what it was made with: layout, seed, model config, the task's data); and the
lock that gives one process at a time a run directory.

Saves are atomic (orbax writes a temporary directory and renames it when complete) and keep the last ``keep``.

Integrity: after each save a manifest (``fp8jax_manifest.json`` in the step directory: every file's size) is
written, so a truncated or missing file is found before orbax reads anything, and named. ``restore_latest`` tries
the checkpoints newest first; a corrupt one is renamed ``<step>.corrupt`` (orbax then ignores it, and the step can
be saved again) and the previous one is used, with a logged warning. Checkpoints without a manifest (written
before it existed, or a crash between orbax's commit and the manifest) are checked for their metadata files only.
When orbax fails on a step whose files are complete, nothing is moved (the error may be transient): the error
names the step and gives the command that moves it aside.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp

from fp8jax import distributed

log = logging.getLogger(__name__)

MANIFEST = "fp8jax_manifest.json"
# Files orbax needs to restore the items: found missing or not JSON, the step is corrupt (named in the error).
_JSON_FILES = ("state/_METADATA", "meta/metadata")


class CheckpointCorrupt(RuntimeError):
  """A checkpoint step whose files are missing, truncated or not JSON; the message names the step directory and
  the file. ``restore_latest`` moves such a step aside and falls back to the previous one."""


class CheckpointUnreadable(RuntimeError):
  """Orbax failed to restore a step whose files look intact (``verify`` passed): maybe damage the manifest cannot
  see, maybe a transient error (memory, file system). Not moved aside automatically; the message says how."""


class Checkpointer:
  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                              enable_async_checkpointing=False),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state, meta: dict):
    """Saves ``state`` (a pytree) and ``meta`` (JSON), then the manifest."""
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    self._mngr.wait_until_finished()
    if distributed.is_primary():  # one writer; the others wait for it (a restore may read it next)
      self._write_manifest(step)
    distributed.barrier(f"fp8jax-manifest-{step}")

  # -- integrity ----------------------------------------------------------------------------------------------------

  def _write_manifest(self, step: int):
    d = self.step_dir(step)
    if not os.path.isdir(d):  # orbax skipped the save (a step <= the latest): nothing to describe
      return
    sizes = {}
    for root, _, files in os.walk(d):
      for f in files:
        p = os.path.join(root, f)
        rel = os.path.relpath(p, d)
        if rel != MANIFEST:
          sizes[rel] = os.path.getsize(p)
    tmp = os.path.join(d, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
      json.dump({"step": step, "sizes": sizes}, f)
    os.replace(tmp, os.path.join(d, MANIFEST))

  def verify(self, step: int) -> None:
    """Raises CheckpointCorrupt naming the step directory and the file when a file is missing or truncated."""
    d = self.step_dir(step)
    if not os.path.isdir(d):
      raise CheckpointCorrupt(f"{d}: checkpoint step directory not found")
    mpath = os.path.join(d, MANIFEST)
    if os.path.isfile(mpath):
      try:
        with open(mpath) as f:
          sizes = json.load(f)["sizes"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(f"{d}: file {MANIFEST} is not a valid manifest ({e})") from None
      for rel, size in sorted(sizes.items()):
        p = os.path.join(d, rel)
        if not os.path.isfile(p):
          raise CheckpointCorrupt(f"{d}: file {rel} is missing")
        got = os.path.getsize(p)
        if got != size:
          raise CheckpointCorrupt(f"{d}: file {rel} has {got} bytes, {size} were written (truncated or changed)")
    for rel in _JSON_FILES:
      p = os.path.join(d, rel)
      if not os.path.isfile(p):
        raise CheckpointCorrupt(f"{d}: file {rel} is missing")
      try:
        with open(p) as f:
          json.load(f)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorrupt(f"{d}: file {rel} is not valid JSON ({e})") from None

  def quarantine(self, step: int) -> str:
    """Renames a corrupt step directory to ``<step>.corrupt[.N]`` (kept for inspection; orbax ignores it)."""
    src = self.step_dir(step)
    dst, n = src + ".corrupt", 1
    while os.path.exists(dst):
      dst, n = f"{src}.corrupt.{n}", n + 1
    os.rename(src, dst)
    self._mngr.reload()
    return dst

  # -- restore ------------------------------------------------------------------------------------------------------

  def read_meta(self, step: int) -> dict:
    """The JSON metadata of ``step`` alone (checked by ``verify`` first)."""
    self.verify(step)
    try:
      return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many types; name the place, keep the cause)
      raise self._unreadable(step, "meta/", e) from e

  def restore(self, step: int, abstract_state):
    """Restores onto the shardings of ``abstract_state`` (a pytree of arrays or ShapeDtypeStructs of the saved
    structure). Returns ``(state, meta)``."""
    self.verify(step)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                          abstract_state)
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                             meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001
      raise self._unreadable(step, "the state", e) from e
    return out["state"], out["meta"]

  def _unreadable(self, step: int, what: str, e: Exception) -> CheckpointUnreadable:
    d = self.step_dir(step)
    return CheckpointUnreadable(
        f"{d}: {what} cannot be restored although its files are complete: {type(e).__name__}: "
        f"{str(e).splitlines()[0][:300]}. If the error is transient (memory, file system), rerun; if the checkpoint "
        f"is damaged, move it aside (mv {d} {d}.corrupt) and rerun to resume from the previous one")

  def restore_latest(self, restore_fn: Callable[[int], object]):
    """``(step, restore_fn(step))`` for the newest step that ``restore_fn`` restores without CheckpointCorrupt, or
    None when there are no checkpoints. Corrupt newer steps (missing/truncated files: CheckpointCorrupt) are
    quarantined with a warning; when every step is corrupt, raises CheckpointCorrupt listing them. Other errors
    (CheckpointUnreadable, a config that does not match) propagate: nothing is moved on an error that may be
    transient.
    """
    steps = self.all_steps()
    if not steps:
      return None
    problems = []
    for step in reversed(steps):
      try:
        return step, restore_fn(step)
      except CheckpointCorrupt as e:
        moved = self.quarantine(step) if distributed.is_primary() else self.step_dir(step) + ".corrupt"
        distributed.barrier(f"fp8jax-quarantine-{step}")
        problems.append(str(e))
        log.warning("checkpoint step %d is corrupt: %s; moved it to %s and falling back to the previous checkpoint",
                    step, e, moved)
    raise CheckpointCorrupt(f"no readable checkpoint in {self.directory} (each was moved to <step>.corrupt): "
                            + "; ".join(problems) + ". Start a new run (another --workdir), or restore a copy")

  def close(self):
    self._mngr.close()


# ------------------------------------------------------------------------------------------------------------------
# One process per run directory
# ------------------------------------------------------------------------------------------------------------------


class WorkdirLocked(RuntimeError):
  """Another live process holds the run directory."""


class WorkdirLock:
  """An exclusive lock on a run directory: ``<workdir>/.lock`` holding the holder's pid and host.

  The lock itself is an ``flock`` on that file, which the kernel releases when the holder dies, however it dies; so
  a file left with a pid but no flock is a stale lock from a dead process, taken over with a warning. The file is
  emptied (not removed) on release, so two processes never lock two different files of the same name. flock works
  on local file systems; on network file systems that do not support it, acquiring fails with an error saying so.
  """

  FILE = ".lock"

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, self.FILE)
    self._f = None

  def acquire(self) -> "WorkdirLock":
    os.makedirs(self.workdir, exist_ok=True)
    f = open(self.path, "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      f.seek(0)
      holder = f.read().strip() or "unknown"
      f.close()
      if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise WorkdirLocked(f"run directory {self.workdir} is in use by another process ({holder}; lock file "
                            f"{self.path}): two runs in one directory would overwrite each other's checkpoints "
                            f"and interleave metrics. Wait for it, stop it, or use another --workdir") from None
      raise WorkdirLocked(f"cannot lock run directory {self.workdir} ({self.path}: {e}); its file system may not "
                          f"support flock") from e
    f.seek(0)
    previous = f.read().strip()
    if previous:
      log.warning("run directory %s: taking over the stale lock of a process that is gone (%s)", self.workdir,
                  previous)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    self._f = f
    return self

  def release(self):
    if self._f is not None:
      self._f.seek(0)
      self._f.truncate()
      self._f.flush()
      fcntl.flock(self._f, fcntl.LOCK_UN)
      self._f.close()
      self._f = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
