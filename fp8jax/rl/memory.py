"""Per-device memory plan of an RL run, from shapes and shardings alone (nothing is allocated).

An RL step has two phases whose buffers are live together with the training state (master params, optimizer
moments, the frozen KL reference), which every device holds its shard of for the whole run:

* **rollout**: the sampler's weights (the refit's form: FP8 codes + scales, BF16 head; whole on every device with
  data-parallel rollouts, else sharded as the master params) and the paged KV pool of one ``generate`` call of the
  step's prompts (one device's pool: ``Sampler.device_pool``);
* **train**: the gradients (the FP32 accumulator over the microbatches, sharded as the params) and the remat
  checkpoints of one microbatch (each layer's BF16 input).

The state, the sampler's weights, the KV pool and the gradients are exact sizes of the buffers the run makes. The
activations are not: the remat checkpoints are the least a microbatch keeps, and XLA's temporaries (one layer's
recomputation, a microbatch's gradients before they are added, the head's vocabulary chunk, the optimizer update)
come on top. So ``check`` refuses a run only on the exact part, and the plan's table says which rows are estimates.

``RLTrainer`` checks its plan against the device's memory before it makes any weights; ``scripts/plan_memory.py``
prints the plan of a config for any number of devices (fake CPU devices: no GPU needed).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from fp8jax import sampler as sampler_lib, sharding

GIB = 2**30


def tree_bytes(tree) -> int:
  """Bytes one device holds of a pytree of arrays or ShapeDtypeStructs with shardings (its shard of each leaf)."""
  total = 0
  for x in jax.tree.leaves(tree):
    sh = getattr(x, "sharding", None)
    shape = sh.shard_shape(x.shape) if sh is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device, by phase. ``estimates``: the rows that are estimates from below (the rest are exact)."""

  mesh: dict[str, int]
  state: dict[str, int]
  rollout: dict[str, int]
  train: dict[str, int]
  estimates: tuple[str, ...] = ()
  kv_cache: str = "bf16"  # the rollout cache's kind (the error's hint)

  def phase(self, name: str, *, exact_only: bool = False) -> int:
    """The state plus phase ``name``'s buffers ("rollout" or "train")."""
    rows = {**self.state, **getattr(self, name)}
    return sum(v for k, v in rows.items() if not (exact_only and k in self.estimates))

  def peak(self, *, exact_only: bool = False) -> int:
    return max(self.phase("rollout", exact_only=exact_only), self.phase("train", exact_only=exact_only))

  def table(self) -> str:
    mesh = " x ".join(f"{a} {s}" for a, s in self.mesh.items() if s > 1) or "one device"
    lines = [f"memory per device (GiB), mesh: {mesh}"]
    for title, rows in (("state (whole run)", self.state), ("rollout", self.rollout), ("train step", self.train)):
      lines.append(f"  {title}")
      lines += [f"    {k:40s} {v / GIB:9.2f}" + ("  (estimate, from below)" if k in self.estimates else "")
                for k, v in rows.items()]
    lines.append(f"  {'peak: state + rollout':42s} {self.phase('rollout') / GIB:9.2f}")
    lines.append(f"  {'peak: state + train step':42s} {self.phase('train') / GIB:9.2f}")
    return "\n".join(lines)

  def to_json(self) -> dict:
    return dict(mesh=self.mesh, state=self.state, rollout=self.rollout, train=self.train,
                estimates=list(self.estimates), kv_cache=self.kv_cache, peak=self.peak(), peak_exact=self.peak(exact_only=True))


def plan(learner, sampler, sample_recipe, *, prompts: int, samples: int, prompt_len: int, max_new_tokens: int,
         microbatch: int) -> MemoryPlan:
  """The plan of a run whose learner and sampler are these, for a step of ``prompts`` x ``samples`` rollouts of
  prompts up to ``prompt_len`` tokens (the largest bucket) and ``max_new_tokens``, trained in microbatches of
  ``microbatch`` sequences."""
  kl = bool(learner.gc.kl_beta)
  state = learner.abstract_state(kv=False, ref=kl)
  rows = {"master params (FP32)": tree_bytes(state.params), "optimizer state": tree_bytes(state.opt_state)}
  if kl:
    rows["KL reference (trainer's form)"] = tree_bytes(state.ref_params)

  # the sampler's weights: the refit's shapes, sharded as the refit leaves them or whole per rollout device
  refit = jax.eval_shape(functools.partial(sampler_lib.prepare_params, recipe=sample_recipe), learner.param_shapes())
  if sampler.rollout_devices() > 1:
    weights = tree_bytes(refit)
  else:
    weights = tree_bytes(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), refit,
                                      sharding.tree_shardings(refit, learner.mesh)))
  _, pool = sampler.device_pool(prompts, sampler.scfg.bucket(prompt_len), max_new_tokens)
  rollout = {"sampler weights": weights, "KV cache pool": pool}

  batch_devices = math.prod(learner.mesh.shape[a] for a in ("data", "fsdp", "expert") if a in learner.mesh.shape)
  rows_per_device = -(-min(microbatch, prompts * samples) // batch_devices)
  seq = prompt_len + max_new_tokens
  cfg = learner.cfg
  ckpt = cfg.n_layers * rows_per_device * seq * cfg.dim * np.dtype(cfg.dtype).itemsize
  train = {"gradients (FP32 accumulator)": rows["master params (FP32)"],
           "remat checkpoints (a microbatch)": ckpt}
  return MemoryPlan(mesh={a: int(s) for a, s in learner.mesh.shape.items()}, state=rows, rollout=rollout,
                    train=train, estimates=("remat checkpoints (a microbatch)",), kv_cache=sampler.scfg.kv_cache)


def allocator_stats(device=None):
  """``read(key)``: the allocator's ``bytes_in_use`` / ``peak_bytes_in_use`` / ``bytes_limit`` of ``device`` (this
  process's first), in bytes. Raises ValueError at once where the backend keeps no such statistics (XLA:CPU)."""
  dev = device or jax.local_devices()[0]
  if "peak_bytes_in_use" not in (dev.memory_stats() or {}):
    raise ValueError(f"device {dev} keeps no allocator statistics (memory_stats()); measure on a GPU")
  return lambda key: int(dev.memory_stats()[key])


def measure(trainer, steps: int, read) -> dict:
  """Runs RL steps 0..``steps``-1 of a built ``RLTrainer`` and returns what ``read`` (``allocator_stats``) saw, in
  GiB: the bytes in use once the state exists (KV scales and KL reference made), the peak through the first rollout
  (read when its tokens reach the host), and per step the peak so far, with the step's timings. Beside the plan
  (``scripts/plan_memory.py --measure_steps``), the difference is what XLA's temporaries and programs add."""
  if steps < 1:
    raise ValueError(f"measure: steps={steps}, at least 1 (the first step's rollout and train phases)")
  trainer.start_rl()
  jax.block_until_ready(trainer.state)
  out = {"state_in_use": read("bytes_in_use") / GIB, "limit": read("bytes_limit") / GIB, "steps": []}
  worker, collect, seen = trainer.worker, trainer.worker.collect, {}

  def collect_and_read(*a, **k):
    col = collect(*a, **k)
    seen.setdefault("rollout_peak", read("peak_bytes_in_use") / GIB)
    return col

  worker.collect = collect_and_read
  try:
    for i in range(steps):
      m = trainer.step(i)
      out["steps"].append({"step": i + 1, "peak": read("peak_bytes_in_use") / GIB,
                           "in_use": read("bytes_in_use") / GIB, "step_s": m["step_s"], "rollout_s": m["rollout_s"],
                           "train_s": m["train_s"], "token_mult_prob_error": m["token_mult_prob_error"]})
  finally:
    del worker.collect  # the bound method again
  out["rollout_peak"] = seen["rollout_peak"]
  return out


def device_limit() -> int | None:
  """Bytes the allocator of this process's first device may use (None where the backend does not say: CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def check(p: MemoryPlan, limit: int | None) -> None:
  """Raises a ValueError naming the config keys to change when the plan's exact part does not fit ``limit`` bytes
  per device (no check when ``limit`` is None)."""
  if limit is None or p.peak(exact_only=True) <= limit:
    return
  phase = "rollout" if p.phase("rollout", exact_only=True) >= p.phase("train", exact_only=True) else "train"
  need = p.phase(phase, exact_only=True)
  parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in {**p.state, **getattr(p, phase)}.items()
                    if k not in p.estimates)
  devices = math.prod(p.mesh.values())
  hint = ("shard the state over more devices (mesh.fsdp; the master params and Adam moments take 12 bytes per "
          "parameter)" if devices == 1 or p.mesh.get("fsdp", 1) < devices else "use more devices (mesh.fsdp)")
  if phase == "rollout":
    hint += ", or a smaller KV pool (rollout.slots, rollout.max_new_tokens, grpo.num_prompts" + (
        "" if p.kv_cache == "fp8" else "; fp8.kv_cache='fp8' halves it") + ")"
  raise ValueError(f"this run needs {need / GIB:.1f} GiB per device in its {phase} phase before any activations "
                   f"({parts}; GiB) on a mesh of {devices} device(s) {p.mesh}, but a device has {limit / GIB:.1f} "
                   f"GiB: {hint}. scripts/plan_memory.py prints the whole plan.")
