"""Per-device memory plan of an RL run, from shapes and shardings alone (nothing is allocated).

An RL step has two phases whose buffers are live together with the training state (master params, optimizer
moments, the frozen KL reference), which every device holds its shard of for the whole run:

* **rollout**: the sampler's weights (the refit's form: FP8 codes + scales, BF16 head; whole on every device with
  data-parallel rollouts, else sharded as the master params) and the paged KV pool of one ``generate`` call of the
  step's prompts (one device's pool: ``Sampler.device_pool``);
* **train**: the gradients (the FP32 accumulator over the microbatches, sharded as the params) and the remat
  checkpoints of one microbatch (each layer's BF16 input).

The state, the sampler's weights, the KV pool and the gradients are exact sizes of the buffers the run makes. What
each phase's programs need on top (the remat checkpoints, one layer's recomputation, a microbatch's gradients
before they are added, the head's vocabulary chunk, the optimizer update; the sampler's activations and its decode
state) is XLA's: ``plan`` compiles the train step (a minibatch's gradient accumulation + the update), the prefill and
the decode loop at the run's shapes from abstract inputs (``jax.ShapeDtypeStruct``s with the run's shardings: no
weights made) for the backend this process runs on (on a GPU the GPU compiler's buffer assignment, on the CPU the
CPU's), and adds each program's ``memory_analysis().temp_size_in_bytes`` (per device) to its phase.

Compiling a 32-layer 8B step takes minutes on a CPU (the layers are a Python list, so the program grows with depth).
Where every layer is alike (no BF16-kept end layers or patterns, all layers dense or all MoE) the temporaries are
affine in the depth: T(L) = T(1) + (L - 1) (T(2) - T(1)), since each further layer adds the same buffers (its remat
checkpoint, its gradient, its weights' FP8 codes) while what the depth does not change (one layer's recomputation,
the head's chunk, the loss) stays. So ``plan`` compiles 1 and 2 layers deep and extrapolates (``compiled_depths``);
tests/test_memory.py checks the extrapolation against the compiled program at full depth. Where the layers differ it
compiles at full depth. XLA:CPU's buffer assignment is close to affine; the GPU's is less so. Measured on an H100 at
Llama-3.1-8B width, 32 x 4096 tokens (docs/results/train_step_temps_lora8b_h100.json): the FP8 LoRA step held
30.2 GiB at 32 layers where the extrapolation said 29.0 (4% under); with its frozen base passed through the
microbatch loop's barrier, 28.1 GiB where it says 36.7 (31% over), its depths 1 / 2 / 3 holding 2.56 / 3.66 /
4.38 GiB: the depth-to-depth steps are not equal on the GPU.

A run's own check (``RLTrainer`` on a GPU, ``full_depth=True``) therefore compiles its programs at the run's full
depth instead: each row is then the program the run executes, and the compiles are not extra, because the run's
first step finds those executables in JAX's in-memory compilation cache. That takes the same lowering: the abstract
arguments carry the run's shapes, dtypes, shardings and static arguments (the sampler's weights the shardings the
refit gives them, ``sampler_weight_shapes``; the decode program the run's stop ids); tests/test_memory.py checks that
the first step compiles none of them again. Rollouts over several devices (data-parallel, or one program over the
mesh) run other programs than the one-device ones the plan compiles, so theirs stay extrapolated.

With ``optim.offload`` the master and the optimizer state live in host memory between steps (``host`` rows, not
counted against the device); the train step's temporaries then hold their device copies (the compiled program's).

``RLTrainer`` checks its plan against the device's memory before it makes any weights; ``scripts/plan_memory.py``
prints the plan of a config for any number of devices (fake CPU devices: no GPU needed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import jax
import numpy as np

from fp8jax import lora as lora_lib, sampler as sampler_lib, sharding

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
  """Bytes per device, by phase. ``estimates``: rows shown but not checked (XLA temporaries compiled for another
  backend than the run's: planning GPUs on the CPU); the rest are exact sizes or the run's own compiled programs'."""

  mesh: dict[str, int]
  state: dict[str, int]
  rollout: dict[str, int]
  train: dict[str, int]
  estimates: tuple[str, ...] = ()
  kv_cache: str = "bf16"  # the rollout cache's kind (the error's hint)
  host: dict[str, int] = dataclasses.field(default_factory=dict)  # state in host memory (optim.offload)
  compiled: dict[str, dict] = dataclasses.field(default_factory=dict)  # program -> its memory analysis (bytes)
  # seconds the plan's compiles took (train step, rollout programs): its cost at start-up, not part of the plan
  compile_s: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)

  def phase(self, name: str, *, exact_only: bool = False) -> int:
    """The state plus phase ``name``'s buffers ("rollout" or "train")."""
    rows = {**self.state, **getattr(self, name)}
    return sum(v for k, v in rows.items() if not (exact_only and k in self.estimates))

  def peak(self, *, exact_only: bool = False) -> int:
    return max(self.phase("rollout", exact_only=exact_only), self.phase("train", exact_only=exact_only))

  def table(self) -> str:
    mesh = " x ".join(f"{a} {s}" for a, s in self.mesh.items() if s > 1) or "one device"
    lines = [f"memory per device (GiB), mesh: {mesh}"]
    groups = (("state (whole run)", self.state), ("rollout", self.rollout), ("train step", self.train))
    if self.host:
      groups += (("host memory (optim.offload; not on the device)", self.host),)
    for title, rows in groups:
      lines.append(f"  {title}")
      lines += [f"    {k:40s} {v / GIB:9.2f}" + (f"  (compiled for {self.compiled.get('backend')}: not checked)"
                                                      if k in self.estimates else "")
                for k, v in rows.items()]
    lines.append(f"  {'peak: state + rollout':42s} {self.phase('rollout') / GIB:9.2f}")
    lines.append(f"  {'peak: state + train step':42s} {self.phase('train') / GIB:9.2f}")
    return "\n".join(lines)

  def to_json(self) -> dict:
    return dict(mesh=self.mesh, state=self.state, rollout=self.rollout, train=self.train,
                estimates=list(self.estimates), kv_cache=self.kv_cache, peak=self.peak(),
                peak_exact=self.peak(exact_only=True), host=self.host, compiled=self.compiled, compile_s=self.compile_s)


# The rows that come from XLA's compiled programs (their names, for the table and the tests).
TRAIN_TEMPS = "XLA temporaries besides the gradients"
ROLLOUT_TEMPS = "XLA temporaries + decode state"


def memory_analysis(compiled) -> dict:
  """Bytes per device of a compiled program (``Compiled.memory_analysis()``): temp, argument, output, alias (outputs
  in donated arguments' buffers) and their host-memory counterparts."""
  ma = compiled.memory_analysis()
  keys = ("temp", "argument", "output", "alias", "host_temp", "host_argument", "host_output", "host_alias")
  return {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in keys}


def layers_alike(cfg, recipe) -> bool:
  """Whether every decoder layer compiles to the same buffers (the depth extrapolation's premise): no layer kept in
  BF16 by the recipe, all layers dense or all MoE."""
  if recipe.keep_first_n or recipe.keep_last_n or recipe.keep_patterns:
    return False
  return len({cfg.is_moe_layer(i) for i in range(cfg.n_layers)}) == 1


def compiled_depths(n_layers: int, alike: bool) -> tuple[int, ...]:
  """The depths ``plan`` compiles at: (1, 2), extrapolated to ``n_layers`` (module docstring), or the depth itself."""
  return (1, 2) if alike and n_layers > 2 else (n_layers,)


def at_depth(analyses: dict[int, dict], n_layers: int) -> dict:
  """A program's memory analysis at ``n_layers`` from its analyses at the compiled depths (affine in the depth)."""
  if n_layers in analyses:
    return dict(analyses[n_layers])
  a1, a2 = analyses[1], analyses[2]
  return {k: a1[k] + (n_layers - 1) * (a2[k] - a1[k]) for k in a1}


def train_step_args(learner, rows: int, seq: int):
  """Abstract (state, batch) of ``learner.train_step`` for a minibatch of ``rows`` sequences of ``seq`` tokens, with
  the run's shardings (and memory kinds: optim.offload)."""
  gc, S = learner.gc, jax.ShapeDtypeStruct
  state = learner.abstract_state(kv=learner.kv_state, ref=bool(gc.kl_beta))

  def rows_of(shape, dtype):
    return S(shape, dtype, sharding=sharding.batch_sharding(learner.mesh, len(shape)))

  per_token = ["mask", "old_logp"] + (["ref_logp"] if gc.kl_beta else []) + \
      (["is_weights"] if gc.is_kind != "none" else [])
  batch = {"tokens": rows_of((rows, seq), np.int32), "adv": rows_of((rows,), np.float32),
           **{k: rows_of((rows, seq - 1), np.float32) for k in per_token}}
  if learner.fp8_kv:
    rep = jax.sharding.NamedSharding(learner.mesh, jax.sharding.PartitionSpec())
    batch["kv_scales"] = tuple(S((learner.cfg.n_layers,), np.float32, sharding=rep) for _ in range(2))
  return state, batch


def compile_train_step(learner, rows: int, seq: int) -> dict:
  """The memory analysis of ``learner.train_step`` compiled for a minibatch of ``rows`` x ``seq``."""
  return memory_analysis(learner.train_step.lower(*train_step_args(learner, rows, seq)).compile())


def _placed(shapes, shardings):
  """``shapes`` (ShapeDtypeStructs) with ``shardings`` (a matching tree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def one_device_rollout(sampler) -> bool:
  """Whether the run's rollouts are the one-device programs the plan compiles (one rollout device, no mesh),
  so that the plan can lower them exactly as the run does (``rollout_args``'s ``placed``)."""
  return sampler.rollout_devices() == 1 and not sharding.multi_device(sampler.lcfg.mesh)


def _compiled_shapes(fn, *args, **kw):
  """``fn``'s outputs on abstract ``args``, with the shardings its compiled program gives them."""
  return _placed(fn.eval_shape(*args, **kw), fn.lower(*args, **kw).compile().output_shardings)


def sampler_weight_shapes(runner, sample_recipe, learner):
  """The one-device sampler's weights as the run's refit makes them from ``learner``'s state
  (``RolloutWorker.refit``: ``sampler.refit`` of the master params, or for LoRA the frozen base with the adapters
  cast to BF16; then ``fuse_projections``), abstract, with the shardings those programs give their outputs (read from
  the programs compiled on the abstract state), so that the rollout programs compiled on them lower exactly as the
  run's, which then reuses them (JAX's in-memory compilation cache)."""
  if learner.lora is not None:
    state = learner.abstract_state(kv=False, ref=False)
    out = lora_lib.sampling_weights(lora_lib.attach(state.base, state.params, learner.lora),
                                    cast=lambda pairs: _compiled_shapes(lora_lib.to_bf16, pairs))
  else:
    shapes = learner.param_shapes()
    master = _placed(shapes, sharding.tree_shardings(shapes, runner.lcfg.mesh))
    out = _compiled_shapes(sampler_lib.refit, master, recipe=sample_recipe)
  fused = runner.fuse_projections_shape(out)
  if fused is out:
    return out
  return _placed(fused, type(runner)._fuse.lower(runner, out).compile().output_shardings)


def rollout_args(sampler, sample_recipe, learner, *, prompts: int, samples: int, bucket: int,
                 max_new_tokens: int, placed: bool = True):
  """(runner, sampler weights, prompts, KV scales, requests, decode state, layout) of one device's share of a
  ``generate`` call, abstract: what its prefill and decode programs take (``Sampler._run_one``; data-parallel
  rollouts run the one-device sampler on each device's share, ``Sampler._local``). ``placed``: where the run rolls
  out on one device, with the shardings the run's arrays carry (``sampler_weight_shapes``; the KV scales and the
  decode state replicated on the mesh, as the learner's state and the prefill leave them), so that the programs
  lower as the run's; False: shapes only (byte counts)."""
  S, i32 = jax.ShapeDtypeStruct, np.int32
  d = sampler.rollout_devices()
  runner = sampler if d == 1 else sampler._local()
  lay, _ = sampler.device_pool(prompts, bucket, max_new_tokens)
  # placed: only where the plan's one-device programs are the run's (data-parallel rollouts gather the weights onto
  # each device's own mesh first, Sampler.sampling_form)
  place = placed and one_device_rollout(sampler)
  if place:
    sparams = sampler_weight_shapes(runner, sample_recipe, learner)
  else:
    refit = jax.eval_shape(functools.partial(sampler_lib.prepare_params, recipe=sample_recipe),
                           learner.param_shapes())
    if sharding.multi_device(runner.lcfg.mesh):  # one SPMD program over the mesh (nothing fuses there)
      sparams = _placed(refit, sharding.tree_shardings(refit, runner.lcfg.mesh))
    else:
      sparams = runner.fuse_projections_shape(refit)
  rep = jax.sharding.NamedSharding(runner.lcfg.mesh, jax.sharding.PartitionSpec()) if place else None
  n_layers, r = sampler.cfg.n_layers, lay.n_prompts * samples
  toks = S((lay.n_prompts, bucket), i32)
  scales = (S((n_layers,), np.float32, sharding=rep), S((n_layers,), np.float32, sharding=rep))
  rq = sampler_lib._Requests(prompt_of_req=S((r,), i32), prompt_len=S((lay.n_prompts,), i32),
                             last_tok=S((lay.n_prompts,), i32), n_req=S((), i32), req_offset=S((), i32))
  kv = runner.scfg.kv_cache

  def start(p, t, ks, vs, q):
    cache, _ = runner._prefill_fn(p, t, ks, vs, lay, kv)
    return runner._take(sampler_lib._new_state(cache, lay.slots, r, max_new_tokens), q, lay, lay.slots)

  state = jax.eval_shape(start, sparams, toks, *scales, rq)
  if place:
    state = jax.tree.map(lambda x: S(x.shape, x.dtype, sharding=rep), state)
  return runner, sparams, toks, scales, rq, state, lay


def compile_rollout(sampler, sample_recipe, learner, sp, *, prompts: int, samples: int, bucket: int,
                    max_new_tokens: int) -> dict:
  """Memory analyses of one device's prefill and decode-loop programs, and the decode state's bytes beyond the KV
  pool (the per-request outputs, slot vectors)."""
  runner, sparams, toks, (ks, vs), rq, state, lay = rollout_args(
      sampler, sample_recipe, learner, prompts=prompts, samples=samples, bucket=bucket,
      max_new_tokens=max_new_tokens)
  kv = runner.scfg.kv_cache
  prefill = memory_analysis(type(runner)._prefill.lower(runner, sparams, toks, ks, vs, lay, kv).compile())
  key = jax.eval_shape(lambda: jax.random.key(0))
  static_sp = dataclasses.replace(sp, seed=0, max_new_tokens=max_new_tokens)
  decode = memory_analysis(type(runner)._decode.lower(runner, sparams, state, rq, lay, static_sp,
                                                      runner.scfg.decode_chunk, key).compile())
  pool = runner._pool_bytes(lay)
  return {"prefill": prefill, "decode": decode, "decode_state_beyond_pool": tree_bytes(state) - pool}


def plan(learner, sampler, sample_recipe, *, prompts: int, samples: int, prompt_len: int, max_new_tokens: int,
         microbatch: int, sp=None, temporaries: bool = True, target: str | None = None,
         full_depth: bool = False) -> MemoryPlan:
  """The plan of a run whose learner and sampler are these, for a step of ``prompts`` x ``samples`` rollouts of
  prompts up to ``prompt_len`` tokens (the largest bucket) and ``max_new_tokens``, trained in microbatches of
  ``microbatch`` sequences (``learner.gc.microbatch``: the compiled step's). ``sp``: the rollouts' sampling
  parameters (top-k / top-p change the decode program); default temperature 1. ``temporaries=False`` leaves XLA's
  part out (no compiles). ``target``: the backend the run will use ("gpu"), when it is not this process's (planning
  GPUs on the CPU): the temporaries, compiled for this backend, are then shown but not checked (``estimates``).
  ``full_depth``: compile the run's own programs at its depth, not at depths 1 and 2 (module docstring)."""
  del microbatch  # the compiled train step's own (learner.gc)
  kl = bool(learner.gc.kl_beta)
  state = learner.abstract_state(kv=False, ref=kl)
  rows = {"master params (FP32)": tree_bytes(state.params), "optimizer state": tree_bytes(state.opt_state)}
  lora = getattr(learner, "lora", None)
  if lora is not None:  # LoRA: the trained params are the adapters; the frozen base (no master) beside them
    rows = {"LoRA adapters (FP32)": rows.pop("master params (FP32)"), **rows,
            "LoRA base (frozen: FP8 codes / BF16)": tree_bytes(state.base)}
  host = {}
  if learner.oc.offload != "none":  # in host memory between steps: not the device's
    host = {f"{k} ({learner.oc.offload})": rows.pop(k) for k in list(rows)}
  if kl and lora is None:  # (LoRA: the reference is the base)
    rows["KL reference (trainer's form)"] = tree_bytes(state.ref_params)

  # the sampler's weights: the refit's shapes, sharded as the refit leaves them or whole per rollout device
  refit = jax.eval_shape(functools.partial(sampler_lib.prepare_params, recipe=sample_recipe), learner.param_shapes())
  if sampler.rollout_devices() > 1:
    weights = tree_bytes(refit)
  else:
    weights = tree_bytes(_placed(refit, sharding.tree_shardings(refit, learner.mesh)))
  if lora is not None:  # the sampler runs the state's own base (a copy only when gathered whole per rollout device)
    weights = tree_bytes(state.params) // 2 + (weights if sampler.rollout_devices() > 1 else 0)  # + BF16 adapters
  bucket = sampler.scfg.bucket(prompt_len)
  _, pool = sampler.device_pool(prompts, bucket, max_new_tokens)
  grads = tree_bytes(state.params)
  mesh = {a: int(s) for a, s in learner.mesh.shape.items()}
  if not temporaries:
    return MemoryPlan(mesh=mesh, state=rows, rollout={"sampler weights": weights, "KV cache pool": pool},
                      train={"gradients (FP32 accumulator)": grads}, kv_cache=sampler.scfg.kv_cache, host=host)

  # XLA's part: the programs compiled at the run's shapes (at depths 1 and 2 where the layers are alike)
  n_layers, gc = learner.cfg.n_layers, learner.gc
  sp = sp or sampler_lib.SamplingParams(max_new_tokens=max_new_tokens)
  seq = bucket + max_new_tokens  # the trainer's sequences: the prompt bucket + the completion (Rollout.sequences)
  minibatch = gc.batch // gc.minibatches
  alike_train = layers_alike(learner.cfg, learner.policy.recipe)
  alike_rollout = layers_alike(sampler.cfg, sample_recipe)
  train_at, prefill_at, decode_at = {}, {}, {}
  t0 = time.perf_counter()
  for k in compiled_depths(n_layers, alike_train and not full_depth):
    train_at[k] = compile_train_step(learner if k == n_layers else learner.at_depth(k), minibatch, seq)
  t1 = time.perf_counter()
  for k in compiled_depths(n_layers, alike_rollout and not (full_depth and one_device_rollout(sampler))):
    s_k = sampler if k == n_layers else sampler_lib.Sampler(dataclasses.replace(sampler.cfg, n_layers=k),
                                                            sampler.scfg, sampler.lcfg)
    got = compile_rollout(s_k, sample_recipe, learner if k == n_layers else learner.at_depth(k), sp, prompts=prompts,
                          samples=samples, bucket=bucket, max_new_tokens=max_new_tokens)
    prefill_at[k], decode_at[k] = got["prefill"], got["decode"]
  compile_s = {"train_step": t1 - t0, "rollout": time.perf_counter() - t1}  # the plan's own cost, at start-up
  *_, dstate, _ = rollout_args(sampler, sample_recipe, learner, prompts=prompts, samples=samples,
                               bucket=bucket, max_new_tokens=max_new_tokens, placed=False)
  train_c, prefill_c, decode_c = (at_depth(a, n_layers) for a in (train_at, prefill_at, decode_at))
  decode_extra = tree_bytes(dstate) - pool
  rollout = {"sampler weights": weights, "KV cache pool": pool,
             ROLLOUT_TEMPS: max(prefill_c["temp"], decode_c["temp"] + decode_extra)}
  train = {"gradients (FP32 accumulator)": grads, TRAIN_TEMPS: max(train_c["temp"] - grads, 0),
           "train batch": tree_bytes(train_step_args(learner, minibatch, seq)[1])}
  depths = lambda a: sorted(a)  # noqa: E731
  other = target is not None and target != jax.default_backend()
  compiled = {"backend": jax.default_backend(),
              "train_step": dict(train_c, depths=depths(train_at), rows=minibatch, seq=seq),
              "prefill": dict(prefill_c, depths=depths(prefill_at)),
              "decode": dict(decode_c, depths=depths(decode_at), state_beyond_pool=decode_extra)}
  return MemoryPlan(mesh=mesh, state=rows, rollout=rollout, train=train, kv_cache=sampler.scfg.kv_cache, host=host,
                    compiled=compiled, estimates=(ROLLOUT_TEMPS, TRAIN_TEMPS) if other else (), compile_s=compile_s)


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
      out["steps"].append({"step": i + 1, "peak": read("peak_bytes_in_use") / GIB, "in_use": read("bytes_in_use") / GIB,
                           **{k: float(m[k]) for k in ("step_s", "rollout_s", "train_s", "token_mult_prob_error")}})
  finally:
    del worker.collect  # the bound method again
  out["rollout_peak"] = seen["rollout_peak"]
  return out


def device_limit() -> int | None:
  """Bytes the allocator of this process's first device may use (None where the backend does not say: CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


class DoesNotFit(ValueError):
  """``check``'s refusal; ``plan`` is the plan it refused (``scripts/plan_memory.py`` prints it)."""

  def __init__(self, message: str, plan: MemoryPlan):
    super().__init__(message)
    self.plan = plan


def check(p: MemoryPlan, limit: int | None) -> None:
  """Raises ``DoesNotFit`` (a ValueError) naming the config keys to change when a phase of the plan (its exact
  buffers and the compiled programs' temporaries, unless compiled for another backend: ``estimates``) does not fit
  ``limit`` bytes per device (no check when ``limit`` is None)."""
  if limit is None or p.peak(exact_only=True) <= limit:
    return
  phase = "rollout" if p.phase("rollout", exact_only=True) >= p.phase("train", exact_only=True) else "train"
  need = p.phase(phase, exact_only=True)
  parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in {**p.state, **getattr(p, phase)}.items() if k not in p.estimates)
  devices = math.prod(p.mesh.values())
  hint = ("shard the state over more devices (mesh.fsdp; the master params and Adam moments take 12 bytes per "
          "parameter)" if devices == 1 or p.mesh.get("fsdp", 1) < devices else "use more devices (mesh.fsdp)")
  if not p.host:
    hint += ("; optim.state_dtype='bfloat16' (Adam moments in BF16: 4 bytes per parameter less), optim.offload="
             "'pinned_host' (master and moments in host memory between steps)")
  if phase == "rollout":
    hint += "; or a smaller KV pool and decode batch (rollout.slots, rollout.max_new_tokens, grpo.num_prompts" + (
        "" if p.kv_cache == "fp8" else "; fp8.kv_cache='fp8' halves the pool") + ")"
  else:
    hint += ("; or fewer activations per microbatch (grpo.microbatch, model.remat=True, rollout.max_new_tokens), "
             "or train adapters only (lora.rank)")
  share = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  share = f"XLA_PYTHON_CLIENT_MEM_FRACTION={share}" if share else "XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's default 0.75"
  raise DoesNotFit(f"this run needs {need / GIB:.1f} GiB per device in its {phase} phase ({parts}; GiB) on a mesh "
                   f"of {devices} device(s) {p.mesh}, but a device has {limit / GIB:.1f} GiB (the share of its memory "
                   f"that JAX's allocator may use: {share}): {hint}. scripts/plan_memory.py prints the whole plan.", p)
