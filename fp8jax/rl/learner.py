"""The learner: the policy's training state and the pure, jitted steps that change it.

``TrainState`` is everything a resumed run needs to continue exactly, as one pytree (one orbax item):

  params        FP32 master weights
  opt_state     the optimizer's state
  step          optimizer steps taken
  kv_scales     (k_scale_L, v_scale_L): the FP8 KV-cache scales of the next rollout (FP8 KV cache only, else None)
  ref_params    the frozen KL reference policy, in the trainer's form of the weights (grpo.kl_beta > 0, else None)
  prompt_batch  prompt batches drawn so far: the task's data position (``fp8jax.rl.source``, rule 1)
  base          LoRA only (``fp8jax.lora``): the frozen base, which ``params`` (then the FP32 adapters) attach to;
                not saved (re-made from the config, checked by checksum on resume)

``kv_scales`` and ``ref_params`` are None until RL starts (``Learner.start_rl``: calibrated on prompt batch 0 /
frozen from the policy RL starts from). Derived, not stored: the sampler's weights (``RolloutWorker.refit`` of
``params``), the learning rate (the optimizer's schedule at ``step``), every random key (from the config's seeds and
the RL step: ``RolloutWorker.sampling_seed``), the warm start's being done (a checkpoint is always written after it).

The steps are pure and jitted once, with the state's shardings pinned (``state_shardings``) and the state donated:
``train_step`` (one optimizer step of a registered loss over a minibatch, gradient accumulation over microbatches;
it also recalibrates ``kv_scales`` from the training forward's K/V amax), ``logprobs`` (the trainer's log-probs of
a policy), and the reference freeze. ``update`` runs a rollout batch's minibatches and leaves the metrics on the
device: nothing here waits for the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax import kvcache, ops, optim, recipes, sharding
from fp8jax import lora as lora_lib
from fp8jax import sampler as sampler_lib
from fp8jax.model import llama, moe, schema
from fp8jax.model.config import ModelConfig
from fp8jax.rl import grpo


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
  loss: str = "grpo"  # a key of LOSSES: the policy loss of the RL steps

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
    if self.is_kind != "none" and not self.recompute_old_logp:
      raise ValueError(f"grpo.is_kind={self.is_kind!r} needs grpo.recompute_old_logp=True (the weights are the "
                       f"trainer's old log-probs over the sampler's)")
    if self.agg not in grpo.AGG_KINDS:
      raise ValueError(f"grpo.agg={self.agg!r} is not one of {grpo.AGG_KINDS}")
    if self.loss not in RL_LOSSES:
      raise ValueError(f"grpo.loss={self.loss!r} is not one of {RL_LOSSES}")
    if not self.router_aux_coef >= 0:
      raise ValueError(f"grpo.router_aux_coef={self.router_aux_coef} must be >= 0")


SCHEDULES = ("constant", "warmup_constant", "cosine")


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
  # Adam's moments: "float32" (optax.adamw) or "bfloat16" (stored rounded, FP32 math: fp8jax.optim); the master
  # weights stay FP32 either way.
  state_dtype: str = "float32"
  # Where the FP32 master and the optimizer state live between train steps: "none" (the device) or "pinned_host"
  # (host memory, moved to the device inside the train step: fp8jax.optim).
  offload: str = "none"

  def __post_init__(self):
    def need(ok, key, why):
      if not ok:
        raise ValueError(f"optim.{key}={getattr(self, key)!r} {why}")

    finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)  # noqa: E731
    need(finite(self.lr) and self.lr >= 0, "lr", "must be a finite number >= 0 (a negative rate ascends the loss)")
    need(self.schedule in SCHEDULES, "schedule", f"is not one of {SCHEDULES}")
    need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
    need(finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
    need(finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0")
    for key in ("b1", "b2"):
      need(finite(getattr(self, key)) and 0 <= getattr(self, key) < 1, key, "must be in [0, 1) (Adam's decay rate)")
    need(finite(self.eps) and self.eps > 0, "eps", "must be > 0 (it keeps Adam's division finite)")
    need(finite(self.grad_clip) and self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 turns clipping off)")
    if self.state_dtype not in optim.STATE_DTYPES:
      raise ValueError(f"optim.state_dtype={self.state_dtype!r} is not one of {optim.STATE_DTYPES}")
    if self.offload not in optim.OFFLOADS:
      raise ValueError(f"optim.offload={self.offload!r} is not one of {optim.OFFLOADS}")


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
    raise ValueError(f"optim.schedule={oc.schedule!r} is not one of {SCHEDULES}")
  if oc.state_dtype == "float32":
    adam = optax.adamw(sched, b1=oc.b1, b2=oc.b2, eps=oc.eps, weight_decay=oc.weight_decay, mask=decay_mask)
  else:  # the same chain with the moments stored narrower (fp8jax.optim: the rounding)
    adam = optim.adamw_stored(sched, b1=oc.b1, b2=oc.b2, eps=oc.eps, weight_decay=oc.weight_decay, mask=decay_mask,
                              state_dtype=oc.state_dtype)
  tx = optax.chain(optax.clip_by_global_norm(oc.grad_clip) if oc.grad_clip > 0 else optax.identity(), adam)
  return tx, sched


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything a resume needs (module docstring); a pytree, saved whole."""
  params: Any  # FP32 master weights
  opt_state: Any
  step: jax.Array  # () int32 optimizer steps
  kv_scales: tuple[jax.Array, jax.Array] | None = None  # FP8 KV scales of the next rollout, (L,) each
  ref_params: Any = None  # the frozen KL reference policy (trainer-form weights)
  prompt_batch: jax.Array | None = None  # () int32 prompt batches drawn (the data position)
  # LoRA (lora.rank > 0): the frozen base in the recipe's form (QWeights, BF16 rest), which ``params`` (then the
  # adapters alone) attach to. Never saved: it is re-made from the config and named by its checksum in the
  # checkpoint's metadata (RLTrainer._meta). Passed through the donated train step unchanged (aliased, not copied).
  base: Any = None


# ------------------------------------------------------------------------------------------------------------------
# The trainer's view of a policy, and the registered losses
# ------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Policy:
  """How the trainer reads a policy: the model, its linear layers' config, the trainer's recipe, the temperature."""
  cfg: ModelConfig
  lcfg: ops.LinearConfig
  recipe: recipes.Recipe
  temperature: float = 1.0
  lora: lora_lib.LoRAConfig | None = None  # LoRA runs: the adapters' rank, alpha and targets

  def weights(self, params, base=None):
    """The model's weights of trained ``params``: themselves, or (LoRA, ``base`` the frozen base) the base with the
    adapters ``params`` attached (``fp8jax.lora.attach``: no copy)."""
    return params if base is None else lora_lib.attach(base, params, self.lora)

  def logprobs(self, params, tokens_BxL, kv_scales=None, router_mask_BxL=None):
    """Log-probs (B, L-1) of each next token, entropy, ForwardAux: ``llama.next_token_logprobs`` with the FP8 layers
    of ``recipe`` quantized on the fly (``params`` master weights), or already quantized (QWeights, the frozen
    reference: ``mark_fp8`` keeps them). The one place the trainer turns weights into log-probs (the losses, the
    mismatch and reference passes, ``fp8jax.diagnostics.one_engine``)."""
    return llama.next_token_logprobs(recipes.mark_fp8(params, self.recipe), tokens_BxL, self.cfg, self.lcfg,
                                     temperature=self.temperature, kv_scales=kv_scales, router_mask_BxT=router_mask_BxL)


def _trained_positions(mask_BxT):
  """(B, L) mask of the positions whose next-token prediction is in the loss (``mask`` is (B, L-1))."""
  return jnp.pad(mask_BxT, ((0, 0), (0, 1)))


@dataclasses.dataclass(frozen=True)
class Loss:
  """A registered loss and how its metrics, computed per microbatch, combine into the minibatch's (``train_step``).

  ``fn``: (policy, params, microbatch, gc, n_tok, n_seq) -> (loss, (metrics, ForwardAux)); summed over the
  microbatches of a minibatch it is the minibatch's loss (n_tok / n_seq: the whole minibatch's token and sequence
  counts). Metrics in ``sums`` (shares of the loss, already divided by the minibatch's counts; counts) add up,
  ``mins`` / ``maxs`` take the extreme over the microbatches that have tokens; every other metric is a masked mean
  over its microbatch's tokens (grpo.policy_loss) and is combined weighted by the microbatch's ``num_tokens``.
  """
  fn: Callable
  sums: frozenset = frozenset()
  mins: frozenset = frozenset()
  maxs: frozenset = frozenset()

  def combine(self, ms: dict) -> dict:
    """The minibatch's metrics from each microbatch's (``ms``: name -> (n_micro,) array)."""
    n = ms.get("num_tokens")
    out = {}
    for k, v in ms.items():
      if k in self.sums:
        out[k] = jnp.sum(v)
        continue
      if n is None:
        raise ValueError(f"loss metric {k!r} is neither in the loss's sums, mins nor maxs, and the loss reports no "
                         f"num_tokens to weight its microbatches by")
      has = n > 0
      if k in self.mins or k in self.maxs:
        pick, fill = (jnp.min, jnp.inf) if k in self.mins else (jnp.max, -jnp.inf)
        out[k] = jnp.where(jnp.any(has), pick(jnp.where(has, v, fill)), v[0])  # all empty: the empty value
      elif v.shape[0] == 1:  # one microbatch: its metric is the minibatch's, bit for bit
        out[k] = v[0]
      else:  # sum(v n) / sum(n): a mean of exactly 1 (on-policy ratios) stays exactly 1
        out[k] = jnp.sum(v * n) / jnp.maximum(jnp.sum(n), 1)
    return out


# The registered losses. A new algorithm is a new entry (``grpo.loss`` picks the RL one), not a branch in the step.
LOSSES: dict[str, Loss] = {}


def register_loss(name: str, **combine):
  """Registers ``fn`` as ``LOSSES[name]``; ``combine``: the ``Loss`` fields sums / mins / maxs (metric names)."""
  def add(fn):
    LOSSES[name] = Loss(fn, **{k: frozenset(v) for k, v in combine.items()})
    return fn
  return add


@register_loss("grpo", sums=("loss", "pg_loss", "kl_loss", "num_tokens", "num_seqs"), mins=("ratio_min",),
               maxs=("ratio_max",))
def grpo_loss(policy: Policy, params, mb, gc: GRPOConfig, n_tok, n_seq):
  """The clipped policy-gradient loss (grpo.policy_loss) of one microbatch.

  With ``grpo.router_aux_coef > 0`` (MoE models) the microbatch adds ``coef * lb * tokens_mb / n_tok``, where ``lb``
  is the load-balancing loss over its trained tokens: summed over microbatches, a token-weighted mean of lb.
  """
  logp, ent, aux = policy.logprobs(params, mb["tokens"], mb.get("kv_scales"), _trained_positions(mb["mask"]))
  loss, m = grpo.policy_loss(
      logp, mb["old_logp"], mb["adv"], mb["mask"], eps_low=gc.eps_low, eps_high=gc.eps_high,
      dual_clip=gc.dual_clip or None, agg=gc.agg, is_weights_BxT=mb.get("is_weights"),
      ref_logp_BxT=mb.get("ref_logp"), kl_beta=gc.kl_beta, global_token_count=n_tok, global_seq_count=n_seq,
      entropy_BxT=ent)
  if aux.router:
    lb = moe.load_balancing_loss(list(aux.router), policy.cfg.n_experts)
    m = dict(m, router_lb_loss=lb)
    if gc.router_aux_coef:
      loss = loss + gc.router_aux_coef * lb * jnp.sum(mb["mask"]) / n_tok
  return loss, (m, aux)


@register_loss("sft", sums=("nll", "entropy"))
def sft_loss(policy: Policy, params, mb, gc, n_tok, n_seq):
  """Cross-entropy on masked target tokens (the tiny task's supervised warm-start), same FP8 forward."""
  del gc, n_seq
  logp, ent, aux = policy.logprobs(params, mb["tokens"], mb.get("kv_scales"))
  loss = -jnp.sum(logp * mb["mask"]) / n_tok
  return loss, ({"nll": loss, "entropy": jnp.sum(ent * mb["mask"]) / n_tok}, aux)


RL_LOSSES = ("grpo",)  # the LOSSES an RL step may use (sft needs no rollouts: the warm start's)


def train_step(state: TrainState, batch: dict, *, loss: Loss, policy: Policy, tx, gc, microbatch, kv_margin=None):
  """One optimizer step over ``batch`` with gradient accumulation over microbatches (lax.scan).

  ``batch``: tokens, mask and what ``loss.fn`` reads, plus ``kv_scales`` when the trainer fake-quantizes K/V as the
  rollout's FP8 cache did (the scales that rollout used). Returns the new state, whose ``kv_scales`` (when the state
  carries them) are the next rollout's: ``margin * amax / 448`` of the K/V this step's forward produced (max over
  microbatches); and the minibatch's metrics (``loss.combine`` of the microbatches'; ``loss``: the summed loss).
  """
  b = batch["tokens"].shape[0]
  mb = min(microbatch, b)
  n_micro = b // mb
  n_tok = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
  n_seq = jnp.maximum(jnp.sum(jnp.any(batch["mask"] > 0, axis=-1)), 1.0)
  kv_scales = batch.pop("kv_scales", None)
  micro = jax.tree.map(lambda x: x.reshape(n_micro, mb, *x.shape[1:]), batch)
  # LoRA: the gradient is of the adapters alone (``state.params``); the frozen base is a constant of the loss, so no
  # weight gradient of it is ever formed (its FP8 linears run ops' frozen-weight VJP: dgrad only).
  grad_fn = jax.value_and_grad(lambda p, base, *a: loss.fn(policy, policy.weights(p, base), *a), has_aux=True)
  # With optim.offload the master and the moments come from host memory: the master to the device for the whole
  # step, the moments for the update only (fp8jax.optim; where they already are, this compiles to nothing).
  state = dataclasses.replace(state, params=optim.to_device(state.params))

  def body(acc, mbatch):
    # The microbatch enters behind a barrier with the gradients accumulated so far, so that its forward pass cannot
    # be scheduled before the previous microbatch's backward pass has ended (where XLA unrolls or pipelines this
    # loop). Values are unchanged (the barrier is the identity). On an H100, with model.remat's recomputation also
    # held behind its cotangent (fp8jax.model.remat), the 8B LoRA train step over 32 microbatches of one
    # 4096-token sequence compiled to 0.84 GiB of temporaries per layer instead of 1.10; at one microbatch the
    # per-layer growth is 0 either way (docs/performance.md, memory). A LoRA run's frozen base goes through the same
    # barrier: it is invariant over this loop, and XLA moves loop-invariant work out of loops, so it had made every
    # layer's copies of the base (dequantized; transposed for the dgrad) once before the loop and held all of them
    # through the step (XLA:CPU: two FP32 copies of the whole base). Behind the barrier they are made per layer in
    # the loop. (A full fine-tune's quantized weights are still made once per step, as XLA hoists them: FP8 codes
    # of every layer held for the step instead of a quantization per microbatch.)
    mbatch, acc, base = jax.lax.optimization_barrier((mbatch, acc, state.base))
    if kv_scales is not None:
      mbatch = dict(mbatch, kv_scales=kv_scales)
    (loss, (m, aux)), g = grad_fn(state.params, base, mbatch, gc, n_tok, n_seq)
    gsum, lsum = acc
    return (jax.tree.map(jnp.add, gsum, g), lsum + loss), (m, aux.k_amax_L, aux.v_amax_L)

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  (grads, loss_sum), (ms, k_amax, v_amax) = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
  updates, opt_state = tx.update(grads, optim.to_device(state.opt_state), state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = loss.combine(ms)
  metrics.update(loss=loss_sum, grad_norm=optax.tree.norm(grads))  # the loss the gradient is of, summed in order
  # Checked on the host before anything is saved: a finite loss can still give non-finite updated weights.
  metrics["params_finite_"] = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))
  new_kv = state.kv_scales
  if new_kv is not None:
    new_kv = (kvcache.scales_from_amax(jnp.max(k_amax, 0), kv_margin),
              kvcache.scales_from_amax(jnp.max(v_amax, 0), kv_margin))
  return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1, kv_scales=new_kv), metrics


# ------------------------------------------------------------------------------------------------------------------
# The learner
# ------------------------------------------------------------------------------------------------------------------


class Learner:
  """The jitted steps of one run's policy and their shardings (the state itself is the loop's: ``TrainState``).

  ``kv_state``: whether the RL state carries FP8 KV scales (the sampler's cache is FP8); ``temperature``: the
  rollouts' (the trainer's log-probs are those of the same distribution); ``warmstart``: (steps, batch, lr) of the
  supervised warm start, or steps 0. ``lora``: a LoRA run's config (rank > 0): the state's params are then the
  adapters, its ``base`` the frozen base (``init_state``), the optimizer the adapters' and the KL reference the base.
  """

  def __init__(self, *, cfg: ModelConfig, lcfg: ops.LinearConfig, recipe: recipes.Recipe, gc: GRPOConfig,
               oc: OptimConfig, mesh, total_steps: int, temperature: float, kv_state: bool, kv_margin: float,
               warmstart=(0, 1, 0.0), lora: lora_lib.LoRAConfig | None = None):
    self.cfg, self.gc, self.oc, self.mesh, self.kv_state = cfg, gc, oc, mesh, kv_state
    self.lora = lora if lora is not None and lora.enabled else None
    # what ``at_depth`` rebuilds the learner from (the memory plan's compiled steps; no warm start there)
    self._kwargs = dict(lcfg=lcfg, recipe=recipe, gc=gc, oc=oc, mesh=mesh, total_steps=total_steps,
                        temperature=temperature, kv_state=kv_state, kv_margin=kv_margin, lora=self.lora)
    self.policy = Policy(cfg, lcfg, recipe, temperature, self.lora)
    self.kv_margin = float(kv_margin)
    # (LoRA: every adapter is trainable, so no decay mask)
    self.tx, self.lr_schedule = make_optimizer(oc, total_steps, None if self.lora else schema.decay_mask(cfg))
    self._rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # The frozen KL reference is scored by the trainer, so it takes the trainer's form of the weights.
    self._freeze = functools.partial(sampler_lib.refit, recipe=recipe)
    self._state_sh = self.state_shardings(self.tx, kv=kv_state, ref=bool(gc.kl_beta))
    self.train_step = fp8jax.jit(functools.partial(
        train_step, loss=LOSSES[gc.loss], policy=self.policy, tx=self.tx, gc=gc, microbatch=gc.microbatch,
        kv_margin=self.kv_margin), donate_argnums=(0,), out_shardings=(self._state_sh, self._rep))
    ws_steps, ws_batch, ws_lr = warmstart
    self.sft_tx = self.sft_step = None
    if ws_steps:
      # Plain Adam (optax.adam's b2 0.999, no decay, clip 1.0) at warmstart.lr, through the one optimizer builder;
      # the warm start's log-probs are those of temperature 1.
      self.sft_tx = make_optimizer(OptimConfig(lr=float(ws_lr), b2=0.999, weight_decay=0.0, grad_clip=1.0),
                                   int(ws_steps))[0]
      self._sft_state_sh = self.state_shardings(self.sft_tx, kv=False, ref=False, lora=False)
      self.sft_step = fp8jax.jit(functools.partial(
          train_step, loss=LOSSES["sft"], policy=dataclasses.replace(self.policy, temperature=1.0),
          tx=self.sft_tx, gc=gc, microbatch=int(ws_batch)), donate_argnums=(0,),
          out_shardings=(self._sft_state_sh, self._rep))
    self.logprobs = fp8jax.jit(self.policy.logprobs)

  def at_depth(self, n_layers: int) -> "Learner":
    """This learner for the same model ``n_layers`` deep (``fp8jax.rl.memory``'s per-layer compiled temporaries)."""
    return Learner(cfg=dataclasses.replace(self.cfg, n_layers=n_layers), **self._kwargs)

  @property
  def fp8_kv(self) -> bool:
    """Whether the trainer quantizes K/V as the rollout's FP8 cache did (its batches then carry the rollout's
    ``kv_scales``). Not in "fp8_rollout": there the BF16 trainer attends over unquantized K/V, as a two-engine setup
    does, while the sampler's cache is FP8."""
    return self.policy.recipe.kv_cache == "fp8"

  # -- shapes and shardings -----------------------------------------------------------------------------------------

  def param_shapes(self):
    """FP32 master params as ShapeDtypeStructs."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), llama.param_shapes(self.cfg),
                        is_leaf=lambda x: isinstance(x, tuple))

  def trained_shapes(self, lora: bool | None = None):
    """The trained params (``TrainState.params``) as FP32 ShapeDtypeStructs: the master params, or (LoRA) the
    adapters. ``lora``: None (this learner's kind) or False (full params: the warm start)."""
    if self.lora is not None and lora is not False:
      return lora_lib.adapter_shapes(self.cfg, self.lora)
    return self.param_shapes()

  def _ref_shapes(self):
    """The frozen reference's shapes (``_freeze`` of the master params; jax.eval_shape traces the unjitted one)."""
    return jax.eval_shape(functools.partial(sampler_lib.prepare_params, recipe=self.policy.recipe),
                          self.param_shapes())

  def abstract_state(self, *, kv: bool, ref: bool) -> TrainState:
    """ShapeDtypeStructs with shardings of a TrainState (with or without KV scales / reference): restore targets."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    ref = ref and self.lora is None  # (LoRA: the reference is the base, no frozen copy)
    shapes = self.trained_shapes()
    layers = jax.ShapeDtypeStruct((self.cfg.n_layers,), jnp.float32)
    state = TrainState(shapes, jax.eval_shape(self.tx.init, shapes), scalar, (layers, layers) if kv else None,
                       self._ref_shapes() if ref else None, scalar, self._ref_shapes() if self.lora else None)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                        self.state_shardings(self.tx, kv=kv, ref=ref))

  def state_shardings(self, tx, *, kv: bool, ref: bool, lora: bool | None = None) -> TrainState:
    """Shardings of a whole TrainState under ``tx``, from shapes alone.

    The state goes in and out of the train step with exactly these shardings (initial state placed with them, the
    step's outputs pinned to them), so the second step does not recompile: left to itself, XLA picks output
    shardings that differ from the inputs' (seen: row-parallel weights' moments, unplaced scalars), and a changed
    input sharding is a new program — a second full compile of the 8B train step. Scalars and KV scales replicated.
    LoRA (``lora`` None: this learner's kind): the adapters (replicated: no sharding rule names them) and the base.
    """
    shapes = self.trained_shapes(lora)
    base = self.lora is not None and lora is not False
    ref = ref and not base  # (LoRA: the reference is the base, no frozen copy)
    rep = self._rep
    # optim.offload: the master and the optimizer state in host memory between steps (fp8jax.optim)
    kind = (lambda t: jax.tree.map(lambda s: s.with_memory_kind(self.oc.offload), t)) \
        if self.oc.offload != "none" else (lambda t: t)
    return TrainState(kind(sharding.tree_shardings(shapes, self.mesh)),
                      kind(sharding.tree_shardings(jax.eval_shape(tx.init, shapes), self.mesh)), rep,
                      (rep, rep) if kv else None,
                      sharding.tree_shardings(self._ref_shapes(), self.mesh) if ref else None, rep,
                      sharding.tree_shardings(self._ref_shapes(), self.mesh) if base else None)

  # -- states -------------------------------------------------------------------------------------------------------

  def init_state(self, params, tx=None) -> TrainState:
    """A state at ``params`` with a fresh ``tx`` optimizer (the RL one by default): step 0, prompt batch 0, RL not
    started (no KV scales, no reference). ``params`` host or device arrays, placed per the sharding rules; device
    arrays already placed so become the state's own buffers (no copy), which the first step donates."""
    tx = tx or self.tx
    params = jax.device_put(params, sharding.tree_shardings(params, self.mesh))
    lora = self.lora is not None and tx is self.tx
    sh = self.state_shardings(tx, kv=False, ref=False, lora=lora)
    step, prompt_batch = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)  # two buffers: both are donated
    base = None
    if lora:
      # LoRA: the base quantized once into the recipe's form (what the sampler runs too) and the full-precision
      # params dropped (the caller's reference is the last); fresh adapters with b = 0 (the model is the base).
      base, params = self._freeze(params), lora_lib.init_adapters(self.cfg, self.lora)
    return jax.device_put(TrainState(params, tx.init(params), step, None, None, prompt_batch, base), sh)

  def weights(self, state: TrainState):
    """The model's weights of ``state`` (in device memory): its params, or (LoRA) the base with the adapters attached
    (the refit's, the mismatch pass's and ``Policy.weights``'s form)."""
    return self.policy.weights(self.device_params(state), state.base)

  def device_params(self, state: TrainState):
    """The master params in device memory: ``state.params`` itself, or with optim.offload a device copy, which the
    caller drops after use (the refit, the log-prob passes, the reference freeze)."""
    if self.oc.offload == "none":
      return state.params
    return jax.device_put(state.params, sharding.tree_shardings(state.params, self.mesh))

  def replicated(self, x):
    """``x`` on every device of the mesh (scalars and KV scales: the sharding the steps pin them to)."""
    return jax.device_put(x, self._rep)

  def with_kv_scales(self, state: TrainState, scales) -> TrainState:
    return dataclasses.replace(state, kv_scales=tuple(self.replicated(jnp.asarray(s, jnp.float32)) for s in scales))

  def reference(self, state: TrainState):
    """The KL reference's weights: the frozen copy (``with_reference``), or (LoRA) the base itself."""
    return state.base if self.lora is not None else state.ref_params

  def with_reference(self, state: TrainState) -> TrainState:
    """Freezes the current policy as the KL reference (the trainer's form of its weights, the mesh's shardings).
    LoRA: nothing to freeze, the reference is the base (adapters off: ``reference``)."""
    if self.lora is not None:
      return state
    ref = self._freeze(self.device_params(state))
    return dataclasses.replace(state, ref_params=jax.device_put(ref, sharding.tree_shardings(ref, self.mesh)))

  # -- steps --------------------------------------------------------------------------------------------------------

  def warm_start(self, params, batches) -> tuple[Any, dict]:
    """Supervised steps (``sft_step``) over ``batches`` (dicts of tokens and mask) from ``params`` with the warm
    start's own optimizer -> (params, metrics of the last step, on the device)."""
    if self.sft_step is None:
      raise ValueError("warmstart.steps=0: this learner has no warm-start step")
    state = self.init_state(params, self.sft_tx)
    m = {}
    for batch in batches:
      state, m = self.sft_step(state, sharding.shard_batch(batch, self.mesh))
    return state.params, m

  def prepare(self, state: TrainState, batch: dict) -> tuple[dict, dict]:
    """The trainer's passes over a rollout batch before its optimizer steps (device work; nothing is fetched).

    Trainer log-probs of the first ``grpo.mismatch_sample`` sequences (all of them with ``recompute_old_logp``)
    against the sampler's: the mismatch metrics. With ``recompute_old_logp`` they replace the old log-probs, and
    ``is_kind``'s importance weights (``grpo.IS_WEIGHTS``) of trainer over sampler are added. With ``kl_beta`` the
    frozen reference's log-probs. ``batch["kv_scales"]``: the rollout cache's FP8 KV scales when the trainer
    quantizes K/V as it did. Returns the batch for ``update`` and the passes' metrics.
    """
    gc, kv = self.gc, batch.get("kv_scales")
    batch, metrics = dict(batch), {}
    tokens = jnp.asarray(batch["tokens"])
    n_check = gc.batch if gc.recompute_old_logp else min(gc.mismatch_sample, gc.batch)
    if n_check:
      tr_lp = self.batch_logprobs(self.weights(state), tokens[:n_check], kv)
      metrics.update(grpo.mismatch_metrics(jnp.asarray(batch["old_logp"][:n_check]), tr_lp,
                                           jnp.asarray(batch["mask"][:n_check])))
      if gc.recompute_old_logp:
        gen_lp, batch["old_logp"] = batch["old_logp"], tr_lp
        if gc.is_kind != "none":
          w, wm = grpo.importance_weights(tr_lp, jnp.asarray(gen_lp), jnp.asarray(batch["mask"]), kind=gc.is_kind,
                                          lo=gc.is_lo, hi=gc.is_hi)
          batch["is_weights"] = w
          metrics.update({f"is_{k}": v for k, v in wm.items()})
    if gc.kl_beta:  # the reference forward runs only with a KL penalty
      batch["ref_logp"] = self.batch_logprobs(self.reference(state), tokens, kv)
    return batch, metrics

  def batch_logprobs(self, params, tokens_BxL, kv_scales=None):
    """``logprobs`` (the log-probs only) of a whole rollout batch, ``grpo.microbatch`` sequences per call: the
    forward pass at the train step's microbatch shape, whose activations the memory plan already holds room for
    (one call over the whole batch needs the activations of every sequence at once)."""
    n = tokens_BxL.shape[0]
    mb = max(1, min(int(self.gc.microbatch), n))
    parts = [self.logprobs(params, tokens_BxL[i:i + mb], kv_scales=kv_scales)[0] for i in range(0, n, mb)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  def update(self, state: TrainState, batch: dict) -> tuple[TrainState, list[dict]]:
    """The optimizer steps of one rollout batch: ``gc.minibatches`` consecutive slices, each one ``train_step``.
    ``batch``: host or device arrays (B, ...) plus optional ``kv_scales``. Returns the new state and each
    minibatch's metrics, left on the device (nothing here waits for the device)."""
    kv = batch.get("kv_scales")
    rows = {k: v for k, v in batch.items() if k != "kv_scales"}
    n_mb = self.gc.minibatches
    size = self.gc.batch // n_mb
    out = []
    for i in range(n_mb):
      mb = sharding.shard_batch({k: v[i * size:(i + 1) * size] for k, v in rows.items()}, self.mesh)
      if kv is not None:
        mb["kv_scales"] = kv
      state, m = self.train_step(state, mb)
      out.append(m)
    return state, out


def n_with_advantage(adv_B, mask_BxT) -> int:
  """Sequences with a nonzero advantage and at least one trained token (host arrays): the ones whose policy-gradient
  term is nonzero unless clipped, so a minibatch holding some must give a nonzero gradient (``RLTrainer``'s
  collapse check)."""
  return int(np.sum(np.any((np.asarray(adv_B)[:, None] != 0) & (np.asarray(mask_BxT) > 0), axis=-1)))
