"""Orbax checkpoints of the RL run: train state (params, optimizer state, step) + JSON metadata.

Saves are atomic (orbax writes a temporary directory and renames it when complete) and keep the last ``keep``.
The metadata holds everything else a resumed run needs to continue exactly: data position, FP8 KV scales, the
seed (all randomness is derived from (seed, step)), and the warm-start flag.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                              enable_async_checkpointing=False),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state, meta: dict):
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    self._mngr.wait_until_finished()

  def restore(self, step: int, abstract_state):
    """Restores onto the shardings of ``abstract_state`` (a pytree of arrays or ShapeDtypeStructs)."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                          abstract_state)
    out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                           meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def close(self):
    self._mngr.close()
