"""The rollout worker: the sampler, the refit of the learner's weights into the sampler's form, and the rollouts of
one RL step turned into the learner's batch.

Per RL step: ``refit`` (one jitted requantization of the master weights: ``sampler.prepare_params`` per the sampler's
recipe) -> ``collect`` (G completions per prompt, scored by the task; with dynamic sampling, groups without reward
variance dropped and further prompt batches drawn, at most ``grpo.max_refills``) -> ``train_batch`` (the first
``num_prompts`` kept groups with their advantages; masked padding groups if dynamic sampling fell short).

The sampler's log-probs are the trainer's (one engine: fp8jax/__init__, tests/test_sampler.py), so they are the
batch's old-policy log-probs. One mesh today: the refit's output keeps the master weights' shardings (XLA propagates
them through the elementwise quantizer), then takes the sampler's form (``Sampler.sampling_form``: with
data-parallel rollouts gathered whole onto every device, once per step).
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from fp8jax import lora, recipes
from fp8jax import sampler as sampler_lib
from fp8jax.rl import grpo
from fp8jax.rl.learner import GRPOConfig
from fp8jax.rl.source import PromptSource


@dataclasses.dataclass
class Collected:
  """The rollouts of one RL step: per generate call, the rollout, its kept groups and its rewards (prompts x G)."""
  parts: list[tuple[sampler_lib.Rollout, np.ndarray]]
  rewards: list[np.ndarray]
  stats: dict  # the sampler's stats summed over the calls
  batches_drawn: int  # prompt batches taken from the task (1 + refills)
  timing: dict


class RolloutWorker:
  """Generates a run's rollouts: its sampler (``fp8jax.sampler.Sampler``), sampling parameters and seeds."""

  def __init__(self, sampler: sampler_lib.Sampler, recipe: recipes.Recipe, sp: sampler_lib.SamplingParams, *,
               seed: int, rollout_seed: int = 0):
    self.sampler, self.recipe, self.sp = sampler, recipe, sp
    self.seed, self.rollout_seed = int(seed), int(rollout_seed)

  @property
  def fp8_kv(self) -> bool:
    return self.sampler.scfg.kv_cache == "fp8"

  def refit(self, params):
    """The sampler's weights from the learner's master weights (the requantization after every optimizer step).
    LoRA (``params`` the learner's base with its adapters attached: ``Learner.weights``): the adapters cast to BF16,
    the frozen base shared as it is (``lora.sampling_weights``: nothing requantized)."""
    if lora.has_adapters(params):
      return self.sampler.sampling_form(lora.sampling_weights(params))
    return self.sampler.sampling_form(sampler_lib.refit(params, recipe=self.recipe))

  def sampling_seed(self, step: int, attempt: int) -> int:
    """The sampling seed of RL step ``step``'s ``attempt``-th generate call (dynamic sampling's refills are further
    attempts): derived from the config's seeds, so a resumed run samples the same tokens with nothing stored.
    ``rollout.seed`` varies the rollouts only (the problems and the init come from ``seed``)."""
    return self.seed * 100003 + step * 17 + attempt + self.rollout_seed * 1000003

  def calibrate_kv_scales(self, sparams, prompts, margin: float):
    """FP8 KV scales from a BF16-cache prefill of ``prompts`` (before any training step has measured K/V)."""
    return self.sampler.calibrate_kv_scales(sparams, prompts, margin)

  def generate(self, sparams, prompts, *, n: int, seed: int, kv_scales=None) -> sampler_lib.Rollout:
    return self.sampler.generate(sparams, prompts, dataclasses.replace(self.sp, seed=seed), n=n, kv_scales=kv_scales)

  def greedy(self, sparams, prompts, kv_scales=None) -> sampler_lib.Rollout:
    """One greedy completion per prompt (validation), through the rollout path."""
    return self.sampler.generate(sparams, prompts, dataclasses.replace(self.sp, greedy=True), n=1,
                                 kv_scales=kv_scales)

  def collect(self, sparams, task: PromptSource, gc: GRPOConfig, *, step: int, prompt_batch: int,
              kv_scales=None) -> Collected:
    """Generates groups for RL step ``step`` from prompt batch ``prompt_batch`` on; with dynamic sampling, drops
    zero-variance groups and draws further batches (bounded by ``grpo.max_refills``)."""
    parts, rewards_list = [], []
    timing = {"rollout_s": 0.0, "reward_s": 0.0}
    stats = {}
    n_groups = attempts = 0
    for attempt in range(1 + (gc.max_refills if gc.dynamic_sampling else 0)):
      # The data position counts the batches drawn (checkpointed), so refills never skip or repeat prompts.
      prompts, answers = task.train_prompts(gc.num_prompts, step=prompt_batch + attempt)
      attempts += 1
      t = time.perf_counter()
      ro = self.generate(sparams, prompts, n=gc.num_generations, seed=self.sampling_seed(step, attempt),
                         kv_scales=kv_scales)
      timing["rollout_s"] += time.perf_counter() - t
      stats = {k: stats.get(k, 0) + v for k, v in ro.stats.items()}
      t = time.perf_counter()
      rewards = task.score(ro, [answers[i] for i in ro.prompt_idx]).reshape(gc.num_prompts, gc.num_generations)
      timing["reward_s"] += time.perf_counter() - t
      keep = np.asarray(grpo.dynamic_sampling_keep(rewards)) if gc.dynamic_sampling else np.ones(gc.num_prompts, bool)
      parts.append((ro, keep))
      rewards_list.append(rewards)
      n_groups += int(keep.sum())
      if n_groups >= gc.num_prompts:
        break
    return Collected(parts, rewards_list, stats, attempts, timing)


def train_batch(parts, rewards_list, gc: GRPOConfig, pad_id: int) -> tuple[dict, dict]:
  """The learner's batch (host arrays: tokens, mask, old_logp, adv) of the first ``num_prompts`` kept groups of
  ``parts`` ([(rollout, kept groups (P,))], ``Collected.parts``) with rewards ``rewards_list`` ([(P, G)]);
  masked-out groups pad it if dynamic sampling fell short (zero mask: no gradient, no metrics). Returns it with host
  metrics: reward metrics cover every generated group (also those dynamic sampling dropped), the rest the kept ones.
  ``no_signal_groups_frac`` is the fraction of generated groups whose rewards all agree (all right or all wrong):
  their advantages are 0, so they teach nothing. At 1.0 the policy-gradient term is exactly 0; a run whose policy gives
  each prompt one answer, however it words it, stalls so (``grpo.dynamic_sampling`` drops such groups and draws more
  prompts).
  """
  g = gc.num_generations
  groups = []  # (tokens, mask, old_logp, adv, lengths, finish) per kept group
  no_signal = []  # per generated group: its rewards all agree (advantage 0)
  for (ro, keep), rewards in zip(parts, rewards_list):
    s, m, o = ro.sequences(pad_id=pad_id)
    adv, valid = grpo.group_advantages(jnp.asarray(rewards), normalize_std=gc.normalize_std,
                                       leave_one_out=gc.leave_one_out)
    adv = np.asarray(adv, np.float32)
    no_signal.append(~np.asarray(valid))
    for pi in np.flatnonzero(keep):
      r = slice(pi * g, (pi + 1) * g)
      groups.append((s[r], m[r], o[r], adv[pi], ro.lengths[r], ro.finish_reason[r]))
  groups = groups[:gc.num_prompts]
  n_real = len(groups)
  if n_real < gc.num_prompts:
    s0, m0 = parts[0][0].sequences(pad_id=pad_id)[:2]
    pad = (np.zeros_like(s0[:g]), np.zeros_like(m0[:g]), np.zeros_like(m0[:g]), np.zeros(g, np.float32),
           np.zeros(g, np.int32), np.zeros(g, np.int32))
    groups += [pad] * (gc.num_prompts - n_real)
  tokens, mask, old, adv, lens, fin = (np.concatenate(x) for x in zip(*groups))
  if gc.overlong_filter:
    mask = mask * np.asarray(grpo.overlong_mask(fin == sampler_lib.FINISH_LENGTH))[:, None]
  rw = np.concatenate([np.ravel(r) for r in rewards_list])
  real = slice(0, n_real * g)
  info = {"reward_mean": float(rw.mean()), "reward_std": float(rw.std()), "groups_kept": float(n_real),
          "no_signal_groups_frac": float(np.concatenate(no_signal).mean())}
  if n_real:
    info.update(gen_len_mean=float(lens[real].mean()), gen_len_max=float(lens[real].max()),
                truncated_frac=float(np.mean(fin[real] == sampler_lib.FINISH_LENGTH)))
  return {"tokens": tokens, "mask": mask, "old_logp": old, "adv": adv}, info
