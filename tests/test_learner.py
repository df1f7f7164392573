"""The learner alone (no rollouts): one train step over a fixed batch, split into microbatches in different ways."""

import fp8jax

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_fp8
from fp8jax import kvcache, ops, recipes, sharding
from fp8jax.config_utils import dataclass_from_group, parse_sets
from fp8jax.model import llama
from fp8jax.model.config import ModelConfig
from fp8jax.rl import learner as learner_lib

B, L = 16, 16


def _learner(microbatch: int):
  c = tiny_fp8.get_config()
  cfg = ModelConfig.from_config(c.model)
  recipe = recipes.Recipe.from_config(c.fp8)
  gc = dataclass_from_group(learner_lib.GRPOConfig, dict(c.grpo, num_prompts=4, num_generations=4,
                                                          microbatch=microbatch), "grpo")
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  return learner_lib.Learner(cfg=cfg, lcfg=ops.LinearConfig.from_recipe(recipe, mesh=mesh), recipe=recipe, gc=gc,
                             oc=dataclass_from_group(learner_lib.OptimConfig, c.optim, "optim"), mesh=mesh,
                             total_steps=10, temperature=1.0, kv_state=True, kv_margin=1.25)


@pytest.fixture(scope="module")
def batch_and_state():
  """A batch of 16 sequences whose first 4 have no trained token (as dynamic sampling's padding groups), and
  old log-probs below the policy's on every trained token (every PPO ratio > 1, so a wrongly counted empty
  microbatch, whose ratio_min reads 1, would show)."""
  lr = _learner(B)
  params = jax.tree.map(np.asarray, llama.init_params(lr.cfg, seed=0))  # host: each state gets its own buffers
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 60, (B, L)).astype(np.int32)
  mask = np.zeros((B, L - 1), np.float32)
  for i in range(4, B):
    start = int(rng.integers(3, 8))
    mask[i, start:start + int(rng.integers(2, L - 1 - start))] = 1
  scales = tuple(jnp.full((lr.cfg.n_layers,), 0.05, jnp.float32) for _ in range(2))
  lp = np.asarray(lr.logprobs(params, jnp.asarray(tokens), kv_scales=scales)[0])
  old = lp - rng.uniform(0.01, 0.4, lp.shape).astype(np.float32)
  adv = np.repeat(rng.normal(size=B // 4), 4).astype(np.float32)
  batch = {"tokens": tokens, "mask": mask, "old_logp": old, "adv": adv}
  return batch, params, scales


def _step(microbatch, batch_and_state):
  batch, params, scales = batch_and_state
  lr = _learner(microbatch)
  state = lr.with_kv_scales(lr.init_state(params), scales)
  new, m = lr.train_step(state, dict(sharding.shard_batch(batch, lr.mesh), kv_scales=scales))
  return new, jax.device_get(m)


def test_microbatch_metrics_are_the_minibatch_metrics(batch_and_state):
  """One train step over 16 sequences as 1 microbatch of 16 and as 4 of 4 (the first of them empty): the same update
  and the same metrics. Shares of the loss and counts add up, extremes skip the empty microbatch, means are weighted
  by tokens (grpo.py: metrics are per-call masked means with num_tokens to re-weight by). An unweighted mean over
  microbatches (the trainer before) reads pg_loss and num_tokens at a quarter and ratio_min at 1."""
  (one, m1), (four, m4) = _step(B, batch_and_state), _step(4, batch_and_state)
  batch = batch_and_state[0]
  assert m1["num_tokens"] == m4["num_tokens"] == batch["mask"].sum()
  assert m1["num_seqs"] == m4["num_seqs"] == 12
  assert float(m4["ratio_min"]) > 1 and m4["ratio_min"] == m1["ratio_min"] and m4["ratio_max"] == m1["ratio_max"]
  for k in ("loss", "pg_loss", "kl_loss", "ratio_mean", "clip_frac_high", "clip_frac_low", "neg_logp", "entropy",
            "adv_mean"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=2e-6, atol=1e-7, err_msg=k)
  assert float(m1["clip_frac_high"]) > 0 and float(m1["pg_loss"]) != 0  # not vacuous
  # The gradient itself is not split-invariant in FP8: wgrad quantizes the activations in 1x128 groups along the
  # tokens of each microbatch (measured: 1.5e-4 relative on grad_norm).
  np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-3)
  assert int(one.step) == int(four.step) == 1


def test_train_step_sets_the_next_rollouts_kv_scales(batch_and_state):
  """The state's FP8 KV scales after a step are margin * amax / 448 of the K/V its forward produced (the
  training forward's amax at the pre-step weights, with the rollout's scales applied), and the step and data
  position move as they should (the data position belongs to the loop: unchanged)."""
  batch, params, scales = batch_and_state
  new, _ = _step(4, batch_and_state)
  lr = _learner(4)
  _, _, aux = jax.jit(lambda p, t: lr.policy.logprobs(p, t, scales))(params, jnp.asarray(batch["tokens"]))
  for got, amax in zip(new.kv_scales, (aux.k_amax_L, aux.v_amax_L)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kvcache.scales_from_amax(amax, 1.25)))
  assert int(new.step) == 1 and int(new.prompt_batch) == 0 and new.ref_params is None


def test_a_loss_metric_without_a_reduction_is_refused():
  loss = learner_lib.Loss(fn=None)
  with pytest.raises(ValueError, match="'nll' is neither in the loss's sums"):
    loss.combine({"nll": jnp.zeros(2)})
  assert dataclasses.is_dataclass(learner_lib.LOSSES["grpo"]) and set(learner_lib.LOSSES) >= {"grpo", "sft"}


def test_batch_logprobs_runs_microbatches_and_gives_the_whole_batch_bits(batch_and_state):
  """The mismatch / recompute / reference passes score a rollout batch grpo.microbatch sequences per call (the
  shape the memory plan holds room for): the same log-probs, bit for bit, as one call over the whole batch, also
  where the microbatch does not divide the sequences scored (grpo.mismatch_sample of them)."""
  batch, params, scales = batch_and_state
  tokens = jnp.asarray(batch["tokens"])
  whole = np.asarray(_learner(B).logprobs(params, tokens, kv_scales=scales)[0])
  lr = _learner(4)
  calls = []
  lr.logprobs = lambda p, t, kv_scales=None, f=lr.logprobs: (calls.append(t.shape[0]), f(p, t, kv_scales))[1]
  for n, expect in ((B, [4, 4, 4, 4]), (10, [4, 4, 2])):
    calls.clear()
    np.testing.assert_array_equal(np.asarray(lr.batch_logprobs(params, tokens[:n], scales)), whole[:n])
    assert calls == expect


def test_set_flags_parse_as_python_literals_else_strings():
  """Scripts' --set KEY=VALUE flags (config_utils.parse_sets): literals become their values, anything else stays the
  string; an item without "=" is refused naming it."""
  got = parse_sets(["grpo.microbatch=1", "optim.lr=3e-5", "model.remat=False", "rollout.prompt_buckets=(512,)",
                    "fp8.gemm_backend=xla", "fp8.keep_patterns=layers/*/wv"])
  assert got == {"grpo.microbatch": 1, "optim.lr": 3e-5, "model.remat": False, "rollout.prompt_buckets": (512,),
                 "fp8.gemm_backend": "xla", "fp8.keep_patterns": "layers/*/wv"}
  assert type(got["grpo.microbatch"]) is int and type(got["model.remat"]) is bool
  with pytest.raises(ValueError, match=r"--set 'grpo.microbatch': expected KEY=VALUE"):
    parse_sets(["grpo.microbatch"])


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SMOLLM2 = os.path.join(_REPO, "configs", "smollm2_asdiv_fp8.py")
sys.path.insert(0, os.path.join(_REPO, "scripts"))  # as tests/test_hf.py does for compare_torch

import check_grad_forward  # noqa: E402


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_train_step_forward_is_the_logprob_pass_bitwise(mode):
  """The train step differentiates the log-prob function; its forward half must give the log-prob pass's bits, or a
  fresh rollout's PPO ratio is not exactly 1 (``scripts/check_grad_forward.py``). SmolLM2's shapes (width 576, not a
  power of two; the tied 49152-row head), one layer, random weights."""
  r = check_grad_forward.check_model(_SMOLLM2, mode, 1, 2, 48, {})
  assert r["layers"] == 1 and r["bitwise"] == 1.0, r


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_gpu_train_step_forward_is_the_logprob_pass_bitwise(mode):
  """On the GPU, at the trainer's sizes (8 x 640 tokens, 2 layers): XLA lays out the gradient program differently
  (the residual stream transposed for the weight gradients), which must not change the forward bits."""
  r = check_grad_forward.check_model(_SMOLLM2, mode, 2, 8, 640, {})
  assert r["bitwise"] == 1.0, r
