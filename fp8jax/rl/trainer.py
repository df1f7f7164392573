"""The GRPO loop: rollouts and gradients in FP8 through one engine, driven by one config.

Per RL step (``RLTrainer.step``):
  1. requantize: ``sampler.prepare_params(master, recipe)`` -> FP8 weights for the sampler (one jitted pass);
  2. rollout: G completions per prompt; the sampler's log-probs are the old-policy log-probs (same model function,
     same quantizer, same GEMMs as the trainer — fp8jax/__init__ and tests/test_sampler.py);
     with ``fp8.mode="fp8_rollout"`` (FP8 in generation only) the sampler runs the FP8 recipe and the trainer BF16
     (``quant.Recipe.sampler_side`` / ``trainer_side``), so the two disagree, as two-engine setups do: the mismatch
     metrics show the gap, and ``grpo.recompute_old_logp`` with ``grpo.is_kind`` corrects for it;
  3. reward (host side) -> leave-one-out group advantages (fp8jax.rl.grpo);
  4. reference log-probs only when grpo.kl_beta != 0; trainer log-probs of a sample of sequences for the mismatch
     metrics (or of all of them with grpo.recompute_old_logp);
  5. ``train_step`` per minibatch: FP8 forward/dgrad/wgrad, gradient accumulation over microbatches, AdamW;
  6. the next rollout's FP8 KV scales come from the K/V amax the training forward recorded.
All randomness derives from (seed, step); everything else a resumed run needs is in the checkpoint (the frozen KL
reference policy, FP8 KV scales, the prompt-batch position, the model config it was made with), so an interrupted
and resumed run repeats the same metrics.

A run directory (``--workdir``) holds one run: ``checkpoints/``, ``metrics.jsonl``, ``tb/``, ``metrics.png`` and
``.lock``. ``run`` locks it for its duration (a second process on it stops at once, naming the holder); resuming
drops the metrics rows written after the checkpoint it resumes from (TensorBoard: a purge event hides them), so a
kill and a resume never duplicate rows; and a run that does not resume refuses a directory that already holds a
run (it would mix the two: orbax skips saving steps <= the latest one on disk), saying what to do instead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax import distributed, kvcache, ops, quant, sampler as sampler_lib, sharding
from fp8jax.checkpoint import Checkpointer, WorkdirLock
from fp8jax.config_utils import dataclass_from_group
from fp8jax.metrics import MetricsWriter, plot
from fp8jax.model import llama, moe, schema
from fp8jax.model.config import ModelConfig
from fp8jax.rl import grpo
from fp8jax.rl.source import PromptSource

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  num_prompts: int = 16
  num_generations: int = 8
  normalize_std: bool = True
  leave_one_out: bool = True
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float = 0.0  # 0 = off
  agg: str = "token_mean"
  kl_beta: float = 0.0
  is_kind: str = "none"
  is_lo: float = 0.5
  is_hi: float = 2.0
  recompute_old_logp: bool = False
  mismatch_sample: int = 16
  dynamic_sampling: bool = False
  max_refills: int = 2
  overlong_filter: bool = False
  minibatches: int = 1
  microbatch: int = 64
  # MoE models only: weight of the Switch load-balancing loss (fp8jax.model.moe) over the trained tokens; 0 = off,
  # the RL default (the policy's routing is what the rollouts sampled; transformers' SFT default is 0.001).
  router_aux_coef: float = 0.0

  @property
  def batch(self) -> int:
    return self.num_prompts * self.num_generations

  def __post_init__(self):
    for key in ("num_prompts", "minibatches", "microbatch"):
      if getattr(self, key) < 1:
        raise ValueError(f"grpo.{key}={getattr(self, key)} must be >= 1")
    if self.num_generations < 2:
      # A group of one has no baseline: every advantage is 0, and the run would train on nothing and exit 0.
      loo = " with grpo.leave_one_out=True (the leave-one-out baseline needs another completion)" \
          if self.leave_one_out else " (a group of one has advantage 0: nothing to learn from)"
      raise ValueError(f"grpo.num_generations={self.num_generations} must be >= 2{loo}")
    if self.batch % self.minibatches:
      raise ValueError(f"grpo.num_prompts*num_generations={self.batch} must divide by grpo.minibatches={self.minibatches}")
    mb = self.batch // self.minibatches
    if mb % min(self.microbatch, mb):
      raise ValueError(f"minibatch of {mb} sequences must divide by grpo.microbatch={self.microbatch}")
    if self.is_kind not in grpo.IS_KINDS:
      raise ValueError(f"grpo.is_kind={self.is_kind!r} is not one of {grpo.IS_KINDS}")
    if self.agg not in grpo.AGG_KINDS:
      raise ValueError(f"grpo.agg={self.agg!r} is not one of {grpo.AGG_KINDS}")
    if not self.router_aux_coef >= 0:
      raise ValueError(f"grpo.router_aux_coef={self.router_aux_coef} must be >= 0")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 1e-3
  schedule: str = "constant"  # "constant" | "warmup_constant" | "cosine"
  warmup_steps: int = 0
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  eps: float = 1e-8
  grad_clip: float = 1.0


def make_optimizer(oc: OptimConfig, total_steps: int, decay_mask=None):
  """AdamW (+ global-norm clipping) on ``oc``'s schedule -> (tx, schedule). ``decay_mask``: a params pytree of bools
  (``schema.decay_mask``), False where weight decay must not apply (buffers with no gradient), or None (all)."""
  if oc.schedule == "constant":
    sched = optax.constant_schedule(oc.lr)
  elif oc.schedule == "warmup_constant":
    sched = optax.join_schedules([optax.linear_schedule(0.0, oc.lr, max(oc.warmup_steps, 1)),
                                  optax.constant_schedule(oc.lr)], [oc.warmup_steps])
  elif oc.schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, oc.lr, max(oc.warmup_steps, 1), max(total_steps, 2),
                                               end_value=oc.lr * oc.min_lr_ratio)
  else:
    raise ValueError(f"optim.schedule={oc.schedule!r} is not 'constant', 'warmup_constant' or 'cosine'")
  tx = optax.chain(optax.clip_by_global_norm(oc.grad_clip) if oc.grad_clip > 0 else optax.identity(),
                   optax.adamw(sched, b1=oc.b1, b2=oc.b2, eps=oc.eps, weight_decay=oc.weight_decay, mask=decay_mask))
  return tx, sched


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  params: Any  # FP32 master weights
  opt_state: Any
  step: jax.Array


# ------------------------------------------------------------------------------------------------------------------
# Pure steps
# ------------------------------------------------------------------------------------------------------------------


def sequence_logprobs(params, tokens_BxL, cfg: ModelConfig, lcfg, recipe: quant.Recipe, kv_scales, temperature,
                      router_mask_BxL=None):
  """Trainer log-probs (B, L-1) of each next token, FP8 per the recipe, + entropy and ForwardAux (per-layer K/V
  amax, MoE routing statistics over ``router_mask_BxL``).

  ``params`` are master weights, or already-quantized ones (the frozen reference policy): mark_fp8 keeps QWeights.
  """
  return llama.next_token_logprobs(quant.mark_fp8(params, recipe), tokens_BxL, cfg, lcfg, temperature=temperature,
                                   kv_scales=kv_scales, router_mask_BxT=router_mask_BxL)


def _trained_positions(mask_BxT):
  """(B, L) mask of the positions whose next-token prediction is in the loss (``mask`` is (B, L-1))."""
  return jnp.pad(mask_BxT, ((0, 0), (0, 1)))


def grpo_loss(params, mb, cfg: ModelConfig, lcfg, recipe, gc: GRPOConfig, temperature, n_tok, n_seq):
  """Loss of one microbatch (summed over microbatches it is the minibatch loss; see grpo.policy_loss).

  With ``grpo.router_aux_coef > 0`` (MoE models) the microbatch adds ``coef * lb * tokens_mb / n_tok``, where ``lb``
  is the load-balancing loss over its trained tokens: summed over microbatches, a token-weighted mean of lb.
  """
  logp, ent, aux = sequence_logprobs(params, mb["tokens"], cfg, lcfg, recipe, mb.get("kv_scales"), temperature,
                                     _trained_positions(mb["mask"]))
  loss, m = grpo.policy_loss(
      logp, mb["old_logp"], mb["adv"], mb["mask"], eps_low=gc.eps_low, eps_high=gc.eps_high,
      dual_clip=gc.dual_clip or None, agg=gc.agg, is_weights_BxT=mb.get("is_weights"),
      ref_logp_BxT=mb.get("ref_logp"), kl_beta=gc.kl_beta, global_token_count=n_tok, global_seq_count=n_seq,
      entropy_BxT=ent)
  if aux.router:
    lb = moe.load_balancing_loss(list(aux.router), cfg.n_experts)
    m = dict(m, router_lb_loss=lb)
    if gc.router_aux_coef:
      loss = loss + gc.router_aux_coef * lb * jnp.sum(mb["mask"]) / n_tok
  return loss, (m, aux)


def sft_loss(params, mb, cfg: ModelConfig, lcfg, recipe, gc, temperature, n_tok, n_seq):
  """Cross-entropy on masked target tokens (the tiny task's supervised warm-start), same FP8 forward."""
  del gc, n_seq
  logp, ent, aux = sequence_logprobs(params, mb["tokens"], cfg, lcfg, recipe, mb.get("kv_scales"), temperature)
  loss = -jnp.sum(logp * mb["mask"]) / n_tok
  return loss, ({"nll": loss, "entropy": jnp.sum(ent * mb["mask"]) / n_tok}, aux)


def train_step(state: TrainState, batch: dict, *, loss_fn, tx, cfg, lcfg, recipe, gc, microbatch, temperature=1.0):
  """One optimizer step over ``batch`` with gradient accumulation over microbatches (lax.scan).

  Returns the new state and metrics (means over microbatches; loss summed, i.e. the minibatch loss), plus
  ``k_amax_L``/``v_amax_L`` (max over microbatches) for FP8 KV-scale recalibration.
  """
  b = batch["tokens"].shape[0]
  mb = min(microbatch, b)
  n_micro = b // mb
  n_tok = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
  n_seq = jnp.maximum(jnp.sum(jnp.any(batch["mask"] > 0, axis=-1)), 1.0)
  kv_scales = batch.pop("kv_scales", None)
  micro = jax.tree.map(lambda x: x.reshape(n_micro, mb, *x.shape[1:]), batch)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def body(acc, mbatch):
    if kv_scales is not None:
      mbatch = dict(mbatch, kv_scales=kv_scales)
    (loss, (m, aux)), g = grad_fn(state.params, mbatch, cfg, lcfg, recipe, gc, temperature, n_tok, n_seq)
    gsum, lsum = acc
    return (jax.tree.map(jnp.add, gsum, g), lsum + loss), (m, aux.k_amax_L, aux.v_amax_L)

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  (grads, loss), (ms, k_amax, v_amax) = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {k: jnp.mean(v) for k, v in ms.items()}
  metrics.update(loss=loss, grad_norm=optax.tree.norm(grads), k_amax_L=jnp.max(k_amax, 0), v_amax_L=jnp.max(v_amax, 0))
  # Checked on the host before anything is saved: a finite loss can still give non-finite updated weights.
  metrics["params_finite_"] = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))
  return TrainState(params, opt_state, state.step + 1), metrics


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


class TrainingDiverged(RuntimeError):
  """The run stopped because training diverged; nothing of the failing step was saved."""


class NonFiniteLoss(TrainingDiverged):
  """Non-finite loss, gradient norm or updated weights."""


class PolicyCollapsed(TrainingDiverged):
  """The policy no longer responds to its inputs (exactly zero gradient although advantages are nonzero)."""


class CheckpointMismatch(ValueError):
  """The checkpoint to resume was made with a config it cannot continue under (the message names the keys)."""


class RunDirInUse(RuntimeError):
  """A run that does not resume was pointed at a directory that already holds a run."""


def validate_config(c) -> None:
  """Checks, before any work starts, the values that would otherwise fail late or be silently ignored.

  Each error names the config key. (Group-local checks live in the groups' dataclasses: GRPOConfig, ModelConfig,
  quant.Recipe, SamplerConfig.)
  """
  def need(ok, key, why):
    if not ok:
      group, field = key.split(".")
      raise ValueError(f"{key}={c[group][field]!r} {why}")

  need(int(c.train.steps) >= 0, "train.steps", "must be >= 0 (0 runs the warm start and the first validation only)")
  need(int(c.train.val_every) >= 1, "train.val_every",
       "must be >= 1 (validation runs every val_every steps and at the last one; a value above train.steps "
       "validates at the end only)")
  need(int(c.train.val_prompts) >= 1, "train.val_prompts", "must be >= 1")
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
  r = c.rollout
  need(1 <= int(r.max_new_tokens) < int(r.max_len), "rollout.max_new_tokens",
       f"must be in [1, rollout.max_len={r.max_len}): prompt (>= 1 token) and completion share rollout.max_len, "
       f"so more new tokens than that could never be generated")


class RLTrainer:
  """Owns the state, the sampler, the task and the writers of one run (built from a ConfigDict)."""

  def __init__(self, config, workdir: str | None = None, *, devices=None):
    self.c = config
    validate_config(config)
    self.workdir = workdir or config.workdir
    hf_dir = config.checkpoint.hf_dir
    if hf_dir:  # the architecture comes from the checkpoint (config.model is ignored then)
      from fp8jax import hf  # noqa: PLC0415

      if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"checkpoint.hf_dir={hf_dir!r} is not a directory: download the HF model (config.json, "
                                f"*.safetensors, tokenizer files) and point --config.checkpoint.hf_dir at it")
      self.cfg = hf.load_config(hf_dir, dtype=config.model.dtype, max_seq_len=config.rollout.max_len)
      self.cfg = dataclasses.replace(self.cfg, remat=bool(config.model.remat), attn_backend=config.model.attn_backend,
                                     norm_backend=config.model.get("norm_backend", "auto"))
    else:
      self.cfg = ModelConfig.from_config(config.model)
    self.recipe = quant.Recipe.from_config(config.fp8)
    # The recipe each engine runs: the same one for "fp8" and "bf16" (one engine); for "fp8_rollout" FP8 weights
    # (and the FP8 KV cache if set) in the sampler and BF16 in the trainer (quant.Recipe).
    self.sample_recipe, self.train_recipe = self.recipe.sampler_side(), self.recipe.trainer_side()
    self.gc = dataclass_from_group(GRPOConfig, config.grpo, "grpo")
    self.oc = dataclass_from_group(OptimConfig, config.optim, "optim")
    r = config.rollout
    self.scfg = sampler_lib.SamplerConfig(slots=r.slots, max_len=r.max_len, prompt_buckets=tuple(r.prompt_buckets),
                                          kv_cache=self.sample_recipe.kv_cache, decode_chunk=r.decode_chunk,
                                          max_refills_per_step=r.get("max_refills_per_step",
                                                                     sampler_lib.SamplerConfig.max_refills_per_step))
    self.task = _make_task(config, self.cfg)
    # rollout.seed varies the rollouts' sampling only (the task's problems, validation set and model init come from
    # seed), so several RL seeds can start from one warm start (scripts/parity.py); 0 is the historical stream.
    self.rollout_seed = int(r.get("seed", 0))
    self.sp = sampler_lib.SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                         max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(self.task.eos_ids))
    if self.sample_recipe.mode == "fp8" and self.cfg.fp8_shape_problems():
      log.warning("FP8 GEMMs will zero-pad: %s", ", ".join(self.cfg.fp8_shape_problems()))
    self.mesh = sharding.make_mesh(config.mesh, devices)
    self.lcfg = ops.LinearConfig.from_recipe(self.recipe, mesh=self.mesh)  # scale format, backend: both engines
    self.sampler = sampler_lib.Sampler(self.cfg, self.scfg, self.lcfg)
    self.total_steps = int(config.train.steps)
    self.tx, self.lr_sched = make_optimizer(self.oc, self.total_steps, schema.decay_mask(self.cfg))
    self._build_steps()
    self.warm_done = False
    self.state = self._init_state()
    self.ref_params = None  # the frozen KL reference (FP8 sampling weights of the policy when RL started)
    self.kv_scales = None
    self.prompt_batch = 0  # training prompt batches drawn so far (the task's data position; checkpointed)
    self.ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=config.checkpoint.keep,
                             extra_items=("ref",))

  # -- setup --------------------------------------------------------------------------------------------------------

  def _state_shardings(self, tx) -> TrainState:
    """Shardings of a whole TrainState (params, optimizer state, step) under ``tx``, from shapes alone.

    The state goes in and out of the train step with exactly these shardings (initial state placed with them, the
    step's outputs pinned to them), so the second step does not recompile: left to itself, XLA picks output
    shardings that differ from the inputs' (seen: row-parallel weights' moments, unplaced scalars), and a changed
    input sharding is a new program — a second full compile of the 8B train step.
    """
    shapes = self._param_shapes()
    state = TrainState(shapes, jax.eval_shape(tx.init, shapes), jax.ShapeDtypeStruct((), jnp.int32))
    return sharding.tree_shardings(state, self.mesh)

  @staticmethod
  def _fresh_state(params, tx, shardings: TrainState, step=None) -> TrainState:
    """``params`` with a new ``tx`` optimizer state (step 0 unless given), placed with ``shardings``."""
    step = jnp.zeros((), jnp.int32) if step is None else step
    return jax.device_put(TrainState(params, tx.init(params), step), shardings)

  def _param_shapes(self):
    """FP32 master params as ShapeDtypeStructs."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), llama.param_shapes(self.cfg),
                        is_leaf=lambda x: isinstance(x, tuple))

  def _build_steps(self):
    kw = dict(tx=self.tx, cfg=self.cfg, lcfg=self.lcfg, recipe=self.train_recipe, gc=self.gc)
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self._state_sh = self._state_shardings(self.tx)
    self._grpo_step = fp8jax.jit(functools.partial(train_step, loss_fn=grpo_loss, microbatch=self.gc.microbatch,
                                                   temperature=self.sp.temperature, **kw), donate_argnums=(0,),
                                 out_shardings=(self._state_sh, rep))
    ws = self.c.warmstart
    # Plain Adam (optax.adam's b2 0.999, no decay, clip 1.0) at warmstart.lr, through the one optimizer builder
    sft_oc = OptimConfig(lr=float(ws.lr), b2=0.999, weight_decay=0.0, grad_clip=1.0)
    self._sft_tx = make_optimizer(sft_oc, int(ws.steps))[0] if ws.steps else None
    if self._sft_tx is not None:
      self._sft_state_sh = self._state_shardings(self._sft_tx)
      self._sft_step = fp8jax.jit(functools.partial(
          train_step, loss_fn=sft_loss, microbatch=ws.batch, **dict(kw, tx=self._sft_tx)), donate_argnums=(0,),
          out_shardings=(self._sft_state_sh, rep))
    self._logprobs = fp8jax.jit(functools.partial(sequence_logprobs, cfg=self.cfg, lcfg=self.lcfg,
                                                  recipe=self.train_recipe, temperature=self.sp.temperature))
    # The sampler's weights, requantized from the master params before every rollout (the "refit").
    self._prepare = fp8jax.jit(functools.partial(sampler_lib.prepare_params, recipe=self.sample_recipe))
    # The frozen KL reference is scored by the trainer, so it takes the trainer's form of the weights.
    self._prepare_ref = self._prepare if self.train_recipe == self.sample_recipe else fp8jax.jit(
        functools.partial(sampler_lib.prepare_params, recipe=self.train_recipe))

  def _ref_abstract(self):
    """ShapeDtypeStructs (with the mesh's shardings) of the KL reference: ``prepare_params`` of the master params."""
    shapes = jax.eval_shape(self._prepare_ref, self._param_shapes())
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        sharding.tree_shardings(shapes, self.mesh))

  def take_reference(self):
    """Freezes the current policy as the KL reference (grpo.kl_beta > 0): run() does so when RL starts."""
    sh = jax.tree.map(lambda x: x.sharding, self._ref_abstract())
    self.ref_params = jax.device_put(self._prepare_ref(self.state.params), sh)

  def _init_state(self) -> TrainState:
    if self.c.checkpoint.hf_dir:
      from fp8jax import hf  # noqa: PLC0415

      shapes = self._param_shapes()
      params = hf.load_params(self.c.checkpoint.hf_dir, self.cfg, shardings=sharding.tree_shardings(shapes, self.mesh),
                              pow2_scales=self.recipe.pow2_scales)  # block-FP8 checkpoints: the same codes again
      self.warm_done = True
    else:
      params = llama.init_params(self.cfg, seed=int(self.c.seed))
      params = jax.device_put(params, sharding.tree_shardings(params, self.mesh))
    return self._fresh_state(params, self.tx, self._state_sh)

  def load_pretrained(self, params):
    """Starts from given master params (e.g. fp8jax.hf.load_params); resets the optimizer."""
    params = jax.device_put(params, sharding.tree_shardings(params, self.mesh))
    self.state = self._fresh_state(params, self.tx, self._state_sh)
    self.warm_done = True

  # -- pieces -------------------------------------------------------------------------------------------------------

  def warmstart(self):
    """Supervised warm-start on the embedded task (tiny configs): teaches the answer format before GRPO."""
    ws = self.c.warmstart
    if not ws.steps or self.warm_done:
      return {}
    state = self._fresh_state(self.state.params, self._sft_tx, self._sft_state_sh)
    t0 = time.perf_counter()
    for i in range(ws.steps):
      sb = self.task.supervised_examples(ws.batch, step=i, seq_len=self.scfg.max_len)
      batch = {"tokens": sb.tokens_NxL, "mask": sb.loss_mask_NxL[:, 1:]}
      state, m = self._sft_step(state, sharding.shard_batch(batch, self.mesh))
    nll = float(m["nll"])
    if not (math.isfinite(nll) and bool(m["params_finite_"])):  # NaN weights stay NaN: the last step shows it
      raise NonFiniteLoss(f"warm start diverged by its step {ws.steps}: nll {nll}, updated weights finite: "
                          f"{bool(m['params_finite_'])} (lower warmstart.lr={ws.lr}); nothing was saved")
    self.state = self._fresh_state(state.params, self.tx, self._state_sh, step=self.state.step)
    self.warm_done = True
    self.kv_scales = None  # recalibrate FP8 KV scales for the warm-started weights
    return {"warmstart_nll": float(m["nll"]), "warmstart_s": time.perf_counter() - t0}

  def validate(self) -> dict:
    """Greedy accuracy on the held-out prompts, sampled through the rollout path (FP8 weights and KV cache)."""
    prompts, answers = self.task.validation(int(self.c.train.val_prompts))
    sp = dataclasses.replace(self.sp, greedy=True)
    ro = self.sampler.generate(self._prepare(self.state.params), prompts, sp, n=1, kv_scales=self._kv_scales())
    rewards = self.task.score(ro, answers)
    return {"val_accuracy": float(np.mean(rewards)), "val_len": float(np.mean(ro.lengths))}

  def _kv_scales(self):
    """The sampler's FP8 KV scales (None with a BF16 cache)."""
    if self.sample_recipe.kv_cache != "fp8":
      return None
    if self.kv_scales is None:  # before the first training step: calibrate on prompts with a BF16 cache prefill
      prompts, _ = self.task.train_prompts(self.gc.num_prompts, step=0)
      self._set_kv_scales(self.sampler.calibrate_kv_scales(self._prepare(self.state.params), prompts,
                                                           float(self.c.rollout.kv_scale_margin)))
    return self.kv_scales

  def _set_kv_scales(self, scales):
    # Replicated on the mesh whatever produced them, so the jitted steps see one sharding (no recompiles).
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self.kv_scales = tuple(jax.device_put(jnp.asarray(s, jnp.float32), rep) for s in scales)

  def _recalibrate_kv_scales(self, train_metrics):
    """The next rollout's FP8 KV scales from a train step's training-forward K/V amax (FP8 KV cache only)."""
    if self.sample_recipe.kv_cache == "fp8":
      margin = float(self.c.rollout.kv_scale_margin)
      self._set_kv_scales((kvcache.scales_from_amax(train_metrics["k_amax_L"], margin),
                           kvcache.scales_from_amax(train_metrics["v_amax_L"], margin)))

  def _rollout(self, step: int, timing: dict):
    """Generates groups; with dynamic sampling, drops zero-variance groups and refills (bounded)."""
    gc = self.gc
    keep_ro, keep_rw = [], []
    t = time.perf_counter()
    sparams = self._prepare(self.state.params)
    jax.block_until_ready(sparams)
    timing["requant_s"] = time.perf_counter() - t
    timing["rollout_s"] = timing["reward_s"] = 0.0
    stats = {}
    n_groups = 0
    for attempt in range(1 + (gc.max_refills if gc.dynamic_sampling else 0)):
      # The data position is the count of batches drawn (checkpointed), so refills never skip or repeat prompts.
      prompts, answers = self.task.train_prompts(gc.num_prompts, step=self.prompt_batch)
      self.prompt_batch += 1
      t = time.perf_counter()
      sp = dataclasses.replace(self.sp, seed=int(self.c.seed) * 100003 + step * 17 + attempt
                               + self.rollout_seed * 1000003)
      ro = self.sampler.generate(sparams, prompts, sp, n=gc.num_generations, kv_scales=self._kv_scales())
      timing["rollout_s"] += time.perf_counter() - t
      stats = {k: stats.get(k, 0) + v for k, v in ro.stats.items()}
      t = time.perf_counter()
      rewards = self.task.score(ro, [answers[i] for i in ro.prompt_idx]).reshape(gc.num_prompts, gc.num_generations)
      timing["reward_s"] += time.perf_counter() - t
      keep = np.asarray(grpo.dynamic_sampling_keep(rewards)) if gc.dynamic_sampling else np.ones(gc.num_prompts, bool)
      keep_ro.append((ro, keep))
      keep_rw.append(rewards)
      n_groups += int(keep.sum())
      if n_groups >= gc.num_prompts:
        break
    return keep_ro, keep_rw, stats

  def _build_batch(self, parts, rewards_list):
    """The train batch: the first num_prompts kept groups; masked-out groups pad it if dynamic sampling fell short.

    Reward metrics cover every generated group (also those dynamic sampling dropped), the rest the kept ones.
    """
    gc, g = self.gc, self.gc.num_generations
    groups = []  # (tokens, mask, old_logp, adv, lengths, finish) per kept group
    for (ro, keep), rewards in zip(parts, rewards_list):
      s, m, o = ro.sequences(pad_id=self.task.pad_id)
      adv, _ = grpo.group_advantages(jnp.asarray(rewards), normalize_std=gc.normalize_std,
                                     leave_one_out=gc.leave_one_out)
      adv = np.asarray(adv, np.float32)
      for pi in np.flatnonzero(keep):
        r = slice(pi * g, (pi + 1) * g)
        groups.append((s[r], m[r], o[r], adv[pi], ro.lengths[r], ro.finish_reason[r]))
    groups = groups[:gc.num_prompts]
    n_real = len(groups)
    if n_real < gc.num_prompts:  # zero mask: no gradient, no metrics
      s0, m0 = parts[0][0].sequences(pad_id=self.task.pad_id)[:2]
      pad = (np.zeros_like(s0[:g]), np.zeros_like(m0[:g]), np.zeros_like(m0[:g]), np.zeros(g, np.float32),
             np.zeros(g, np.int32), np.zeros(g, np.int32))
      groups += [pad] * (gc.num_prompts - n_real)
    tokens, mask, old, adv, lens, fin = (np.concatenate(x) for x in zip(*groups))
    if gc.overlong_filter:
      mask = mask * np.asarray(grpo.overlong_mask(fin == sampler_lib.FINISH_LENGTH))[:, None]
    rw = np.concatenate([np.ravel(r) for r in rewards_list])
    real = slice(0, n_real * g)
    info = {"reward_mean": float(rw.mean()), "reward_std": float(rw.std()), "groups_kept": float(n_real)}
    if n_real:
      info.update(gen_len_mean=float(lens[real].mean()), gen_len_max=float(lens[real].max()),
                  truncated_frac=float(np.mean(fin[real] == sampler_lib.FINISH_LENGTH)))
    return {"tokens": tokens, "mask": mask, "old_logp": old, "adv": adv}, info

  def step(self, step: int) -> dict:
    """One RL step; returns host metrics."""
    timing: dict[str, float] = {}
    t_step = time.perf_counter()
    parts, rewards, rstats = self._rollout(step, timing)
    batch, info = self._build_batch(parts, rewards)
    # The trainer fake-quantizes K/V like the rollout cache only when its own recipe has the FP8 KV cache (not in
    # "fp8_rollout": there the BF16 trainer attends over unquantized K/V, as a two-engine setup does).
    kv = self._kv_scales() if self.train_recipe.kv_cache == "fp8" else None
    metrics: dict[str, Any] = dict(info)
    t = time.perf_counter()
    tokens_j = jnp.asarray(batch["tokens"])
    # Mismatch metrics: trainer log-probs of a sample of sequences (all of them when recomputing old log-probs).
    n_check = self.gc.batch if self.gc.recompute_old_logp else min(self.gc.mismatch_sample, self.gc.batch)
    if n_check:
      tr_lp, _, _ = self._logprobs(self.state.params, tokens_j[:n_check], kv_scales=kv)
      mm = grpo.mismatch_metrics(jnp.asarray(batch["old_logp"][:n_check]), tr_lp, jnp.asarray(batch["mask"][:n_check]))
      metrics.update(mm)
      if self.gc.recompute_old_logp:
        gen_lp = batch["old_logp"]
        batch["old_logp"] = np.asarray(tr_lp)
        if self.gc.is_kind != "none":
          w, wm = grpo.importance_weights(tr_lp, jnp.asarray(gen_lp), jnp.asarray(batch["mask"]), kind=self.gc.is_kind,
                                          lo=self.gc.is_lo, hi=self.gc.is_hi)
          batch["is_weights"] = np.asarray(w)
          metrics.update({f"is_{k}": v for k, v in wm.items()})
    elif self.gc.is_kind != "none":
      raise ValueError("grpo.is_kind needs grpo.recompute_old_logp=True (the trainer's old log-probs)")
    if self.gc.kl_beta:  # the reference forward runs only with a KL penalty
      if self.ref_params is None:  # run() takes it when RL starts; direct step() callers get it here
        self.take_reference()
      ref_lp, _, _ = self._logprobs(self.ref_params, tokens_j, kv_scales=kv)
      batch["ref_logp"] = np.asarray(ref_lp)
    timing["logprob_s"] = time.perf_counter() - t

    t = time.perf_counter()
    n_mb = self.gc.minibatches
    size = self.gc.batch // n_mb
    for i in range(n_mb):
      mb = {k: v[i * size:(i + 1) * size] for k, v in batch.items()}
      mb = sharding.shard_batch(mb, self.mesh)
      if kv is not None:
        mb["kv_scales"] = kv
      lr = float(self.lr_sched(int(self.state.step)))
      self.state, tm = self._grpo_step(self.state, mb)
      self._check_update(step, i, tm, lr, batch["adv"][i * size:(i + 1) * size], batch["mask"][i * size:(i + 1) * size])
    tm = {k: v for k, v in tm.items() if k != "params_finite_"}
    timing["train_s"] = time.perf_counter() - t
    t = time.perf_counter()
    self._recalibrate_kv_scales(tm)
    timing["kv_recalib_s"] = time.perf_counter() - t
    metrics.update({k: v for k, v in tm.items() if not k.endswith("_L")})
    metrics["lr"] = lr
    metrics["gen_tokens_per_s"] = rstats.get("generated_tokens", 0) / max(timing["rollout_s"], 1e-9)
    metrics["mean_occupancy"] = rstats.get("mean_occupancy", 0.0) / max(len(parts), 1)
    metrics["step_s"] = time.perf_counter() - t_step
    metrics.update(timing)
    return metrics

  def _last_checkpoint_text(self) -> str:
    last = self.ckpt.latest_step()
    if last is None:
      return f"no checkpoint has been written to {self.ckpt.directory} yet"
    return f"the latest checkpoint, step {last} in {self.ckpt.directory}, is from before it (resume from it)"

  def _check_update(self, step: int, minibatch: int, tm: dict, lr: float, adv_B, mask_BxT):
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
    n_adv = int(np.sum(np.any((np.asarray(adv_B)[:, None] != 0) & (np.asarray(mask_BxT) > 0), axis=-1)))
    if gnorm == 0.0 and n_adv:
      pmax = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(self.state.params))
      ent = float(tm.get("entropy", float("nan")))
      raise PolicyCollapsed(
          f"policy collapsed at {where}: the gradient is exactly 0 although {n_adv} sequences have nonzero "
          f"advantages (entropy {ent:.4g}, log(vocab) = {math.log(self.cfg.vocab_size):.4g}; max |weight| "
          f"{pmax:.3g}): the weights have likely overflowed (optim.lr={lr:g}); {self._last_checkpoint_text()}")

  # -- run ----------------------------------------------------------------------------------------------------------

  # Model config keys that change parameter shapes (a checkpoint made with other values cannot be restored).
  SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tie_embeddings",
                "qk_norm")

  def _meta(self, step: int) -> dict:
    meta = {"step": step, "seed": int(self.c.seed), "warm_done": self.warm_done, "prompt_batch": self.prompt_batch,
            "kv_scales": None if self.kv_scales is None else [np.asarray(s).tolist() for s in self.kv_scales],
            "model": json.loads(json.dumps(dataclasses.asdict(self.cfg))), "kl_reference": self.ref_params is not None}
    meta.update(self.task.state())
    return meta

  def save(self, step: int):
    ref = self.ref_params if self.gc.kl_beta else None
    self.ckpt.save(step, self.state, self._meta(step), ref=ref)

  def _check_checkpoint_config(self, step: int, meta: dict):
    """Raises, naming each differing key, when the checkpoint was made with another model shape."""
    where = self.ckpt.step_dir(step)
    saved = meta.get("model")
    if saved is None:
      log.warning("%s has no model config (written by an older fp8jax): not compared with this config's", where)
      return
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
    meta = self.ckpt.read_meta(step)
    self._check_checkpoint_config(step, meta)
    if not self.gc.kl_beta:
      return self.ckpt.restore(step, self.state) + ({},)
    if not meta.get("kl_reference") or not os.path.isdir(os.path.join(self.ckpt.step_dir(step), "ref")):
      raise CheckpointMismatch(
          f"{self.ckpt.step_dir(step)} holds no KL reference policy (saved with grpo.kl_beta=0, before RL started, "
          f"or by an older fp8jax), so grpo.kl_beta={self.gc.kl_beta} cannot resume it with the reference it "
          f"started from. Resume with grpo.kl_beta=0, or start a new run in another --workdir")
    return self.ckpt.restore(step, self.state, ref=self._ref_abstract())

  def restore(self) -> int:
    """Restores the newest readable checkpoint if any; returns the next RL step to run.

    A corrupt newest checkpoint is set aside with a warning and the previous one used (fp8jax.checkpoint); a
    checkpoint of another model shape, or without the KL reference a run with grpo.kl_beta > 0 needs, raises.
    """
    found = self.ckpt.restore_latest(self._restore_step)
    if found is None:
      return 0
    last, (self.state, meta, extra) = found
    self.ref_params = extra.get("ref")
    self.warm_done = meta["warm_done"]
    self.kv_scales = None
    if meta["kv_scales"] is not None:
      self._set_kv_scales(meta["kv_scales"])
    if "prompt_batch" in meta:
      self.prompt_batch = int(meta["prompt_batch"])
    else:  # written before the position was checkpointed: batch k was drawn for step k // (refills + 1)
      self.prompt_batch = last * (self.gc.max_refills + 1)
      log.warning("%s has no prompt_batch (older fp8jax): continuing at prompt batch %d", self.ckpt.step_dir(last),
                  self.prompt_batch)
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

  def run(self, steps: int | None = None, *, progress: bool = True) -> list[dict]:
    """Runs (or resumes) the loop up to ``steps`` RL steps, holding the run directory's lock throughout."""
    steps = self.total_steps if steps is None else int(steps)
    if steps < 0:
      raise ValueError(f"steps={steps} (--steps / train.steps) must be >= 0")
    if not distributed.is_primary():  # process 0 holds the lock for the whole multi-process run
      return self._run(steps, False)
    with WorkdirLock(self.workdir):
      return self._run(steps, progress)

  def _run(self, steps: int, progress: bool) -> list[dict]:
    if self.c.checkpoint.resume:
      start = self.restore()
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
      if start == 0:
        ws = self.warmstart()
        row = writer.write(0, {**ws, **self.validate(), "ckpt_s": 0.0})
        history.append(row)
      if self.gc.kl_beta and self.ref_params is None:
        self.take_reference()  # the policy RL starts from (after the warm start), checkpointed with every save
      for step in range(start, steps):
        m = self.step(step)
        if (step + 1) % self.c.train.val_every == 0 or step + 1 == steps:
          m.update(self.validate())
        t = time.perf_counter()
        if (step + 1) % self.c.checkpoint.every == 0 or step + 1 == steps:
          self.save(step + 1)
        m["ckpt_s"] = time.perf_counter() - t
        history.append(writer.write(step + 1, m))
    finally:
      writer.close()
    if distributed.is_primary():
      plot(self.workdir)
    return history


# ------------------------------------------------------------------------------------------------------------------
# Tasks: the data sources the loop can run on (the interface and its rules: fp8jax.rl.source.PromptSource)
# ------------------------------------------------------------------------------------------------------------------


class _ArithmeticSource:
  """Adapter: the embedded arithmetic task (tokenized prompts, exact-match reward) as a ``source.PromptSource``.

  Batch ``step`` is ``ArithmeticTask.sample(n, step=step)``: a stream keyed by (seed, step), pure in ``step``.
  """

  def __init__(self, config):
    from fp8jax.rl import tasks  # noqa: PLC0415

    a = config.arithmetic
    self.task = tasks.ArithmeticTask(seed=int(config.seed), difficulty=a.difficulty, num_val=a.num_val)
    self.tok = self.task.tokenizer
    self.pad_id = self.tok.pad_id
    self.eos_id = self.tok.eos_id
    self.eos_ids = (self.tok.eos_id,)

  def _encode(self, prompts):
    return [self.tok.encode(p, add_bos=True) for p in prompts]

  def train_prompts(self, n, step):
    prompts, answers = self.task.sample(n, step=step)
    return self._encode(prompts), answers

  def validation(self, n):
    prompts, answers = self.task.validation()
    return self._encode(prompts[:n]), answers[:n]

  def supervised_examples(self, n, step, seq_len):
    return self.task.supervised_examples(n, step=step, seq_len=seq_len)

  def _decode(self, ids):
    # The model's vocabulary is padded to a multiple of 128; ids the tokenizer lacks decode as '?' (reward 0).
    v = self.tok.vocab_size
    return "".join(self.tok.decode([i]) if i < v else "?" for i in ids)

  def score(self, ro, answers):
    texts = [self._decode(ro.tokens[i, :ro.lengths[i]]) for i in range(len(answers))]
    return np.array([self.task.reward(t, a) for t, a in zip(texts, answers)], np.float32)

  def state(self):
    return {"task": self.task.state()}

  def load_state(self, meta):
    self.task.load_state(meta["task"])


def _make_task(config, cfg: ModelConfig) -> PromptSource:
  if config.task == "arithmetic":
    src = _ArithmeticSource(config)
    if src.tok.vocab_size > cfg.vocab_size:
      raise ValueError(f"model.vocab_size={cfg.vocab_size} < the arithmetic tokenizer's {src.tok.vocab_size}")
  elif config.task == "math":
    from fp8jax.rl.math_source import MathSource  # noqa: PLC0415

    src = MathSource(config)
  else:
    raise ValueError(f"task={config.task!r} is not 'arithmetic' or 'math'")
  assert isinstance(src, PromptSource), type(src)
  return src
