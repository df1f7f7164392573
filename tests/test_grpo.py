"""Tests for fp8jax.rl.grpo: hand-derived cases, independent loop-based numpy references, properties, gradients."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8jax.rl import grpo

SETTINGS = settings(max_examples=25, deadline=None)


# ------------------------------------------------------------------------------------------------------------------
# Independent numpy references (explicit loops; written from the definitions, not from the jnp code)
# ------------------------------------------------------------------------------------------------------------------


def ref_group_advantages(rewards, normalize_std, leave_one_out, eps=1e-6):
  rewards = np.asarray(rewards, np.float64)
  b, g = rewards.shape
  adv = np.zeros((b, g))
  valid = np.zeros(b, bool)
  for i in range(b):
    row = list(rewards[i])
    valid[i] = len(set(row)) > 1
    if not valid[i]:
      continue
    for j in range(g):
      if leave_one_out:
        others = row[:j] + row[j + 1:]
      else:
        others = row
      base = sum(others) / len(others)
      a = row[j] - base
      if normalize_std:
        n = len(others)
        if n >= 2:
          m = sum(others) / n
          std = math.sqrt(sum((o - m) ** 2 for o in others) / (n - 1))
        else:
          std = 0.0
        if std > 0:
          a = a / (std + eps)
      adv[i, j] = a
  return adv, valid


def ref_policy_loss(logp, old, adv, mask, eps_low, eps_high, dual_clip=None, agg="token_mean", w=None, ref=None,
                    beta=0.0, global_count=None):
  logp, old, mask = (np.asarray(x, np.float64) for x in (logp, old, mask))
  adv = np.asarray(adv, np.float64)
  b, t = logp.shape
  per_tok = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      if mask[i, j] == 0:
        continue
      a = adv[i] if adv.ndim == 1 else adv[i, j]
      ratio = math.exp(logp[i, j] - old[i, j])
      clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
      loss = max(-a * ratio, -a * clipped)
      if dual_clip is not None and a < 0:
        loss = min(loss, -dual_clip * a)
      if beta != 0:
        d = ref[i, j] - logp[i, j]
        loss += beta * (math.exp(d) - d - 1)
      weight = 1.0 if w is None else w[i, j]
      per_tok[i, j] = weight * loss
  if agg == "token_mean":
    n = mask.sum() if global_count is None else global_count
    return per_tok.sum() / max(n, 1)
  total, nseq = 0.0, 0
  for i in range(b):
    n_i = mask[i].sum()
    if n_i > 0:
      total += per_tok[i].sum() / n_i
      nseq += 1
  n = nseq if global_count is None else global_count
  return total / max(n, 1)


def ref_importance_weights(train, gen, mask, kind, lo=None, hi=None):
  b, t = train.shape
  w = np.ones((b, t))
  nonfinite = 0
  for i in range(b):
    toks = [j for j in range(t) if mask[i, j] > 0]
    if kind == "seq_mask_tis":
      lrs = [float(train[i, j]) - float(gen[i, j]) for j in toks]
      if any(not math.isfinite(x) for x in lrs):
        keep = False
      else:
        geo = math.exp(sum(lrs) / len(lrs)) if lrs else 1.0
        keep = lo <= geo <= hi
    for j in toks:
      with np.errstate(all="ignore"):
        r = float(np.exp(np.float64(train[i, j]) - np.float64(gen[i, j])))
      fin = math.isfinite(r)
      if kind != "none" and not fin:
        nonfinite += 1
      if kind == "none":
        w[i, j] = 1.0
      elif not fin:
        w[i, j] = 0.0
      elif kind == "token":
        w[i, j] = r
      elif kind == "tis":
        w[i, j] = min(max(r, lo), hi)
      elif kind == "icepop":
        w[i, j] = r if lo <= r <= hi else 0.0
      elif kind == "seq_mask_tis":
        w[i, j] = r if keep else 0.0
  return w, nonfinite


def logp_arrays(b=3, t=5):
  """Hypothesis strategy: (logp, old, mask, adv) with log-probs in a range where ratios stay moderate."""
  lp = hnp.arrays(np.float32, (b, t), elements=st.floats(-4.0, -0.0625, width=32))
  delta = hnp.arrays(np.float32, (b, t), elements=st.floats(-0.625, 0.625, width=32))
  mask = hnp.arrays(np.float32, (b, t), elements=st.sampled_from([0.0, 1.0]))
  adv = hnp.arrays(np.float32, (b,), elements=st.floats(-2.0, 2.0, width=32))
  return st.tuples(lp, delta, mask, adv)


# ------------------------------------------------------------------------------------------------------------------
# group_advantages
# ------------------------------------------------------------------------------------------------------------------


class TestGroupAdvantages:

  def test_hand_leave_one_out_no_std(self):
    adv, valid = grpo.group_advantages(jnp.array([[1.0, 0.0, 0.0, 0.0]]), normalize_std=False)
    # baseline_0 = mean(0,0,0) = 0; baseline_{1..3} = mean(1,0,0) = 1/3.
    np.testing.assert_allclose(adv, [[1.0, -1 / 3, -1 / 3, -1 / 3]], rtol=1e-6)
    assert valid.tolist() == [True]

  def test_hand_leave_one_out_std_nemo_semantics(self):
    adv, _ = grpo.group_advantages(jnp.array([[1.0, 0.0, 0.0, 0.0]]), normalize_std=True)
    # Sample 0: the others [0,0,0] have std 0 -> unnormalized (NeMo). Others: std of [1,0,0] = sqrt(1/3).
    s = math.sqrt(1 / 3)
    np.testing.assert_allclose(adv, [[1.0, -1 / 3 / (s + 1e-6)] + [-1 / 3 / (s + 1e-6)] * 2], rtol=1e-5)

  def test_hand_group_mean_std(self):
    adv, _ = grpo.group_advantages(jnp.array([[1.0, 0.0, 1.0, 0.0]]), normalize_std=True, leave_one_out=False)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1,0,1,0]
    np.testing.assert_allclose(adv, [[0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 2], rtol=1e-5)

  def test_equal_rewards_zero_and_invalid(self):
    rewards = jnp.array([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    for norm in (False, True):
      for loo in (False, True):
        adv, valid = grpo.group_advantages(rewards, normalize_std=norm, leave_one_out=loo)
        assert valid.tolist() == [False, False, True]
        assert np.all(np.asarray(adv[:2]) == 0.0)

  def test_g2_leave_one_out_never_normalized(self):
    adv, _ = grpo.group_advantages(jnp.array([[1.0, 0.0]]), normalize_std=True)
    np.testing.assert_allclose(adv, [[1.0, -1.0]])

  def test_g1(self):
    adv, valid = grpo.group_advantages(jnp.array([[1.0], [0.0]]), normalize_std=True)
    assert np.all(np.asarray(adv) == 0) and not np.any(valid)

  def test_rejects_1d(self):
    with pytest.raises(ValueError, match="2-D"):
      grpo.group_advantages(jnp.ones(4), normalize_std=False)

  def test_jit(self):
    f = jax.jit(lambda r: grpo.group_advantages(r, normalize_std=True))
    adv, valid = f(jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert adv.shape == (2, 3) and valid.shape == (2,)

  @SETTINGS
  @given(r=hnp.arrays(np.float32, (3, 5), elements=st.sampled_from([0.0, 0.25, 0.5, 1.0])),
         norm=st.booleans(), loo=st.booleans())
  def test_matches_reference(self, r, norm, loo):
    adv, valid = grpo.group_advantages(jnp.asarray(r), normalize_std=norm, leave_one_out=loo)
    want_adv, want_valid = ref_group_advantages(r, norm, loo)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(valid), want_valid)

  @SETTINGS
  @given(r=hnp.arrays(np.float32, (2, 6), elements=st.floats(-3, 3, width=32)))
  def test_loo_equals_scaled_centering(self, r):
    # r_i - mean_{j!=i} r_j == G/(G-1) (r_i - mean r): the leave-one-out identity.
    adv, valid = grpo.group_advantages(jnp.asarray(r), normalize_std=False)
    want = 6 / 5 * (r - r.mean(axis=1, keepdims=True))
    want = np.where(np.asarray(valid)[:, None], want, 0.0)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-4, atol=1e-5)

  def test_dynamic_sampling_keep(self):
    keep = grpo.dynamic_sampling_keep(jnp.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))
    assert keep.tolist() == [False, True, False]

  def test_train_batch_counts_the_groups_that_teach_nothing(self):
    """rollout.train_batch's no_signal_groups_frac: the share of generated groups whose rewards all agree (their
    advantages are exactly 0), over every group generated, also those dynamic sampling dropped."""
    from fp8jax import sampler as sampler_lib  # noqa: PLC0415
    from fp8jax.rl import rollout  # noqa: PLC0415
    from fp8jax.rl.learner import GRPOConfig  # noqa: PLC0415

    def ro(n_prompts, g=2):
      r = n_prompts * g
      return sampler_lib.Rollout(
          prompt_idx=np.repeat(np.arange(n_prompts), g), prompt_tokens=np.ones((r, 3), np.int32),
          prompt_lens=np.full(r, 3), tokens=np.full((r, 2), 5, np.int32), logprobs=np.full((r, 2), -0.5, np.float32),
          lengths=np.full(r, 2), finish_reason=np.full(r, sampler_lib.FINISH_STOP), stats={})

    rewards = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], np.float32)  # agree, differ, agree
    gc = GRPOConfig(num_prompts=3, num_generations=2)
    batch, info = rollout.train_batch([(ro(3), np.ones(3, bool))], [rewards], gc, pad_id=0)
    assert info["no_signal_groups_frac"] == 2 / 3 and info["groups_kept"] == 3
    assert np.all(batch["adv"][[0, 1, 4, 5]] == 0) and np.all(batch["adv"][2:4] != 0)
    # dynamic sampling: a second batch refilled what the first dropped; the share counts both batches' groups
    second = np.array([[1.0, 0.0], [0.5, 0.5], [2.0, 0.0]], np.float32)  # differ, agree, differ
    parts = [(ro(3), np.array([False, True, False])), (ro(3), np.array([True, False, True]))]
    batch, info = rollout.train_batch(parts, [rewards, second], gc, pad_id=0)
    assert info["no_signal_groups_frac"] == 3 / 6 and info["groups_kept"] == 3
    assert np.all(batch["adv"] != 0)


class TestOverlongMask:

  def test_bool(self):
    np.testing.assert_array_equal(grpo.overlong_mask(jnp.array([True, False, False])), [0.0, 1.0, 1.0])

  def test_strings(self):
    np.testing.assert_array_equal(grpo.overlong_mask(["stop", "length", "stop"]), [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(grpo.overlong_mask(["abort", "length"], truncated_reasons=("length", "abort")),
                                  [0.0, 0.0])

  def test_rejects_ints(self):
    with pytest.raises(TypeError, match="dtype"):
      grpo.overlong_mask(jnp.array([0, 1]))


# ------------------------------------------------------------------------------------------------------------------
# policy_loss
# ------------------------------------------------------------------------------------------------------------------


class TestPolicyLoss:

  def test_hand_case(self):
    # Two tokens of one sequence, A = +1, eps = 0.2: ratios 1.5 (clipped at 1.2) and 0.5 (not clipped for A>0).
    logp = jnp.log(jnp.array([[0.75, 0.25]]))
    old = jnp.log(jnp.array([[0.5, 0.5]]))
    loss, m = grpo.policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)), eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(loss, -(1.2 + 0.5) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], 0.5)
    np.testing.assert_allclose(m["clip_frac_low"], 0.0)
    np.testing.assert_allclose(m["ratio_max"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-6)
    assert "kl" not in m

  def test_hand_negative_adv_and_dual_clip(self):
    # A = -1: ratio 0.5 -> clipped low (loss 0.8); ratio 5 -> loss 5, dual clip c=3 caps it at 3.
    logp = jnp.log(jnp.array([[0.1, 0.5]]))
    old = jnp.log(jnp.array([[0.2, 0.1]]))
    mask = jnp.ones((1, 2))
    loss, m = grpo.policy_loss(logp, old, jnp.array([-1.0]), mask, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(loss, (0.8 + 5.0) / 2, rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac_low"], 0.5)
    loss, m = grpo.policy_loss(logp, old, jnp.array([-1.0]), mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    np.testing.assert_allclose(loss, (0.8 + 3.0) / 2, rtol=1e-5)
    np.testing.assert_allclose(m["dual_clip_frac"], 0.5)

  def test_hand_kl(self):
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -2.0]])
    loss, m = grpo.policy_loss(logp, logp, jnp.array([0.0]), jnp.ones((1, 2)), eps_low=0.2, eps_high=0.2,
                               ref_logp_BxT=ref, kl_beta=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    np.testing.assert_allclose(m["kl"], k3 / 2, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.1 * k3 / 2, rtol=1e-6)

  def test_beta_zero_accepts_none_and_nonzero_requires_ref(self):
    x = jnp.zeros((2, 3))
    loss, m = grpo.policy_loss(x, x, jnp.ones(2), jnp.ones((2, 3)), eps_low=0.2, eps_high=0.2, ref_logp_BxT=None,
                               kl_beta=0.0)
    assert np.isfinite(loss) and "kl" not in m
    with pytest.raises(ValueError, match="ref_logp_BxT"):
      grpo.policy_loss(x, x, jnp.ones(2), jnp.ones((2, 3)), eps_low=0.2, eps_high=0.2, kl_beta=0.01)

  def test_bad_args(self):
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="agg"):
      grpo.policy_loss(x, x, jnp.ones(2), x, eps_low=0.2, eps_high=0.2, agg="mean")
    with pytest.raises(ValueError, match="dual_clip"):
      grpo.policy_loss(x, x, jnp.ones(2), x, eps_low=0.2, eps_high=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="adv_B"):
      grpo.policy_loss(x, x, jnp.ones(3), x, eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="shape mismatch"):
      grpo.policy_loss(x, jnp.zeros((2, 4)), jnp.ones(2), x, eps_low=0.2, eps_high=0.2)

  @SETTINGS
  @given(data=logp_arrays(), agg=st.sampled_from(grpo.AGG_KINDS), dual=st.sampled_from([None, 1.5, 3.0]),
         beta=st.sampled_from([0.0, 0.05]), use_w=st.booleans())
  def test_matches_reference(self, data, agg, dual, beta, use_w):
    lp, delta, mask, adv = data
    old = lp - delta
    ref = lp + delta[::-1]
    w = np.linspace(0.5, 1.5, lp.size, dtype=np.float32).reshape(lp.shape) if use_w else None
    loss, _ = grpo.policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps_low=0.2,
                               eps_high=0.28, dual_clip=dual, agg=agg,
                               is_weights_BxT=None if w is None else jnp.asarray(w),
                               ref_logp_BxT=jnp.asarray(ref), kl_beta=beta)
    want = ref_policy_loss(lp, old, adv, mask, 0.2, 0.28, dual, agg, w, ref, beta)
    np.testing.assert_allclose(float(loss), want, rtol=2e-4, atol=1e-5)

  @SETTINGS
  @given(data=logp_arrays())
  def test_on_policy_equals_minus_weighted_adv(self, data):
    # ratio == 1 -> no clipping: token mean is -sum_b adv_b n_b / N, seq mean is -mean over non-empty seqs.
    lp, _, mask, adv = data
    x = jnp.asarray(lp)
    n_b = mask.sum(axis=1)
    loss, m = grpo.policy_loss(x, x, jnp.asarray(adv), jnp.asarray(mask), eps_low=0.2, eps_high=0.2)
    want = -(adv * n_b).sum() / max(n_b.sum(), 1)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    assert float(m["clip_frac_low"]) == 0 and float(m["clip_frac_high"]) == 0
    loss, _ = grpo.policy_loss(x, x, jnp.asarray(adv), jnp.asarray(mask), eps_low=0.2, eps_high=0.2, agg="seq_mean")
    nonempty = n_b > 0
    want = -adv[nonempty].mean() if nonempty.any() else 0.0
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)

  @SETTINGS
  @given(data=logp_arrays(b=4, t=6), agg=st.sampled_from(grpo.AGG_KINDS))
  def test_microbatch_sum_equals_full_batch(self, data, agg):
    lp, delta, mask, adv = data
    old = lp - delta
    kw = dict(eps_low=0.2, eps_high=0.28, agg=agg)
    full, _ = grpo.policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), **kw)
    gkey = "global_token_count" if agg == "token_mean" else "global_seq_count"
    gcount = mask.sum() if agg == "token_mean" else (mask.sum(axis=1) > 0).sum()
    parts = 0.0
    for s in (slice(0, 1), slice(1, 4)):
      part, _ = grpo.policy_loss(jnp.asarray(lp[s]), jnp.asarray(old[s]), jnp.asarray(adv[s]), jnp.asarray(mask[s]),
                                 **kw, **{gkey: gcount})
      parts += float(part)
    np.testing.assert_allclose(parts, float(full), rtol=1e-5, atol=1e-6)

  def test_clipped_tokens_have_zero_gradient(self):
    # Token 0: A>0, ratio 1.5 > 1.2 -> clipped. Token 1: A>0, ratio 1.1 -> live. Token 2: A<0 ratio 0.5 -> clipped.
    # Token 3: A<0, ratio 5 > c=3 -> dual-clipped. Token 4: A<0, ratio 1.1 -> live.
    old = jnp.log(jnp.array([[0.2, 0.2, 0.2, 0.1, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    logp = jnp.log(jnp.array([[0.3, 0.22, 0.1, 0.5, 0.22], [0.1, 0.1, 0.1, 0.1, 0.1]]))
    adv_BxT = jnp.array([[1.0, 1.0, -1.0, -1.0, -1.0], [1.0] * 5])
    mask = jnp.array([[1.0] * 5, [0.0] * 5])

    def f(lp):
      return grpo.policy_loss(lp, old, adv_BxT, mask, eps_low=0.2, eps_high=0.2, dual_clip=3.0)[0]

    g = np.asarray(jax.grad(f)(logp))
    assert g[0, 0] == 0 and g[0, 2] == 0 and g[0, 3] == 0
    assert g[0, 1] != 0 and g[0, 4] != 0
    assert np.all(g[1] == 0)  # masked out
    # Live tokens: d/dlogp of -A * exp(logp - old) / N = -A * ratio / N.
    np.testing.assert_allclose(g[0, 1], -1.1 / 5, rtol=1e-5)
    np.testing.assert_allclose(g[0, 4], 1.1 / 5, rtol=1e-5)

  def test_garbage_in_padding_gives_finite_loss_and_grad(self):
    logp = jnp.array([[-1.0, jnp.nan, 50.0]])
    old = jnp.array([[-1.0, -jnp.inf, -1e9]])
    mask = jnp.array([[1.0, 0.0, 0.0]])
    ref = jnp.array([[-1.0, jnp.inf, jnp.nan]])

    def f(lp):
      return grpo.policy_loss(lp, old, jnp.array([1.0]), mask, eps_low=0.2, eps_high=0.2, ref_logp_BxT=ref,
                              kl_beta=0.1)[0]

    loss, g = jax.value_and_grad(f)(logp)
    assert np.isfinite(loss) and np.all(np.isfinite(np.asarray(g)))

  def test_old_and_ref_get_no_gradient(self):
    lp = jnp.array([[-1.0, -2.0]])
    g_old, g_ref = jax.grad(
        lambda o, r: grpo.policy_loss(lp, o, jnp.array([1.0]), jnp.ones((1, 2)), eps_low=0.2, eps_high=0.2,
                                      ref_logp_BxT=r, kl_beta=0.1)[0], argnums=(0, 1))(lp - 0.1, lp + 0.2)
    assert np.all(np.asarray(g_old) == 0) and np.all(np.asarray(g_ref) == 0)

  def test_kl_gradient_matches_k3_derivative(self):
    # d/dl [exp(r - l) - (r - l) - 1] = 1 - exp(r - l).
    lp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    g = jax.grad(lambda x: grpo.policy_loss(x, x, jnp.array([0.0]), jnp.ones((1, 2)), eps_low=0.2, eps_high=0.2,
                                            ref_logp_BxT=ref, kl_beta=1.0)[0])(lp)
    want = (1 - np.exp(np.asarray(ref - lp))) / 2
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)

  def test_entropy_and_jit(self):
    f = jax.jit(lambda lp, e: grpo.policy_loss(lp, lp, jnp.ones(2), jnp.ones((2, 3)), eps_low=0.2, eps_high=0.2,
                                               entropy_BxT=e, agg="seq_mean"))
    _, m = f(jnp.full((2, 3), -0.5), jnp.full((2, 3), 0.7))
    np.testing.assert_allclose(m["entropy"], 0.7, rtol=1e-6)
    np.testing.assert_allclose(m["neg_logp"], 0.5, rtol=1e-6)
    assert int(m["num_tokens"]) == 6 and int(m["num_seqs"]) == 2

  @SETTINGS
  @given(l=st.floats(-20, 0), r=st.floats(-20, 0))
  def test_k3_nonnegative(self, l, r):
    assert float(grpo.k3_kl(jnp.float32(l), jnp.float32(r))) >= 0.0

  def test_k3_accurate_for_nearly_equal_policies(self):
    """k3 ~ d^2 / 2 for small log-ratios d: FP32 ``exp(d) - d - 1`` was off by 10x at d = 1e-4 (its exp rounding,
    6e-8, against 5e-9) and negative at hypothesis's d = 6e-8; the float64 expm1 is the reference."""
    for d in (1e-4, -1e-4, 1e-3, -2e-2):
      d32 = float(np.float32(d))
      want = math.expm1(d32) - d32
      got = float(grpo.k3_kl(jnp.float32(0.0), jnp.float32(d)))
      assert abs(got - want) <= 1e-2 * want, (d, got, want)
    assert float(grpo.k3_kl(jnp.float32(-5.960464477539063e-08), jnp.float32(0.0))) >= 0.0


# ------------------------------------------------------------------------------------------------------------------
# importance_weights
# ------------------------------------------------------------------------------------------------------------------


class TestImportanceWeights:

  train = np.log(np.array([[0.5, 0.2, 0.9, 0.3], [0.4, 0.4, 0.4, 0.4]], np.float32))
  gen = np.log(np.array([[0.5, 0.4, 0.3, 0.3], [0.5, 0.5, 0.5, 0.25]], np.float32))
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)

  def _w(self, kind, lo=None, hi=None):
    return grpo.importance_weights(jnp.asarray(self.train), jnp.asarray(self.gen), jnp.asarray(self.mask), kind=kind,
                                   lo=lo, hi=hi)

  def test_hand_cases(self):
    w, m = self._w("none")
    assert np.all(np.asarray(w) == 1.0)
    w, _ = self._w("token")
    np.testing.assert_allclose(w, [[1.0, 0.5, 3.0, 1.0], [0.8, 0.8, 0.8, 1.6]], rtol=1e-5)
    w, m = self._w("tis", 0.6, 2.0)
    np.testing.assert_allclose(w, [[1.0, 0.6, 2.0, 1.0], [0.8, 0.8, 0.8, 1.6]], rtol=1e-5)
    np.testing.assert_allclose(m["is_oob_frac"], 2 / 7, rtol=1e-6)
    w, _ = self._w("icepop", 0.6, 2.0)
    np.testing.assert_allclose(w, [[1.0, 0.0, 0.0, 1.0], [0.8, 0.8, 0.8, 1.6]], rtol=1e-5)
    # Geometric means: seq 0 = (1 * 0.5 * 3)^(1/3) = 1.145; seq 1 = (0.8^3 * 1.6)^(1/4) = 0.951.
    w, m = self._w("seq_mask_tis", 0.9, 1.1)
    np.testing.assert_allclose(w, [[0.0, 0.0, 0.0, 1.0], [0.8, 0.8, 0.8, 1.6]], rtol=1e-5)
    np.testing.assert_allclose(m["is_seq_dropped_frac"], 0.5)

  def test_nonfinite_zeroed_and_counted(self):
    train = jnp.array([[0.0, jnp.nan, 100.0, -1.0]])
    gen = jnp.array([[0.0, -1.0, -100.0, jnp.nan]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    for kind in ("token", "tis", "icepop", "seq_mask_tis"):
      w, m = grpo.importance_weights(train, gen, mask, kind=kind, lo=0.5, hi=2.0)
      assert np.all(np.isfinite(np.asarray(w)))
      assert int(m["nonfinite_zeroed"]) == 2, kind  # exp(200) overflows in fp32, NaN stays NaN
      assert float(w[0, 1]) == 0.0 and float(w[0, 2]) == 0.0
      assert float(w[0, 3]) == 1.0  # outside the mask: neutral

  def test_gradient_is_stopped(self):
    g = jax.grad(lambda t: jnp.sum(grpo.importance_weights(t, jnp.zeros((1, 2)), jnp.ones((1, 2)), kind="token")[0]))(
        jnp.array([[0.1, -0.2]]))
    assert np.all(np.asarray(g) == 0)

  def test_bad_args(self):
    with pytest.raises(ValueError, match="kind"):
      self._w("clip")
    with pytest.raises(ValueError, match="lo and hi"):
      self._w("tis", lo=0.5)
    with pytest.raises(ValueError, match="lo <= hi"):
      self._w("icepop", 2.0, 0.5)

  @SETTINGS
  @given(train=hnp.arrays(np.float32, (3, 4), elements=st.floats(-5, 0, width=32)),
         dgen=hnp.arrays(np.float32, (3, 4), elements=st.floats(-1.5, 1.5, width=32)),
         mask=hnp.arrays(np.float32, (3, 4), elements=st.sampled_from([0.0, 1.0])),
         kind=st.sampled_from(grpo.IS_KINDS))
  def test_matches_reference(self, train, dgen, mask, kind):
    gen = train + dgen
    w, m = grpo.importance_weights(jnp.asarray(train), jnp.asarray(gen), jnp.asarray(mask), kind=kind, lo=0.5, hi=2.0)
    want, nonfinite = ref_importance_weights(train, gen, mask, kind, 0.5, 2.0)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5, atol=1e-6)
    assert int(m["nonfinite_zeroed"]) == nonfinite

  @SETTINGS
  @given(train=hnp.arrays(np.float32, (2, 3), elements=st.floats(-5, 0, width=32)),
         gen=hnp.arrays(np.float32, (2, 3), elements=st.floats(-5, 0, width=32)))
  def test_none_is_ones(self, train, gen):
    w, _ = grpo.importance_weights(jnp.asarray(train), jnp.asarray(gen), jnp.ones((2, 3)), kind="none")
    assert np.all(np.asarray(w) == 1.0)


# ------------------------------------------------------------------------------------------------------------------
# mismatch_metrics
# ------------------------------------------------------------------------------------------------------------------


class TestMismatchMetrics:

  def test_identical_is_exactly_one_and_zero(self):
    lp = jnp.array([[-1.0, -2.5, -0.1], [-3.0, -0.2, -9.0]])
    m = grpo.mismatch_metrics(lp, lp, jnp.ones((2, 3)))
    assert float(m["token_mult_prob_error"]) == 1.0
    assert float(m["gen_kl_error"]) == 0.0
    assert float(m["max_abs_logp_diff"]) == 0.0
    assert float(m["sampling_importance_ratio"]) == 1.0

  def test_matches_reference(self):
    rng = np.random.default_rng(0)
    gen = rng.uniform(-4, 0, (3, 5)).astype(np.float32)
    train = (gen + rng.normal(0, 0.3, (3, 5))).astype(np.float32)
    mask = (rng.uniform(size=(3, 5)) > 0.3).astype(np.float32)
    m = grpo.mismatch_metrics(jnp.asarray(gen), jnp.asarray(train), jnp.asarray(mask))
    mult, kl, mx, sir, n = 0.0, 0.0, 0.0, 0.0, 0
    for i in range(3):
      for j in range(5):
        if mask[i, j]:
          d = float(train[i, j]) - float(gen[i, j])
          mult += math.exp(abs(d))
          kl += math.exp(d) - d - 1
          sir += math.exp(d)
          mx = max(mx, abs(d))
          n += 1
    np.testing.assert_allclose(m["token_mult_prob_error"], mult / n, rtol=1e-5)
    np.testing.assert_allclose(m["gen_kl_error"], kl / n, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(m["max_abs_logp_diff"], mx, rtol=1e-5)
    np.testing.assert_allclose(m["sampling_importance_ratio"], sir / n, rtol=1e-5)

  def test_padding_garbage_ignored(self):
    gen = jnp.array([[-1.0, jnp.nan]])
    train = jnp.array([[-1.0, 5.0]])
    m = grpo.mismatch_metrics(gen, train, jnp.array([[1.0, 0.0]]))
    assert float(m["token_mult_prob_error"]) == 1.0 and int(m["nonfinite_tokens"]) == 0

  @SETTINGS
  @given(gen=hnp.arrays(np.float32, (2, 4), elements=st.floats(-10, 0, width=32)),
         train=hnp.arrays(np.float32, (2, 4), elements=st.floats(-10, 0, width=32)))
  def test_k3_and_mult_error_bounds(self, gen, train):
    m = grpo.mismatch_metrics(jnp.asarray(gen), jnp.asarray(train), jnp.ones((2, 4)))
    assert float(m["gen_kl_error"]) >= 0.0
    assert float(m["token_mult_prob_error"]) >= 1.0
